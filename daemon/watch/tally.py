"""A flight segment's GPU busy time and stall time, counted from its GPU records as they are written.

The flight recorder hands every batch of GPU operations (kernels, copies, sets) to a ``GpuTally``; when the
segment closes, ``take()`` gives per device (of each process) what the report's device timeline would: the
busy time (the union of the operations), the window (first start to last end), and the gaps of at least
``min_gap_ns`` between operations (the stalls, without their causes). This costs a few microseconds per
operation and no reading back, so every segment gets its busy share and stall time; only the causes need
the full analysis (watcher.py decides which segments get it).

Memory and time stay bounded: operations are merged every MERGE_EVERY (sorted, then added at the end of the
merged busy intervals: they come nearly in order, so that is amortised constant time each), and merged
intervals that ended more than HORIZON_NS before the latest operation are final (an operation arriving later
than that, four times the agents' sending period in watch mode, is clipped to what is final and counted in
``late``).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

GPU_OPS = frozenset({"GpuKernel", "GpuMemcpy", "GpuMemset"})  # (pid, device, ..., start_ns, end_ns, ...)
MERGE_EVERY = 1024
HORIZON_NS = 1_000_000_000


@dataclass
class DeviceTally:
    busy_ns: int = 0
    window_ns: int = 0
    stall_ns: int = 0
    stalls: int = 0


@dataclass
class SegmentGpu:
    """One closed segment's GPU figures, by (pid, device)."""

    devices: dict[tuple[int, int], DeviceTally] = field(default_factory=dict)
    late: int = 0

    @property
    def busy_ns(self) -> int:
        return sum(d.busy_ns for d in self.devices.values())

    @property
    def window_ns(self) -> int:
        return sum(d.window_ns for d in self.devices.values())

    @property
    def stall_ns(self) -> int:
        return sum(d.stall_ns for d in self.devices.values())

    @property
    def stalls(self) -> int:
        return sum(d.stalls for d in self.devices.values())

    def busy_ratio(self) -> float | None:
        window = self.window_ns
        return self.busy_ns / window if window > 0 else None


class _Device:
    def __init__(self, min_gap_ns: int) -> None:
        self.min_gap_ns = min_gap_ns
        self.pending: list[tuple[int, int]] = []
        self.merged: list[list[int]] = []  # disjoint, by start: not final yet
        self.first = self.last = -1
        self.final_end = -1  # where the final part ends
        self.out = DeviceTally()
        self.late = 0

    def add(self, start: int, end: int) -> None:
        if end < start:
            start, end = end, start
        self.pending.append((start, end))
        self.first = start if self.first < 0 else min(self.first, start)
        self.last = max(self.last, end)
        if len(self.pending) >= MERGE_EVERY:
            self.merge(self.last - HORIZON_NS)

    def merge(self, final_before: int) -> None:
        """Merge what is pending; intervals ending before ``final_before`` become final."""
        merged = self.merged
        for start, end in sorted(self.pending):
            if start < self.final_end:  # reaches into what is final already
                self.late += 1
                start = self.final_end
                if end <= start:
                    continue
            if not merged or start > merged[-1][1]:
                merged.append([start, end])
            elif start >= merged[-1][0]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                _insert(merged, start, end)  # out of order: seldom
        self.pending = []
        done = 0
        while done < len(merged) and merged[done][1] < final_before:
            self._final(*merged[done])
            done += 1
        del merged[:done]

    def _final(self, start: int, end: int) -> None:
        if self.final_end >= 0 and start - self.final_end >= self.min_gap_ns:
            self.out.stall_ns += start - self.final_end
            self.out.stalls += 1
        self.out.busy_ns += end - start
        self.final_end = end

    def take(self) -> DeviceTally:
        self.merge(self.last + 1)
        self.out.window_ns = max(0, self.last - self.first)
        return self.out


def _insert(merged: list[list[int]], start: int, end: int) -> None:
    """[start, end) into the disjoint, sorted ``merged``, joined with the intervals it overlaps."""
    i = bisect.bisect_left(merged, [start, start])
    if i > 0 and merged[i - 1][1] >= start:
        i -= 1
        start = merged[i][0]
    j = i
    while j < len(merged) and merged[j][0] <= end:
        end = max(end, merged[j][1])
        j += 1
    merged[i:j] = [[start, end]]


class GpuTally:
    """Fed with GPU operation rows as the recorder writes them; ``take()`` at each segment's close."""

    def __init__(self, min_gap_ns: int) -> None:
        self.min_gap_ns = min_gap_ns
        self._devices: dict[tuple[int, int], _Device] = {}

    def add(self, rows: Sequence[Sequence[Any]]) -> None:
        for row in rows:
            key = (int(row[0]), int(row[1]))
            dev = self._devices.get(key)
            if dev is None:
                dev = self._devices[key] = _Device(self.min_gap_ns)
            dev.add(int(row[4]), int(row[5]))

    def take(self) -> SegmentGpu:
        """The segment's figures; the next segment starts from nothing (a gap across segments is in neither,
        as in each segment's own report)."""
        out = SegmentGpu()
        for key, dev in self._devices.items():
            out.devices[key] = dev.take()
            out.late += dev.late
        self._devices = {}
        return out
