"""The GPU tier (tests/test_gpu.py) checked on the CPU, so that the first run on a GPU tests the GPU and not the
tier: it runs every recipe in recipes/ and every GPU-only flag; `-m gpu --collect-only` lists it anywhere and a real
`-m gpu` run without CUDA fails with one line; each flag it passes is one its recipe takes; each text, RESULT key
and checkpoint name it expects is one the code can print or write; and the weights it calls a run's starting point
are the ones the recipe starts from.

Most of this reads test_gpu.py's own source (ast), so a test added there is checked here without a word changed."""

import ast
import functools
import os
import re
import signal
import subprocess
import sys

import pytest
import test_gpu as tier
from conftest import RECIPES, REPO, launch, load_recipe, max_diff, params

# Where the texts the tier expects come from: the recipes, the code they share, the launcher's helpers, the faults
# the drills inject.
SOURCES = [*sorted((REPO / "recipes").glob("*.py")), *sorted((REPO / "common").glob("*.py")),
           *sorted((REPO / "tools").glob("*.py")), *sorted((REPO / "tests" / "faults").glob("*.py"))]
# What die() and one_line_errors() put before a message (common/utils._error_line).
ERROR_PREFIX = re.compile(r"^(\[rank \d+\] )?error: ")


@functools.cache
def tier_tree():
    return ast.parse((REPO / "tests" / "test_gpu.py").read_text())


def tier_tests():
    return [node for node in tier_tree().body if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")]


def without_cuda():
    """This environment with every GPU hidden: CUDA cannot run, on any machine."""
    return {**os.environ, "CUDA_VISIBLE_DEVICES": ""}


# ------------------------------------------------------------------------------ every recipe, every GPU-only flag


def test_the_tier_runs_every_recipe_on_one_gpu():
    assert sorted([*tier.ONE_GPU, *tier.LM_ONE_GPU]) == RECIPES


def sync_bn_recipes():
    """The recipes with a --sync-bn flag (torch's SyncBatchNorm refuses CPU tensors: GPU-only)."""
    def has_flag(path):
        return any(isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                   and node.func.attr == "add_argument" and node.args and isinstance(node.args[0], ast.Constant)
                   and node.args[0].value == "--sync-bn" for node in ast.walk(ast.parse(path.read_text())))
    return sorted(p.stem for p in (REPO / "recipes").glob("*.py") if has_flag(p))


def test_the_tier_runs_sync_bn_in_every_recipe_that_has_it():
    # torch_amp's test has the unsynced control; SYNC_BN holds the others.
    assert sorted([*tier.SYNC_BN, "torch_amp"]) == sync_bn_recipes()
    assert len(sync_bn_recipes()) >= 9  # ddp_torchrun, its launcher siblings, and 6 more today


@pytest.mark.slow  # a pytest of its own: 5-10 s
def test_collect_only_lists_the_tier_without_cuda():
    proc = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "--collect-only", "-q", "-p",
                           "no:cacheprovider"], cwd=REPO, env=without_cuda(), capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    listed = [line for line in proc.stdout.splitlines() if "::" in line]
    assert not [line for line in listed if line.startswith("tests/test_gpu_tier.py::")]  # the tier alone: -m gpu
    for recipe in tier.ONE_GPU:
        assert f"tests/test_gpu.py::test_every_recipe_learns_on_one_gpu_with_exact_eval[{recipe}]" in listed
    for recipe in tier.LM_ONE_GPU:
        assert f"tests/test_gpu.py::test_every_language_model_learns_on_one_gpu[{recipe}]" in listed
    # ... and first: a tier stopped at its time limit keeps them (tools/gpu_session.sh; lm_moe's tokens/s, issue 67).
    assert {line.split("[")[0] for line in listed[:len(tier.LM_ONE_GPU)]} == {
        "tests/test_gpu.py::test_every_language_model_learns_on_one_gpu"}, listed[:8]
    for recipe in tier.SYNC_BN:
        assert f"tests/test_gpu.py::test_sync_bn_of_each_recipe_on_two_ranks_matches_batchnorm_on_one_rank[{recipe}]" \
            in listed
    assert "the GPU tier needs CUDA" not in proc.stdout + proc.stderr
    assert re.search(rf"^{len(listed)}/\d+ tests collected \(\d+ deselected\)", proc.stdout, re.M), proc.stdout[-500:]


@pytest.mark.slow  # a pytest of its own: 5-10 s
def test_a_gpu_run_without_cuda_fails_with_one_line():
    # A real -m gpu run where CUDA cannot run must fail, not skip every test and pass (tests/conftest.py).
    import torch

    proc = subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "-p", "no:cacheprovider",
                           "tests/test_gpu.py", "-k", "dataloaderx_cuda_stream"], cwd=REPO, env=without_cuda(),
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1, proc.stdout[-2000:]
    said = [line for line in proc.stdout.splitlines() if "the GPU tier needs CUDA" in line]
    assert len(said) == 1 and f"torch {torch.__version__} is built for CUDA {torch.version.cuda}" in said[0], said
    assert not re.search(r"\d+ (passed|skipped)", proc.stdout), proc.stdout[-2000:]


# ------------------------------------------------------------------------------------------- what it launches


def parametrized(function):
    """[{argname: value}, ...]: the cases pytest makes of one of the tier's tests ([{}] when it has none)."""
    cases = [{}]
    for mark in getattr(getattr(tier, function.name), "pytestmark", []):
        if mark.name == "parametrize":
            names = [n.strip() for n in mark.args[0].split(",")] if isinstance(mark.args[0], str) else mark.args[0]
            values = [v if len(names) > 1 else (v,) for v in mark.args[1]]
            cases = [{**case, **dict(zip(names, v, strict=True))} for case in cases for v in values]
    return cases


# The calls a launch's arguments may make while this evaluates them: pure functions of the tier's constants.
SAFE_CALLS = {"cpu_hooks.steps_per_epoch", "cpu_hooks.batch_for", "str", "int", "len", "max", "sorted"}


def evaluate(node, namespace):
    """An expression of test_gpu.py, evaluated as the test would, where it calls nothing but SAFE_CALLS (so never a
    launch)."""
    if any(isinstance(n, ast.Call) and ast.unparse(n.func) not in SAFE_CALLS for n in ast.walk(node)):
        raise ValueError(f"calls something: {ast.unparse(node)}")
    return eval(compile(ast.fix_missing_locations(ast.Expression(node)), "test_gpu.py", "eval"), namespace)


def launches(function, case):
    """(argv, evaluated): each launch() and Job() of a tier test as launch.sh gets it, for one case (and each value of
    a comprehension around it). The test's own assignments come first, in order; a value computed at run time (a
    process, a data folder) stands in as "<name>". A call this cannot evaluate gives its string constants instead."""
    namespace = {**vars(tier), **case, "tmp_path": REPO / "tmp_path"}
    for node in function.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target, value = node.targets[0], node.value
            pairs = zip(target.elts, value.elts, strict=False) if isinstance(target, ast.Tuple) and \
                isinstance(value, ast.Tuple) else [(target, value)]
            for name, part in pairs:
                if isinstance(name, ast.Name):
                    try:
                        namespace[name.id] = evaluate(part, namespace)
                    except Exception:
                        namespace[name.id] = f"<{name.id}>"
    parents = {child: node for node in ast.walk(function) for child in ast.iter_child_nodes(node)}
    for node in ast.walk(function):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("launch", "Job")):
            continue
        scopes, above = [{}], parents.get(node)
        while above is not None:  # {impl: launch(..., impl, ...) for impl in ("apex", "torch")}: one per value
            for gen in getattr(above, "generators", []):
                if isinstance(gen.target, ast.Name):
                    try:
                        values = evaluate(gen.iter, namespace)
                    except Exception:
                        continue
                    scopes = [{**scope, gen.target.id: v} for scope in scopes for v in values]
            above = parents.get(above)
        for scope in scopes:
            try:
                argv = evaluate(ast.List(node.args, ast.Load()), {**namespace, **scope})
                yield [str(a) for a in argv], True
            except Exception:
                yield [n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and isinstance(n.value, str)], \
                    False


def all_launches():
    """{(test, case index): [(recipe, devices, flags)]} of every launch in the tier; each must evaluate (a launch
    whose flags come from what the test computed cannot be checked here: build them from constants)."""
    got = {}
    for function in tier_tests():
        for i, case in enumerate(parametrized(function)):
            for argv, evaluated in launches(function, case):
                assert evaluated, f"{function.name}: cannot evaluate a launch's arguments: {argv}"
                recipe = re.fullmatch(r"(?:.*/)?recipes/(\w+)\.py", argv[0])
                assert recipe, f"{function.name}: launches {argv[0]}, not a recipe"
                got.setdefault((function.name, i), []).append((recipe.group(1), argv[1], argv[2:]))
    return got


@functools.cache
def recipe_module(name):
    return load_recipe(name)


def test_every_flag_the_tier_passes_is_one_its_recipe_takes():
    # Each launch as the tier makes it, case by case: the recipe's own argparse parses its flags (names, choices,
    # types), as it will on the GPU. A typo in a flag would fail the first GPU run in seconds, as exit 2.
    runs = [run for case in all_launches().values() for run in case]
    assert len(runs) >= len(RECIPES) + len(tier.SYNC_BN)
    for recipe, devices, flags in runs:
        assert re.fullmatch(r"0|0,1|0:2", devices), (recipe, devices)  # the tier's devices: its GPUs, never cpu
        try:
            recipe_module(recipe).parse_args(flags)
        except SystemExit as exc:
            pytest.fail(f"recipes/{recipe}.py refuses the tier's flags {flags} (exit {exc.code}); see stderr")


def flags_used():
    """{recipe: [(devices, flags), ...]} over the whole tier."""
    used = {}
    for case in all_launches().values():
        for recipe, devices, flags in case:
            used.setdefault(recipe, []).append((devices, flags))
    return used


def given(flags, flag, value=None):
    return flag in flags and (value is None or flags[flags.index(flag) + 1] == value)


# The GPU-only paths beyond --sync-bn (which sync_bn_recipes() finds), each a flag that reaches a CUDA-only line:
# (recipe, flag, its value or None).
GPU_PATHS = [
    ("torch_amp", "--channels-last", None), ("torch_amp", "--amp-dtype", "fp16"),  # NHWC, CUDA's GradScaler
    ("torch_amp", "--amp-dtype", "bf16"), ("fsdp", "--amp-dtype", "bf16"),  # bf16 all-gathers on the GPU
    ("ddp_spawn", "--model-parallel", None),  # two GPUs per worker, or its refusal on one GPU
    ("apex_amp", "--impl", "apex"), ("apex_ddp", "--impl", "apex"),  # apex's CUDA code, where it is installed
    ("ddp_comm_hooks", "--comm-hook", "powersgd"),  # PowerSGD's torch.cuda.synchronize path
    # Resume on the GPU: map_location=its own device, the CUDA RNG stream restored where it is saved.
    ("ddp_checkpoint", "--resume", None), ("ddp_zero", "--resume", None), ("ddp_comm_hooks", "--resume", None),
    ("fsdp", "--resume", None), ("torch_amp", "--resume", None),
    ("ddp_uneven", "--shard-size", None),  # ranks with different batch counts: Join on the GPU
]


def test_the_tier_runs_every_gpu_only_flag():
    used = flags_used()
    missing = [recipe for recipe in sync_bn_recipes()
               if not any(given(flags, "--sync-bn") and devices != "0" for devices, flags in used.get(recipe, []))]
    assert missing == [], f"no 2-rank --sync-bn run of {missing}"
    missing = [path for path in GPU_PATHS if not any(given(flags, *path[1:]) for _, flags in used.get(path[0], []))]
    assert missing == [], missing


# ------------------------------------------------------------------------- what it expects the code to print


def renderings(node):
    """The texts a string expression can make, each a tuple of pieces: str, or None for a value (a hole)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return [(node.value,)]
    if isinstance(node, ast.JoinedStr):
        return [tuple(v.value if isinstance(v, ast.Constant) else None for v in node.values)]
    if isinstance(node, ast.IfExp):
        return renderings(node.body) + renderings(node.orelse)
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        left, right = renderings(node.left), renderings(node.right)
        if left or right:
            return [a + b for a in left or [(None,)] for b in right or [(None,)]]
    return []


@functools.cache
def templates():
    """(the constant texts the sources can print, one a line; the others, each hole a "\\0")."""
    plain, holed = set(), set()
    for path in SOURCES:
        for node in ast.walk(ast.parse(path.read_text())):
            for pieces in renderings(node):
                text = "".join("\0" if piece is None else piece for piece in pieces)
                (holed if None in pieces else plain).add(text)
    return "\n".join(sorted(plain)), sorted(holed)


def fits(text, template):
    """Whether `text` is part of what `template` prints, each hole ("\\0") filled with a value without whitespace (a
    number, a name, a path), and the template's own words at least half of the text: a line of values alone
    ("{}/{} {} {}") would take any short text."""
    n, m = len(text), len(template)

    @functools.cache
    def words(i, p):  # the most of text[i:] that template[p:] can print as its own (non-space) characters, or -1
        if i == n:
            return 0
        if p == m:
            return -1
        if template[p] == "\0":
            best, j = -1, i
            while True:  # the hole takes text[i:j]
                best = max(best, words(j, p + 1))
                if j == n or text[j].isspace():
                    return best
                j += 1
        if template[p] != text[i]:
            return -1
        rest = words(i + 1, p + 1)
        return rest + (not text[i].isspace()) if rest >= 0 else -1

    own = max((words(0, p) for p in range(m) if template[p] in ("\0", text[0])), default=-1)
    return own >= 0 and 2 * own >= len("".join(text.split()))


def printable(text):
    """Whether the sources can print `text` (less die()'s prefix, which common/utils adds to every message)."""
    text = ERROR_PREFIX.sub("", text)
    plain, holed = templates()
    return text in plain or any(fits(text, template) for template in holed)


def about_output(node, outputs):
    """Whether an expression reads a run's output: its stdout or stderr, or a name bound to lines of them."""
    source = ast.unparse(node)
    return "stdout" in source or "stderr" in source or source in outputs


def expected_texts(function):
    """(text pieces, kind) for each text a tier test looks for in a run's output: `in` / `not in` and startswith
    (pieces: the constant parts, split where the test puts its own values), job.wait_for, and re.search patterns."""
    outputs = {gen.target.id for gen in ast.walk(function) if isinstance(gen, ast.comprehension)
               and isinstance(gen.target, ast.Name) and about_output(gen.iter, ())}

    def pieces(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            return [node.value]
        if isinstance(node, ast.JoinedStr):
            return [v.value for v in node.values if isinstance(v, ast.Constant)]
        return None

    for node in ast.walk(function):
        if isinstance(node, ast.Compare) and isinstance(node.ops[0], (ast.In, ast.NotIn)) \
                and about_output(node.comparators[0], outputs) and pieces(node.left) is not None:
            yield pieces(node.left), "text"
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.args:
            if node.func.attr in ("startswith", "wait_for") and pieces(node.args[0]) is not None \
                    and (node.func.attr == "wait_for" or about_output(node.func.value, outputs)):
                yield pieces(node.args[0]), "text"
            elif node.func.attr == "search" and ast.unparse(node.func.value) == "re" and len(node.args) > 1 \
                    and about_output(node.args[1], outputs):
                pattern = node.args[0]
                values = pattern.values if isinstance(pattern, ast.JoinedStr) else [pattern]
                yield "".join(v.value if isinstance(v, ast.Constant) else r"\d+" for v in values), "regex"


def launcher_lines():
    """The launcher's line for a rank killed by SIGKILL or SIGABRT, rendered by its own code (tools/torchrun.py's
    f-string and describe()) from torch's ProcessFailure, as torchrun hands it over."""
    from torch.distributed.elastic.multiprocessing.errors import ProcessFailure

    from tools import torchrun

    tree = ast.parse((REPO / "tools" / "torchrun.py").read_text())
    line = next(node for node in ast.walk(tree) if isinstance(node, ast.JoinedStr) and isinstance(
        node.values[0], ast.Constant) and node.values[0].value.startswith("launch.sh: job failed"))
    code = compile(ast.Expression(line), "tools/torchrun.py", "eval")
    failures = [(rank, ProcessFailure(local_rank=rank, pid=4242, exitcode=-sig, error_file="/nonexistent"))
                for rank in (0, 1) for sig in (signal.SIGKILL, signal.SIGABRT)]
    return [eval(code, {"describe": torchrun.describe, "ranked": [failure]}) for failure in failures]


def regex_as_pieces(pattern):
    """A simple pattern's literal text, split where it matches a value (\\d, \\d+, [\\d.]+, \\S+), or None."""
    out, current, i = [], "", 0
    while i < len(pattern):
        hole = re.match(r"\\d\+?|\[\\d\.\]\+|\\S\+", pattern[i:])
        if hole:
            out, current, i = [*out, current], "", i + hole.end()
        elif pattern[i] == "\\" and i + 1 < len(pattern) and not pattern[i + 1].isalnum():
            current, i = current + pattern[i + 1], i + 2
        elif pattern[i] in "^$" and i in (0, len(pattern) - 1):
            i += 1
        elif pattern[i] in ".*+?()[]{}|\\":
            return None
        else:
            current, i = current + pattern[i], i + 1
    return [*out, current]


def test_every_text_the_tier_expects_is_one_the_code_can_print():
    # The setup:, amp:, compile:, resume:, comm_hook:, data: and error lines, the apex impl line, the fault's and the
    # launcher's: a typo in one would fail the first GPU run (or pass it vacuously, in a `not in`).
    texts, patterns = [], []
    for function in tier_tests():
        for found, kind in expected_texts(function):
            (texts if kind == "text" else patterns).append((function.name, found))
    assert len(texts) >= 20 and len(patterns) >= 3, (texts, patterns)
    unprintable = [(name, piece) for name, found in texts for piece in found if piece.strip() and not printable(piece)]
    assert unprintable == []
    lines = launcher_lines()
    for name, pattern in patterns:
        literal = regex_as_pieces(pattern)
        assert any(re.search(pattern, line) for line in lines) or (
            literal and all(printable(piece) for piece in literal if piece.strip())), (name, pattern)


def test_the_text_check_sees_a_typo():
    # The check above, on texts it must refuse: a word changed in a recipe's line, or a value where the line has
    # words. And on what the recipes print, values filled in.
    assert printable("setup: world_size=2 backend=gloo device=cuda")
    assert printable("error: --model-parallel needs 2 whole GPUs per worker, 1 visible")
    assert printable("comm_hook: powersgd rank=1 from step 4")  # f"comm_hook: {...}" + (f" rank=..." if ... else "")
    assert not printable("setup: world_size=2 backend=gloo devices=cuda")
    assert not printable("amp: fp16 autocast=True gradscaler=True")
    assert not printable("setup: world_size=2 x 3 backend=gloo")


# --------------------------------------------------------------------------- what it reads of the RESULT line


@functools.cache
def result_keys():
    """{recipe: the keys of its RESULT line}: what harness.gather_result_line adds, and the fields each recipe gives."""
    harness = ast.parse((REPO / "common" / "harness.py").read_text())
    gather = next(node for node in harness.body if isinstance(node, ast.FunctionDef)
                  and node.name == "gather_result_line")
    common = {kw.arg for node in ast.walk(gather) if isinstance(node, ast.Call) and ast.unparse(node.func) ==
              "result_line" for kw in node.keywords if kw.arg}
    common |= {key.value for node in ast.walk(gather) if isinstance(node, ast.Dict) for key in node.keys
               if isinstance(key, ast.Constant)}
    keys = {}
    for path in (REPO / "recipes").glob("*.py"):
        calls = [node for node in ast.walk(ast.parse(path.read_text())) if isinstance(node, ast.Call)
                 and ast.unparse(node.func) in ("harness.gather_result_line", "meter.gather_result_line")]
        assert len(calls) == 1, path
        keys[path.stem] = common | {kw.arg for kw in calls[0].keywords if kw.arg and kw.arg != "peaks"}
        if ast.unparse(calls[0].func) == "meter.gather_result_line":  # the language models' StepMeter: tokens
            keys[path.stem] |= {"tokens_per_sec"}
    return keys


def results_read(function):
    """[(key, the recipes it is read for)]: each RESULT field a tier test reads (result_of(...)["key"], and the same
    through names and dicts bound to result_of), attributed to the recipe of an enclosing `if recipe == "..."`."""
    def is_result_of(node):
        return isinstance(node, ast.Call) and ast.unparse(node.func) == "result_of"

    results, maps = set(), set()
    for node in ast.walk(function):
        if isinstance(node, ast.Assign):
            for target in node.targets:
                pairs = zip(target.elts, node.value.elts, strict=False) if isinstance(target, ast.Tuple) and \
                    isinstance(node.value, ast.Tuple) else [(target, node.value)]
                for name, value in pairs:
                    if isinstance(name, ast.Name) and is_result_of(value):
                        results.add(name.id)
                    if isinstance(name, ast.Name) and isinstance(value, ast.DictComp) and is_result_of(value.value):
                        maps.add(name.id)
        if isinstance(node, ast.For) and isinstance(node.target, ast.Name) and \
                ast.unparse(node.iter).removesuffix(".values()") in maps:
            results.add(node.target.id)

    def is_result(node):
        return (is_result_of(node) or (isinstance(node, ast.Name) and node.id in results)
                or (isinstance(node, ast.Subscript) and ast.unparse(node.value) in maps))

    read = []

    def visit(node, only):
        test = node.test if isinstance(node, ast.If) else None
        if isinstance(test, ast.Compare) and ast.unparse(test.left) == "recipe" and isinstance(test.ops[0], ast.Eq) \
                and isinstance(test.comparators[0], ast.Constant):
            for child in node.body:
                visit(child, {node.test.comparators[0].value})
            for child in node.orelse:
                visit(child, only)
            return
        if isinstance(node, ast.Subscript) and is_result(node.value) and isinstance(node.slice, ast.Constant):
            read.append((node.slice.value, only))
        for child in ast.iter_child_nodes(node):
            visit(child, only)

    visit(function, None)
    return read


def test_every_result_key_the_tier_reads_is_one_its_recipes_print():
    keys, checked = result_keys(), 0
    for function in tier_tests():
        recipes = {recipe for case in parametrized(function) for argv, evaluated in launches(function, case)
                   for recipe in re.findall(r"recipes/(\w+)\.py", argv[0] if evaluated else " ".join(argv))}
        for key, only in results_read(function):
            for recipe in only or recipes:
                assert key in keys[recipe], f"{function.name} reads RESULT[{key!r}], which {recipe} does not print"
                checked += 1
    assert checked >= 30
    assert {"compiled_graphs", "eval_graphs", "recompiles", "graph_breaks"} <= keys["ddp_compile"]
    assert "compiled_graphs" not in keys["ddp_torchrun"]  # the check can fail


def test_every_file_the_tier_reads_is_one_its_recipes_write():
    # model.pt, checkpoint.pt, latest.pt: each name a tier test opens must be one each recipe it launches writes.
    checked = set()
    for function in tier_tests():
        recipes = {recipe for case in parametrized(function) for argv, evaluated in launches(function, case)
                   for recipe in re.findall(r"recipes/(\w+)\.py", argv[0] if evaluated else " ".join(argv))}
        names = {node.value.rsplit("/", 1)[-1] for node in ast.walk(function)
                 if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.endswith(".pt")}
        for recipe in recipes:
            source = (REPO / "recipes" / f"{recipe}.py").read_text()
            if "ShardFolders(" in source:  # the sharded recipes' checkpoint/latest.pt: common/checkpoint.py names it
                source += (REPO / "common" / "checkpoint.py").read_text()
            assert all(f'"{name}"' in source for name in names), (function.name, recipe, names)
            checked |= {(recipe, name) for name in names}
    assert len(checked) >= 20 and {r for r, _ in checked} >= {"ddp_checkpoint", "fsdp", "lm_ddp"}, checked
    assert '"checkpoint.pt"' not in (REPO / "recipes" / "lm_ddp.py").read_text()  # the check can fail


# --------------------------------------------------------------------------- the weights a run starts from


@pytest.mark.slow  # two 1-process launches
def test_the_tiers_initial_weights_are_the_recipes_and_its_runs_move_them(tmp_path):
    # The tier's "it trained" check compares a torch_amp run's model.pt with tier.initial_weights("tiny"). A run with
    # a step too small to move a float32 weight (--lr 1e-30: 1e-31 per step, below any weight's last bit) saves the
    # weights it started from: exactly those, so they are the recipe's initial weights. The tier's own run (the
    # same flags, the same arithmetic, here on the CPU) moves them by more than the check's 1e-3.
    initial = tier.initial_weights("tiny")
    frozen = launch("recipes/torch_amp.py", "cpu:1", *tier.AMP_FP32, "--lr", "1e-30", "--out-dir", tmp_path / "frozen")
    trained = launch("recipes/torch_amp.py", "cpu:1", *tier.AMP_FP32, "--out-dir", tmp_path / "trained")
    for proc in (frozen, trained):
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "amp: fp32 autocast=False grad_scaler=False" in proc.stdout  # no autocast, as on the GPU
    assert max_diff(params(tmp_path / "frozen/model.pt"), initial) == 0
    moved = max_diff(params(tmp_path / "trained/model.pt"), initial)
    print(f"6 steps of torch_amp fp32 at lr 0.05 moved the weights by {moved:.2e}")
    assert moved > 1e-3
