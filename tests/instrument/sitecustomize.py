"""Instrumentation for the tests (test_conformance.py, test_recipe_variants.py, test_fsdp.py): what DDP, the RNG and
torch.load do, without touching the recipes.

Python imports this module at start-up when tests/instrument is on PYTHONPATH (every rank, spawned workers too).
With COUNT_DDP_DIR set, once torch's DistributedDataParallel is imported, each process counts
  grad_allreduces: gradient buckets DDP hands to its comm hook: the recipe's own (register_comm_hook, wrapped), or
                   where the recipe registers none, one registered at the first training forward that does what
                   DDP's built-in one does (divide by the world size, all-reduce; DDP multiplies by the reciprocal,
                   so on 3 ranks an element may round otherwise: compare such a run bitwise only with another);
  allreduce_bytes_per_step: per training forward through the wrapper, the bytes the comm hooks pass to
                   dist.all_reduce: torch's default_hooks and powerSGD_hook modules get a `dist` of their own whose
                   all_reduce counts (torch.distributed itself is untouched: the recipe's all-reduces of its meters
                   are not counted, and compiled code sees the real one); DDP's built-in fp32 all-reduce counts as the
                   hook above. PowerSGD's second all-reduce runs in a callback on gloo's thread: a lock keeps the sum;
  eval_forwards:   forwards through the DDP wrapper with autograd off (evaluation through the wrapper, whose
                   forward may broadcast buffers: a collective that hangs a rank whose shard has no batch),
  scaler_host_reads: GradScaler steps that read the inf flag on the host (GradScaler._maybe_opt_step, its
                   .item() per step: the CPU waits for the GPU); an optimizer with _step_supports_amp_scaling
                   (SGD(fused=True)) takes the flag on the device and makes none,
  buffer_syncs:    DDP's broadcasts of the module's buffers before a forward (DDP._sync_buffers),
  common_rank_agreements: DDP._find_common_rank calls: under Join, a blocking all_reduce and a host read (.item())
                   that pick the rank to copy buffers (each forward, with forward_sync_buffers) or final weights from,
  zero_broadcasts_per_step: per ZeroRedundancyOptimizer step, the broadcasts that share the stepped parameters
                   (its _sync_params: one per parameter tensor, or one per rank with parameters_as_bucket_view),
  debug_level:     torch.distributed's debug level as the process group ends ("DETAIL" under --debug-collectives),
and writes them to COUNT_DDP_DIR/rank<R>.json when the recipe calls dist.destroy_process_group().
With LOG_RNG_DIR set, each time a DataLoader whose sampler has an epoch (DistributedSampler: the training loader)
starts an epoch, the process appends {"world", "rank", "epoch", "rng"} to LOG_RNG_DIR/<pid>.jsonl, "rng" a digest
of the main process's CPU RNG state at that moment: where the epoch's worker seeds (non-persistent workers) and
main-process augmentation and CPU dropout start drawing from (rng_streams() in conftest.py reads them back).
With LOG_LOADS_DIR set, each torch.load of a file appends {"rank", "file", "map_location", "mmap"} to
LOG_LOADS_DIR/<pid>.jsonl ("file" the base name, "map_location" its repr, "mmap" as passed): where a checkpoint's
tensors went and whether the file was read or mapped (ddp_checkpoint's per-epoch reload of the weights; on this
CPU-only box the recipe's device is the CPU too, so the repr tells map_location="cpu" from map_location=device).
With COUNT_FSDP_DIR set, each process counts FSDP2's collectives per parameter group (fully_shard's unit: a block,
or "root" for the root module's own parameters) and per training step (optimizer steps delimit them): the
all-gathers FSDPParamGroup starts (foreach_all_gather: one for all of a group's parameters, before its forward, and
before its backward where the forward resharded) and its reduce-scatters (foreach_reduce, in post_backward, where
the group reduces its gradients), and writes COUNT_FSDP_DIR/rank<R>.json at each step and at exit:
{"steps": [{group: {"all_gather": n, "reduce_scatter": n}}, one per step], "eval_all_gathers": {group: n} (forwards
with autograd off, evaluation's), "after_last_step": what came after the last step}. A mesh dimension of one rank
makes none (FSDP2 skips the collective).
With LOG_PP_DIR set, each call of a torch.distributed.pipelining single-stage schedule's step() (or eval(), which
calls it with backward off) appends {"rank", "stage", "stages", "schedule", "microbatches", "kind": "step" or
"eval", "actions": [["F" or "B", microbatch], ...]} to LOG_PP_DIR/rank<R>.jsonl: the forwards and backwards the
stage ran (PipelineStage.forward_one_chunk, backward_one_chunk where the stage has a backward: eval() calls it too,
and it returns at once), in the order it ran them.
With LOG_SAMPLES_DIR set, each batch of indices a map-style DataLoader takes from its sampler (the batch it loads
next: with workers, those dispatched ahead too) appends {"rank", "world", "kind", "pass", "indices"} to
LOG_SAMPLES_DIR/<pid>.jsonl: "kind" "eval" for a loader over a SequentialSampler (the validation shards), "train"
otherwise (DistributedSampler, RandomSampler, SkipFirst); "pass" counts that process's iterations of loaders of that
kind (a training epoch, an evaluation) from 0; "indices" resolved through any Subset to the dataset beneath (the
sample ids each rank computes). samples_seen() in conftest.py reads them back.
With LOG_LAYERS_DIR set, each process records the distinct (mode, layer, input, weight, output) its nn.Conv2d and
nn.Linear modules meet: mode "train" (autograd on), "train_no_grad" (a module in train mode, autograd off: the
BatchNorm recompute before evaluating) or "eval"; layer "Conv2d" or "Linear" (FSDP's subclasses too); the memory
format of the input and weight ("channels_last", "contiguous", or "either" where both hold, as for a 1 x 1 image);
the output's dtype. It rewrites LOG_LAYERS_DIR/<pid>.json each time a new one appears (layers_seen() in
conftest.py reads them). Code that torch.compile traces records nothing (what --channels-last and --amp-dtype change
in the eager recipes).
With LOG_BUCKETS_DIR set, each forward through the DDP wrapper with autograd on appends to LOG_BUCKETS_DIR/rank<R>.jsonl
the gradient buckets that forward's backward reduces, [[bucket index, [the shape of each parameter in it, in the
bucket's order]], ...] (Reducer._get_zeros_like_grad_buckets, read after the forward, where DDP rebuilds its buckets
once): where each gradient element sits in the all-reduce. It registers no comm hook: COUNT_DDP_DIR's divides each
gradient by the world size where DDP's built-in reduction multiplies it by the reciprocal (reducer.cpp), so on 3
ranks a run counted rounds otherwise than one not counted; a run logged here is bitwise the run not logged.
With UNEVEN_INIT set, each rank's model differs from rank 0's as common.models.build_model returns it (every
floating parameter and buffer plus 0.01 x the rank), as where each rank drew or loaded its initial weights on its
own: DistributedDataParallel's wrap broadcasts rank 0's, and whatever a recipe built from them before the wrap
(apex_amp's O2 fp32 masters) must follow, or the ranks train apart.
Processes that never import those modules (launch.sh's port picker) do not pay for importing torch.
"""

import hashlib
import importlib.abc
import importlib.util
import json
import os
import sys
import threading
import weakref

import lm_claims  # the language models' measurements (tests/instrument/lm_claims.py): their PATCHES below

_DIR = os.environ.get("COUNT_DDP_DIR")
_RNG_DIR = os.environ.get("LOG_RNG_DIR")
_LOADS_DIR = os.environ.get("LOG_LOADS_DIR")
_FSDP_DIR = os.environ.get("COUNT_FSDP_DIR")
_PP_DIR = os.environ.get("LOG_PP_DIR")
_SAMPLES_DIR = os.environ.get("LOG_SAMPLES_DIR")
_LAYERS_DIR = os.environ.get("LOG_LAYERS_DIR")
_BUCKETS_DIR = os.environ.get("LOG_BUCKETS_DIR")
_UNEVEN_INIT = os.environ.get("UNEVEN_INIT")


def _rank():
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else int(os.environ.get("RANK", 0))


def _patch(ddp_module):
    import torch
    import torch.distributed as dist
    from torch.amp.grad_scaler import GradScaler
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks, powerSGD_hook
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    ddp = ddp_module.DistributedDataParallel
    counts = _COUNTS
    per_step = []  # allreduce_bytes_per_step
    wrapped = weakref.WeakSet()
    forward, register, destroy = ddp.forward, ddp.register_comm_hook, dist.destroy_process_group
    sync_buffers, common_rank = ddp._sync_buffers, ddp._find_common_rank
    lock = threading.Lock()

    def counting(hook):
        def counted(state, bucket):
            counts["grad_allreduces"] += 1
            return hook(state, bucket)
        return counted

    def patched_register(self, state, hook):
        register(self, state, counting(hook))
        wrapped.add(self)

    def patched_forward(self, *args, **kwargs):
        if not torch.is_grad_enabled():
            counts["eval_forwards"] += 1
        else:
            if self not in wrapped:  # the recipe registered no hook: count DDP's own all-reduce, done in Python,
                patched_register(self, self.process_group, allreduce_hook)  # on DDP's group (not WORLD's)
            per_step.append(0)
        return forward(self, *args, **kwargs)

    def count_bytes(tensor, *args, **kwargs):  # all_reduce's bytes, into the current step
        with lock:
            if per_step:
                per_step[-1] += tensor.numel() * tensor.element_size()

    maybe_opt_step = GradScaler._maybe_opt_step

    def counting_opt_step(self, *args, **kwargs):
        counts["scaler_host_reads"] += 1
        return maybe_opt_step(self, *args, **kwargs)

    def counting_sync_buffers(self):
        counts["buffer_syncs"] += 1
        return sync_buffers(self)

    def counting_common_rank(self, *args):
        counts["common_rank_agreements"] += 1
        return common_rank(self, *args)

    def patched_destroy(*args, **kwargs):
        with open(os.path.join(_DIR, f"rank{dist.get_rank()}.json"), "w") as f:
            json.dump({**counts, "allreduce_bytes_per_step": per_step, "debug_level": dist.get_debug_level().name}, f)
        # Let the reducer, which holds the Python hook, go now: destroyed at interpreter exit instead, after Python
        # has shut down, it can abort the process ("terminate called without an active exception", seen twice).
        for model in wrapped:
            model.reducer = model.logger = None
        return destroy(*args, **kwargs)

    ddp.forward, ddp.register_comm_hook, dist.destroy_process_group = patched_forward, patched_register, patched_destroy
    default_hooks.dist = powerSGD_hook.dist = _counting_dist("all_reduce", count_bytes)
    GradScaler._maybe_opt_step = counting_opt_step
    ddp._sync_buffers, ddp._find_common_rank = counting_sync_buffers, counting_common_rank


def _patch_buckets(ddp_module):
    import torch

    ddp = ddp_module.DistributedDataParallel
    forward = ddp.forward

    def logged_forward(self, *args, **kwargs):
        output = forward(self, *args, **kwargs)
        if torch.is_grad_enabled():
            buckets = [[b.index(), [list(p.shape) for p in b.parameters()]]
                       for b in self.reducer._get_zeros_like_grad_buckets()]
            with open(os.path.join(_BUCKETS_DIR, f"rank{_rank()}.jsonl"), "a") as f:
                f.write(json.dumps(buckets) + "\n")
        return output

    ddp.forward = logged_forward


def _patch_build_model(models_module):
    import torch

    build = models_module.build_model

    def uneven_build(*args, **kwargs):
        model = build(*args, **kwargs)
        with torch.no_grad():
            for tensor in [*model.parameters(), *model.buffers()]:
                if tensor.is_floating_point():
                    tensor.add_(0.01 * _rank())
        return model

    models_module.build_model = uneven_build


def _patch_ddp(ddp_module):
    if _DIR:
        _patch(ddp_module)
    if _BUCKETS_DIR:
        _patch_buckets(ddp_module)


def _counting_dist(name, count):
    """A `dist` for one of torch's modules to use instead of torch.distributed: the same, but its `name` function
    calls count(*args, **kwargs) first. torch.distributed itself is untouched (the recipes' own calls)."""
    import torch.distributed as dist

    def counted(self, *args, **kwargs):
        count(*args, **kwargs)
        return getattr(dist, name)(*args, **kwargs)

    proxy = type("CountingDist", (), {"__getattr__": lambda self, attr: getattr(dist, attr), name: counted})
    return proxy()


def _patch_zero(zero_module):
    """ZeroRedundancyOptimizer's module gets a `dist` of its own whose broadcast counts into the current step."""
    zero, sync_params = zero_module.ZeroRedundancyOptimizer, zero_module.ZeroRedundancyOptimizer._sync_params
    steps, in_step = _COUNTS["zero_broadcasts_per_step"], [False]  # consolidate_state_dict's broadcasts: not counted

    def count_broadcast(*args, **kwargs):
        if in_step[0]:
            steps[-1] += 1

    def counting_sync_params(self):
        steps.append(0)
        in_step[0] = True
        try:
            return sync_params(self)
        finally:
            in_step[0] = False

    zero._sync_params = counting_sync_params
    zero_module.dist = _counting_dist("broadcast", count_broadcast)


def _patch_loader(loader_module):
    loader, start = loader_module.DataLoader, loader_module.DataLoader.__iter__

    def patched_iter(self):
        import torch  # here, not above: torch is still being imported when its DataLoader module is
        import torch.distributed as dist

        epoch = getattr(self.sampler, "epoch", None)
        if epoch is not None:
            world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
            rng = hashlib.sha1(torch.get_rng_state().numpy().tobytes()).hexdigest()[:16]
            with open(os.path.join(_RNG_DIR, f"{os.getpid()}.jsonl"), "a") as f:
                f.write(json.dumps({"world": world, "rank": rank, "epoch": epoch, "rng": rng}) + "\n")
        return start(self)

    loader.__iter__ = patched_iter


def _patch_samples(loader_module):
    """Each batch of indices a loader takes from its sampler, logged under the loader's kind and pass."""
    loader, base = loader_module.DataLoader, loader_module._BaseDataLoaderIter
    start, next_index, passes = loader.__iter__, base._next_index, {}

    def patched_iter(self):
        from torch.utils.data import SequentialSampler, Subset

        kind = "eval" if isinstance(self.sampler, SequentialSampler) else "train"
        passes[kind] = passes.get(kind, -1) + 1
        dataset, maps = self.dataset, []
        while isinstance(dataset, Subset):  # the ids of the dataset beneath every Subset
            maps.append(dataset.indices)
            dataset = dataset.dataset
        # On the index sampler the iterator draws from, before it starts: persistent workers' iterators take their
        # first batches' indices in _reset, inside __iter__.
        sampler = self.batch_sampler if self.batch_sampler is not None else self.sampler
        sampler._logged_pass = (kind, passes[kind], maps)
        return start(self)

    def logged_next_index(self):
        import torch.distributed as dist

        indices = next_index(self)
        logged = getattr(self._index_sampler, "_logged_pass", None)
        if logged is not None:
            kind, n, maps = logged
            ids = list(indices) if isinstance(indices, (list, tuple)) else [indices]
            for indices_of in maps:
                ids = [indices_of[i] for i in ids]
            world, rank = (dist.get_world_size(), dist.get_rank()) if dist.is_initialized() else (1, 0)
            with open(os.path.join(_SAMPLES_DIR, f"{os.getpid()}.jsonl"), "a") as f:
                f.write(json.dumps({"rank": rank, "world": world, "kind": kind, "pass": n,
                                    "indices": [int(i) for i in ids]}) + "\n")
        return indices

    loader.__iter__, base._next_index = patched_iter, logged_next_index


def _patch_dataloader(loader_module):
    if _RNG_DIR:
        _patch_loader(loader_module)
    if _SAMPLES_DIR:
        _patch_samples(loader_module)


def _memory_format(tensor):
    import torch

    if tensor.dim() != 4:
        return "contiguous" if tensor.is_contiguous() else "other"
    last, plain = tensor.is_contiguous(memory_format=torch.channels_last), tensor.is_contiguous()
    return "either" if last and plain else "channels_last" if last else "contiguous" if plain else "other"


_LAYERS = set()


def _record_layer(module, layer, input, weight, output):
    import torch

    mode = "train" if torch.is_grad_enabled() else "train_no_grad" if module.training else "eval"
    seen = (mode, layer, _memory_format(input), _memory_format(weight),
            str(output.dtype).removeprefix("torch."))
    if seen not in _LAYERS:
        _LAYERS.add(seen)
        with open(os.path.join(_LAYERS_DIR, f"{os.getpid()}.json"), "w") as f:
            json.dump({"rank": _rank(), "seen": sorted(_LAYERS)}, f)


def _patch_conv(conv_module):
    import torch

    conv = conv_module.Conv2d
    conv_forward = conv._conv_forward

    def recorded(self, input, weight, bias):
        output = conv_forward(self, input, weight, bias)
        if not torch.compiler.is_compiling():  # traced by dynamo: nothing (a graph break otherwise)
            _record_layer(self, "Conv2d", input, weight, output)
        return output

    conv._conv_forward = recorded


def _patch_linear(linear_module):
    import torch

    linear = linear_module.Linear
    forward = linear.forward

    def recorded(self, input):
        output = forward(self, input)
        if not torch.compiler.is_compiling():
            _record_layer(self, "Linear", input, self.weight, output)
        return output

    linear.forward = recorded


def _patch_load(torch):
    load = torch.load

    os.makedirs(_LOADS_DIR, exist_ok=True)

    def logged_load(f, map_location=None, *args, mmap=None, **kwargs):
        if isinstance(f, (str, os.PathLike)):  # a file, not the buffers all_gather_object unpickles
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            with open(os.path.join(_LOADS_DIR, f"{os.getpid()}.jsonl"), "a") as log:
                log.write(json.dumps({"rank": rank, "file": os.path.basename(f), "map_location": repr(map_location),
                                      "mmap": mmap}) + "\n")
        return load(f, map_location, *args, mmap=mmap, **kwargs)

    torch.load = logged_load


def _patch_fsdp(group_module):
    """FSDPParamGroup's all-gathers and reduce-scatters, each counted under the group that starts it."""
    import atexit

    import torch
    from torch.optim.optimizer import register_optimizer_step_post_hook

    groups, current = group_module.FSDPParamGroup, threading.local()
    record = {"steps": [], "eval_all_gathers": {}, "after_last_step": {}}

    def name(group):
        return (group._module_fqn or "root") if group is not None else "unknown"

    def within(method):  # the group whose method runs: the collectives below are its
        def run(self, *args, **kwargs):
            outer, current.group = getattr(current, "group", None), self
            try:
                return method(self, *args, **kwargs)
            finally:
                current.group = outer
        return run

    def counting(kind, collective):
        def counted(*args, **kwargs):
            group = getattr(current, "group", None)
            evaluating = (kind == "all_gather" and not torch.is_grad_enabled() and group is not None
                          and group._training_state.name == "FORWARD")
            if evaluating:
                record["eval_all_gathers"][name(group)] = record["eval_all_gathers"].get(name(group), 0) + 1
            else:
                counts = record["after_last_step"].setdefault(name(group), {"all_gather": 0, "reduce_scatter": 0})
                counts[kind] += 1
            return collective(*args, **kwargs)
        return counted

    def write(*args):
        with open(os.path.join(_FSDP_DIR, f"rank{_rank()}.json"), "w") as f:
            json.dump(record, f)

    def step_ends(*args):
        record["steps"].append(record["after_last_step"])
        record["after_last_step"] = {}
        write()

    for method in ("unshard", "post_backward"):
        setattr(groups, method, within(getattr(groups, method)))
    group_module.foreach_all_gather = counting("all_gather", group_module.foreach_all_gather)
    group_module.foreach_reduce = counting("reduce_scatter", group_module.foreach_reduce)
    register_optimizer_step_post_hook(step_ends)
    atexit.register(write)


def _patch_pipelining(schedules):
    """Each single-stage schedule's step() (and eval()) logs the forwards and backwards its stage runs, in order."""
    stage_base = sys.modules["torch.distributed.pipelining.stage"]._PipelineStageBase
    single, running = schedules.PipelineScheduleSingle, [None]
    step, forward, backward = single.step, stage_base.forward_one_chunk, stage_base.backward_one_chunk

    def logged_step(self, *args, **kwargs):
        kind, running[0] = "step" if self._has_backward else "eval", []
        try:
            return step(self, *args, **kwargs)
        finally:
            actions, running[0] = running[0], None
            line = {"rank": _rank(), "stage": self._stage.stage_index, "stages": self._stage.num_stages,
                    "schedule": type(self).__name__, "microbatches": self._n_microbatches, "kind": kind,
                    "actions": actions}
            with open(os.path.join(_PP_DIR, f"rank{_rank()}.jsonl"), "a") as f:
                f.write(json.dumps(line) + "\n")

    def logged_forward(self, chunk, *args, **kwargs):
        if running[0] is not None:
            running[0].append(["F", chunk])
        return forward(self, chunk, *args, **kwargs)

    def logged_backward(self, chunk, *args, **kwargs):
        if running[0] is not None and self.has_backward:  # eval(): the schedule calls it, and it returns at once
            running[0].append(["B", chunk])
        return backward(self, chunk, *args, **kwargs)

    single.step = logged_step
    stage_base.forward_one_chunk, stage_base.backward_one_chunk = logged_forward, logged_backward


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds the modules in `patches` as usual, and patches each once it has run."""

    def __init__(self, patches):
        self.patches = patches

    def find_spec(self, name, path, target=None):
        if name not in self.patches:
            return None
        patch = self.patches.pop(name)
        if not self.patches:
            sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            patch(module)

        spec.loader.exec_module = exec_module
        return spec


_COUNTS = {"grad_allreduces": 0, "eval_forwards": 0, "scaler_host_reads": 0, "buffer_syncs": 0,
           "common_rank_agreements": 0, "zero_broadcasts_per_step": []}
_PATCHES = {**({"torch.nn.parallel.distributed": _patch_ddp} if _DIR or _BUCKETS_DIR else {}),
            **({"common.models": _patch_build_model} if _UNEVEN_INIT else {}),
            **({"torch.distributed.optim.zero_redundancy_optimizer": _patch_zero} if _DIR else {}),
            **({"torch.utils.data.dataloader": _patch_dataloader} if _RNG_DIR or _SAMPLES_DIR else {}),
            **({"torch.nn.modules.conv": _patch_conv, "torch.nn.modules.linear": _patch_linear} if _LAYERS_DIR
               else {}),
            **({"torch": _patch_load} if _LOADS_DIR else {}),
            **({"torch.distributed.fsdp._fully_shard._fsdp_param_group": _patch_fsdp} if _FSDP_DIR else {}),
            **({"torch.distributed.pipelining.schedules": _patch_pipelining} if _PP_DIR else {}),
            **lm_claims.PATCHES}  # the language models' (tests/instrument/lm_claims.py)
for _name in [name for name in _PATCHES if name in sys.modules]:  # imported already: a rank forked from
    _PATCHES.pop(_name)(sys.modules[_name])  # tests/warm_server.py, which imported torch before this ran
if _PATCHES:
    sys.meta_path.insert(0, _PatchOnImport(_PATCHES))
