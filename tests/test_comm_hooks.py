"""recipes/ddp_comm_hooks.py (issue 27): what each DDP communication hook all-reduces, how far it trains from DDP's
own fp32 all-reduce, and PowerSGD's state across a checkpoint, on 2 and 3 real gloo processes.

Bytes are counted by tests/instrument/sitecustomize.py (every dist.all_reduce that torch's ddp_comm_hooks make, per
training step) and checked against what each hook must send, computed here from the model's parameter shapes.
"""

import math
import os
import shutil
import subprocess
import sys

import pytest
import torch
from conftest import (
    REPO,
    as_if_saved_on_gpu,
    ddp_counts,
    launch,
    replayed,
    result_of,
    rng_env,
    rng_streams,
    run_direct,
)
from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook

from common.models import build_model

EPOCHS, TRAIN, START, RANK = 2, 256, 3, 1
FLAGS = ["--arch", "tiny", "--workers", "0", "--epochs", EPOCHS, "--lr", 0.1, "--image-size", 16,
         "--synthetic-train", TRAIN, "--synthetic-val", 37, "--powersgd-start", START, "--powersgd-rank", RANK]
# How far each hook's weights end from DDP's own fp32 all-reduce, relative to how far training moved them (||w_hook -
# w_fp32|| / ||w_fp32 - w_init||, 16 steps of tiny at lr 0.1). Measured on 2 / 3 processes: bf16 3.1e-3 / 1.8e-3, fp16
# 1.8e-4 / 2.9e-4 (3 more mantissa bits), powersgd 0.30 / 0.31 (rank 1, from step 4: lossy by design). A PowerSGD run
# stopped after epoch 1 and resumed ends 1.3e-7 / 1.4e-7 from the uninterrupted one (float rounding: the resumed ranks
# share the mean error, see the recipe); resumed without its state, 0.17 / 0.18.
TOLERANCE = {"bf16": 1e-2, "fp16": 1e-3, "powersgd": 0.5}
RESUME_TOLERANCE = 1e-5


def batch_for(world):
    return 32 if world == 2 else 30


def steps_per_epoch(world):
    return math.ceil(TRAIN / world) // (batch_for(world) // world)


def initial():
    torch.manual_seed(0)  # the recipe's --seed 0, right before build_model
    return build_model("tiny", 10, 16)


def flat(weights):
    return torch.cat([t.float().reshape(-1) for k, t in sorted(weights.items())])


def distance(a, b, init):
    """||a - b|| relative to how far training moved b from the initial weights."""
    return ((flat(a) - flat(b)).norm() / (flat(b) - flat(init)).norm()).item()


def factor_sizes():
    """{name: (numel of P, numel of Q)} for each parameter PowerSGD compresses: its gradient as an n x m matrix (the
    hook's tensor.view(n, -1)), factors n x r and m x r, where the hook's own _should_compress says they pay."""
    sizes = {}
    for name, param in initial().named_parameters():
        n = param.shape[0]
        m = param.numel() // n
        r = min(n, m, RANK)
        if powerSGD_hook._should_compress(n, m, r, 2)[0]:
            sizes[name] = (n * r, m * r)
    return sizes


def expected_bytes(hook):
    """What one training step all-reduces, from the parameter shapes: every gradient in fp32; in 16 bits; or PowerSGD's
    factors P and Q for each matrix it compresses, the rest whole."""
    if hook == "powersgd":
        factors = factor_sizes()
        return sum(4 * (sum(factors[name]) if name in factors else p.numel())
                   for name, p in initial().named_parameters())
    return sum(p.numel() * (2 if hook in ("bf16", "fp16") else 4) for p in initial().parameters())


@pytest.fixture(scope="module", params=[pytest.param(world, marks=pytest.mark.slow) for world in (2, 3)])
def runs(request, tmp_path_factory):
    """Per world size: one run per hook, and PowerSGD stopped after epoch 1 then resumed (--resume auto)."""
    world = request.param
    base = tmp_path_factory.mktemp(f"hooks{world}")
    args = ["recipes/ddp_comm_hooks.py", f"cpu:{world}", *FLAGS, "--batch-size", batch_for(world)]
    out = {"world": world, "base": base}
    for hook in ("none", "bf16", "fp16", "powersgd"):
        counts = base / f"counts_{hook}"
        counts.mkdir()
        env = rng_env(base / f"rng_{hook}", {"COUNT_DDP_DIR": str(counts)})  # tests/instrument counts the bytes
        out[hook] = launch(*args, "--comm-hook", hook, "--out-dir", base / hook, env=env)
        out[f"counts_{hook}"] = ddp_counts(counts)
    pieced = base / "pieced"
    out["first"] = launch(*args, "--comm-hook", "powersgd", "--out-dir", pieced, "--max-steps", steps_per_epoch(world),
                          env=rng_env(base / "rng_first"))
    out["saved"] = torch.load(pieced / "latest.pt", weights_only=True)
    shutil.copy(pieced / "latest.pt", base / "epoch1.pt")
    out["resumed"] = launch(*args, "--comm-hook", "powersgd", "--out-dir", pieced, "--resume", "auto")
    return out


def weights(folder):
    return torch.load(folder / "model.pt", weights_only=True)


def test_each_hook_all_reduces_the_bytes_it_should(runs):
    world, steps = runs["world"], EPOCHS * steps_per_epoch(runs["world"])
    full = expected_bytes("none")
    assert full == 4 * sum(p.numel() for p in initial().parameters())
    for hook in ("none", "bf16", "fp16"):
        sent = [c["allreduce_bytes_per_step"] for c in runs[f"counts_{hook}"]]
        assert sent == [[expected_bytes(hook)] * steps] * world, (hook, sent)
    assert expected_bytes("bf16") * 2 == full
    # PowerSGD: plain all-reduce for --powersgd-start steps, then the factors (tiny at rank 1: about 1/9 of the bytes)
    powersgd = expected_bytes("powersgd")
    assert [c["allreduce_bytes_per_step"] for c in runs["counts_powersgd"]] == [
        [full] * START + [powersgd] * (steps - START)] * world
    assert powersgd < full / 5
    print(f"bytes per step on {world} processes: fp32 {full}, bf16/fp16 {full // 2}, powersgd {powersgd}")
    lines = {hook: [line for line in runs[hook].stdout.splitlines() if line.startswith("comm_hook:")] for hook in
             ("none", "bf16", "powersgd")}
    assert lines == {"none": ["comm_hook: none"], "bf16": ["comm_hook: bf16"],
                     "powersgd": [f"comm_hook: powersgd rank={RANK} from step {START + 1}"]}


def test_each_hook_trains_within_its_tolerance_of_fp32_all_reduce(runs):
    init, fp32 = initial().state_dict(), weights(runs["base"] / "none")
    distances = {hook: distance(weights(runs["base"] / hook), fp32, init) for hook in TOLERANCE}
    print(f"distance from fp32 all-reduce on {runs['world']} processes: {distances}")
    for hook, tolerance in TOLERANCE.items():
        assert 0 < distances[hook] <= tolerance, (hook, distances)
        assert result_of(runs[hook])["val_acc1"] > 25, result_of(runs[hook])  # it learns: 10 classes, chance is 10%


def test_powersgd_state_survives_a_checkpoint(runs):
    world, per_epoch = runs["world"], steps_per_epoch(runs["world"])
    saved = runs["saved"]["comm_hook"]
    # Its step count, the error feedback of every gradient element, and the warm-start factors of each compressed
    # matrix, keyed by parameter name (DDP's buckets are laid out again in a new process).
    assert saved["iter"] == per_epoch
    assert {n: t.shape for n, t in saved["error"].items()} == {n: (p.numel(),) for n, p in initial().named_parameters()}
    factors = factor_sizes()
    assert set(saved["p"]) == set(saved["q"]) == set(factors) and factors
    assert {n: (saved["p"][n].numel(), saved["q"][n].numel()) for n in factors} == factors
    assert all(saved["error"][n].abs().max() > 0 for n in factors)  # what rank 1 left out, for the next step
    resumed = result_of(runs["resumed"])
    assert resumed["steps"] == EPOCHS * per_epoch
    assert "holds no PowerSGD state" not in runs["resumed"].stdout
    init, straight = initial().state_dict(), weights(runs["base"] / "powersgd")
    gap = distance(weights(runs["base"] / "pieced"), straight, init)
    print(f"resumed PowerSGD from uninterrupted on {world} processes: {gap:.1e}")
    assert gap <= RESUME_TOLERANCE


def test_resuming_without_the_powersgd_state_is_said_and_differs(runs, tmp_path):
    # The control for the test above: the same checkpoint without its PowerSGD state resumes with a fresh one, says so,
    # and ends far outside RESUME_TOLERANCE.
    ckpt = dict(runs["saved"], comm_hook=None)
    torch.save(ckpt, tmp_path / "latest.pt")
    world = runs["world"]
    args = ["recipes/ddp_comm_hooks.py", f"cpu:{world}", *FLAGS, "--batch-size", batch_for(world)]
    proc = launch(*args, "--comm-hook", "powersgd", "--out-dir", tmp_path, "--resume", "auto")
    assert (f"holds no PowerSGD state (saved with --comm-hook powersgd): plain all-reduce for {START} steps, then "
            "compression from a cold start") in proc.stdout
    gap = distance(weights(tmp_path), weights(runs["base"] / "powersgd"), initial().state_dict())
    print(f"resumed without the PowerSGD state: {gap:.1e}")
    assert gap > 100 * RESUME_TOLERANCE


def test_powersgd_resumes_on_another_world_size(runs, tmp_path):
    # The mean error fits any world size: 2 ranks' checkpoint resumes on 3, 3 ranks' on 2. Compression goes on from
    # the first step (its step count and factors restored), and the random streams are reseeded, not replayed.
    world, other = runs["world"], 5 - runs["world"]
    shutil.copy(runs["base"] / "epoch1.pt", tmp_path / "latest.pt")
    as_if_saved_on_gpu(tmp_path / "latest.pt")  # each rank loads it with map_location=its own device
    counts = tmp_path / "counts"
    counts.mkdir()
    proc = launch("recipes/ddp_comm_hooks.py", f"cpu:{other}", *FLAGS, "--batch-size", batch_for(other),
                  "--comm-hook", "powersgd", "--out-dir", tmp_path, "--resume", "auto",
                  env=rng_env(tmp_path / "rng", {"COUNT_DDP_DIR": str(counts)}))
    result = result_of(proc)
    assert (result["world_size"], result["steps"]) == (other, EPOCHS * steps_per_epoch(other)), proc.stdout
    assert f"resume: saved with {world} ranks, now {other}: random streams reseeded after epoch 1" in proc.stdout
    assert "holds no PowerSGD state" not in proc.stdout
    assert [c["allreduce_bytes_per_step"] for c in ddp_counts(counts)] == [
        [expected_bytes("powersgd")] * steps_per_epoch(other)] * other
    assert replayed(rng_streams(runs["base"] / "rng_first", tmp_path / "rng")) == {}
    assert result["val_acc1"] > 25, result


def test_powersgd_starts_after_the_lr_warmup_by_default(tmp_path):
    # --powersgd-start's default, the LR warm-up's steps (common.schedule.warmup_steps: --warmup-epochs' worth, at most
    # a third of the run), at least 2: the recipe's default one-epoch run compresses two thirds of its 6 steps (an
    # epoch's worth, the warm-up uncapped, would have left none compressed).
    from common.schedule import warmup_steps

    proc = run_direct("ddp_comm_hooks", "--arch", "tiny", "--workers", "0", "--image-size", "16", "--synthetic-train",
                      "192", "--synthetic-val", "16", "--batch-size", "32", "--comm-hook", "powersgd",
                      "--max-steps", "1", "--out-dir", tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert warmup_steps(1, 6, 1) == 2 and "comm_hook: powersgd rank=1 from step 3\n" in proc.stdout, proc.stdout


def test_powersgd_resume_with_another_rank_is_one_line(runs, tmp_path):
    # P and Q have --powersgd-rank columns: another rank cannot take them (a lower one would misread them).
    world = runs["world"]
    shutil.copy(runs["base"] / "epoch1.pt", tmp_path / "latest.pt")
    proc = launch("recipes/ddp_comm_hooks.py", f"cpu:{world}", *FLAGS, "--batch-size", batch_for(world), "--comm-hook",
                  "powersgd", "--powersgd-rank", RANK + 1, "--out-dir", tmp_path, "--resume", "auto")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert f"error: {tmp_path / 'latest.pt'} was trained with --powersgd-rank {RANK}; resume with the same " \
           "--powersgd-rank" in proc.stderr, proc.stderr[-2000:]
    assert "RESULT" not in proc.stdout


@pytest.mark.parametrize("world", [1])  # no launch, so the quick tier has it
def test_powersgd_state_moves_between_bucket_layouts_parameter_by_parameter(world):
    # In a fresh process with a time limit. It hung 1 run in 7 (faulthandler: two gloo worker threads inside
    # powerSGD_hook's callbacks, each waiting for an all-reduce no thread was left to run) until PowerSGDByParameter
    # waited for each CPU bucket in its hook; 30 runs since, none hung. A new interpreter, as a user's: forked from the
    # warm server (run_script, until 2026-11-28) the two runs came apart on that day's machine, 2e-4 of a weight's scale
    # (layer4.1.conv2), every time, the tree before issue 65 too; in a new interpreter bitwise equal, with glibc's
    # MALLOC_PERTURB_ too (not uninitialised memory). Not understood; docs/testing.md says so.
    proc = subprocess.run([sys.executable, REPO / "tests" / "test_comm_hooks.py", str(world)], cwd=REPO / "tests",
                          env={**os.environ, "PYTHONPATH": f"{REPO}{os.pathsep}{REPO / 'tests'}"},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.stdout.strip().endswith("bitwise equal"), proc.stdout[-2000:]


def bucket_layouts_case(world):
    # Two "processes" in one: DDP #1 trains 5 steps with PowerSGD (from step 3), saves the state by parameter; DDP #2,
    # a new wrapper over a copy of the weights (its first step with one bucket of everything, then DDP's rebuilt
    # buckets), loads it and trains 3 more. resnet18 at rank 2: many same-shaped matrices, which the hook lays out
    # grouped by shape, in several buckets. The result must equal 8 uninterrupted steps, bitwise.
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from common.comm_hooks import PowerSGDByParameter

    torch.manual_seed(0)
    batches = [(torch.randn(4, 3, 8, 8), torch.randint(10, (4,))) for _ in range(8)]
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=world)
    try:
        def trained(model, optimizer, state, steps):
            ddp = DDP(model, bucket_cap_mb=5)
            powersgd = PowerSGDByParameter(model, matrix_approximation_rank=2, start_powerSGD_iter=3)
            if state:
                powersgd.load_state_dict(state)
            ddp.register_comm_hook(powersgd.state, powersgd.hook)
            for images, targets in steps:
                optimizer.zero_grad()
                torch.nn.functional.cross_entropy(ddp(images), targets).backward()
                optimizer.step()
            return powersgd.state_dict(), len(powersgd.layout)

        torch.manual_seed(1)
        straight = build_model("resnet18", 10, 8)
        pieced = build_model("resnet18", 10, 8)
        pieced.load_state_dict(straight.state_dict())
        sgd = [torch.optim.SGD(m.parameters(), lr=0.05, momentum=0.9) for m in (straight, pieced)]
        _, buckets = trained(straight, sgd[0], None, batches)
        saved, _ = trained(pieced, sgd[1], None, batches[:5])
        assert saved["iter"] == 5 and len(saved["q"]) > 20
        trained(pieced, sgd[1], saved, batches[5:])
    finally:
        dist.destroy_process_group()
    assert buckets > 1  # the rebuilt layout is several buckets: state moved out of the first step's one and back
    after = pieced.state_dict()
    assert all(torch.equal(t, after[k]) for k, t in straight.state_dict().items())
    print("bitwise equal")


def test_powersgd_state_of_another_rank_is_refused():
    from common.comm_hooks import PowerSGDByParameter

    model = build_model("tiny", 10, 16)
    saved = PowerSGDByParameter(model, matrix_approximation_rank=1, start_powerSGD_iter=2)
    state = {"iter": 5, "error": {}, "p": {}, "q": {"fc.weight": torch.zeros(32)}}  # rank 1: m x 1 = 32
    saved.load_state_dict(state)
    other = PowerSGDByParameter(model, matrix_approximation_rank=2, start_powerSGD_iter=2)
    with pytest.raises(ValueError, match=r"PowerSGD state of another size than this run's: q of fc.weight"):
        other.load_state_dict(state)
    with pytest.raises(ValueError, match=r"parameters this model does not have: \['nope'\]"):
        saved.load_state_dict({**state, "error": {"nope": torch.zeros(1)}})


if __name__ == "__main__":  # test_powersgd_state_moves_between_bucket_layouts_parameter_by_parameter's process
    bucket_layouts_case(int(sys.argv[1]))
