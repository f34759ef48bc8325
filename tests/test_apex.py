"""apex_ddp.py and apex_amp.py: torch mode at every opt level; the ways apex is unusable; the contract between
tests/fake_apex (a TEST DOUBLE of apex on torch) and the real apex 25.04 built from vendor/; and the apex code
path through the double, which stands in for apex on a GPU (FAKE_APEX_ON_CPU=1)."""

import importlib.util
import json
import os
import subprocess
import sys
from collections import defaultdict

import pytest
import torch
import warm
from conftest import REPO, as_if_saved_on_gpu, epoch_lines, launch, load_recipe, result_of, run_direct

from common import apex_compat
from common.apex_compat import ApexUnavailable, load_apex

FAKE_APEX = str(REPO / "tests" / "fake_apex")
DOUBLE = {"PYTHONPATH": FAKE_APEX, "FAKE_APEX_ON_CPU": "1"}  # the double, standing in for apex on a GPU
SMALL = ["--arch", "tiny_bn", "--workers", "0", "--batch-size", "16", "--image-size", "16",
         "--synthetic-train", "128", "--synthetic-val", "20"]
REAL_APEX = importlib.util.find_spec("apex") is not None
INSTALL_APEX = "pip install --no-build-isolation --no-deps ./vendor/apex-25.04.tar.gz (vendor/README.md)"


def calls_by_process(log):
    """The double's log, split per process (ranks interleave in the file)."""
    calls = defaultdict(list)
    for line in log.read_text().splitlines():
        pid, event = line.split(" ", 1)
        calls[pid].append(event)
    return list(calls.values())


def files(folder):
    return {p.name: p.read_bytes() for p in folder.iterdir()}


def one_error(proc):
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    return lines[0].removeprefix("error: ")


# --------------------------------------------------------------------------------- torch mode

@pytest.mark.slow
def test_o3_keep_batchnorm_fp32(tmp_path):
    proc = launch("recipes/apex_amp.py", "cpu:2", *SMALL, "--opt-level", "O3",
                  "--keep-batchnorm-fp32", "--impl", "torch", "--out-dir", tmp_path)
    result_of(proc)
    model = torch.load(tmp_path / "checkpoint.pt", weights_only=True)["model"]
    assert model["features.0.weight"].dtype == torch.float16 and model["features.1.weight"].dtype == torch.float32


@pytest.mark.parametrize("level", ["O0", "O1"])
def test_keep_batchnorm_fp32_is_refused_where_the_level_does_not_take_it(level, capsys):
    # apex raises inside amp.initialize at O1 (the double too, see the contract test); torch mode ignored it. The
    # check is in check_args, before either implementation is touched.
    recipe = load_recipe("apex_amp")
    with pytest.raises(SystemExit) as leaving:
        recipe.check_args(recipe.parse_args(["--opt-level", level, "--keep-batchnorm-fp32"]), 2)
    assert leaving.value.code == 2 and capsys.readouterr().err == (
        f"error: --keep-batchnorm-fp32 is for O2 and O3: at {level} BatchNorm already runs in fp32; drop it\n")


@pytest.mark.slow
def test_torch_mode_checkpoint_restores_the_scaler_and_refuses_another_impl(tmp_path):
    args = [*SMALL, "--opt-level", "O2", "--impl", "torch", "--epochs", "2", "--out-dir", tmp_path]
    cut = launch("recipes/apex_amp.py", "cpu:2", *args, "--max-steps", "4")  # half an epoch: no checkpoint
    assert result_of(cut)["steps"] == 4 and not (tmp_path / "checkpoint.pt").exists()
    first = launch("recipes/apex_amp.py", "cpu:2", *args, "--max-steps", "8")  # epoch 1 of 2 (8 steps each)
    assert result_of(first)["steps"] == 8
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["amp"]["_growth_tracker"] == 8
    as_if_saved_on_gpu(tmp_path / "checkpoint.pt")  # --resume loads it with map_location=this rank's device
    # A torch-mode "amp" slot (GradScaler's) into apex, whose amp.load_state_dict raises on its keys: refused first.
    before = files(tmp_path)
    other = run_direct("apex_amp", *[a if a != "torch" else "apex" for a in args],
                       "--resume", tmp_path / "checkpoint.pt", env=DOUBLE)
    assert one_error(other) == (f"{tmp_path / 'checkpoint.pt'} was written with --impl torch (this run: apex); "
                                "resume with the same flags")
    assert files(tmp_path) == before
    resumed = launch("recipes/apex_amp.py", "cpu:2", *args, "--resume", "auto")  # OUT_DIR/checkpoint.pt
    assert result_of(resumed)["steps"] == 16 and f"resumed: {tmp_path / 'checkpoint.pt'} epoch=1 " in resumed.stdout
    assert torch.load(tmp_path / "checkpoint.pt", weights_only=True)["amp"]["_growth_tracker"] == 16


# ------------------------------------------------------------------------- apex unusable, 4 ways


def fake_package(root, *subpackages):
    for sub in ("", *subpackages):
        folder = root / "apex" / sub
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "__init__.py").write_text("")
    return str(root)


BUILD = ("install NVIDIA apex 25.04 from source: pip install --no-build-isolation ./vendor/apex-25.04.tar.gz "
         "(docs/apex.md), or use --impl torch")


def test_load_apex_tells_the_four_ways_apex_is_unusable(tmp_path, monkeypatch, capfd):
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(apex_compat.importlib.util, "find_spec",
                        lambda name, *a: None if name == "apex" else real_find_spec(name, *a))
    with pytest.raises(ApexUnavailable) as why:
        load_apex(cuda=True)
    assert str(why.value) == f"NVIDIA apex is not installed (it is not on PyPI); {BUILD}"
    monkeypatch.undo()
    if not REAL_APEX:
        pytest.skip(f"the real apex is not installed here, so its 'no GPU' case is not checked; {INSTALL_APEX}")
    with pytest.raises(ApexUnavailable, match="^NVIDIA apex needs a GPU and none is visible .*; use --impl torch"):
        load_apex(cuda=False)
    capfd.readouterr()
    amp, ddp, apex = load_apex(cuda=True)  # with a GPU, the real 25.04 is usable
    assert amp.__name__ == "apex.amp" and ddp.__name__ == "DistributedDataParallel"
    # The python-only build's "installed without --cpp_ext" warning, which apex DDP would print on every rank at the
    # wrap, came out here, into nothing: the impl: line says which build runs, once.
    assert sys.modules["apex.parallel.distributed"].imported_flatten_impl and "cpp_ext" not in capfd.readouterr().out
    assert not hasattr(apex, "RUNS_ON_CPU")  # only the double may say it runs on the CPU


def test_apex_build_tells_a_python_only_build_from_a_full_one(tmp_path, monkeypatch):
    # apex's compiled extensions are top-level modules: apex_C (--cpp_ext), amp_C (--cuda_ext). Stand-ins on the path.
    assert apex_compat.apex_build().startswith("python-only (no apex_C or amp_C: ")  # vendor/'s build here
    monkeypatch.syspath_prepend(str(tmp_path))
    (tmp_path / "apex_C.py").write_text("")
    assert apex_compat.apex_build().startswith("python-only (no amp_C: a host sync per gradient tensor at O1/O2")
    (tmp_path / "amp_C.py").write_text("")
    assert apex_compat.apex_build() == "full"


@pytest.mark.parametrize(("recipe", "situation", "message"), [
    ("apex_amp", "pypi apex", f"is the unrelated PyPI package (a Pyramid toolkit, no amp); pip uninstall apex, then "
                              f"{BUILD}"),
    ("apex_amp", "apex 25.07", f"is too new: apex.amp and apex.parallel were removed in 25.07; pip uninstall apex, "
                               f"then {BUILD}"),
    # The double, like real apex, does not run on the CPU unless told to (FAKE_APEX_ON_CPU=1); both recipes ask.
    *((recipe, "no GPU", "NVIDIA apex needs a GPU and none is visible (amp.initialize refuses CPU parameters, apex DDP "
                         "uses CUDA streams); use --impl torch on the CPU") for recipe in ("apex_amp", "apex_ddp")),
])
@pytest.mark.slow
def test_impl_apex_says_why_apex_is_unusable(tmp_path, recipe, situation, message):
    path = {"pypi apex": lambda: fake_package(tmp_path, "views"),  # a throwaway apex, like the Pyramid one
            "apex 25.07": lambda: fake_package(tmp_path, "optimizers", "normalization"),  # NVIDIA's, no amp
            "no GPU": lambda: FAKE_APEX}[situation]()
    assert message in one_error(run_direct(recipe, "--impl", "apex", env={"PYTHONPATH": path}))


# ------------------------------------------------------------- the double against the real apex


def probe(env, *args):
    """tests/apex_probe.py's report in a process of its own, forked from the warm server where it can be (apex is
    not among what the server imports: each probe imports the real one or the double anew); its --ddp ranks are
    forked from the probe (tests/apex_probe.py)."""
    argv = [str(REPO / "tests" / "apex_probe.py"), *args]
    env = {**{k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "FAKE_APEX_ON_CPU")}, **env}
    job = warm.direct_job(argv, env, REPO)
    proc = job.wait(300) if job is not None else subprocess.run([sys.executable, *argv], cwd=REPO,
                                                                 capture_output=True, text=True, timeout=300, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout)


@pytest.mark.skipif(not REAL_APEX, reason=f"the real apex is not installed; {INSTALL_APEX}")
def test_the_double_behaves_like_the_real_apex_where_the_recipes_depend_on_it():
    real, double, double_on_cpu = probe({}, "--ddp"), probe({"PYTHONPATH": FAKE_APEX}, "--ddp"), probe(DOUBLE)
    # Every call the recipes make fits both; the refusals read the same; apex O2's zero_grad takes no argument
    # (bug: zero_grad(set_to_none=True) crashed the first step) and every level has _amp_lazy_init.
    assert all(real["the recipes' calls bind"].values()) and double["the recipes' calls bind"] == real[
        "the recipes' calls bind"]
    assert double["refuses"] == real["refuses"] and all(real["refuses"].values())
    assert double_on_cpu["the optimizer initialize returns"] == real["the optimizer initialize returns"]
    assert real["the optimizer initialize returns"]["O2"]["zero_grad(set_to_none=True) binds"] is False
    assert (real["runs_on_cpu"], double["runs_on_cpu"], double_on_cpu["runs_on_cpu"]) == (False, False, True)
    # Each wrapped on 2 gloo CPU ranks whose parameters and BatchNorm buffers differ: apex's DDP broadcasts rank 0's
    # parameters when it wraps the model (apex/parallel/distributed.py: flat_dist_call over module.parameters()),
    # never the buffers, and its forward syncs nothing (torch's DDP broadcasts the buffers at every forward). So
    # apex_ddp.py and apex_amp.py broadcast rank 0's buffers themselves before evaluating. The double used to
    # broadcast the whole state_dict, buffers too, when it wrapped.
    ddp = "DistributedDataParallel(model, delay_allreduce=True), 2 gloo CPU ranks"
    assert double[ddp] == real[ddp] == {"wrapping makes the parameters rank 0's": True,
                                        "wrapping makes the buffers rank 0's": False,
                                        "a forward makes the buffers rank 0's": False}


# ------------------------------------------------------------------- the apex path, via the double


@pytest.mark.slow
def test_apex_amp_call_order_through_the_double(tmp_path):
    log = tmp_path / "apex_calls.log"
    env = {**DOUBLE, "FAKE_APEX_LOG": str(log)}
    args = [*SMALL, "--opt-level", "O2", "--impl", "apex", "--epochs", "2", "--out-dir", tmp_path / "out"]
    first = launch("recipes/apex_amp.py", "cpu:2", *args, "--max-steps", "8", env=env)  # epoch 1 of 2
    # The double has no compiled extensions, like a python-only build: the first line says so, once.
    assert result_of(first)["impl"] == "apex" and first.stdout.startswith(
        "impl: apex O2 (apex build: python-only (no apex_C or amp_C: a host sync per gradient tensor at O1/O2; for the "
        "fused kernels rebuild with --cpp_ext --cuda_ext, docs/apex.md))\n")
    ranks = calls_by_process(log)
    assert len(ranks) == 2
    for calls in ranks:
        assert calls[:2] == ["amp.initialize O2", "parallel.DistributedDataParallel delay_allreduce=True"]
        steps = [c for c in calls[2:] if c != "amp.state_dict"]
        # backward (whose end triggers the delayed all-reduce) runs inside amp.scale_loss, every step
        assert steps == ["amp.scale_loss enter", "parallel.allreduce", "amp.scale_loss exit"] * 8
    # After the epoch every rank reads the loss scale once (the divergence check: amp.state_dict()'s loss_scaler0),
    # and rank 0 alone then checkpoints it (amp.state_dict again).
    assert sorted(calls.count("amp.state_dict") for calls in ranks) == [1, 2]
    assert all(calls[-1] == "amp.state_dict" for calls in ranks)
    assert torch.load(tmp_path / "out/checkpoint.pt", weights_only=True)["amp"] == {
        "loss_scaler0": {"loss_scale": 1024.0, "unskipped": 0}}

    log.unlink()
    resumed = launch("recipes/apex_amp.py", "cpu:2", *args, "--resume", tmp_path / "out/checkpoint.pt", env=env)
    assert result_of(resumed)["steps"] == 16
    for calls in calls_by_process(log):
        # apex's restore order: initialize, the weights, then O2's fp32 masters made (from those weights) before
        # the optimizer state goes into them (loaded earlier, the momentum would be rounded to fp16), amp, wrap.
        assert calls[:5] == ["amp.initialize O2", "optimizer._amp_lazy_init", "optimizer.load_state_dict",
                             "amp.load_state_dict", "parallel.DistributedDataParallel delay_allreduce=True"]


@pytest.mark.slow
def test_apex_ddp_through_the_double_matches_torch_ddp(tmp_path):
    # With BatchNorm: neither DDP syncs the buffers after the last step (apex's never does), so the evaluation and
    # model.pt agree only because the recipe broadcasts rank 0's before evaluating; rank 0's own are the same under
    # both (torch's DDP broadcasts them from rank 0, apex's leaves them alone).
    log = tmp_path / "apex_calls.log"
    args = ["--arch", "tiny_bn", "--workers", "0", "--max-steps", "4", "--batch-size", "32"]
    apex = launch("recipes/apex_ddp.py", "cpu:2", *args, "--impl", "apex", "--out-dir", tmp_path / "a",
                  env={**DOUBLE, "FAKE_APEX_LOG": str(log)})
    torch_ddp = launch("recipes/apex_ddp.py", "cpu:2", *args, "--out-dir", tmp_path / "t")
    assert result_of(apex)["impl"] == "apex" and result_of(torch_ddp)["impl"] == "torch"
    for calls in calls_by_process(log):
        assert calls == ["parallel.DistributedDataParallel delay_allreduce=True"] + ["parallel.allreduce"] * 4
    # One delayed all-reduce or torch's bucketed ones: the same averaged gradients; the same evaluation.
    assert result_of(apex)["train_loss"] == pytest.approx(result_of(torch_ddp)["train_loss"], abs=1e-6)
    assert epoch_lines(apex.stdout) == epoch_lines(torch_ddp.stdout)
    a, b = (torch.load(tmp_path / d / "model.pt", weights_only=True) for d in ("a", "t"))
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=1e-6)
