"""Instrumentation for tests/test_conformance.py: counts what DDP does, without touching the recipes.

Python imports this module at start-up when tests/instrument is on PYTHONPATH (every rank, spawned workers too).
With COUNT_DDP_DIR set, once torch's DistributedDataParallel is imported, each process counts
  grad_allreduces: gradient buckets all-reduced (through a comm hook that does what DDP's built-in one does:
                   divide by the world size, all-reduce);
  eval_forwards:   forwards through the DDP wrapper with autograd off (evaluation through the wrapper, whose
                   forward may broadcast buffers: a collective that hangs a rank whose shard has no batch),
and writes them to COUNT_DDP_DIR/rank<R>.json when the recipe calls dist.destroy_process_group().
Processes that never import DDP (launch.sh's port picker) do not pay for importing torch.
"""

import importlib.abc
import importlib.util
import json
import os
import sys
import weakref

_DIR = os.environ.get("COUNT_DDP_DIR")


def _patch(ddp_module):
    import torch
    import torch.distributed as dist
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    ddp, counts = ddp_module.DistributedDataParallel, {"grad_allreduces": 0, "eval_forwards": 0}
    wrapped = weakref.WeakSet()
    init, forward, destroy = ddp.__init__, ddp.forward, dist.destroy_process_group

    def counting_allreduce(state, bucket):
        counts["grad_allreduces"] += 1
        return allreduce_hook(state, bucket)

    def patched_init(self, *args, **kwargs):
        init(self, *args, **kwargs)
        self.register_comm_hook(None, counting_allreduce)
        wrapped.add(self)

    def patched_forward(self, *args, **kwargs):
        if not torch.is_grad_enabled():
            counts["eval_forwards"] += 1
        return forward(self, *args, **kwargs)

    def patched_destroy(*args, **kwargs):
        with open(os.path.join(_DIR, f"rank{dist.get_rank()}.json"), "w") as f:
            json.dump(counts, f)
        # Let the reducer, which holds the Python hook, go now: destroyed at interpreter exit instead, after Python
        # has shut down, it can abort the process ("terminate called without an active exception", seen twice).
        for model in wrapped:
            model.reducer = model.logger = None
        return destroy(*args, **kwargs)

    ddp.__init__, ddp.forward, dist.destroy_process_group = patched_init, patched_forward, patched_destroy


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Finds torch.nn.parallel.distributed as usual, and patches it once it has run."""

    def find_spec(self, name, path, target=None):
        if name != "torch.nn.parallel.distributed":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


if _DIR:
    sys.meta_path.insert(0, _PatchOnImport())
