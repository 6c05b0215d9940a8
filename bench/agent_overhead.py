#!/usr/bin/env python3
"""Cost of the CUPTI agent on a small PyTorch loop: step time without and with it, and µs per kernel.

Each run is a fresh process (CUPTI cannot be fully detached from one). Modes:
  backend  the agent's CuptiBackend started in the process, records counted and msgpack-encoded as the
           agent would send them (the cost CUPTI and conversion add, without a session)
  capture  the loop under `gputrace capture --` (agent armed by the session, eBPF and NVML running too)

    sudo .venv/bin/python bench/agent_overhead.py                 # backend mode, defaults
    sudo .venv/bin/python bench/agent_overhead.py --mode capture --steps 300

Needs an NVIDIA GPU with CUDA, torch and cupti-python; refuses with the reason otherwise.
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
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gputrace.probes.cupti import real_gpu_missing

# ------------------------------------------------------------------------------------------- child ---
KERNELS_PER_OP = 3  # x @ w, relu, * 0.5



def child(args: argparse.Namespace) -> None:
    import torch

    counter = {"records": 0, "kernels": 0, "bytes": 0}
    backend = None
    if args.child == "on":
        import msgpack

        from gputrace.probes.cupti import CuptiBackend

        def emit(records: Sequence[tuple[Any, ...]]) -> None:
            counter["records"] += len(records)
            counter["kernels"] += sum(type(r).__name__ == "GpuKernel" for r in records)
            counter["bytes"] += len(msgpack.packb([list(r) for r in records], use_bin_type=True))

        backend = CuptiBackend()
        backend.start(emit)
    dev = torch.device("cuda")
    x = torch.randn(args.size, args.size, device=dev)
    w = torch.randn(args.size, args.size, device=dev)
    times = []
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        for _ in range(args.ops):
            x = torch.relu(x @ w) * 0.5
        torch.cuda.synchronize()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    if backend is not None:
        backend.stop()
        counter.update({f"drop_{k}": v for k, v in backend.drops().items()})
    print(json.dumps({"step_s": times, **counter}))


# ------------------------------------------------------------------------------------------ parent ---


def run_child(args: argparse.Namespace, state: str) -> dict[str, Any]:
    cmd = [sys.executable, __file__, "--child", "off" if state == "off" else "on", "--steps", str(args.steps),
           "--warmup", str(args.warmup), "--size", str(args.size), "--ops", str(args.ops)]  # fmt: skip
    if args.mode == "capture" and state == "on":
        out = Path(tempfile.mkdtemp()) / "bench.gputrace"
        cmd = [sys.executable, "-m", "gputrace", "capture", "-f", "--no-perfetto", "-o", str(out), "--", *cmd[:3],
               "off", *cmd[4:]]  # fmt: skip  # the session arms the agent; the child starts none itself
    run = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    if run.returncode != 0:
        sys.exit(f"agent_overhead: {state} run failed:\n{run.stderr[-2000:]}")
    result: dict[str, Any] = json.loads([line for line in run.stdout.splitlines() if line.startswith("{")][-1])
    if args.mode == "capture" and state == "on":
        result.update(capture_facts(out))
    return result


def capture_facts(path: Path) -> dict[str, Any]:
    """Kernels the capture holds, what it lost (as drop_* keys) and what its sources said went wrong."""
    from gputrace.capture import CaptureReader
    from gputrace.records import GpuKernel, SourceStatus

    reader = CaptureReader(path)
    records = list(reader.records())
    bad = [f"{r.source} {r.status}: {r.detail}" for r in records
           if type(r) is SourceStatus and r.status not in ("started", "missing")]  # fmt: skip
    return {"kernels": sum(type(r) is GpuKernel for r in records), "statuses": bad,
            **{f"drop_{k}": v for k, v in reader.drops.items() if v}}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", choices=("backend", "capture"), default="backend")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--size", type=int, default=1024, help="matrix size (default 1024)")
    p.add_argument("--ops", type=int, default=10, help="matmul+relu+scale per step: 3 kernels each (default 10)")
    p.add_argument("--repeat", type=int, default=3, help="runs of each state, alternating (default 3)")
    p.add_argument("--child", choices=("off", "on"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        child(args)
        return 0
    why = real_gpu_missing()
    if why:
        print(f"agent_overhead: needs an NVIDIA GPU with CUDA, torch and cupti-python: {why}", file=sys.stderr)
        return 2
    if args.mode == "capture" and os.geteuid() != 0:
        print("agent_overhead: --mode capture needs root (the capture's eBPF sources)", file=sys.stderr)
        return 2
    off, on = [], []
    for _ in range(args.repeat):
        off.append(run_child(args, "off"))
        on.append(run_child(args, "on"))
    report(args, off, on)
    return 0


def report(args: argparse.Namespace, off: list[dict[str, Any]], on: list[dict[str, Any]]) -> None:
    t_off = statistics.median(statistics.median(r["step_s"]) for r in off)
    t_on = statistics.median(statistics.median(r["step_s"]) for r in on)
    traced = statistics.median(r["kernels"] for r in on) / (args.warmup + args.steps)
    launched = KERNELS_PER_OP * args.ops
    print(f"mode {args.mode}: {args.steps} steps × {args.ops} ops, {args.size}², median of {args.repeat} runs each")
    print(f"  step time   without agent {t_off * 1e3:9.3f} ms   with agent {t_on * 1e3:9.3f} ms   "
          f"overhead {100 * (t_on - t_off) / t_off:+.1f} %")  # fmt: skip
    print(f"  kernels     {launched} per step launched, {launched / t_off:,.0f} kernels/s without agent; "
          f"{traced:.1f} per step traced")  # fmt: skip
    print(f"  agent cost  {(t_on - t_off) * 1e6 / launched:+.2f} µs per kernel")
    drops = {k: v for r in on for k, v in r.items() if k.startswith("drop_") and v}
    print(f"  drops       {drops or 'none'}")
    for line in sorted({line for r in on for line in r.get("statuses", [])}):
        print(f"  status      {line}")


if __name__ == "__main__":
    sys.exit(main())
