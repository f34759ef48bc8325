"""dp.py and ddp_torchrun.py, run for real through launch.sh (gloo on CPU) and read back from RESULT."""

import re
import time

import pytest
import torch
from conftest import launch, result_of, run_direct
from torch.utils.data import DataLoader

from common.data import build_datasets
from common.models import build_model

pytestmark = pytest.mark.slow  # real multi-process jobs, each several seconds
TINY = ["--arch", "tiny", "--workers", "0"]


def load_plain(path, arch, num_classes):
    """The saved state_dict must load into an unwrapped model, strictly (no "module." prefix)."""
    state = torch.load(path, map_location="cpu", weights_only=True)
    assert not any(k.startswith("module.") for k in state)
    model = build_model(arch, num_classes)
    model.load_state_dict(state, strict=True)
    return model.eval()


@torch.no_grad()
def single_process_acc1(model, dataset):
    correct = sum((model(x).argmax(1) == y).sum().item() for x, y in DataLoader(dataset, batch_size=5))
    return 100.0 * correct / len(dataset)


@torch.no_grad()
def single_process_loss(model, dataset):
    total = sum(torch.nn.functional.cross_entropy(model(x), y, reduction="sum").item()
                for x, y in DataLoader(dataset, batch_size=5))
    return total / len(dataset)


@pytest.fixture(scope="module")
def synthetic_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("synthetic")
    args = ["--dataset", "synthetic", "--arch", "tiny", "--epochs", "1", "--batch-size", "64", "--workers", "2"]
    return {
        "ddp_torchrun": (launch("recipes/ddp_torchrun.py", "cpu:2", *args, "--out-dir", out / "ddp"), out / "ddp"),
        "dp": (launch("recipes/dp.py", "cpu", *args, "--out-dir", out / "dp"), out / "dp"),
    }


@pytest.mark.parametrize(("recipe", "world_size"), [("ddp_torchrun", 2), ("dp", 1)])
def test_one_synthetic_epoch_learns_and_saves_a_plain_state_dict(synthetic_runs, recipe, world_size):
    proc, out = synthetic_runs[recipe]
    result = result_of(proc)
    assert result["recipe"] == recipe and result["world_size"] == world_size and result["device"] == "cpu"
    assert result["steps"] == 2048 // 64
    assert result["val_samples"] == 500
    assert result["val_acc1"] > 50, result  # 10 classes: chance is 10%
    assert 0 < result["train_loss"] < 2.3 and result["images_per_sec"] > 0 and result["peak_mem_mb"] > 0
    assert len(result["peak_mem_mb_per_rank"]) == world_size and max(result["peak_mem_mb_per_rank"]) == result[
        "peak_mem_mb"]
    assert 1.7e9 < result["first_step_end_unix"] < time.time()  # unix time the first step ended
    epoch_lines = [line for line in proc.stdout.splitlines() if line.startswith("epoch=")]
    assert len(epoch_lines) == 1 and epoch_lines[0].startswith("epoch=1/1 step=32/32 train_loss=")  # rank 0 only
    assert f"val_acc1={result['val_acc1']:.2f}" in epoch_lines[0]
    model = load_plain(out / "model.pt", "tiny", 10)
    val = build_datasets("synthetic")[1]
    assert single_process_acc1(model, val) == pytest.approx(result["val_acc1"], abs=1e-3)


def test_ddp_says_how_it_split_the_batch_and_workers(synthetic_runs):
    proc, _ = synthetic_runs["ddp_torchrun"]
    assert ("setup: world_size=2 backend=gloo device=cpu global_batch=64 (32 per process x 2), "
            "workers=1 per process") in proc.stdout


@pytest.mark.parametrize(("recipe", "devices", "arch"), [("ddp_torchrun", "cpu:2", "tiny"), ("dp", "cpu", "tiny")])
def test_imagefolder_eval_is_exact(imagefolder, tmp_path, recipe, devices, arch):
    # 21 validation images over 2 ranks: a padding sampler would score 22, drop_last 20. (Exact eval with
    # BatchNorm, in every recipe, is in test_conformance.py; this is the PNG path with its transforms.)
    proc = launch(f"recipes/{recipe}.py", devices, "--dataset", "imagefolder", "--data-root", imagefolder,
                  "--image-size", "16", "--batch-size", "8", "--epochs", "2", "--arch", arch, "--workers", "0",
                  "--out-dir", tmp_path)
    result = result_of(proc)
    assert result["val_samples"] == 21 and result["steps"] == 2 * (60 // 8)
    assert "data: imagefolder train=60 val=21 classes=3" in proc.stdout
    model = load_plain(tmp_path / "model.pt", arch, 3)
    val = build_datasets("imagefolder", str(imagefolder), image_size=16)[1]
    assert single_process_acc1(model, val) == pytest.approx(result["val_acc1"], abs=1e-3)
    printed_loss = float(re.findall(r"val_loss=([\d.]+)", proc.stdout)[-1])  # 4 decimals
    assert single_process_loss(model, val) == pytest.approx(printed_loss, abs=2e-4)


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
