"""dp.py and ddp_torchrun.py, run for real through launch.sh (gloo on CPU) and read back from RESULT."""

import re
import time

import pytest
import torch
from conftest import launch, result_of, run_direct
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler

from common.data import SyntheticImages, build_datasets
from common.models import build_model

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
    assert 1.7e9 < result["t_first_step"] < time.time()  # unix time the first step ended
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


@pytest.mark.parametrize(("recipe", "devices", "arch"), [
    ("ddp_torchrun", "cpu:2", "tiny"), ("ddp_torchrun", "cpu:2", "tiny_bn"), ("dp", "cpu", "tiny")])
def test_imagefolder_eval_is_exact(imagefolder, tmp_path, recipe, devices, arch):
    # 21 validation images over 2 ranks: a padding sampler would score 22, drop_last 20. With BatchNorm,
    # each rank's running statistics drift apart after the last step: all must evaluate with rank 0's.
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


def test_two_ranks_on_half_batches_match_one_process_on_the_full_batch(tmp_path):
    common = ["--dataset", "synthetic", *TINY, "--batch-size", "32", "--max-steps", "6", "--lr", "0.05"]
    two = launch("recipes/ddp_torchrun.py", "cpu:2", *common, "--out-dir", tmp_path / "two")
    one = run_direct("ddp_torchrun", *common, "--out-dir", tmp_path / "one")  # no launcher: a world of 1
    assert result_of(two)["steps"] == result_of(one)["steps"] == 6
    assert "setup: world_size=1 backend=gloo" in one.stdout
    a = torch.load(tmp_path / "two/model.pt", weights_only=True)
    b = torch.load(tmp_path / "one/model.pt", weights_only=True)
    initial = build_model("tiny", 10).state_dict()
    for name in a:
        assert (a[name] - initial[name]).abs().max() > 1e-4 or "bias" in name  # it really trained
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-6, msg=name)


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


@pytest.mark.parametrize(("args", "message"), [
    (["--arch", "resnet19"], "error: unknown --arch 'resnet19'; did you mean resnet18"),
    (["--dataset", "imagefolder", "--data-root", "/nonexistent"],
     "error: --data-root '/nonexistent' has no train/ folder; expected ROOT/train/<class>/*.png|jpg"),
    (["--workers", "-1"], "error: --workers -1 must be >= 0"),
    (["--lr", "0"], "error: --lr"),
    (["--max-steps", "0"], "error: --max-steps 0 must be >= 1"),
])
@pytest.mark.parametrize("recipe", ["ddp_torchrun", "dp"])
def test_bad_flags_give_one_line_and_exit_2(recipe, args, message):
    proc = run_direct(recipe, *args)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines() == [proc.stderr.strip()] and message in proc.stderr, proc.stderr


def test_global_batch_must_split_evenly_across_processes(tmp_path):
    proc = launch("recipes/ddp_torchrun.py", "cpu:2", *TINY, "--batch-size", "5", "--out-dir", tmp_path)
    assert proc.returncode != 0
    assert ("error: --batch-size 5 is the GLOBAL batch and must be a multiple of the 2 processes; "
            "try --batch-size 4") in proc.stderr
    assert proc.stderr.count("error: --batch-size") == 1  # said once, by rank 0


def reference_training(epochs, steps_per_epoch, batch, lr, set_epoch):
    """What ddp_torchrun.py should compute at world size 1, written out plainly."""
    torch.manual_seed(0)
    model = build_model("tiny", 10)
    train = SyntheticImages(steps_per_epoch * batch)
    sampler = DistributedSampler(train, num_replicas=1, rank=0, shuffle=True, seed=0)
    optimizer = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9, weight_decay=5e-4)
    scheduler = torch.optim.lr_scheduler.CosineAnnealingLR(optimizer, T_max=epochs)
    for epoch in range(epochs):
        if set_epoch:
            sampler.set_epoch(epoch)
        for x, y in DataLoader(train, batch_size=batch, sampler=sampler, drop_last=True):
            loss = torch.nn.functional.cross_entropy(model(x), y)
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        scheduler.step()
    return model.state_dict()


def test_training_matches_a_plain_reference_loop_including_the_per_epoch_shuffle(tmp_path):
    # Catches a missing set_epoch (the same order every epoch), a wrong LR schedule or optimizer.
    args = ["--dataset", "synthetic", *TINY, "--epochs", "3", "--batch-size", "64", "--lr", "0.05",
            "--synthetic-train", "128", "--synthetic-val", "10", "--out-dir", tmp_path]
    proc = run_direct("ddp_torchrun", *args)
    assert result_of(proc)["steps"] == 6
    saved = torch.load(tmp_path / "model.pt", weights_only=True)
    expected = reference_training(epochs=3, steps_per_epoch=2, batch=64, lr=0.05, set_epoch=True)
    same_order_every_epoch = reference_training(epochs=3, steps_per_epoch=2, batch=64, lr=0.05, set_epoch=False)
    for name in saved:
        torch.testing.assert_close(saved[name], expected[name], rtol=0, atol=1e-6, msg=name)
    assert max((saved[n] - same_order_every_epoch[n]).abs().max() for n in saved) > 1e-4
