#!/usr/bin/env python3
"""What tracing costs a real PyTorch job: examples/train_torch.py's step time untraced, traced with every
source, and traced with each source family turned off, side by side in one run.

    sudo .venv/bin/python bench/job_overhead.py --device sim
    sudo .venv/bin/python bench/job_overhead.py --device cuda --rounds 3 --off syscalls,sched,agent
    sudo .venv/bin/python bench/job_overhead.py --device cuda --watch --off agent --steps 1500 -- --workers 2

``--watch`` adds a state: the job started plainly while `gputrace daemon --watch` (a private instance) runs,
found by the service as any GPU job is (its libcuda mapping, its /dev/nvidia* files, NVML; a --device sim job
announces itself) and traced from then on: its step time is taken over the steps that end 2 s after the
service said it watches the job (the agent injected, the first segments written), its cost from the
service's status (the job's tracing_cpu_share, which counts the service's own threads for the job).

Every run is a fresh process tree (the job under `gputrace capture --` when traced); each round runs every
state once, in an order rotated from round to round, so the machine's other load falls on all of them alike.
The step time is the job's own: from its --step-log marks, the mean time per step over the steady steps (the
first fifth, with the workers starting and CUDA warming up, left out) — not wall time, which counts start-up.
The ratio is the median over rounds of each state against the untraced run of the same round. Each traced
run also prints the capture's own measure of what tracing cost (capture.overhead: share of the host's CPU,
by source), so the two can be compared.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gputrace.analysis.overhead import cost_text, read_overhead
from gputrace.capture import CaptureReader
from gputrace.documents import Overhead
from gputrace.families import FAMILIES, parse_off

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_torch.py"
DEFAULT_OFF = "syscalls,sched,block,faults,sampler,agent,cgroups,nvml"


def steady_step_ms(step_log: Path, since_ns: int = 0) -> float:
    """Mean time per step over the steady steps (after the first fifth, or those that end after ``since_ns``),
    from train_torch's --step-log."""
    ends: list[int] = json.loads(step_log.read_text())["step_end_ns"]
    after = (i for i, t in enumerate(ends) if t >= since_ns)
    first = next(after, len(ends)) if since_ns else max(1, len(ends) // 5)
    if len(ends) - first < 2:
        raise SystemExit(f"job_overhead: {step_log}: too few steps ({len(ends)}) for a steady-state time")
    return float((ends[-1] - ends[first]) / (len(ends) - 1 - first) / 1e6)


def run_watched(job: list[str], work: Path, n: int) -> tuple[float, Overhead | None]:
    """One fresh run of the job, plainly started, while a watch service runs: (step ms after it was watched,
    the job's cost as the service's status gave it last)."""
    from watch_cost import Service, bench_env

    log = work / f"{n}-watch.steps.json"
    env = bench_env()
    base = Path(tempfile.mkdtemp(prefix="svc-", dir=work))
    svc = Service(base, env, [], None)
    try:
        if "sim" in job:  # a simulated device is no GPU the service can see: the job announces itself
            from gputrace.agent import arming

            env = {**env, **arming.environment(None, base=env)}
        proc = subprocess.Popen([*job, "--step-log", str(log)], cwd=work, stdout=subprocess.PIPE,
                                stderr=subprocess.STDOUT, text=True, env=env)
        since, last = 0, None
        while proc.poll() is None:
            mine = [j for j in svc.status()["jobs"] if j["pid"] == proc.pid and j["state"] == "watching"]
            if mine and not since:
                since = time.monotonic_ns() + 2_000_000_000
            if mine and mine[0].get("tracing_cpu_share") is not None:
                last = mine[0]
            time.sleep(0.5)
        out = proc.communicate()[0]
    finally:
        svc.stop()
    if proc.returncode != 0:
        raise SystemExit(f"job_overhead: watch: the job failed ({proc.returncode}):\n{out[-2000:]}")
    if not since:
        raise SystemExit("job_overhead: watch: the service never watched the job: raise --steps")
    cost: Overhead | None = None
    if last is not None:
        cost = {"cpu_share": float(last["tracing_cpu_share"]), "by_source": {}, "events": {}, "wakeups": {},
                "events_per_s": {}}
    return steady_step_ms(log, since), cost


def run_state(state: str, job: list[str], work: Path, n: int) -> tuple[float, Overhead | None]:
    """One fresh run of the job in ``state`` ("untraced", "all", "watch" or "off:FAMILY"): (step ms, overhead)."""
    if state == "watch":
        return run_watched(job, work, n)
    log = work / f"{n}-{state.replace(':', '-')}.steps.json"
    cmd = [*job, "--step-log", str(log)]
    cap = work / f"{n}.gputrace"
    if state != "untraced":
        off = ["--off", state.split(":", 1)[1]] if state.startswith("off:") else []
        cmd = [sys.executable, "-m", "gputrace", "capture", "-f", "--no-perfetto", "-o", str(cap), *off, "--", *cmd]
    done = subprocess.run(cmd, cwd=work, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        raise SystemExit(f"job_overhead: {state} failed ({done.returncode}):\n{done.stdout[-2000:]}")
    overhead = None
    if state != "untraced":
        with CaptureReader(cap) as reader:
            for _ in reader.records():
                pass
            overhead = read_overhead((reader.trailer or {}).get("overhead"))
        cap.unlink()
    return steady_step_ms(log), overhead


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="sim", help="train_torch's --device: sim, cpu or cuda (default: sim)")
    p.add_argument("--rounds", type=int, default=3, help="rounds of every state (default: 3)")
    p.add_argument("--steps", type=int, default=60, help="steps per run (default: 60)")
    p.add_argument("--off", default=DEFAULT_OFF,
                   help=f"families to turn off one at a time, comma-separated (default: {DEFAULT_OFF}; "
                        f"'' for none; any of: {', '.join(FAMILIES)})")  # fmt: skip
    p.add_argument("--watch", action="store_true", help="also run the job watched by `gputrace daemon --watch`")
    p.add_argument("job_args", nargs="*", help="more train_torch arguments, after -- (default: --slow-worker 1)")
    args = p.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("job_overhead: run as root (the traced states load eBPF programs)")
    off = sorted(parse_off([args.off]), key=list(FAMILIES).index) if args.off else []
    states = ["untraced", "all", *(["watch"] if args.watch else []), *(f"off:{f}" for f in off)]
    extra = args.job_args or ["--slow-worker", "1"]
    job = [sys.executable, str(EXAMPLE), "--device", args.device, "--steps", str(args.steps), *extra]
    print(f"job_overhead: {' '.join(job[1:])}; {args.rounds} rounds of {len(states)} states, "
          f"{os.cpu_count()} CPUs", flush=True)
    ms: dict[str, list[float]] = {s: [] for s in states}
    ratios: dict[str, list[float]] = {s: [] for s in states}
    costs: dict[str, list[Overhead]] = {s: [] for s in states}
    with tempfile.TemporaryDirectory(prefix="gputrace-job-overhead-") as tmp:
        n = 0
        for r in range(args.rounds):
            order = states[r % len(states):] + states[: r % len(states)]
            got: dict[str, float] = {}
            for state in order:
                n += 1
                got[state], overhead = run_state(state, job, Path(tmp), n)
                ms[state].append(got[state])
                if overhead is not None:
                    costs[state].append(overhead)
                print(f"  round {r + 1} {state:14s} {got[state]:8.2f} ms/step", flush=True)
            for state in states:
                ratios[state].append(got[state] / got["untraced"])
    print(f"\n{'state':16s} {'ms/step':>9s} {'ratio':>7s}  tracing cost as the capture measured it (median run)")
    for state in states:
        line = f"{state:16s} {statistics.median(ms[state]):9.2f} {statistics.median(ratios[state]):7.3f}"
        if costs[state]:
            mid = sorted(costs[state], key=lambda o: o["cpu_share"])[len(costs[state]) // 2]
            line += "  " + cost_text(mid)
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
