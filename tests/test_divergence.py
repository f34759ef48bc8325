"""A run that diverges stops, says so once, exits 3 (common.utils.DIVERGED) and writes nothing from its weights.

Real 2-process jobs with a learning rate no model survives (--lr 1000: the loss is NaN within a few steps;
mx_face_prefetch 1e12), on every recipe family: torchrun, the legacy launcher, mp.spawn, DataParallel, AMP bf16 and
fp16 (GradScaler: the scale collapses instead), apex_amp's torch mode with and without loss scaling, FSDP, RecordIO.
A NaN in one rank's data alone (tests/faults) must stop both ranks with the same verdict and no wait at a
collective; an earlier good checkpoint in the same --out-dir must survive bitwise. tools/mutation_check.py's
`divergence_check` edit removes the check, and these tests notice.
"""

import hashlib
import re
import time

import pytest
from conftest import REPO, launch, result_of
from jobs import error_lines, tracebacks_beyond_multiprocessing

from common.utils import DIVERGED

TINY = ["--arch", "tiny", "--workers", "0", "--image-size", "16", "--synthetic-train", "512", "--synthetic-val", "64",
        "--batch-size", "32"]
DIVERGES = ["--lr", "1000", "--epochs", "3"]

# recipe, devices, flags, what the line names (loss: the first non-finite step; scale: the fp16 loss scale)
FAMILIES = {
    "ddp_torchrun": ("ddp_torchrun", "cpu:2", [], "loss"),
    "ddp_launch": ("ddp_launch", "cpu:2", [], "loss"),
    "ddp_spawn": ("ddp_spawn", "cpu:2", [], "loss"),
    "dp": ("dp", "cpu", [], "loss"),
    "ddp_checkpoint": ("ddp_checkpoint", "cpu:2", [], "loss"),
    "apex_ddp": ("apex_ddp", "cpu:2", [], "loss"),
    # Normalised embeddings and a cosine margin bound the loss: it takes a far larger rate to break.
    "mx_face_prefetch": ("mx_face_prefetch", "cpu:2", ["--rec", "synthetic", "--lr", "1e12"], "loss"),
    "fsdp": ("fsdp", "cpu:2", [], "loss"),
    "ddp_compile": ("ddp_compile", "cpu:2", [], "loss"),
    "ddp_zero": ("ddp_zero", "cpu:2", [], "loss"),
    "ddp_comm_hooks:powersgd": ("ddp_comm_hooks", "cpu:2", ["--comm-hook", "powersgd", "--powersgd-start", "2"],
                                "loss"),
    "ddp_uneven": ("ddp_uneven", "cpu:2", ["--shard-size", "64"], "loss"),  # 4 shards each: the same 16 steps
    "gpu_decode": ("gpu_decode", "cpu:2", [], "loss"),  # synthetic images as JPEGs, decoded in the main process
    "torch_amp:bf16": ("torch_amp", "cpu:2", ["--amp-dtype", "bf16"], "loss"),
    "torch_amp:fp16": ("torch_amp", "cpu:2", ["--amp-dtype", "fp16"], "scale"),
    "apex_amp:O0": ("apex_amp", "cpu:2", ["--opt-level", "O0"], "loss"),
    "apex_amp:O1": ("apex_amp", "cpu:2", ["--opt-level", "O1"], "scale"),
}
QUICK = {"ddp_torchrun"}
LINE = re.compile(r"^error: training diverged in epoch (\d+), steps (\d+)-(\d+): (.*)\. Nothing was saved from these "
                  r"weights; (.*)\. Likely causes: a learning rate too high for this batch \(--lr\), fp16 without a "
                  r"loss scaler, or inf/NaN in the data$")


def diverged(proc):
    """The one divergence line's (epoch, first step, last step, what, kept), after checking the exit and output."""
    out = f"exit {proc.returncode}\nstdout:\n{proc.stdout[-2000:]}\nstderr:\n{proc.stderr[-3000:]}"
    assert proc.returncode == DIVERGED, out
    assert "RESULT" not in proc.stdout, out
    assert not tracebacks_beyond_multiprocessing(proc.stderr), out
    said = [line for line in error_lines(proc.stderr) if "training diverged" in line]
    assert len(said) == 1, out  # the same verdict on every rank, said once
    match = LINE.match(said[0])
    assert match, said[0]
    epoch, first, last = map(int, match.group(1, 2, 3))
    return epoch, first, last, match.group(4), match.group(5)


def files_of(folder):
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("family", [pytest.param(f, marks=() if f in QUICK else pytest.mark.slow) for f in FAMILIES])
def test_a_diverging_learning_rate_stops_the_run_within_an_epoch(family, tmp_path):
    recipe, devices, flags, kind = FAMILIES[family]
    out = tmp_path / "out"
    proc = launch(f"recipes/{recipe}.py", devices, *TINY, *DIVERGES, *flags, "--out-dir", out)
    epoch, first, last, what, kept = diverged(proc)
    steps_per_epoch = 512 // 32
    assert (first, last) == ((epoch - 1) * steps_per_epoch + 1, epoch * steps_per_epoch), (epoch, first, last)
    printed = re.findall(r"^epoch=(\d+)/", proc.stdout, re.M)
    assert printed == [str(e) for e in range(1, epoch)], proc.stdout  # stopped before the diverged epoch's line
    if kind == "loss":
        bad = int(re.fullmatch(r"the training loss stopped being finite at step (\d+)", what).group(1))
        assert first <= bad <= last and epoch == 1, what  # --lr 1000 breaks the first epoch
    else:
        assert what.startswith("the fp16 loss scale fell below 1"), what
    assert not (out / "model.pt").exists() and not (out / "best.pt").exists(), sorted(files_of(out))
    written = out / "checkpoint.pt"
    if epoch == 1:
        assert kept == "this run wrote no checkpoint", kept
    else:  # an fp16 epoch whose scale held: its checkpoint is the last good one, and the line names it
        assert kept == f"the last good checkpoint is {written}" and written.is_file(), (kept, sorted(files_of(out)))


def test_within_one_tensorboard_interval(tmp_path):
    """With --tb-dir the verdict comes at the TensorBoard steps too: within 4 steps, not at the epoch's end."""
    proc = launch("recipes/ddp_torchrun.py", "cpu:2", *TINY, *DIVERGES, "--out-dir", tmp_path / "out",
                  "--tb-dir", tmp_path / "tb", "--tb-every", "4")
    epoch, first, last, what, _ = diverged(proc)
    bad = int(re.search(r"at step (\d+)", what).group(1))
    assert last % 4 == 0 and first == last - 3 and first <= bad <= last, (first, last, bad)


def test_a_nan_batch_on_one_rank_stops_every_rank_with_one_verdict(tmp_path):
    """Rank 1's third batch is NaN. Its loss is NaN at step 3; rank 0's own loss stays finite until step 4 (the NaN
    gradients arrive through the all-reduce). The MIN all-reduce of the verdict makes both stop at the same check
    naming step 3; a rank that decided alone would leave the other waiting in a collective until --dist-timeout."""
    start = time.monotonic()
    proc = launch("recipes/ddp_torchrun.py", "cpu:2", *TINY, "--lr", "0.05", "--epochs", "2", "--dist-timeout", "60",
                  "--out-dir", tmp_path / "out",
                  env={"PYTHONPATH": str(REPO / "tests" / "faults"), "FAULT_NAN_BATCH": "1:3"})
    took = time.monotonic() - start
    assert "FAULT: training batch 3 of rank 1 is NaN" in proc.stdout, proc.stdout
    epoch, first, last, what, kept = diverged(proc)
    assert (epoch, first, last) == (1, 1, 16) and what == "the training loss stopped being finite at step 3", what
    assert took < 45, took  # no wait at a collective (the timeout is 60 s)
    assert not (tmp_path / "out" / "model.pt").exists()


@pytest.mark.slow
@pytest.mark.parametrize("recipe", ["ddp_checkpoint", "fsdp"])
def test_an_earlier_good_checkpoint_survives_bitwise(recipe, tmp_path):
    """A good run's files (latest.pt, best.pt, model.pt; fsdp: its DCP shards and latest.pt), then a diverging run
    in the same --out-dir: every earlier file is left byte for byte, and nothing is added."""
    out = tmp_path / "out"
    result_of(launch(f"recipes/{recipe}.py", "cpu:2", *TINY, "--lr", "0.05", "--epochs", "1", "--out-dir", out))
    before = files_of(out)
    assert "model.pt" in before and (("latest.pt" in before) if recipe == "ddp_checkpoint" else
                                     "checkpoint/latest.pt" in before), sorted(before)
    proc = launch(f"recipes/{recipe}.py", "cpu:2", *TINY, *DIVERGES, "--out-dir", out)
    *_, kept = diverged(proc)
    assert kept == "this run wrote no checkpoint", kept
    assert files_of(out) == before
