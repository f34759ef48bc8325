"""Run a command in its own process group, so that a timeout can kill all of it (launcher, ranks, workers)."""

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
