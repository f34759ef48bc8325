"""TEST DOUBLE of apex.parallel.DistributedDataParallel: like apex's delay_allreduce=True, one
all-reduce of every gradient, queued to run when backward finishes. Like apex 25.04
(apex/parallel/distributed.py), it broadcasts rank 0's parameters once, when it wraps the model, and
never the buffers: no broadcast in forward, unlike torch's DDP, so each rank's BatchNorm statistics
follow its own batches until the recipe broadcasts them itself."""

import torch
import torch.distributed as dist
from torch import nn

from apex import log


class DistributedDataParallel(nn.Module):
    def __init__(self, module, delay_allreduce=False, **kwargs):
        super().__init__()
        log(f"parallel.DistributedDataParallel delay_allreduce={delay_allreduce}")
        self.module = module
        self._queued = False
        with torch.no_grad():
            for p in module.parameters():
                dist.broadcast(p, 0)  # every rank starts from rank 0's weights (the buffers stay each rank's own)
        for p in module.parameters():
            if p.requires_grad:
                p.register_hook(self._queue_allreduce)

    def _queue_allreduce(self, grad):
        if not self._queued:
            self._queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._allreduce)
        return grad

    def _allreduce(self):
        log("parallel.allreduce")
        for p in self.module.parameters():
            if p.grad is not None:
                dist.all_reduce(p.grad)
                p.grad.div_(dist.get_world_size())
        self._queued = False

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)
