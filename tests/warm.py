"""The warm path: a test's job runs its ranks as processes forked from a server that has already imported torch
(tests/warm_server.py, one per test process), instead of each rank importing torch, torchvision and torch._dynamo
anew (3 to 4.5 s of CPU a rank, 3.5 s more for torchrun's agent). docs/testing.md says why and what it costs.

launch() and run_direct() in tests/conftest.py take it for every job it can run as the real path would:
- launch.sh itself still parses every job: `./launch.sh --dry-run ARGS` gives the environment and the command, and
  its errors (a bad DEVICES, a bad MASTER_PORT) are the job's result, as they would be;
- each rank gets what torchrun gives it: RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, GROUP_RANK, ROLE_*,
  MASTER_ADDR and MASTER_PORT (rank 0 hosts the store, as under torchrun without its agent's), launch.sh's variables,
  `--local-rank=N` for the legacy launcher, its thread count (torch.set_num_threads, from OMP_NUM_THREADS), SIGINT at
  Python's default, SIGUSR1 ignored until the recipe's handler, a session of its own, death with its parent;
- a rank that fails stops the others as torchrun does (SIGTERM to each rank's group, SIGKILL 30 s later), and the
  job's exit code and last line are tools/torchrun.py's (the failed rank's code; "launch.sh: job failed: ...");
- the output is each rank's own, in rank order (stdout: rank 0's, then rank 1's...), after launch.sh's line.

The real path (launch.sh -> tools/torchrun.py -> torchrun -> new interpreters) is taken instead, with the reason in
`last_real_path_reason`, where the warm one could differ: a test marked `real_path` (its subject is the launcher or
the processes), MAX_RESTARTS (torchrun restarts ranks), GPUs (the GPU tier runs as a user's job runs, NCCL and all;
the server never starts CUDA, so a fork could), a variable Python or torch reads once at start-up set differently
from the server's (READ_AT_START), or COOKBOOK_WARM=0 in the suite's environment (every job then takes the real
path: the suite as it was).
"""

import contextlib
import dataclasses
import json
import os
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SERVER = Path(__file__).resolve().parent / "warm_server.py"
SPAWN_RANK = Path(__file__).resolve().parent / "warm_spawn_rank.py"
# Variables Python or torch read once, at interpreter start or at `import torch`: a rank forked from the server would
# keep the server's. A job that sets one differently takes the real path. Those read later (torch.distributed's
# and the elastic agent's, the recipes' own, the tests' fault switches) are passed as they are. Not Intel OpenMP's
# KMP_* (torch's OpenMP is GNU's, libgomp): scikit-learn sets two of them in the suite's process when imported.
# Nor TORCHINDUCTOR_CACHE_DIR: inductor reads it at each look-up and sets it to its default in any process that
# compiled (the suite's own, after a test compiled in it).
READ_AT_START = re.compile(r"^(PYTHON(?!$|PATH$|UNBUFFERED$).*|"
                           r"TORCH(?!ELASTIC_|_NCCL_|_DISABLE_SHARE_RDZV|INDUCTOR_CACHE_DIR$).*|"
                           r"OMP_(?!NUM_THREADS$).*|MKL_.*|GOMP_.*|LD_PRELOAD|LD_LIBRARY_PATH|MALLOC_.*|"
                           r"CUDA_(?!VISIBLE_DEVICES$|DEVICE_ORDER$).*|NVIDIA_TF32_OVERRIDE|TRITON_.*|CXX|CC|INDUCTOR_.*)$")
ENABLED = os.environ.get("COOKBOOK_WARM", "1") != "0"
TERM_GRACE = 30.0  # torchrun's: SIGKILL this long after SIGTERM
forbidden = threading.local()  # .why: set by tests/conftest.py around a test marked real_path
last_real_path_reason = None
_server = None
_server_lock = threading.Lock()


class Server:
    """tests/warm_server.py, started once in this process (the first warm job waits for its imports)."""

    def __init__(self):
        self.env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        self.proc = subprocess.Popen([sys.executable, str(SERVER)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     env=self.env, cwd=REPO)
        self.changed = threading.Condition()
        self.pids, self.ended, self.next_id = {}, {}, 0
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            message = json.loads(line)
            with self.changed:
                if "id" in message:
                    self.pids[message["id"]] = message["pid"]
                else:
                    self.ended[message["pid"]] = message["status"]
                self.changed.notify_all()
        with self.changed:
            self.pids[None] = None  # it ended
            self.changed.notify_all()

    def fork(self, argv, env, cwd, stdout, stderr, threads, spawn=False):
        """spawn: the process's multiprocessing spawns its children as forks of a clean copy (tests/warm_mp.py)."""
        with self.changed:
            ident, self.next_id = self.next_id, self.next_id + 1
        request = {"id": ident, "argv": list(map(str, argv)), "env": env, "cwd": str(cwd), "stdout": str(stdout),
                   "stderr": str(stderr), "threads": threads, "spawn": spawn}
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()
        with self.changed:
            self.changed.wait_for(lambda: ident in self.pids or None in self.pids, timeout=120)
            if ident not in self.pids:
                raise RuntimeError(f"the warm server did not fork (exit {self.proc.poll()}); its stderr is above")
            return self.pids.pop(ident)

    def poll(self, pid):
        with self.changed:
            return self.ended.get(pid)

    def wait_any(self, pids, timeout):
        """Block until one of `pids` has ended or `timeout` seconds pass."""
        with self.changed:
            self.changed.wait_for(lambda: any(p in self.ended for p in pids), timeout=timeout)

    def forget(self, pid):
        with self.changed:
            self.ended.pop(pid, None)


def server():
    global _server
    with _server_lock:
        if _server is None or _server.proc.poll() is not None:
            _server = Server()
        return _server


def reason_for_real_path(env):
    """Why a job in environment `env` must take the real path, or None."""
    if not ENABLED:
        return "COOKBOOK_WARM=0"
    if getattr(forbidden, "why", None):
        return forbidden.why
    if env.get("FAULT_KILL_ON_WRITE") or env.get("FAULT_KILL_MID_WRITE") or env.get("FAULT_COLLECTIVE") or re.search(
            r":(launcher|job)(,|$)", env.get("FAULT_SIGNAL", "")):
        return "tests/faults acts on the launcher (a kill, a signal passed on, the stacks it shows after a hang)"
    if env.get("CUDA_VISIBLE_DEVICES"):
        return "GPUs: the GPU tier runs its jobs as a user's run (the server never starts CUDA; a fork could)"
    base = server_env()
    differ = sorted(k for k in {*env, *base} if READ_AT_START.match(k) and env.get(k) != base.get(k))
    if differ:
        return f"{', '.join(differ)}: read once when Python or torch starts"
    return None


def server_env():
    return _server.env if _server is not None else {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


@dataclasses.dataclass
class _Failure:
    """What tools/torchrun.py's job_failed reads of torch's ProcessFailure for a rank that failed."""
    pid: int
    exitcode: int
    timestamp: int  # whole seconds, as torchrun's

    def signal_name(self):
        return signal.Signals(-self.exitcode).name


class Job:
    """The ranks of one job, forked from the server; wait() gives what subprocess.run would have."""

    def __init__(self, argv, ranks, cwd, head="", torchrun=True):
        """ranks: one environment per rank, in rank order; argv: the script and its arguments (the legacy launcher's
        --local-rank=N is added per rank: torchrun=="legacy"); head: what stderr starts with (launch.sh's line)."""
        self.argv, self.cwd, self.head, self.torchrun = argv, cwd, head, torchrun
        self.folder = Path(tempfile.mkdtemp(prefix="warm_job_"))
        self.server = server()
        self.pids, self.started = [], time.monotonic()
        for rank, env in enumerate(ranks):
            args = [*argv, f"--local-rank={env['LOCAL_RANK']}"] if torchrun == "legacy" else argv
            threads = int(env.get("OMP_NUM_THREADS") or 1)
            self.pids.append(self.server.fork(args, env, cwd, self.folder / f"{rank}.out", self.folder / f"{rank}.err",
                                              threads, spawn=not torchrun))  # a `python` job: ddp_spawn's workers

    def wait(self, timeout):
        deadline, failures, stopping = time.monotonic() + timeout, [], None
        while True:
            codes = [self.server.poll(pid) for pid in self.pids]
            for rank, code in enumerate(codes):
                if code not in (None, 0) and rank not in (r for r, _, _ in failures):
                    failures.append((rank, code, time.monotonic()))
            if all(code is not None for code in codes):
                break
            now = time.monotonic()
            if now > deadline:
                self.kill()
                expired = subprocess.TimeoutExpired(self.argv, timeout, self._read("out"), self._read("err"))
                self._clean_up()
                raise expired
            if failures and self.torchrun and stopping is None:  # torchrun stops the others
                stopping = now
                self._signal(signal.SIGTERM, only_running=True)
            if stopping is not None and now - stopping > TERM_GRACE:
                self._signal(signal.SIGKILL, only_running=True)
            self.server.wait_any([p for p, c in zip(self.pids, codes, strict=True) if c is None], timeout=0.5)
        self._signal(signal.SIGKILL)  # DataLoader workers a rank left behind (they hold no pipe here, but CPU)
        stdout, stderr = self._read("out"), self.head + self._read("err")
        code = codes[0]
        if self.torchrun:
            code = 0
            if failures:  # torchrun's verdict, as tools/torchrun.py words it
                from tools.torchrun import job_failed

                code, line = job_failed({rank: _Failure(self.pids[rank], exitcode, int(when - self.started))
                                         for rank, exitcode, when in failures})
                stderr += line + "\n"
        self._clean_up()
        return subprocess.CompletedProcess(self.argv, code, stdout, stderr)

    def _clean_up(self):
        """The ranks forgotten by the server, their output files and folder removed (after a timeout too)."""
        for pid in self.pids:
            self.server.forget(pid)
        with contextlib.suppress(OSError):
            for path in self.folder.iterdir():
                path.unlink()
            self.folder.rmdir()

    def kill(self):
        self._signal(signal.SIGKILL)
        deadline = time.monotonic() + 30
        while any(self.server.poll(pid) is None for pid in self.pids) and time.monotonic() < deadline:
            self.server.wait_any(self.pids, timeout=0.5)

    def _signal(self, sig, only_running=False):
        for pid in self.pids:
            if only_running and self.server.poll(pid) is not None:
                continue
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, sig)

    def _read(self, kind):
        return "".join(p.read_text(errors="replace") for p in sorted(self.folder.glob(f"*.{kind}"),
                                                                     key=lambda p: int(p.stem)))

def dry_run(args, env, cwd):
    """`./launch.sh --dry-run ARGS`: (the CompletedProcess, its stderr line, the environment, the command)."""
    from tools.procs import run_group

    proc = run_group([str(REPO / "launch.sh"), "--dry-run", *map(str, args)], env=env, cwd=cwd, timeout=60)
    if proc.returncode != 0:
        return proc, None, None, None
    words = shlex.split(proc.stdout.strip().splitlines()[-1])
    assigned = {}
    while words and re.match(r"^[A-Z_][A-Z0-9_]*=", words[0]):
        key, value = words.pop(0).split("=", 1)
        assigned[key] = value
    return proc, proc.stderr, assigned, words


def launch_job(args, env, cwd):
    """launch.sh ARGS as a warm job: a Job, or the dry run's CompletedProcess where launch.sh refused the arguments,
    or None where the job must take the real path (the reason in last_real_path_reason)."""
    global last_real_path_reason
    last_real_path_reason = reason_for_real_path(env)
    if str(args[0]).startswith("-") or env.get("LAUNCH_DRY_RUN", "0") not in ("", "0"):  # 1, or one it refuses
        last_real_path_reason = "launch.sh's own options (--dry-run, --help): its output is the result"
    if last_real_path_reason:
        return None
    proc, head, assigned, command = dry_run(args, env, cwd)
    if assigned is None:
        return proc
    full = {**env, **assigned}
    last_real_path_reason = reason_for_real_path(full)
    if last_real_path_reason:
        return None
    if command[1].endswith("tools/torchrun.py"):
        script_at = next(i for i, w in enumerate(command) if w.endswith(".py") and i > 1)  # the recipe
        legacy = "--legacy-launch" in command[:script_at]
        flags = dict(w[2:].split("=", 1) for w in command[2:script_at] if w.startswith("--") and "=" in w)
        if int(flags.get("max-restarts", 0)) > 0:
            last_real_path_reason = "MAX_RESTARTS: torchrun restarts the ranks"
            return None
        nprocs, nnodes, node = int(flags["nproc-per-node"]), int(flags["nnodes"]), int(flags["node-rank"])
        ranks = [{**full, **torchrun_env(node * nprocs + local, local, nprocs, nnodes, node, full)}
                 for local in range(nprocs)]
        return Job(command[script_at:], ranks, cwd, head, torchrun="legacy" if legacy else True)
    return Job(command[1:], [full], cwd, head, torchrun=False)  # '# launcher: python': the recipe starts its own


def torchrun_env(rank, local_rank, nprocs, nnodes, node, env):
    """What torchrun's agent adds to a rank's environment (LocalElasticAgent._start_workers), for a store that rank
    0 hosts on MASTER_PORT (the agent's own store is the real path's)."""
    world = str(nprocs * nnodes)
    return {"RANK": str(rank), "LOCAL_RANK": str(local_rank), "GROUP_RANK": str(node), "ROLE_RANK": str(rank),
            "ROLE_NAME": "default", "LOCAL_WORLD_SIZE": str(nprocs), "WORLD_SIZE": world,
            "GROUP_WORLD_SIZE": str(nnodes), "ROLE_WORLD_SIZE": world, "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "0", "TORCHELASTIC_RUN_ID": "none",
            "TORCHELASTIC_USE_AGENT_STORE": "False",
            "TORCH_NCCL_ASYNC_ERROR_HANDLING": env.get("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")}


def spawn(fn, args=(), nprocs=2):
    """torch.multiprocessing.spawn(fn, args, nprocs) with each process forked from the warm server
    (tests/warm_spawn_rank.py runs fn(rank, *args) there): the same join as spawn's (every process ends with 0, or
    the first to fail stops the others, SIGTERM then SIGKILL 30 s later, and its traceback or exit code is raised as
    ProcessRaisedException or ProcessExitedException), the environment, working folder and sys.path of this
    process, OMP_NUM_THREADS threads or as many as a new interpreter's (one per core). What the processes print is
    printed here after they end, stdout then stderr, rank by rank."""
    import multiprocessing
    import pickle

    from torch.multiprocessing import ProcessExitedException, ProcessRaisedException

    folder = Path(tempfile.mkdtemp(prefix="warm_spawn_"))
    with open(folder / "payload", "wb") as f:
        pickle.dump((bytes(multiprocessing.current_process().authkey), list(sys.path)), f)
        pickle.dump((fn, tuple(args)), f)
    env, srv = dict(os.environ), server()
    threads = int(env.get("OMP_NUM_THREADS") or os.cpu_count() or 1)
    pids = [srv.fork([SPAWN_RANK, folder / "payload", rank, folder / f"{rank}.error"], env, os.getcwd(),
                     folder / f"{rank}.out", folder / f"{rank}.err", threads) for rank in range(nprocs)]
    failed = None
    try:
        while failed is None:
            codes = [srv.poll(pid) for pid in pids]
            failed = next((rank for rank, code in enumerate(codes) if code not in (None, 0)), None)
            if failed is None and all(code == 0 for code in codes):
                return
            if failed is None:
                srv.wait_any([p for p, c in zip(pids, codes, strict=True) if c is None], timeout=0.5)
        for pid in pids:  # spawn's terminate(): SIGTERM to each process still running, SIGKILL after 30 s
            if srv.poll(pid) is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + TERM_GRACE
        while any(srv.poll(pid) is None for pid in pids) and time.monotonic() < deadline:
            srv.wait_any(pids, timeout=0.5)
    finally:
        for pid in pids:  # anything a process left behind (its DataLoader workers), and a process past its grace
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, signal.SIGKILL)
        while any(srv.poll(pid) is None for pid in pids):
            srv.wait_any(pids, timeout=0.5)
        codes = [srv.poll(pid) for pid in pids]
        for pid in pids:
            srv.forget(pid)
        for rank in range(nprocs):
            for kind, stream in (("out", sys.stdout), ("err", sys.stderr)):
                text = (folder / f"{rank}.{kind}").read_text(errors="replace")
                if text:
                    stream.write(text)
                    stream.flush()
        error = folder / f"{failed}.error"
        trace = pickle.loads(error.read_bytes()) if failed is not None and error.exists() else None
        for path in folder.iterdir():
            path.unlink()
        folder.rmdir()
    if trace is not None:
        raise ProcessRaisedException(f"\n\n-- Process {failed:d} terminated with the following error:\n{trace}", failed,
                                     pids[failed])
    code = codes[failed]
    if code < 0:
        name = signal.Signals(-code).name
        raise ProcessExitedException(f"process {failed:d} terminated with signal {name}", error_index=failed,
                                     error_pid=pids[failed], exit_code=code, signal_name=name)
    raise ProcessExitedException(f"process {failed:d} terminated with exit code {code:d}", error_index=failed,
                                 error_pid=pids[failed], exit_code=code)


def direct_job(argv, env, cwd):
    """`python SCRIPT ARGS` as one warm process: a Job, or None (the reason in last_real_path_reason)."""
    global last_real_path_reason
    last_real_path_reason = reason_for_real_path(env)
    if last_real_path_reason:
        return None
    return Job(argv, [env], cwd, torchrun=False)
