"""How analysis time and memory grow with capture size: from 100k to 10M records, side by side.

    .venv/bin/python bench/analysis_scale.py [--sizes 100000,1000000,10000000] [--waits pipe,relay] [--stall-every 2]

The captures (gputrace/testing/scale.py, written as generated) mimic a DataLoader training loop: a trainer
launching kernels and copies, four workers reading shards (block requests, off-CPU waits, wakeups), noise
syscalls, and a GPU stall every other step whose wait chain leads to a worker's read. Each size is generated
twice: the trainer waiting on the workers' queue itself (a pipe), and waiting on a pin-memory thread's queue
(a futex the thread wakes after its own read of the pipe: a relay). Each analysis runs in a fresh process so
its peak RSS is its own; ``records/s`` is the records read per second of analysis; the last column is
the share of stall time named `storage` (the chain followed to the worker's read). A capture of over 200k
time-local records is analysed window by window (gputrace/analysis/windowed.py): ``held at once`` is the
most records the analysis held together (one window with its margins; where a capture is analysed whole,
all of them). Peak RSS still grows with the stall count, as the report lists every stall (35k per 1M
records here, a few KiB each).
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from gputrace.testing.scale import generate


def analyse_one(path: str) -> None:
    """Child mode: analyse one capture, print time, peak RSS and the stall count as JSON."""
    from gputrace.analysis.windowed import WindowedAnalysis
    from gputrace.capture import open_capture

    t0 = time.perf_counter()
    with open_capture(path) as reader:  # what analyze() does, keeping the analysis to ask how much it held
        an = WindowedAnalysis(dict(reader.header))
        for r in reader.records():
            an.add(r)
        report = an.report(reader)
    secs = time.perf_counter() - t0
    rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    by = report["summary"]["by_cause"]
    held = an.peak_window_records if an.held is None else sum(report["capture"]["records"].values())
    print(json.dumps({"seconds": secs, "rss_mib": rss_mib, "stalls": len(report["stalls"]), "by_cause": by,
                      "held": held}))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="100000,1000000,3000000,10000000", help="record counts, comma separated")
    ap.add_argument("--waits", default="pipe,relay", help="which trainer waits to generate: pipe, relay or both")
    ap.add_argument("--stall-every", type=int, default=2, help="steps per GPU stall (the report lists every stall)")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        analyse_one(args.one)
        return 0
    sizes = [int(s) for s in args.sizes.split(",")]
    relays = [w == "relay" for w in args.waits.split(",")]
    print(f"{'records':>10} {'trainer waits':>13} {'file MiB':>9} {'stalls':>7} {'analyze s':>10} {'records/s':>10} "
          f"{'peak RSS MiB':>13} {'held at once':>13} {'storage %':>10}")
    with tempfile.TemporaryDirectory(prefix="gputrace-scale-") as tmp:
        for n in sizes:
            for relay in relays:
                path = Path(tmp) / f"scale-{n}-{relay}.gputrace"
                written = generate(path, n, relay, args.stall_every)
                out = subprocess.run([sys.executable, __file__, "--one", str(path)], check=True,
                                     capture_output=True, text=True).stdout
                mib = path.stat().st_size / 2**20
                path.unlink()
                r = json.loads(out)
                storage = 100.0 * r["by_cause"].get("storage", 0) / max(sum(r["by_cause"].values()), 1)
                print(f"{written:>10,} {'futex relay' if relay else 'pipe':>13} {mib:>9.1f} "
                      f"{r['stalls']:>7,} {r['seconds']:>10.2f} {written / r['seconds']:>10,.0f} "
                      f"{r['rss_mib']:>13.0f} {r['held']:>13,} {storage:>10.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
