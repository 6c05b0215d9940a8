"""Per-device GPU timelines and the stalls in them.

A device is busy while any of its streams runs a kernel, copy or set — except while a collective kernel
only waits for a late rank: that wait is stall time (the GPU spins but does no work).
"""

from __future__ import annotations

import re
from bisect import bisect_left
from dataclasses import dataclass, field
from operator import attrgetter, itemgetter
from typing import Any

from gputrace.analysis.devices import DeviceKey
from gputrace.analysis.load import Capture, GpuOp
from gputrace.records import CollectiveCall, GpuKernel

# "broadcast" alone would also match elementwise kernels with broadcasting: not a collective marker
_COLLECTIVE_WORDS = ("nccl", "rccl", "allreduce", "all_reduce", "allgather", "all_gather", "reducescatter",
                     "reduce_scatter", "alltoall", "all_to_all")
_COLLECTIVE_NAME = re.compile("|".join(_COLLECTIVE_WORDS))  # a kernel name (lower case) holding one of them


@dataclass
class CollectiveWait:
    """The part of one rank's collective kernel spent waiting for the last rank to arrive."""

    op: GpuKernel
    name: str
    wait_start: int
    wait_end: int
    late: GpuKernel | None  # the last rank's kernel, when that rank was captured, on its own capture's clock
    late_rank: int = -1
    seq: int = -1  # the collective's sequence number in its communicator, where a Collective record gave it
    late_capture: int = -1  # which of several captures holds ``late`` (-1: this one)
    late_shift_ns: int = 0  # added to a time of the late rank's capture, gives this capture's clock


@dataclass
class Stall:
    device: DeviceKey
    start_ns: int
    end_ns: int
    op: GpuOp | None  # the operation whose start ended the stall
    collective: CollectiveWait | None = None


@dataclass
class DeviceTimeline:
    key: DeviceKey
    first_ns: int
    last_ns: int
    busy_ns: int
    collective_wait_ns: int
    stalls: list[Stall] = field(default_factory=list)


def is_collective(cap: Capture, op: GpuOp) -> bool:
    if not isinstance(op, GpuKernel):
        return False
    if (op.pid, op.correlation_id) in cap.collectives:
        return True
    return _COLLECTIVE_NAME.search(op.name.lower()) is not None


Member = tuple[GpuKernel, int, int]  # kernel, rank (-1 unknown), bytes (-1 unknown)
# One collective instance: (communicator id, collective name, seq). Ranks of a communicator on other hosts
# share its id. Kernels matched by name alone (no Collective record) are keyed by the n-th occurrence in their
# process, with the communicator "" and a negative seq, and never join another capture's.
InstanceKey = tuple[str, str, int]


@dataclass(frozen=True)
class Remote:
    """A rank of a collective instance in another capture: its kernel on that capture's clock, and the shift
    that puts that clock on this capture's."""

    op: GpuKernel
    rank: int
    nbytes: int
    capture: int
    shift_ns: int


def instances(cap: Capture) -> dict[InstanceKey, list[Member]]:
    """The collective kernels of a capture by instance. Ranks are matched by (communicator, name, seq) from
    Collective records, or by (name, n-th occurrence in its process) when only kernel names mark a collective."""
    groups: dict[InstanceKey, list[Member]] = {}
    nth: dict[tuple[int, str], int] = {}
    for ops in cap.ops.values():
        for op in ops:
            if not is_collective(cap, op):
                continue
            assert isinstance(op, GpuKernel)
            meta = cap.collectives.get((op.pid, op.correlation_id))
            if meta is not None:
                groups.setdefault((comm_of(meta), meta.name, meta.seq), []).append((op, meta.rank, meta.nbytes))
            else:
                n = nth.get((op.pid, op.name), 0)
                nth[(op.pid, op.name)] = n + 1
                groups.setdefault(("", op.name, -1 - n), []).append((op, -1, -1))
    return groups


def comm_of(meta: Any) -> str:
    """A Collective record's communicator id; anything but a short string (hostile input) is none."""
    comm = getattr(meta, "comm", "")
    return comm if type(comm) is str and len(comm) <= MAX_COMM_ID else ""


MAX_COMM_ID = 128


def collective_waits(cap: Capture, min_gap_ns: int,
                     remote: dict[InstanceKey, list[Remote]] | None = None) -> dict[int, CollectiveWait]:
    """Waits by id() of the waiting kernel, over this capture's ranks and, for instances ``remote`` names,
    the ranks other captures hold (their kernels shifted onto this capture's clock)."""
    groups = instances(cap)
    remote = remote or {}
    waits: dict[int, CollectiveWait] = {}
    fastest = _fastest_runs({k: v for k, v in groups.items() if k not in remote})
    after_last: dict[tuple[int, str, int], int] | None = None  # made when a partly captured instance needs it
    for key, members in groups.items():
        _comm, name, seq = key
        others = remote.get(key, [])
        if len(members) == 1 and not others:
            _single(waits, name, members[0], fastest, min_gap_ns, seq)
            continue
        # the last to arrive, on this capture's clock: (start, kernel on its own clock, rank, capture, shift)
        arrivals = [(op.start_ns, op, rank, -1, 0) for op, rank, _ in members]
        arrivals += [(r.op.start_ns + r.shift_ns, r.op, r.rank, r.capture, r.shift_ns) for r in others]
        late_start, late, late_rank, where, shift = max(arrivals, key=lambda a: a[0])
        if _world(cap, members) > len(arrivals):  # ranks of it were not captured: one of them may be the last
            after_last = after_last if after_last is not None else _fastest_after_last(groups, remote)
            first = min(a[0] for a in arrivals)
            if _uncaptured_last(waits, name, seq, members, (first, late_start), after_last, min_gap_ns):
                continue
        for op, _rank, _n in members:
            if late_start - op.start_ns >= min_gap_ns and op is not late:
                waits[id(op)] = CollectiveWait(op, name, op.start_ns, min(late_start, op.end_ns), late, late_rank,
                                               seq, where, shift)
    return waits


def _fastest_runs(groups: dict[InstanceKey, list[Member]]) -> dict[tuple[int, str, int], int]:
    """For a rank captured alone, the fastest run of the same collective over the same bytes is the best
    estimate of its transfer time. Without a byte count runs are not comparable, so none is estimated."""
    best: dict[tuple[int, str, int], int] = {}
    for members in groups.values():
        op, _, nbytes = members[0]
        if len(members) == 1 and nbytes >= 0:
            k = (op.pid, op.name, nbytes)
            best[k] = min(best.get(k, op.end_ns - op.start_ns), op.end_ns - op.start_ns)
    return best


def _world(cap: Capture, members: list[Member]) -> int:
    """How many ranks the instance has, by its Collective records (0: unknown)."""
    worlds = [meta.world for op, _, _ in members
              if (meta := cap.collectives.get((op.pid, op.correlation_id))) is not None and type(meta.world) is int]
    return max(worlds, default=0)


def _fastest_after_last(groups: dict[InstanceKey, list[Member]],
                        remote: dict[InstanceKey, list[Remote]]) -> dict[tuple[int, str, int], int]:
    """Per (pid, collective, bytes), the shortest time any of its kernels ran after the last captured rank of its
    instance arrived: the transfer alone, the best estimate of it (as ``_fastest_runs`` is for a rank captured
    alone). A kernel that ended before that arrival (clocks that disagree) says nothing."""
    best: dict[tuple[int, str, int], int] = {}
    for key, members in groups.items():
        last = max([op.start_ns for op, _, _ in members] + [r.op.start_ns + r.shift_ns for r in remote.get(key, [])])
        for op, _, nbytes in members:
            run = op.end_ns - max(op.start_ns, last)
            if nbytes >= 0 and run > 0:
                k = (op.pid, op.name, nbytes)
                best[k] = min(best.get(k, run), run)
    return best


def _uncaptured_last(waits: dict[int, CollectiveWait], name: str, seq: int, members: list[Member],
                     captured: tuple[int, int], after_last: dict[tuple[int, str, int], int], min_gap_ns: int) -> bool:
    """An instance of which some ranks were captured (a host's 2 of a job's 8), its captured ranks' first and
    last arrivals ``captured``: when its kernels here ran on past the last captured arrival beyond their transfer
    (``after_last``) by the minimum gap, and by more than the last captured rank was late, a rank that was not
    captured arrived later still, and the ranks here waited for it more than for any captured one, the last
    captured one too: each waited until its end less its transfer, for a late rank unknown here (as a rank
    captured alone does). Adds those waits and says so; False (nothing added) when the last captured rank was
    the last, its lateness the larger (a completion's own jitter must not hide it), or it cannot be told."""
    first, last = captured
    ends: list[tuple[GpuKernel, int]] = []
    for op, _, nbytes in members:
        transfer = after_last.get((op.pid, op.name, nbytes)) if nbytes >= 0 else None
        if transfer is None:
            return False
        ends.append((op, op.end_ns - transfer))
    if not _arrived_later([end for _, end in ends], first, last, min_gap_ns):
        return False
    for op, end in ends:
        if end - op.start_ns >= min_gap_ns:
            waits[id(op)] = CollectiveWait(op, name, op.start_ns, end, None, seq=seq)
    return True


def _arrived_later(ends: list[int], first: int, last: int, min_gap_ns: int) -> bool:
    """Whether a rank not captured arrived after the captured ones (``first`` and ``last`` of their arrivals)
    by the minimum gap, and by more than the last captured was late: ``ends``, the captured ranks' completions
    less their own transfer, are each a rank's view of the last arrival; most of them are taken."""
    arrived = sorted(ends)[len(ends) // 2]
    return arrived - last >= max(min_gap_ns, last - first + 1)


def _single(waits: dict[int, CollectiveWait], name: str, member: Member, best: dict[tuple[int, str, int], int],
            min_gap_ns: int, seq: int) -> None:
    op, _, nbytes = member
    fastest = best.get((op.pid, op.name, nbytes))
    if fastest is not None and (op.end_ns - op.start_ns) - fastest >= min_gap_ns:
        waits[id(op)] = CollectiveWait(op, name, op.start_ns, op.start_ns + (op.end_ns - op.start_ns) - fastest, None,
                                       seq=seq)


Waits = dict[int, CollectiveWait]
_START, _END, _INDEX = attrgetter("start_ns"), attrgetter("end_ns"), itemgetter(2)


# ------------------------------------------------------------------ collectives called on the host ---


@dataclass(frozen=True)
class RemoteCall:
    """A rank's call of a collective instance in another capture, and the shift onto this capture's clock."""

    call: CollectiveCall
    capture: int
    shift_ns: int


@dataclass
class HostWait:
    """The part of one rank's blocking collective call (gloo's) spent waiting for the last rank to arrive:
    its thread's time in [wait_start, wait_end) is the late rank's doing."""

    call: CollectiveCall
    wait_start: int
    wait_end: int
    late: CollectiveCall  # the last rank's call, on its own capture's clock
    late_capture: int = -1  # which of several captures holds ``late`` (-1: this one)
    late_shift_ns: int = 0  # added to a time of the late rank's capture, gives this capture's clock


def host_instances(cap: Capture) -> dict[InstanceKey, list[CollectiveCall]]:
    """The host-side collective calls of a capture by instance (communicator, name, seq); a call without a
    communicator id names no instance."""
    groups: dict[InstanceKey, list[CollectiveCall]] = {}
    for c in cap.calls:
        comm = comm_of(c)
        if comm:
            groups.setdefault((comm, c.name, c.seq), []).append(c)
    return groups


def host_waits(cap: Capture, min_gap_ns: int,
               remote: dict[InstanceKey, list[RemoteCall]] | None = None) -> dict[int, list[HostWait]]:
    """For each thread, its blocking collective calls' waits for a later rank (this capture's ranks and, for
    instances ``remote`` names, other captures'), by start. The last rank to arrive is the one whose call
    entered last; a rank whose call returned before that (it never waited) has no wait."""
    out: dict[int, list[HostWait]] = {}
    remote = remote or {}
    groups = host_instances(cap)
    after_last: dict[tuple[int, str, int], int] | None = None  # made when a partly captured instance needs it
    for key, calls in groups.items():
        arrivals = [(c.start_ns, c, -1, 0) for c in calls]
        arrivals += [(r.call.start_ns + r.shift_ns, r.call, r.capture, r.shift_ns) for r in remote.get(key, [])]
        if len(arrivals) < 2:
            continue
        if max(c.world for c in calls) > len(arrivals):
            after_last = after_last if after_last is not None else host_after_last(groups, remote)
            if host_uncaptured_last(calls, remote.get(key, []), after_last, min_gap_ns):
                continue  # the ranks here waited for one not captured: their time is explained as a rank alone's
        late_start, late, where, shift = max(arrivals, key=lambda a: a[0])
        for c in calls:
            if c.waited and c is not late and late_start - c.start_ns >= min_gap_ns:
                out.setdefault(c.tid, []).append(HostWait(c, c.start_ns, min(late_start, c.end_ns), late, where, shift))
    for waits in out.values():
        waits.sort(key=lambda w: w.wait_start)
    return out


def host_after_last(groups: dict[InstanceKey, list[CollectiveCall]],
                    remote: dict[InstanceKey, list[RemoteCall]]) -> dict[tuple[int, str, int], int]:
    """Per (pid, collective, bytes), the shortest time a blocking call (gloo's) took to return after the last
    captured rank of its instance called: the transfer alone (``_fastest_after_last``, for calls)."""
    best: dict[tuple[int, str, int], int] = {}
    for key, calls in groups.items():
        last = max([c.start_ns for c in calls] + [r.call.start_ns + r.shift_ns for r in remote.get(key, [])])
        for c in calls:
            run = c.end_ns - max(c.start_ns, last)
            if c.waited and c.nbytes >= 0 and run > 0:
                k = (c.pid, c.name, c.nbytes)
                best[k] = min(best.get(k, run), run)
    return best


def host_uncaptured_last(calls: list[CollectiveCall], others: list[RemoteCall],
                         after_last: dict[tuple[int, str, int], int], min_gap_ns: int) -> bool:
    """Whether a rank not captured called an instance last, after every captured rank (``_uncaptured_last``, for
    blocking calls): False when all its ranks were captured, or a call here did not wait for the completion."""
    starts = [c.start_ns for c in calls] + [r.call.start_ns + r.shift_ns for r in others]
    if max(c.world for c in calls) <= len(starts):
        return False
    ends = []
    for c in calls:
        transfer = after_last.get((c.pid, c.name, c.nbytes)) if c.waited and c.nbytes >= 0 else None
        if transfer is None:
            return False
        ends.append(c.end_ns - transfer)
    return _arrived_later(ends, min(starts), max(starts), min_gap_ns)


def build(cap: Capture, min_gap_ns: int,
          remote: dict[InstanceKey, list[Remote]] | None = None) -> tuple[list[DeviceTimeline], Waits]:
    """The device timelines, and the collective waits found on the way (by id() of the waiting kernel)."""
    waits = collective_waits(cap, min_gap_ns, remote)
    return [_device(key, ops, waits, min_gap_ns) for key, ops in sorted(cap.ops.items()) if ops], waits


@dataclass
class Sweep:
    """One device's timeline swept in time order, a window at a time (analysis/windowed.py): what the
    sweep has seen so far, and the busy interval it is in."""

    key: DeviceKey
    first_ns: int = 0
    last_ns: int = 0
    busy_ns: int = 0
    cur_start: int | None = None
    cur_end: int = 0
    stalls: int = 0
    stall_ns: int = 0

    def window(self, ops: list[GpuOp], a: int, b: int, waits: Waits, min_gap_ns: int) -> list[Stall]:
        """Go on over the ops (sorted by start) whose busy time starts in [a, b): the stalls they end, as
        ``_device`` finds them over the whole timeline."""
        if waits:
            busy = sorted((s, op.end_ns, i) for i, op in enumerate(ops) if a <= (s := _busy_start(op, waits)) < b)
        else:  # each op busy from its start: in the order of the ops, sorted by (start, end)
            starts = list(map(_START, ops))
            lo, hi = bisect_left(starts, a), bisect_left(starts, b)
            busy = list(zip(starts[lo:hi], map(_END, ops[lo:hi]), range(lo, hi), strict=True))
        found: list[Stall] = []
        if not busy:
            return found
        seen = list(map(ops.__getitem__, map(_INDEX, busy)))
        first_ns, last_ns = min(map(_START, seen)), max(map(_END, seen))
        if self.cur_start is None:  # the device's first op
            self.first_ns, self.last_ns = first_ns, last_ns
            self.cur_start, self.cur_end = busy[0][0], busy[0][1]
            busy = busy[1:]
        else:
            self.first_ns, self.last_ns = min(self.first_ns, first_ns), max(self.last_ns, last_ns)
        cur_start, cur_end, busy_ns = self.cur_start, self.cur_end, self.busy_ns
        for start, end, i in busy:
            if start > cur_end:
                busy_ns += cur_end - cur_start
                if start - cur_end >= min_gap_ns:
                    found.extend(_gap(self.key, cur_end, start, ops[i], waits, min_gap_ns))
                cur_start, cur_end = start, end
            elif end > cur_end:
                cur_end = end
        self.cur_start, self.cur_end, self.busy_ns = cur_start, cur_end, busy_ns
        self.stalls += len(found)
        self.stall_ns += sum(s.end_ns - s.start_ns for s in found)
        return found

    def timeline(self, collective_wait_ns: int) -> DeviceTimeline:
        """The whole timeline swept (its stalls are counted here, not listed)."""
        busy = self.busy_ns + (self.cur_end - self.cur_start if self.cur_start is not None else 0)
        return DeviceTimeline(self.key, self.first_ns, self.last_ns, busy, collective_wait_ns)


def _device(key: DeviceKey, ops: list[GpuOp], waits: dict[int, CollectiveWait], min_gap_ns: int) -> DeviceTimeline:
    busy = sorted((_busy_start(op, waits), op.end_ns, i) for i, op in enumerate(ops))
    first = min(op.start_ns for op in ops)
    last = max(op.end_ns for op in ops)
    tl = DeviceTimeline(key, first, last, 0, sum(w.wait_end - w.wait_start for w in _waits_of(ops, waits)))
    cur_start, cur_end = busy[0][0], busy[0][1]
    for start, end, i in busy[1:]:
        if start > cur_end:
            tl.busy_ns += cur_end - cur_start
            if start - cur_end >= min_gap_ns:
                tl.stalls.extend(_gap(key, cur_end, start, ops[i], waits, min_gap_ns))
            cur_start, cur_end = start, end
        else:
            cur_end = max(cur_end, end)
    tl.busy_ns += cur_end - cur_start
    return tl


def _waits_of(ops: list[GpuOp], waits: dict[int, CollectiveWait]) -> list[CollectiveWait]:
    return [waits[id(op)] for op in ops if id(op) in waits]


def _busy_start(op: GpuOp, waits: dict[int, CollectiveWait]) -> int:
    w = waits.get(id(op))
    return w.wait_end if w is not None else op.start_ns


def _gap(key: DeviceKey, g0: int, g1: int, op: GpuOp, waits: dict[int, CollectiveWait],
         min_gap_ns: int) -> list[Stall]:
    """The stall [g0, g1) ended by ``op``, split where a collective kernel started waiting inside it."""
    w = waits.get(id(op))
    if w is None:
        return [Stall(key, g0, g1, op)]  # busy is sorted by (start, end): ops[i] is the first to start
    stalls = []
    if w.wait_start - g0 >= min_gap_ns:
        stalls.append(Stall(key, g0, w.wait_start, op))
    stalls.append(Stall(key, max(g0, w.wait_start), g1, op, w))
    return stalls


def loss_windows(cap: Capture) -> list[tuple[int, int]]:
    """Intervals in which some source lost records, from its cumulative Drops counters."""
    windows: list[tuple[int, int]] = []
    last: dict[tuple[str, str], tuple[int, int]] = {}
    for d in sorted(cap.drops, key=lambda d: d.ts):
        k = (d.source, d.what)
        prev_ts, prev_count = last.get(k, (cap.first_ns, 0))
        if d.count > prev_count:
            windows.append((prev_ts, d.ts))
        last[k] = (d.ts, max(d.count, prev_count))
    return windows


def untimed_losses(cap: Capture) -> bool:
    """Losses the trailer reports that no timed Drops record accounts for: they could be anywhere."""
    timed: dict[str, int] = {}
    for d in cap.drops:
        timed[f"{d.source}.{d.what}"] = max(timed.get(f"{d.source}.{d.what}", 0), d.count)
    for name, count in _trailer_drops(cap).items():
        if count > timed.get(name, 0) and not any(k.startswith(name + ".") for k in timed):
            return True
    return False


def _trailer_drops(cap: Capture) -> dict[str, int]:
    raw: Any = cap.trailer.get("drops", {})
    out: dict[str, int] = {}
    if isinstance(raw, dict):
        for k, v in raw.items():
            if isinstance(v, int) and v > 0:
                out[str(k)] = v
            elif isinstance(v, dict):
                out.update({f"{k}.{kk}": vv for kk, vv in v.items() if isinstance(vv, int) and vv > 0})
    return out
