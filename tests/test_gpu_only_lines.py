"""tools/gpu_only_lines.py: each line no CPU test runs is filed under the guard that keeps the CPU out, or listed as
having none; the committed list (docs/gpu_only_lines.md) and docs/testing.md agree on its count."""

import re
import textwrap

from conftest import REPO

from tools.gpu_only_lines import FAIL_UNDER_COVERAGE, classify, failed_tests, verdict

SOURCE = textwrap.dedent('''\
    def train(device, gpus):
        x = 1
        if torch.cuda.is_available():
            torch.cuda.set_device(0)
            y = 2
        w = 4 if device.type == "cuda" else 5
        while gpus:
            gpus -= 1
        return x


    class ApexAmp:
        def step(self):
            return 1


    def _to_device(batch):
        return batch


    def produce(stream, num_gpus):
        if stream is not None:
            x = 2
        if num_gpus:
            x = 3
    ''')


def test_each_line_is_filed_under_its_gpu_guard_or_listed_without_one(tmp_path):
    path = tmp_path / "apex_amp.py"
    path.write_text(SOURCE)
    statements = [1, 2, 3, 4, 5, 6, 7, 8, 9, 12, 13, 14, 17, 18, 21, 22, 23, 24, 25]
    missing = [4, 5, 6, 8, 9, 14, 18, 23, 25]  # what a CPU run would leave out, and line 9 (a test gap, no guard)
    assert classify(path, statements, missing) == [
        (4, 5, 3, "if torch.cuda.is_available()", "torch.cuda.set_device(0)"),
        (6, 6, 6, 'if device.type == "cuda"', 'w = 4 if device.type == "cuda" else 5'),
        (8, 8, 7, "while gpus", "gpus -= 1"),
        (9, 9, None, None, "return x"),
        (14, 14, None, None, "return 1"),  # a class is GPU-only only if GPU_ONLY_DEFS names it
        (18, 18, None, None, "return batch"),  # loader.py's _to_device is GPU-only, not apex_amp.py's
        (23, 23, 22, "if stream is not None", "x = 2"),  # DataLoaderX makes a stream only on CUDA
        (25, 25, 24, "if num_gpus", "x = 3"),
    ]
    # Two missing lines under one guard with a line that ran between them stay apart.
    assert [c[:2] for c in classify(path, statements, [4, 8])] == [(4, 4), (8, 8)]
    # A whole function or class is GPU-only in the file named for it, not wherever its name recurs.
    elsewhere = tmp_path / "loader.py"
    elsewhere.write_text(SOURCE)
    assert classify(elsewhere, statements, [14, 18]) == [
        (14, 14, None, None, "return 1"),
        (18, 18, 17, "_to_device: DataLoaderX's copy on its CUDA side stream: called only where there is one",
         "return batch")]


def test_the_committed_list_and_readme_agree():
    listed = (REPO / "docs" / "gpu_only_lines.md").read_text()
    total = int(re.search(r"^(\d+) statement lines of `recipes/` and `common/` run in no CPU test", listed, re.M)[1])
    def spans(pattern, text):
        return sum(int(last or first) - int(first) + 1 for first, last in re.findall(pattern, text, re.M))

    guarded = spans(r"^- (\d+)(?:-(\d+))?: under", listed)
    unguarded = spans(r"^- `[^`:]+:(\d+)(?:-(\d+))?`", listed.split("## Not run on the CPU, no GPU guard")[1])
    readme = (REPO / "docs" / "testing.md").read_text()
    # Ranges count their end lines: an upper bound on the statements in them (a range may hold a blank or a comment).
    assert guarded + unguarded >= total and f"{total} lines of `recipes/` and `common/` that no CPU test runs" in readme
    assert re.search(rf"{total} lines of .*?: \d+ behind such a guard,\s+and \d+ with none", readme, re.S)


def test_pytests_exit_is_said_and_only_the_tests_coverage_breaks_are_no_error(tmp_path):
    """The failed tests come from pytest's JUnit XML; only FAIL_UNDER_COVERAGE's failing (any parameters) is no error,
    and the list says which failed and why."""
    (tmp_path / "junit.xml").write_text(
        '<testsuites><testsuite name="pytest" tests="3">'
        '<testcase classname="tests.test_failures" '
        'name="test_sigterm_to_the_launcher_stops_every_process[ddp_torchrun]">'
        '<failure message="x"/></testcase>'
        '<testcase classname="tests.test_lm" name="test_resume"><error message="y"/></testcase>'
        '<testcase classname="tests.test_lm" name="test_ok"/></testsuite></testsuites>')
    failed = failed_tests(tmp_path / "junit.xml")
    assert failed == ["tests/test_failures.py::test_sigterm_to_the_launcher_stops_every_process[ddp_torchrun]",
                      "tests/test_lm.py::test_resume"]
    assert failed_tests(tmp_path / "none.xml") == []
    assert verdict(0, []) == (None, False)
    said, error = verdict(1, failed[:1])
    assert not error and said.startswith("pytest exited 1: only tests that fail under coverage alone failed")
    assert f"`{failed[0]}`: a rank stopped by SIGTERM runs coverage's handler" in said
    assert verdict(1, failed) == ("**pytest exited 1** (`tests/test_lm.py::test_resume`): a failed test may leave out "
                                  "lines it runs.", True)
    assert verdict(2, []) == ("**pytest exited 2**: a failed test may leave out lines it runs.", True)
    for test in FAIL_UNDER_COVERAGE:  # each names a test that is there
        path, name = test.split("::")
        assert re.search(rf"^def {name}\(", (REPO / path).read_text(), re.M), test
