"""Print a free TCP port for a job's rendezvous, one below the kernel's ephemeral range (launch.sh's default).

A port the kernel hands out with bind(("", 0)) comes from its ephemeral range (net.ipv4.ip_local_port_range,
32768-60999 by default), the range it also draws every outgoing connection's local port from. Between the pick and
torchrun's listen on it, another job's connection (gloo and NCCL open many) can take it: EADDRINUSE, seen on a GPU
machine running 8 test jobs at once. A random free port below that range is not one the kernel hands out.

Jobs started together (a sweep, a test suite) would each find the same port free when their random picks meet (6
at once: 1 in 800) and one would fail to listen. So the picks of the last HOLD_S seconds are kept in a file of the
user's in the temporary folder, read and written under a lock: a port picked there is not picked again until
torchrun has had time to listen on it (where the file cannot be used, the pick goes on without it).
"""

import contextlib
import fcntl
import os
import random
import socket
import sys
import tempfile
import time

HOLD_S = 120  # torchrun listens on its port within seconds of the pick
RECENT = os.path.join(tempfile.gettempdir(), f"ddp-cookbook-ports-{os.getuid()}")


def ephemeral_range(path="/proc/sys/net/ipv4/ip_local_port_range"):
    try:
        low, high = (int(x) for x in open(path).read().split())
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default; also where the file is missing (macOS)
    return low, high


@contextlib.contextmanager
def recent_picks(path=RECENT):
    """{port: when picked} of the last HOLD_S seconds, held under an exclusive lock; what the caller adds is written
    back. An unusable file (another user's, a read-only folder): an empty dict, nothing kept."""
    try:
        f = open(path, "a+")
    except OSError:
        yield {}
        return
    with f:
        fcntl.flock(f, fcntl.LOCK_EX)
        f.seek(0)
        now, picks = time.time(), {}
        for line in f.read().split("\n"):
            port, _, when = line.partition(" ")
            with contextlib.suppress(ValueError):
                if now - float(when) < HOLD_S:
                    picks[int(port)] = float(when)
        yield picks
        f.seek(0)
        f.truncate()
        f.write("".join(f"{port} {when}\n" for port, when in picks.items()))


def free_port(low=None, high=None, tries=200, recent=RECENT):
    """A random port in [low, high) that binds now (SO_REUSEADDR, as torch's TCPStore sets it, so a port in
    TIME_WAIT counts as free) and that no pick of the last HOLD_S seconds took (`recent`: the file that keeps them).
    By default the 12,000 ports below the ephemeral range; the kernel's pick if that range starts too low to leave
    room."""
    if low is None:
        start = ephemeral_range()[0]
        low, high = max(1024, start - 12000), start
    with recent_picks(recent) as picks:
        for _ in range(tries if high - low >= 1000 else 0):
            port = random.randint(low, high - 1)
            if port in picks:
                continue
            with socket.socket() as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                try:
                    s.bind(("", port))
                except OSError:
                    continue
            picks[port] = time.time()
            return port
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    if len(sys.argv) not in (1, 3):
        sys.exit("usage: python tools/free_port.py [LOW HIGH]")
    print(free_port(*(int(a) for a in sys.argv[1:])))
