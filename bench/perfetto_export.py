"""Perfetto export throughput and memory: a synthetic capture of N records → .pftrace.

    .venv/bin/python bench/perfetto_export.py [N] [--no-samples]      (default 500000)

Prints records/s, packets/s and peak RSS growth, so a streaming regression (memory growing with N) shows.
Each step holds a syscall, an off-CPU interval, a block request, a launch, its kernel and a CPU sample (one
of 64 stacks of 16 frames); ``--no-samples`` leaves the samples out.
"""

from __future__ import annotations

import resource
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gputrace.capture import CaptureReader, CaptureWriter, host_header
from gputrace.exporters.perfetto.export import PerfettoExporter
from gputrace.records import (
    BlockIO,
    CudaApi,
    GpuKernel,
    OffCpu,
    ProcInfo,
    StackFrames,
    StackSample,
    Syscall,
    ThreadInfo,
)

US = 1000
STACKS = 64


def _stacks() -> list[StackFrames]:
    """Distinct stacks sharing their outer frames, as a program's stacks do."""
    common = [f"layer_{d} (libtorch.so)" for d in range(12)] + ["main (python3.11)"]
    return [StackFrames(100, k, [f"kernel_{k} (libjpeg.so)", f"inner_{k % 8} (libc.so.6)", f"mid_{k % 4} (x.so)",
                                 *common]) for k in range(STACKS)]


def _batch(i0: int, n: int, samples: bool) -> list[tuple[Any, ...]]:
    """A mix like a real capture: per step a syscall, an off-CPU interval, a block request, a launch, its kernel
    and (``samples``) a CPU sample."""
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


def main() -> None:
    args = [a for a in sys.argv[1:] if a != "--no-samples"]
    samples = "--no-samples" not in sys.argv[1:]
    n = int(args[0]) if args else 500_000
    written = 0
    with tempfile.TemporaryDirectory() as tmp:
        cap = Path(tmp) / "bench.gputrace"
        w = CaptureWriter(cap, host_header(["bench"]))
        w.write([ProcInfo(0, 100, 1, "trainer", ["python"], "/usr/bin/python3")]
                + [ThreadInfo(0, 100, 101 + k, f"loader{k}") for k in range(4)] + (_stacks() if samples else []))
        chunk = 12_000 if samples else 10_000  # whole steps per frame
        for i0 in range(0, n, chunk):
            batch = _batch(i0, min(chunk, n - i0), samples)
            w.write(batch)
            written += len(batch)
        w.close({"complete": True})
        rss0 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        t0 = time.perf_counter()
        with CaptureReader(cap) as reader:
            result = PerfettoExporter(Path(tmp) / "bench.pftrace").write(reader)
        dt = time.perf_counter() - t0
        rss1 = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        size = (Path(tmp) / "bench.pftrace").stat().st_size
    kind = "with" if samples else "without"
    print(f"{kind} CPU samples: records {written:,}  packets {result.items:,}  {dt:.2f} s  "
          f"{written / dt:,.0f} records/s  "
          f"{result.items / dt:,.0f} packets/s  trace {size / 1e6:.1f} MB  peak RSS +{(rss1 - rss0) / 1024:.1f} MiB")


if __name__ == "__main__":
    main()
