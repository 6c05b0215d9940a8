"""`gputrace doctor`: what works on this host, and how to fix what doesn't."""

from __future__ import annotations

import argparse
import json

from gputrace import __version__
from gputrace.documents import DOCTOR_SCHEMA, Doctor
from gputrace.hostcheck import OK, Check, failed_required, run_checks

GPU_SOURCES = ("cupti-python", "NVML")  # what a capture without eBPF still records
EBPF_SIDE = ("bpf() syscall", "tracefs", "bcc (python3-bpfcc)", "kernel headers", "bcc program load")
HELP = "check what works on this host (eBPF, bcc, headers, tracepoints, CUPTI, NVML, permissions)"
ORDER = 60
EXAMPLES = """\
  sudo gputrace doctor              the checks as a table, with the fix for each problem
  sudo gputrace doctor --verbose    also list every tracepoint that is present
  gputrace doctor --json            machine-readable (schema gputrace.doctor/1)
  gputrace doctor --no-load         skip compiling and loading the test BPF program

Exit status: 0 when everything `gputrace capture` requires works, 1 when a required check FAILs.
WARN: a source is degraded; INFO: optional (GPU sources, kprobes).
"""


def prepare_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("-v", "--verbose", action="store_true", help="list every tracepoint, not just missing ones")
    p.add_argument("--no-load", action="store_true",
                   help="skip the real test program (compiling it takes a few seconds)")


def run(args: argparse.Namespace) -> int:
    checks = run_checks(load_program=not args.no_load)
    failed = failed_required(checks)
    if args.json:
        print(json.dumps(document(checks), indent=2))
    else:
        for line in table(checks, verbose=args.verbose):
            print(line)
        print()
        print(verdict(failed, checks))
    return 1 if failed else 0


def document(checks: list[Check]) -> Doctor:
    """The ``gputrace.doctor/1`` document of the checks (``--json``)."""
    return {"schema": DOCTOR_SCHEMA, "version": __version__, "ok": not failed_required(checks),
            "checks": [c.as_dict() for c in checks]}


def table(checks: list[Check], *, verbose: bool = False) -> list[str]:
    rows = _collapse_tracepoints(checks) if not verbose else checks
    width = max(len(c.name) for c in rows)
    lines = []
    for c in rows:
        lines.append(f"{c.status:<4}  {c.name:<{width}}  {c.detail}")
        if c.fix and c.status != OK:
            lines.append(f"{'':<4}  {'':<{width}}  fix: {c.fix}")
    return lines


def _collapse_tracepoints(checks: list[Check]) -> list[Check]:
    """All present tracepoints as one row; each missing one keeps its own row."""
    present = [c for c in checks if c.name.startswith("tracepoint ") and c.status == OK]
    out: list[Check] = []
    for c in checks:
        if c in present:
            if c is present[0]:
                total = sum(1 for x in checks if x.name.startswith("tracepoint "))
                out.append(Check("tracepoints", OK, f"{len(present)}/{total} present (--verbose lists them)"))
            continue
        out.append(c)
    return out


def verdict(failed: list[Check], checks: list[Check]) -> str:
    if not failed:
        return "gputrace capture can run on this host."
    fix = f"fix {', '.join(c.name for c in failed)} (see above)"
    gpu = [c.name for c in checks if c.name in GPU_SOURCES and c.status == OK]
    if gpu and all(c.name in EBPF_SIDE for c in failed):  # a capture without eBPF still records the GPU
        return (f"gputrace capture runs here without eBPF: GPU activity only ({', '.join(gpu)}), so no stall "
                f"gets a host-side cause. For causes, {fix}.")
    return f"gputrace capture cannot run here: {fix}."
