"""CPU stack samples as Perfetto draws its own profilers' samples: PerfSample packets whose callstacks are
interned in the exporter's trusted sequence (function names, module paths, mappings, frames, callstacks).

Each function name, module, frame and distinct callstack is interned once per trace; its InternedData goes
out inside the first sample packet that uses it. State grows with the number of distinct stacks, never with
the number of samples. A sample whose StackFrames has not arrived yet waits in a bounded buffer; one whose
frames never come is drawn under a single ``[unknown]`` frame and counted.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

from gputrace.exporters.perfetto import proto as pp
from gputrace.records import StackFrames, StackSample

UNKNOWN = "[unknown]"
_U32 = 1 << 32
_FUNCTION_NAMES, _MAPPING_PATHS = 5, 17  # InternedData fields
_TAILS_MAX = 1 << 14
_I64_MAX = (1 << 63) - 1
_STR_ONLY = frozenset({str})  # the types a list of strings holds


def split_frame(frame: str) -> tuple[str, str]:
    """``"func (module)"`` → ``("func", "module")``; a frame with no module → ``(frame, "")``."""
    if frame.endswith(")"):
        head, sep, module = frame[:-1].rpartition(" (")
        if sep and head:
            return head, module
    return frame, ""


class StackInterner:
    """Interned ids of one trusted sequence; ``callstack()`` also returns the entries not written yet."""

    def __init__(self) -> None:
        self._names: dict[str, int] = {}
        self._paths: dict[str, int] = {}
        self._mappings: dict[str, int] = {}
        self._frames: dict[tuple[int, int], int] = {}
        self._callstacks: dict[tuple[int, ...], int] = {}
        self._frame_ids: dict[str, int] = {}  # a frame as records name it -> its iid (stacks share most frames)

    def callstack(self, frames: list[str]) -> tuple[int, bytes]:
        """The iid of ``frames`` (leaf first, as records hold them) and the InternedData entries it adds."""
        new: list[bytes] = []
        root_first = frames[::-1] if frames else [UNKNOWN]  # Perfetto wants root first
        known = list(map(self._frame_ids.get, root_first))  # (a dict lookup each, in a C loop)
        ids = tuple(self._frame(f, new) if i is None else i for f, i in zip(root_first, known, strict=True)) \
            if None in known else cast(tuple[int, ...], tuple(known))
        iid = self._callstacks.get(ids)
        if iid is None:
            iid = self._callstacks[ids] = len(self._callstacks) + 1
            new.append(pp.interned_callstack(iid, ids))
        return iid, b"".join(new)

    def _frame(self, frame: str, new: list[bytes]) -> int:
        func, module = split_frame(frame)
        key = (self._intern(self._names, _FUNCTION_NAMES, func, new), self._mapping(module, new))
        iid = self._frames.get(key)
        if iid is None:
            iid = self._frames[key] = len(self._frames) + 1
            new.append(pp.interned_frame(iid, *key))
        self._frame_ids[frame] = iid
        return iid

    def _mapping(self, module: str, new: list[bytes]) -> int:
        iid = self._mappings.get(module)
        if iid is None:
            path = self._intern(self._paths, _MAPPING_PATHS, module, new) if module else 0
            iid = self._mappings[module] = len(self._mappings) + 1
            new.append(pp.interned_mapping(iid, path))
        return iid

    @staticmethod
    def _intern(table: dict[str, int], field: int, text: str, new: list[bytes]) -> int:
        iid = table.get(text)
        if iid is None:
            iid = table[text] = len(table) + 1
            new.append(pp.interned_string(field, iid, text))
        return iid

    def __len__(self) -> int:
        return len(self._callstacks)


Key = tuple[int, int]
Ready = tuple[int, int, int, bytes]  # a sample checked and half encoded: ts, pid, tid, its PerfSample fields


class CpuSamples:
    """StackSample / StackFrames records → PerfSample packets, in either arrival order.

    ``thread(pid, tid)`` must describe the sample's thread track before its packet is written.
    """

    def __init__(self, put: Callable[[bytes], None], thread: Callable[[int, int], int], pending_cap: int, *,
                 put_framed: Callable[[bytes, int], None], interner: StackInterner | None = None,
                 ids: Callable[[int], int] = int) -> None:
        """``interner``: the trace's, shared by the captures of several hosts (interned ids are the
        sequence's, not a capture's); ``ids``: a pid or tid as the trace writes it (tracks.Tracks.perfetto_id);
        ``put_framed``: how packets framed already are written (PacketSink.put_framed)."""
        self._put, self._thread = put, thread
        self._put_framed = put_framed
        self._cap = pending_cap
        self._ids = ids
        self.interner = interner if interner is not None else StackInterner()
        self._stacks: dict[Key, list[str] | int] = {}  # frames until first drawn, then the callstack iid
        self._pending: OrderedDict[Key, deque[Ready]] = OrderedDict()
        self._npending = 0
        self._fields: dict[tuple[int, int, int], bytes] = {}  # (pid, tid, cpu) -> encoded PerfSample fields
        self.unsymbolized = 0  # drawn as [unknown]: their frames never came (or came too late)
        self.malformed = 0  # rows sample_rows refused (fields of the wrong type)
        self._tails: dict[tuple[int, int, int, int], bytes] = {}  # (pid, tid, cpu, callstack) -> pp.sample_tail

    def frames(self, r: StackFrames) -> None:
        if type(r.frames) is not list or not set(map(type, r.frames)) <= _STR_ONLY:
            raise TypeError("StackFrames.frames must be a list of strings")
        key = (r.pid, r.stack)
        self._stacks[key] = list(r.frames)  # a later StackFrames of the same stack replaces it
        waiting = self._pending.pop(key, None)
        if waiting:
            self._npending -= len(waiting)
            for s in waiting:
                self._write(s, key)

    def sample(self, r: StackSample) -> None:
        key = (r.pid, r.stack)
        iid = self._stacks.get(key)
        if type(iid) is int:  # a stack drawn before (nearly every sample): _write's work, without its steps
            fields = self._fields.get((r.pid, r.tid, r.cpu)) or self._ready(r)[3]
            ts = pp.clamp_ts(r.ts)
            self._thread(r.pid, r.tid)
            self._put_framed(pp.framed_perf_sample(ts, fields, iid), 1)
            return
        ready = self._ready(r)  # a broken record is refused now, whole, not when its frames arrive
        if key in self._stacks:
            self._write(ready, key)
            return
        waiting = self._pending.get(key)
        if waiting is None:
            waiting = self._pending[key] = deque()
        waiting.append(ready)
        self._npending += 1
        if self._npending > self._cap:
            self._evict_oldest()

    def sample_rows(self, rows: Sequence[Sequence[Any]]) -> None:
        """``sample()`` of each row (ts, pid, tid, stack, cpu), a record made only for a sample whose stack
        was not drawn before."""
        stacks, fields_of, thread, put, tails = self._stacks, self._fields, self._thread, self._put_framed, self._tails
        new, framed, clamp = tuple.__new__, pp.framed_sample, pp.clamp_ts
        for row in rows:
            try:
                ts, pid, tid, stack, cpu = row
                iid = stacks.get((pid, stack))
                if type(iid) is not int:
                    self.sample(new(StackSample, row))
                    continue
                key = (pid, tid, cpu, iid)
                tail = tails.get(key)
                if tail is None:
                    fields = fields_of.get((pid, tid, cpu)) or self._ready(new(StackSample, row))[3]
                    if len(tails) >= _TAILS_MAX:
                        tails.clear()
                    tail = tails[key] = pp.sample_tail(fields, iid)
                thread(pid, tid)
                put(framed(ts if 0 <= ts <= _I64_MAX else clamp(ts), tail), 1)
            except (TypeError, ValueError, AttributeError, OverflowError, IndexError):
                self.malformed += 1

    def finish(self) -> None:
        """Samples still waiting for frames that never came: drawn as [unknown]."""
        while self._pending:
            self._unsymbolized(self._pending.popitem(last=False)[1])

    def _evict_oldest(self) -> None:
        """One sample of the stack that has waited longest gives up waiting."""
        key, waiting = next(iter(self._pending.items()))
        self._unsymbolized([waiting.popleft()])
        if not waiting:
            del self._pending[key]

    def notes(self) -> list[str]:
        if not self.unsymbolized:
            return []
        return [f"{self.unsymbolized} CPU sample(s) whose stack frames never arrived: drawn as {UNKNOWN}"]

    def _unsymbolized(self, samples: Iterable[Ready]) -> None:
        samples = list(samples)
        self._npending -= len(samples)
        self.unsymbolized += len(samples)
        for s in samples:
            self._write(s, None)

    def _write(self, ready: Ready, key: Key | None) -> None:
        ts, pid, tid, fields = ready
        self._thread(pid, tid)
        known = self._stacks.get(key) if key is not None else None
        if isinstance(known, int):
            iid, interned = known, b""
        else:
            iid, interned = self.interner.callstack(known or [UNKNOWN])
            if key is not None:
                self._stacks[key] = iid  # the frames themselves are no longer needed
        self._put(pp.perf_sample(ts, fields, iid, interned))

    def _ready(self, r: StackSample) -> Ready:
        fields = self._fields.get((r.pid, r.tid, r.cpu))
        if fields is None:
            if not all(type(v) is int and 0 <= v < _U32 for v in (r.pid, r.tid)):
                raise ValueError("StackSample pid/tid must be 32-bit unsigned integers")
            if not (type(r.cpu) is int and -1 <= r.cpu < _U32):
                raise ValueError("StackSample cpu must be -1 or a 32-bit unsigned integer")
            fields = self._fields[(r.pid, r.tid, r.cpu)] = pp.sample_fields(self._ids(r.pid), self._ids(r.tid),
                                                                            r.cpu)
        return pp.clamp_ts(r.ts), r.pid, r.tid, fields
