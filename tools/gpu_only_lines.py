"""The lines of recipes/ and common/ that no CPU test runs, each with the guard that keeps the CPU out of it.

    python tools/gpu_only_lines.py           # the whole suite under coverage, subprocesses included (~30 min)

It runs `python -m pytest` (or --pytest-args) under coverage.py, every recipe process, torchrun rank and spawned
worker included, and the warm path's forked ranks (`[run] patch = subprocess, _exit, fork`: the recipes leave
with os._exit after an error), and writes
docs/gpu_only_lines.md: each line that never ran, grouped by file, under the closest enclosing guard that only a GPU
or a real apex passes (an `if` / ternary / `while` whose condition names CUDA, NCCL, GPUs, pinned memory or apex,
or a function or class of a file named in GPU_ONLY_DEFS). A line that never ran and has no such guard is listed
apart: no GPU is needed for it, so a CPU test should run it (the tool exits 1 while there is one).
"""

import argparse
import ast
import datetime
import re
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))  # tools/ run as a script

from tools import junit  # noqa: E402

OUT = REPO / "docs" / "gpu_only_lines.md"
SUITE = "-n 2 --dist loadfile"  # README's test command's
# A condition that only a GPU (or a real apex on one) makes take the branch the CPU never takes.
# DataLoaderX makes its copy stream (and with it each batch's event) only for a CUDA device.
# --sync-bn: harness.check_flags refuses it without torch.cuda.is_available(), so `if args.sync_bn:` is a GPU guard.
GPU_CONDITION = re.compile(r"cuda|nccl|\bgpus?\b|num_gpus|ranks_per_gpu|pin_memory|impl == \"apex\"|\bapex\b|"
                           r"channels_last|\b(stream|event) is not None|\bsync_bn\b")
# Whole functions and classes that run only on a GPU, by file and name, with the reason.
GPU_ONLY_DEFS = {
    "loader.py:_to_device": "DataLoaderX's copy on its CUDA side stream: called only where there is one",
    "loader.py:_record_stream": "DataLoaderX's hand-over of a batch from its CUDA side stream: called only where there "
                                "is one",
}


def guard_of(tree, source, line, filename=""):
    """The closest enclosing node of `line` that keeps the CPU out: (its line, its text), or None. filename: the
    file's name, for GPU_ONLY_DEFS."""
    best = None
    for node in ast.walk(tree):
        if not (getattr(node, "lineno", None) and node.lineno <= line <= (node.end_lineno or node.lineno)):
            continue
        text = None
        # An if / while around the line (not its own condition), or a conditional expression on it.
        if isinstance(node, ast.IfExp) or isinstance(node, (ast.If, ast.While)) and line > node.test.end_lineno:
            condition = " ".join((ast.get_source_segment(source, node.test) or "").split())
            if GPU_CONDITION.search(condition):
                text = f"{'while' if isinstance(node, ast.While) else 'if'} {condition}"
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef)) and f"{filename}:{node.name}" in GPU_ONLY_DEFS:
            text = f"{node.name}: {GPU_ONLY_DEFS[f'{filename}:{node.name}']}"
        # The closest guard; a conditional expression only where no statement guards the line.
        rank = (not isinstance(node, ast.IfExp), node.lineno)
        if text and (best is None or rank >= best[0]):
            best = (rank, text)
    return (best[0][1], best[1]) if best else None


def classify(path, statements, missing):
    """[(first line, last line, guard line or None, guard text or None, first line's text)] for the statement lines
    in `missing` (never ran); neighbours under the same guard with no statement that ran between them are joined."""
    source = path.read_text()
    tree, lines = ast.parse(source), source.splitlines()
    ran = set(statements) - set(missing)
    out = []
    for line in sorted(missing):
        where, text = guard_of(tree, source, line, path.name) or (None, None)
        if out and out[-1][2:4] == (where, text) and not any(out[-1][1] < k < line for k in ran):
            out[-1] = (out[-1][0], line, where, text, out[-1][4])
        else:
            out.append((line, line, where, text, lines[line - 1].strip()))
    return out


# Tests that check how a process meets SIGTERM, which coverage's own SIGTERM handler (`sigterm = true` below: a stopped
# rank saves what it ran) changes. Under this tool they fail at a check after their jobs ran, so the lines they run are
# counted; without coverage they pass (the suite's runs in docs/testing.md). By test function; the reason.
FAIL_UNDER_COVERAGE = {
    "tests/test_failures.py::test_sigterm_to_the_launcher_stops_every_process":
        "a rank stopped by SIGTERM runs coverage's handler, which saves its data, instead of ending at once; its "
        "DataLoader worker, stopped meanwhile, then raises in it: a traceback the drill forbids",
    "tests/test_warm_path.py::test_a_python_jobs_spawned_workers_start_as_new_interpreters_would":
        "the real path's spawned workers start with coverage's SIGTERM handler, the warm path's forks with the default",
}


def failed_tests(path):
    """The node ids of the tests that failed or erred, from pytest's JUnit XML (none if it was not written)."""
    if not path.is_file():
        return []
    return [node for node, outcome, _ in junit.read(path)[0] if outcome in ("failed", "error")]


def verdict(code, failed):
    """(the list's line on pytest's exit, or None; whether that is an error) for pytest's exit code and the failed
    tests: only FAIL_UNDER_COVERAGE's failing is said, and is no error; any other failure may leave lines unrun that
    its test runs when it passes."""
    if code == 0:
        return None, False
    others = [t for t in failed if t.split("[")[0] not in FAIL_UNDER_COVERAGE]
    if failed and not others:
        reasons = "; ".join(f"`{t}`: {FAIL_UNDER_COVERAGE[t.split('[')[0]]}" for t in failed)
        return (f"pytest exited {code}: only tests that fail under coverage alone failed, each at a check after its "
                f"jobs ran (their lines are counted): {reasons}."), False
    named = f" ({', '.join(f'`{t}`' for t in others)})" if others else ""
    return f"**pytest exited {code}**{named}: a failed test may leave out lines it runs.", True


def measure(pytest_args, data_dir):
    """Run pytest under coverage into data_dir; the combined coverage.Coverage, pytest's exit code and the tests
    that failed."""
    import coverage

    rc = data_dir / "coveragerc"
    # sigterm: a rank the launcher stops (SIGTERM) once another has exited still saves what it ran. fork: the warm
    # path's ranks (tests/warm.py) are forked from a server that imported torch, not started as new interpreters.
    # A recipe copied with one line edited (test_recipe_variants' compile whose result is dropped, test_uneven's Join
    # taken out: each edit keeps the line count) runs the recipe's other lines: measured in the copy (`include`) and
    # credited to the recipe line for line ([paths]).
    rc.write_text("[run]\npatch = subprocess\n    _exit\n    fork\nparallel = true\nsigterm = true\n"
                  f"include =\n    */recipes/*.py\n    {REPO / 'common'}/*.py\ndata_file = {data_dir / '.coverage'}\n"
                  f"[paths]\nrecipes =\n    {REPO / 'recipes'}/\n    */recipes/\n")
    code = subprocess.call([sys.executable, "-m", "coverage", "run", f"--rcfile={rc}", "-m", "pytest", "-p",
                            "no:cacheprovider", "--junitxml", str(data_dir / "junit.xml"), *pytest_args], cwd=REPO)
    cov = coverage.Coverage(config_file=str(rc))
    cov.combine(strict=True)
    cov.save()
    cov.load()
    return cov, code, failed_tests(data_dir / "junit.xml")


def report(cov, command):
    """The markdown list, and the number of lines with no GPU guard."""
    guarded, unguarded, total = [], [], 0
    for path in sorted([*(REPO / "recipes").glob("*.py"), *(REPO / "common").glob("*.py")]):
        _, statements, _, missing, _ = cov.analysis2(str(path))
        total += len(missing)
        for first, last, where, text, code in classify(path, statements, missing):
            name = path.relative_to(REPO)
            span = f"{first}" if first == last else f"{first}-{last}"
            if where is None:
                unguarded.append(f"- `{name}:{span}` `{code}`")
            else:
                guarded.append((str(name), f"- {span}: under `{text}` (line {where}), first `{code}`"))
    lines = ["# GPU-only lines", "",
             f"{total} statement lines of `recipes/` and `common/` run in no CPU test: measured by `{command}` on "
             f"{datetime.date.today()} (coverage.py over every process the suite starts). Each is listed under the "
             "closest guard that keeps a CPU out of it; the GPU tier (`python -m pytest -m gpu`) runs them. "
             "Regenerate with `python tools/gpu_only_lines.py`.", ""]
    for name in dict.fromkeys(n for n, _ in guarded):
        entries = [e for n, e in guarded if n == name]
        lines += [f"## {name}", "", *entries, ""]
    lines += ["## Not run on the CPU, no GPU guard", "",
              *(unguarded or ["None: every line the CPU tests leave out sits behind a GPU guard."]), ""]
    return "\n".join(lines), total, len(unguarded)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--pytest-args", default=SUITE,
                   help=f"pytest's arguments (quoted); default: the whole suite, README's {SUITE!r}")
    p.add_argument("--out", type=Path, default=OUT)
    args = p.parse_args(argv)
    pytest_args = shlex.split(args.pytest_args)
    with tempfile.TemporaryDirectory(prefix="gpu_only_lines_") as tmp:
        cov, code, failed = measure(pytest_args, Path(tmp))
        command = "python -m pytest" + (f" {args.pytest_args}" if pytest_args else "")
        text, total, unguarded = report(cov, command)
    said, error = verdict(code, failed)
    if said:  # said in the list too
        text = text.replace("\n\n", f"\n\n{said}\n\n", 1)
        print(f"gpu_only_lines: {'error: ' if error else ''}{said.replace('**', '')}", file=sys.stderr)
    args.out.write_text(text)
    print(f"gpu_only_lines: {total} lines no CPU test runs, {unguarded} of them without a GPU guard; wrote {args.out}")
    return 1 if unguarded or error else 0


if __name__ == "__main__":
    sys.exit(main())
