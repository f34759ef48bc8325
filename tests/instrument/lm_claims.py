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
  all_reduce_max": the stop vote's ballot, a CPU tensor). lm_moe.py's runs add, per MoE layer's training forward, a
  "route" record and an "expert" record per expert it runs (_route), and at the end of the first step ["parameters",
  "step", [], bytes]: every nn.Parameter alive in the process (the garbage collector's, each once), held by the
  model or by anything else.
With COUNT_SAVED_DIR set, each rank records, per backward (torch.autograd.backward: a tensor's .backward(), a
  pipeline stage's backward of a microbatch; none inside another backward), {"saved": bytes, "saved_in_blocks":
  bytes, "grads": bytes}, and rewrites COUNT_SAVED_DIR/rank<R>.json at each step: {"steps": [[one per backward] per
  step]}. "saved": the bytes autograd saved for backward since the last backward, in training forwards (from the
  call of a common.lm.Transformer, or a stage's forward_one_chunk, autograd on, to the backward: the loss included),
  counted as tools/lm_bench.py's activation_bytes counts them (torch.autograd.graph.saved_tensors_hooks, each
  storage once, a DTensor's local shard, parameters left out: an nn.Parameter or a view of one, FSDP2's unsharded
  ones too, or a storage of the model's parameters); "saved_in_blocks": those first saved inside a
  common.lm.Block's forward (under --activation-checkpointing none: the checkpoint saves each block's input before
  the block runs, outside it). "grads": the bytes of .grad the rank holds just after that backward (FSDP2's
  post-backward included: it runs inside), each tensor once, a DTensor's local shard: of the parameters the
  backward accumulated into (its graph's leaves: FSDP2's unsharded parameters between --accum-steps' micro-steps)
  and of the model's own parameters (FSDP2's shards, where its reduce-scatter put the gradients).
None of it changes what the recipe computes: the hooks read tensors and call through (the saved-tensor hooks keep
what autograd saves as it is).
With LOG_ADAMW_DIR set, each rank rewrites LOG_ADAMW_DIR/rank<R>.json as each optimizer step starts (torch's global
  pre-hook; DCP's get_state_dict steps a fresh optimizer once too): {"steps": [[{"fused": ..., "foreach": ...} of each
  param group] one per step], "step_devices": [[the devices its parameters' step counts are on] one per step]}, the
  implementation each step ran with and where its counts were (fused: the parameters' device; foreach: the host).
  ADAMW_AS (a JSON object) is what common.lm.adamw_implementation returns instead of its choice, as another torch
  would choose ('{"foreach": true}': torch 2.10 and 2.11 on DTensors): a run writing a checkpoint as that torch
  would, or resuming one where it runs.
"""

import json
import os
import sys
import threading
import weakref

_TOKENS_DIR = os.environ.get("LOG_TOKENS_DIR")
_BLOCKS_DIR = os.environ.get("COUNT_BLOCKS_DIR")
_COMMS_DIR = os.environ.get("COUNT_COMMS_DIR")
_SAVED_DIR = os.environ.get("COUNT_SAVED_DIR")
_ADAMW_DIR = os.environ.get("LOG_ADAMW_DIR")
_ADAMW_AS = os.environ.get("ADAMW_AS")
_STATE = {"step": 0, "blocks": [], "comms": [], "saved": [], "in_optimizer": False}
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
    if _COMMS_DIR and _EXPERTS and _STATE["step"] == 1:  # lm_moe.py: what its first step ended holding
        _STATE["comms"][-1].append(["parameters", "step", [], _parameter_bytes()])
    if _BLOCKS_DIR:
        _STATE["blocks"].append({"forward": 0, "recomputed": 0})
        _write(_BLOCKS_DIR, {"steps": _STATE["blocks"][:-1]})
    if _COMMS_DIR:
        _STATE["comms"].append([])
        _write(_COMMS_DIR, {"steps": _STATE["comms"][:-1]})
    if _SAVED_DIR:
        _SAVING.stop()  # a training forward without a backward (none in the recipes): its bytes go with nothing
        _STATE["saved"].append([])
        os.makedirs(_SAVED_DIR, exist_ok=True)
        _write(_SAVED_DIR, {"steps": _STATE["saved"][:-1]})


def _parameter_bytes():
    """The bytes of every nn.Parameter alive in this process, found by the garbage collector after a collection (each
    object once): the weights it holds, whether the model still reaches them or something else keeps them alive."""
    import gc

    import torch

    gc.collect()
    return sum(o.numel() * o.element_size() for o in gc.get_objects() if type(o) is torch.nn.Parameter)


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
    if _COMMS_DIR:  # and lm_moe.py's: each MoE layer's routing, seen from its input, and the experts each rank runs
        import torch

        transformer.__call__ = _within_forward(transformer.__call__)
        torch.nn.modules.module.register_module_forward_pre_hook(_route)
        mlp_forward = lm.MLP.forward

        def expert_forward(self, x):
            if id(self) in _EXPERTS and torch.is_grad_enabled() and not _in_backward():
                _STATE["comms"][-1].append(["expert", "forward", [], x.shape[0], _EXPERTS[id(self)]])
            return mlp_forward(self, x)

        lm.MLP.forward = expert_forward
    if _BLOCKS_DIR:
        block_forward = block.forward

        def counted_forward(self, x):
            import torch

            if torch.is_grad_enabled() or _in_backward():
                _STATE["blocks"][-1]["recomputed" if _in_backward() else "forward"] += 1
            return block_forward(self, x)

        block.forward = counted_forward
    if _SAVED_DIR:
        call, inner_forward = transformer.__call__, block.forward

        def saving_call(self, *args, **kwargs):
            _SAVING.start(self)
            return call(self, *args, **kwargs)

        def forward_in_block(self, x):
            _SAVING.in_block += 1
            try:
                return inner_forward(self, x)
            finally:
                _SAVING.in_block -= 1

        transformer.__call__, block.forward = saving_call, forward_in_block


_EXPERTS = {}  # id(an expert of lm_moe.py's MoE layers) -> its global index, as seen in a training forward


def _route(module, args):
    """Before an lm_moe.py MoE layer's training forward: the experts its router chooses for each token (the top-k of
    its gates, computed again here from the layer's input, apart from the recipe's own lines), counted per expert:
    ["route", "forward", [], 0, [rows for expert 0, 1, ...]]; and its experts' global indices (for "expert" records:
    ["expert", "forward", [], rows, index], one per expert's training forward)."""
    import torch

    if type(module).__name__ != "MoE" or not torch.is_grad_enabled() or _in_backward():
        return
    _EXPERTS.update({id(expert): int(name) for name, expert in module.experts.items()})
    x = args[0]
    with torch.no_grad():
        chosen = module.router(x.reshape(-1, x.shape[-1])).float().topk(module.top_k, dim=-1).indices
        counts = torch.bincount(chosen.flatten().cpu(), minlength=module.n_experts)
    _STATE["comms"][-1].append(["route", "forward", [], 0, [int(c) for c in counts.numpy()]])


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
    if _SAVED_DIR:
        chunk_forward = run_forward

        def saving_forward(self, *args, **kwargs):
            _SAVING.start(self.submod)  # on until the stage's next backward: the last stage's loss_fn too
            return chunk_forward(self, *args, **kwargs)

        run_forward = saving_forward
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
    # inductor's in-place and out= variants (--compile: the functional ones re-inplaced), named as the ops they replace
    ops.update({getattr(funcol, name): name.removesuffix("_").removesuffix("_out") for name in
                ("all_reduce_", "all_reduce_coalesced_", "all_gather_into_tensor_out") if hasattr(funcol, name)})
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
        @classmethod
        def ignore_compile_internals(cls):
            # --compile: dynamo compiles under this mode (without it, it compiles nothing: "non-infra torch dispatch
            # mode present"), the mode off while it traces and on while the compiled code runs.
            return True

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
                inputs = args[1] if name in ("_allgather_base_", "_reduce_scatter_base_", "alltoall_base_") else \
                    args[0]
                size = sum(t.numel() * t.element_size() for t in tensors(inputs))
                record = [name, phase, group_ranks(name, args), size]
                if name == "alltoall_base_":  # (output, input, group, output splits, input splits, timeout): rows
                    record += [list(args[4]), list(args[3])]  # sent to, received from each rank of the group
                _STATE["comms"][-1].append(record)
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


# ------------------------------------------------------------------- what autograd saves, the gradients held
def _local(tensor):
    """A DTensor's local shard; any other tensor as it is."""
    from torch.distributed.tensor import DTensor

    return tensor._local_tensor if isinstance(tensor, DTensor) else tensor


def _is_parameter(tensor):
    """An nn.Parameter (a DTensor one, FSDP2's unsharded ones) or a view of one (a weight's transpose)."""
    from torch.nn import Parameter

    return isinstance(tensor, Parameter) or isinstance(tensor._base, Parameter)


class _Saving:
    """COUNT_SAVED_DIR's saved-tensor hooks: on from a training forward's start (autograd on, not inside a backward)
    until the next backward, counting what autograd saves as tools/lm_bench.py's activation_bytes does."""

    def __init__(self):
        self.hooks = None  # the saved_tensors_hooks context, while on
        self.model = None  # a weak reference to the module whose training forward turned them on last
        self.params = set()  # its parameters' storages (data_ptr), left out
        self.storages = {}  # data_ptr: (bytes, saved inside a Block's forward), since they went on
        self.in_block = 0  # how deep in common.lm.Block forwards

    def start(self, model):
        import torch

        if self.hooks is not None or not torch.is_grad_enabled() or _in_backward():
            return
        self.model = weakref.ref(model)
        self.params = {_local(p).untyped_storage().data_ptr() for p in model.parameters()}
        self.hooks = torch.autograd.graph.saved_tensors_hooks(self.pack, _unpack)
        self.hooks.__enter__()

    def pack(self, tensor):
        local = _local(tensor)
        if not _is_parameter(tensor) and not local.is_meta:  # meta: a pipeline stage's shape inference
            storage = local.untyped_storage()
            if storage.data_ptr() not in self.params:
                self.storages.setdefault(storage.data_ptr(), (storage.nbytes(), self.in_block > 0))
        return tensor  # kept as it is

    def stop(self):
        """The hooks off. (bytes saved since they went on, those inside a Block's forward)."""
        if self.hooks is not None:
            self.hooks.__exit__(None, None, None)
            self.hooks = None
        saved = (sum(n for n, _ in self.storages.values()), sum(n for n, inside in self.storages.values() if inside))
        self.storages = {}
        return saved


def _unpack(tensor):
    return tensor


_SAVING = _Saving()


def _graph_parameters(tensors):
    """The parameters a backward from `tensors` accumulates into: its graph's AccumulateGrad nodes' variables."""
    import torch
    from torch.nn import Parameter

    roots = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
    todo = [t.grad_fn for t in roots if isinstance(t, torch.Tensor) and t.grad_fn is not None]
    seen, found = set(), []
    while todo:
        node = todo.pop()
        if node is None or node in seen:
            continue
        seen.add(node)  # (held: the same Python object for the node each time)
        variable = getattr(node, "variable", None)
        if isinstance(variable, Parameter):
            found.append(variable)
        todo.extend(fn for fn, _ in node.next_functions)
    return found


def _grad_bytes(params):
    """Bytes of the .grad of `params` (a DTensor's local shard), each gradient tensor once."""
    held = {}
    for p in params:
        if p.grad is not None:
            local = _local(p.grad)
            held[local.data_ptr(), local.numel()] = local.numel() * local.element_size()
    return sum(held.values())


def _patch_backward(autograd):
    """torch.autograd.backward (what Tensor.backward and the pipeline's stage_backward call): the saved-tensor hooks
    off and their count, the run, then the gradients held, one record per backward."""
    backward = autograd.backward

    def counted_backward(tensors, *args, **kwargs):
        if _in_backward():  # inside another backward (a reentrant checkpoint's): part of that one
            return backward(tensors, *args, **kwargs)
        saved, in_blocks = _SAVING.stop()
        params = _graph_parameters(tensors)
        result = backward(tensors, *args, **kwargs)
        model = _SAVING.model() if _SAVING.model is not None else None
        grads = _grad_bytes(params + (list(model.parameters()) if model is not None else []))
        _STATE["saved"][-1].append({"saved": saved, "saved_in_blocks": in_blocks, "grads": grads})
        return result

    autograd.backward = counted_backward


# ------------------------------------------------------------------------------------------- setup
def _on_lm(lm):
    from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

    register_optimizer_step_pre_hook(lambda *args: _STATE.update(in_optimizer=True))
    register_optimizer_step_post_hook(_step_ends)
    _STATE["blocks"].append({"forward": 0, "recomputed": 0})
    _STATE["comms"].append([])
    _STATE["saved"].append([])
    _patch_lm(lm)
    if _SAVED_DIR:
        import torch.autograd

        _patch_backward(torch.autograd)
    if _TOKENS_DIR or _COMMS_DIR or _SAVED_DIR:
        import torch.distributed.pipelining.schedules as schedules
        import torch.distributed.pipelining.stage as stage_module

        _patch_pipelining(stage_module, schedules)
    if _COMMS_DIR:
        _start_counting_comms()


def _patch_adamw(lm):
    """ADAMW_AS and LOG_ADAMW_DIR (the module's docstring)."""
    if _ADAMW_AS:
        chosen = json.loads(_ADAMW_AS)
        lm.adamw_implementation = lambda dtensor: dict(chosen)
    if _ADAMW_DIR:
        from torch.optim.optimizer import register_optimizer_step_pre_hook

        steps, devices = [], []

        def log(optimizer, args, kwargs):
            steps.append([{key: group.get(key) for key in ("fused", "foreach")} for group in optimizer.param_groups])
            devices.append(sorted({str(s["step"].device) for s in optimizer.state.values() if "step" in s}))
            _write(_ADAMW_DIR, {"steps": steps, "step_devices": devices})

        register_optimizer_step_pre_hook(log)


def _on_common_lm(lm):
    if _TOKENS_DIR or _BLOCKS_DIR or _COMMS_DIR or _SAVED_DIR:
        _on_lm(lm)
    _patch_adamw(lm)


# What sitecustomize.py's import hook patches for this module, once it has run (the recipe imports torch before it).
PATCHES = {"common.lm": _on_common_lm} if _TOKENS_DIR or _BLOCKS_DIR or _COMMS_DIR or _SAVED_DIR or _ADAMW_DIR \
    or _ADAMW_AS else {}
