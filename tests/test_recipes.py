"""ddp_torchrun.py and dp.py beyond the conformance suite: unused parameters, a missing --data-root."""

import pytest
from conftest import launch, result_of, run_direct

pytestmark = pytest.mark.slow  # real multi-process jobs, each several seconds
TINY = ["--arch", "tiny", "--workers", "0"]


def test_unused_parameters_fail_clearly_then_train_with_the_flag(tmp_path):
    args = ["--dataset", "synthetic", "--arch", "tiny_unused", "--workers", "0", "--max-steps", "3",
            "--out-dir", tmp_path]
    failed = launch("recipes/ddp_torchrun.py", "cpu:2", *args)
    assert failed.returncode != 0
    assert ("error: aux_head.weight, aux_head.bias got no gradient (the forward pass skipped them), which DDP "
            "rejects by default; rerun with --find-unused-parameters") in failed.stderr
    assert "Traceback" not in failed.stderr.split("error: aux_head")[0]  # our line comes first, not torch's
    ok = launch("recipes/ddp_torchrun.py", "cpu:2", *args, "--find-unused-parameters")
    assert result_of(ok)["steps"] == 3


@pytest.mark.parametrize("recipe", ["ddp_torchrun", "dp"])
def test_a_missing_data_root_gives_one_line_and_exit_2(recipe):
    # The shared flags are checked in every recipe by test_conformance.py; this one fails while building the data.
    message = "error: --data-root '/nonexistent' has no train/ folder; expected ROOT/train/<class>/*.png|jpg"
    proc = run_direct(recipe, "--dataset", "imagefolder", "--data-root", "/nonexistent")
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and message in proc.stderr, proc.stderr


def test_global_batch_must_split_evenly_across_processes(tmp_path):
    proc = launch("recipes/ddp_torchrun.py", "cpu:2", *TINY, "--batch-size", "5", "--out-dir", tmp_path)
    assert proc.returncode != 0
    assert ("error: --batch-size 5 is the GLOBAL batch and must be a multiple of the 2 processes; "
            "try --batch-size 4") in proc.stderr
    assert proc.stderr.count("error: --batch-size") == 1  # said once, by rank 0
