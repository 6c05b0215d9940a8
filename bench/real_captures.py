"""Report and Perfetto export of the captures recorded on real GPU hosts (tests/data/captures), side by side.

    .venv/bin/python bench/real_captures.py [--baseline-src DIR] [--repeat 3] [--jobs 2] [NAME ...]

Real captures are not the synthetic ones of bench/analysis_scale.py and bench/perfetto_export.py: most of their
host side is raw kernel events (decoded as they are read, fds resolved against the tables the events before
built), and their CPU samples name deep Python stacks. Each capture is unpacked once; each analysis (what
``gputrace report`` does) and each export of the trace with that report drawn on it (what ``gputrace export
--perfetto`` does) runs in a fresh process, the seconds measured inside it. ``--baseline-src DIR`` (another
checkout's tree, e.g. ``git archive main | tar -x -C DIR``) runs the same with DIR first on PYTHONPATH, the two
taking turns; each line gives the medians of ``--repeat`` runs, the ratios, and whether both made the same report
and byte-identical traces. ``--jobs 2``: this tree's exports drawn by two processes (``gputrace export --jobs``;
the baseline's by one): ``same`` then compares the reports alone, the traces' bytes differing by design
(tests/test_perfetto_parts.py checks that they show the same).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


def once(path: str, out: str, jobs: int = 1) -> None:
    """Child mode: analyse ``path`` and export it to ``out`` with whichever gputrace is first on the path (``jobs``
    above 1: given to its exporter)."""
    from gputrace.capture import open_capture
    from gputrace.exporters.perfetto.export import PerfettoExporter
    from gputrace.pipeline import analyse

    t0 = time.perf_counter()
    with open_capture(path) as reader:
        report = analyse(reader)
    t1 = time.perf_counter()
    with open_capture(path) as reader:
        PerfettoExporter(out, report=report, **({"jobs": jobs} if jobs > 1 else {})).write(reader)
    t2 = time.perf_counter()
    trace = hashlib.sha256(Path(out).read_bytes()).hexdigest()[:16]
    os.unlink(out)
    print(json.dumps({"report_s": t1 - t0, "export_s": t2 - t1, "records": sum(report["capture"]["records"].values()),
                      "report": hashlib.sha256(json.dumps(report, sort_keys=True).encode()).hexdigest()[:16],
                      "trace": trace}))


def run(path: Path, out: Path, src: Path, jobs: int = 1) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": str(src)}
    proc = subprocess.run([sys.executable, __file__, "--once", str(path), str(out), "--jobs", str(jobs)], env=env,
                          cwd=src,
                          capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SystemExit(f"real_captures: {path.name} with {src} failed:\n{proc.stderr[-2000:]}")
    row: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return row


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("names", nargs="*", help="recorded captures (default: all of tests/data/captures)")
    ap.add_argument("--baseline-src", type=Path, help="another checkout's tree to run side by side")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each version (medians)")
    ap.add_argument("--jobs", type=int, default=1, help="given to this tree's exporter (the baseline's: 1)")
    ap.add_argument("--once", nargs=2, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.once:
        once(args.once[0], args.once[1], args.jobs)
        return 0
    sys.path.insert(0, str(ROOT / "tests"))
    from recorded import CAPTURES, unpacked

    names = args.names or CAPTURES
    unknown = sorted(set(names) - set(CAPTURES))
    if unknown:
        ap.error(f"no recorded capture {', '.join(unknown)} (there are: {', '.join(CAPTURES)})")
    base = args.baseline_src.resolve() if args.baseline_src else None
    if base is not None and not (base / "gputrace" / "analysis").is_dir():
        ap.error(f"{base} holds no gputrace checkout")
    head = f"{'capture':<20} {'records':>8} {'MB':>6} {'report s':>9} {'rec/s':>8} {'export s':>9} {'rec/s':>8}"
    if base is not None:
        head += f" {'base report':>11} {'base export':>11} {'report':>7} {'export':>7} {'same':>5}"
    print(f"medians of {args.repeat} run(s) each" + (f"; base: {base}" if base else ""))
    print(head)
    with tempfile.TemporaryDirectory(prefix="gputrace-recorded-") as tmp:
        for name in names:
            path = unpacked(name, Path(tmp))
            out = Path(tmp) / "trace.pftrace"
            new: list[dict[str, Any]] = []
            old: list[dict[str, Any]] = []
            for _ in range(args.repeat):  # taking turns: a busy spell of the machine falls on both
                if base is not None:
                    old.append(run(path, out, base))
                new.append(run(path, out, ROOT, args.jobs))
            rep, exp = (statistics.median(r[k] for r in new) for k in ("report_s", "export_s"))
            n = new[0]["records"]
            line = (f"{name:<20} {n:>8,} {path.stat().st_size / 1e6:>6.1f} {rep:>9.3f} {n / rep:>8,.0f} {exp:>9.3f} "
                    f"{n / exp:>8,.0f}")
            if old:
                orep, oexp = (statistics.median(r[k] for r in old) for k in ("report_s", "export_s"))
                same = len({(r["report"], r["trace"] if args.jobs == 1 else "") for r in old + new}) == 1
                line += (f" {orep:>11.3f} {oexp:>11.3f} {orep / rep:>6.2f}x {oexp / exp:>6.2f}x "
                         f"{'yes' if same else 'NO':>5}")
            print(line, flush=True)
            path.unlink()
    return 0


if __name__ == "__main__":
    sys.exit(main())
