"""TEST DOUBLE of apex.amp: initialize / scale_loss / state_dict / load_state_dict on plain torch.

Numerics are deliberately simple (a fixed loss scale; O2/O3 cast the model to fp16, O2 keeps BatchNorm fp32;
no master weights). What it checks is how the recipe calls apex. Where a recipe depends on apex's behaviour it
does what apex 25.04 does, with apex's words: it refuses a model already wrapped for data parallelism, CPU
parameters (unless FAKE_APEX_ON_CPU=1), and keep_batchnorm_fp32 at O1; at O2 (master weights) it replaces
optimizer.zero_grad with a method that takes no argument; every optimizer gets apex's _amp_lazy_init, which
makes O2's fp32 master weights in real apex.
"""

import contextlib
import types

import torch
from torch import nn

from apex import RUNS_ON_CPU, log
from apex.parallel import DistributedDataParallel as ApexDDP

_state = {"scale": 2.0**10, "opt_level": None}


def initialize(models, optimizers=None, opt_level="O1", keep_batchnorm_fp32=None, verbosity=1, **kwargs):
    if opt_level == "O1" and keep_batchnorm_fp32 is not None:  # apex/amp/frontend.py, Properties.__setattr__
        raise RuntimeError("With opt_level O1, batchnorm functions are automatically patched to run in FP32, so "
                           f"keep_batchnorm_fp32 should be None. keep_batchnorm_fp32 was {keep_batchnorm_fp32}")
    for kind, name in ((nn.parallel.DistributedDataParallel, "torch.nn.parallel.DistributedDataParallel"),
                       (ApexDDP, "apex.parallel.DistributedDataParallel"),
                       (nn.DataParallel, "torch.nn.parallel.DataParallel")):  # apex's check_models
        if isinstance(models, kind):
            raise RuntimeError(f"Incoming model is an instance of {name}. Parallel wrappers should only be applied "
                               "to the model(s) AFTER \nthe model(s) have been returned from amp.initialize.")
    for name, param in models.named_parameters():  # apex's check_params_fp32
        if not (param.is_cuda or RUNS_ON_CPU):
            raise RuntimeError(f"Found param {name} with type {param.type()}, expected torch.cuda.FloatTensor.\n"
                               "When using amp.initialize, you need to provide a model with parameters\n"
                               "located on a CUDA device before passing it no matter what optimization level\n"
                               "you chose. Use model.to('cuda') to use the default device.")
    log(f"amp.initialize {opt_level}")
    _state["opt_level"] = opt_level
    if opt_level in ("O2", "O3"):
        models.half()
        keep = keep_batchnorm_fp32 if keep_batchnorm_fp32 is not None else opt_level == "O2"
        for m in models.modules():
            if keep and isinstance(m, nn.modules.batchnorm._BatchNorm):
                m.float()
                m.register_forward_pre_hook(lambda mod, args: tuple(a.float() for a in args))
                m.register_forward_hook(lambda mod, args, out: out.half())
        models.register_forward_pre_hook(lambda mod, args: tuple(a.half() for a in args))  # apex casts inputs
    _process_optimizer(optimizers, master_weights=opt_level == "O2")
    return models, optimizers


def _process_optimizer(optimizer, master_weights):
    """apex/amp/_process_optimizer.py's patches that the recipes meet, logged."""
    load_state_dict = optimizer.load_state_dict

    def logged_load_state_dict(state):
        log("optimizer.load_state_dict")
        load_state_dict(state)

    def _amp_lazy_init(self):
        log("optimizer._amp_lazy_init")

    optimizer.load_state_dict = logged_load_state_dict
    optimizer._amp_lazy_init = types.MethodType(_amp_lazy_init, optimizer)
    if master_weights:
        def new_zero_grad(self):  # apex's replacement takes no argument: zero_grad(set_to_none=True) fails
            for group in self.param_groups:
                for p in group["params"]:
                    p.grad = None

        optimizer.zero_grad = types.MethodType(new_zero_grad, optimizer)


@contextlib.contextmanager
def scale_loss(loss, optimizers, loss_id=0, model=None, delay_unscale=False, delay_overflow_check=False):
    log("amp.scale_loss enter")
    yield loss.float() * _state["scale"]
    with torch.no_grad():
        for group in optimizers.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.div_(_state["scale"])
    log("amp.scale_loss exit")


def state_dict(destination=None):
    log("amp.state_dict")
    return {"loss_scaler0": {"loss_scale": _state["scale"], "unskipped": 0}}


def load_state_dict(state_dict):
    log("amp.load_state_dict")
    unexpected = [key for key in state_dict if "loss_scaler" not in key]
    if unexpected:  # apex's words
        raise RuntimeError("Error(s) in loading state_dict. Unexpected key(s) in state_dict: {}. ".format(
            ", ".join(f'"{k}"' for k in unexpected)))
    _state["scale"] = state_dict["loss_scaler0"]["loss_scale"]
