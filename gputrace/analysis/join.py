"""One job's captures from several hosts, explained together: each collective stall names the late rank, on
whatever host it ran, and why it was late (its own records, by the same rules as any stall).

Clocks. Each capture is on its host's CLOCK_MONOTONIC; its header holds that host's realtime-monotonic
offset, which puts it on the realtime clock, and so on the first capture's clock. Realtime clocks of two hosts
differ by their NTP error, unknown to either. Collectives measure it: every rank of an all-reduce completes
when the last rank's data is in, within the transfer's own jitter, so for each instance two captures share,
the difference of its completion times is the two clocks' residual disagreement. Its median over the shared
instances corrects the header's alignment; its spread is the alignment's uncertainty. A correction larger
than the smallest stall the report counts is said, and a spread that large leaves the captures unjoined: a
wrong culprit is worse than none.

Captures that share no communicator are different jobs: said, and analysed side by side without a join.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from statistics import median
from typing import Any

from gputrace.analysis.attribute import Attributor
from gputrace.analysis.load import Capture, load
from gputrace.analysis.report import (
    SCHEMA,
    assemble,
    communicators,
    host_of,
    input_bound,
    top_culprits,
)
from gputrace.analysis.timefmt import fmt_ms
from gputrace.analysis.timeline import InstanceKey, Remote, RemoteCall, host_instances, host_waits, instances
from gputrace.capture import CaptureReader
from gputrace.documents import CaptureInfo, Device, Evidence, InProgressThread, JoinedCapture, Report, TopProcess
from gputrace.errors import UserError
from gputrace.records import CollectiveCall

UNCERTAINTY_QUANTILE = 0.8  # of the shared instances' deviations from the median correction
MIN_ANCHORS = 3  # shared collective instances needed before their completions correct the headers' alignment
MAX_CAPTURES = 4096
MAX_TOP = 10


@dataclass
class Alignment:
    """How one capture's clock is put on the first's: ``shift_ns`` is added to each of its times."""

    header_shift_ns: int = 0
    correction_ns: int = 0
    uncertainty_ns: int | None = None  # None: no shared collectives measured it (the hosts' NTP error)
    anchors: int = 0
    joined: bool = True
    notes: list[str] = field(default_factory=list)

    @property
    def shift_ns(self) -> int:
        return self.header_shift_ns + self.correction_ns


@dataclass
class Joined:
    """A joined report and the per-capture reports it was merged from (the same stall dicts, on the first
    capture's clock): an exporter draws each capture's stalls with that capture's records."""

    report: Report
    parts: list[Report]


def analyze_many(readers: Sequence[CaptureReader], names: Sequence[str], *,
                 min_gap_ns: int = 1_000_000) -> Report:
    """The joined report of several captures (``names`` label them: their paths)."""
    return join(readers, names, min_gap_ns=min_gap_ns).report


def join(readers: Sequence[CaptureReader], names: Sequence[str], *, min_gap_ns: int = 1_000_000) -> Joined:
    """analyze_many's report with its parts."""
    if min_gap_ns <= 0:
        raise ValueError("min_gap_ns must be > 0")
    if len(readers) > MAX_CAPTURES:
        raise UserError(f"{len(readers)} captures given; at most {MAX_CAPTURES} are joined")
    caps = [load(r) for r in readers]
    hosts = [host_of(c) for c in caps]
    notes: list[str] = []
    jobs = _jobs(caps, names, notes)
    job_of = {i: k for k, job in enumerate(jobs) for i in job}
    keys = [{k: m for k, m in instances(c).items() if k[0] and k[2] >= 0} for c in caps]
    calls = [host_instances(c) for c in caps]
    align = _align(caps, names, jobs, [_ends(k, c) for k, c in zip(keys, calls, strict=True)], min_gap_ns, notes)
    atts = [Attributor(c, h) for c, h in zip(caps, hosts, strict=True)]
    for a in atts:
        a.peers = atts
    remotes: list[dict[InstanceKey, list[Remote]]] = []
    remote_calls: list[dict[InstanceKey, list[RemoteCall]]] = []
    for i, cap in enumerate(caps):
        remote: dict[InstanceKey, list[Remote]] = {}
        others: dict[InstanceKey, list[RemoteCall]] = {}
        if align[i].joined:
            for j in jobs[job_of[i]]:
                if j == i or not align[j].joined:
                    continue
                shift = align[j].shift_ns - align[i].shift_ns  # capture j's clock -> capture i's
                for key, members in keys[j].items():
                    if key in keys[i]:
                        remote.setdefault(key, []).extend(Remote(op, rank, n, j, shift) for op, rank, n in members)
                for key, theirs in calls[j].items():
                    if key in calls[i]:
                        others.setdefault(key, []).extend(RemoteCall(c, j, shift) for c in theirs)
        remotes.append(remote)
        remote_calls.append(others)
        # every capture's calls known before any stall is explained: a late rank's time may be another's
        atts[i].host_waits(host_waits(cap, min_gap_ns, others))
    reports = [assemble(cap, min_gap_ns, attributor=atts[i], remote=remotes[i], remote_calls=remote_calls[i])
               for i, cap in enumerate(caps)]
    return Joined(_merge(reports, caps, names, hosts, align, jobs, notes, min_gap_ns), reports)


def _jobs(caps: list[Capture], names: Sequence[str], notes: list[str]) -> list[list[int]]:
    """Captures grouped by shared communicators (transitively); each group is one job."""
    comms = [communicators(c) for c in caps]
    parent = list(range(len(caps)))

    def root(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    owner: dict[str, int] = {}
    for i, cs in enumerate(comms):
        for c in cs:
            if c in owner:
                parent[root(i)] = root(owner[c])
            else:
                owner[c] = i
    groups: dict[int, list[int]] = {}
    for i in range(len(caps)):
        groups.setdefault(root(i), []).append(i)
    jobs = sorted(groups.values())
    if len(jobs) > 1:
        parts = ["; ".join(names[i] for i in job) for job in jobs]
        notes.append(f"the captures share no communicator across {len(jobs)} groups ({' | '.join(parts)}): "
                     "they are not one job, and each group is analysed without the others")
    return jobs


def _completions(keys: dict[InstanceKey, list[Any]]) -> dict[InstanceKey, int]:
    """Each instance's completion in one capture: the latest end of its ranks' kernels there."""
    return {k: max(op.end_ns for op, _, _ in members) for k, members in keys.items()}


def _ends(keys: dict[InstanceKey, list[Any]], calls: dict[InstanceKey, list[CollectiveCall]]) -> dict[InstanceKey, int]:
    """Each instance's completion in one capture: its kernels' (``_completions``), or where the host waited
    for it (gloo: every rank's call returns once the last rank's data is in), the latest return of those
    calls."""
    out = {k: max(c.end_ns for c in cs if c.waited) for k, cs in calls.items() if any(c.waited for c in cs)}
    return {**out, **_completions(keys)}


def _align(caps: list[Capture], names: Sequence[str], jobs: list[list[int]],
           ends: list[dict[InstanceKey, int]], min_gap_ns: int, notes: list[str]) -> list[Alignment]:
    offsets = [c.header.get("mono_to_realtime_ns") for c in caps]
    ok = [type(o) is int for o in offsets]
    out = [Alignment() for _ in caps]
    ref = next((o for o, good in zip(offsets, ok, strict=True) if good), 0)
    for i, good in enumerate(ok):
        if good:
            out[i].header_shift_ns = int(offsets[i] or 0) - int(ref or 0)
        else:
            out[i].notes.append("its header has no realtime offset: its clock is taken to be the first capture's")
    for job in jobs:
        anchor = job[0]
        for i in job[1:]:
            shared = [k for k in ends[i] if k in ends[anchor]]
            a = out[i]
            a.anchors = len(shared)
            if len(shared) < MIN_ANCHORS:
                a.notes.append(f"{len(shared)} collective instances shared with {names[anchor]}: the alignment "
                               "is the headers' alone, uncertain by the hosts' clock synchronisation")
                continue
            base = out[anchor].shift_ns - a.header_shift_ns
            residuals = sorted(ends[anchor][k] + base - ends[i][k] for k in shared)
            a.correction_ns = int(median(residuals))
            # the deviation most instances stay within: a completion seen late on one rank (its completion
            # signal waited for a CPU) says nothing of the clocks, and one such outlier must not unjoin a job
            deviations = sorted(abs(r - a.correction_ns) for r in residuals)
            a.uncertainty_ns = int(deviations[int(UNCERTAINTY_QUANTILE * (len(deviations) - 1))])
            if abs(a.correction_ns) >= min_gap_ns:
                a.notes.append(f"its clock and {names[anchor]}'s disagree by {fmt_ms(abs(a.correction_ns))} beyond "
                               "their headers' offsets (collectives complete together on every rank): aligned by "
                               "the collectives")
            if a.uncertainty_ns >= 10 * min_gap_ns:
                a.joined = False
                a.notes.append(f"its collectives' completions disagree with {names[anchor]}'s by up to "
                               f"{fmt_ms(a.uncertainty_ns)}: too uncertain to say which rank arrived last; "
                               "analysed without the other captures")
    for i, a in enumerate(out):
        notes.extend(f"{names[i]}: {n}" for n in a.notes)
    return out


def _on_first_clock(rep: Report, by: int) -> None:
    """Every time of a capture's report moved onto the first capture's clock."""
    times: list[CaptureInfo | Evidence] = [rep["capture"]]
    for s in rep["stalls"]:
        s["start_ns"] += by
        s["end_ns"] += by
        times += s["evidence"]
    for t in times:
        t["start_ns"] += by
        t["end_ns"] += by
    row: InProgressThread
    for row in rep["capture"].get("in_progress", []):
        row["start_ns"] += by
    d: Device
    for d in rep["devices"]:
        d["first_ns"] += by
        d["last_ns"] += by
    for c in rep.get("collectives", []):
        c["enqueued_ns"] += by
        c["started_ns"] += by
        c["completed_ns"] += by


def _merge(reports: list[Report], caps: list[Capture], names: Sequence[str], hosts: list[str],
           align: list[Alignment], jobs: list[list[int]], notes: list[str], min_gap_ns: int) -> Report:
    for rep, a in zip(reports, align, strict=True):
        _on_first_clock(rep, a.shift_ns)
    stalls = sorted((s for r in reports for s in r["stalls"]), key=lambda s: (s["start_ns"], s["host"], s["device"]))
    devices: list[Device] = [{**d, "host": h} for r, h in zip(reports, hosts, strict=True) for d in r["devices"]]
    caps_out = [r["capture"] for r in reports]
    by_cause: dict[str, int] = {}
    for s in stalls:
        by_cause[s["cause"]] = by_cause.get(s["cause"], 0) + s["duration_ns"]
    drops: dict[str, int] = {}
    records: dict[str, int] = {}
    for c in caps_out:
        for k, v in c["drops"].items():
            drops[k] = drops.get(k, 0) + v
        for k, v in c["records"].items():
            records[k] = records.get(k, 0) + v
    merged: CaptureInfo = {
        "start_ns": min(c["start_ns"] for c in caps_out), "end_ns": max(c["end_ns"] for c in caps_out),
        "pids": sorted({p for c in caps_out for p in c["pids"]}), "host": ", ".join(dict.fromkeys(hosts)),
        "drops": drops, "complete": all(c["complete"] for c in caps_out), "records": dict(sorted(records.items())),
    }
    problems = [f"{names[i]}: {c['problem']}" for i, c in enumerate(caps_out) if c.get("problem")]
    if problems:
        merged["problem"] = "; ".join(problems)
    if any(c.get("ebpf_missing") for c in caps_out):
        merged["ebpf_missing"] = "; ".join(f"{names[i]}: {c['ebpf_missing']}" for i, c in enumerate(caps_out)
                                           if c.get("ebpf_missing"))
    window, stall_ns = sum(d["window_ns"] for d in devices), sum(s["duration_ns"] for s in stalls)
    report: Report = {
        "schema": SCHEMA,
        "capture": merged,
        "devices": devices,
        "summary": {
            "window_ns": window, "busy_ns": sum(d["busy_ns"] for d in devices),
            "stall_ns": stall_ns, "stalls": len(stalls),
            "by_cause": dict(sorted(by_cause.items(), key=lambda kv: -kv[1])),
            "input_bound": input_bound(window, stalls, merged),
        },
        "stalls": stalls,
        "top_culprits": top_culprits(stalls),
        "top_processes": _top_processes(reports, hosts, stall_ns),
        "min_gap_ns": min_gap_ns,
    }
    rows = sorted((row for r in reports for row in r.get("collectives", [])),
                  key=lambda row: (row["started_ns"], row["host"], row["rank"]))
    if rows:
        report["collectives"] = rows
    captures: list[JoinedCapture] = [
        {"name": names[i], "host": hosts[i], "job": next(k for k, job in enumerate(jobs) if i in job),
         "capture": caps_out[i], "shift_ns": a.shift_ns, "header_shift_ns": a.header_shift_ns,
         "correction_ns": a.correction_ns, "uncertainty_ns": a.uncertainty_ns, "anchors": a.anchors,
         "joined": a.joined}
        for i, a in enumerate(align)]
    report["captures"] = captures
    known = [a.uncertainty_ns for a in align[1:] if a.uncertainty_ns is not None]
    report["join"] = {
        "captures": len(caps), "jobs": jobs, "clock": names[0] if names else "",
        "uncertainty_ns": max(known) if known and len(known) == len(align) - 1 else None,
        "notes": notes,
    }
    return report


def _top_processes(reports: list[Report], hosts: list[str], total: int) -> list[TopProcess]:
    rows: list[TopProcess] = [{**row, "host": h} for r, h in zip(reports, hosts, strict=True)
                              for row in r.get("top_processes", [])]
    for row in rows:
        row["share_pct"] = round(100.0 * row["stall_ns"] / total, 1) if total else 0.0
    return sorted(rows, key=lambda row: -row["stall_ns"])[:MAX_TOP]
