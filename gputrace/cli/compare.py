"""gputrace compare: two captures side by side — did a change shrink the stalls, and which ones?"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from gputrace.cli import common
from gputrace.documents import Report

ORDER = 25
HELP = "compare two captures: GPU busy time and stall time by cause and culprit, before and after a change"
EXAMPLES = """\
  gputrace compare before.gputrace after.gputrace          busy %, stall budget, culprits side by side
  gputrace compare before.gputrace after.gputrace --json   the gputrace.compare/1 JSON on stdout

Runs differ in length, so times are compared as shares of each run's GPU window. Files, peers and
collectives are matched by name; processes get new pids in every run: they are listed per run among
the culprits, and summed by name (all DataLoader workers of each run) in their own table.
"""


def prepare_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("before", metavar="BEFORE", help="a NAME.gputrace file: the run before the change")
    p.add_argument("after", metavar="AFTER", help="a NAME.gputrace file: the run after it")
    p.add_argument("--json", action="store_true", help="print the gputrace.compare/1 JSON to stdout")
    common.add_min_gap(p)


def _report(path: str, min_gap_ns: int) -> Report:
    from gputrace.analysis import analyze
    from gputrace.capture import open_capture

    with open_capture(path) as reader, common.progress(reader, f"analysing {Path(path).name}"):
        return analyze(reader, min_gap_ns=min_gap_ns)


def run(args: argparse.Namespace) -> int:
    from gputrace.analysis.compare import compare

    common.require_positive("--min-gap-ms", args.min_gap_ms)
    min_gap_ns = max(1, int(args.min_gap_ms * 1e6))
    doc = compare(_report(args.before, min_gap_ns), _report(args.after, min_gap_ns))
    if args.json:
        common.write_stdout(json.dumps(doc, indent=1) + "\n")
        return 0
    from rich.console import Console

    from gputrace.viewer.terminal import render_compare

    render_compare(doc, Console(), Path(args.before).name, Path(args.after).name)
    return 0
