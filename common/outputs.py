"""Fail before training, never after: prove at start-up that the run can write what it will write.

broadcast_out_dir_check() runs on every rank before the first step: it is a collective (rank 0 broadcasts its verdict),
as its name says, so it must not go under `if is_main:`. Rank 0, which writes, creates --out-dir, writes and
deletes a small file there (a real write, not a guess from permission bits) and compares the free space with
what the run will hold there; with shared=True every node must also see a file rank 0 wrote there (recipes
whose ranks load what rank 0 saved). Every rank learns the outcome, so all stop together with one line and
exit 2, within seconds, leaving nothing behind, instead of training for hours and failing at the first save.
"""

import os
import secrets
import shutil
import socket
import sys

import torch
import torch.distributed as dist

from common.utils import die, human, local_shard


def state_bytes(model, optimizer=None):
    """A checkpoint's size, estimated before training: the model's tensors, plus one tensor like each parameter
    the optimizer updates (SGD's momentum; before the first step it holds none yet)."""
    size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    if optimizer is not None:
        size += sum(p.numel() * p.element_size() for group in optimizer.param_groups for p in group["params"])
    return size


def held_state_bytes(model, optimizer):
    """Bytes of parameters, gradients and optimizer state in this process's memory. A sharded (DTensor) tensor
    counts its local shard only, so FSDP and DDP compare exactly."""
    tensors = [p for p in model.parameters()] + [p.grad for p in model.parameters() if p.grad is not None]
    # ZeRO's state is its shard's, in the optimizer it wraps. Its module is looked up, not imported: importing it
    # (DTensor, FSDP, sympy) cost every rank of every other recipe 0.3 s of start-up; a recipe that made a
    # ZeroRedundancyOptimizer has imported it.
    zero = sys.modules.get("torch.distributed.optim")
    if zero is not None and isinstance(optimizer, zero.ZeroRedundancyOptimizer):
        optimizer = optimizer.optim
    tensors += [v for state in optimizer.state.values() for v in state.values() if isinstance(v, torch.Tensor)]
    return sum(local_shard(t).numel() * local_shard(t).element_size() for t in tensors)


def _needed(out_dir, files):
    """Bytes the run still needs in out_dir at its peak: each file at its full size, less what a file of that name
    already holds (it is replaced), plus the largest one again for the temp copy of an atomic save."""
    existing = {name: os.path.getsize(os.path.join(out_dir, name)) for name in files
                if os.path.isfile(os.path.join(out_dir, name))}
    return sum(max(0, size - existing.get(name, 0)) for name, size in files.items()) + max(files.values())


def _probe(out_dir, files, marker, flag):
    """Rank 0's checks. Returns (error or None, the folders it created)."""
    created, path = [], os.path.abspath(out_dir)
    while not os.path.exists(path):  # the folders makedirs will create, to remove them again on failure
        created.append(path)
        path = os.path.dirname(path)
    try:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, marker), "wb") as f:  # a real write, fsynced: permissions, read-only
            f.write(b"written by rank 0 at start-up; deleted when every node has seen it\n")  # mounts, quotas
            f.flush()
            os.fsync(f.fileno())
    except OSError as exc:
        if os.path.exists(out_dir) and not os.path.isdir(out_dir):
            return f"{flag} {out_dir} is a file, not a folder; pass a folder to write to", created
        where = f" at {exc.filename}" if exc.filename and exc.filename != out_dir else ""
        return f"cannot write to {flag} {out_dir} ({exc.strerror}{where}); pass a folder you can write to", created
    free, need = shutil.disk_usage(out_dir).free, _needed(out_dir, files)
    if free < need:
        listed = ", ".join(f"{name} {human(size)}" for name, size in files.items())
        return (f"{flag} {out_dir} has {human(free)} free, and this run will write {human(need)} there ({listed}, "
                f"and a temp copy of the largest for its atomic save); free some space or pass another {flag}"),\
            created
    return None, created


def _clean(out_dir, marker, created):
    if os.path.exists(os.path.join(out_dir, marker)):
        os.remove(os.path.join(out_dir, marker))
    for folder in created:  # deepest first
        if os.path.isdir(folder) and not os.listdir(folder):
            os.rmdir(folder)


def broadcast_out_dir_check(out_dir, is_main, files, shared=False, flag="--out-dir", tb_dir=None):
    """files: {name: bytes} the run writes into out_dir (state_bytes() of what goes in each); flag: the option that
    named the folder, for the messages; tb_dir: --tb-dir, checked the same way (its event file). A collective: call
    it on every rank, after the process group is up; rank 0 checks and broadcasts the verdict."""
    grouped = dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1
    marker = f".write-test-{secrets.token_hex(4)}"
    error, created, tb_created = None, [], []
    if is_main:
        error, created = _probe(out_dir, files, marker, flag)
        if error is None and tb_dir is not None:
            error, tb_created = _probe(tb_dir, {"events.out.tfevents": 2**20}, marker, "--tb-dir")
    if grouped:
        box = [error, marker]
        dist.broadcast_object_list(box, src=0)  # rank 0's outcome, and the name of the file it wrote
        error, marker = box
    if error is None and shared and grouped:
        # Every rank loads what rank 0 saves there: a folder on each node's own disk would not have it.
        unseen = [None] * dist.get_world_size()
        seen = os.path.exists(os.path.join(out_dir, marker))
        dist.all_gather_object(unseen, None if seen else f"rank {dist.get_rank()} on {socket.gethostname()}")
        blind = [who for who in unseen if who]
        if blind:
            error = (f"{flag} {out_dir} must be on storage that every node shares: {', '.join(blind[:3])} "
                     "cannot see the file rank 0 wrote there, and would not see its checkpoints; use a shared "
                     "folder (NFS, Lustre, a cluster file system)")
    if is_main:  # --tb-dir first: it may be inside --out-dir, whose folders go only if empty
        if tb_dir is not None:
            _clean(tb_dir, marker, tb_created if error else [])
        _clean(out_dir, marker, created if error else [])
    if error:
        die(error)
