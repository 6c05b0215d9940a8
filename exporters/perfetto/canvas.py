"""Where the Perfetto exporter draws: tracks, lane sets, clamped spans, and slice and instant packets.

The record handlers (``perfetto._Run``) decide what a record looks like; this is how it lands on a track.
"""

from __future__ import annotations

from typing import Any

from gputrace.exporters.perfetto import proto as pp
from gputrace.exporters.perfetto.tracks import LaneSet, PacketSink, Tracks

_NESTING = {"CUDA API", "NVTX"}  # thread child tracks whose slices may legitimately nest
_I64_MAX = (1 << 63) - 1


class Canvas:
    """The drawing state of one export: tracks, lanes per key, and how many spans had to be fixed."""

    def __init__(self, sink: PacketSink, tracks: Tracks | None = None) -> None:
        self.sink, self.put = sink, sink.put
        self.put_framed = sink.put_framed
        self.tracks = tracks if tracks is not None else Tracks(sink)
        self.lanes: dict[tuple[object, ...], LaneSet] = {}
        self.fixed = 0

    # -- drawing --------------------------------------------------------------------------------------

    def slice(self, uuid: int, s: int, e: int, name: str, cat: bytes, args: dict[str, Any],
              flows: list[int] | tuple[int, ...] = ()) -> None:
        fields = pp.event_name(name) + cat + pp.debug_args(args) + (pp.flow_ids(flows) if flows else b"")
        self.put_framed(pp.framed_slice(s, e, uuid, fields), 2)

    def span(self, s: int, e: int) -> tuple[int, int]:
        if type(s) is int and type(e) is int and 0 <= s <= e <= _I64_MAX:  # what clamp_ts leaves as it is
            return s, e
        s, e = pp.clamp_ts(s), pp.clamp_ts(e)
        if e < s:
            self.fixed += 1
            e = s
        return s, e

    def laneset(self, key: tuple[object, ...], make: Any, nest: bool = False) -> LaneSet:
        ls = self.lanes.get(key)
        if ls is None:
            ls = self.lanes[key] = LaneSet(make, nest)
        return ls

    def thread_lanes(self, pid: int, tid: int, what: str) -> LaneSet:
        """Slices of one kind on a thread: lane 0 is the thread track itself (syscalls) or a named child."""
        ls = self.lanes.get(("tl", pid, tid, what))
        if ls is not None:
            return ls

        def make(n: int) -> int:
            t = self.tracks.thread(pid, tid)
            if what == "" and n == 0:
                return t
            label = what or "syscalls"
            return self.tracks.track(("tc", pid, tid, what, n), label if n == 0 else f"{label} #{n + 1}", t)
        return self.laneset(("tl", pid, tid, what), make, nest=what in _NESTING)

    def instant(self, uuid: int, ts: int, name: str, cat: bytes, args: dict[str, Any],
                flows: list[int] | tuple[int, ...] = ()) -> None:
        fields = pp.event_name(name) + cat + pp.debug_args(args) + (pp.flow_ids(flows) if flows else b"")
        self.put_framed(pp.framed_event(pp.INSTANT, pp.clamp_ts(ts), uuid, fields), 1)

    def meta_track(self) -> int:
        return self.tracks.track(("meta",), "gputrace", description="capture sources and their losses")
