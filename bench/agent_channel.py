#!/usr/bin/env python3
"""What the agent and its channel cost, measured side by side in one run (no GPU needed).

  startup     `python -c pass` plain, armed-dormant (GPUTRACE_AGENT=1) and armed for a live session
  launch      host µs per simulated launch+sync pair without a session and with one (records flowing)
  throughput  records/s from one agent process through the session socket into a capture file, and drops

    .venv/bin/python bench/agent_channel.py
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gputrace.agent import arming
from gputrace.capture import CaptureWriter, host_header
from gputrace.daemon.agents.server import AgentServer
from gputrace.daemon.writer import QueueSink

LAUNCHES = """
import sys, time
from gputrace.sim import Device
s = Device(0).stream()
n = int(sys.argv[1])
t = time.perf_counter()
for _ in range(n):
    s.launch("k", duration_ms=0)
    s.synchronize()
print((time.perf_counter() - t) / n * 1e6)
"""

FLOOD = """
import os, sys, time
from gputrace.agent import arming
from gputrace.records import GpuKernel
agent = arming.current()
n, pid, batch = int(sys.argv[1]), os.getpid(), 256
rows = [GpuKernel(pid, 0, 1, 1, i, i + 5, i, "gemm_kernel", (1, 1, 1), (128, 1, 1)) for i in range(batch)]
t = time.perf_counter()
for _ in range(n // batch):
    agent.submit(rows)
    while len(agent.queue) > 32768:   # pace like a real producer instead of overflowing at once
        time.sleep(0.001)
print(time.perf_counter() - t)
"""


class Session:
    def __init__(self, tmp: Path) -> None:
        self.pids: set[int] = set()
        self.server = AgentServer(tmp / "agent.sock", authorize=self.pids.__contains__, attach_dir=str(tmp / "a"))
        self.writer = CaptureWriter(tmp / "bench.gputrace", host_header(["bench"]), force=True)
        self.sink = QueueSink(self.writer)
        self.server.start(self.sink)

    def run(self, code: str, *args: str) -> str:
        env = {**_clean_env(), **self.server.child_env(_clean_env())}
        p = subprocess.Popen([sys.executable, "-c", code, *args], env=env, stdout=subprocess.PIPE, text=True)
        self.pids.add(p.pid)
        out, _ = p.communicate(timeout=300)
        return out.strip()

    def close(self) -> dict[str, int]:
        self.server.stop()
        self.sink.close()
        self.writer.close({})
        return self.server.drops()


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("GPUTRACE_") and k != "PYTHONPATH"}


def _one_start_ms(env: dict[str, str]) -> float:
    t = time.perf_counter()
    subprocess.run([sys.executable, "-c", "pass"], env=env, check=True)
    return (time.perf_counter() - t) * 1000


def bench_startup(tmp: Path, runs: int) -> None:
    """Modes interleaved run by run, so a change in the machine's load hits them all alike."""
    plain = _clean_env()
    session = Session(tmp / "s0")
    session.server.authorize = lambda pid: True  # each run is a new pid
    modes = {
        "plain": plain,
        "boot dir only (chain)": {**plain, "PYTHONPATH": arming.boot_dir()},
        "armed, dormant": {**plain, **arming.environment(None, base=plain), "GPUTRACE_ATTACH_DIR": str(tmp / "no")},
        "armed, live session": {**plain, **session.server.child_env(plain)},
    }
    times: dict[str, list[float]] = {name: [] for name in modes}
    for _ in range(runs):
        for name, env in modes.items():
            times[name].append(_one_start_ms(env))
    session.close()
    base = statistics.median(times["plain"])
    for name, ts in times.items():
        ms = statistics.median(ts)
        print(f"startup  {name:<22} {ms:7.1f} ms  ({ms - base:+5.1f} ms)   median of {runs} `python -c pass`")


def bench_launch(tmp: Path, n: int) -> None:
    plain = subprocess.run([sys.executable, "-c", LAUNCHES, str(n)], env=_clean_env(), capture_output=True,
                           text=True, check=True).stdout.strip()
    session = Session(tmp / "s1")
    traced = session.run(LAUNCHES, str(n))
    drops = session.close()
    print(f"launch   no session  {float(plain):7.1f} µs per launch+synchronize ({n} pairs)")
    print(f"launch   with session {float(traced):6.1f} µs per launch+synchronize "
          f"({session.server.stats['records']} records, drops {sum(drops.values())})")


def bench_throughput(tmp: Path, n: int) -> None:
    session = Session(tmp / "s2")
    t0 = time.perf_counter()
    produce_s = float(session.run(FLOOD, str(n)))
    drops = session.close()
    total = time.perf_counter() - t0
    got = session.server.stats["records"]
    print(f"channel  {got:,} records in {total:.2f} s end to end ({got / total:,.0f} records/s; producer "
          f"{n / produce_s:,.0f}/s); drops {drops}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--runs", type=int, default=20, help="startup runs per mode")
    p.add_argument("--launches", type=int, default=5000)
    p.add_argument("--records", type=int, default=500_000)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="gputrace-bench-") as d:
        tmp = Path(d)
        for sub in ("s0", "s1", "s2"):
            (tmp / sub).mkdir()
        bench_startup(tmp, args.runs)
        bench_launch(tmp, args.launches)
        bench_throughput(tmp, args.records)
    return 0


if __name__ == "__main__":
    sys.exit(main())
