"""CPU quota throttling: which waits for a CPU were a cpu cgroup's quota running out (cause ``cpu.throttled``).

A thread whose cgroup used up its CFS quota for the period (v1 ``cpu.cfs_quota_us``, v2 ``cpu.max``; a
container's CPU limit) is taken off its CPU while still runnable, and put back when the next period refills
the quota: the scheduler shows a preemption (an ``R`` off-CPU span, or a wakeup followed by a long wait for a
CPU), and the CPU it left may sit idle. Only the cgroup's counters (``CpuThrottle`` records, probes/cgroups.py)
say it was throttled. The kernel adds a throttle's length to the group's throttled time when it lets the group
run again, so a sample that shows throttled time ``D`` more than the previous one (taken at ``prev_ts``) says
throttles of ``D`` in all ended in (prev_ts, ts].

Such a throttle ended a runnable wait of a thread of the group: the wait ends (the thread is back on a CPU) at
or after the throttle's end, and began before it. Per window and per thread, the longest such wait that
overlaps [prev_ts - D, ts] (where a throttle of at most ``D`` ending in the window can lie) is taken as that
thread's throttle, for at most ``D``: every runnable thread of a throttled group is held, and threads that
share a CPU's run queue share one throttle, which the group counts once (a throttle on each CPU the group ran
on adds its own time, so ``D`` bounds each thread's share, not their sum). The throttled part of a wait
is taken from its start: the thread left the CPU when throttled (or was woken into a throttled group), and
what is left after ``D`` is time it waited for a CPU once let run again (``cpu.runqueue``). A window whose
group was throttled in ``n`` periods (the sampler ran late: a busy host) holds up to ``n`` waits of each
thread. The process's cgroup is the one last recorded for it when the wait began, or, for a wait before its
first record, that record where it came before the wait ended (a process is recorded in its group only once
the sampler has seen it there); a process never recorded in the cgroup, a cgroup whose files could not be
read, or a window without a sample before it, leave the waits run-queue waits.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field
from typing import Any

from gputrace.documents import CgroupError, CgroupFields, CpuCgroup, Evidence, ThrottleFields
from gputrace.records import CpuThrottle, OffCpu

# The kernel adds a throttle's time to the group's counters a moment after the group may run again (the
# unthrottle completes on another CPU): a sample read just after the thread was back on its CPU can still
# miss it (seen: 40 us), so a wait that ended this much before a window's start may have been its throttle
UPDATE_SLACK_NS = 1_000_000
Wait = tuple[OffCpu, int, int]  # an off-CPU span and the window [a, b) of it that was a wait for a CPU


@dataclass(frozen=True)
class Window:
    """A change of a cgroup's counters between two samples: throttles that ended in (start_ns, end_ns]."""

    path: str
    version: int
    start_ns: int
    end_ns: int
    quota_us: int
    period_us: int
    throttled_ns: int
    nr_throttled: int


@dataclass
class Throttled:
    """A runnable wait of a thread, ``ns`` of it from its start taken as its cgroup's throttle."""

    start_ns: int
    end_ns: int
    ns: int
    window: Window


@dataclass
class Split:
    """Run-queue waits, split: the time throttled, its culprit fields and evidence, and what is left to
    explain as a wait for a CPU (the windows of the waits past their throttled part)."""

    ns: int = 0
    fields: ThrottleFields = field(default_factory=lambda: ThrottleFields())
    evidence: list[Evidence] = field(default_factory=list)
    rest: list[Wait] = field(default_factory=list)


def wait_start(o: OffCpu) -> int:
    """When ``o`` became a wait for a CPU: a preempted thread at once, a woken one at its wakeup."""
    return o.start_ns if o.state == "R" else o.wake_ns


class Throttles:
    """The capture's cpu cgroups, their throttling windows, and the waits those windows explain."""

    def __init__(self, cap: Any) -> None:
        self.cap = cap
        self._spans: dict[int, dict[int, Throttled]] | None = None  # tid -> wait start -> its throttle
        self._samples: dict[str, list[CpuThrottle]] | None = None  # readable samples by cgroup, by time

    def spans(self) -> dict[int, dict[int, Throttled]]:
        if self._spans is None:
            self._spans = {}
            members = _members(self.cap)
            threads: dict[int, list[int]] = {}
            for tid, pid in self.cap.tgid.items():
                if pid in members:
                    threads.setdefault(pid, []).append(tid)
            for w in windows(self.cap.cpu_throttles):
                self._assign(w, members, threads, self._spans)
        return self._spans

    def _assign(self, w: Window, members: dict[int, list[tuple[int, str]]], threads: dict[int, list[int]],
                spans_by_tid: dict[int, dict[int, Throttled]]) -> None:
        """Give the longest runnable wait of each thread of the group up to the window's throttled time."""
        lo, hi = w.start_ns - w.throttled_ns, w.end_ns
        best: list[list[tuple[int, int, OffCpu]]] = []  # per thread: the waits taken, by start
        for pid, rows in members.items():
            for tid in threads.get(pid, ()):
                index = self.cap.offcpu.get(tid)
                # in the group when it began waiting (an exiting process leaves its group while it waits to be
                # reaped, after the throttle that held it)
                waits = [(o.end_ns - wait_start(o), tid, o) for o in (index.overlapping(lo, hi) if index else ())
                         if runnable_wait(o) and o.end_ns > w.start_ns - UPDATE_SLACK_NS
                         and _inside(cgroup_of(rows, wait_start(o), o.end_ns), w.path)]
                # waits the window's throttles ended end in the window; ones ending later, only if too few do
                waits.sort(key=lambda x: (x[2].end_ns <= hi, x[0]), reverse=True)
                best.append(sorted(waits[: max(w.nr_throttled, 1)], key=lambda x: wait_start(x[2])))
        for chosen in best:
            left = w.throttled_ns  # each thread's share of the window's throttled time
            for length, tid, o in chosen:
                spans = spans_by_tid.setdefault(tid, {})
                start = wait_start(o)
                t = spans.get(start)
                ns = min(length - (t.ns if t else 0), left)
                if ns > 0:
                    spans[start] = Throttled(start, o.end_ns, (t.ns if t else 0) + ns, w)
                    left -= ns

    def split(self, tid: int, waits: list[Wait]) -> Split:
        """How much of the waits [(o, a, b)] of ``tid`` for a CPU was its cgroup's throttle."""
        out = Split()
        spans = self.spans().get(tid, {})
        last: Throttled | None = None
        for o, a, b in waits:
            t = spans.get(wait_start(o)) if runnable_wait(o) else None
            if t is None:
                out.rest.append((o, a, b))
                continue
            cut = t.start_ns + t.ns  # the throttled part is the wait's first t.ns
            ns = max(min(b, cut) - a, 0)
            out.ns += ns
            if ns:
                last = t
                out.evidence.append(_evidence(o, t))
            if b > max(a, cut):
                out.rest.append((o, max(a, cut), b))
        if last is not None:
            out.fields = culprit_fields(last.window, out.ns)
        return out

    def counters(self, path: str, a: int, b: int) -> CgroupFields:
        """The cgroup's counters' increase over the samples that bound [a, b)."""
        if self._samples is None:
            self._samples = {}
            for r in self.cap.cpu_throttles:
                if not r.error:
                    self._samples.setdefault(r.path, []).append(r)
            for rows in self._samples.values():
                rows.sort(key=lambda r: r.ts)
        return counters(self._samples.get(path, []), a, b)


def runnable_wait(o: OffCpu) -> bool:
    """An off-CPU span that was (or became) a wait for a CPU: preempted, or woken and then kept off a CPU."""
    return o.state == "R" or 0 < o.wake_ns < o.end_ns


def culprit_fields(w: Window, ns: int) -> ThrottleFields:
    return {"object": w.path, "cgroup_version": w.version, "quota_us": w.quota_us, "period_us": w.period_us,
            "throttled_ns": ns}


def _evidence(o: OffCpu, t: Throttled) -> Evidence:
    w = t.window
    what = (f"runnable, throttled: cgroup {w.path} over its CPU quota ({quota_text(w.quota_us, w.period_us)}), "
            f"{w.throttled_ns / 1e6:.1f} ms throttled in ({w.start_ns}, {w.end_ns}]")
    return {"pid": o.pid, "tid": o.tid, "kind": "offcpu", "what": what, "start_ns": o.start_ns, "end_ns": o.end_ns}


def quota_text(quota_us: int, period_us: int) -> str:
    """'20 ms per 100 ms' (a quota of 0.2 CPU)."""
    if quota_us < 0:
        return "no quota"
    return f"{quota_us / 1000:g} ms per {period_us / 1000:g} ms"


def windows(samples: list[CpuThrottle]) -> list[Window]:
    """Each cgroup's counter changes with throttled time in them, from consecutive readable samples: the later
    one's ``prev_ts`` is when the counters still read as the earlier one's."""
    by_path: dict[str, list[CpuThrottle]] = {}
    for r in samples:
        by_path.setdefault(r.path, []).append(r)
    out = []
    for rows in by_path.values():
        rows.sort(key=lambda r: r.ts)
        for prev, r in zip(rows, rows[1:], strict=False):
            if prev.error or r.error or r.version != prev.version or r.prev_ts < prev.ts:
                continue
            d = r.throttled_ns - prev.throttled_ns
            if d > 0 and r.quota_us >= 0:
                out.append(Window(r.path, r.version, r.prev_ts, r.ts, r.quota_us, r.period_us, d,
                                  r.nr_throttled - prev.nr_throttled))
    return out


def counters(rows: list[CpuThrottle], a: int, b: int) -> CgroupFields:
    """The increase of one cgroup's counters over [a, b), from its readable samples ``rows`` (by time).
    Samples are recorded only when the counters changed: the values at a time are the last record's before
    it, unless the next record says the change may have come sooner (its ``prev_ts`` before that time), when
    that record's are taken for ``b``. With no record at or before ``a`` (the cgroup was first read after the
    window began: a process that joined it then), from its first record before ``b``, whose time is
    ``cgroup_counted_from_ns`` (the throttles the analysis names come from the records too, so none is left
    out); {} when there is none."""
    ts = [r.ts for r in rows]
    i, j = bisect_right(ts, a) - 1, bisect_right(ts, b) - 1
    since: CgroupFields = {}
    if i < 0:
        if not rows or rows[0].ts >= b:
            return {}
        i, since = 0, {"cgroup_counted_from_ns": rows[0].ts}
    if j + 1 < len(rows) and rows[j + 1].prev_ts < b:
        j += 1
    first, end = rows[i], rows[j]
    return {"cgroup_periods": end.nr_periods - first.nr_periods,
            "cgroup_throttled_periods": end.nr_throttled - first.nr_throttled,
            "cgroup_throttled_ns": end.throttled_ns - first.throttled_ns, **since}


def _members(cap: Any) -> dict[int, list[tuple[int, str]]]:
    """pid -> [(ts, cgroup path)] as recorded, by time; a record that could not be read places it nowhere."""
    out: dict[int, list[tuple[int, str]]] = {}
    for r in cap.cpu_cgroups:
        out.setdefault(r.pid, []).append((r.ts, "" if r.error else r.path))
    for rows in out.values():
        rows.sort()
    return out


def cgroup_at(rows: list[tuple[int, str]], t: int) -> str:
    """The cgroup last recorded at or before ``t``; "" when none was."""
    i = bisect_right(rows, (t, "\U0010ffff")) - 1
    return rows[i][1] if i >= 0 else ""


def cgroup_of(rows: list[tuple[int, str]], start: int, end: int) -> str:
    """The cgroup of a process for a wait over [start, end): the one recorded when it began, or, before the
    process's first record, that record's where it was made before the wait ended; "" when neither."""
    at = cgroup_at(rows, start)
    if at or not rows or (rows[0][0] <= start):
        return at
    return rows[0][1] if rows[0][0] <= end else ""


def _inside(path: str, group: str) -> bool:
    """Whether ``path`` is the cgroup ``group`` or below it (a pod's quota throttles its containers)."""
    if not path:
        return False
    return path == group or group == "/" or path.startswith(group.rstrip("/") + "/")


def errors(cap: Any) -> list[CgroupError]:
    """The cgroups (and processes' memberships) whose files could not be read, each once: their run-queue
    waits could not be checked for throttling."""
    seen: dict[tuple[str, str], CgroupError] = {}
    for r in cap.cpu_throttles:
        if r.error:
            seen.setdefault((r.path, r.error), {"path": r.path, "error": r.error})
    for m in cap.cpu_cgroups:
        if m.error:
            seen.setdefault((f"pid {m.pid}", m.error), {"path": f"/proc/{m.pid}/cgroup", "error": m.error})
    return list(seen.values())[:20]


def limited(cap: Any) -> list[CpuCgroup]:
    """The cgroups with a quota that the capture sampled: path, version, quota, period and their counters'
    increase over the capture (for the report's capture section)."""
    by_path: dict[str, list[CpuThrottle]] = {}
    for r in cap.cpu_throttles:
        if not r.error:
            by_path.setdefault(r.path, []).append(r)
    out: list[CpuCgroup] = []
    for path, rows in sorted(by_path.items()):
        rows.sort(key=lambda r: r.ts)
        first, last = rows[0], rows[-1]
        if last.quota_us < 0:
            continue
        out.append({"path": path, "version": last.version, "quota_us": last.quota_us, "period_us": last.period_us,
                    "periods": last.nr_periods - first.nr_periods,
                    "throttled_periods": last.nr_throttled - first.nr_throttled,
                    "throttled_ns": last.throttled_ns - first.throttled_ns})
    return out
