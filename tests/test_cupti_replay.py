"""Recorded CUPTI batches (CuptiBackend(record_path=...), GPUTRACE_CUPTI_RECORD) replayed through conversion.

tests/data/cupti/*.jsonl are recordings from real GPUs (see tests/data/cupti/README.md); the round trip
below checks the recording format itself on cupti-python-shaped records.
"""

from __future__ import annotations

from pathlib import Path

import cupti_shapes as shapes
import pytest

from gputrace.clock import RealtimeConverter, monotonic_ns
from gputrace.probes.cupti import BatchRecorder
from gputrace.probes.cupti_convert import ActivityConverter, replay
from gputrace.records import CudaApi, GpuKernel, GpuMemcpy

RECORDINGS = [pytest.param(p, id=p.name) for p in sorted((Path(__file__).parent / "data" / "cupti").glob("*.jsonl"))]
NO_RECORDING = pytest.param(None, marks=pytest.mark.skip(
    reason="no CUPTI batches recorded on a real GPU yet (tests/data/cupti/README.md says how)"))  # fmt: skip


def test_record_then_replay_gives_the_live_conversion(tmp_path: Path) -> None:
    clock = RealtimeConverter(3600)
    t0 = monotonic_ns()
    batches = [shapes.step(clock, t0), shapes.step_tail(clock, t0)]
    live = ActivityConverter(4242, clock.to_monotonic, shapes.api_name)
    path = tmp_path / "rec.jsonl"
    rec = BatchRecorder(str(path), 4242, clock.offset_ns, live.api_name)
    expected = []
    for b in batches:
        rec.write(b)
        expected += live.convert(b)
    rec.close()
    expected += live.finish()
    got, conv = replay(str(path))
    assert got == expected
    assert conv.skipped == {}


@pytest.mark.parametrize("path", RECORDINGS or [NO_RECORDING])
def test_recorded_gpu_batches_convert(path: Path) -> None:
    records, conv = replay(str(path))
    kernels = [r for r in records if type(r) is GpuKernel]
    assert kernels and all(k.start_ns <= k.end_ns for k in kernels)
    launches = {r.correlation_id for r in records if type(r) is CudaApi}
    assert sum(k.correlation_id in launches for k in kernels) >= 0.95 * len(kernels)
    assert any(type(r) is GpuMemcpy for r in records)
    assert conv.skipped.get("incomplete", 0) == 0
