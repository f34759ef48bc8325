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
times; recipes run with --resume auto then continue from their last whole epoch.
"""

import contextlib
import ctypes
import functools
import gc
import os
import signal
import subprocess
import sys

from torch.distributed import launch as legacy_launch
from torch.distributed import run as torch_run
from torch.distributed.elastic.multiprocessing.api import SignalException
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.elastic.multiprocessing.subprocess_handler import subprocess_handler

PR_SET_PDEATHSIG = 1  # linux/prctl.h


def ranks_die_with_this_process():
    """Every rank torchrun starts from now on gets SIGKILL from the kernel when this process dies (Linux)."""
    if not sys.platform.startswith("linux"):
        return
    prctl, launcher = ctypes.CDLL(None, use_errno=True).prctl, os.getpid()

    def in_the_rank():  # between fork and exec, in the new process
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        if os.getppid() != launcher:  # it died before prctl: no signal will come
            os._exit(1)

    # torchrun's SubprocessHandler starts each rank with this module's Popen.
    subprocess_handler.Popen = functools.partial(subprocess.Popen, preexec_fn=in_the_rank)


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
    one that really failed: within a second, SIGKILL comes first (torchrun sends it only 30 s after SIGTERM, so
    it came from outside: the OOM killer), then other signals, then a non-zero exit, then SIGTERM. Time still
    comes first: a rank that ignored SIGTERM and got SIGKILL 30 s later is not the cause."""
    def order(item):
        rank, failure = item
        code = failure.exitcode
        kind = (0 if code == -signal.SIGKILL else 1 if code < 0 and code != -signal.SIGTERM else 2 if code > 0
                else 3)
        return failure.timestamp, kind, rank
    return sorted(failures.items(), key=order)


def main(argv):
    legacy = argv[:1] == ["--legacy-launch"]
    if legacy:
        argv = argv[1:]
    ranks_die_with_this_process()
    # What torch's import made lives as long as this process: out of the collector's sight, the exit does not walk
    # it in a last collection (half a second of CPU, per launch, while the ranks are exiting too).
    gc.freeze()
    try:
        if legacy:
            legacy_launch.launch(legacy_launch.parse_args(argv))
        else:
            torch_run.run(torch_run.parse_args(argv))
    except ChildFailedError as exc:
        for failure in exc.failures.values():
            # torchrun stops the process groups of the ranks still running; a rank that died (SIGKILL, OOM) leaves
            # its DataLoader workers behind, holding the output pipe open until they notice, up to 5 s later.
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(failure.pid, signal.SIGKILL)  # each rank leads its own group (start_new_session)
        ranked = root_cause(exc.failures)
        first = ranked[0][1]
        print(f"launch.sh: job failed: {'; '.join(describe(rank, f) for rank, f in ranked)} "
              "(each rank's own output is above)", file=sys.stderr, flush=True)
        return 128 - first.exitcode if first.exitcode < 0 else first.exitcode
    except SignalException as exc:  # torchrun has already stopped every rank with the same signal
        print(f"launch.sh: {exc.sigval.name} received: all ranks were stopped", file=sys.stderr, flush=True)
        return 128 + exc.sigval
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
