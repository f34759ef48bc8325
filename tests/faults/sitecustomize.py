"""Fault injection for tests/test_failures.py: a test double of a BUG in training code, not of torch.

Python imports this module at start-up when tests/faults is on PYTHONPATH. With
FAULT_COLLECTIVE="RANK:OP:N:MODE" in the environment, the process whose RANK is RANK (torchrun sets RANK
per rank; the launcher process has none) replaces torch.distributed.OP so that its N-th call
  skip: returns at once without communicating, as a rank that took another branch would;
  hang: never returns, as a rank stuck before the collective (a dead NFS read, a deadlock) would.
Every other process, and every other call, runs the real collective.
"""

import os
import sys
import time

_spec = os.environ.get("FAULT_COLLECTIVE", "")
if _spec and os.environ.get("RANK") == _spec.split(":")[0]:
    import torch.distributed as dist

    _rank, _op, _nth, _mode = _spec.split(":")
    _real = getattr(dist, _op)
    _calls = [0]

    def _faulty(*args, **kwargs):
        _calls[0] += 1
        if _calls[0] != int(_nth):
            return _real(*args, **kwargs)
        sys.stdout.write(f"FAULT: rank {_rank} {_mode}s call {_nth} of torch.distributed.{_op}\n")  # one write:
        sys.stdout.flush()  # under PYTHONUNBUFFERED, print() splits it from the newline, and rank 0's lines cut in
        if _mode == "hang":
            while True:
                time.sleep(60)
        return None

    setattr(dist, _op, _faulty)
