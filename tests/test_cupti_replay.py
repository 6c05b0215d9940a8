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
from gputrace.probes.cupti_convert import ActivityConverter, load_recording, replay
from gputrace.records import CudaApi, GpuDevice, GpuKernel, GpuMemcpy, GpuSync, NvtxRange

DATA = Path(__file__).parent / "data" / "cupti"
RECORDINGS = [pytest.param(p, id=p.name) for p in sorted(DATA.glob("*.jsonl*"))]
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


def test_the_h100_torch_loop_replays_as_the_loop_ran() -> None:
    """tests/test_gpu_real.py's loop on an H100 (README.md here): 20 steps, each an NVTX range holding two 4 MiB
    H2D copies (pageable, pinned), matmuls of three sizes and a synchronize on the loop's thread."""
    records, conv = replay(str(DATA / "h100-torch-loop.jsonl.gz"))
    meta, _ = load_recording(str(DATA / "h100-torch-loop.jsonl.gz"))
    of = lambda cls: [r for r in records if type(r) is cls]  # noqa: E731
    (dev,) = of(GpuDevice)
    assert dev.name == "NVIDIA H100 80GB HBM3" and dev.uuid.startswith("GPU-") and not dev.simulated
    steps = [r for r in of(NvtxRange) if r.name == "step"]
    assert len(steps) == 20 and len({r.tid for r in steps}) == 1
    loop_tid = steps[0].tid
    h2d = [(c.memory, c.nbytes) for c in of(GpuMemcpy) if c.kind == "h2d" and c.nbytes == 4 << 20]
    assert h2d.count(("pageable", 4 << 20)) >= 20 and h2d.count(("pinned", 4 << 20)) >= 20
    kernels = of(GpuKernel)
    assert len(kernels) >= 20 * 5 and all(k.device == 0 for k in kernels)
    by_stream: dict[int, list[GpuKernel]] = {}
    for k in kernels:
        by_stream.setdefault(k.stream, []).append(k)
    for ks in by_stream.values():  # one stream runs one kernel at a time
        ks.sort(key=lambda k: k.start_ns)
        assert all(a.end_ns <= b.start_ns for a, b in zip(ks, ks[1:], strict=False))
    in_steps = [k for k in kernels if any(s.start_ns <= k.start_ns <= s.end_ns + 50_000_000 for s in steps)]
    assert len(in_steps) >= 0.9 * len(kernels) - 10  # the rest: torch's own warm-up before the first step
    syncs = [s for s in of(GpuSync) if s.tid == loop_tid]
    assert len(syncs) >= 20
    apis = of(CudaApi)
    assert {a.tid for a in apis if a.name.startswith("cudaLaunchKernel")} == {loop_tid}
    assert not [a for a in apis if a.name.startswith("cudaGetDevice_")]  # recorded, then dropped as quiet
    assert conv.skipped.get("quiet_api", 0) > len(apis)  # they outnumbered all other API records
    assert meta["driver_version"] == "580.159.04" and meta["cupti_python"] == "13.4.0"


def test_a_one_rank_nccl_communicator_shows_its_calls_as_nvtx_ranges_and_no_kernel() -> None:
    """What NCCL shows on one H100 with world size 1 (README.md here): each call as an NVTX range of NCCL's
    own, inside the user's; no NCCL kernel (nothing to exchange); the quiet lookups dropped."""
    records, conv = replay(str(DATA / "h100-nccl-one-rank.jsonl.gz"))
    ranges = [r for r in records if type(r) is NvtxRange]
    names = [r.name for r in ranges]
    assert names.count("ncclAllReduce") == 12 and names.count("ncclBroadcast") == 12, names
    users = sorted((r for r in ranges if r.name.startswith("all_reduce ")), key=lambda r: r.start_ns)
    assert [r.name for r in users] == [f"all_reduce {4096 << i} B" for i in range(len(users))] and len(users) >= 10
    calls = [r for r in ranges if r.name.startswith("nccl")]
    assert all(any(u.start_ns <= c.start_ns and c.end_ns <= u.end_ns for u in users) for c in calls[: 2 * len(users)])
    kernels = [r.name for r in records if type(r) is GpuKernel]
    assert kernels and not [k for k in kernels if "nccl" in k.lower()], kernels
    assert conv.skipped.get("quiet_api", 0) > 1000
