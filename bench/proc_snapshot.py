#!/usr/bin/env python3
"""What naming a process's sockets costs when its state is read (each flight segment's start, each traced
process's snapshot): every socket table read, against only as many as its sockets need, in one run.

    .venv/bin/python bench/proc_snapshot.py [--rounds 5] [--calls 50]

A child process holds a unix socket (as a job's agent connection or a DataLoader's queue) and, with ``--tcp``, a
TCP connection too. ``procfs.socket_peers`` reads /proc/PID/net/{unix,udp,udp6,tcp,tcp6}; a TCP table's read
walks the host's whole connection hash (milliseconds on a host sized for many connections, even when it holds
few), so ``fd_snapshot`` now reads the tables cheapest first and stops once each of the process's sockets is
named. Prints the ms per call of each, taking turns ``--rounds`` times, and their ratio.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time

from gputrace.probes import procfs

CHILD = """
import socket, sys, tempfile, os
d = tempfile.mkdtemp()
u = socket.socket(socket.AF_UNIX); u.bind(os.path.join(d, "agent.sock"))
if sys.argv[1] == "tcp":
    l = socket.socket(); l.bind(("127.0.0.1", 0)); l.listen(); c = socket.create_connection(l.getsockname())
print("up", flush=True)
sys.stdin.readline()
"""


def per_call_ms(fn: object, calls: int) -> float:
    assert callable(fn)
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - t0) / calls * 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--calls", type=int, default=50, help="calls per timing (default 50)")
    p.add_argument("--tcp", action="store_true", help="the child holds a TCP connection too")
    args = p.parse_args()
    child = subprocess.Popen([sys.executable, "-c", CHILD, "tcp" if args.tcp else "unix"], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "up"
        pid = child.pid
        every, needed = [], []
        for _ in range(args.rounds):
            every.append(per_call_ms(lambda: procfs.socket_peers(pid), args.calls))
            needed.append(per_call_ms(lambda: procfs.fd_snapshot(pid), args.calls))
        named = {i.fd: i.obj for i in procfs.fd_snapshot(pid)}
    finally:
        child.kill()
        child.wait()
    e, n = statistics.median(every), statistics.median(needed)
    sockets = sorted(v for v in named.values() if v.startswith(("unix:", "127.", "listen")))
    print(f"# pid {pid}'s sockets: {', '.join(sockets)}; medians of {args.rounds} turns of {args.calls} calls")
    print(f"every socket table (before)             {e:7.3f} ms a call")
    print(f"fd_snapshot, the tables it needs (now)  {n:7.3f} ms a call (its fds and their names included)")
    print(f"now / before: {n / e:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
