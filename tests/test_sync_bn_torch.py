"""torch's own SyncBatchNorm through the recipes' --sync-bn, on CPU processes (issue 39).

torch refuses SyncBatchNorm on the CPU, so these runs put tests/fake_syncbn_cpu on PYTHONPATH: a TEST DOUBLE that
lifts exactly those refusals (the forward's device check, DDP's constructor, the recipes' own --sync-bn check) and
gives the five CUDA-only kernels CPU versions. Everything else is torch's: SyncBatchNorm's autograd Function, the
gloo all_gather of each layer's statistics, the mask over the gathered counts (a host sync on CUDA, the `nonzero`
that breaks a compiled graph), the backward all_reduce. tests/test_gpu.py runs the real thing on a GPU; this is its
CPU twin: 2 ranks x 16 with --sync-bn compute what 1 rank x 32 with plain BatchNorm computes, and the control (2
ranks without it) does not. tests/test_syncbn.py proves the same of apex's SyncBatchNorm without a stand-in.
"""

import json
import os
import re

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import warm
from conftest import REPO, launch, max_diff, params, result_of

from common.models import build_model

FAKE = str(REPO / "tests" / "fake_syncbn_cpu")
STEPS = 6
COMMON = ["--arch", "tiny_bn", "--workers", "0", "--batch-size", "32", "--max-steps", STEPS, "--lr", "0.05",
          "--synthetic-train", "256", "--synthetic-val", "64", "--image-size", "16", "--no-flip"]
EXTRA = {"torch_amp": ["--amp-dtype", "fp32"], "apex_ddp": ["--impl", "torch"]}
# Each a path of its own to the same conversion: the flagship's, apex_ddp's torch branch, torch_amp's (with its
# accumulation loop) and ddp_compile's, compiled. The other --sync-bn recipes (ddp_launch, ddp_spawn, ddp_checkpoint,
# ddp_zero, ddp_comm_hooks) run the flagship's line as it is (ddp_spawn, tried: the same weights); the GPU tier runs
# each.
RECIPES = ["ddp_torchrun", "apex_ddp", "torch_amp", "ddp_compile"]


def counted(folder):
    return [json.loads((folder / f"rank{r}.json").read_text())["sync_forwards"] for r in (0, 1)]


@pytest.fixture(scope="module")
def whole(tmp_path_factory):
    """One process, plain BatchNorm over the whole global batch of 32: what --sync-bn on 2 ranks must equal."""
    out = tmp_path_factory.mktemp("whole")
    proc = launch("recipes/ddp_torchrun.py", "cpu:1", *COMMON, "--out-dir", out)
    assert result_of(proc)["steps"] == STEPS
    return params(out / "model.pt")


@pytest.mark.slow
@pytest.mark.parametrize("recipe", RECIPES)
def test_sync_bn_on_two_ranks_equals_batchnorm_on_one_rank_with_the_whole_batch(tmp_path, whole, recipe):
    proc = launch(f"recipes/{recipe}.py", "cpu:2", *COMMON, *EXTRA.get(recipe, []), "--sync-bn",
                  "--out-dir", tmp_path, env={"PYTHONPATH": FAKE, "SYNCBN_CPU_COUNT_DIR": str(tmp_path / "counts")})
    assert result_of(proc)["world_size"] == 2
    synced = params(tmp_path / "model.pt")
    build_model("tiny_bn", 10).load_state_dict(synced)  # strict: model.pt has plain BatchNorm's keys
    # Equal up to SyncBatchNorm's own arithmetic: it all-gathers each rank's mean and 1/std and merges them (the
    # variance comes back as 1/invstd^2 - eps), not plain BatchNorm's one pass over the batch. After 1 step the
    # weights are 1.5e-8 apart and the statistics 1.2e-7; training grows that to 3.4e-5 and 4.1e-4 (a running mean of
    # 1.5) after 6 steps, every recipe alike. The control below is 100 times further.
    weights = [k for k in whole if "running" not in k]
    assert max_diff({k: synced[k] for k in weights}, {k: whole[k] for k in weights}) < 1e-4
    assert max_diff(synced, whole) < 2e-3
    # One synced forward (an all_gather, and on CUDA a host sync) per BatchNorm layer per training forward: tiny_bn
    # has 2, and each rank ran 6 steps and the 4 batches of the epoch-end recompute.
    assert counted(tmp_path / "counts") == [2 * (STEPS + 4)] * 2
    if recipe == "ddp_compile":  # each SyncBatchNorm breaks the graph; tiny_bn's sit in an nn.Sequential, which runs
        # eagerly whole once a break is inside it: the compiled graph is the fc alone.
        result = result_of(proc)
        assert (result["graph_breaks"], result["compiled_graphs"] - result["eval_graphs"]) == (1, 1), result
        assert re.search(r"; 1 graph break\(s\) \(1 x Dynamic shape operator; TORCH_LOGS=graph_breaks shows where\)",
                         proc.stdout), proc.stdout


@pytest.mark.slow
def test_without_sync_bn_two_ranks_miss_the_whole_batch_statistics(tmp_path, whole):
    # The control: plain BatchNorm on 2 ranks normalises by each half's statistics, far outside the tolerance above.
    proc = launch("recipes/ddp_torchrun.py", "cpu:2", *COMMON, "--out-dir", tmp_path)
    assert result_of(proc)["world_size"] == 2
    unsynced = params(tmp_path / "model.pt")
    stats = [k for k in whole if "running_var" in k]
    assert max_diff({k: unsynced[k] for k in stats}, {k: whole[k] for k in stats}) > 2e-2  # measured: 4.2e-2


def _compiled_resnet18_step(rank, init_file, out):
    """ddp_compile's order (SyncBatchNorm, model.compile, the DDP wrap), one training step on 2 gloo ranks; rank 0
    writes dynamo's counts. backend="eager": dynamo alone decides where graphs break, inductor's code generation
    (minutes on 2 cores for resnet18's pieces) only compiles them."""
    from torch._dynamo.utils import counters
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    torch.manual_seed(0)
    model = torch.nn.SyncBatchNorm.convert_sync_batchnorm(build_model("resnet18", 10, 8))
    model.compile(dynamic=False, backend="eager")
    model = DDP(model)
    torch.nn.functional.cross_entropy(model(torch.randn(4, 3, 8, 8)), torch.arange(4)).backward()
    if rank == 0:
        breaks = {}  # by each reason's first line, as ddp_compile prints them
        for reason, n in counters["graph_break"].items():
            breaks[reason.splitlines()[0]] = breaks.get(reason.splitlines()[0], 0) + n
        out.write_text(json.dumps({"graphs": counters["stats"]["unique_graphs"], "breaks": breaks}))
    dist.destroy_process_group()


@pytest.mark.slow
def test_compiled_resnet18_breaks_once_per_sync_batchnorm(tmp_path, monkeypatch):
    # resnet18's SyncBatchNorms sit in its own forward and its blocks' (torchvision code, which dynamo compiles
    # frame by frame): a break at each of the 20, the 21 pieces between them compiled. ddp_compile's docstring.
    monkeypatch.setenv("PYTHONPATH", FAKE)  # the ranks start with the stand-in (its sitecustomize imported first)
    args = (str(tmp_path / "init"), tmp_path / "counts.json")
    if warm.reason_for_real_path(dict(os.environ)) is None:  # forked from the warm server, which imports it
        warm.spawn(_compiled_resnet18_step, args=args, nprocs=2)
    else:  # new interpreters: multiprocessing's fork server would not import the sitecustomize
        mp.spawn(_compiled_resnet18_step, args=args, nprocs=2)
    layers = sum("BatchNorm" in type(m).__name__ for m in build_model("resnet18", 10, 8).modules())
    assert layers == 20
    assert json.loads((tmp_path / "counts.json").read_text()) == {
        "graphs": layers + 1, "breaks": {"Dynamic shape operator": layers}}
