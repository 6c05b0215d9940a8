#!/usr/bin/env python3
"""Whether each flight segment, analysed alone, gives its stalls the causes the whole job's capture gives them.

    sudo .venv/bin/python bench/flight_segments.py [--jobs 3] [--seconds 20] [--segment-s 1]
    sudo .venv/bin/python bench/flight_segments.py --baseline-src /tmp/gputrace-main   # old code beside

Records land in a flight segment when the service's writer gets them, and the kernel's events (the ring,
drained every 250 ms) and an agent's GPU records (sent every ``flush_ms``) come at different paces: a segment's
first and last stalls are the ones whose evidence could lie in the segment beside them (docs/watch.md, "The
flight recorder"). This runs the watch service with short segments over simulated jobs (10 ms kernels, 10 ms
sleeps, as uid 64123, the only user it watches) until they end, then for each job joins its segments into one
capture as a dump does (daemon/watch/flight.py's ``dump_capture``) and analyses each segment alone and the
joined capture. Each segment's stall is matched with the joined capture's stall of the same device and start;
the table counts the matched stalls whose cause differs (by the pair of causes), the segment's `unknown` ones,
and the joined capture's stalls no segment has (a stall whose two ops lie in two segments is in neither).

``--baseline-src DIR`` runs the same with the service from DIR (another checkout's tree), in the same run.
"""

from __future__ import annotations

import argparse
import collections
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from watch_cost import UID, Service, bench_env, job_workdir, start_jobs

from gputrace.analysis import analyze
from gputrace.capture import CaptureReader, open_capture
from gputrace.daemon.watch.flight import dump_capture


def stalls(path: Path) -> dict[tuple[int, int], str]:
    """(device, start ns) -> cause, of each stall the capture at ``path`` reports."""
    with open_capture(path) as reader:
        report = analyze(reader)
    return {(int(s.get("device", 0)), int(s["start_ns"])): str(s["cause"]) for s in report["stalls"]}


def compare(job_dir: Path, work: Path) -> dict[str, Any]:
    """A job's segments against the capture joined from them."""
    segments = sorted(job_dir.glob("seg-*.gputrace"))
    with CaptureReader(segments[0]) as reader:
        header = dict(reader.header)
    joined = dump_capture(segments, work / f"{job_dir.name}.gputrace", header, {"kind": "request", "detail": ""})
    whole = stalls(joined)
    seen: set[tuple[int, int]] = set()
    differ: collections.Counter[str] = collections.Counter()
    unknown = extra = 0
    for seg in segments:
        for key, cause in stalls(seg).items():
            unknown += cause == "unknown"
            if key not in whole:
                extra += 1
                continue
            seen.add(key)
            if cause != whole[key]:
                differ[f"{cause} (joined: {whole[key]})"] += 1
    return {"segments": len(segments), "stalls": len(whole), "matched": len(seen), "differ": differ,
            "unknown": unknown, "extra": extra, "joined_causes": collections.Counter(whole.values())}


def run(label: str, args: argparse.Namespace, work: Path, env: dict[str, str]) -> list[dict[str, Any]]:
    base = Path(tempfile.mkdtemp(prefix="flight-", dir=work))
    svc_env = dict(env)
    if label == "baseline":
        svc_env["PYTHONPATH"] = str(args.baseline_src)
    svc = Service(base, svc_env, ["--watch-max-jobs", str(args.jobs), "--watch-user", str(UID), "--flight-seconds",
                                  "3600", "--flight-segment-s", str(args.segment_s)], None)
    try:
        jobs = start_jobs(args.jobs, args.seconds, work / "job.py", env)
        pids = [p.pid for p in jobs]
        svc.wait_watched(pids, f"flight_segments: {label}")
        for p in jobs:
            p.wait()
        deadline = time.monotonic() + 60
        while svc.jobs(pids) and time.monotonic() < deadline:  # each job's last segment closed
            time.sleep(0.2)
    finally:
        svc.stop()
    out = []
    for d in sorted((svc.state / ".flight").iterdir()):
        if d.is_dir() and any(d.glob("seg-*.gputrace")):
            out.append(compare(d, base))
    shutil.rmtree(base, ignore_errors=True)
    return out


def show(label: str, rows: list[dict[str, Any]]) -> None:
    total = collections.Counter[str]()
    for r in rows:
        total.update({k: r[k] for k in ("segments", "stalls", "matched", "unknown", "extra")})
        total.update({"differ": sum(r["differ"].values())})
    differ = sum((r["differ"] for r in rows), collections.Counter[str]())
    causes = sum((r["joined_causes"] for r in rows), collections.Counter[str]())
    print(f"{label:9s} {len(rows)} jobs, {total['segments']} segments: joined captures {total['stalls']} stalls "
          f"({', '.join(f'{c} {n}' for c, n in causes.most_common())}); in the segments {total['matched']} of them, "
          f"{total['differ']} with another cause, {total['unknown']} unknown, {total['extra']} not in the joined")
    for pair, n in differ.most_common():
        print(f"          {n:5d}  {pair}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--jobs", type=int, default=3)
    p.add_argument("--seconds", type=float, default=20.0, help="each job's run (default 20)")
    p.add_argument("--segment-s", type=float, default=1.0, help="flight segment length (default 1)")
    p.add_argument("--baseline-src", type=Path, help="also run the service from this source tree")
    args = p.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("flight_segments: run as root (eBPF)")
    env = bench_env()
    with job_workdir("flight-segments-") as work:
        for label in ["this tree", *(["baseline"] if args.baseline_src else [])]:
            rows = run(label, args, work, env)
            print(f"flight_segments: {label} done", file=sys.stderr, flush=True)
            show(label, rows)
    return 0


if __name__ == "__main__":
    sys.exit(main())
