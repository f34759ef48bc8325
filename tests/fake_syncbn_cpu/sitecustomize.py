"""A TEST DOUBLE, put on PYTHONPATH by tests that run --sync-bn on the CPU: torch's own SyncBatchNorm made to run on
CPU tensors over gloo. torch refuses that in three places, and this lifts exactly those:

- SyncBatchNorm.forward's device check (torch/nn/modules/batchnorm.py: cuda, hpu, xpu or privateuse1): the method's
  own source, recompiled with "cpu" added to that list; nothing else in it changes.
- DDP's constructor (_passing_sync_batchnorm_handle: "SyncBatchNorm layers only work with GPU modules"): a no-op.
- The five CUDA-only kernels its autograd Function calls (torch/nn/modules/_functions.py): CPU versions below, the
  CUDA kernels' arithmetic (Welford-combined statistics, unbiased running variance) in plain torch ops.
- The recipes' own refusal (common/harness.check_flags: "--sync-bn needs GPUs"), which exists because of the above.

So torch's SyncBatchNorm Function runs as it does on a GPU: its gloo all_gather of the statistics, its boolean mask
over the gathered counts (a device-to-host sync on CUDA, and the `nonzero` that breaks a torch.compile graph), its
backward all_reduce. What cannot be shown on the CPU is the cost of that host sync; the tests count it instead.
Set SYNCBN_CPU_COUNT_DIR to have each rank write how many synced SyncBatchNorm forwards it ran (each a host sync on
CUDA) to SYNCBN_CPU_COUNT_DIR/rank<R>.json at exit.
"""

import atexit
import inspect
import json
import os
import sys
import textwrap
from pathlib import Path

import torch
import torch.nn.modules.batchnorm as batchnorm
from torch.nn.parallel import DistributedDataParallel

_lib = torch.library.Library("aten", "IMPL")
_seen = {"sync_forwards": 0, "rank": None}  # counted in a kernel: a counter in the forward would be traced by dynamo


def _channel_dims(x):
    return [d for d in range(x.dim()) if d != 1]


def _per_channel(t, like):
    return t.view([1, -1] + [1] * (like.dim() - 2))


def _stats(x, eps):
    x = x.float()
    var = x.var(_channel_dims(x), unbiased=False)
    return x.mean(_channel_dims(x)), torch.rsqrt(var + eps)


def _gather_stats_with_counts(x, mean, invstd, running_mean, running_var, momentum, eps, counts):
    _seen["sync_forwards"] += 1  # one per synced training forward: after its all_gather and mask (CUDA: a host sync)
    _seen["rank"] = torch.distributed.get_rank()
    counts = counts.float().view(-1, 1)
    n = counts.sum()
    avg = (counts * mean).sum(0) / n
    var_n = (counts * ((1.0 / invstd**2 - eps) + (mean - avg) ** 2)).sum(0)  # the CUDA kernel's var * count, merged
    if running_mean is not None:
        running_mean.mul_(1 - momentum).add_(avg.to(running_mean.dtype), alpha=momentum)
    if running_var is not None:
        running_var.mul_(1 - momentum).add_((var_n / (n - 1)).to(running_var.dtype), alpha=momentum)
    return avg, torch.rsqrt(var_n / n + eps)


def _elemt(x, weight, bias, mean, invstd, eps, *out):
    y = (x.float() - _per_channel(mean, x)) * _per_channel(invstd, x)
    if weight is not None:
        y = y * _per_channel(weight.float(), x)
    if bias is not None:
        y = y + _per_channel(bias.float(), x)
    return y.to(x.dtype).contiguous(memory_format=_layout(x))


def _layout(x):
    return torch.channels_last if x.dim() == 4 and x.is_contiguous(memory_format=torch.channels_last) \
        and not x.is_contiguous() else torch.contiguous_format


def _backward_reduce(dy, x, mean, invstd, weight, input_g, weight_g, bias_g):
    dims = _channel_dims(x)
    dy32 = dy.float()
    sum_dy = dy32.sum(dims)
    sum_dy_xmu = (dy32 * (x.float() - _per_channel(mean, x))).sum(dims)
    grad_weight = (sum_dy_xmu * invstd).to(weight.dtype) if weight is not None and weight_g else torch.empty(0)
    grad_bias = sum_dy.to(weight.dtype) if weight is not None and bias_g else torch.empty(0)
    return sum_dy, sum_dy_xmu, grad_weight, grad_bias


def _backward_elemt(dy, x, mean, invstd, weight, sum_dy, sum_dy_xmu, count):
    norm = 1.0 / count.float().sum()
    xmu = x.float() - _per_channel(mean, x)
    grad = (dy.float() - _per_channel(sum_dy * norm, x)
            - xmu * _per_channel(invstd**2 * sum_dy_xmu * norm, x)) * _per_channel(invstd, x)
    if weight is not None:
        grad = grad * _per_channel(weight.float(), x)
    return grad.to(x.dtype).contiguous(memory_format=_layout(x))


for _name, _fn in (("batch_norm_stats", _stats), ("batch_norm_gather_stats_with_counts", _gather_stats_with_counts),
                   ("batch_norm_elemt", _elemt), ("batch_norm_backward_reduce", _backward_reduce),
                   ("batch_norm_backward_elemt", _backward_elemt)):
    # Hidden from torch.compile: on a GPU these are C++ kernels, which dynamo never sees (it would trace these Python
    # stand-ins, and recompile them for every layer's channel count).
    _lib.impl(_name, torch.compiler.disable(_fn), "CPU")

# SyncBatchNorm.forward, torch's source with "cpu" in its device list.
_source = textwrap.dedent(inspect.getsource(batchnorm.SyncBatchNorm.forward))
assert '"cuda",' in _source, "torch's SyncBatchNorm.forward changed: update tests/fake_syncbn_cpu"
_namespace = {}
exec(compile(_source.replace('"cuda",', '"cuda", "cpu",', 1), batchnorm.__file__, "exec"),
     vars(batchnorm), _namespace)
batchnorm.SyncBatchNorm.forward = _namespace["forward"]
DistributedDataParallel._passing_sync_batchnorm_handle = lambda self, module: None

# The recipes' refusal of --sync-bn without CUDA (common/harness.check_flags), lifted: the flag is hidden from it.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from common import harness  # noqa: E402

_check_flags = harness.check_flags


def _check_flags_allowing_sync_bn(args, world_size=1):
    sync_bn = getattr(args, "sync_bn", False)
    args.sync_bn = False
    try:
        _check_flags(args, world_size)
    finally:
        args.sync_bn = sync_bn


harness.check_flags = _check_flags_allowing_sync_bn

if os.environ.get("SYNCBN_CPU_COUNT_DIR"):
    @atexit.register
    def _write_count():
        if _seen["rank"] is not None:  # a rank that ran a synced forward (not the launcher, not a loader worker)
            folder = Path(os.environ["SYNCBN_CPU_COUNT_DIR"])
            folder.mkdir(parents=True, exist_ok=True)
            (folder / f"rank{_seen['rank']}.json").write_text(json.dumps({"sync_forwards": _seen["sync_forwards"]}))
