"""Stall attribution: GPU timeline → idle gaps → what each gap waited on.

    from gputrace.analysis import analyze, summary_lines
    with open_capture(path) as reader:
        report = analyze(reader)          # the gputrace.report/1 dict (docs/report.md)
    print("\\n".join(summary_lines(report)))
"""

from __future__ import annotations

from gputrace.analysis.notes import capture_notes, lost_records
from gputrace.analysis.report import CAUSES, SCHEMA, holders_text, pid_text
from gputrace.analysis.timefmt import fmt_ms
from gputrace.analysis.windowed import analyze_capture
from gputrace.capture import CaptureReader
from gputrace.documents import Holder, Report, Stall

__all__ = ["CAUSES", "SCHEMA", "analyze", "fmt_ms", "lost_records", "summary_lines"]


def analyze(reader: CaptureReader, *, min_gap_ns: int = 1_000_000, jobs: int = 1) -> Report:
    """Read the capture once and attribute every GPU stall of at least ``min_gap_ns``, in memory flat in the
    capture's length (analysis/windowed.py); a long capture's windows explained in ``jobs`` processes."""
    if min_gap_ns <= 0:
        raise ValueError("min_gap_ns must be > 0")
    if jobs <= 0:
        raise ValueError("jobs must be > 0")
    return analyze_capture(reader, min_gap_ns=min_gap_ns, jobs=jobs)


RUNQUEUE_NOTE_SHARE = 0.2  # of stall time in cpu.runqueue, from which the capture's summary says who had the CPU


def cpu_holders(stalls: list[Stall], limit: int = 3) -> list[Holder]:
    """The tasks named in the stalls' ``cpu_held_by``, summed by process (by thread where the process is not
    known), most time first."""
    acc: dict[tuple[int, int], Holder] = {}
    for s in stalls:
        for h in s["culprit"].get("cpu_held_by", []):
            key = (h["pid"], 0) if h["pid"] else (0, h["tid"])
            slot = acc.setdefault(key, {"pid": h["pid"], "tid": h["tid"], "comm": h["comm"], "ns": 0})
            slot["ns"] += h["ns"]
    top = sorted(acc.values(), key=lambda v: -v["ns"])[:limit]
    return [{"pid": h["pid"], "tid": h["pid"] or h["tid"], "comm": h["comm"], "ns": h["ns"]} for h in top]


def summary_lines(report: Report) -> list[str]:
    """The short form printed at the end of a capture."""
    cap, summ = report["capture"], report["summary"]
    lines = []
    if not cap["complete"]:
        lines.append("INCOMPLETE capture" + (f": {cap['problem']}" if cap.get("problem") else "")
                     + " — results cover what was recorded")
    lost = lost_records(cap["drops"])
    if lost:
        lines.append(f"LOST {lost}")
    lines += capture_notes(cap)
    if not report["devices"]:
        lines.append("no GPU activity in this capture")
        return lines
    for d in report["devices"]:
        pct = 100.0 * d["busy_ns"] / d["window_ns"] if d["window_ns"] else 0.0
        sim = " (simulated)" if d["simulated"] else ""
        owner = f" pid {d['pid']}" if "pid" in d else ""
        lines.append(f"GPU {d['id']}{owner}{sim}: busy {pct:.1f}% of {fmt_ms(d['window_ns'])}, "
                     f"{d['stalls']} stalls, {fmt_ms(d['stall_ns'])}")
    total = summ["stall_ns"]
    if total:
        budget = ", ".join(f"{c} {100.0 * ns / total:.0f}%" for c, ns in summ["by_cause"].items())
        lines.append(f"stall budget: {budget}")
        top = report.get("top_culprits", [])[:3]
        for c in top:
            lines.append(f"  {c['share_pct']:5.1f}%  {c['kind']}: {c['culprit']}")
        procs = report.get("top_processes", [])[:3]
        if procs and any(c["kind"] != "process" for c in top):  # files, peers: whose were they
            lines.append("  by process: " + ", ".join(f"{pid_text(p)} {p['share_pct']:.1f}%" for p in procs))
        held = cpu_holders(report["stalls"])
        if held and summ["by_cause"].get("cpu.runqueue", 0) >= RUNQUEUE_NOTE_SHARE * total:
            lines.append(f"waiting for a CPU ({fmt_ms(summ['by_cause']['cpu.runqueue'])}): the CPU was held by "
                         + holders_text(held))
        ib = summ["input_bound"]
        if cap.get("ebpf_missing"):
            lines.append("input-bound: unknown (no host-side data: the capture ran without eBPF)")
        else:
            lines.append(f"input-bound: {ib['pct']:.1f}% of GPU time waiting on input ({ib['verdict']}; "
                         "TF profiler thresholds 5%/20%, for comparison)")
    return lines
