"""From a stall to its cause: the op that ended it, its launch, then the launching thread's time (docs/report.md,
"How a stall is explained")."""

from __future__ import annotations

from collections import Counter

from gputrace.analysis.explain import CaptureFacts, Explainer, Part, PartExtra, empty_culprit
from gputrace.analysis.load import Capture, GpuOp
from gputrace.analysis.timeline import CollectiveWait, HostWait, Stall
from gputrace.documents import BreakdownEntry, Culprit, DirtyFields, Evidence, Holder, LateRank, StallPlace, Verdict
from gputrace.documents import Stall as StallDoc
from gputrace.records import CollectiveCall, CudaApi

MAX_BREAKDOWN = 5
MAX_HOLDERS = 3  # tasks named in a run-queue wait's cpu_held_by


def gpu_evidence(op: GpuOp, launch: CudaApi | None) -> Evidence:
    name = getattr(op, "name", "") or type(op).__name__.removeprefix("Gpu").lower()
    return {"pid": op.pid, "tid": launch.tid if launch else 0, "kind": "gpu", "what": name,
            "start_ns": op.start_ns, "end_ns": op.end_ns}


def launch_evidence(api: CudaApi) -> Evidence:
    return {"pid": api.pid, "tid": api.tid, "kind": "gpu", "what": f"launch {api.name}", "start_ns": api.start_ns,
            "end_ns": api.end_ns}


class Attributor:
    """Explains the stalls of one capture. Of several captures of one job, ``peers`` holds each capture's
    Attributor (by its index), so a late rank in another capture is explained on that capture's records."""

    def __init__(self, cap: Capture, host: str = "", facts: CaptureFacts | None = None) -> None:
        self.cap = cap
        self.host = host
        self.explainer = Explainer(cap, facts)
        self.peers: list[Attributor] = []
        self.explaining_late = False  # this capture's records are explaining a late rank's time just now

    def stall(self, st: Stall) -> StallDoc:
        """The stall's document: its device and times, what it waited on, and this capture's host
        (``overlaps_drops`` is the report's to set)."""
        verdict = self._collective(st, st.collective) if st.collective is not None else self._idle(st)
        where: StallPlace = {"device": st.device[1], "start_ns": st.start_ns, "end_ns": st.end_ns,
                             "duration_ns": st.end_ns - st.start_ns}
        if st.device[0] >= 0:
            where["device_pid"] = st.device[0]
        return {**where, **verdict, "host": self.host, "overlaps_drops": False}

    def launch_of(self, op: GpuOp | None) -> CudaApi | None:
        return self.cap.launches.get((op.pid, op.correlation_id)) if op is not None else None

    def _idle(self, st: Stall) -> Verdict:
        op = st.op
        api = self.launch_of(op)
        gpu_ev = [gpu_evidence(op, api)] if op is not None else []
        if api is None:
            return _verdict("unknown", empty_culprit(), [], gpu_ev, why="no launch record for the op that ended it")
        ev = [*gpu_ev, launch_evidence(api)]
        launched = api.start_ns
        if launched <= st.start_ns:  # it was queued before the GPU went idle, yet did not start
            culprit = self.explainer.culprit(api.tid, api.name, getattr(op, "name", ""))
            return _verdict("device", culprit, [], ev, why="launched before the stall, started at its end")
        host_ns, launch_ns = launched - st.start_ns, st.end_ns - launched
        if launch_ns > host_ns:
            culprit = self.explainer.culprit(api.tid, api.name, getattr(op, "name", ""), 0, api.end_ns - api.start_ns)
            return _verdict("launch", culprit, [], ev, why="the op started long after its launch")
        parts = self.explainer.explain(api.tid, st.start_ns, launched)
        out = _from_parts(parts, ev)
        if out["cause"] == "cpu.throttled":  # what the cgroup's counters say of the stall's window
            path = out["culprit"].get("object", "")
            out["culprit"] = {**out["culprit"], **self.explainer.throttles.counters(path, st.start_ns, launched)}
        return out

    def _collective(self, st: Stall, w: CollectiveWait) -> Verdict:
        own = self.launch_of(w.op)
        ev = [gpu_evidence(w.op, own)]
        what = collective_object(w.name, w.seq)
        if w.late is None:  # the other ranks were not captured: the wait is real, the late peer unknown
            culprit: Culprit = {**empty_culprit(), "op": w.op.name, "object": what}
            return _verdict("collective", culprit, [], ev, why="ran past its shortest run; late rank not captured")
        # the late rank's own capture: its launch, its threads and their time are there, on its clock
        there = self.peers[w.late_capture] if 0 <= w.late_capture < len(self.peers) else self
        late_api = there.launch_of(w.late)
        late_ev = gpu_evidence(w.late, late_api)
        tid = late_api.tid if late_api else 0
        culprit = {**empty_culprit(), "pid": w.late.pid, "tid": tid, "comm": there.cap.comm(tid or w.late.pid)
                   or there.cap.comm(w.late.pid), "op": w.late.name, "object": what, "host": there.host}
        if there is not self:  # evidence times are this capture's: the late rank's are shifted onto its clock
            late_ev = shifted(late_ev, w.late_shift_ns)
            late_ev["host"] = there.host
        ev.append(late_ev)
        if w.late_rank >= 0:
            culprit["rank"] = w.late_rank
        hop = f"collective:pid {w.late.pid}" + (f" rank {w.late_rank}" if w.late_rank >= 0 else "")
        if there is not self:
            hop += f" host {there.host}"
        out = _verdict("collective", culprit, [hop], ev)
        start_there = st.start_ns - w.late_shift_ns  # the stall's start on the late rank's clock
        if late_api is not None and late_api.start_ns > start_there:
            launch_ev = launch_evidence(late_api)
            ev.append(_elsewhere(launch_ev, w.late_shift_ns, there.host) if there is not self else launch_ev)
            late, more = self.late_rank(there, late_api.tid, start_there, late_api.start_ns, w.late_shift_ns)
            if late is not None:
                out["late_rank"] = late
                out["late_rank_cause"] = late  # the name this field had before it was named on its host
                out["evidence"] = (ev + more)[:24]
        return out

    def late_rank(self, there: Attributor, tid: int, a: int, b: int,
                  shift_ns: int) -> tuple[LateRank | None, list[Evidence]]:
        """Why the late rank arrived late: [a, b) of its thread ``tid`` (on its capture's clock: from when the
        others waited to its arrival), explained by the same rules as any stall on ``there``'s records,
        named on its host; with the evidence of its dominant part, on this capture's clock. None where
        nothing is known of that time, or where this is already the explanation of another late rank's
        time (a late rank that waited for yet another is named, not explained again)."""
        if there.explaining_late:
            return None, []
        there.explaining_late = True
        try:
            parts = there.explainer.explain(tid, a, b)
        finally:
            there.explaining_late = False
        if not parts:
            return None, []
        best = _dominant(parts)
        # the same verdict the late rank's own stall would get (storage's dirty pauses, a run queue's
        # holders), named on its host
        mine = _from_parts(parts, [])
        late: LateRank = {"cause": mine["cause"], "culprit": {**mine["culprit"], "host": there.host},
                          "via": mine["via"]}
        more = best.evidence if there is self else [_elsewhere(e, shift_ns, there.host) for e in best.evidence]
        return late, more

    def arrival(self, tid: int, a: int, b: int) -> LateRank | None:
        """Why thread ``tid`` arrived at a collective call at ``b``: its time since ``a`` (its previous
        collective call's return), explained by the same rules as any stall, named on its host."""
        parts = self.explainer.explain(tid, a, b)
        if not parts:
            return None
        mine = _from_parts(parts, [])
        found: LateRank = {"cause": mine["cause"], "culprit": {**mine["culprit"], "host": self.host},
                           "via": mine["via"]}
        return found

    def host_waits(self, waits: dict[int, list[HostWait]]) -> None:
        """Collective calls that waited for a later rank: a thread's time there, wherever a stall's
        explanation meets it, is the late rank's (``_host_part``)."""
        self.explainer.host_waits = waits
        self.explainer.on_collective = self._host_part

    def _host_part(self, w: HostWait, x: int, y: int, _depth: int) -> Part:
        """[x, y) of a thread blocked in a collective call (gloo's) before the last rank arrived: ``collective``,
        the culprit the late rank's process and call, and ``late_rank`` why it was late, as a collective
        kernel's wait on the device is explained (``_collective``)."""
        there = self.peers[w.late_capture] if 0 <= w.late_capture < len(self.peers) else self
        late, what = w.late, collective_object(w.call.name, w.call.seq)
        culprit: Culprit = {**empty_culprit(), "pid": late.pid, "tid": late.tid,
                            "comm": there.cap.comm(late.tid) or there.cap.comm(late.pid), "op": late.name,
                            "object": what, "bytes": late.nbytes, "host": there.host, "rank": late.rank}
        hop = f"collective:pid {late.pid} rank {late.rank}" + (f" host {there.host}" if there is not self else "")
        late_ev = call_evidence(late, f"{what}: rank {late.rank} arrived")
        ev = [call_evidence(w.call, f"{what}: rank {w.call.rank} waited"),
              _elsewhere(late_ev, w.late_shift_ns, there.host) if there is not self else late_ev]
        extra: PartExtra = {}
        found, more = self.late_rank(there, late.tid, x - w.late_shift_ns, late.start_ns, w.late_shift_ns)
        if found is not None:
            extra = {"late_rank": found, "late_rank_cause": found}
            ev += more
        return Part("collective", y - x, culprit, via=[hop], path=[late.tid], evidence=ev[:24], extra=extra)


def call_evidence(c: CollectiveCall, what: str) -> Evidence:
    return {"pid": c.pid, "tid": c.tid, "kind": "collective", "what": f"{what} ({c.backend})",
            "start_ns": c.start_ns, "end_ns": c.end_ns}


def collective_object(name: str, seq: int) -> str:
    """How a collective instance is named: "all_reduce #17" (its sequence number in its communicator)."""
    return f"{name} #{seq}" if seq >= 0 else name


def _elsewhere(ev: Evidence, shift_ns: int, host: str) -> Evidence:
    """Evidence from the late rank's capture: on this capture's clock, and naming its host (its pid and tid
    are that host's, which an exporter must know to find its slice)."""
    return {**shifted(ev, shift_ns), "host": host}


def shifted(ev: Evidence, shift_ns: int) -> Evidence:
    """A piece of evidence from another capture, its times put on this capture's clock."""
    return {**ev, "start_ns": ev["start_ns"] + shift_ns, "end_ns": ev["end_ns"] + shift_ns}


def _verdict(cause: str, culprit: Culprit, via: list[str], evidence: list[Evidence], why: str = "") -> Verdict:
    out: Verdict = {"cause": cause, "via": via, "culprit": culprit, "evidence": evidence}
    if why:
        out["why"] = why
    return out


def _dominant(parts: list[Part]) -> Part:
    """The part holding the most time once parts with the same cause and culprit are summed: of those, the
    largest part of the thread that holds the most time among them (a process's CPU time may be two threads',
    the waiting one's and a lock holder's)."""
    totals: dict[tuple[str, int, str], int] = {}
    for p in parts:
        totals[p.key()] = totals.get(p.key(), 0) + p.ns
    best = max(totals, key=lambda k: totals[k])
    mine = [p for p in parts if p.key() == best]
    by_tid: dict[int, int] = {}
    for p in mine:
        tid = p.culprit["tid"]
        by_tid[tid] = by_tid.get(tid, 0) + p.ns
    tid = max(by_tid, key=lambda t: by_tid[t])
    return max((p for p in mine if p.culprit["tid"] == tid), key=lambda p: p.ns)


def _cpu_held_by(parts: list[Part], best: Part) -> list[Holder]:
    """``cpu_held_by``: who had the CPU the run-queue waits of ``best``'s thread (same cause and culprit)
    waited for, most time first (for each wait, the task it got the CPU back from)."""
    tid = best.culprit["tid"]
    held: Counter[tuple[int, int, str]] = Counter()
    for p in parts:
        if p.key() == best.key() and p.culprit["tid"] == tid:
            held.update(p.held)
    return [{"pid": pid, "tid": t, "comm": comm, "ns": ns} for (pid, t, comm), ns in held.most_common(MAX_HOLDERS)]


def _same_thread_ns(parts: list[Part], best: Part) -> int:
    """The time of the parts with ``best``'s cause, culprit and thread: a throttled thread's time throttled in
    the stall, over all its waits."""
    tid = best.culprit["tid"]
    return sum(p.ns for p in parts if p.key() == best.key() and p.culprit["tid"] == tid)


def _dirty_pauses(parts: list[Part], best: Part) -> DirtyFields:
    """The pauses for dirty pages in every call of ``best``'s thread on ``best``'s object in this stall (a save
    is many write()s, paused in turn): how many, their time, and in how many calls; the device and its dirty
    pages as of the last. Each call counts once, however many parts hold it."""
    tid = best.culprit["tid"]
    calls: dict[int, Culprit] = {}
    for p in parts:
        c = p.culprit
        if p.key() == best.key() and c["tid"] == tid and c.get("dirty_pauses") and p.evidence:
            calls[int(p.evidence[0]["start_ns"])] = c
    if not calls:
        return {}
    last = calls[max(calls)]
    return {"dirty_pauses": sum(c.get("dirty_pauses", 0) for c in calls.values()),
            "dirty_paused_ns": sum(c.get("dirty_paused_ns", 0) for c in calls.values()), "dirty_calls": len(calls),
            "dirty_device": last["dirty_device"], "dirty_bytes": last["dirty_bytes"],
            "dirty_setpoint_bytes": last["dirty_setpoint_bytes"]}


def _breakdown(parts: list[Part]) -> list[BreakdownEntry]:
    """The parts summed by (cause, pid, object), the largest ``MAX_BREAKDOWN`` first; the rest is folded by
    (cause, pid) with an empty object and ``objects`` (how many it holds), so the entries always add up to
    the whole stall (a worker's reads of forty shard files are all still that worker's)."""
    totals: Counter[tuple[str, int, str]] = Counter()
    for p in parts:
        totals[p.key()] += p.ns
    ranked = sorted(totals.items(), key=lambda kv: -kv[1])
    out: list[BreakdownEntry] = [{"cause": c, "pid": pid, "object": obj, "ns": ns}
                                 for (c, pid, obj), ns in ranked[:MAX_BREAKDOWN]]
    rest: dict[tuple[str, int], list[int]] = {}
    for (c, pid, _obj), ns in ranked[MAX_BREAKDOWN:]:
        acc = rest.setdefault((c, pid), [0, 0])
        acc[0] += ns
        acc[1] += 1
    out += [{"cause": c, "pid": pid, "object": "", "ns": ns, "objects": n}
            for (c, pid), (ns, n) in sorted(rest.items(), key=lambda kv: -kv[1][0])]
    return out


def _from_parts(parts: list[Part], gpu_ev: list[Evidence]) -> Verdict:
    if not parts:
        return _verdict("unknown", empty_culprit(), [], gpu_ev)
    best = _dominant(parts)
    culprit = best.culprit if best.cause != "unknown" else empty_culprit()
    held = _cpu_held_by(parts, best) if best.cause == "cpu.runqueue" else []
    if held:
        culprit = {**culprit, "cpu_held_by": held}
    elif best.cause == "storage":
        culprit = {**culprit, **_dirty_pauses(parts, best)}
    elif best.cause == "cpu.throttled":
        culprit = {**culprit, "throttled_ns": _same_thread_ns(parts, best)}
    out = _verdict(best.cause, culprit, best.via, (best.evidence + gpu_ev)[:24])
    out["breakdown"] = _breakdown(parts)
    if "why" in best.extra and "why" not in out:
        out["why"] = best.extra["why"]
    if "remote_fs" in best.extra:
        out["remote_fs"] = best.extra["remote_fs"]
    if "late_rank" in best.extra:  # a thread's wait in a collective call (gloo's): why the late rank was late
        out["late_rank"] = best.extra["late_rank"]
    if "late_rank_cause" in best.extra:
        out["late_rank_cause"] = best.extra["late_rank_cause"]
    return out
