"""Real jobs started through launch.sh and watched from outside: their output line by line, their processes
through /proc. The failure drills (test_failures.py) and the GPU tier (test_gpu.py) kill, interrupt and time them."""

import contextlib
import os
import queue
import re
import signal
import subprocess
import threading
import time

import pytest
from conftest import LAUNCH, REPO, launch_env

from tools.procs import descendants, process_table


def environ_of(pid):
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            return dict(kv.split(b"=", 1) for kv in f.read().split(b"\0") if b"=" in kv)
    except OSError:
        return {}


# The signals a terminal's shell leaves at their defaults in a foreground job. A process inherits an ignored
# signal across exec, and a shell script starts its background commands with SIGINT and SIGQUIT ignored
# (`nohup python -m pytest &` ignores SIGHUP too): a job started from such a suite would ignore Ctrl-C and the
# drill would test what the suite inherited, not what a user's terminal does.
JOB_CONTROL_SIGNALS = (signal.SIGINT, signal.SIGQUIT, signal.SIGTERM, signal.SIGHUP, signal.SIGTSTP,
                       signal.SIGTTIN, signal.SIGTTOU)


def started_with(ignored=()):
    """A preexec_fn: between fork and exec, every job-control signal back to its default action, then `ignored`
    set to ignore (what a non-interactive shell does to `cmd &`: ignored=(signal.SIGINT, signal.SIGQUIT))."""
    def preexec():
        for sig in JOB_CONTROL_SIGNALS:
            signal.signal(sig, signal.SIG_IGN if sig in ignored else signal.SIG_DFL)
    return preexec


class Job:
    """./launch.sh in a new session, its output read line by line, so that a test can act mid-training. It starts
    as a terminal starts a foreground job: job-control signals at their defaults, whatever the suite inherited."""

    def __init__(self, *args, env=None, ignored=(), command=None):
        """./launch.sh ARGS, or another `command` (a list) in the same environment."""
        argv = command or [str(LAUNCH), *map(str, args)]
        self.proc = subprocess.Popen(argv, env=launch_env(env), cwd=REPO, text=True,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True,
                                     preexec_fn=started_with(ignored))
        self.stdout, self.stderr, self.lines = [], [], queue.Queue()
        self.readers = [threading.Thread(target=self._read, args=(self.proc.stdout, self.stdout, self.lines)),
                        threading.Thread(target=self._read, args=(self.proc.stderr, self.stderr, None))]
        for reader in self.readers:
            reader.start()

    @staticmethod
    def _read(stream, into, lines):
        for line in stream:
            into.append(line)
            if lines is not None:
                lines.put(line)

    def wait_for(self, prefix, timeout=120):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                line = self.lines.get(timeout=0.5)
            except queue.Empty:
                assert self.proc.poll() is None, f"job ended before {prefix!r}:\n{self.output()}"
                continue
            if line.startswith(prefix):
                return line
        self.kill()
        pytest.fail(f"no line starting {prefix!r} within {timeout} s:\n{self.output()}")

    def tree(self):
        """{pid: start time} of the launcher and all its descendants: ranks (in their own sessions under
        torchrun) and their DataLoader workers. The start time tells a reused pid from the same process."""
        return descendants(self.proc.pid)

    def rank_pid(self, rank):
        """The pid of the rank's own process (not of one of its DataLoader workers)."""
        table = process_table()  # read once: the tree and the parents below from the same moment
        tree = descendants(self.proc.pid, table)
        by_env = [pid for pid in tree if environ_of(pid).get(b"RANK") == str(rank).encode()]
        if by_env:  # torchrun puts RANK in each rank's environment; its DataLoader workers inherit it
            return next(pid for pid in by_env if table.get(pid, (None,))[0] not in by_env)
        # mp.spawn: the launcher's children that run spawn_main, started in rank order
        workers = sorted((start, pid) for pid, start in tree.items()
                         if table.get(pid, (None,))[0] == self.proc.pid and b"--multiprocessing-fork" in cmdline(pid))
        return workers[rank][1]

    def finish(self, timeout):
        try:
            self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            pytest.fail(f"still running {timeout} s later (a hang):\n{self.output()}")
        for reader in self.readers:
            reader.join(timeout=30)
        return self.proc.returncode

    def kill(self):
        signal_all(self.tree(), signal.SIGKILL)
        self.proc.wait()

    def output(self):
        return "stdout:\n" + "".join(self.stdout)[-3000:] + "\nstderr:\n" + "".join(self.stderr)[-5000:]


def cmdline(pid):
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read()
    except OSError:
        return b""


def signal_all(pids, sig):
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):  # it exited meanwhile
            os.kill(pid, sig)


def job_mid_epoch(recipe, out_dir, devices="cpu:2", ignored=(), samples=4096):
    """A 2-rank job with DataLoader workers, a little into epoch 2 (of samples / 64 steps: 64, several seconds here)."""
    job = Job(f"recipes/{recipe}.py", devices, "--arch", "tiny", "--workers", "1", "--epochs", "20",
              "--synthetic-train", str(samples), "--batch-size", "64", "--out-dir", out_dir, ignored=ignored)
    job.wait_for("epoch=1/")
    time.sleep(0.5)
    return job


def survivors(tree, grace=10):
    """The processes of `tree` still running `grace` seconds on (same pid and same start time)."""
    deadline = time.monotonic() + grace
    while True:
        table = process_table()
        alive = {pid for pid, start in tree.items() if table.get(pid, (None, None))[1] == start}
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.1)


def error_lines(stderr):
    return [line for line in stderr.splitlines() if re.match(r"(\[rank \d+\] |launch\.sh: )?error: ", line)]


def tracebacks_beyond_multiprocessing(stderr):
    """The tracebacks in stderr, less those whose every frame is in the standard library's multiprocessing: a
    DataLoader worker's fd-sharing thread prints a BrokenPipeError when Ctrl-C takes its rank away in the middle
    of a hand-over (pytorch/pytorch#22924, open upstream). Any frame of torch or of these recipes counts."""
    blocks = stderr.split("Traceback (most recent call last):")[1:]
    return [block for block in blocks
            if not all("/multiprocessing/" in path for path in re.findall(r'File "([^"]+)"', block))]
