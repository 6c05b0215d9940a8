"""Two reports side by side: did a change (more loader workers, a local copy of the data) shrink the stalls?

Runs differ in length, so times are compared as shares of each run's GPU window (percentage points). Files,
peers and collectives keep their names from run to run and are matched by name; processes get new pids in
every run, so each run's processes are listed on their own among the culprits, and matched by name (and
whether their GPU stalled) in ``processes``: the DataLoader workers of one run against the other's.
"""

from __future__ import annotations

from typing import Any

from gputrace.analysis.notes import lost_records
from gputrace.analysis.report import CAUSES, culprit_label
from gputrace.documents import COMPARE_SCHEMA as SCHEMA
from gputrace.documents import CauseChange, Comparison, CulpritChange, ProcessChange, Report, Side

TOP_CULPRITS = 8


def _side(report: Report) -> Side:
    summ, cap = report["summary"], report["capture"]
    window = int(summ.get("window_ns", 0))
    return {
        "window_ns": window,
        "busy_ns": int(summ.get("busy_ns", 0)),
        "busy_pct": _pct(int(summ.get("busy_ns", 0)), window),
        "stall_ns": int(summ.get("stall_ns", 0)),
        "stall_pct": _pct(int(summ.get("stall_ns", 0)), window),
        "stalls": int(summ.get("stalls", len(report.get("stalls", [])))),
        "input_bound_pct": (summ.get("input_bound") or {}).get("pct"),
        "devices": [{"id": d["id"], "name": d["name"], "simulated": d["simulated"]} for d in report["devices"]],
        "complete": bool(cap.get("complete", True)),
        "lost": lost_records(cap.get("drops") or {}),
        "min_gap_ns": report.get("min_gap_ns"),
    }


def _pct(part: int, whole: int) -> float:
    return round(100.0 * part / whole, 2) if whole else 0.0


def _change(before: int, wb: int, after: int, wa: int) -> float | None:
    """Percentage points from before's share of its window to after's, from the unrounded shares; None when
    a run has no GPU window (no GPU activity): there is nothing to compare with."""
    if not (wb and wa):
        return None
    return round(100.0 * (after / wa - before / wb), 2)


def _by_cause(before: Report, after: Report) -> list[CauseChange]:
    wb, wa = before["summary"]["window_ns"], after["summary"]["window_ns"]
    cb, ca = before["summary"].get("by_cause", {}), after["summary"].get("by_cause", {})
    order = {c: i for i, c in enumerate(CAUSES)}
    rows: list[CauseChange] = []
    for cause in sorted(set(cb) | set(ca), key=lambda c: (-max(_pct(cb.get(c, 0), wb), _pct(ca.get(c, 0), wa)),
                                                           order.get(c, len(order)))):
        b, a = int(cb.get(cause, 0)), int(ca.get(cause, 0))
        rows.append({"cause": cause, "before_ns": b, "after_ns": a, "before_pct": _pct(b, wb),
                     "after_pct": _pct(a, wa), "change_points": _change(b, wb, a, wa)})
    return rows


def _culprits(before: Report, after: Report) -> list[CulpritChange]:
    acc: dict[tuple[str, str], list[int]] = {}
    for i, report in enumerate((before, after)):
        for s in report["stalls"]:
            acc.setdefault(culprit_label(s), [0, 0])[i] += int(s["duration_ns"])
    wb, wa = before["summary"]["window_ns"], after["summary"]["window_ns"]
    return [{"kind": kind, "culprit": label, "before_ns": b, "after_ns": a, "before_pct": _pct(b, wb),
             "after_pct": _pct(a, wa)} for (kind, label), (b, a) in _largest(acc, wb, wa)]


def _largest(acc: dict[Any, list[int]], wb: int, wa: int) -> list[tuple[Any, list[int]]]:
    """The ``TOP_CULPRITS`` rows of ``acc`` (key -> [before ns, after ns, ...]) with the largest share of either
    run's window."""
    return sorted(acc.items(), key=lambda kv: -max(_pct(kv[1][0], wb), _pct(kv[1][1], wa)))[:TOP_CULPRITS]


def _processes(before: Report, after: Report) -> list[ProcessChange]:
    """Each run's ``top_processes`` summed by (comm, gpu_process): how many processes of that name had stall
    time in each run, and how much (as a share of the run's window)."""
    acc: dict[tuple[str, bool], list[int]] = {}
    for i, report in enumerate((before, after)):
        for p in report.get("top_processes", []):
            row = acc.setdefault((str(p["comm"]), bool(p["gpu_process"])), [0, 0, 0, 0])
            row[i] += int(p["stall_ns"])
            row[2 + i] += 1
    wb, wa = before["summary"]["window_ns"], after["summary"]["window_ns"]
    return [{"comm": comm, "gpu_process": gpu, "before_processes": nb, "after_processes": na,
             "before_ns": b, "after_ns": a, "before_pct": _pct(b, wb), "after_pct": _pct(a, wa),
             "change_points": _change(b, wb, a, wa)} for (comm, gpu), (b, a, nb, na) in _largest(acc, wb, wa)]


def _notes(b: Side, a: Side) -> list[str]:
    notes = []
    for name, side in (("before", b), ("after", a)):
        if not side["complete"]:
            notes.append(f"the {name} capture is incomplete: its stalls may be missing some")
        if side["lost"]:
            notes.append(f"the {name} capture lost {side['lost']}")
        if not side["devices"]:
            notes.append(f"the {name} capture has no GPU activity")
    sim = {name: {d["simulated"] for d in side["devices"]} for name, side in (("before", b), ("after", a))}
    if sim["before"] and sim["after"] and sim["before"] != sim["after"]:
        notes.append("one run is on a simulated device and the other on a real one")
    if b["min_gap_ns"] != a["min_gap_ns"]:
        notes.append("the reports count stalls from different minimum gaps")
    return notes


def _input_change(b: Side, a: Side) -> float | None:
    """Percentage points between the runs' shares of their windows spent waiting on input; None without both."""
    if not (b["window_ns"] and a["window_ns"]) or b["input_bound_pct"] is None or a["input_bound_pct"] is None:
        return None
    return round(a["input_bound_pct"] - b["input_bound_pct"], 2)


def compare(before: Report, after: Report) -> Comparison:
    """The ``gputrace.compare/1`` document of two ``gputrace.report/1`` reports."""
    b, a = _side(before), _side(after)
    wb, wa = b["window_ns"], a["window_ns"]
    return {"schema": SCHEMA, "before": b, "after": a,
            "busy_change_points": _change(b["busy_ns"], wb, a["busy_ns"], wa),
            "stall_change_points": _change(b["stall_ns"], wb, a["stall_ns"], wa),
            "input_change_points": _input_change(b, a),
            "by_cause": _by_cause(before, after), "culprits": _culprits(before, after),
            "processes": _processes(before, after), "notes": _notes(b, a)}
