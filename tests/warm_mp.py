"""multiprocessing's spawn start method in a warm job (tests/warm_server.py's forked process running a recipe that
starts its own workers, `ddp_spawn.py`'s `mp.spawn`), with one change: a worker is not a new interpreter that
imports torch (about 5 s of CPU each) but a fork of a clean copy of the job's process, the zygote, forked from it
before the recipe ran (so it holds no state of the recipe's, as a new interpreter holds none).

Everything else is multiprocessing's and torch's own code, as a new interpreter would run it: the parent's
`Popen._launch` pickles the preparation data and the process object into the worker's pipe, the worker runs the
command line's `spawn_main(...)` (multiprocessing.spawn: `prepare()` re-runs the recipe as `__mp_main__`, sets
sys.path, argv, the working folder and the authkey, then `_bootstrap` runs torch's `_wrap`), and torch's
ProcessContext joins them (sentinels, exit codes, SIGTERM then SIGKILL to the others). The only stand-ins are the
two calls a new interpreter needs: `util.spawnv_passfds` (the zygote forks, with the same file descriptors at the
same numbers) and the exit status (the zygote is the workers' parent, so it reports them; `Popen.poll`).

What the worker starts with, as a new interpreter would: the parent's environment at the time of the spawn, its
ignored signals still ignored and every other at its default (SIGINT to Python's handler), the thread count from
OMP_NUM_THREADS (else one per core), torch's and numpy's generators seeded from the OS, the parent's stdout and
stderr. A test that is about the processes (tests/jobs.py's drills) takes the real path, where none of this is used.

The end of this file is what the zygote and tests/warm_server.py share: the wait for a request or a child's end, and
what Python does at start-up and at exit for a process forked to stand in for a new interpreter.
"""

import atexit
import ctypes
import fcntl
import os
import pickle
import select
import signal
import socket
import sys
import threading
import types
from multiprocessing import popen_spawn_posix
from multiprocessing import util as mp_util

PR_SET_PDEATHSIG = 1
_client = _base_path = None


def install(base_path):
    """In the job's process, before its script runs: fork the zygote and route multiprocessing's spawn start method
    through it. base_path: sys.path of a new interpreter, less its script's folder and PYTHONPATH."""
    global _client, _base_path
    _base_path = list(base_path)
    ours, its = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    pid = os.fork()
    if pid == 0:
        ours.close()
        _zygote(its)  # never returns
    its.close()
    _client = _Client(ours)
    popen_spawn_posix.util = _Util()  # its _launch starts the child through util.spawnv_passfds
    popen_spawn_posix.Popen = Popen  # SpawnProcess._Popen imports it at each start


class _Util:
    """multiprocessing.util for popen_spawn_posix alone: spawnv_passfds is the zygote's fork."""

    def __getattr__(self, name):
        return getattr(mp_util, name)

    @staticmethod
    def spawnv_passfds(path, args, passfds):
        return _client.fork(args, passfds)


class Popen(popen_spawn_posix.Popen):
    """A spawned worker, whose exit status comes from the zygote (its parent) instead of os.waitpid."""

    def poll(self, flag=os.WNOHANG):
        if self.returncode is None:
            self.returncode = _client.status(self.pid, block=flag == 0)
        return self.returncode


class _Client:
    def __init__(self, sock):
        self.sock, self.lock, self.pids, self.ended = sock, threading.Lock(), [], {}

    def _take(self, block):
        """Read one message from the zygote (False where none is waiting and block is False)."""
        try:
            data = self.sock.recv(4096, 0 if block else socket.MSG_DONTWAIT)
        except BlockingIOError:
            return False
        if not data:
            raise RuntimeError("tests/warm_mp.py: the zygote ended")
        kind, pid, code = pickle.loads(data)
        if kind == "pid":
            self.pids.append(pid)
        else:
            self.ended[pid] = code
        return True

    def fork(self, argv, fds):
        ignored = [int(s) for s in signal.valid_signals() if _ignored(s)]
        request = pickle.dumps({"argv": list(argv), "fds": [int(fd) for fd in fds], "env": dict(os.environ),
                                "ignored": ignored})
        with self.lock:
            socket.send_fds(self.sock, [request], [int(fd) for fd in fds])
            while not self.pids:
                self._take(block=True)
            return self.pids.pop(0)

    def status(self, pid, block):
        with self.lock:
            while self._take(block=False):
                pass
            while block and pid not in self.ended:
                self._take(block=True)
            return self.ended.pop(pid, None)


def _ignored(sig):
    try:
        return signal.getsignal(sig) == signal.SIG_IGN
    except (ValueError, OSError):
        return False


def watch_children():
    """A pipe that wakes select() when a child of this process ends (SIGCHLD): (its read end, its write end). Here
    and in tests/warm_server.py, the two fork servers."""
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda signum, frame: None)
    return wake_r, wake_w


def wait_ready(source, wake_r):
    """Block until `source` has a request or a child has ended: (whether a request waits, [(pid, exit code as
    Popen.returncode) for each child that ended])."""
    while True:
        try:
            ready, _, _ = select.select([source, wake_r], [], [])
            break
        except InterruptedError:
            continue
    ended = []
    if wake_r in ready:
        os.read(wake_r, 4096)
        while True:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            ended.append((pid, os.waitstatus_to_exitcode(status)))
    return source in ready, ended


def _zygote(sock):
    """Fork a worker per request; report each worker's pid, and its exit status when it ends. Ends with the job."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(sig, signal.SIG_IGN)  # a signal to the job's process group is for the workers, not for this
    wake_r, wake_w = watch_children()
    while True:
        requested, ended = wait_ready(sock, wake_r)
        for pid, code in ended:
            sock.send(pickle.dumps(("ended", pid, code)))
        if requested:
            data, fds, _, _ = socket.recv_fds(sock, 1 << 20, 64)
            if not data:
                os._exit(0)
            request = pickle.loads(data)
            pid = os.fork()
            if pid == 0:
                _worker(request, fds, (sock.fileno(), wake_r, wake_w))
            for fd in fds:
                os.close(fd)
            sock.send(pickle.dumps(("pid", pid, None)))


def _worker(request, fds, zygote_fds):
    """In the forked worker: become what `python [flags] -c 'spawn_main(...)' --multiprocessing-fork` would be at its
    first line, run that line, exit as the interpreter would. Never returns."""
    code = 1
    try:
        signal.set_wakeup_fd(-1)
        for sig in signal.valid_signals():
            if sig in (signal.SIGKILL, signal.SIGSTOP):
                continue
            try:
                signal.signal(sig, signal.SIG_IGN if sig in request["ignored"] else signal.SIG_DFL)
            except (OSError, ValueError):
                pass
        for sig in (signal.SIGPIPE, signal.SIGXFSZ):  # what Python ignores at start-up
            signal.signal(sig, signal.SIG_IGN)
        if signal.SIGINT not in request["ignored"]:
            signal.signal(signal.SIGINT, signal.default_int_handler)
        # The parent's file descriptors at the numbers its command line names: above every number first, so that
        # no move overwrites another, then down.
        floor = max([*fds, *request["fds"], *zygote_fds]) + 1
        high = [fcntl.fcntl(fd, fcntl.F_DUPFD, floor) for fd in fds]
        for fd in {*fds, *zygote_fds}:
            os.close(fd)
        for fd, target in zip(high, request["fds"], strict=True):
            os.dup2(fd, target)
            os.close(fd)
        os.environ.clear()
        os.environ.update(request["env"])
        import numpy
        import torch

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS") or os.cpu_count() or 1))
        torch.seed()
        numpy.random.seed()
        # A new interpreter's sys.path at start-up ('' for -c, PYTHONPATH, the rest), and the sitecustomize it imports
        # from there (tests/instrument's, where a test put it on PYTHONPATH); spawn_main's prepare() then sets the
        # parent's sys.path.
        extra = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        sys.path[:] = ["", *extra, *_base_path]
        import_sitecustomize(extra)
        argv = request["argv"]
        program = argv[argv.index("-c") + 1]
        sys.argv = ["-c", *argv[argv.index("-c") + 2:]]
        main = types.ModuleType("__main__")
        sys.modules["__main__"] = main
        try:
            exec(compile(program, "<string>", "exec"), main.__dict__)
            code = 0
        except SystemExit as exc:
            code = exit_code(exc.code)
        exit_as_the_interpreter_does()
    except BaseException:
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code & 0xFF)


# What Python does at start-up and at exit, for a process forked to stand in for a new interpreter (a warm rank, a
# spawned worker).
def import_sitecustomize(extra):
    """The sitecustomize a new interpreter imports at start-up, the first on PYTHONPATH (`extra`), if one is there."""
    if any(os.path.exists(os.path.join(p, "sitecustomize.py")) for p in extra):
        sys.modules.pop("sitecustomize", None)
        __import__("sitecustomize")


def exit_as_the_interpreter_does():
    """Wait for the non-daemon threads, run the atexit functions, flush stdout and stderr."""
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass


def exit_code(value):
    """The exit code of SystemExit(value), as the interpreter makes it (a message goes to stderr, code 1)."""
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    print(value, file=sys.stderr)
    return 1
