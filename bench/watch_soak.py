#!/usr/bin/env python3
"""Watch mode's memory over a long run: whether the service's resident size stays flat as jobs come and go.

    sudo .venv/bin/python bench/watch_soak.py [--minutes 10] [--jobs 3] [--churn-s 60] [--flood 8]

The service watches simulated GPU jobs (10 ms kernels, 10 ms sleeps, as uid 64123, the only user it watches)
with its defaults (60 s flight window, 10 s segments). ``--jobs`` jobs run at all times; every ``--churn-s``
the oldest is killed and a new one started, and ``--flood`` short-lived GPU processes (2 s each) start at
once, so sessions start and end, flight directories are left behind and the scan meets processes it must
forget. Every ``--sample-s`` it reads the service's resident size (/proc/PID/status: VmRSS, of it RssAnon,
the heap) and, from `gputrace daemon status`, the jobs watched, the flight recorders' bytes and the drops,
and prints them; at the end, the anonymous memory's growth from the end of the first ``--settle-min`` minutes
to the end, its least-squares slope over that time in MB per minute, and its lowest and highest value in
each minute (what a session's start or a flood takes comes back; a leak raises the lowest).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from watch_cost import UID, Service, bench_env, job_workdir, rss_mb, start_jobs, stop_jobs


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of y over x."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    var = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / var if var else 0.0


def sample(svc: Service, t0: float) -> dict[str, Any]:
    status = svc.status()
    rss = rss_mb(svc.proc.pid)
    jobs = status.get("jobs", [])
    return {"min": (time.monotonic() - t0) / 60, "rss": rss["VmRSS"], "anon": rss["RssAnon"],
            "watching": sum(j["state"] == "watching" for j in jobs), "known": len(jobs),
            "flight_mb": sum(int(j.get("flight_bytes", 0)) for j in jobs) / 1e6,
            "refused": status.get("refused", 0), "vanished": status.get("vanished", 0)}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--minutes", type=float, default=10.0)
    p.add_argument("--jobs", type=int, default=3, help="jobs running at all times (default 3)")
    p.add_argument("--churn-s", type=float, default=60.0, help="a job replaced this often (default 60)")
    p.add_argument("--flood", type=int, default=8, help="short-lived GPU processes at each churn (default 8)")
    p.add_argument("--sample-s", type=float, default=10.0)
    p.add_argument("--settle-min", type=float, default=2.0, help="growth measured from here (default 2)")
    args = p.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("watch_soak: run as root (eBPF)")
    env = bench_env()
    with job_workdir("watch-soak-") as work:
        base = Path(tempfile.mkdtemp(prefix="svc-", dir=work))
        svc = Service(base, env, ["--watch-max-jobs", str(args.jobs + args.flood), "--watch-user", str(UID)], None)
        job_s = args.minutes * 60 + 120
        jobs = start_jobs(args.jobs, job_s, work / "job.py", env)
        flood: list[subprocess.Popen[str]] = []
        rows: list[dict[str, Any]] = []
        try:
            svc.wait_watched([j.pid for j in jobs], "watch_soak")
            t0 = time.monotonic()
            next_churn, next_sample, end = t0 + args.churn_s, t0, t0 + args.minutes * 60
            print(f"# {args.jobs} jobs, one replaced every {args.churn_s:g} s with {args.flood} short-lived GPU "
                  f"processes beside it, {args.minutes:g} min")
            print(f"{'min':>5} {'RSS MB':>7} {'anon MB':>8} {'watching':>8} {'known':>6} {'flight MB':>9} "
                  f"{'refused':>7} {'vanished':>8}")
            while (now := time.monotonic()) < end:
                if now >= next_churn:
                    next_churn += args.churn_s
                    stop_jobs(jobs[:1])
                    jobs = jobs[1:] + start_jobs(1, job_s, work / "job.py", env)
                    stop_jobs([f for f in flood if f.poll() is None])
                    flood = start_jobs(args.flood, 2, work / "job.py", env)
                if now >= next_sample:
                    next_sample += args.sample_s
                    r = sample(svc, t0)
                    rows.append(r)
                    print(f"{r['min']:5.1f} {r['rss']:7.0f} {r['anon']:8.1f} {r['watching']:8d} {r['known']:6d} "
                          f"{r['flight_mb']:9.1f} {r['refused']:7d} {r['vanished']:8d}", flush=True)
                time.sleep(min(1.0, max(0.0, min(next_churn, next_sample) - time.monotonic())))
        finally:
            stop_jobs(jobs + flood)
            log = svc.stop()
            shutil.rmtree(base, ignore_errors=True)
    settled = [r for r in rows if r["min"] >= args.settle_min]
    if len(settled) >= 2:
        a, b = settled[0], settled[-1]
        per_min = slope([(r["min"], r["anon"]) for r in settled])
        print(f"# anonymous memory from minute {a['min']:.1f} to {b['min']:.1f}: {a['anon']:.1f} -> {b['anon']:.1f} MB "
              f"({b['anon'] - a['anon']:+.1f} MB); slope {per_min:+.2f} MB/min; resident {a['rss']:.0f} -> "
              f"{b['rss']:.0f} MB")
        by_min: dict[int, list[float]] = {}
        for r in settled:
            by_min.setdefault(int(r["min"]), []).append(r["anon"])
        print("# anonymous MB, lowest and highest in each minute (a session's start and a flood come and go; a "
              "leak raises the lowest): " + ", ".join(f"{m}: {min(v):.0f}-{max(v):.0f}" for m, v in by_min.items()))
    if "Traceback" in log:
        print(log[-3000:], file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
