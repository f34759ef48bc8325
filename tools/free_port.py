"""Print a free TCP port for a job's rendezvous, one below the kernel's ephemeral range (launch.sh's default).

A port the kernel hands out with bind(("", 0)) comes from its ephemeral range (net.ipv4.ip_local_port_range,
32768-60999 by default), the range it also draws every outgoing connection's local port from. Between the pick and
torchrun's listen on it, another job's connection (gloo and NCCL open many) can take it: EADDRINUSE, seen on a GPU
machine running 8 test jobs at once. A random free port below that range is not one the kernel hands out.
"""

import random
import socket
import sys


def ephemeral_range(path="/proc/sys/net/ipv4/ip_local_port_range"):
    try:
        low, high = (int(x) for x in open(path).read().split())
    except (OSError, ValueError):
        return 32768, 60999  # Linux's default; also where the file is missing (macOS)
    return low, high


def free_port(low=None, high=None, tries=200):
    """A random port in [low, high) that binds now (SO_REUSEADDR, as torch's TCPStore sets it, so a port in
    TIME_WAIT counts as free). By default the 12,000 ports below the ephemeral range; the kernel's pick if that
    range starts too low to leave room."""
    if low is None:
        start = ephemeral_range()[0]
        low, high = max(1024, start - 12000), start
    for _ in range(tries if high - low >= 1000 else 0):
        port = random.randint(low, high - 1)
        with socket.socket() as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    if len(sys.argv) not in (1, 3):
        sys.exit("usage: python tools/free_port.py [LOW HIGH]")
    print(free_port(*(int(a) for a in sys.argv[1:])))
