"""Validates a Perfetto trace with the official protos, and gives tests a parsed view to assert on.

Checks: every track an event uses was described before; slices per track are balanced and, replayed in
time order the way Perfetto does (ties in file order), close exactly the slices they opened (no partial
overlaps); every flow id has at least two ends; timestamps are on CLOCK_MONOTONIC (3) and a clock
snapshot exists. CPU samples (PerfSample): every callstack, frame, function name, mapping and path id they
use was interned earlier in the same sequence (or in the same packet), after that sequence cleared its
incremental state; callstacks are not empty; the sample's thread (or at least its process) was described
before it; its timestamp is set and plausible.

    python -m gputrace.testing.perfetto_check TRACE.pftrace [--tree]
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gputrace.errors import UserError

from .perfetto_check_samples import (
    SEQ_INCREMENTAL_STATE_CLEARED,
    Interned,
    Sample,
    check_interned_data,
    check_perf_sample,
)

MONOTONIC = 3
BEGIN, END, INSTANT, COUNTER = 1, 2, 3, 4
MAX_PER_KIND = 20


@dataclass
class Track:
    uuid: int
    name: str
    parent: int | None  # a thread's parent is its process track, when there is one
    kind: str  # process, thread, counter, track
    pid: int | None = None
    tid: int | None = None
    description: str = ""


@dataclass
class Slice:
    track: int
    name: str
    ts: int
    dur: int
    depth: int = 0
    args: dict[str, Any] = field(default_factory=dict)
    categories: list[str] = field(default_factory=list)
    flow_ids: list[int] = field(default_factory=list)
    index: int = 0  # packet index of its begin
    instant: bool = False

    @property
    def end(self) -> int:
        return self.ts + self.dur


@dataclass
class _Event:
    index: int
    ts: int
    type: int
    track: int
    name: str
    args: dict[str, Any]
    categories: list[str]
    flows: list[int]


class TraceCheck:
    """The result of checking one trace: ``problems`` (empty when valid) and a queryable view."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.problems: list[str] = []
        self.tracks: dict[int, Track] = {}
        self.slices: dict[int, list[Slice]] = {}
        self.flows: list[tuple[Slice, Slice]] = []
        self.counters: dict[int, list[tuple[int, float]]] = {}
        self.clocks: dict[int, int] = {}
        self.samples: list[Sample] = []
        self.pids: set[int] = set()  # and of their processes
        self.packets = 0
        self._counts: dict[str, int] = {}

    @property
    def ok(self) -> bool:
        return not self.problems

    def problem(self, kind: str, text: str) -> None:
        n = self._counts[kind] = self._counts.get(kind, 0) + 1
        if n <= MAX_PER_KIND:
            self.problems.append(text)
        elif n == MAX_PER_KIND + 1:
            self.problems.append(f"... more problems of kind {kind!r} not shown")

    # -- queries for tests ----------------------------------------------------------------------------

    def tracks_named(self, name: str, parent: str | None = None) -> list[Track]:
        return [t for t in self.tracks.values()
                if t.name == name and (parent is None or self.parent_name(t) == parent)]

    def track(self, name: str, parent: str | None = None) -> Track:
        """The one track called ``name`` (under a parent called ``parent``, when given)."""
        found = self.tracks_named(name, parent)
        if len(found) != 1:
            raise LookupError(f"{len(found)} tracks named {name!r}"
                              + (f" under {parent!r}" if parent else "") + f"; tracks: {self.track_names()}")
        return found[0]

    def track_names(self) -> list[str]:
        return sorted({t.name for t in self.tracks.values()})

    def parent_name(self, t: Track) -> str | None:
        return self.tracks[t.parent].name if t.parent in self.tracks else None

    def children(self, t: Track) -> list[Track]:
        return sorted((c for c in self.tracks.values() if c.parent == t.uuid), key=lambda c: c.uuid)

    def thread(self, tid: int) -> Track:
        found = [t for t in self.tracks.values() if t.kind == "thread" and t.tid == tid]
        if len(found) != 1:
            raise LookupError(f"{len(found)} thread tracks for tid {tid}")
        return found[0]

    def process(self, pid: int) -> Track:
        found = [t for t in self.tracks.values() if t.kind == "process" and t.pid == pid]
        if len(found) != 1:
            raise LookupError(f"{len(found)} process tracks for pid {pid}")
        return found[0]

    def slices_on(self, t: Track | str, *, deep: bool = False) -> list[Slice]:
        """Slices on a track (by object or unique name), in time order; ``deep`` adds its descendants'."""
        track = self.track(t) if isinstance(t, str) else t
        out = list(self.slices.get(track.uuid, []))
        if deep:
            for c in self.children(track):
                out += self.slices_on(c, deep=True)
            out.sort(key=lambda s: (s.ts, s.index))
        return out

    def all_slices(self) -> Iterator[Slice]:
        for slices in self.slices.values():
            yield from slices

    def find(self, name: str) -> list[Slice]:
        return sorted((s for s in self.all_slices() if s.name == name), key=lambda s: (s.ts, s.index))

    def track_of(self, s: Slice) -> Track:
        return self.tracks[s.track]

    def flows_into(self, t: Track) -> list[tuple[Slice, Slice]]:
        return [f for f in self.flows if f[1].track == t.uuid]

    def flows_from(self, t: Track) -> list[tuple[Slice, Slice]]:
        return [f for f in self.flows if f[0].track == t.uuid]

    def shown(self) -> dict[str, Any]:
        """What the trace shows, whatever its uuids, arrow ids and packet order (two traces of one capture drawn
        differently compare equal): each track by its kind, name, ids, description and parent's; each slice and
        instant by its track, times, name, arguments, categories and how many arrows it has (a slice's depth too;
        an instant's follows the order of packets at one time); each arrow by its ends; the counters' values; the
        CPU samples in order."""
        tracks: dict[int, tuple[Any, ...]] = {}

        def track(uuid: int) -> tuple[Any, ...]:
            if uuid not in tracks:
                t = self.tracks[uuid]
                tracks[uuid] = (t.kind, t.name, t.pid, t.tid, t.description,
                                track(t.parent) if t.parent in self.tracks else None)
            return tracks[uuid]

        def drawn(s: Slice) -> tuple[Any, ...]:
            return (track(s.track), s.name, s.ts, s.dur, None if s.instant else s.depth,
                    repr(sorted((k, repr(v)) for k, v in s.args.items())), tuple(s.categories), len(s.flow_ids))

        return {"tracks": Counter(map(track, self.tracks)), "slices": Counter(map(drawn, self.all_slices())),
                "arrows": Counter((drawn(a), drawn(b)) for a, b in self.flows),
                "counters": Counter((track(u), ts, v) for u, values in self.counters.items() for ts, v in values),
                "samples": [(s.ts, s.pid, s.tid, tuple(s.frames), s.cpu) for s in self.samples]}

    def tree(self) -> str:
        """The track hierarchy as indented text (children in uuid order), for golden comparisons."""
        lines: list[str] = []

        def walk(t: Track, depth: int) -> None:
            lines.append("  " * depth + f"{t.kind} {t.name}")
            for c in self.children(t):
                walk(c, depth + 1)

        for root in sorted((t for t in self.tracks.values() if t.parent is None), key=lambda t: t.uuid):
            walk(root, 0)
        return "\n".join(lines)


def check_trace(path: str | Path) -> TraceCheck:
    """Parse ``path`` with the official Perfetto protos and check it; see the module docstring."""
    from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as e:
        raise UserError(f"cannot read {p}: {e.strerror}") from None
    trace = pb.Trace()
    try:
        trace.ParseFromString(data)
    except Exception as e:  # the protobuf runtime raises its own DecodeError types
        raise UserError(f"{p} is not a Perfetto trace ({type(e).__name__})") from None
    check = TraceCheck(p)
    events = _read_packets(check, trace)
    _link_threads(check)
    _replay(check, events)
    return check


def _read_packets(check: TraceCheck, trace: Any) -> list[_Event]:
    events: list[_Event] = []
    defaults: dict[int, int] = {}
    interned: dict[int, Interned] = {}
    for index, pkt in enumerate(trace.packet):
        check.packets += 1
        seq = pkt.trusted_packet_sequence_id
        if pkt.sequence_flags & SEQ_INCREMENTAL_STATE_CLEARED or pkt.incremental_state_cleared:
            interned[seq] = Interned()
        if pkt.HasField("interned_data"):
            check_interned_data(check, index, interned.get(seq), pkt.interned_data)
        if pkt.HasField("perf_sample"):
            check_perf_sample(check, index, interned.get(seq), pkt)
        if pkt.HasField("trace_packet_defaults") and pkt.trace_packet_defaults.HasField("timestamp_clock_id"):
            defaults[seq] = pkt.trace_packet_defaults.timestamp_clock_id
        if pkt.HasField("clock_snapshot"):
            check.clocks.update({c.clock_id: c.timestamp for c in pkt.clock_snapshot.clocks})
        elif pkt.HasField("timestamp"):
            clock = pkt.timestamp_clock_id if pkt.HasField("timestamp_clock_id") else defaults.get(seq, 6)
            if clock != MONOTONIC:
                check.problem("clock", f"packet {index}: timestamp on clock {clock}, not CLOCK_MONOTONIC (3)")
        if pkt.HasField("track_descriptor"):
            _descriptor(check, index, pkt.track_descriptor)
        if pkt.HasField("track_event"):
            ev = _event(check, index, pkt)
            if ev is not None:
                events.append(ev)
    if MONOTONIC not in check.clocks:
        check.problem("clock", "no clock snapshot with CLOCK_MONOTONIC: the trace cannot be placed in time")
    return events


def _descriptor(check: TraceCheck, index: int, td: Any) -> None:
    kind = "thread" if td.HasField("thread") else "process" if td.HasField("process") else \
        "counter" if td.HasField("counter") else "track"
    parent = td.parent_uuid if td.HasField("parent_uuid") else None
    if parent is not None and parent not in check.tracks:
        check.problem("order", f"packet {index}: track {td.uuid} has parent {parent} not described before it")
    name = td.thread.thread_name if kind == "thread" else td.process.process_name if kind == "process" else td.name
    pid = td.thread.pid if kind == "thread" else td.process.pid if kind == "process" else None
    tid = td.thread.tid if kind == "thread" else None
    if pid is not None:
        check.pids.add(pid)
    old = check.tracks.get(td.uuid)
    if old is not None and (old.kind != kind or (parent is not None and old.parent != parent)
                            or old.pid != pid or old.tid != tid):
        check.problem("descriptor", f"packet {index}: track {td.uuid} re-described as a different track")
    check.tracks[td.uuid] = Track(td.uuid, name or (td.name if td.name else ""), parent, kind, pid, tid,
                                  td.description)


def _event(check: TraceCheck, index: int, pkt: Any) -> _Event | None:
    te = pkt.track_event
    if te.track_uuid not in check.tracks:
        check.problem("order", f"packet {index}: event on track {te.track_uuid} before (or without) its descriptor")
        return None
    if te.HasField("name_iid"):
        check.problem("interned", f"packet {index}: interned names are not supported by this checker")
    if not pkt.HasField("timestamp"):
        check.problem("clock", f"packet {index}: track event without a timestamp")
    if te.type == COUNTER:
        value = te.double_counter_value if te.HasField("double_counter_value") else float(te.counter_value)
        if check.tracks[te.track_uuid].kind != "counter":
            check.problem("counter", f"packet {index}: counter value on non-counter track {te.track_uuid}")
        check.counters.setdefault(te.track_uuid, []).append((pkt.timestamp, value))
        return None
    if te.type not in (BEGIN, END, INSTANT):
        check.problem("type", f"packet {index}: track event of unsupported type {te.type}")
        return None
    args = {a.name: _annotation_value(a) for a in te.debug_annotations}
    flows = list(te.flow_ids) + list(te.terminating_flow_ids)
    return _Event(index, pkt.timestamp, te.type, te.track_uuid, te.name, args, list(te.categories), flows)


def _annotation_value(a: Any) -> Any:
    which = a.WhichOneof("value")
    return getattr(a, which) if which else None


def _link_threads(check: TraceCheck) -> None:
    """Thread tracks hang under their process track, as the Perfetto UI shows them."""
    procs = {t.pid: t.uuid for t in check.tracks.values() if t.kind == "process"}
    for t in check.tracks.values():
        if t.kind == "thread" and t.parent is None and t.pid in procs:
            t.parent = procs[t.pid]


def _replay(check: TraceCheck, events: list[_Event]) -> None:
    by_track: dict[int, list[_Event]] = {}
    for ev in events:
        by_track.setdefault(ev.track, []).append(ev)
    ends: dict[int, list[tuple[int, int, Slice]]] = {}
    for track, evs in by_track.items():
        slices = _track_slices(check, track, evs)
        slices.sort(key=lambda s: (s.ts, s.index))
        check.slices[track] = slices
    for slices in check.slices.values():
        for s in slices:
            for f in s.flow_ids:
                ends.setdefault(f, []).append((s.ts, s.index, s))
    for fid, uses in sorted(ends.items()):
        if len(uses) < 2:
            check.problem("flow", f"flow {fid} has one end only (slice {uses[0][2].name!r} at {uses[0][0]})")
            continue
        uses.sort(key=lambda u: (u[0], u[1]))
        check.flows += [(a[2], b[2]) for a, b in zip(uses, uses[1:], strict=False)]


def _track_slices(check: TraceCheck, track: int, evs: list[_Event]) -> list[Slice]:
    """Pairs begins and ends in file order (what the writer meant), then checks the time-order replay agrees."""
    name = check.tracks[track].name
    pair: dict[int, int] = {}  # end index -> begin index
    stack: list[_Event] = []
    out: dict[int, Slice] = {}
    for ev in evs:
        if ev.type == BEGIN:
            stack.append(ev)
        elif ev.type == END:
            if not stack:
                check.problem("balance", f"track {name!r}: slice end at {ev.ts} with no open slice")
                continue
            b = stack.pop()
            pair[ev.index] = b.index
            if ev.ts < b.ts:
                check.problem("balance", f"track {name!r}: slice {b.name!r} ends ({ev.ts}) before it begins ({b.ts})")
            out[b.index] = Slice(track, b.name, b.ts, ev.ts - b.ts, 0, b.args, b.categories, b.flows, b.index)
        else:
            out[ev.index] = Slice(track, ev.name, ev.ts, 0, 0, ev.args, ev.categories, ev.flows, ev.index, True)
    for b in stack:
        check.problem("balance", f"track {name!r}: slice {b.name!r} at {b.ts} never ends")
        out[b.index] = Slice(track, b.name, b.ts, 0, 0, b.args, b.categories, b.flows, b.index)
    _time_replay(check, name, evs, pair, out)
    return list(out.values())


def _time_replay(check: TraceCheck, name: str, evs: list[_Event], pair: dict[int, int],
                 out: dict[int, Slice]) -> None:
    stack: list[_Event] = []
    for ev in sorted(evs, key=lambda e: (e.ts, e.index)):
        if ev.type == BEGIN:
            if ev.index in out:
                out[ev.index].depth = len(stack)
            stack.append(ev)
        elif ev.type == INSTANT:
            out[ev.index].depth = len(stack)
        elif stack and ev.index in pair:
            top = stack.pop()
            if top.index != pair[ev.index]:
                meant = out[pair[ev.index]]
                check.problem("nesting", f"track {name!r}: slice {meant.name!r} [{meant.ts}, {meant.end}] "
                                         f"overlaps {top.name!r} (from {top.ts}) without nesting")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m gputrace.testing.perfetto_check",
                                 description="Check a Perfetto trace written by gputrace.")
    ap.add_argument("trace", help="the .pftrace file")
    ap.add_argument("--tree", action="store_true", help="also print the track tree")
    args = ap.parse_args(argv)
    try:
        check = check_trace(args.trace)
    except UserError as e:
        print(f"perfetto_check: error: {e}", file=sys.stderr)
        return 2
    if args.tree:
        print(check.tree())
    if check.problems:
        print("\n".join(check.problems))
        return 1
    nslices = sum(len(v) for v in check.slices.values())
    print(f"OK: {check.packets} packets, {len(check.tracks)} tracks, {nslices} slices, {len(check.flows)} flows, "
          f"{sum(len(v) for v in check.counters.values())} counter values, {len(check.samples)} CPU samples")
    return 0


if __name__ == "__main__":
    sys.exit(main())
