"""How analysis time and memory grow with capture size: from 100k to 10M records, side by side.

    .venv/bin/python bench/analysis_scale.py [--sizes 100000,1000000,10000000] [--waits pipe,relay] [--stall-every 2]
        [--mounts 400] [--baseline-src DIR] [--repeat 3]

The captures (gputrace/testing/scale.py, written as generated) mimic a DataLoader training loop: a trainer
launching kernels and copies, four workers reading shards (block requests, off-CPU waits, wakeups), noise
syscalls, and a GPU stall every other step whose wait chain leads to a worker's read. Each size is generated
twice: the trainer waiting on the workers' queue itself (a pipe), and waiting on a pin-memory thread's queue
(a futex the thread wakes after its own read of the pipe: a relay). Each analysis runs in a fresh process so
its peak RSS is its own; ``records/s`` is the records read per second of analysis (wall clock; ``pass 1 s``:
the first pass over the records, in one process whatever ``--jobs``; ``cpu s``: the process's own CPU time and
that of the processes it forked to explain windows, which other work on the machine disturbs less);
``storage %`` is the share of stall time named `storage` (the chain followed to the worker's read). A capture
of over 200k time-local records is analysed window by window (gputrace/analysis/windowed.py): ``held at once``
is the most records the analysis held together (one window with its margins; where a capture is analysed
whole, all of them). Peak RSS still grows with the stall count, as the report lists every stall (35k per 1M
records here, a few KiB each).

``--jobs 1,2``: each capture analysed with its windows explained in this process alone, then in two forked
processes (``gputrace report --jobs``), side by side; ``job RSS`` is the largest forked process's peak RSS,
``vs jobs 1`` the ratio of times to the first count's, ``same`` whether every run made the same report.

``--baseline-src DIR``: also analyse each capture with the gputrace in DIR (a checkout of another version, e.g.
``git archive main | tar -x -C DIR``), run first on PYTHONPATH in its own process, old and new taking turns;
each line then gives the medians of ``--repeat`` runs of both, the ratio of their times, and whether both made
the same report. ``--spooled``: every record given to the analysis one by one (``WindowedAnalysis.add``), as the
kernel events a frame of them decodes to are (a frame of plain rows is otherwise noted where it is and read
again): the records are written to the analysis's own spool file and read back from it. ``--mounts N`` adds N rows
to the captures' mount tables, as a container host's (each pod's volumes, each container's root): the analysis
names each stalled read's filesystem and block device from it.
"""

from __future__ import annotations

import argparse
import hashlib
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

from gputrace.testing.scale import generate


def analyse_one(path: str, jobs: int, spooled: bool = False) -> None:
    """Child mode: analyse one capture with whichever gputrace is first on the path, as ``analyze()`` does but
    keeping the analysis to ask how much it held; print times (CPU: with the processes it forked, once they
    ended), peak RSS (its own, and its largest forked process's), the stall count and the report's hash."""
    from gputrace.analysis import windowed
    from gputrace.capture import open_capture

    t0, c0 = time.perf_counter(), time.process_time()
    with open_capture(path) as reader:
        if spooled:  # record by record, as decoded kernel events are
            an = windowed.WindowedAnalysis(dict(reader.header), jobs=jobs)
            with windowed.paused_gc():
                for r in reader.records():
                    an.add(r)
                first_pass = time.perf_counter() - t0
                report = an.report(reader)
        elif hasattr(windowed, "read_capture"):  # a frame at a time (analysis/windowed.py's analyze_capture)
            with windowed.paused_gc():
                an = windowed.read_capture(reader, **({"jobs": jobs} if jobs > 1 else {}))
                first_pass = time.perf_counter() - t0
                report = an.report(reader)
        else:  # a version that reads record by record (what its analyze() did)
            an = windowed.WindowedAnalysis(dict(reader.header))
            for r in reader.records():
                an.add(r)
            first_pass = time.perf_counter() - t0
            report = an.report(reader)
    secs = time.perf_counter() - t0
    children = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = time.process_time() - c0 + children.ru_utime + children.ru_stime
    rss_mib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    by = report["summary"]["by_cause"]
    held = an.peak_window_records if an.held is None else sum(report["capture"]["records"].values())
    digest = hashlib.sha256(json.dumps(report, sort_keys=True).encode()).hexdigest()[:16]
    print(json.dumps({"seconds": secs, "first_pass": first_pass, "cpu": cpu, "rss_mib": rss_mib,
                      "job_rss_mib": children.ru_maxrss / 1024, "stalls": len(report["stalls"]),
                      "by_cause": by, "held": held, "digest": digest}))


def run_one(path: Path, src: str | None, jobs: int = 1, spooled: bool = False) -> dict[str, Any]:
    """One analysis of ``path`` in a fresh process (with ``src`` first on PYTHONPATH), its windows explained in
    ``jobs`` processes."""
    env = dict(os.environ)
    if src is not None:
        env["PYTHONPATH"] = os.pathsep.join([src, *filter(None, [env.get("PYTHONPATH")])])
    out = subprocess.run([sys.executable, __file__, "--one", str(path), "--jobs", str(jobs),
                          *(["--spooled"] if spooled else [])], check=True,
                         capture_output=True, text=True, env=env).stdout
    result: dict[str, Any] = json.loads(out)
    return result


def medians(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The first run's figures, with the median seconds, CPU seconds and peak RSS of all."""
    return {**runs[0], **{k: statistics.median(r[k] for r in runs) for k in ("seconds", "first_pass", "cpu",
                                                                                "rss_mib", "job_rss_mib")}}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="100000,1000000,3000000,10000000", help="record counts, comma separated")
    ap.add_argument("--waits", default="pipe,relay", help="which trainer waits to generate: pipe, relay or both")
    ap.add_argument("--stall-every", type=int, default=2, help="steps per GPU stall (the report lists every stall)")
    ap.add_argument("--mounts", type=int, default=0,
                    help="mount-table rows to add, as a container host's (a Kubernetes node has hundreds)")
    ap.add_argument("--baseline-src", help="a checkout of another gputrace to run side by side (its root)")
    ap.add_argument("--repeat", type=int, default=1, help="analyses of each capture by each version (medians)")
    ap.add_argument("--jobs", default="1",
                    help="processes explaining a capture's windows, comma separated: each analysed that way too "
                         "(the baseline: by one), side by side")
    ap.add_argument("--spooled", action="store_true",
                    help="give the analysis every record one by one, as decoded kernel events are")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        analyse_one(args.one, int(args.jobs), args.spooled)
        return 0
    jobs = [int(j) for j in args.jobs.split(",")]
    base = str(Path(args.baseline_src).resolve()) if args.baseline_src else None
    if base is not None and not (Path(base) / "gputrace" / "analysis").is_dir():
        ap.error(f"{base} holds no gputrace checkout")
    sizes = [int(s) for s in args.sizes.split(",")]
    relays = [w == "relay" for w in args.waits.split(",")]
    head = (f"{'records':>10} {'trainer waits':>13} {'file MiB':>9} {'stalls':>7} {'jobs':>4} {'analyze s':>10} "
            f"{'pass 1 s':>8} {'cpu s':>7} {'records/s':>10} {'peak RSS MiB':>13} {'held at once':>13} "
            f"{'storage %':>10}")
    if len(jobs) > 1:
        head += f" {'job RSS':>8} {'vs jobs ' + str(jobs[0]):>10} {'same':>5}"
    if base is not None:
        head += f" {'base s':>8} {'base cpu s':>10} {'base rec/s':>10} {'base RSS':>9} {'speedup':>8} {'same':>5}"
    print(f"median of {args.repeat} run(s) each" + (f"; base: {base}" if base else "")
          + ("; every record given one by one (--spooled)" if args.spooled else ""))
    print(head)
    with tempfile.TemporaryDirectory(prefix="gputrace-scale-") as tmp:
        for n in sizes:
            for relay in relays:
                path = Path(tmp) / f"scale-{n}-{relay}.gputrace"
                written = generate(path, n, relay, args.stall_every, args.mounts)
                runs: dict[int, list[dict[str, Any]]] = {j: [] for j in jobs}
                old_runs = []
                for _ in range(args.repeat):  # taking turns: a busy spell of the machine falls on all
                    for j in jobs:
                        runs[j].append(run_one(path, None, j, args.spooled))
                    if base is not None:
                        old_runs.append(run_one(path, base, 1, args.spooled))
                mib = path.stat().st_size / 2**20
                path.unlink()
                first = medians(runs[jobs[0]])
                for j in jobs:
                    r = medians(runs[j])
                    storage = 100.0 * r["by_cause"].get("storage", 0) / max(sum(r["by_cause"].values()), 1)
                    line = (f"{written:>10,} {'futex relay' if relay else 'pipe':>13} {mib:>9.1f} "
                            f"{r['stalls']:>7,} {j:>4} {r['seconds']:>10.2f} {r['first_pass']:>8.2f} {r['cpu']:>7.2f} "
                            f"{written / r['seconds']:>10,.0f} {r['rss_mib']:>13.0f} {r['held']:>13,} {storage:>10.1f}")
                    if len(jobs) > 1:
                        same = all(x["digest"] == first["digest"] for k in jobs for x in runs[k])
                        line += (f" {r['job_rss_mib']:>8.0f} {first['seconds'] / r['seconds']:>9.2f}x "
                                 f"{'yes' if same else 'NO':>5}")
                    if old_runs:
                        o = medians(old_runs)
                        same = all(x["digest"] == r["digest"] for x in old_runs + runs[j])
                        line += (f" {o['seconds']:>8.2f} {o['cpu']:>10.2f} {written / o['seconds']:>10,.0f} "
                                 f"{o['rss_mib']:>9.0f} {o['seconds'] / r['seconds']:>7.1f}x "
                                 f"{'yes' if same else 'NO':>5}")
                    print(line, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
