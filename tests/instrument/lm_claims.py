"""Instrumentation for the language models' claims (recipes/lm_*.py, issue 57): what each rank computes and sends,
measured inside the recipe's own processes during a real run. sitecustomize.py imports it (every rank); it does
nothing unless one of its variables is set. A step is what lies between two optimizer steps (torch's global
optimizer step hook): "step" k in a record is the number of optimizer steps the process took before it.

With LOG_TOKENS_DIR set, each rank appends to LOG_TOKENS_DIR/rank<R>.jsonl, one line per
  - forward through common.lm.Transformer (lm_ddp, lm_tp, lm_fsdp_tp): {"where": "model", ...},
  - microbatch a pipeline stage runs forward (torch's PipelineStage.forward_one_chunk, lm_pp): {"where": "stage"},
  - microbatch whose loss a pipeline schedule computes (its _compute_loss: the last stage): {"where": "targets"},
  each with "train" (autograd on), "step", "rows": the token windows it received (lists of ints: the input bytes, or
  for "targets" the target bytes; None where a stage receives activations from the stage before), "shape": the
  input's, and "dtype": the output's (the logits' or the activations' sent on: what --amp-dtype changes).
With COUNT_BLOCKS_DIR set, each rank counts the forwards of common.lm.Block per step (training steps only: autograd
  on), {"forward": n, "recomputed": n}, "recomputed" those run inside autograd's backward (activation checkpointing
  rebuilding a block's activations), and rewrites COUNT_BLOCKS_DIR/rank<R>.json at each step: {"steps": [...]}.
With COUNT_COMMS_DIR set, each rank records every collective and point-to-point operation its main thread issues,
  torch.ops.c10d's (torch.distributed's calls, DDP's reducer, FSDP2, the pipeline's sends and receives) and
  torch.ops._c10d_functional's (DTensor's redistributions), seen by a TorchDispatchMode that lets DTensor desugar
  first (as torch's CommDebugMode does), and rewrites COUNT_COMMS_DIR/rank<R>.json at each step: {"steps": [[[op,
  phase, ranks, bytes], ...] per step]}: op the operation's name ("allreduce_", "all_reduce", "send", "recv_", ...),
  phase "forward" (inside a Transformer's call, its FSDP2 hooks included, or a stage's forward_one_chunk, autograd
  on), "backward" (inside autograd's backward) or "step" (the rest: the loss, clipping, the optimizer, the stop vote,
  evaluation, saves), ranks the group's global ranks (for a send or a receive: [this rank, the peer]), bytes the
  input tensors' (what this rank contributes: its shard for an all-gather, the whole tensor for a reduce-scatter).
  Operations of other threads (DCP's async save) are not seen. Host reads of a tensor's value (.item(), bool(),
  float(): aten._local_scalar_dense, where a CPU waits for its GPU) outside optimizer.step() go into the same lists
  as ["item", phase, [], bytes, "file:function"], the caller the innermost frame outside torch ("common/harness.py:
  all_reduce_max": the stop vote's ballot, a CPU tensor).
None of it changes what the recipe computes: the hooks read tensors and call through.
"""

import json
import os
import sys
import threading

_TOKENS_DIR = os.environ.get("LOG_TOKENS_DIR")
_BLOCKS_DIR = os.environ.get("COUNT_BLOCKS_DIR")
_COMMS_DIR = os.environ.get("COUNT_COMMS_DIR")
_STATE = {"step": 0, "blocks": [], "comms": [], "in_optimizer": False}
_LOCAL = threading.local()  # .forward: inside a Transformer's call or a stage's forward


def _rank():
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", 0))


def _in_backward():
    import torch

    return torch._C._current_graph_task_id() != -1


def _rows(tensor):
    """The token windows of an integer tensor (B, T) as lists, else None (activations)."""
    import torch

    if isinstance(tensor, torch.Tensor) and not tensor.is_floating_point() and tensor.dim() == 2:
        return tensor.detach().cpu().tolist()
    return None


def _log_tokens(where, tensor, output):
    import torch

    line = {"where": where, "train": torch.is_grad_enabled(), "step": _STATE["step"], "rows": _rows(tensor),
            "shape": list(tensor.shape) if isinstance(tensor, torch.Tensor) else None,
            "dtype": str(output.dtype).removeprefix("torch.") if isinstance(output, torch.Tensor) else None}
    with open(os.path.join(_TOKENS_DIR, f"rank{_rank()}.jsonl"), "a") as f:
        f.write(json.dumps(line) + "\n")


def _write(folder, record):
    with open(os.path.join(folder, f"rank{_rank()}.json"), "w") as f:
        json.dump(record, f)


def _step_ends(*args):
    _STATE["step"] += 1
    _STATE["in_optimizer"] = False
    if _BLOCKS_DIR:
        _STATE["blocks"].append({"forward": 0, "recomputed": 0})
        _write(_BLOCKS_DIR, {"steps": _STATE["blocks"][:-1]})
    if _COMMS_DIR:
        _STATE["comms"].append([])
        _write(_COMMS_DIR, {"steps": _STATE["comms"][:-1]})


def _within_forward(call):
    """call, marked as a training forward (autograd on when it starts) for the collectives it makes."""
    def run(self, *args, **kwargs):
        import torch

        outer, _LOCAL.forward = getattr(_LOCAL, "forward", False), torch.is_grad_enabled()
        try:
            return call(self, *args, **kwargs)
        finally:
            _LOCAL.forward = outer
    return run


def _patch_lm(lm):
    """common.lm: the Transformer's call (tokens in, logits out; its FSDP2 hooks inside) and the Block's forward."""
    transformer, block = lm.Transformer, lm.Block
    if _TOKENS_DIR:
        forward = transformer.forward

        def logged_forward(self, tokens):
            logits = forward(self, tokens)
            _log_tokens("model", tokens, logits)
            return logits

        transformer.forward = logged_forward
    if _COMMS_DIR:
        transformer.__call__ = _within_forward(transformer.__call__)
    if _BLOCKS_DIR:
        block_forward = block.forward

        def counted_forward(self, x):
            import torch

            if torch.is_grad_enabled() or _in_backward():
                _STATE["blocks"][-1]["recomputed" if _in_backward() else "forward"] += 1
            return block_forward(self, x)

        block.forward = counted_forward


def _patch_pipelining(stage_module, schedules):
    stage_base = stage_module._PipelineStageBase
    forward = run_forward = stage_base.forward_one_chunk
    if _TOKENS_DIR:
        compute_loss = schedules._PipelineSchedule._compute_loss

        def logged_loss(self, output, target, *args, **kwargs):
            _log_tokens("targets", target, output)
            return compute_loss(self, output, target, *args, **kwargs)

        schedules._PipelineSchedule._compute_loss = logged_loss

        def logged_forward(self, chunk, args, *rest, **kwargs):
            output = forward(self, chunk, args, *rest, **kwargs)
            _log_tokens("stage", args[0] if self.is_first and args else None, output)
            return output

        run_forward = logged_forward
    if _COMMS_DIR:
        run_forward = _within_forward(run_forward)
    stage_base.forward_one_chunk = run_forward


# ----------------------------------------------------------------------------------- the collectives
def _comm_mode():
    import torch
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group
    from torch.distributed.tensor import DTensor
    from torch.utils._python_dispatch import TorchDispatchMode

    c10d, funcol = torch.ops.c10d, torch.ops._c10d_functional
    names = {"allreduce_", "allreduce_coalesced_", "allgather_", "_allgather_base_", "allgather_coalesced_",
             "allgather_into_tensor_coalesced_", "reduce_scatter_", "_reduce_scatter_base_",
             "reduce_scatter_tensor_coalesced_", "broadcast_", "gather_", "scatter_", "reduce_", "alltoall_",
             "alltoall_base_", "barrier", "send", "recv_", "recv_any_source_"}
    ops = {getattr(c10d, name): name for name in names if hasattr(c10d, name)}
    functional = {"all_reduce", "all_reduce_coalesced", "all_gather_into_tensor", "all_gather_into_tensor_coalesced",
                  "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced", "all_to_all_single", "broadcast"}
    ops.update({getattr(funcol, name): name for name in functional if hasattr(funcol, name)})
    ProcessGroup = torch._C._distributed_c10d.ProcessGroup

    def tensors(value):
        if isinstance(value, torch.Tensor):
            return [value]
        if isinstance(value, (list, tuple)):
            return [t for v in value for t in tensors(v)]
        return []

    def group_ranks(name, args):
        boxed = next((a for a in args if isinstance(a, torch.ScriptObject)
                      and "ProcessGroup" in str(a._type())), None)  # c10d's: the group, boxed
        if boxed is not None:
            group = ProcessGroup.unbox(boxed)
        else:  # the functional ones name their group
            group = _resolve_process_group(next(a for a in reversed(args) if isinstance(a, str)))
        ranks = dist.get_process_group_ranks(group)
        if name in ("send", "recv_"):  # (tensors, group, the peer's rank in the group, tag)
            return [dist.get_rank(), ranks[args[2]]]
        return ranks

    class Count(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            if DTensor in types:
                return NotImplemented  # DTensor first: it desugars into the collectives counted below
            name = ops.get(func._overloadpacket)
            if func is torch.ops.aten._local_scalar_dense.default and not _STATE["in_optimizer"]:
                name = "item"
            if name == "item":  # a host read (.item(), bool(), float()): where the CPU waits for the device
                phase = "backward" if _in_backward() else "step"
                _STATE["comms"][-1].append([name, phase, [], args[0].element_size(), _caller()])
            elif name is not None:
                phase = "backward" if _in_backward() else "forward" if getattr(_LOCAL, "forward", False) else "step"
                inputs = args[1] if name in ("_allgather_base_", "_reduce_scatter_base_") else args[0]
                size = sum(t.numel() * t.element_size() for t in tensors(inputs))
                _STATE["comms"][-1].append([name, phase, group_ranks(name, args), size])
            return func(*args, **(kwargs or {}))

    return Count()


def _caller():
    """The innermost frame outside torch and this file: "common/harness.py:all_reduce_max", "recipes/lm_ddp.py:main"."""
    frame = sys._getframe(2)
    while frame is not None and ("/torch/" in frame.f_code.co_filename or frame.f_code.co_filename == __file__):
        frame = frame.f_back
    if frame is None:
        return "?"
    path = frame.f_code.co_filename
    parts = path.split(os.sep)
    short = os.sep.join(parts[-2:]) if len(parts) > 1 else path
    return f"{short}:{frame.f_code.co_name}"


def _start_counting_comms():
    """The mode, on the main thread's stack for the rest of the process (entered once torch is imported)."""
    if getattr(_start_counting_comms, "mode", None) is None:
        _start_counting_comms.mode = _comm_mode()
        _start_counting_comms.mode.__enter__()


# ------------------------------------------------------------------------------------------- setup
def _on_lm(lm):
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    register_optimizer_step_pre_hook(lambda *args: _STATE.update(in_optimizer=True))
    register_optimizer_step_post_hook(_step_ends)
    _STATE["blocks"].append({"forward": 0, "recomputed": 0})
    _STATE["comms"].append([])
    _patch_lm(lm)
    if _TOKENS_DIR or _COMMS_DIR:
        import torch.distributed.pipelining.schedules as schedules
        import torch.distributed.pipelining.stage as stage_module

        _patch_pipelining(stage_module, schedules)
    if _COMMS_DIR:
        _start_counting_comms()


# What sitecustomize.py's import hook patches for this module, once it has run (the recipe imports torch before it).
PATCHES = {"common.lm": _on_lm} if _TOKENS_DIR or _BLOCKS_DIR or _COMMS_DIR else {}
