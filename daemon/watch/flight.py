"""The flight recorder: a watched job's last N seconds of full detail, as a rolling set of capture segments.

A ``FlightRecorder`` stands where the session's ``CaptureWriter`` would (the session's writer thread alone calls
it). It writes ordinary capture files, one per segment (``seg-<start ns>.gputrace`` in the job's root-only
directory): every ``segment_s``, or when a segment reaches a quarter of the byte bound, the segment is due, and
right after the next kernel blob (within ``HOST_CATCH_UP_S``) it gets its trailer and is renamed into place,
and the next one opens. Each segment stands alone: it starts with the
header, every source's metadata and the state the analysis needs to read it (processes, threads, open files,
devices, agents), the open files read again from /proc at that moment. Closed segments older than the window,
or over the byte bound, are deleted oldest first. A crash leaves only the open segment unfinished, as a
partial capture file that ``salvage`` names as a cut-off segment (readable up to the cut).

``dump_capture`` joins segments into one ordinary capture (header, the segments' frames in order, a trailer
with their drops summed, what tracing cost over the dump's window and the trigger that asked for it).
"""

from __future__ import annotations

import os
import re
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack

from gputrace import clock
from gputrace.capture import MAX_FRAME_BYTES, CaptureWriter, by_kind
from gputrace.daemon.watch.tally import GPU_OPS, GpuTally, SegmentGpu

# Records that say what the others mean (who a pid is, what an fd names, which devices exist): carried into
# every segment so that each can be read alone.
STATE_KINDS = frozenset({"ProcInfo", "ThreadInfo", "FdInfo", "EpollEntry", "FileMap", "GpuDevice", "AgentInfo",
                         "AgentThread", "CpuCgroup", "StackFrames", "SourceStatus"})
MAX_STATE_ROWS = 50_000  # state rows carried at most; more are counted (flight.state_rows) and not carried
HOST_CATCH_UP_S = 1.0  # a due segment closes after the next kernel blob, or this long after it was due
# The kernel blobs of the last CARRY_S go into the next segment as well (``_open``): agents send their GPU records
# later than the ring is drained (watch mode: the agents every second, the ring every 250 ms), so a segment's
# first stalls lie before it opened
CARRY_S = 2.0
CARRY_BYTES = 8 << 20  # carried at most (the oldest go first)
CARRIED = "flight"  # the metadata frame that says how many kernel frames after it were carried
CONTROL = "watch"  # metadata from this source steers the recorder and is not written
SEGMENT_RE = re.compile(r"^seg-(\d{1,20})\.gputrace$")
_PARTIAL_RE = re.compile(r"^\.(seg-\d{1,20}\.gputrace)\.\d+\.partial$")


@dataclass(frozen=True)
class FlightLimits:
    seconds: float = 60.0  # the window kept
    max_bytes: int = 256 << 20  # all of a job's segments together
    segment_s: float = 10.0  # a segment is closed after this long

    @property
    def segment_bytes(self) -> int:
        return max(1 << 20, self.max_bytes // 4)


@dataclass
class Segment:
    path: Path
    start_ns: int
    end_ns: int = 0
    bytes: int = 0
    drops: dict[str, int] = field(default_factory=dict)
    gpu: SegmentGpu | None = None  # its GPU busy and stall time, counted as it was written (tally.py)


class FlightRecorder:
    """A CaptureWriter look-alike writing rolling segments into ``directory`` (see the module docstring).

    ``on_closed(segment)`` runs (on the writer thread) for each segment closed; ``snapshot()`` gives the state
    rows read fresh from /proc for each new segment; ``drops()`` the session's cumulative drops (set once the
    session is running). Each closed segment carries its GPU tally (``Segment.gpu``; stalls are gaps of at
    least ``min_gap_ns``)."""

    def __init__(self, directory: Path, header: dict[str, Any], limits: FlightLimits, *,
                 on_closed: Callable[[Segment], None] = lambda s: None,
                 snapshot: Callable[[], Sequence[tuple[Any, ...]]] = lambda: (), min_gap_ns: int = 1_000_000) -> None:
        self.directory, self.header, self.limits = directory, header, limits
        self.on_closed, self.snapshot = on_closed, snapshot
        self.drops: Callable[[], dict[str, int]] = dict
        self.path = directory / "live.gputrace"  # what the session calls its output; segments are the files
        self.counts: dict[str, int] = {}
        self.lock = threading.Lock()  # guards ``closed`` against a dump listing it while it rotates
        self.closed: list[Segment] = existing_segments(directory)
        self.evicted = 0  # segments deleted for the byte bound before they left the window
        self.state_overflow = 0
        self.rotations = 0  # a counter a dump waits on: a segment was closed
        self.rotated = threading.Condition()
        self._meta: dict[str, dict[str, Any]] = {}
        self._state: dict[str, dict[str, Sequence[Any]]] = {}  # kind -> {row's repr: row}, in arrival order
        self._state_rows = 0
        self._drops_base: dict[str, int] = {}
        self._tally = GpuTally(min_gap_ns)
        self._carry: deque[tuple[int, bytes]] = deque()  # (when written, blob): the kernel blobs of the last CARRY_S
        self._carry_bytes = 0
        self._dropped_ns = 0  # when the last blob no longer carried was written (every event in it was read by then)
        self._origin_ns = 0  # when this recorder opened its first segment: no kernel blob came before
        self._host_from = 0  # the open segment holds every host-side record from then on
        self._due_ns = 0  # when the open segment became due to close (0: not yet)
        self._cur: CaptureWriter | None = None
        self._seg: Segment | None = None
        self._open()

    # ---------------------------------------------------------------------- CaptureWriter's interface ---
    def write_meta(self, source: str, meta: dict[str, Any]) -> None:
        if source == CONTROL:
            if meta.get("now") == self.rotations:  # a dump's second asking: at once (``request_rotation``)
                self._rotate()
            elif meta.get("rotate"):
                self._due_ns = self._due_ns or clock.monotonic_ns()
                self._maybe_rotate()
            return
        self._meta[source] = meta
        self._writer().write_meta(source, meta)
        self._maybe_rotate()

    def write(self, records: Iterable[tuple[Any, ...]]) -> None:
        for kind, rows in by_kind(records).items():
            self.write_rows(kind, rows)

    def write_rows(self, kind: str, rows: Sequence[Sequence[Any]]) -> None:
        if kind in STATE_KINDS:
            self._keep_state(kind, rows)
        elif kind in GPU_OPS:
            self._tally.add(rows)
        self._writer().write_rows(kind, rows)
        self._count(kind, len(rows))
        self._maybe_rotate()

    def write_kernel(self, blob: bytes, nevents: int) -> None:
        now = clock.monotonic_ns()
        self._writer().write_kernel(blob, nevents)
        if blob:
            self._carry.append((now, blob))
            self._carry_bytes += len(blob)
            self._forget(now)
        self._count("kernel_events", nevents)
        self._maybe_rotate(kernel=True)

    def close(self, trailer: dict[str, Any]) -> Path:
        """The session ended: the open segment gets the session's trailer (its drops made the segment's own)."""
        seg, cur = self._seg, self._writer()
        assert seg is not None
        final = dict(trailer)
        final["drops"] = self._segment_drops(trailer.get("drops", {}))
        final["complete"] = not any(final["drops"].values())
        final["tracing_ns"] = seg.start_ns
        final.update(self._host_fields())
        final["flight"] = self._flight_fields()
        self._cur = None
        path = cur.close(final)
        self._closed(seg, cur.written, final)
        return path

    def abort(self) -> None:
        if self._cur is not None:
            self._cur.abort()
            self._cur = None

    # ------------------------------------------------------------------------------------ segments ---
    def request_rotation(self, emit: Callable[[str, dict[str, Any]], None], timeout_s: float = 5.0) -> bool:
        """Have the writer thread close the open segment (through the session's queue, so after what is queued),
        as a due segment closes (``_maybe_rotate``); asked again after HOST_CATCH_UP_S, at once. True once it
        did."""
        with self.rotated:
            before = self.rotations

            def done() -> bool:
                return self.rotations > before or self._cur is None

            emit(CONTROL, {"rotate": True})
            if self.rotated.wait_for(done, min(timeout_s, HOST_CATCH_UP_S)):
                return True
            emit(CONTROL, {"now": before})  # no kernel blob came: the job's threads were quiet meanwhile
            return self.rotated.wait_for(done, max(timeout_s - HOST_CATCH_UP_S, 0.0))

    def segments(self) -> list[Segment]:
        with self.lock:
            return list(self.closed)

    def bytes_held(self) -> int:
        with self.lock:
            held = sum(s.bytes for s in self.closed)
        cur = self._cur
        return held + (cur.written if cur is not None else 0)

    def _writer(self) -> CaptureWriter:
        if self._cur is None:
            raise ValueError("flight recorder is closed")
        return self._cur

    def _count(self, kind: str, n: int) -> None:
        self.counts[kind] = self.counts.get(kind, 0) + n

    def _open(self) -> None:
        start = clock.monotonic_ns()
        seg = Segment(self.directory / f"seg-{start:020d}.gputrace", start)
        self._origin_ns = self._origin_ns or start
        self._forget(start)
        self._host_from, self._due_ns = self._dropped_ns or self._origin_ns, 0
        header = {**self.header, "start_ns": start, "flight": {"segment_of": self.header.get("targets", [])}}
        self._cur = CaptureWriter(seg.path, header)
        self._seg = seg
        for source, meta in self._meta.items():
            self._cur.write_meta(source, {"tracing_ns": start} if source == "session" else meta)
        self._write_carried()
        for kind, rows in self._state.items():
            self._cur.write_rows(kind, list(rows.values()))
        self._cur.write(list(self.snapshot()))

    def _forget(self, now: int) -> None:
        """Blobs written more than CARRY_S ago (and the oldest while over CARRY_BYTES) are no longer carried."""
        limit = now - CARRY_S * 1e9
        while self._carry and (self._carry[0][0] < limit or self._carry_bytes > CARRY_BYTES):
            self._dropped_ns, blob = self._carry.popleft()
            self._carry_bytes -= len(blob)

    def _write_carried(self) -> None:
        """The kernel blobs of the last CARRY_S, again, at the new segment's start: the host side of the time its
        first GPU records describe. They come before its state rows, so the fds they name are named by their
        own opens (one opened earlier stays unnamed: never a later file's name); a dump of several segments
        leaves them out but in the first (``dump_capture``), where they are the only copy."""
        cur = self._writer()
        if self._carry:
            cur.write_meta(CARRIED, {"carried_kernel_frames": len(self._carry)})
            for _, blob in self._carry:
                cur.write_kernel(blob, 0)  # the events were counted in the segment they came in

    def _maybe_rotate(self, kernel: bool = False) -> None:
        """A segment is due once it is ``segment_s`` old or ``segment_bytes`` large. A due segment closes right
        after a kernel blob is written (``kernel``): every GPU record it holds was handed to the writer before
        that blob, so the kernel events of the time before those records' launches are in it (they were read
        from the ring by then). Closed at any other write, its last GPU records could be newer than its last
        kernel events, and their stalls would be explained without them. Where no kernel blob comes within
        HOST_CATCH_UP_S (several drains of the ring), the job's threads made no kernel events meanwhile: it
        closes at the next write."""
        seg, cur = self._seg, self._cur
        if seg is None or cur is None:
            return
        now = clock.monotonic_ns()
        if not self._due_ns and (now - seg.start_ns >= self.limits.segment_s * 1e9
                                 or cur.written >= self.limits.segment_bytes):
            self._due_ns = now
        if self._due_ns and (kernel or now - self._due_ns >= HOST_CATCH_UP_S * 1e9):
            self._rotate()

    def _rotate(self) -> None:
        seg, cur = self._seg, self._cur
        if seg is None or cur is None:
            return
        drops = self._segment_drops(self.drops())
        trailer = {"end_ns": clock.monotonic_ns(), "tracing_ns": seg.start_ns, **self._host_fields(),
                   "stop_reason": "flight segment", "drops": drops, "complete": not any(drops.values()),
                   "flight": self._flight_fields()}
        self._cur = None
        cur.close(trailer)
        self._closed(seg, cur.written, trailer)
        self._open()

    def _closed(self, seg: Segment, size: int, trailer: dict[str, Any]) -> None:
        seg.end_ns, seg.bytes, seg.drops = int(trailer["end_ns"]), size, dict(trailer["drops"])
        seg.gpu = self._tally.take()
        with self.lock:
            self.closed.append(seg)
            self._trim()
        with self.rotated:
            self.rotations += 1
            self.rotated.notify_all()
        self.on_closed(seg)

    def _trim(self) -> None:
        """Called with the lock held: the oldest segment goes once the window is covered without it, and
        while all segments together are over the byte bound."""
        now = clock.monotonic_ns()
        window_ns = self.limits.seconds * 1e9
        while len(self.closed) > 1 and now - self.closed[1].start_ns >= window_ns:
            _unlink(self.closed.pop(0).path)
        open_bytes = self._cur.written if self._cur is not None else 0
        while self.closed and sum(s.bytes for s in self.closed) + open_bytes > self.limits.max_bytes:
            _unlink(self.closed.pop(0).path)
            self.evicted += 1

    def _segment_drops(self, total: dict[str, int]) -> dict[str, int]:
        """This segment's share of the session's cumulative drops."""
        out = {k: int(v) - self._drops_base.get(k, 0) for k, v in total.items()}
        self._drops_base = {k: int(v) for k, v in total.items()}
        if self.state_overflow:
            out["flight.state_rows"] = self.state_overflow
            self.state_overflow = 0
        return {k: v for k, v in out.items() if v}

    def _host_fields(self) -> dict[str, int]:
        """``host_from_ns``: from when the open segment holds every host-side record of its time: when the last
        kernel blob it does not hold (neither carried nor its own) was written. Records land in a segment when
        the writer gets them, not by their times, and a kernel event is read from the ring after it ended: one
        that ended later came in a later blob. A stall its GPU records put before then (an agent's batch more
        than CARRY_S late) has its host time ``unknown`` (analysis/explain.py, ``host_records_from``)."""
        return {"host_from_ns": self._host_from}

    def _flight_fields(self) -> dict[str, Any]:
        return {"segment_s": self.limits.segment_s, "window_s": self.limits.seconds, "evicted": self.evicted}

    def _keep_state(self, kind: str, rows: Sequence[Sequence[Any]]) -> None:
        kept = self._state.setdefault(kind, {})
        for row in rows:
            key = repr(row)  # rows hold lists (a command line): not hashable themselves
            if key in kept:
                continue
            if self._state_rows >= MAX_STATE_ROWS:
                self.state_overflow += 1
                continue
            kept[key] = row
            self._state_rows += 1


def _unlink(path: Path) -> None:
    path.unlink(missing_ok=True)


def existing_segments(directory: Path) -> list[Segment]:
    """The closed segments a job's directory holds (an earlier run of the service's too), oldest first."""
    out = []
    for p in sorted(directory.iterdir()):
        m = SEGMENT_RE.match(p.name)
        if m and p.is_file() and not p.is_symlink():
            st = p.stat()
            out.append(Segment(p, int(m[1]), 0, st.st_size))
    return out


def salvage(directory: Path) -> int:
    """Segments a killed service left open become cut-off segments (readable up to the cut). Returns how many."""
    n = 0
    for p in directory.iterdir():
        m = _PARTIAL_RE.match(p.name)
        if m and p.is_file() and not p.is_symlink():
            os.rename(p, directory / m[1])
            n += 1
    return n


# ----------------------------------------------------------------------------------------- dumps ---


def frames(path: Path) -> Iterator[list[Any]]:
    """The frames of a capture file in order; a segment cut off by a crash ends at the cut."""
    with open(path, "rb") as f:
        unpacker = msgpack.Unpacker(f, raw=False, strict_map_key=False, max_buffer_size=MAX_FRAME_BYTES,
                                    use_list=True)
        try:
            for frame in unpacker:
                if isinstance(frame, list) and frame and isinstance(frame[0], str):
                    yield frame
        except (msgpack.OutOfData, ValueError, msgpack.ExtraData):
            return


def dump_capture(segments: Sequence[Path], out: Path, header: dict[str, Any], trigger: dict[str, Any],
                 host_cpus: int | None = None) -> Path:
    """Join ``segments`` (oldest first) into one capture at ``out``: ``header`` with the trigger, their frames
    in order, a trailer with their drops summed (a segment without a trailer makes the dump incomplete). A
    segment's copies of the kernel blobs that came before it (``CARRIED``) are left out but in the first: the
    others' are in the dump already. The dump's host-side records begin where the first segment's did
    (``host_from_ns``). ``host_cpus``: the CPUs of the host the segments were written on (default: this one's)."""
    writer = CaptureWriter(out, {**header, "flight": {"trigger": trigger, "segments": len(segments)}})
    cost = WindowCost()
    drops: dict[str, int] = {}
    complete, first_ns = True, 0
    first: dict[str, Any] = {}
    last: dict[str, Any] = {}
    try:
        for n, seg in enumerate(segments):
            trailer, skip = None, 0
            for frame in frames(seg):
                tag = frame[0]
                if tag == "M" and len(frame) == 3 and frame[1] == CARRIED:
                    carried = frame[2].get("carried_kernel_frames") if isinstance(frame[2], dict) else None
                    skip = carried if n and type(carried) is int else 0
                elif tag == "M" and len(frame) == 3:
                    writer.write_meta(frame[1], frame[2])
                elif tag == "R" and len(frame) == 3:
                    writer.write_rows(frame[1], frame[2])
                    if frame[1] == "TracingCost":
                        cost.add(frame[2])
                elif tag == "K" and len(frame) == 2 and skip > 0:
                    skip -= 1
                elif tag == "K" and len(frame) == 2:
                    writer.write_kernel(frame[1], 0)
                elif tag == "T" and isinstance(frame[1], dict):
                    trailer = frame[1]
            if trailer is None:
                complete = False
                continue
            for k, v in trailer.get("drops", {}).items():
                drops[k] = drops.get(k, 0) + int(v)
            if not first_ns:
                first_ns, first = int(trailer.get("tracing_ns", 0)), trailer
            last = trailer
    except BaseException:
        writer.abort()
        raise
    final = {"end_ns": int(last.get("end_ns", clock.monotonic_ns())), "tracing_ns": first_ns,
             "stop_reason": f"flight recorder dump ({trigger.get('kind', '')})", "drops": drops,
             "complete": complete and not any(drops.values()), "sources": last.get("sources", {}),
             "trigger": trigger}
    if "host_from_ns" in first:
        final["host_from_ns"] = int(first["host_from_ns"])
    overhead = cost.overhead(host_cpus or os.cpu_count() or 1)
    if overhead is not None:
        final["overhead"] = overhead
    return writer.close(final)


class WindowCost:
    """What tracing cost over a dump's window, from the cost meter's ``TracingCost`` rows in it (daemon/cost.py:
    each a source's CPU time since the session began, every second). A counter present at the window's first
    tick counts from its value there; one that appears later (an agent that connected within the window)
    counts whole. The trailer's ``overhead`` has the share of the host's CPU and its parts by source; the
    per-program and per-event figures of a capture's own trailer are not in the rows, so not in a dump's."""

    def __init__(self) -> None:
        self.first_ts = self.last_ts = 0
        self.base: dict[tuple[str, int], int] = {}
        self.now: dict[tuple[str, int], int] = {}

    def add(self, rows: Iterable[Any]) -> None:
        for row in rows:
            if not isinstance(row, (list, tuple)) or len(row) < 3:
                continue
            ts, source, ns = row[0], row[1], row[2]
            pid = row[4] if len(row) > 4 else 0
            if type(ts) is not int or type(source) is not str or type(ns) is not int or type(pid) is not int:
                continue
            if not self.first_ts or ts < self.first_ts:
                self.first_ts = ts
                self.base.clear()
            self.last_ts = max(self.last_ts, ts)
            key = (source[:64], pid)
            if ts == self.first_ts:
                self.base[key] = ns
            self.now[key] = max(self.now.get(key, 0), ns)

    def overhead(self, cpus: int) -> dict[str, Any] | None:
        window = self.last_ts - self.first_ts
        if window <= 0:
            return None
        by_source: dict[str, int] = {}
        for key, ns in self.now.items():
            by_source[key[0]] = by_source.get(key[0], 0) + max(0, ns - self.base.get(key, 0))
        return {"cpu_share": round(sum(by_source.values()) / (window * cpus), 6), "window_ns": window,
                "host_cpus": cpus, "by_source": by_source, "events": {}, "events_per_s": {}, "wakeups": {}}


def dump_name(comm: str, pid: int, kind: str, n: int) -> str:
    """flight-<comm>-<pid>-<date-time>-<n>-<trigger>.gputrace (``n``: the job's n-th dump)."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", comm)[:15].lstrip(".-") or "job"
    return f"flight-{safe}-{pid}-{time.strftime('%Y%m%d-%H%M%S')}-{n}-{kind}.gputrace"
