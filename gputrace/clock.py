"""The one place that converts between clocks.

The capture clock is CLOCK_MONOTONIC nanoseconds (what bpf_ktime_get_ns returns). CUPTI and NVML stamp
with CLOCK_REALTIME; convert with an offset measured here and re-sampled while a capture runs, since
NTP slews the realtime clock.
"""

from __future__ import annotations

import threading
import time


def monotonic_ns() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def _offset_ns(clock_id: int, samples: int) -> int:
    """clock_id - monotonic, from the tightest of a few bracketed readings."""
    best_width, best = None, 0
    for _ in range(samples):
        m0 = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
        other = time.clock_gettime_ns(clock_id)
        m1 = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
        if best_width is None or m1 - m0 < best_width:
            best_width, best = m1 - m0, other - (m0 + m1) // 2
    return best


def realtime_offset_ns(samples: int = 7) -> int:
    """realtime - monotonic."""
    return _offset_ns(time.CLOCK_REALTIME, samples)


def boottime_offset_ns(samples: int = 7) -> int:
    """boottime - monotonic: the time the host spent suspended (Perfetto's default trace clock is BOOTTIME).

    Never negative (BOOTTIME runs ahead of MONOTONIC by the suspended time); a reading a few ns below zero
    is sampling noise between the two clock reads.
    """
    return max(0, _offset_ns(time.CLOCK_BOOTTIME, samples))


class RealtimeConverter:
    """Converts CLOCK_REALTIME ns to capture-clock ns with an offset re-sampled at most every ``period_s``."""

    def __init__(self, period_s: float = 1.0) -> None:
        self._period_ns = int(period_s * 1e9)
        self._lock = threading.Lock()
        self.offset_ns = realtime_offset_ns()
        self._sampled_at = monotonic_ns()

    def resample(self) -> int:
        offset = realtime_offset_ns()
        with self._lock:
            self.offset_ns, self._sampled_at = offset, monotonic_ns()
        return offset

    def maybe_resample(self) -> None:
        if monotonic_ns() - self._sampled_at >= self._period_ns:
            self.resample()

    def to_monotonic(self, realtime_ns: int) -> int:
        return realtime_ns - self.offset_ns

    def to_realtime(self, monotonic: int) -> int:
        return monotonic + self.offset_ns


def to_realtime_ns(monotonic: int, offset_ns: int) -> int:
    """A capture-clock time as epoch ns, with the offset stored in a capture's header."""
    return monotonic + offset_ns
