"""Each device's time line cut into equal slices: how much of each slice lay in the device's window and which
causes its stalls had there. The HTML report's timeline (when it has too many stalls to draw one by one) and
the terminal's one-line strip are both drawn from these slices.

Only stalls are known per instant: a report keeps no busy intervals, so time in the device's window that no
stall covers is busy (or idle for less than the minimum gap); time outside it had no GPU work recorded.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from gputrace.documents import Device, Report, Stall

# The contract's causes, in the order the legends list them; a letter each for the terminal strip.
LETTERS = {
    "storage": "s", "network": "n", "collective": "C", "cpu": "c", "cpu.runqueue": "r", "cpu.throttled": "t",
    "sync": "y", "sleep": "z", "device": "d", "launch": "l", "tracing": "T", "unknown": "?",
}
BUSY, OUTSIDE, OTHER = "=", ".", "x"  # OTHER: a cause this version does not know (a newer analysis)


def letter(cause: str) -> str:
    return LETTERS.get(cause, OTHER)


def span(report: Report) -> tuple[int, int]:
    """The capture's time line, widened to every device's window (GPU work recorded before the start)."""
    cap = report["capture"]
    t0 = min([cap["start_ns"], *(d["first_ns"] for d in report["devices"] if "first_ns" in d)])
    t1 = max([cap["end_ns"], *(d["last_ns"] for d in report["devices"] if "last_ns" in d)])
    return t0, max(t1, t0 + 1)


def device_stalls(report: Report, dev: Device) -> list[Stall]:
    """The stalls of one device: in a report of several captures, device ids repeat across hosts."""
    host = dev.get("host")
    return [s for s in report["stalls"] if s["device"] == dev["id"] and (host is None or s.get("host") == host)]


@dataclass
class Slice:
    start_ns: int
    end_ns: int
    window_ns: int = 0  # the part of the slice inside the device's window
    by_cause: dict[str, int] = field(default_factory=dict)
    stalls: int = 0
    longest: Stall | None = None  # the longest stall that touches the slice, to name its culprit

    @property
    def stalled_ns(self) -> int:
        return sum(self.by_cause.values())

    def top_cause(self) -> str:
        return max(self.by_cause.items(), key=lambda kv: kv[1])[0]


def slices(report: Report, dev: Device, stalls: list[Stall], n: int) -> list[Slice]:
    """``n`` equal slices of ``span(report)``; each stall adds its overlap to the slices it crosses, so the
    work is the number of stalls plus the slices they cover, whatever their count."""
    t0, t1 = span(report)
    width = (t1 - t0) / n
    out = [Slice(t0 + round(i * width), t0 + round((i + 1) * width)) for i in range(n)]
    first, last = dev.get("first_ns", t0), dev.get("last_ns", t1)
    for sl in out:
        sl.window_ns = max(0, min(sl.end_ns, last) - max(sl.start_ns, first))
    for s in stalls:
        lo, hi = s["start_ns"], s["end_ns"]
        i0 = max(0, min(n - 1, int((lo - t0) / width)))
        i1 = max(i0, min(n - 1, int((hi - t0) / width)))
        for sl in out[i0:i1 + 1]:
            overlap = min(hi, sl.end_ns) - max(lo, sl.start_ns)
            if overlap <= 0 and not (lo == hi and sl.start_ns <= lo <= sl.end_ns):
                continue
            sl.by_cause[s["cause"]] = sl.by_cause.get(s["cause"], 0) + max(overlap, 0)
            sl.stalls += 1
            if sl.longest is None or s["duration_ns"] > sl.longest["duration_ns"]:
                sl.longest = s
    return out


def strip(report: Report, dev: Device, width: int) -> str:
    """One character per slice: the letter of the cause with the most stall time where stalls took at least
    half of the slice's time in the window, BUSY where they took less, OUTSIDE where the device had no window."""
    chars = []
    for sl in slices(report, dev, device_stalls(report, dev), width):
        if sl.window_ns <= 0:
            chars.append(OUTSIDE)
        elif sl.by_cause and 2 * sl.stalled_ns >= sl.window_ns:
            chars.append(letter(sl.top_cause()))
        else:
            chars.append(BUSY)
    return "".join(chars)
