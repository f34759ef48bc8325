"""Run a command in its own process group, so that a timeout can kill all of it (launcher, ranks, workers); read
the process table (Linux's /proc) for a job's processes. Standard library only: tests/faults imports it into every
process of a job."""

import os
import signal
import subprocess


def run_group(argv, env, cwd, timeout):
    """subprocess.run in a new session; on timeout the whole group is killed, so no orphaned rank keeps
    running, then TimeoutExpired is raised. Returns a CompletedProcess with text stdout and stderr."""
    with subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                          start_new_session=True) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
    return subprocess.CompletedProcess(argv, proc.returncode, stdout, stderr)


def process_table():
    """{pid: (ppid, start time)} of every process, from /proc: what `ps` shows. A zombie is left out: it has
    exited, only its parent's wait() is missing."""
    table = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:  # it exited while we looked
                continue
            if fields[0] != "Z":
                table[int(entry)] = (int(fields[1]), int(fields[19]))
    return table


def descendants(root, table=None):
    """{pid: start time} of `root` and every process under it: a job's launcher, its ranks (in sessions of their own
    under torchrun) and their DataLoader workers. The start time tells a reused pid from the same process."""
    table, pids = process_table() if table is None else table, {root}
    while True:
        more = {pid for pid, (ppid, _) in table.items() if ppid in pids} - pids
        if not more:
            return {pid: table[pid][1] for pid in pids if pid in table}
        pids |= more
