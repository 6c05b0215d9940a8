"""Raw against classic tracepoints for the eBPF source's scheduler and interrupt hooks, side by side.

    sudo .venv/bin/python bench/sched_hooks.py [--rounds R] [--steps N] [--switches N]

Two measurements, each round running both hooks back to back (order alternating between rounds):

1. What the kernel skipped: the README's job (examples/train_sim.py --slow-worker 1 --cold, a trainer on
   the simulated device fed by worker processes reading files from a cold page cache) traced by the eBPF
   source with `sched_hook` raw, then classic. Printed per hook: the runs the kernel skipped (each
   program's recursion_misses: a classic program is skipped while another classic or perf-event program
   runs on its CPU, a raw one only when it nests in itself), of them in the scheduler programs; the job's
   sleeps (off-CPU waits other than preemption) and how many lack a waker (no sched_waking was seen).
2. What a context switch costs: two threads of an untraced-then-traced process hand a token back and forth
   over pipes; ns per round trip (two switches) untraced, traced with raw hooks, traced with classic ones.
   The ratio is the median over rounds against the untraced run of the same round.
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from contextlib import nullcontext
from pathlib import Path

from gputrace.capture import CaptureReader
from gputrace.daemon.writer import source_capture
from gputrace.probes.ebpf.source import EbpfSource
from gputrace.probes.ebpf.syscalls import RAW_SCHED_ONLY, SCHED_TRACEPOINTS
from gputrace.records import OffCpu

ROOT = Path(__file__).resolve().parent.parent
SCHED = {name for _, name, _ in SCHED_TRACEPOINTS + RAW_SCHED_ONLY}
HOOKS = ("raw", "classic")

PINGPONG = """
import os, sys, threading, time
n = int(sys.argv[1])
a_r, a_w = os.pipe()
b_r, b_w = os.pipe()
def echo():
    for _ in range(n):
        os.write(b_w, os.read(a_r, 1))
t = threading.Thread(target=echo)
t.start()
print("ready", flush=True)
sys.stdin.readline()
t0 = time.perf_counter_ns()
for _ in range(n):
    os.write(a_w, b"x")
    os.read(b_r, 1)
print((time.perf_counter_ns() - t0) / n, flush=True)
t.join()
"""


def job(hook: str, out: Path, steps: int) -> dict[str, int]:
    """Trace one run of the job; what the kernel skipped and how many waits lack a waker."""
    cmd = [sys.executable, str(ROOT / "examples/train_sim.py"), "--slow-worker", "1", "--cold", "--steps",
           str(steps), "--data", str(out / "data")]
    gate = subprocess.Popen([sys.executable, "-c", "import os, sys; sys.stdin.readline(); os.execv(sys.argv[1], "
                             "sys.argv[1:])", *cmd], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True)
    assert gate.stdin is not None
    path = out / f"{hook}.gputrace"
    with source_capture(path, EbpfSource([gate.pid], sched_hook=hook), ["bench"]) as src:
        gate.stdin.write("go\n")
        gate.stdin.close()
        gate.wait()
    skips = src.skipped()
    with CaptureReader(path) as reader:
        waits = [r for r in reader.records() if isinstance(r, OffCpu) and r.state != "R"]  # not preempted
    path.unlink()
    return {"skipped": sum(skips.values()), "skipped_sched": sum(n for k, n in skips.items() if k in SCHED),
            "waits": len(waits), "no_waker": sum(1 for w in waits if not w.waker_tid and not w.waker_comm)}


def pingpong(hook: str | None, out: Path, n: int) -> float:
    p = subprocess.Popen([sys.executable, "-c", PINGPONG, str(n)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    assert p.stdin is not None and p.stdout is not None
    assert p.stdout.readline() == "ready\n"
    path = out / f"pp-{hook}.gputrace"
    with source_capture(path, EbpfSource([p.pid], sched_hook=hook), ["bench"]) if hook else nullcontext():
        p.stdin.write("go\n")
        p.stdin.flush()
        ns = float(p.stdout.readline())
    p.wait()
    path.unlink(missing_ok=True)
    return ns


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=150, help="training steps per traced job")
    ap.add_argument("--switches", type=int, default=20_000, help="round trips per ping-pong run")
    args = ap.parse_args()
    jobs: dict[str, list[dict[str, int]]] = {h: [] for h in HOOKS}
    trips: dict[str, list[float]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        for r in range(args.rounds):
            order = HOOKS if r % 2 == 0 else HOOKS[::-1]
            for hook in order:
                jobs[hook].append(job(hook, out, args.steps))
            trips.setdefault("untraced", []).append(pingpong(None, out, args.switches))
            for hook in order:
                trips.setdefault(hook, []).append(pingpong(hook, out, args.switches))
    report(jobs, trips)


def report(jobs: dict[str, list[dict[str, int]]], trips: dict[str, list[float]]) -> None:
    print("skipped probe runs and waits without a waker, per traced job (one value per round)")
    print(f"{'hook':8} {'skipped (all)':>16} {'in sched programs':>18} {'sleeps':>16} {'no waker':>12}")
    for hook, runs in jobs.items():
        def col(key: str, runs: list[dict[str, int]] = runs) -> str:
            return "/".join(str(x[key]) for x in runs)
        print(f"{hook:8} {col('skipped'):>16} {col('skipped_sched'):>18} {col('waits'):>16} {col('no_waker'):>12}")
    print()
    print("context switch round trip (two switches), ns")
    print(f"{'mode':10} {'best ns':>9} {'ratio':>8}")
    base = trips["untraced"]
    for mode, ns in trips.items():
        ratio = statistics.median(n / b for n, b in zip(ns, base, strict=True))
        print(f"{mode:10} {min(ns):9.0f} {ratio:7.2f}x")


if __name__ == "__main__":
    main()
