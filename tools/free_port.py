"""Print a free TCP port for a job's rendezvous, one below the kernel's ephemeral range (launch.sh's default).

A port the kernel hands out with bind(("", 0)) comes from its ephemeral range (net.ipv4.ip_local_port_range,
32768-60999 by default), the range it also draws every outgoing connection's local port from. Between the pick and
torchrun's listen on it, another job's connection (gloo and NCCL open many) can take it: EADDRINUSE, seen on a GPU
machine running 8 test jobs at once. A random free port below that range is not one the kernel hands out.

Jobs started together (a sweep, a test suite) would each find the same port free when their random picks meet (6
at once: 1 in 800) and one would fail to listen. So the picks of the last HOLD_S seconds are kept in a file of the
user's in the temporary folder, read and written under a lock: a port picked there is not picked again until
torchrun has had time to listen on it (where the file cannot be used, the pick goes on without it).

    python tools/free_port.py              # below the ephemeral range (launch.sh's MASTER_PORT)
    python tools/free_port.py 29500 29600  # in [29500, 29600): a free one, or one line and exit 1 if none is

With LOW and HIGH it prints only a port in [LOW, HIGH), 1 <= LOW < HIGH <= 65536: random draws, then (a range that
is small or nearly full) every port of it in random order; none free there (or all picked in the last HOLD_S
seconds): one line on stderr, exit 1. Bad arguments: one line, exit 2.
"""

import contextlib
import fcntl
import itertools
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
    room. With low and high given, only a port in [low, high): after `tries` random draws (none where the range is
    under 1000 ports) every port of it, in random order; OSError when none is free."""
    given = low is not None
    if not given:
        start = ephemeral_range()[0]
        low, high = max(1024, start - 12000), start

    def walk():  # lazily: a large range is seldom walked
        yield from random.sample(range(low, high), high - low)

    with recent_picks(recent) as picks:
        draws = (random.randint(low, high - 1) for _ in range(tries if high - low >= 1000 else 0))
        for port in itertools.chain(draws, walk() if given else ()):
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
    if given:
        raise OSError(f"no free port in [{low}, {high}): each is in use or was picked in the last {HOLD_S} s")
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def main(argv):
    """The command line: prints the port, or one line on stderr (exit 2: bad arguments, 1: none free)."""
    usage = "usage: python tools/free_port.py [LOW HIGH]"
    if len(argv) not in (0, 2):
        print(f"error: expected no argument or LOW HIGH, got {len(argv)}; {usage}", file=sys.stderr)
        return 2
    try:
        bounds = [int(a) for a in argv]
    except ValueError:
        print(f"error: LOW and HIGH must be whole numbers, not {' '.join(argv)!r}; {usage}", file=sys.stderr)
        return 2
    if bounds and not 1 <= bounds[0] < bounds[1] <= 65536:
        print(f"error: LOW {bounds[0]} and HIGH {bounds[1]} must satisfy 1 <= LOW < HIGH <= 65536 (HIGH is not "
              "included); " + usage, file=sys.stderr)
        return 2
    try:
        print(free_port(*bounds))
    except OSError as exc:
        print(f"error: {exc}; give a wider range", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
