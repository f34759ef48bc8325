"""recipes/NAME.py imported as a module, its main() not run: what the tests (tests/conftest.py) and tools/lm_bench.py
use to call a recipe's own functions (its parse_args and check_args, the plan, the stages, the clips)."""

import importlib.util
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def load_recipe(name):
    """recipes/NAME.py as the module recipe_NAME (its main() not run)."""
    spec = importlib.util.spec_from_file_location(f"recipe_{name}", REPO / "recipes" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
