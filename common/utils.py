"""Meters, top-k accuracy, rank-0 printing, one-line errors and the RESULT line."""

import json
import os
import re
import resource
import sys

import torch
import torch.distributed as dist


def _rank():
    # Before init_process_group the launcher's RANK is the only source; after it, ask the group.
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank()
    return int(os.environ.get("RANK", 0))


def print0(*args, **kwargs):
    """print() on rank 0 only, flushed, so N processes do not print N interleaved copies."""
    if _rank() == 0:
        print(*args, **kwargs, flush=True)


def die(message, code=2, all_ranks=False):
    """Exit with one line on stderr. all_ranks=False: the error is the same everywhere, rank 0 says it."""
    if all_ranks or _rank() == 0:
        prefix = f"[rank {_rank()}] " if all_ranks else ""
        print(f"{prefix}error: {message}", file=sys.stderr, flush=True)
    sys.exit(code)


class AverageMeter:
    """Running sum and count; all_reduce() makes them global so every rank reports the same average."""

    def __init__(self):
        self.sum = 0.0
        self.count = 0

    def update(self, value, n=1):
        self.sum += float(value) * n
        self.count += n

    @property
    def avg(self):
        return self.sum / max(self.count, 1)

    def all_reduce(self, device):
        """Sum over ranks (no-op without a process group). device: cuda for nccl, cpu for gloo."""
        if dist.is_available() and dist.is_initialized():
            t = torch.tensor([self.sum, self.count], dtype=torch.float64, device=device)
            dist.all_reduce(t)
            self.sum, self.count = t[0].item(), int(t[1].item())
        return self


def accuracy(output, target, topk=(1,)):
    """Top-k accuracy in percent of the batch, one float per k."""
    maxk = min(max(topk), output.size(1))
    pred = output.topk(maxk, dim=1).indices
    correct = pred.eq(target.unsqueeze(1))
    return [correct[:, : min(k, maxk)].any(dim=1).float().mean().item() * 100.0 for k in topk]


def peak_memory_mb(device):
    """Peak memory of this process: CUDA allocator peak on GPU, max resident set size on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def result_line(**fields):
    """The one machine-readable line tests, benchmarks and scripts grep for: RESULT {json}."""
    return "RESULT " + json.dumps(fields, sort_keys=False)


def unused_parameters_error(exc, module):
    """One line for DDP's unused-parameter RuntimeError (naming the parameters), or None for other errors."""
    text = str(exc)
    if "find_unused_parameters" not in text:
        return None
    names = [name for name, _ in module.named_parameters()]
    found = re.search(r"did not receive grad for rank \d+: ([\d ]+)", text)
    indices = [int(i) for i in found.group(1).split()] if found else []
    which = ", ".join(names[i] for i in indices if i < len(names)) or "some parameters"
    return (f"{which} got no gradient (the forward pass skipped them), which DDP rejects by default; "
            "rerun with --find-unused-parameters, or remove the unused layers")
