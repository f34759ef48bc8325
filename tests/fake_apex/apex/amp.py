"""TEST DOUBLE of apex.amp: initialize / scale_loss / state_dict / load_state_dict on plain torch.

Numerics are deliberately simple (a fixed loss scale; O2/O3 cast the model to fp16, O2 keeps
BatchNorm fp32; no master weights). What it checks is how the recipe calls apex. Like apex, it
refuses a model that is already wrapped for data parallelism.
"""

import contextlib

import torch
from torch import nn

from apex import log
from apex.parallel import DistributedDataParallel as ApexDDP

_state = {"scale": 2.0**10, "opt_level": None}


def initialize(model, optimizer, opt_level="O1", keep_batchnorm_fp32=None, verbosity=1, **kwargs):
    if isinstance(model, (nn.parallel.DistributedDataParallel, nn.DataParallel, ApexDDP)):
        raise RuntimeError("Incoming model is an instance of a parallel wrapper. Parallel wrappers should only "
                           "be applied to the model(s) AFTER the model(s) have been returned from amp.initialize.")
    log(f"amp.initialize {opt_level}")
    _state["opt_level"] = opt_level
    if opt_level in ("O2", "O3"):
        model.half()
        keep = keep_batchnorm_fp32 if keep_batchnorm_fp32 is not None else opt_level == "O2"
        for m in model.modules():
            if keep and isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.float()
                m.register_forward_pre_hook(lambda mod, args: tuple(a.float() for a in args))
                m.register_forward_hook(lambda mod, args, out: out.half())
        model.register_forward_pre_hook(lambda mod, args: tuple(a.half() for a in args))  # apex casts inputs
    return model, optimizer


@contextlib.contextmanager
def scale_loss(loss, optimizer):
    log("amp.scale_loss enter")
    yield loss.float() * _state["scale"]
    with torch.no_grad():
        for group in optimizer.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.div_(_state["scale"])
    log("amp.scale_loss exit")


def state_dict():
    log("amp.state_dict")
    return {"loss_scaler0": {"loss_scale": _state["scale"], "unskipped": 0}}


def load_state_dict(state):
    log("amp.load_state_dict")
    _state["scale"] = state["loss_scaler0"]["loss_scale"]
