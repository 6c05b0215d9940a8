"""Perfetto export throughput and memory: a synthetic capture of N records → .pftrace.

    .venv/bin/python bench/perfetto_export.py [N] [--no-samples]      (default 500000)
    .venv/bin/python bench/perfetto_export.py 500000 --runs 3 --baseline-src /tmp/gputrace-main   # old beside new
    .venv/bin/python bench/perfetto_export.py 500000 --scale          # gputrace/testing/scale.py's capture instead
    .venv/bin/python bench/perfetto_export.py 1000000 --jobs 2 --runs 3 --baseline-src DIR   # two processes

Prints records/s, packets/s and peak RSS growth, so a streaming regression (memory growing with N) shows.
Each step holds a syscall, an off-CPU interval, a block request, a launch, its kernel and a CPU sample (one
of 64 stacks of 16 frames); ``--no-samples`` leaves the samples out. ``--scale`` exports the windowed analysis's
DataLoader-like capture instead (about 20 records a step: launches, kernels, copies, syscalls, off-CPU waits with
their wakers, block requests, aggregates), with the stall report drawn on it when ``--report`` is given too.

Each export runs in a fresh process. ``--baseline-src DIR`` (another checkout's tree, e.g.
``git archive main | tar -x -C DIR``) exports the same capture with DIR first on PYTHONPATH, alternating with this
tree's export ``--runs`` times, so old and new code meet the same load; it prints each run, the medians and
their ratio. The capture is written by this tree (the format is the same). ``--jobs 2`` has this tree's exporter
draw the trace in two processes (PerfettoExporter's ``jobs``; the baseline draws it in one): the CPU time shown is
both processes'. Beside it, the same tree with ``--jobs 1`` as the baseline shows what the second process gives.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
US = 1000
STACKS = 64


def _stacks() -> list[Any]:
    """Distinct stacks sharing their outer frames, as a program's stacks do."""
    from gputrace.records import StackFrames

    common = [f"layer_{d} (libtorch.so)" for d in range(12)] + ["main (python3.11)"]
    return [StackFrames(100, k, [f"kernel_{k} (libjpeg.so)", f"inner_{k % 8} (libc.so.6)", f"mid_{k % 4} (x.so)",
                                 *common]) for k in range(STACKS)]


def _batch(i0: int, n: int, samples: bool) -> list[tuple[Any, ...]]:
    """A mix like a real capture: per step a syscall, an off-CPU interval, a block request, a launch, its kernel
    and (``samples``) a CPU sample."""
    from gputrace.records import BlockIO, CudaApi, GpuKernel, OffCpu, StackSample, Syscall

    out: list[tuple[Any, ...]] = []
    step = 6 if samples else 5
    for i in range(i0, i0 + n, step):
        t = i * 100 * US
        tid = 101 + i % 4
        out += [
            Syscall(100, tid, "pread64", t, t + 50 * US, 4096, 3, "/data/shard.bin", 4096, 4096),
            OffCpu(100, tid, t + 5 * US, t + 45 * US, "S", t + 40 * US, 300, 301, "fuse-srv"),
            BlockIO(100, tid, "loader", "loop0", i, 4096, "R", t + 10 * US, t + 30 * US),
            CudaApi(100, 100, "cudaLaunchKernel", t, t + 5 * US, i + 1, "runtime", 0),
            GpuKernel(100, 0, 1, 7, t + 10 * US, t + 90 * US, i + 1, "gemm", (1, 1, 1), (128, 1, 1)),
        ]
        if samples:
            out.append(StackSample(t + 20 * US, 100, tid, i // step % STACKS))
    return out


def write_capture(cap: Path, n: int, samples: bool) -> int:
    """The synthetic capture of ``n`` records; the number written."""
    from gputrace.capture import CaptureWriter, host_header
    from gputrace.records import ProcInfo, ThreadInfo

    written = 0
    w = CaptureWriter(cap, host_header(["bench"]))
    w.write([ProcInfo(0, 100, 1, "trainer", ["python"], "/usr/bin/python3")]
            + [ThreadInfo(0, 100, 101 + k, f"loader{k}") for k in range(4)] + (_stacks() if samples else []))
    chunk = 12_000 if samples else 10_000  # whole steps per frame
    for i0 in range(0, n, chunk):
        batch = _batch(i0, min(chunk, n - i0), samples)
        w.write(batch)
        written += len(batch)
    w.close({"complete": True})
    return written


def _children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def export_once(cap: Path, out: Path, report_path: Path | None, jobs: int = 1) -> dict[str, Any]:
    """Export ``cap`` with whichever gputrace is first on sys.path (``jobs`` above 1: given to the exporter); what
    it took (CPU: this process's and that of the process it forked, once waited for)."""
    import gputrace
    from gputrace.capture import CaptureReader
    from gputrace.exporters.perfetto.export import PerfettoExporter

    report = json.loads(report_path.read_text()) if report_path is not None else None
    rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    c0, k0, t0 = time.process_time(), _children_cpu(), time.perf_counter()
    with CaptureReader(cap) as reader:
        exporter = PerfettoExporter(out, report=report, **({"jobs": jobs} if jobs > 1 else {}))
        result = exporter.write(reader)
    dt, cpu = time.perf_counter() - t0, time.process_time() - c0 + _children_cpu() - k0
    rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"src": str(Path(gputrace.__file__).parent.parent), "s": dt, "cpu_s": cpu, "packets": result.items,
            "bytes": out.stat().st_size, "rss_mib": (rss1 - rss0) / 1024, "parts": getattr(exporter, "parts", 1)}


def run_export(cap: Path, out: Path, report: Path | None, src: Path | None, jobs: int = 1) -> dict[str, Any]:
    """``export_once`` in a fresh process, with ``src`` first on PYTHONPATH when given."""
    env = {**os.environ, "PYTHONPATH": str(src or ROOT)}
    cmd = [sys.executable, str(Path(__file__).resolve()), "--export-once", str(cap), str(out), "--jobs", str(jobs)]
    if report is not None:
        cmd += ["--report-file", str(report)]
    proc = subprocess.run(cmd, env=env, cwd=src or ROOT, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"perfetto_export: the export from {src or ROOT} failed:\n{proc.stderr[-2000:]}")
    out.unlink()
    row: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return row


def _line(label: str, records: int, row: dict[str, Any]) -> str:
    return (f"{label}: records {records:,}  packets {row['packets']:,}  {row['s']:.2f} s  "
            f"{records / row['s']:,.0f} records/s  {row['packets'] / row['s']:,.0f} packets/s  "
            f"(CPU {row['cpu_s']:.2f} s: {records / row['cpu_s']:,.0f} records/s)  trace {row['bytes'] / 1e6:.1f} MB  "
            f"peak RSS +{row['rss_mib']:.1f} MiB"
            + (f"  ({row['parts']} processes)" if row.get("parts", 1) > 1 else ""))


def _scale_capture(cap: Path, n: int, report: bool, tmp: Path) -> tuple[int, Path | None]:
    """gputrace/testing/scale.py's capture of about ``n`` records, and its stall report's file when asked."""
    from gputrace.testing import scale

    written = scale.generate(cap, n, relay=False)
    if not report:
        return written, None
    from gputrace.capture import CaptureReader
    from gputrace.pipeline import analyse

    with CaptureReader(cap) as reader:
        path = tmp / "report.json"
        path.write_text(json.dumps(analyse(reader)))
    return written, path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("n", nargs="?", type=int, default=500_000)
    ap.add_argument("--no-samples", action="store_true")
    ap.add_argument("--scale", action="store_true", help="export gputrace/testing/scale.py's capture")
    ap.add_argument("--report", action="store_true", help="with --scale: draw the capture's stall report too")
    ap.add_argument("--runs", type=int, default=1)
    ap.add_argument("--jobs", type=int, default=1,
                    help="given to this tree's exporter (2: a trace drawn by two processes; the baseline: one)")
    ap.add_argument("--baseline-src", type=Path)
    ap.add_argument("--export-once", nargs=2, type=Path, help=argparse.SUPPRESS)
    ap.add_argument("--report-file", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.export_once:
        once_cap, once_out = args.export_once
        print(json.dumps(export_once(once_cap, once_out, args.report_file, args.jobs)))
        return
    sys.path.insert(0, str(ROOT))
    with tempfile.TemporaryDirectory() as tmp_name:
        tmp = Path(tmp_name)
        cap, out = tmp / "bench.gputrace", tmp / "bench.pftrace"
        report = None
        if args.scale:
            written, report = _scale_capture(cap, args.n, args.report, tmp)
            kind = "scale.py capture" + (" with its report" if report else "")
        else:
            written = write_capture(cap, args.n, not args.no_samples)
            kind = "without CPU samples" if args.no_samples else "with CPU samples"
        new: list[dict[str, Any]] = []
        old: list[dict[str, Any]] = []
        for _ in range(args.runs):
            if args.baseline_src is not None:
                old.append(run_export(cap, out, report, args.baseline_src.resolve()))
                print(_line(f"{kind}, baseline", written, old[-1]), flush=True)
            new.append(run_export(cap, out, report, None, args.jobs))
            print(_line(f"{kind}, this tree", written, new[-1]), flush=True)
    _summary(kind, written, new, old)


def _summary(kind: str, records: int, new: list[dict[str, Any]], old: list[dict[str, Any]]) -> None:
    """Medians of the runs, and new against old where the baseline ran."""
    if len(new) < 2 and not old:
        return
    rate = statistics.median(records / r["s"] for r in new)
    cpu_rate = statistics.median(records / r["cpu_s"] for r in new)
    text = f"{kind}: median of {len(new)}: this tree {rate:,.0f} records/s (CPU {cpu_rate:,.0f}/s)"
    if old:
        old_rate = statistics.median(records / r["s"] for r in old)
        old_cpu = statistics.median(records / r["cpu_s"] for r in old)
        ratios = [o["s"] / n["s"] for o, n in zip(old, new, strict=True)]
        text += (f", baseline {old_rate:,.0f} records/s (CPU {old_cpu:,.0f}/s): {rate / old_rate:.2f}x "
                 f"(CPU {cpu_rate / old_cpu:.2f}x; median of the runs' own ratios {statistics.median(ratios):.2f}x)")
    print(text)


if __name__ == "__main__":
    main()
