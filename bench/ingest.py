"""Sustained ingest: kernel events per second into a capture file, with every syscall recorded.

    sudo .venv/bin/python bench/ingest.py [--rate 300000] [--seconds 60] [--burst-seconds 5]

Phase 1 traces a process making 4 KiB preads at ``--rate`` calls/s (threshold 0: each call is one
event) for ``--seconds`` and reports events/s written, drops, file size and this process's peak RSS.
Phase 2 lets ``--burst-procs`` processes run flat out for ``--burst-seconds`` and reports the same, with the exact drop
count where the machine cannot keep up.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gputrace.capture import CaptureReader, CaptureWriter, host_header
from gputrace.daemon.writer import QueueSink
from gputrace.probes.ebpf.source import EbpfSource

LOAD = """
import os, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY)
rate, seconds = float(sys.argv[2]), float(sys.argv[3])
print("ready", flush=True)
sys.stdin.readline()
n, t0 = 0, time.monotonic()
end = t0 + seconds
while (now := time.monotonic()) < end:
    due = int((now - t0) * rate) if rate > 0 else n + 1000
    while n < due:
        os.pread(fd, 4096, 0)
        n += 1
print(n, flush=True)
"""


def phase(data: Path, out: Path, rate: float, seconds: float, procs: int = 1) -> dict[str, float]:
    loads = [subprocess.Popen([sys.executable, "-c", LOAD, str(data), str(rate), str(seconds)],
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
             for _ in range(procs)]  # fmt: skip
    for p in loads:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    path = out / f"ingest-{loads[0].pid}.gputrace"
    writer = CaptureWriter(path, host_header(["bench/ingest.py"]))
    sink = QueueSink(writer)
    src = EbpfSource([p.pid for p in loads], threshold_ns=0)
    src.start(sink)
    rss_started = _rss_mib()
    t0 = time.monotonic()
    for p in loads:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    calls = sum(int(p.stdout.readline()) for p in loads if p.stdout is not None)
    for p in loads:
        p.wait()
    src.stop()
    sink.close()
    elapsed = time.monotonic() - t0
    drops = {**src.drops(), **sink.drops()}
    writer.close({"drops": drops, "complete": True})
    size = path.stat().st_size
    peak_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # before reading back
    decoded, decode_s = read_back(path)
    path.unlink()
    return {"calls": calls, "events": src.events, "seconds": elapsed, "events_per_s": src.events / seconds,
            "drops": sum(drops.values()), "file_mib": size / 2**20, "rss_started_mib": rss_started,
            "decoded_per_s": decoded / decode_s,
            "peak_rss_mib": peak_rss}  # fmt: skip


def read_back(path: Path) -> tuple[int, float]:
    """Records decoded from the capture, and the seconds it took."""
    t0 = time.monotonic()
    with CaptureReader(path) as reader:
        n = sum(1 for _ in reader.records())
    return n, time.monotonic() - t0


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return 0.0


def show(title: str, r: dict[str, float]) -> None:
    print(f"{title}: {r['calls']:.0f} preads, {r['events']:.0f} events recorded "
          f"({r['events_per_s']:,.0f}/s), drops {r['drops']:.0f}, file {r['file_mib']:.1f} MiB, "
          f"RSS after compiling {r['rss_started_mib']:.0f} MiB, peak {r['peak_rss_mib']:.0f} MiB; "
          f"read back at {r['decoded_per_s']:,.0f} records/s")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rate", type=float, default=300_000, help="preads per second in phase 1")
    ap.add_argument("--seconds", type=float, default=60)
    ap.add_argument("--burst-seconds", type=float, default=5)
    ap.add_argument("--burst-procs", type=int, default=2, help="processes running flat out in phase 2")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(dir=os.environ.get("GPUTRACE_BENCH_DIR", "/var/tmp")) as tmp:
        out = Path(tmp)
        data = out / "page.bin"
        data.write_bytes(os.urandom(4096))
        show(f"paced {args.rate:,.0f}/s for {args.seconds:g} s", phase(data, out, args.rate, args.seconds))
        if args.burst_seconds > 0:
            r = phase(data, out, 0, args.burst_seconds, args.burst_procs)
            show(f"{args.burst_procs} processes flat out for {args.burst_seconds:g} s", r)


if __name__ == "__main__":
    main()
