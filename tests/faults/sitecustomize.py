"""Fault injection for tests/test_failures.py: test doubles of a BUG in training code and of a FULL DISK, not of
torch. Each part below acts only when its environment variable is set.

Python imports this module at start-up when tests/faults is on PYTHONPATH. With
FAULT_COLLECTIVE="RANK:OP:N:MODE" in the environment, the process whose RANK is RANK (torchrun sets RANK
per rank; the launcher process has none) replaces torch.distributed.OP so that its N-th call
  skip: returns at once without communicating, as a rank that took another branch would;
  hang: never returns, as a rank stuck before the collective (a dead NFS read, a deadlock) would;
  block: waits inside a real collective that no other rank joins (a barrier on a second process group, which every
    rank makes right after init_process_group, with a timeout of 10 minutes), as a rank that called a collective the
    others did not would; its peers meet their own --dist-timeout first.
  grow: runs the real collective on its first tensor with one element more (a copy), as a rank that sized a
    buffer from its own data would: the shapes differ across ranks (issue 42's mismatch drill).
Every other process, and every other call, runs the real collective.
"""

import builtins
import io
import os
import sys
import time


class _WrappedFile:
    """A file opened for writing, its write() the fault's (a subclass's); everything else the file's own."""

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()


def _on_write_open(name, act):
    """open(), and io.open() as pathlib and torch.distributed.checkpoint's writer use it, call act(file, n) as a file
    named `name` (or any of a tuple of names, counted together) is opened for writing the n-th time, before it opens;
    act may return a function that wraps the opened file. Each fault below that watches a file is one of these; set
    together, they chain."""
    real, seen, names = builtins.open, [0], (name,) if isinstance(name, str) else tuple(name)

    def watching(file, mode="r", *args, **kwargs):
        wrap = None
        if "w" in mode and os.path.basename(str(file)) in names:
            seen[0] += 1
            wrap = act(file, seen[0])
        f = real(file, mode, *args, **kwargs)
        return wrap(f) if wrap else f

    builtins.open = io.open = watching

_spec = os.environ.get("FAULT_COLLECTIVE", "")
_second_group = []
if _spec.endswith(":block") and os.environ.get("RANK") is not None:  # every rank: the second group is collective
    import datetime

    import torch.distributed as dist

    _init = dist.init_process_group

    def _init_and_a_second_group(*args, **kwargs):
        _init(*args, **kwargs)
        _second_group.append(dist.new_group(timeout=datetime.timedelta(minutes=10)))

    dist.init_process_group = _init_and_a_second_group

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
        if _mode == "block":
            dist.barrier(group=_second_group[0])  # no other rank calls it: blocked in C++ until its 10-minute timeout
        if _mode == "grow":
            import torch

            return _real(torch.cat([args[0].flatten(), args[0].new_zeros(1)]), *args[1:], **kwargs)
        return None

    setattr(dist, _op, _faulty)

# FAULT_DISK_FREE=BYTES: the disk reports BYTES free (shutil.disk_usage), as a nearly full one would.
if os.environ.get("FAULT_DISK_FREE"):
    import shutil

    _usage = shutil.disk_usage

    def _nearly_full(path):
        total, used, _ = _usage(path)
        return type(_usage(path))(total, used, int(os.environ["FAULT_DISK_FREE"]))

    shutil.disk_usage = _nearly_full

# FAULT_DISK_FULL="NAME:N:BYTES": in rank 0 (or a process without RANK), the N-th time a file named NAME is
# opened for writing (by open(), or io.open() as pathlib and torch.distributed.checkpoint's writer do), it takes
# BYTES and then every write fails with ENOSPC, as on a disk that filled up.
if os.environ.get("FAULT_DISK_FULL") and os.environ.get("RANK", "0") == "0":
    import errno

    _name, _nth, _room = os.environ["FAULT_DISK_FULL"].split(":")

    class _FillingFile(_WrappedFile):
        def __init__(self, f, room):
            self._f, self._room = f, room

        def write(self, data):
            if len(data) > self._room:
                self._f.write(bytes(data[: self._room]))
                self._room = 0
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            self._room -= len(data)
            return self._f.write(data)

    def _fill(file, n):
        if n == int(_nth):
            sys.stdout.write(f"FAULT: {file} fills the disk after {_room} bytes\n")
            sys.stdout.flush()
            return lambda f: _FillingFile(f, int(_room))

    _on_write_open(_name, _fill)

# FAULT_NAN_BATCH="RANK:N": in the process whose RANK is RANK (a process without RANK counts as rank 0), the N-th
# training batch (from a loader whose sampler has an epoch: DistributedSampler) has NaN images, as a corrupt
# sample that decodes to NaN, or a bad normalisation constant, would give. A test double of BAD DATA.
if os.environ.get("FAULT_NAN_BATCH") and os.environ.get("RANK", "0") == os.environ["FAULT_NAN_BATCH"].split(":")[0]:
    import torch.utils.data

    _nth = int(os.environ["FAULT_NAN_BATCH"].split(":")[1])
    _seen, _iter = [0], torch.utils.data.DataLoader.__iter__

    def _with_a_nan_batch(loader):
        batches = _iter(loader)
        if not hasattr(loader.sampler, "epoch"):  # validation: left alone
            return batches

        def generate():
            for images, *rest in batches:
                _seen[0] += 1
                if _seen[0] == _nth:
                    sys.stdout.write(f"FAULT: training batch {_nth} of rank {os.environ.get('RANK', '0')} is NaN\n")
                    sys.stdout.flush()
                    images = images.float().fill_(float("nan"))
                yield (images, *rest)
        return generate()

    torch.utils.data.DataLoader.__iter__ = _with_a_nan_batch

# FAULT_SLOW="RANK:SECONDS": in the process whose RANK is RANK (a process without RANK counts as rank 0), every
# training-mode forward of an nn.Linear sleeps SECONDS first, as a slower GPU or a throttled CPU would make its
# forward: a straggler, not a hang (issue 42's straggler drill). Eval's forwards run at full speed.
if os.environ.get("FAULT_SLOW") and os.environ.get("RANK", "0") == os.environ["FAULT_SLOW"].split(":")[0]:
    import torch.nn

    _pause, _linear = float(os.environ["FAULT_SLOW"].split(":")[1]), torch.nn.Linear.forward
    _told = []

    def _slow_linear(self, x):
        if self.training:
            if not _told:
                _told.append(1)
                sys.stdout.write(f"FAULT: rank {os.environ.get('RANK', '0')} sleeps {_pause} s in each nn.Linear\n")
                sys.stdout.flush()
            time.sleep(_pause)
        return _linear(self, x)

    torch.nn.Linear.forward = _slow_linear


def _job_pids(root):
    """root and every process under it: a job's launcher, ranks and DataLoader workers (tools/procs.py, loaded from
    its file: the repository is not on this process's path)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(
        "_fault_procs", os.path.join(os.path.dirname(__file__), "..", "..", "tools", "procs.py"))
    procs = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(procs)
    return set(procs.descendants(root))


# FAULT_SIGNAL="RANK:WHEN:TARGET[,...]": in the process whose RANK is RANK (none: rank 0), SIGUSR1 is sent to TARGET
# when WHEN comes: WHEN is step=N (after this rank's N-th optimizer step) or save=N (as this process opens a file
# named latest.pt.tmp for writing for the N-th time: inside a save); TARGET is launcher (this rank's parent, which
# passes it on), self (this rank alone) or job (the launcher and every process under it: ranks and DataLoader
# workers, as SLURM's --signal=USR1@120 does). A test double of a SCHEDULER's preemption warning. The sender then
# waits (up to 30 s) until its own handler has run, in this process or passed back by the launcher: the signal lands
# after that step or inside that save on every machine, however loaded (a busy CI machine once took 4 tiny steps to
# pass it on, and the stop came an epoch late).
if os.environ.get("FAULT_SIGNAL"):
    import signal
    import threading

    _signals = [spec.split(":") for spec in os.environ["FAULT_SIGNAL"].split(",")]
    _signals = [(when, target) for rank, when, target in _signals if os.environ.get("RANK", "0") == rank]

    def _send(when, target):
        sys.stdout.write(f"FAULT: rank {os.environ.get('RANK', '0')} sends SIGUSR1 to {target} at {when}\n")
        sys.stdout.flush()
        launcher = os.getppid()
        handler, landed = signal.getsignal(signal.SIGUSR1), []
        waits = callable(handler) and threading.current_thread() is threading.main_thread()  # signal.signal's rule
        if waits:
            signal.signal(signal.SIGUSR1, lambda signum, frame: (landed.append(signum), handler(signum, frame)))
        for pid in {"launcher": [launcher], "self": [os.getpid()], "job": sorted(_job_pids(launcher))}[target]:
            try:
                os.kill(pid, signal.SIGUSR1)
            except ProcessLookupError:
                pass
        if waits:
            deadline = time.monotonic() + 30
            while not landed and time.monotonic() < deadline:
                time.sleep(0.005)  # the handler runs in this thread, between two of these
            signal.signal(signal.SIGUSR1, handler)

    _counts = {"step": [0], "save": [0]}

    def _tick(kind):
        _counts[kind][0] += 1
        for when, target in _signals:
            if when == f"{kind}={_counts[kind][0]}":
                _send(when, target)

    if any(when.startswith("step=") for when, _ in _signals):
        from torch.optim.optimizer import register_optimizer_step_post_hook

        register_optimizer_step_post_hook(lambda *args: _tick("step"))
    if any(when.startswith("save=") for when, _ in _signals):
        _on_write_open("latest.pt.tmp", lambda file, n: _tick("save"))

def _sigkill_the_job(when):
    """SIGKILL to every process of the job (the launcher, this rank's parent, and all under it), this one last."""
    import signal

    sys.stdout.write(f"FAULT: killing the job {when}\n")
    sys.stdout.flush()
    launcher = os.getppid()
    for pid in sorted(_job_pids(launcher) - {os.getpid()}) + [os.getpid()]:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


# FAULT_KILL_ON_WRITE="NAME:N": in rank 0 (or a process without RANK), when a file named NAME is opened for writing
# for the N-th time (torch.distributed.checkpoint's shard files: __0_0.distcp; from --async-save's writer thread too),
# every process of the job (the launcher and all under it) is killed with SIGKILL: a node lost mid-write. A test double
# of a CRASH.
if os.environ.get("FAULT_KILL_ON_WRITE") and os.environ.get("RANK", "0") == "0":
    _kill_name, _kill_nth = os.environ["FAULT_KILL_ON_WRITE"].split(":")

    def _kill_the_job(file, n):
        if n == int(_kill_nth):
            _sigkill_the_job(f"as {file} opens")

    _on_write_open(_kill_name, _kill_the_job)

# FAULT_SLOW_WRITE="NAME:SECONDS": in rank 0 (or a process without RANK), each time a file named NAME is opened for
# writing, the open first sleeps SECONDS: a slow disk (a shared file system), so that an --async-save writer thread is
# still writing while training goes on. Set with FAULT_KILL_ON_WRITE, the sleep comes before the kill's count.
if os.environ.get("FAULT_SLOW_WRITE") and os.environ.get("RANK", "0") == "0":
    _slow_name, _slow_seconds = os.environ["FAULT_SLOW_WRITE"].split(":")
    _on_write_open(_slow_name, lambda file, n: time.sleep(float(_slow_seconds)))

# FAULT_KILL_MID_WRITE="NAME:N": in rank 0 (or a process without RANK), the N-th time a file named NAME or NAME.tmp
# (common.checkpoint.save_atomic's temp file) is opened for writing, counted together, the job is SIGKILLed as
# FAULT_KILL_ON_WRITE kills it, but after the file's first write() (flushed: the file holds those bytes), not before
# the open: a node lost partway through writing the file. torch.save given a path of either name opens it with
# open() here: torch writes a path from C++, which no open() above would see (a plain torch.save(obj, "model.pt")).
if os.environ.get("FAULT_KILL_MID_WRITE") and os.environ.get("RANK", "0") == "0":
    _mid_name, _mid_nth = os.environ["FAULT_KILL_MID_WRITE"].split(":")
    _mid_names = (_mid_name, f"{_mid_name}.tmp")

    class _KilledAfterTheFirstWrite(_WrappedFile):
        def __init__(self, f, file):
            self._f, self._file = f, file

        def write(self, data):
            written = self._f.write(data)
            self._f.flush()
            _sigkill_the_job(f"after the first write to {self._file} ({written} bytes)")
            return written

    def _kill_mid_write(file, n):
        if n == int(_mid_nth):
            return lambda f: _KilledAfterTheFirstWrite(f, file)

    _on_write_open(_mid_names, _kill_mid_write)
    if os.environ.get("RANK") is not None:  # a rank: torch.save to a path goes through open()
        import torch

        _save = torch.save

        def _save_through_open(obj, f, *args, **kwargs):
            if isinstance(f, (str, os.PathLike)) and os.path.basename(os.fspath(f)) in _mid_names:
                with open(f, "wb") as opened:
                    return _save(obj, opened, *args, **kwargs)
            return _save(obj, f, *args, **kwargs)

        torch.save = _save_through_open
