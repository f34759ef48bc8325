"""Run as a script where `apex` imports (the real one, or tests/fake_apex on PYTHONPATH). Prints, as one JSON
line, how that apex behaves where the recipes depend on it; tests/test_apex.py compares the double's answers
with the real apex's. With --ddp, also what its DistributedDataParallel synchronizes, on 2 gloo CPU processes forked
from this one before it calls anything of apex's (nothing imported anew; one thread each, as torchrun's ranks)."""

import contextlib
import inspect
import json
import os
import sys
import tempfile

import apex
import torch
import torch.distributed as dist
from apex import amp
from apex.parallel import DistributedDataParallel
from torch import nn


def binds(fn, *args, **kwargs):
    """Whether a call of this shape (the one a recipe makes) fits fn's signature."""
    try:
        inspect.signature(fn).bind(*args, **kwargs)
    except TypeError:
        return False
    return True


def first_error_line(call):
    try:
        call()
    except Exception as exc:
        return f"{type(exc).__name__}: {str(exc).splitlines()[0]}"
    return None


def model():
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4))


def sgd(module):
    return torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)


def processed_optimizer(level):
    """The optimizer amp.initialize returns at `level`, or None where this apex cannot say on the CPU. Real apex
    cannot finish initialize on the CPU (its loss scaler allocates a CUDA tensor), so its optimizer comes from
    the function initialize gets it from (apex/amp/_initialize.py: _process_optimizer)."""
    net = model()
    if getattr(apex, "RUNS_ON_CPU", False):
        return amp.initialize(net, sgd(net), opt_level=level, verbosity=0)[1]
    try:
        from apex.amp._process_optimizer import _process_optimizer
        from apex.amp.frontend import Properties, opt_levels
    except ImportError:  # the double, not told to run on the CPU
        return None
    return _process_optimizer(sgd(net), opt_levels[level](Properties()))


def optimizer_report(level):
    optimizer = processed_optimizer(level)
    if optimizer is None:
        return None
    return {"zero_grad() binds": binds(optimizer.zero_grad),
            "zero_grad(set_to_none=True) binds": binds(optimizer.zero_grad, set_to_none=True),
            "has _amp_lazy_init": callable(getattr(optimizer, "_amp_lazy_init", None))}


def rank0s(tensors):
    """Whether every rank holds rank 0's values of all these tensors (a collective: every rank calls it)."""
    same = torch.tensor(1)
    for tensor in tensors:
        theirs = tensor.detach().double().clone()
        dist.broadcast(theirs, 0)
        same &= torch.equal(theirs, tensor.detach().double())
    dist.all_reduce(same, op=dist.ReduceOp.MIN)
    return bool(same)


def make_rank_own(module, rank):
    with torch.no_grad():
        for tensor in [*module.parameters(), *module.buffers()]:  # BatchNorm's buffers: running_mean, _var, count
            tensor.fill_(rank + 1)


def ddp_rank(rank, folder):
    """One of 2 ranks: parameters and buffers that differ per rank, wrapped, then a forward; what became rank 0's."""
    torch.set_num_threads(1)  # as torchrun's ranks: two ranks of two threads each would spin against each other
    with contextlib.redirect_stdout(sys.stderr):  # this script's only stdout line is the report
        dist.init_process_group("gloo", init_method=f"file://{folder}/store", rank=rank, world_size=2)
        if not torch.cuda.is_available():
            # apex DDP's __init__ keeps torch.cuda.current_stream() (distributed.py:230), which raises without a GPU.
            # With delay_allreduce=True only the after-backward all-reduce uses it, which this probe never runs; nothing
            # else it does at construction or in forward touches CUDA (no amp_C here: multi_tensor_applier is off).
            torch.cuda.current_stream = lambda device=None: None
        net = model()
        make_rank_own(net, rank)
        wrapped = DistributedDataParallel(net, delay_allreduce=True)
        report = {"wrapping makes the parameters rank 0's": rank0s(net.parameters()),
                  "wrapping makes the buffers rank 0's": rank0s(net.buffers())}
        make_rank_own(net, rank)
        net.eval()  # BatchNorm leaves its statistics alone: they change only if the wrapper's forward syncs them
        with torch.no_grad():
            wrapped(torch.ones(2, 3, 4, 4))
        report["a forward makes the buffers rank 0's"] = rank0s(net.buffers())
        if rank == 0:
            with open(os.path.join(folder, "report.json"), "w") as f:
                json.dump(report, f)
        dist.destroy_process_group()


def ddp_report():
    with tempfile.TemporaryDirectory() as folder:
        torch.multiprocessing.start_processes(ddp_rank, args=(folder,), nprocs=2, start_method="fork")
        with open(os.path.join(folder, "report.json")) as f:
            return json.load(f)


def main():
    ddp = ddp_report() if "--ddp" in sys.argv else None  # first: its ranks fork from a process that called no apex
    net = model()
    loss = net(torch.ones(1, 3, 4, 4)).sum()
    runs_on_cpu = getattr(apex, "RUNS_ON_CPU", False)
    report = {
        "runs_on_cpu": runs_on_cpu,
        "the recipes' calls bind": {
            "amp.initialize(model, optimizer, opt_level=, keep_batchnorm_fp32=, verbosity=)":
                binds(amp.initialize, net, sgd(net), opt_level="O2", keep_batchnorm_fp32=None, verbosity=0),
            "amp.scale_loss(loss, optimizer)": binds(amp.scale_loss, loss, sgd(net)),
            "amp.state_dict()": binds(amp.state_dict),
            "amp.load_state_dict(state)": binds(amp.load_state_dict, {}),
            "DistributedDataParallel(model, delay_allreduce=True)": binds(DistributedDataParallel, net,
                                                                          delay_allreduce=True),
        },
        "refuses": {
            "keep_batchnorm_fp32 at O1": first_error_line(
                lambda: amp.initialize(model(), sgd(net), opt_level="O1", keep_batchnorm_fp32=True, verbosity=0)),
            "a wrapped model": first_error_line(
                lambda: amp.initialize(nn.DataParallel(model()), sgd(net), opt_level="O2", verbosity=0)),
            "CPU parameters": None if runs_on_cpu else first_error_line(
                lambda: amp.initialize(model(), sgd(net), opt_level="O0", verbosity=0)),
        },
        "the optimizer initialize returns": {level: optimizer_report(level) for level in ("O0", "O1", "O2", "O3")},
    }
    if ddp is not None:
        report["DistributedDataParallel(model, delay_allreduce=True), 2 gloo CPU ranks"] = ddp
    print(json.dumps(report))


if __name__ == "__main__":
    main()
