"""torchrun (or the legacy torch.distributed.launch) with a short failure report: what launch.sh runs.

    python tools/torchrun.py --nproc-per-node=2 recipes/ddp_torchrun.py --arch tiny     # = torchrun ...
    python tools/torchrun.py --legacy-launch --nproc-per-node=2 recipes/ddp_launch.py   # = torch.distributed.launch

It takes torchrun's own flags and runs torchrun's own code in this process; only the end differs.
When a rank fails, torchrun stops the others (SIGTERM to each rank's process group, SIGKILL 30 s later)
and raises ChildFailedError: a traceback and a 20-line report, after which it exits 1 whatever the
rank's exit code was. Here that becomes one line naming every failed rank and how it ended, and the exit
code of the rank that failed first, so a recipe's `exit 2` for a bad flag stays 2 and a rank killed by a
signal gives 128 + its number, as in a shell. Ctrl-C or SIGTERM to this process stops every rank the same
way and exits 128 + the signal number.

Ranks die with it: torchrun starts each rank in a session of its own, so a SIGKILL of torchrun (or of
launch.sh, which becomes this process) used to leave them training. Here every rank it starts gets Linux's
parent-death signal (prctl PR_SET_PDEATHSIG): the kernel SIGKILLs it when this process dies, however it
dies; its DataLoader workers notice that their parent is gone within 5 s and exit.

With --max-restarts N (launch.sh: MAX_RESTARTS=N), torchrun restarts all ranks when one fails, up to N
times; recipes run with --resume auto then continue from their last checkpoint.

SIGUSR1 (a scheduler's warning before a preemption or the time limit: SLURM's --signal=USR1@120) is passed on to
each rank, and only to the ranks: not to their DataLoader workers, and this process does not die of it. A recipe
that saves on it (ddp_checkpoint.py, the language models) saves at a step every rank agrees on and every rank
exits 75 (EX_TEMPFAIL); then this process exits 75 too, without restarting them (MAX_RESTARTS is for failures):
the scheduler's job script requeues the job (slurm/train.sbatch). A rank starts with SIGUSR1 ignored, until its
recipe installs its handler (common.checkpoint.SignalFlag), and the signal is passed on again every second to each
rank until it has that handler (and to ranks started later), so one sent while a rank was starting is not lost.
Recipes without a save on it ignore it. torchrun's own --signals-to-handle loses SIGUSR1 (its handler would stop
every rank at once, with no save).

torchrun's log folder (each rank's error.json) goes with this process, in the temporary folder the ranks' stacks use,
unless --log-dir names one: torchrun alone leaves a /tmp/torchelastic_* folder behind at every launch.

After a hang or a lost peer (a rank's collective timed out, or its peer is gone; or NCCL's watchdog aborted a rank),
every rank's Python stack is printed, in rank order, before the ranks are stopped: show_stacks, docs/failures.md.
"""

import contextlib
import ctypes
import gc
import linecache
import os
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

# SIGUSR1 while torch imports (seconds; launch.sh ignored it until now): kept, and passed on once the handler below
# is in place (pass_sigusr1_to_the_ranks).
EARLY_SIGUSR1 = []
signal.signal(signal.SIGUSR1, lambda signum, frame: EARLY_SIGUSR1.append(signum))
if __name__ == "__main__":  # run as the launcher, not imported (by a test, which keeps Python's Ctrl-C):
    # Ctrl-C while torch imports ends this process as by the signal (exit 130 in the shell), not with a 35-line
    # KeyboardInterrupt traceback from inside the import; main() keeps it so until torchrun handles it.
    signal.signal(signal.SIGINT, signal.SIG_DFL)

from torch.distributed import DistError  # noqa: E402
from torch.distributed import launch as legacy_launch  # noqa: E402
from torch.distributed import run as torch_run  # noqa: E402
from torch.distributed.elastic.agent.server.api import WorkerState  # noqa: E402
from torch.distributed.elastic.agent.server.local_elastic_agent import LocalElasticAgent  # noqa: E402
from torch.distributed.elastic.multiprocessing.api import SignalException, SubprocessContext  # noqa: E402
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError  # noqa: E402
from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler  # noqa: E402
from torch.distributed.elastic.rendezvous import api as rendezvous_api  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # common/, for a script run from anywhere
from common.checkpoint import EX_TEMPFAIL  # noqa: E402
from common.utils import STACK_SIGNAL, STACKS_ENV, first_line  # noqa: E402
from tools.free_port import free_port  # noqa: E402

PR_SET_PDEATHSIG = 1  # linux/prctl.h
RANKS = []  # the Popen of every rank started, for SIGUSR1


def start_ranks_here():
    """Every rank torchrun starts from now on is in RANKS, starts with SIGUSR1 ignored (until its recipe's handler;
    an ignored signal stays ignored across exec), and gets SIGKILL from the kernel when this process dies (Linux)."""
    libc, launcher = ctypes.CDLL(None, use_errno=True), os.getpid()
    # Looked up here, in the parent: between fork and exec the child of a threaded process should only call.
    set_action, prctl = libc.signal, libc.prctl if sys.platform.startswith("linux") else None
    set_action.restype = ctypes.c_void_p
    set_action.argtypes = (ctypes.c_int, ctypes.c_void_p)

    def in_the_rank():  # between fork and exec, in the new process
        set_action(signal.SIGUSR1, 1)  # SIG_IGN
        if prctl is not None:
            prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            if os.getppid() != launcher:  # it died before prctl: no signal will come
                os._exit(1)

    def popen(*args, **kwargs):
        proc = subprocess.Popen(*args, preexec_fn=in_the_rank, **kwargs)
        RANKS.append(proc)
        return proc

    # torchrun's SubprocessHandler starts each rank with this module's Popen.
    subprocess_handler.Popen = popen


def ranks_port_below_the_ephemeral_range():
    """With --max-restarts (the c10d rendezvous, a store for each attempt: launch.sh), torchrun picks the ranks'
    MASTER_PORT on node 0 with a bind to port 0 (RendezvousStoreInfo.build's get_free_port): from the kernel's
    ephemeral range, where another job's connection can take it before rank 0 listens (tools/free_port.py). It picks
    with free_port instead: below that range."""
    if hasattr(rendezvous_api, "get_free_port"):
        rendezvous_api.get_free_port = free_port


def handles(pid, signum):
    """Whether process `pid` has a handler of its own for `signum` (Linux: SigCgt in /proc/PID/status); False where
    that cannot be read."""
    try:
        with open(f"/proc/{pid}/status") as status:
            caught = next(line for line in status if line.startswith("SigCgt:"))
    except (OSError, StopIteration):
        return False
    return bool(int(caught.split()[1], 16) >> (signum - 1) & 1)


def pass_sigusr1_to_the_ranks():
    """SIGUSR1 to this process: to each running rank (os.kill, not its process group: its DataLoader workers are
    left alone), at once and then every second, to each rank until it has its recipe's handler (one still starting
    ignores it) and to any rank started later (a restart), for as long as this process lives."""
    asked, reached = threading.Event(), set()  # reached: the Popen of each rank that has it (a pid can come back)

    def send():
        for proc in RANKS:
            if proc.returncode is None and proc not in reached:  # not yet reaped: its pid is still its own
                handled = handles(proc.pid, signal.SIGUSR1)  # before the kill: this one is then caught
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGUSR1)
                    if handled:
                        reached.add(proc)

    def again():  # a thread: printing from the handler could land inside the main thread's own print
        print(f"launch.sh: SIGUSR1 received: passed on to the {sum(p.returncode is None for p in RANKS)} rank(s); "
              f"a recipe that saves on it saves and exits {EX_TEMPFAIL}", file=sys.stderr, flush=True)
        while True:  # a daemon thread: it ends with this process
            time.sleep(1.0)
            send()

    def handler(signum, frame):
        send()
        if not asked.is_set():
            asked.set()
            threading.Thread(target=again, daemon=True).start()

    signal.signal(signal.SIGUSR1, handler)
    if EARLY_SIGUSR1:  # it came while torch was importing
        handler(signal.SIGUSR1, None)


def without_sigusr1(args):
    """torchrun's --signals-to-handle (PET_SIGNALS_TO_HANDLE) may name SIGUSR1, as its help suggests for SLURM: its
    handler would stop every rank at once (exit 138), with no save. Taken out: SIGUSR1 is this launcher's own."""
    names = [name.strip() for name in args.signals_to_handle.split(",")]
    if "SIGUSR1" in names:
        kept = ",".join(name for name in names if name != "SIGUSR1")
        args.signals_to_handle = kept or "SIGTERM,SIGINT,SIGHUP,SIGQUIT"  # torchrun's default: none left is a warning
        print("launch.sh: SIGUSR1 left out of --signals-to-handle: it is passed on to the ranks for a save (their "
              "recipe's), not a stop", file=sys.stderr, flush=True)
    return args


def saved_and_left(failures):
    """Every rank that did not exit 0 exited 75 after its save, or was stopped (SIGTERM) by torchrun right after
    the first of them left."""
    codes = {failure.exitcode for failure in failures.values()}
    return EX_TEMPFAIL in codes and codes <= {EX_TEMPFAIL, -signal.SIGTERM}


def no_restart_after_a_save():
    """torchrun restarts the ranks (--max-restarts) after any non-zero exit: not after a save for a requeue."""
    monitor = LocalElasticAgent._monitor_workers

    def monitor_then_check(self, worker_group):
        result = monitor(self, worker_group)
        if result.state == WorkerState.FAILED and saved_and_left(result.failures):
            self._remaining_restarts = 0  # as torch does for a rank stuck in an uninterruptible state
        return result

    LocalElasticAgent._monitor_workers = monitor_then_check


HEADER = re.compile(r"^(Current thread|Thread) (0x[0-9a-f]+) \(most recent call first\):$")
FRAME = re.compile(r'^  File "(.*)", line (\d+) in (.*)$')


def python_format(dump):
    """faulthandler's dump (threads most recent call first, no source) as Python prints a stack: each thread most
    recent call last, with its source lines, the main thread (the one whose first frame is a <module>) last, so the
    line each rank is stuck on ends its block. Not a traceback: no "Traceback" line."""
    threads, current = [], None
    for line in dump.splitlines():
        if header := HEADER.match(line):
            current = (header[2], [])
            threads.append(current)
        elif current is not None and (frame := FRAME.match(line)):
            current[1].append(frame.groups())
    threads.sort(key=lambda t: bool(t[1]) and t[1][-1][2] == "<module>")  # the main thread last
    out = []
    for ident, frames in threads:
        main = bool(frames) and frames[-1][2] == "<module>"
        out.append(f"{'Main thread' if main else 'Thread'} {ident} (most recent call last):")
        for filename, lineno, name in reversed(frames):
            out.append(f'  File "{filename}", line {lineno}, in {name}')
            source = linecache.getline(filename, int(lineno)).strip()
            if source:
                out.append(f"    {source}")
    return out


# The pids of ranks that failed because a peer did (each left RANK.failed: a collective that lost its peer or timed
# out): root_cause puts them after the rank that failed first. Pids, not ranks: a restart (MAX_RESTARTS) makes new ones.
VICTIMS = set()


def note_victims(context, folder):
    """VICTIMS += the pid of each rank whose RANK.failed is in `folder` now (before show_stacks removes them)."""
    pids = {int(context.envs[local]["RANK"]): handler.proc.pid for local, handler in
            context.subprocess_handlers.items()}
    for path in folder.glob("rank*.failed"):
        with contextlib.suppress(ValueError, KeyError):
            VICTIMS.add(pids[int(path.name[4:].split(".")[0])])


def show_stacks(context, folder, wait=3.0):
    """Before the ranks are stopped after a failure: if a rank met a collective timeout or a lost peer (it left
    RANK.failed in `folder`, with its stack and its error line), or was aborted (SIGABRT: NCCL's watchdog does that
    to a rank whose collective timed out, and no Python error is raised), every rank's stack, in rank order, then
    those error lines. A rank still running gets STACK_SIGNAL: faulthandler, registered in it by
    common.utils.one_line_errors, writes its frames to RANK.stack even while it is blocked inside a C++ collective.
    Any other failure (a bad file, an exception with its traceback, a killed rank) and Ctrl-C show no stacks.
    context: torchrun's SubprocessContext (its Popen per local rank, and each rank's environment)."""
    handlers = context.subprocess_handlers
    aborted = any(handler.proc.poll() == -signal.SIGABRT for handler in handlers.values())
    if getattr(context, "stacks_shown", False) or not (aborted or any(folder.glob("rank*.failed"))):
        return
    context.stacks_shown = True  # once: torchrun closes a context again on its way out
    ranks = {local_rank: int(context.envs[local_rank]["RANK"]) for local_rank in handlers}
    running = {}
    for local_rank, handler in handlers.items():
        rank = ranks[local_rank]
        if handler.proc.poll() is None and (folder / f"rank{rank}.stack").exists() and not (
                folder / f"rank{rank}.failed").exists():
            with contextlib.suppress(ProcessLookupError):
                os.kill(handler.proc.pid, STACK_SIGNAL)
                running[rank] = handler

    def dumped(rank):
        stack = folder / f"rank{rank}.stack"
        return stack.exists() and stack.stat().st_size > 0

    def settled(rank):  # its dump written (faulthandler writes it whole from its handler), or its own file (it failed
        # meanwhile), or it ended or left its main() (it took its file away and ignores the signal)
        stack, handler = folder / f"rank{rank}.stack", running[rank]
        return (folder / f"rank{rank}.failed").exists() or dumped(rank) or not stack.exists() or (
            handler.proc.poll() is not None)

    deadline = time.monotonic() + wait
    while time.monotonic() < deadline and not all(settled(rank) for rank in running):
        time.sleep(0.05)
    time.sleep(0.1)  # the last thread's lines
    lines, errors = [], []
    for local_rank in sorted(handlers, key=ranks.get):
        rank = ranks[local_rank]
        failed_file, stack_file = folder / f"rank{rank}.failed", folder / f"rank{rank}.stack"
        if failed_file.exists():
            error, _, dump = failed_file.read_text().partition("\n")
            errors.append(error)
        elif rank in running and dumped(rank):
            dump = stack_file.read_text()
        else:
            code = handlers[local_rank].proc.poll()
            how = ("its main() had returned: it was exiting" if code is None else f"exit code {code}" if code >= 0
                   else f"killed by {signal.Signals(-code).name}")
            lines.append(f"[rank {rank}] stack: none, it had ended ({how}) before the others stopped")
            continue
        lines += [f"[rank {rank}] stack:", *python_format(dump)]
    print("\n".join(lines + errors), file=sys.stderr, flush=True)
    note_victims(context, folder)  # the ones that failed while the others were stopped too
    for path in folder.glob("rank*.*"):  # a restart (MAX_RESTARTS) starts from an empty folder: no rank signalled early
        path.unlink()


def stacks_before_stopping(folder):
    """torchrun's SubprocessContext.close, which stops the ranks still running (SIGTERM, then SIGKILL) the moment it
    finds one that failed, and on Ctrl-C and at the end: with show_stacks first."""
    close = SubprocessContext.close

    def close_after_the_stacks(self, *args, **kwargs):
        note_victims(self, folder)
        show_stacks(self, folder)
        return close(self, *args, **kwargs)

    SubprocessContext.close = close_after_the_stacks


def describe(rank, failure):
    if failure.exitcode < 0:
        how = f"was killed by {failure.signal_name()}"
        if failure.exitcode == -signal.SIGTERM:  # the signal torchrun itself stops the surviving ranks with
            how = "was stopped (SIGTERM)"
        elif failure.exitcode == -signal.SIGABRT:  # NCCL's default (TORCH_NCCL_ASYNC_ERROR_HANDLING=3): no Python error
            how += (" (under NCCL, its watchdog aborts a rank whose collective timed out or lost a peer: that rank's "
                    "output above names which, 'Watchdog caught collective operation timeout' or a remote error)")
    else:
        how = f"exited with code {failure.exitcode}"
    return f"rank {rank} (pid {failure.pid}) {how}"


def root_cause(failures):
    """The failures, the first one first. Timestamps are whole seconds, so a rank that torchrun stopped with
    SIGTERM, or one that died of its peer's death (a broken connection, NCCL's watchdog abort), can tie with the
    one that really failed: within a second, a rank torchrun stopped (SIGTERM) comes last, and a rank that said it
    lost its peer or timed out (VICTIMS) after the others (a rank that hung, stopped, leaves the one that timed out
    waiting for it first); then SIGKILL comes first (torchrun sends it only 30 s after SIGTERM, so it came from
    outside: the OOM killer), then other signals, then a non-zero exit. Time still comes first: a rank that ignored
    SIGTERM and got SIGKILL 30 s later is not the cause."""
    def order(item):
        rank, failure = item
        code = failure.exitcode
        kind = (0 if code == -signal.SIGKILL else 1 if code < 0 and code != -signal.SIGTERM else 2 if code > 0
                else 3)
        return failure.timestamp, kind == 3, failure.pid in VICTIMS, kind, rank
    return sorted(failures.items(), key=order)


def job_failed(failures):
    """launch.sh's exit code and last line for a job whose ranks failed ({rank: ProcessFailure}): 75 and "requeue"
    when they saved and left (SIGUSR1), else the first failure's code and every failure, the first one first."""
    if saved_and_left(failures):
        return EX_TEMPFAIL, (f"launch.sh: the ranks saved and exited {EX_TEMPFAIL} (SIGUSR1): requeue the job; with "
                             "--resume auto it goes on from the save")
    ranked = root_cause(failures)
    first = ranked[0][1]
    return (128 - first.exitcode if first.exitcode < 0 else first.exitcode,
            f"launch.sh: job failed: {'; '.join(describe(rank, f) for rank, f in ranked)} "
            "(each rank's own output is above)")


def main(argv):
    legacy = argv[:1] == ["--legacy-launch"]
    if legacy:
        argv = argv[1:]
    start_ranks_here()
    ranks_port_below_the_ephemeral_range()
    pass_sigusr1_to_the_ranks()
    no_restart_after_a_save()
    # Ctrl-C stops this process at once until torchrun handles it (it does from the ranks' start): Python's own
    # handler cannot run while the rendezvous waits inside C++ for the other nodes, up to its 600 s.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    with tempfile.TemporaryDirectory(prefix="launch_stacks_") as folder:
        os.environ[STACKS_ENV] = folder  # the ranks inherit it: their stacks, and their error line after a hang
        stacks_before_stopping(Path(folder))
        return run(legacy, argv, folder)


def logs_in(args, folder):
    """torchrun's log folder (each rank's error.json, and its output under --redirects/--tee) inside `folder`, which
    goes when this process ends, unless --log-dir names one: left to torchrun, every launch leaves a
    /tmp/torchelastic_* folder behind (its DefaultLogsSpecs makes one with mkdtemp and never removes it)."""
    if not args.log_dir:
        args.log_dir = os.path.join(folder, "torchelastic")
    return args


def run(legacy, argv, folder):
    # What torch's import made lives as long as this process: out of the collector's sight, the exit does not walk
    # it in a last collection (half a second of CPU, per launch, while the ranks are exiting too).
    gc.freeze()
    try:
        if legacy:
            legacy_launch.launch(without_sigusr1(logs_in(legacy_launch.parse_args(argv), folder)))
        else:
            torch_run.run(without_sigusr1(logs_in(torch_run.parse_args(argv), folder)))
    except ChildFailedError as exc:
        for failure in exc.failures.values():
            # torchrun stops the process groups of the ranks still running; a rank that died (SIGKILL, OOM) leaves
            # its DataLoader workers behind, holding the output pipe open until they notice, up to 5 s later.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(failure.pid, signal.SIGKILL)  # each rank leads its own group (start_new_session)
        code, line = job_failed(exc.failures)
        print(line, file=sys.stderr, flush=True)
        return code
    except (DistError, rendezvous_api.RendezvousError) as exc:  # the nodes did not meet: a port taken, a node missing
        print(f"launch.sh: error: the rendezvous failed: {first_line(exc)[:300]}", file=sys.stderr,
              flush=True)
        return 1
    except SignalException as exc:  # torchrun has already stopped every rank with the same signal
        print(f"launch.sh: {exc.sigval.name} received: all ranks were stopped", file=sys.stderr, flush=True)
        return 128 + exc.sigval
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
