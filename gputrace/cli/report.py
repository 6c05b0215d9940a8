"""gputrace report: the stall budget of a capture — by cause, by culprit, stall by stall."""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
from pathlib import Path

from gputrace.cli import common
from gputrace.documents import Report
from gputrace.errors import UserError

ORDER = 20
HELP = "analyse a capture: GPU stalls by cause and culprit (terminal, --json or --html)"
EXAMPLES = """\
  gputrace report run.gputrace                      stall budget, top culprits, longest stalls
  gputrace report run.gputrace --json | jq .summary the gputrace.report/1 JSON on stdout
  gputrace report run.gputrace --html run.html      a self-contained page to share
  gputrace report run.gputrace --min-gap-ms 5       count only GPU gaps of 5 ms or more
  gputrace report long.gputrace --jobs 1            a long capture's windows explained in this process alone
  gputrace report hostA.gputrace hostB.gputrace     one job's captures from several hosts, on one clock:
                                                    each collective stall names the late rank and its cause

Reads only the capture file: re-run it with other options any time.
"""


def prepare_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("captures", metavar="CAPTURE", nargs="+",
                   help="a NAME.gputrace file; several: one job's captures from several hosts, joined")
    p.add_argument("--json", action="store_true", help="print the gputrace.report/1 JSON to stdout")
    p.add_argument("--html", metavar="OUT.html", help="also write the report as a self-contained HTML page")
    common.add_force(p)
    common.add_min_gap(p)
    jobs = default_jobs()
    p.add_argument("--jobs", type=int, metavar="N", default=jobs,
                   help="processes explaining the windows of a capture analysed window by window (over 200k "
                        "records), at a lower CPU priority (default: the CPUs this may run on and its cpu cgroup's "
                        f"quota allows, at most {MAX_JOBS}: {jobs} here; 1: this process alone)")


MAX_JOBS = 8  # processes explaining windows by default, however many CPUs


def default_jobs() -> int:
    """The CPUs this process may run on (its affinity), no more than its cpu cgroup's quota allows whole (a
    container limited to 1.5 CPUs: 1), at most MAX_JOBS; at least 1."""
    from gputrace.probes.cgroups import quota_cpus

    quota = quota_cpus()
    cpus = len(os.sched_getaffinity(0))
    return max(1, min(cpus, int(quota) if quota is not None else cpus, MAX_JOBS))


def run(args: argparse.Namespace) -> int:
    from gputrace.analysis import analyze
    from gputrace.capture import check_output_path, open_capture
    from gputrace.viewer.terminal import shown

    common.require_positive("--min-gap-ms", args.min_gap_ms)
    if args.jobs < 1:
        raise UserError(f"--jobs must be 1 or more, not {args.jobs}")
    if args.html == "":
        raise UserError("--html needs a file name (e.g. --html report.html)")
    html_out = Path(args.html) if args.html is not None else None
    paths = list(dict.fromkeys(args.captures))  # the same file twice is one capture, not two ranks
    if html_out is not None:
        for path in paths:
            check_output_path(html_out, force=args.force, source=path)
    min_gap_ns = max(1, int(args.min_gap_ms * 1e6))
    title = " ".join(Path(p).name for p in paths)
    if len(paths) > 1:
        report = analyze_paths(paths, min_gap_ns)
    else:
        with open_capture(paths[0]) as reader, common.progress(reader, "analysing"):
            report = analyze(reader, min_gap_ns=min_gap_ns, jobs=args.jobs)
            if reader.trailer and reader.trailer.get("stop_reason"):  # how the capture ended, for "complete" to say
                report["capture"].setdefault("stop_reason", reader.trailer["stop_reason"])
    if html_out is not None:
        from gputrace.viewer import html

        html.write(report, html_out, title=title, force=args.force)
    if args.json:
        # whole: json.dump hands stdout every token apart, a write() each where stdout is unbuffered
        common.write_stdout(json.dumps(report, indent=1) + "\n")
        if html_out is not None:  # stdout is the JSON alone
            print(f"Wrote {shown(str(html_out))}", file=sys.stderr)
        return 0
    from rich.console import Console

    from gputrace.viewer import terminal

    terminal.render(report, Console(), title)
    if html_out is not None:
        print(f"Wrote {shown(str(html_out))}")
    return 0


def analyze_paths(paths: list[str], min_gap_ns: int) -> Report:
    """The joined report of several captures (gputrace.analysis.join)."""
    from gputrace.analysis.join import analyze_many
    from gputrace.capture import open_capture

    with contextlib.ExitStack() as stack:
        readers = [stack.enter_context(open_capture(p)) for p in paths]
        return analyze_many(readers, paths, min_gap_ns=min_gap_ns)
