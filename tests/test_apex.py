"""apex_ddp.py and apex_amp.py: torch mode at every opt level, the three ways apex is missing, and the apex
code path through tests/fake_apex (a TEST DOUBLE of apex's API on torch; real apex cannot be installed here)."""

import os
from collections import defaultdict

import pytest
import torch
from conftest import REPO, launch, result_of, run_direct

FAKE_APEX = str(REPO / "tests" / "fake_apex")
SMALL = ["--arch", "tiny_bn", "--workers", "0", "--batch-size", "16", "--image-size", "16",
         "--synthetic-train", "128", "--synthetic-val", "20"]


def calls_by_process(log):
    """The double's log, split per process (ranks interleave in the file)."""
    calls = defaultdict(list)
    for line in log.read_text().splitlines():
        pid, event = line.split(" ", 1)
        calls[pid].append(event)
    return list(calls.values())


# --------------------------------------------------------------------------------- torch mode

# The table in apex_amp.py's docstring: (conv weight, BatchNorm weight, optimizer state, loss scaler).
DTYPES = {"O0": (torch.float32, torch.float32, torch.float32, False),
          "O1": (torch.float32, torch.float32, torch.float32, True),
          "O2": (torch.float16, torch.float32, torch.float32, True),  # fp32 masters in the optimizer
          "O3": (torch.float16, torch.float16, torch.float16, False)}


@pytest.mark.parametrize("level", ["O0", "O1", "O2", "O3"])
def test_torch_mode_trains_with_the_dtypes_of_each_opt_level(tmp_path, level):
    proc = launch("recipes/apex_amp.py", "cpu:2", *SMALL, "--opt-level", level, "--out-dir", tmp_path)
    result = result_of(proc)
    assert (result["impl"], result["opt_level"], result["steps"], result["world_size"]) == ("torch", level, 8, 2)
    # Without apex, auto says so on the first line.
    assert proc.stdout.splitlines()[0] == (f"impl: torch {level} (apex unavailable: NVIDIA apex is not installed "
                                           "(it is not on PyPI))")
    ckpt = torch.load(tmp_path / "checkpoint.pt", weights_only=True)
    conv, bn, state, scaled = DTYPES[level]
    assert ckpt["model"]["features.0.weight"].dtype == conv and ckpt["model"]["features.1.weight"].dtype == bn
    assert {s["momentum_buffer"].dtype for s in ckpt["optimizer"]["state"].values()} == {state}
    assert ("scale" in ckpt["amp"]) == scaled
    assert 0 < result["train_loss"] < 2.4


def test_o3_keep_batchnorm_fp32(tmp_path):
    proc = launch("recipes/apex_amp.py", "cpu:2", *SMALL, "--opt-level", "O3",
                  "--keep-batchnorm-fp32", "--impl", "torch", "--out-dir", tmp_path)
    result_of(proc)
    model = torch.load(tmp_path / "checkpoint.pt", weights_only=True)["model"]
    assert model["features.0.weight"].dtype == torch.float16 and model["features.1.weight"].dtype == torch.float32


def test_torch_mode_checkpoint_restores_the_scaler(tmp_path):
    args = [*SMALL, "--opt-level", "O2", "--impl", "torch", "--epochs", "2", "--out-dir", tmp_path]
    cut = launch("recipes/apex_amp.py", "cpu:2", *args, "--max-steps", "4")  # half an epoch: no checkpoint
    assert result_of(cut)["steps"] == 4 and not (tmp_path / "checkpoint.pt").exists()
    first = launch("recipes/apex_amp.py", "cpu:2", *args, "--max-steps", "8")  # epoch 1 of 2 (8 steps each)
    assert result_of(first)["steps"] == 8
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["amp"]["_growth_tracker"] == 8
    resumed = launch("recipes/apex_amp.py", "cpu:2", *args, "--resume", tmp_path / "checkpoint.pt")
    assert result_of(resumed)["steps"] == 16 and "resumed: " in resumed.stdout
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["amp"]["_growth_tracker"] == 16


# ------------------------------------------------------------------------- apex missing, 3 ways


def fake_package(root, *subpackages):
    for sub in ("", *subpackages):
        folder = root / "apex" / sub
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "__init__.py").write_text("")
    return {"PYTHONPATH": str(root)}


@pytest.mark.parametrize("recipe", ["apex_amp", "apex_ddp"])
@pytest.mark.parametrize(("situation", "message"), [
    ("not installed", "error: NVIDIA apex is not installed (it is not on PyPI); build NVIDIA apex 25.04 from "
                      "source (README, section 'NVIDIA apex'), or use --impl torch"),
    ("pypi apex", "is the unrelated PyPI package (a Pyramid toolkit, no amp); pip uninstall apex, then build"),
    ("apex 25.07", "is too new: apex.amp and apex.parallel were removed in 25.07; pip uninstall apex, then build"),
])
def test_impl_apex_says_why_apex_is_unusable(tmp_path, recipe, situation, message, monkeypatch):
    if situation == "pypi apex":  # a throwaway package named apex, like the Pyramid one
        monkeypatch.setenv("PYTHONPATH", fake_package(tmp_path, "views")["PYTHONPATH"])
    elif situation == "apex 25.07":  # NVIDIA's layout without amp and parallel
        monkeypatch.setenv("PYTHONPATH", fake_package(tmp_path, "optimizers", "normalization")["PYTHONPATH"])
    else:
        monkeypatch.delenv("PYTHONPATH", raising=False)
    proc = run_direct(recipe, "--impl", "apex")
    assert proc.returncode == 2
    assert len(proc.stderr.strip().splitlines()) == 1 and message in proc.stderr, proc.stderr


# ------------------------------------------------------------------- the apex path, via the double


def test_apex_amp_call_order_through_the_double(tmp_path):
    log = tmp_path / "apex_calls.log"
    env = {"PYTHONPATH": FAKE_APEX, "FAKE_APEX_LOG": str(log)}
    args = [*SMALL, "--opt-level", "O2", "--impl", "apex", "--epochs", "2", "--out-dir", tmp_path / "out"]
    first = launch("recipes/apex_amp.py", "cpu:2", *args, "--max-steps", "8", env=env)  # epoch 1 of 2
    assert result_of(first)["impl"] == "apex" and first.stdout.startswith("impl: apex O2\n")
    ranks = calls_by_process(log)
    assert len(ranks) == 2
    for calls in ranks:
        assert calls[:2] == ["amp.initialize O2", "parallel.DistributedDataParallel delay_allreduce=True"]
        steps = [c for c in calls[2:] if c != "amp.state_dict"]
        # backward (whose end triggers the delayed all-reduce) runs inside amp.scale_loss, every step
        assert steps == ["amp.scale_loss enter", "parallel.allreduce", "amp.scale_loss exit"] * 8
    saving = [calls for calls in ranks if "amp.state_dict" in calls]
    assert len(saving) == 1 and saving[0][-1] == "amp.state_dict"  # rank 0 checkpoints, after the epoch
    assert torch.load(tmp_path / "out/checkpoint.pt", weights_only=True)["amp"] == {
        "loss_scaler0": {"loss_scale": 1024.0, "unskipped": 0}}

    log.unlink()
    resumed = launch("recipes/apex_amp.py", "cpu:2", *args, "--resume", tmp_path / "out/checkpoint.pt", env=env)
    assert result_of(resumed)["steps"] == 16
    for calls in calls_by_process(log):  # apex's restore order: initialize, load, then wrap
        assert calls[:3] == ["amp.initialize O2", "amp.load_state_dict",
                             "parallel.DistributedDataParallel delay_allreduce=True"]


def test_apex_ddp_through_the_double_matches_torch_ddp(tmp_path):
    log = tmp_path / "apex_calls.log"
    args = ["--arch", "tiny", "--workers", "0", "--max-steps", "4", "--batch-size", "32"]
    apex = launch("recipes/apex_ddp.py", "cpu:2", *args, "--impl", "apex", "--out-dir", tmp_path / "a",
                  env={"PYTHONPATH": FAKE_APEX, "FAKE_APEX_LOG": str(log)})
    torch_ddp = launch("recipes/apex_ddp.py", "cpu:2", *args, "--out-dir", tmp_path / "t",
                       env={"PYTHONPATH": os.environ.get("PYTHONPATH", "")})
    assert result_of(apex)["impl"] == "apex" and result_of(torch_ddp)["impl"] == "torch"
    for calls in calls_by_process(log):
        assert calls == ["parallel.DistributedDataParallel delay_allreduce=True"] + ["parallel.allreduce"] * 4
    # One delayed all-reduce or torch's bucketed ones: the same averaged gradients.
    assert result_of(apex)["train_loss"] == pytest.approx(result_of(torch_ddp)["train_loss"], abs=1e-6)
    a, b = (torch.load(tmp_path / d / "model.pt", weights_only=True) for d in ("a", "t"))
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-6)
