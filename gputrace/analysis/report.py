"""The `gputrace.report/1` dict (docs/report.md, the JSON contract) and the figures derived from it."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from gputrace.analysis import throttle, uring
from gputrace.analysis.attribute import Attributor
from gputrace.analysis.devices import DeviceKey
from gputrace.analysis.load import DIRTY_OP, Capture
from gputrace.analysis.overhead import read_overhead
from gputrace.analysis.timeline import (
    CollectiveWait,
    DeviceTimeline,
    HostWait,
    InstanceKey,
    Remote,
    RemoteCall,
    build,
    comm_of,
    host_after_last,
    host_instances,
    host_uncaptured_last,
    host_waits,
    instances,
    loss_windows,
    untimed_losses,
)
from gputrace.analysis.timeline import Stall as TimelineStall
from gputrace.documents import (
    CAUSES,
    Attached,
    CaptureInfo,
    CollectiveRow,
    Culprit,
    Device,
    InProgressThread,
    InputBound,
    Report,
    Stall,
    Summary,
    TopCulprit,
    TopProcess,
)
from gputrace.documents import REPORT_SCHEMA as SCHEMA
from gputrace.records import CollectiveCall

__all__ = ["CAUSES", "SCHEMA", "assemble"]
# TensorFlow profiler's input-pipeline analysis calls a step input-bound at these shares of waiting on input
INPUT_BOUND_MODERATE, INPUT_BOUND_HIGH = 5.0, 20.0


MAX_HOST = 253  # a DNS name's length: a longer "host" in a header is cut there


def host_of(cap: Capture) -> str:
    return str(cap.header.get("host", ""))[:MAX_HOST]


def assemble(cap: Capture, min_gap_ns: int, *, attributor: Attributor | None = None,
             remote: dict[InstanceKey, list[Remote]] | None = None,
             remote_calls: dict[InstanceKey, list[RemoteCall]] | None = None) -> Report:
    """The report of one capture; of one of several captures of a job, with the ranks the others hold
    (``remote``, ``remote_calls``) and an ``attributor`` that knows the others' (analysis/join.py)."""
    timelines, waits = build(cap, min_gap_ns, remote)
    host = host_of(cap)
    calls_waited = host_waits(cap, min_gap_ns, remote_calls)
    if attributor is None:
        attributor = Attributor(cap, host)
        attributor.host_waits(calls_waited)
    # a cut-off capture may miss records anywhere (sources flush batches late), so every stall is suspect
    losses, lost_anywhere = loss_windows(cap), untimed_losses(cap) or bool(cap.problem)
    stalls: list[Stall] = []
    arrivals: dict[int, Stall] = {}  # id() of a collective kernel -> the idle stall its start ended
    for tl in timelines:
        for st in tl.stalls:
            s = stall_doc(attributor, st, host, losses, lost_anywhere)
            stalls.append(s)
            if st.collective is None and st.op is not None:
                arrivals[id(st.op)] = s
    report = report_of(cap, timelines, stalls, min_gap_ns)
    rows = collective_rows(cap, waits, arrivals, host, remote or {}, min_gap_ns)
    rows += call_rows(cap, calls_waited, host, remote_calls or {}, min_gap_ns, {(r["comm"], r["seq"]) for r in rows},
                      attributor)
    rows.sort(key=lambda r: (r["started_ns"], r["rank"]))
    if rows:
        report["collectives"] = rows
    return report


def stall_doc(attributor: Attributor, st: TimelineStall, host: str, losses: list[tuple[int, int]],
              lost_anywhere: bool) -> Stall:
    """One stall's document: explained on ``attributor``'s records, named on ``host``, and whether records
    were lost over it (``losses``: when; ``lost_anywhere``: at an unknown time)."""
    s = attributor.stall(st)
    _namespaced(attributor.cap, s["culprit"])
    s["host"] = host
    s["culprit"].setdefault("host", host)
    s["overlaps_drops"] = lost_anywhere or any(a < st.end_ns and b > st.start_ns for a, b in losses)
    return s


def report_of(cap: Capture, timelines: list[DeviceTimeline], stalls: list[Stall], min_gap_ns: int,
              counted: dict[DeviceKey, tuple[int, int]] | None = None) -> Report:
    """The report of ``stalls`` (sorted here) on ``timelines``, without collectives rows; ``counted``: each
    device's (stalls, stall ns) where its timeline does not list them (a windowed analysis's)."""
    stalls.sort(key=lambda s: (s["start_ns"], s["device"]))
    capture = _capture(cap, timelines)
    devices = [_device(cap, tl) for tl in timelines]
    for d, tl in zip(devices, timelines, strict=True):
        if counted is not None and tl.key in counted:
            d["stalls"], d["stall_ns"] = counted[tl.key]
    return {
        "schema": SCHEMA,
        "capture": capture,
        "devices": devices,
        "summary": _summary(timelines, stalls, capture),
        "stalls": stalls,
        "top_culprits": top_culprits(stalls),
        "top_processes": top_processes(cap, stalls),
        "min_gap_ns": min_gap_ns,
    }


def collective_rows(cap: Capture, waits: dict[int, CollectiveWait], arrivals: dict[int, Stall], host: str,
                    remote: dict[InstanceKey, list[Remote]], min_gap_ns: int) -> list[CollectiveRow]:
    """Each rank's part in each collective instance this capture holds (those a Collective record names):
    its identity, when it arrived (its launch: ``enqueued_ns``; its kernel's start: ``started_ns``), when
    the collective completed, how long it waited for the others, and the stall its arrival ended (why it
    arrived then, on its own records). ``late``: whether it arrived last, where other ranks were captured."""
    rows: list[CollectiveRow] = []
    for key, members in instances(cap).items():
        comm, name, seq = key
        if seq < 0:
            continue  # matched by kernel name alone: no identity to give
        others = remote.get(key, [])
        starts = [op.start_ns for op, _, _ in members] + [r.op.start_ns + r.shift_ns for r in others]
        last = max(starts)
        # every rank here waited for one that was not captured: none of these came last
        uncaptured_last = any((w := waits.get(id(op))) is not None and w.late is None for op, _, _ in members)
        for op, rank, nbytes in members:
            meta = cap.collectives.get((op.pid, op.correlation_id))
            api = cap.launches.get((op.pid, op.correlation_id))
            w = waits.get(id(op))
            row: CollectiveRow = {
                "comm": comm, "seq": seq, "op": name, "bytes": nbytes, "rank": rank,
                "world": int(meta.world) if meta is not None and type(meta.world) is int else -1,
                "host": host, "pid": op.pid, "device": op.device, "kernel": op.name,
                "enqueued_ns": api.start_ns if api is not None else op.start_ns, "started_ns": op.start_ns,
                "completed_ns": op.end_ns, "waited_ns": w.wait_end - w.wait_start if w is not None else 0,
                "ranks_captured": len(starts)}
            if len(starts) > 1:  # who came last is known only when another rank was captured
                row["late"] = not uncaptured_last and op.start_ns == last and last - min(starts) >= min_gap_ns
            stall = arrivals.get(id(op))
            if stall is not None:
                row["arrival"] = {"cause": stall["cause"], "culprit": stall["culprit"], "via": stall["via"],
                                  "stall_ns": stall["duration_ns"]}
            rows.append(row)
    rows.sort(key=lambda r: (r["started_ns"], r["rank"]))
    return rows


def call_rows(cap: Capture, waited: dict[int, list[HostWait]], host: str, remote: dict[InstanceKey, list[RemoteCall]],
              min_gap_ns: int, done: set[tuple[str, int]], attributor: Attributor | None) -> list[CollectiveRow]:
    """Each rank's part in each collective instance called on the host (torch.distributed's, gloo's above
    all), as ``collective_rows`` gives a kernel's: arrival (the call entered: ``enqueued_ns`` and
    ``started_ns``), completion, and the time it waited for a later rank. An instance a kernel already
    gives (an NCCL call linked to its kernel) is not given twice. ``arrival``: why the rank got there when
    it did, on its own records alone (as a kernel's is its device's idle gap before it): its thread's time
    since its previous collective call returned, where that is at least ``min_gap_ns`` (not without an
    ``attributor``: the windowed analysis of a long capture holds no thread's whole time between calls)."""
    waits = {id(w.call): w for ws in waited.values() for w in ws}
    since = _previous_returns(cap)
    rows = []
    groups = host_instances(cap)
    after_last = host_after_last(groups, remote)
    for key, calls in groups.items():
        comm, name, seq = key
        if (comm, seq) in done:
            continue
        starts = [c.start_ns for c in calls] + [r.call.start_ns + r.shift_ns for r in remote.get(key, [])]
        last = max(starts)
        # a rank not captured called last: none of these came last
        uncaptured_last = host_uncaptured_last(calls, remote.get(key, []), after_last, min_gap_ns)
        for c in calls:
            w = waits.get(id(c))
            row: CollectiveRow = {
                "comm": comm, "seq": seq, "op": name, "bytes": c.nbytes, "rank": c.rank, "world": c.world,
                "host": host, "pid": c.pid, "tid": c.tid, "device": -1, "kernel": "", "backend": c.backend,
                "enqueued_ns": c.start_ns, "started_ns": c.start_ns, "completed_ns": c.end_ns,
                "waited_ns": w.wait_end - w.wait_start if w is not None else 0, "ranks_captured": len(starts)}
            if len(starts) > 1:
                row["late"] = not uncaptured_last and c.start_ns == last and last - min(starts) >= min_gap_ns
            a = since.get(id(c))
            if attributor is not None and a is not None and c.start_ns - a >= min_gap_ns:
                found = attributor.arrival(c.tid, a, c.start_ns)
                if found is not None:
                    _namespaced(cap, found["culprit"])
                    row["arrival"] = {"cause": found["cause"], "culprit": found["culprit"], "via": found["via"],
                                      "stall_ns": c.start_ns - a}
            rows.append(row)
    return rows


def _previous_returns(cap: Capture) -> dict[int, int]:
    """For each host collective call (by id()), when its thread's previous collective call returned (a
    thread's collectives run one after another). A gloo async op's record ends at its work's completion,
    not at its call's return, which only enqueued it: its start stands for that return."""
    by_tid: dict[int, list[CollectiveCall]] = {}
    for c in cap.calls:
        by_tid.setdefault(c.tid, []).append(c)
    out: dict[int, int] = {}
    for calls in by_tid.values():
        calls.sort(key=lambda c: c.start_ns)
        prev: int | None = None
        for c in calls:
            if prev is not None and prev <= c.start_ns:
                out[id(c)] = prev
            prev = c.end_ns if c.waited or c.backend != "gloo" else c.start_ns
    return out


def communicators(cap: Capture) -> set[str]:
    """The communicator ids the capture's Collective and CollectiveCall records name."""
    return {c for c in (comm_of(m) for m in [*cap.collectives.values(), *cap.calls]) if c}


def _namespaced(cap: Capture, culprit: Culprit | TopProcess) -> None:
    """A culprit in a container's pid namespace also gets the pid it has there (its logs use that one)."""
    nspid = cap.nspids.get(culprit["pid"])
    if nspid:
        culprit["pid_in_namespace"] = nspid


def pid_text(c: Mapping[str, Any]) -> str:
    """'pid 4242 (python)', or 'pid 4242 (python; pid 3 in its namespace)' for a process in a container."""
    inside = f"; pid {c['pid_in_namespace']} in its namespace" if c.get("pid_in_namespace") else ""
    detail = f"{c.get('comm', '')}{inside}".lstrip("; ")  # no name without eBPF's process records
    return f"pid {c['pid']} ({detail})" if detail else f"pid {c['pid']}"


def holders_text(held: Sequence[Mapping[str, Any]]) -> str:
    """'pid 700 (hog) 83%, kworker/0:1 (tid 55) 17%': who had the CPU a run-queue wait waited for (a culprit's
    ``cpu_held_by``), by share of that wait. Values come from a capture file: shown, never trusted."""
    rows = [r for r in held if isinstance(r, dict)]
    total = sum(int(r.get("ns", 0)) for r in rows) or 1
    out = []
    for r in rows:
        pid, tid, comm = int(r.get("pid", 0)), int(r.get("tid", 0)), str(r.get("comm", ""))
        who = f"pid {pid} ({comm})" if pid else f"{comm} (tid {tid})"
        if pid and tid != pid:
            who += f" thread {tid}"
        out.append(f"{who} {100 * int(r.get('ns', 0)) / total:.0f}%")
    return ", ".join(out)


def capture_start(cap: Capture, timelines: list[DeviceTimeline]) -> int:
    """When tracing began, not when the capture file was opened: compiling and loading the probes comes between
    (seconds). Captures written before the session recorded it start at the header's start_ns. GPU work seen
    earlier than that (an agent's records from before) moves the start back, so no stall is before it."""
    start = cap.tracing_ns or int(cap.header.get("start_ns") or cap.first_ns)
    return min([start, *(tl.first_ns for tl in timelines)])


def _capture(cap: Capture, timelines: list[DeviceTimeline]) -> CaptureInfo:
    drops = {k: int(v) for k, v in cap.reader_drops.items() if isinstance(v, int)}
    start = capture_start(cap, timelines)
    end = int(cap.trailer.get("end_ns") or cap.last_ns)
    out: CaptureInfo = {"start_ns": start, "end_ns": max(end, start), "pids": sorted(p for p in cap.pids if p > 0),
           "host": str(cap.header.get("host", "")), "drops": drops, "complete": cap.complete,
           "records": dict(sorted(cap.counts.items()))}
    if cap.problem:
        out["problem"] = cap.problem
    if cap.malformed:
        out["malformed_records"] = cap.malformed
    if cap.unknown_kinds:
        out["unknown_record_kinds"] = dict(sorted(cap.unknown_kinds.items()))
    sources = cap.trailer.get("sources")
    ebpf = sources.get("ebpf") if isinstance(sources, dict) else None
    if isinstance(ebpf, list) and len(ebpf) == 2 and ebpf[0] == "missing":
        out["ebpf_missing"] = str(ebpf[1])[:500]  # the capture ran without the kernel side: why
    skipped = cap.trailer.get("skipped")
    if isinstance(skipped, dict):
        out["skipped_probes"] = {str(k): int(v) for k, v in skipped.items() if type(v) is int and v > 0}
    if cap.in_progress:
        out["in_progress"] = in_progress(cap)
        out["in_progress_threads"] = len(cap.in_progress)
    if cap.cpu_throttles or cap.cpu_cgroups:  # CPU quotas (container limits) and cgroup files unreadable
        out["cpu_cgroups"] = throttle.limited(cap)
        unreadable = throttle.errors(cap)
        if unreadable:
            out["cpu_cgroup_errors"] = unreadable
    if cap.counts.get("ProcLeftOut"):  # a service capture for a user: processes that gained privileges
        out["left_out"] = cap.counts["ProcLeftOut"]
    if cap.off:
        out["off"] = sorted(cap.off)
    overhead = read_overhead(cap.trailer.get("overhead"))
    if overhead is not None:
        out["overhead"] = overhead
    if cap.agent_from:  # GPU agents report device work from their hello on, not before (one attached late)
        out["device_timing_from_ns"] = min(cap.agent_from.values())
        out["device_timing_from"] = [{"pid": p, "ns": ns} for p, ns in sorted(cap.agent_from.items())]
    attached = _attached(cap.trailer.get("attached"))
    if attached:
        out["attached"] = attached
    return out


def _attached(rows: Any) -> list[Attached]:
    """The session's explicit targets and how each got its agent (a file's values: checked, never trusted)."""
    out: list[Attached] = []
    for r in rows[:64] if isinstance(rows, list) else []:
        if not isinstance(r, dict) or type(r.get("pid")) is not int:
            continue
        row: Attached = {"pid": r["pid"], "how": str(r.get("how", ""))[:20]}
        if "method" in r:
            row["method"] = str(r["method"])[:20]
        if type(r.get("pause_ms")) in (int, float):
            row["pause_ms"] = float(r["pause_ms"])
        out.append(row)
    return out


MAX_IN_PROGRESS = 20
MAX_REQUESTS = 5  # io_uring requests listed for each thread caught in io_uring_enter


def in_progress(cap: Capture) -> list[InProgressThread]:
    """Threads caught waiting when the capture stopped, longest first: what a hung job is stuck in."""
    rows = sorted(cap.in_progress, key=lambda r: (r.start_ns - r.at_ns, r.tid))[:MAX_IN_PROGRESS]
    out: list[InProgressThread] = []
    for r in rows:
        row: InProgressThread = {
            "pid": r.pid, "tid": r.tid, "comm": cap.comm(r.tid) or cap.comm(r.pid), "op": r.name or "off-CPU",
            "object": r.obj, "state": r.state, "start_ns": r.start_ns, "duration_ns": r.at_ns - r.start_ns,
            "since_before_capture": bool(r.before)}
        requests = uring.in_flight(cap.uring.get(r.pid), r.tid) if r.name == uring.ENTER else []
        if requests:  # what its io_uring_enter was waiting for
            row["requests_in_flight"] = len(requests)
            row["requests"] = [{"op": q.op, "object": q.obj, "fd": q.fd, "start_ns": q.start_ns,
                                "duration_ns": q.end_ns - q.start_ns} for q in requests[:MAX_REQUESTS]]
        out.append(row)
    return out


def _device(cap: Capture, tl: DeviceTimeline) -> Device:
    info = cap.devices.get(tl.key)
    window = tl.last_ns - tl.first_ns
    out: Device = {
        "id": tl.key[1], "name": info.name if info else "", "simulated": bool(info.simulated) if info else False,
        "busy_ns": tl.busy_ns, "idle_ns": window - tl.busy_ns,
        "window_ns": window, "first_ns": tl.first_ns, "last_ns": tl.last_ns,
        "stall_ns": sum(s.end_ns - s.start_ns for s in tl.stalls), "stalls": len(tl.stalls),
        "collective_wait_ns": tl.collective_wait_ns,
    }
    if tl.key[0] >= 0:
        out["pid"] = tl.key[0]
    uuid = cap.device_map.uuids.get(tl.key)
    if uuid:
        out["uuid"] = uuid
    named = cap.device_map.cuda_ids.get(tl.key)
    if named:  # how each process numbers it (CUDA_VISIBLE_DEVICES renumbers): what exporters place records by
        out["cuda_ids"] = [{"pid": pid, "id": dev} for pid, dev in named]
    nvml = cap.nvml.get(tl.key[1]) if tl.key[0] < 0 else None  # a real device is keyed by NVML's index
    if nvml and nvml[1]:
        out["nvml_util_pct"] = round(nvml[0] / nvml[1], 1)
    return out


def _summary(timelines: list[DeviceTimeline], stalls: list[Stall], capture: CaptureInfo) -> Summary:
    by_cause: dict[str, int] = {}
    for s in stalls:
        by_cause[s["cause"]] = by_cause.get(s["cause"], 0) + s["duration_ns"]
    window = sum(tl.last_ns - tl.first_ns for tl in timelines)
    return {
        "window_ns": window,
        "busy_ns": sum(tl.busy_ns for tl in timelines),
        "stall_ns": sum(s["duration_ns"] for s in stalls),
        "stalls": len(stalls),
        "by_cause": dict(sorted(by_cause.items(), key=lambda kv: -kv[1])),
        "input_bound": input_bound(window, stalls, capture),
    }


def is_input_stall(s: Stall) -> bool:
    """Waiting for data: storage or network, or a data worker's CPU time reached through a wait chain."""
    return s["cause"] in ("storage", "network") or (s["cause"].startswith("cpu") and bool(s["via"]))


def input_bound(window: int, stalls: list[Stall], capture: CaptureInfo) -> InputBound:
    """Storage, network and data workers' CPU reached through a wait, as a share of the GPU ``window``."""
    ns = sum(s["duration_ns"] for s in stalls if is_input_stall(s))
    pct = 100.0 * ns / window if window else 0.0
    if capture.get("ebpf_missing"):
        verdict = "unknown (no host-side data: the capture ran without eBPF)"  # no stall can show as input
    elif pct >= INPUT_BOUND_HIGH:
        verdict = "highly input-bound"
    elif pct >= INPUT_BOUND_MODERATE:
        verdict = "moderately input-bound"
    else:
        verdict = "not input-bound"
    return {"input_ns": ns, "pct": round(pct, 2), "verdict": verdict,
            "thresholds_pct": [INPUT_BOUND_MODERATE, INPUT_BOUND_HIGH]}


def culprit_label(s: Stall) -> tuple[str, str]:
    """(kind, label) under which a stall's time is counted among the top culprits."""
    c, cause = s["culprit"], s["cause"]
    if cause == "unknown":
        return "unknown", "(unexplained)"
    if cause == "storage" and c.get("op") == DIRTY_OP:  # a store to a mapping: the device, no file named
        return "device", c["object"]
    if cause == "storage" and c.get("object"):
        return "file", c["object"]
    if cause == "network" and c.get("object"):
        return "peer", c["object"]
    if cause == "collective":  # by the late rank, not by instance: one line per process that kept the others
        what = str(c.get("object") or c.get("op", "")).split(" #")[0]
        if c.get("pid"):
            rank = f"rank {c['rank']} " if "rank" in c else ""
            where = f" on {c['host']}" if c.get("host") else ""
            return "collective", f"{what}: late {rank}{pid_text(c)}{where}"
        return "collective", what
    if cause == "tracing":  # gputrace's own agent in the job: what it did, and where
        return "tracing", f"{c.get('object', '')} in {pid_text(c)}"
    if c.get("pid"):
        return "process", pid_text(c)
    return cause, c.get("op", "") or cause


def top_culprits(stalls: list[Stall], limit: int = 10) -> list[TopCulprit]:
    total = sum(s["duration_ns"] for s in stalls)
    acc: dict[tuple[str, str], list[int]] = {}
    for s in stalls:
        slot = acc.setdefault(culprit_label(s), [0, 0])
        slot[0] += s["duration_ns"]
        slot[1] += 1
    top = sorted(acc.items(), key=lambda kv: -kv[1][0])[:limit]
    return [{"kind": k, "culprit": label, "stall_ns": ns, "stalls": n,
             "share_pct": round(100.0 * ns / total, 1) if total else 0.0} for (k, label), (ns, n) in top]


def top_processes(cap: Capture, stalls: list[Stall], limit: int = 10) -> list[TopProcess]:
    """The processes the stall time went to, most first: each stall's whole ``breakdown`` (the largest
    parts by cause, process and object, the rest by cause and process) summed by process. A DataLoader's
    stalls on many shard files are one worker's; the GPU process's own time (``gpu_process``) is there
    too. ``unknown`` names no process."""
    total = sum(s["duration_ns"] for s in stalls)
    gpu_pids = {s.get("device_pid") for s in stalls}
    acc: dict[int, tuple[Counter[str], set[int]]] = {}
    for k, s in enumerate(stalls):
        for part in s.get("breakdown", []):
            if part["pid"]:
                causes, seen = acc.setdefault(part["pid"], (Counter(), set()))
                causes[part["cause"]] += part["ns"]
                seen.add(k)
    top = sorted(acc.items(), key=lambda kv: -kv[1][0].total())[:limit]
    out: list[TopProcess] = []
    for pid, (causes, seen) in top:
        ns = causes.total()
        row: TopProcess = {"pid": pid, "comm": cap.comm(pid), "gpu_process": pid in gpu_pids, "stall_ns": ns,
               "share_pct": round(100.0 * ns / total, 1) if total else 0.0, "stalls": len(seen),
               "by_cause": dict(causes.most_common())}
        _namespaced(cap, row)
        out.append(row)
    return out


def causes_text(by_cause: dict[str, int], limit: int = 3) -> str:
    """'storage 99%, cpu 1%': a process's stall time by cause (``top_processes``), largest first; causes
    under half a percent are left out (the largest never is)."""
    total = sum(by_cause.values()) or 1
    top = sorted(by_cause.items(), key=lambda kv: -kv[1])[:limit]
    return ", ".join(f"{cause} {100 * ns / total:.0f}%" for k, (cause, ns) in enumerate(top)
                     if k == 0 or ns * 200 >= total)
