"""SyncBatchNorm (issue 26): what --sync-bn promises, on real processes.

The property that defines SyncBatchNorm: N ranks, each with 1/N of a batch, wrapped in DDP, compute what one process
with plain BatchNorm computes on the whole batch: the forward's normalised outputs, the (averaged) gradients and the
running statistics. torch's SyncBatchNorm refuses CPU tensors (its forward, and DDP's constructor), so on the CPU
the test runs apex's python SyncBatchNorm (apex.parallel.convert_syncbn_model, which recipes/apex_ddp.py --sync-bn
uses with apex's DDP; the real apex from vendor/, under torch's DDP on gloo). tests/test_gpu.py checks torch's on
GPUs through the recipe. The control: plain BatchNorm on the same ranks misses, by far more than the tolerance.
"""

import contextlib
import io
import warnings

import pytest
import torch
import torch.distributed as dist
from conftest import launch, warm_spawn
from jobs import error_lines

from common.models import build_model, recomputed_batchnorm

pytest.importorskip("apex", reason="the real apex: pip install --no-build-isolation --no-deps "
                                   "./vendor/apex-25.04.tar.gz (docs/apex.md)")

BATCH, STEPS = 12, 3  # 12 divides by 1, 2 and 3 ranks


def _model():
    torch.manual_seed(0)
    return build_model("tiny_bn", 10, 8)


def _batches():
    g = torch.Generator().manual_seed(1)
    # Shifted and scaled per channel: statistics far from BatchNorm's initial 0 and 1.
    return [(torch.randn(BATCH, 3, 8, 8, generator=g) * torch.tensor([1.0, 2.0, 0.5]).view(1, 3, 1, 1) + 0.7,
             torch.randint(0, 10, (BATCH,), generator=g)) for _ in range(STEPS)]


def _train(model, rank, world, out):
    """STEPS SGD steps, rank r on its contiguous 1/world of each batch; what each step's forward gave, the first
    step's gradients, and the final weights and buffers."""
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    inner = model.module if hasattr(model, "module") else model  # DDP's: names without "module."
    outputs = []
    for step, (images, targets) in enumerate(_batches()):
        part = slice(rank * BATCH // world, (rank + 1) * BATCH // world)
        output = model(images[part])
        outputs.append(output.detach())
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(output, targets[part]).backward()
        if step == 0:
            out["grads"] = {n: p.grad.clone() for n, p in inner.named_parameters()}
        optimizer.step()
    out["outputs"] = outputs
    out["state"] = {k: v.clone() for k, v in inner.state_dict().items()}
    # The recipes' epoch-end recompute (momentum 1/k per batch): with SyncBatchNorm every rank runs it, in step.
    with recomputed_batchnorm(inner):
        for images, _ in _batches()[-2:]:
            inner(images[part])
    out["recomputed"] = {k: v.clone() for k, v in inner.state_dict().items() if "running" in k}


def _rank(rank, world, init_file, results, sync):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    import apex

    model = _model()
    if sync:
        with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():  # its fallback notice, per rank
            warnings.simplefilter("ignore")
            model = apex.parallel.convert_syncbn_model(model)
    model = torch.nn.parallel.DistributedDataParallel(model)
    out = {"bn_class": type(model.module.features[1]).__name__}
    _train(model, rank, world, out)
    torch.save(out, f"{results}/rank{rank}.pt")
    dist.destroy_process_group()


def _ranks(tmp_path, world, sync):
    warm_spawn(_rank, args=(world, str(tmp_path / f"init{world}{sync}"), str(tmp_path), sync), nprocs=world)
    return [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(world)]


def _gap(a, b):
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


@pytest.mark.parametrize("world", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_sync_batchnorm_on_n_ranks_equals_batchnorm_on_the_whole_batch(tmp_path, world):
    whole = {}
    _train(_model(), 0, 1, whole)
    ranks = _ranks(tmp_path, world, sync=True)
    assert {r["bn_class"] for r in ranks} == {"SyncBatchNorm"}
    for step in range(STEPS):  # each rank's outputs are its rows of the whole batch's
        joined = torch.cat([r["outputs"][step] for r in ranks])
        assert (joined - whole["outputs"][step]).abs().max().item() < 1e-5, step
    for r in ranks:
        assert _gap(r["grads"], whole["grads"]) < 1e-6  # DDP's average of the ranks' gradients: the whole batch's
        assert _gap(r["state"], whole["state"]) < 1e-5  # weights and running mean / variance (unbiased, N = 12 x H x W)
        assert _gap(r["recomputed"], whole["recomputed"]) < 1e-5
    # The control: plain BatchNorm on the same ranks normalises each part by its own statistics.
    plain = _ranks(tmp_path, world, sync=False)
    assert {r["bn_class"] for r in plain} == {"BatchNorm2d"}
    running = [k for k in whole["state"] if "running_var" in k]
    assert _gap({k: plain[0]["state"][k] for k in running}, {k: whole["state"][k] for k in running}) > 1e-3
    assert _gap(plain[0]["grads"], whole["grads"]) > 1e-4


@pytest.mark.parametrize("recipe", ["ddp_torchrun", pytest.param("ddp_spawn", marks=pytest.mark.slow)])
def test_sync_bn_on_the_cpu_is_one_line(tmp_path, recipe):
    proc = launch(f"recipes/{recipe}.py", "cpu:2", "--arch", "tiny_bn", "--sync-bn", "--out-dir", tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert error_lines(proc.stderr) == ["error: --sync-bn needs GPUs: torch's SyncBatchNorm refuses CPU tensors; leave "
                                        "it out on the CPU"], proc.stderr
    assert "Traceback" not in proc.stderr and "RESULT" not in proc.stdout
    assert not (tmp_path / "model.pt").exists()

