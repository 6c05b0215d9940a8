"""A capture's host-side records begin at a known time, and nothing is concluded from their absence before it.

Records land in a capture (a flight segment above all) when they are written, not by their times, and agents send
GPU records later than the kernel's ring is drained: a segment's first stalls can lie before its host-side records
begin. Their host time is `unknown`, never `cpu` (a thread without records looks on CPU); the flight recorder
carries the last kernel blobs into the next segment, so those stalls keep their evidence, and closes a segment
right after a kernel blob, so its last stalls have theirs (daemon/watch/flight.py).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from gputrace import clock
from gputrace.analysis import analyze
from gputrace.analysis.explain import BEFORE_HOST_RECORDS
from gputrace.analysis.windowed import analyze_records
from gputrace.capture import CaptureReader, CaptureWriter, host_header, open_capture
from gputrace.daemon.session import WATCH_PACING
from gputrace.daemon.watch import flight
from gputrace.daemon.watch.flight import CONTROL, FlightLimits, FlightRecorder, dump_capture
from gputrace.records import CudaApi, GpuDevice, GpuKernel, ProcInfo, ThreadInfo, TracingCost
from gputrace.testing import synth
from gputrace.testing.synth import Builder, ns

JOB = 100
STEP_MS, KERNEL_MS = 20.0, 10.0  # a 10 ms kernel, then a 10 ms sleep, then the next launch


def report(path: Path) -> dict[str, Any]:
    with open_capture(path) as reader:
        return dict(analyze(reader))


def windowed_report(path: Path) -> dict[str, Any]:
    with open_capture(path) as reader:
        return dict(analyze_records(reader, reader.records(), small_records=0, bucket_ns=20_000_000, window_buckets=1))


def sleeper(steps: int, host_from_ms: float) -> Builder:
    """The job: kernel [t, t+10), clock_nanosleep (t+10, t+20), the next launch at t+20; the GPU side recorded
    throughout, the host side only from ``host_from_ms`` on."""
    b = Builder().proc(JOB, "python").device(JOB)
    for i in range(steps):
        t = i * STEP_MS
        b.op(JOB, JOB, t, t + 0.01, t + KERNEL_MS, f"step{i}")
        if t + KERNEL_MS >= host_from_ms:
            b.syscall(JOB, JOB, "clock_nanosleep", t + KERNEL_MS + 0.02, t + STEP_MS - 0.02)
            b.offcpu(JOB, JOB, t + KERNEL_MS + 0.03, t + STEP_MS - 0.03, "S", waker=(0, 0, "[timer]"))
    return b


def test_a_stall_before_the_host_side_records_begin_is_unknown_not_cpu(tmp_path: Path) -> None:
    # host-side records from 50 ms on: the stalls at 10 and 30 ms have none of theirs in the capture
    path = sleeper(6, 50).write(tmp_path / "t.gputrace", trailer={"tracing_ns": ns(50)})
    r = report(path)
    causes = [(round((s["start_ns"] - ns(0)) / 1e6), s["cause"]) for s in r["stalls"]]
    assert causes == [(10, "unknown"), (30, "unknown"), (50, "sleep"), (70, "sleep"), (90, "sleep")], causes
    first = r["stalls"][0]
    assert first["why"] == BEFORE_HOST_RECORDS and first["culprit"]["pid"] == 0
    assert first["breakdown"] == [{"cause": "unknown", "pid": 0, "object": "", "ns": first["duration_ns"] - 10_000}]
    assert "cpu" not in r["summary"]["by_cause"], r["summary"]
    assert r["capture"]["start_ns"] == ns(0.01)  # the capture still starts at its first GPU op
    assert windowed_report(path) == r  # a window's capture knows where the host side begins too


def test_only_the_part_of_a_stall_before_the_host_records_is_unknown(tmp_path: Path) -> None:
    # the host side from 53 ms: the stall [50, 60.01) is 3 ms unknown and its sleep (from 50.02) cut at 53
    b = sleeper(4, 50)
    path = b.write(tmp_path / "t.gputrace", trailer={"tracing_ns": ns(53)})
    [stall] = [s for s in report(path)["stalls"] if s["start_ns"] == ns(50)]
    parts = {e["cause"]: e["ns"] for e in stall["breakdown"]}
    assert stall["cause"] == "sleep" and parts["unknown"] == ns(53) - ns(50), stall["breakdown"]
    assert parts["sleep"] == ns(60 - 0.02) - ns(53), stall["breakdown"]  # the call, from 53 on


def test_a_segments_host_from_ns_says_where_its_host_records_begin(tmp_path: Path) -> None:
    # a flight segment opened at 100 ms holds kernel events from 30 ms on (carried from the one before it)
    trailer = {"tracing_ns": ns(100), "host_from_ns": ns(30)}
    r = report(sleeper(8, 30).write(tmp_path / "t.gputrace", trailer=trailer))
    causes = [s["cause"] for s in r["stalls"]]
    assert causes == ["unknown", "sleep", "sleep", "sleep", "sleep", "sleep", "sleep"], causes


def test_captures_that_say_nothing_of_it_are_explained_as_before(tmp_path: Path) -> None:
    r = report(sleeper(4, 50).write(tmp_path / "t.gputrace"))  # no tracing_ns: no bound
    assert [s["cause"] for s in r["stalls"]] == ["cpu", "cpu", "sleep"]


# --------------------------------------------------------------------------------- the flight recorder ---
BASE = 5_000_000_000_000  # the fake clock's start (the synthetic records' 0 ms)
DRAIN_MS = 250.0  # the kernel ring is drained this often


class Job:
    """The sleeper's records as a session hands them to its recorder: kernel events in blobs, one per drain of
    the ring (every DRAIN_MS: the events that ended since the last); GPU records and their launches in an
    agent's batches (every ``flush_ms``, from ``gpu_lag_ms`` after the op ended)."""

    def __init__(self, steps: int, gpu_lag_ms: float, flush_ms: float) -> None:
        self.arrivals: list[tuple[float, int, str, Any]] = []  # (ms written, order, kind, payload)
        b = Builder().ebpf()
        self.ebpf_meta = b.meta["ebpf"]
        for i in range(steps):
            t = i * STEP_MS
            end = t + STEP_MS - 0.02
            b.kernel_call(JOB, JOB, "clock_nanosleep", t + KERNEL_MS + 0.02, end)
            self._at(_next(end, DRAIN_MS), "K", b.kernel.pop())
            op = [
                CudaApi(JOB, JOB, "cudaLaunchKernel", ns(t), ns(t) + 5_000, i + 1, "runtime", 0),
                GpuKernel(JOB, 0, 1, 7, ns(t + 0.01), ns(t + KERNEL_MS), i + 1, f"step{i}", (1, 1, 1), (128, 1, 1)),
            ]
            self._at(_next(t + KERNEL_MS + gpu_lag_ms, flush_ms) + 1, "R", op)

    def _at(self, ms: float, kind: str, payload: Any) -> None:
        self.arrivals.append((ms, len(self.arrivals), kind, payload))

    def batches(self) -> Iterator[tuple[float, str, list[Any]]]:
        """What is written when, in order: one kernel blob per drain, one batch of rows per agent flush."""
        grouped: dict[tuple[float, str], list[Any]] = {}
        for ms, _, kind, payload in sorted(self.arrivals):
            grouped.setdefault((ms, kind), []).append(payload)
        for (ms, kind), items in grouped.items():
            yield ms, kind, [r for rows in items for r in rows] if kind == "R" else items


def _next(ms: float, period: float) -> float:
    return (ms // period + 1) * period


@pytest.fixture
def fake_clock(monkeypatch: pytest.MonkeyPatch) -> Callable[[float], None]:
    """The recorder's clock, set by the test (ms of the synthetic timeline); synthetic ms 0 is BASE."""
    now = [BASE]
    monkeypatch.setattr(clock, "monotonic_ns", lambda: now[0])
    monkeypatch.setattr(synth, "BASE_NS", BASE)

    def at(ms: float) -> None:
        now[0] = BASE + round(ms * 1e6)

    return at


def record(directory: Path, job: Job, at: Callable[[float], None], segment_s: float = 1.0) -> list[Path]:
    """``job`` through a FlightRecorder with ``segment_s`` segments; its segment files, oldest first."""
    at(-1)
    directory.mkdir()
    rec = FlightRecorder(
        directory, {**host_header(["test"]), "targets": [JOB]}, FlightLimits(seconds=600, segment_s=segment_s)
    )
    rec.write_meta("ebpf", job.ebpf_meta)
    rec.write_meta("session", {"tracing_ns": BASE})
    rec.write(
        [
            ProcInfo(BASE, JOB, 1, "python", ["python"], "/usr/bin/python"),
            ThreadInfo(BASE, JOB, JOB, "python"),
            GpuDevice(0, "sim-gpu", True, f"uuid-{JOB}-0", JOB),
        ]
    )
    last = 0.0
    for ms, kind, items in job.batches():
        at(ms)
        last = ms
        if kind == "K":
            rec.write_kernel(b"".join(items), len(items))
        else:
            rec.write(items)
    at(last + 1)
    rec.close({"end_ns": clock.monotonic_ns(), "drops": {}})
    return sorted(directory.glob("seg-*.gputrace"))


def causes_of(segments: list[Path]) -> Counter[str]:
    return Counter(s["cause"] for seg in segments for s in report(seg)["stalls"])


@pytest.mark.parametrize(("gpu_lag_ms", "flush_ms"), [(600, 250), (0, WATCH_PACING.agent_flush_ms)])
def test_a_segments_first_stalls_keep_their_host_side_evidence(
    tmp_path: Path, fake_clock: Callable[[float], None], gpu_lag_ms: int, flush_ms: int
) -> None:
    # the agent's batches come 600-850 ms after their ops (or, at watch mode's agent pace, up to a whole
    # flush period after them): each 1 s segment's first stalls lie before it opened
    segments = record(tmp_path / "f", Job(150, gpu_lag_ms=gpu_lag_ms, flush_ms=flush_ms), fake_clock)
    assert len(segments) >= 2, segments
    early = 0
    for seg in segments:
        with CaptureReader(seg) as reader:
            list(reader.records())
            opened = reader.trailer["tracing_ns"] if reader.trailer else 0
            assert reader.trailer is not None and reader.trailer["host_from_ns"] <= opened
        early += sum(s["start_ns"] < opened for s in report(seg)["stalls"])
    assert early >= 20, early  # the case at hand
    # every stall a sleep (one at a boundary whose two ops are in two segments is in neither)
    causes = causes_of(segments)
    assert set(causes) == {"sleep"} and 150 - len(segments) <= causes["sleep"] < 150, causes


def test_without_carried_blobs_such_stalls_are_unknown_never_cpu(
    tmp_path: Path, fake_clock: Callable[[float], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(flight, "CARRY_S", 0.0)
    segments = record(tmp_path / "f", Job(150, gpu_lag_ms=600, flush_ms=250), fake_clock)
    causes = causes_of(segments)
    assert set(causes) == {"sleep", "unknown"} and causes["unknown"] >= 20, causes
    whys = {s.get("why") for seg in segments for s in report(seg)["stalls"] if s["cause"] == "unknown"}
    assert whys == {BEFORE_HOST_RECORDS}, whys


def test_a_segment_closes_after_a_kernel_blob_so_its_last_stalls_have_their_evidence(
    tmp_path: Path, fake_clock: Callable[[float], None], monkeypatch: pytest.MonkeyPatch
) -> None:
    # the agent sends at once (every 20 ms), the ring is drained every 250 ms: a segment closed at any write
    # holds GPU records whose sleeps are in the next one
    job = Job(150, gpu_lag_ms=0, flush_ms=20)
    segments = record(tmp_path / "f", job, fake_clock, segment_s=1.1)  # due between two drains
    assert len(segments) >= 2, segments
    assert causes_of(segments) == Counter({"sleep": 150 - len(segments)}), causes_of(segments)
    monkeypatch.setattr(flight, "HOST_CATCH_UP_S", 0.0)  # closed at the first write once due
    causes = causes_of(record(tmp_path / "g", job, fake_clock, segment_s=1.1))
    assert causes["cpu"] >= 3, causes  # what it would say


def test_a_dump_holds_every_kernel_event_once(tmp_path: Path, fake_clock: Callable[[float], None]) -> None:
    segments = record(tmp_path / "f", Job(150, gpu_lag_ms=600, flush_ms=250), fake_clock)
    with CaptureReader(segments[0]) as reader:
        header = dict(reader.header)
    dump = dump_capture(segments, tmp_path / "dump.gputrace", header, {"kind": "request"})
    with CaptureReader(dump) as reader:
        calls = [r for r in reader.records() if type(r).__name__ == "Syscall"]
    assert len(calls) == len(set(calls)) == 150, (len(calls), len(set(calls)))
    assert Counter(s["cause"] for s in report(dump)["stalls"]) == Counter({"sleep": 149})


def test_a_dump_says_what_tracing_cost_over_its_window(tmp_path: Path) -> None:
    """The cost meter's counters (CPU time since the session began) over the dump's first and last tick: a
    counter present at the first tick counts from there, an agent that connected later counts whole."""
    s = 1_000_000_000
    ticks = [[TracingCost(1 * s, "session", 100_000_000), TracingCost(1 * s, "agent", 50_000_000, 0, 7)],
             [TracingCost(2 * s, "session", 150_000_000), TracingCost(2 * s, "agent", 60_000_000, 0, 7)],
             [TracingCost(3 * s, "session", 220_000_000), TracingCost(3 * s, "agent", 80_000_000, 0, 7),
              TracingCost(3 * s, "agent", 30_000_000, 0, 9), TracingCost(3 * s, "ebpf", 9, 1, 0)]]
    segments = []
    for n, seg in enumerate([ticks[:2], ticks[2:]]):
        w = CaptureWriter(tmp_path / f"seg{n}.gputrace", host_header(["test"]))
        for rows in seg:
            w.write(rows)
        segments.append(w.close({"end_ns": (n + 2) * s, "drops": {}}))
    dump = dump_capture(segments, tmp_path / "dump.gputrace", host_header(["test"]), {"kind": "request"},
                        host_cpus=4)
    with CaptureReader(dump) as reader:
        list(reader.records())
        overhead = reader.trailer["overhead"]
    assert overhead["by_source"] == {"session": 120_000_000, "agent": 60_000_000, "ebpf": 9}
    assert overhead["window_ns"] == 2 * s and overhead["host_cpus"] == 4
    assert overhead["cpu_share"] == round(180_000_009 / (2 * s * 4), 6)
    assert report(dump)["capture"]["overhead"]["cpu_share"] == overhead["cpu_share"]


def test_a_dump_asks_the_segment_to_close_after_a_kernel_blob_then_at_once(
    tmp_path: Path, fake_clock: Callable[[float], None]
) -> None:
    fake_clock(0)
    (tmp_path / "f").mkdir()
    rec = FlightRecorder(tmp_path / "f", host_header(["test"]), FlightLimits(seconds=600, segment_s=60))
    rec.write_meta("ebpf", Builder().ebpf().meta["ebpf"])
    rec.write_meta(CONTROL, {"rotate": True})  # a dump asks: the segment closes after the next kernel blob
    rec.write([GpuDevice(0, "sim-gpu", True, "u", JOB)])
    assert rec.rotations == 0
    fake_clock(100)
    rec.write_kernel(b"\0" * 8, 0)
    assert rec.rotations == 1
    rec.write_meta(CONTROL, {"now": 0})  # asked again after a rotation that came meanwhile: nothing to do
    assert rec.rotations == 1
    fake_clock(150)
    rec.write_meta(CONTROL, {"now": 1})  # no kernel blob came: at once
    assert rec.rotations == 2
    fake_clock(200)
    rec.write_meta(CONTROL, {"rotate": True})
    fake_clock(200 + flight.HOST_CATCH_UP_S * 1000)  # none within HOST_CATCH_UP_S: at the next write
    rec.write([GpuDevice(0, "sim-gpu", True, "u", JOB)])
    assert rec.rotations == 3
    rec.close({"end_ns": clock.monotonic_ns(), "drops": {}})
