"""The Perfetto exporter: captures built from typed records, exported, validated and queried."""

from __future__ import annotations

import random
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any, NamedTuple

import pytest

from gputrace.capture import CaptureReader, CaptureWriter, host_header
from gputrace.exporters import ExportResult
from gputrace.exporters.perfetto.export import PerfettoExporter
from gputrace.exporters.perfetto.samples import split_frame
from gputrace.exporters.perfetto.tracks import EVICT, Lane
from gputrace.records import (
    BlockIO,
    CudaApi,
    Drops,
    FdInfo,
    GpuDevice,
    GpuKernel,
    GpuMemcpy,
    GpuMemset,
    GpuSync,
    NvmlSample,
    NvtxRange,
    OffCpu,
    ProcInfo,
    SourceStatus,
    StackFrames,
    StackSample,
    Syscall,
    SyscallAgg,
    ThreadInfo,
)
from gputrace.testing.perfetto_check import TraceCheck, check_trace

MS = 1_000_000
T0 = 10_000 * MS
H100_UUID = "GPU-5e0c1a7e-2b1f-4a8e-9d3c-7f1e2a3b4c5d"


def _capture(tmp: Path, records: Sequence[tuple[Any, ...]], *, batch: int = 0) -> Path:
    """A capture file with ``records`` in the given order (``batch``: records per frame, 0 = one frame each)."""
    w = CaptureWriter(tmp / "c.gputrace", host_header(["test"]))
    for i in range(0, len(records), batch or 1):
        for rec in records[i : i + (batch or 1)]:
            w.write_rows(type(rec).__name__, [rec])
    return w.close({"complete": True})


def _export(tmp: Path, records: Sequence[tuple[Any, ...]], report: dict[str, Any] | None = None,
            **kw: Any) -> tuple[TraceCheck, ExportResult]:
    cap = _capture(tmp, records)
    out = tmp / "t.pftrace"
    with CaptureReader(cap) as reader:
        result = PerfettoExporter(out, report=report, **kw).write(reader)
    check = check_trace(out)
    assert check.problems == []
    assert result.items == check.packets
    return check, result


def _proc(pid: int, comm: str, *threads: tuple[int, str]) -> list[tuple[Any, ...]]:
    return [ProcInfo(T0, pid, 1, comm, [comm, "run.py"], f"/usr/bin/{comm}")] + [
        ThreadInfo(T0, pid, tid, name) for tid, name in threads
    ]


def test_threads_syscalls_offcpu_and_wakeups(tmp_path: Path) -> None:
    recs = _proc(100, "trainer", (101, "loader")) + [
        Syscall(100, 101, "pread64", T0 + 1 * MS, T0 + 9 * MS, 65536, 5, "/data/shard-1.bin", 65536, 65536),
        OffCpu(100, 101, T0 + 2 * MS, T0 + 8 * MS, "S", T0 + 7 * MS, 300, 301, "fuse-srv"),
        OffCpu(100, 100, T0 + 3 * MS, T0 + 4 * MS, "R", 0, 0, 0, "", 700, 701, "hog"),
        Syscall(100, 100, "futex", T0 + 2 * MS, T0 + 5 * MS, 0, -1, "", 0, 0xDEAD),
    ]
    check, _ = _export(tmp_path, recs)
    loader = check.thread(101)
    assert loader.name == "loader" and check.parent_name(loader) == "trainer"
    [pread] = check.slices_on(loader)
    assert (pread.name, pread.ts, pread.dur) == ("pread64", T0 + MS, 8 * MS)
    assert pread.args == {"obj": "/data/shard-1.bin", "nbytes": 65536, "ret": 65536, "fd": 5, "arg": 65536}
    assert "syscall" in pread.categories
    offcpu = check.track("off-CPU", parent="loader")
    off, woken = check.slices_on(offcpu)
    assert (off.name, off.depth, off.args["state"], off.args["waker_comm"]) == ("off-CPU (S)", 0, "S", "fuse-srv")
    assert (woken.name, woken.ts, woken.end, woken.depth) == ("woken by fuse-srv", T0 + 7 * MS, T0 + 8 * MS, 1)
    waker = check.thread(301)
    assert waker.name == "fuse-srv" and "not traced" in waker.description
    assert check.parent_name(waker) == "fuse-srv (untraced)"
    [(src, dst)] = check.flows_into(offcpu)
    assert check.track_of(src) is waker and src.name == "wake tid 101" and src.ts == T0 + 7 * MS
    assert dst is woken
    [runq] = check.slices_on(check.track("off-CPU", parent="trainer"))
    assert runq.name == "runqueue" and "waker_pid" not in runq.args
    assert (runq.args["cpu_from_pid"], runq.args["cpu_from_tid"], runq.args["cpu_from_comm"]) == (700, 701, "hog")
    assert "cpu_from_pid" not in off.args
    assert check.slices_on(check.thread(100))[0].args["arg"] == 0xDEAD


def test_clock_is_monotonic_with_wall_time_snapshot(tmp_path: Path) -> None:
    cap = _capture(tmp_path, _proc(1, "x"))
    with CaptureReader(cap) as reader:
        header = reader.header
        PerfettoExporter(tmp_path / "t.pftrace").write(reader)
    check = check_trace(tmp_path / "t.pftrace")
    assert check.ok
    assert check.clocks[3] == header["start_ns"]
    assert check.clocks[1] == header["start_ns"] + header["mono_to_realtime_ns"]
    assert check.clocks[6] == header["start_ns"] + header["mono_to_boottime_ns"] >= check.clocks[3]


def test_block_requests_go_to_non_overlapping_lanes(tmp_path: Path) -> None:
    rng = random.Random(7)
    reqs = []
    for i in range(300):
        issue = T0 + rng.randrange(0, 200 * MS)
        reqs.append(BlockIO(100, 101, "loader", "loop0", i * 8, 4096 * (1 + i % 32), "R", issue,
                            issue + rng.randrange(1, 20 * MS)))
    rng.shuffle(reqs)  # completion order is not issue order
    check, _ = _export(tmp_path, _proc(100, "trainer", (101, "loader")) + reqs)
    dev = check.track("block loop0")
    lanes = check.children(dev)
    assert [t.name for t in lanes] == [f"lane {i}" for i in range(len(lanes))]
    seen = []
    for lane in lanes:
        slices = check.slices_on(lane)
        for a, b in zip(slices, slices[1:], strict=False):
            assert a.end <= b.ts, f"{lane.name}: {a} overlaps {b}"
        seen += slices
    assert len(seen) == 300 and all(s.depth == 0 for s in seen)
    s = next(x for x in seen if x.args["sector"] == 8)
    assert s.args["pid"] == 100 and s.args["tid"] == 101 and s.args["comm"] == "loader"
    assert s.args["bytes"] == 8192 and s.args["rwbs"] == "R" and s.args["latency_ns"] == s.dur
    assert s.name == "R 8 KiB"


def _gpu_records() -> list[tuple[Any, ...]]:
    recs = _proc(200, "python", (201, "python")) + [GpuDevice(0, "NVIDIA H100 80GB HBM3", False, H100_UUID, 200)]
    for i in range(20):
        launch = CudaApi(200, 201, "cudaLaunchKernel", T0 + i * MS, T0 + i * MS + 20_000, 1000 + i, "runtime", 0)
        kernel = GpuKernel(200, 0, 1, 7 + i % 2, T0 + i * MS + 50_000, T0 + i * MS + 600_000, 1000 + i,
                           f"gemm_{i}", (4, 1, 1), (128, 1, 1))
        recs += [launch, kernel] if i % 2 else [kernel, launch]  # either end may come first
    recs += [
        CudaApi(200, 201, "cudaMemcpyAsync", T0 + 30 * MS, T0 + 30 * MS + 10_000, 2000, "runtime", 0),
        GpuMemcpy(200, 0, 1, 7, T0 + 31 * MS, T0 + 33 * MS, 2000, 1 << 20, "h2d", "pinned"),
        GpuMemset(200, 0, 1, 7, T0 + 34 * MS, T0 + 35 * MS, 2001, 4096),
        CudaApi(200, 201, "cudaStreamSynchronize", T0 + 36 * MS, T0 + 40 * MS, 2002, "runtime", 0),
        GpuSync(200, 201, 0, 1, 7, T0 + 36 * MS, T0 + 40 * MS, 2002, "stream"),
        NvtxRange(200, 201, "step", T0, T0 + 40 * MS, "train"),
        NvtxRange(200, 201, "forward", T0 + MS, T0 + 20 * MS, "train"),
    ]
    recs += [NvmlSample(T0 + i * 10 * MS, 0, "gpu_util_pct", 10.0 * i) for i in range(5)]
    recs += [NvmlSample(T0, 0, "power_mw", 250_000.0)]
    return recs


def test_gpu_streams_api_and_launch_flows(tmp_path: Path) -> None:
    check, result = _export(tmp_path, _gpu_records())
    dev = check.track("GPU 0: NVIDIA H100 80GB HBM3")
    names = [t.name for t in check.children(dev)]
    assert {"stream 7", "stream 8", "sync", "gpu_util_pct", "power_mw"} <= set(names)
    api = check.track("CUDA API", parent="python")
    kernels = [s for s in check.slices_on(dev, deep=True) if s.name.startswith("gemm_")]
    assert len(kernels) == 20
    flows = {dst.name: src for src, dst in check.flows_into(check.track("stream 7"))}
    flows.update({dst.name: src for src, dst in check.flows_into(check.track("stream 8"))})
    for k in kernels:
        src = flows[k.name]
        assert check.track_of(src) is api and src.name == "cudaLaunchKernel"
        assert src.args["correlation_id"] == k.args["correlation_id"] and src.ts < k.ts
    copy = check.find("Memcpy HtoD")[0]
    assert copy.args["bytes"] == 1 << 20 and copy.args["direction"] == "h2d" and copy.args["memory"] == "pinned"
    assert flows["Memcpy HtoD"].name == "cudaMemcpyAsync"
    assert check.find("Memset")[0].args["bytes"] == 4096
    sync = check.find("sync stream")[0]
    assert check.track_of(sync).name == "sync" and sync.args["tid"] == 201
    step, fwd = check.slices_on(check.track("NVTX", parent="python"))
    assert (step.name, step.depth, fwd.name, fwd.depth) == ("step", 0, "forward", 1)
    util = check.track("gpu_util_pct")
    assert check.counters[util.uuid] == [(T0 + i * 10 * MS, 10.0 * i) for i in range(5)]
    assert "1 launch/GPU record(s) without their other end: no flow" in result.notes  # the memset


def test_unmatched_launches_are_bounded_and_noted(tmp_path: Path) -> None:
    recs = _proc(200, "python") + [
        CudaApi(200, 200, "cudaLaunchKernel", T0 + i * MS, T0 + i * MS + 1000, 10 + i, "runtime", 0)
        for i in range(50)
    ]
    check, result = _export(tmp_path, recs, pending_cap=8)
    assert len(check.slices_on(check.track("CUDA API"))) == 50
    assert check.flows == []
    assert any("50 launch/GPU record(s) without their other end" in n for n in result.notes)


def _stall_report(simulated: bool = True) -> dict[str, Any]:
    """A report on pid 100's simulated device 0 (its own, so `pid` and `device_pid` say whose), or on a real
    GPU 0 that any process may share."""
    culprit = {"pid": 100, "tid": 101, "comm": "loader", "op": "pread64", "object": "/data/shard-1.bin",
               "bytes": 65536, "duration_ns": 8 * MS}
    evidence = [
        {"pid": 100, "tid": 101, "kind": "syscall", "what": "pread64", "start_ns": T0 + MS, "end_ns": T0 + 9 * MS},
        {"pid": 100, "tid": 101, "kind": "block", "what": "R", "start_ns": T0 + 2 * MS, "end_ns": T0 + 6 * MS},
        {"pid": 100, "tid": 100, "kind": "wakeup", "what": "woken", "start_ns": T0 + MS, "end_ns": T0 + 10 * MS},
        {"pid": 100, "tid": 101, "kind": "syscall", "what": "never recorded", "start_ns": 5, "end_ns": 6},
    ]
    dev: dict[str, Any] = {"id": 0, "name": "Simulated A100", "simulated": True, "busy_ns": 0, "idle_ns": 0,
                           "pid": 100, "cuda_ids": [{"pid": 100, "id": 0}]}
    where: dict[str, Any] = {"device": 0, "device_pid": 100}
    if not simulated:
        dev = {"id": 0, "name": "NVIDIA H100 80GB HBM3", "simulated": False, "busy_ns": 0, "idle_ns": 0,
               "uuid": H100_UUID, "cuda_ids": [{"pid": 100, "id": 0}]}
        where = {"device": 0}
    return {"schema": "gputrace.report/1",
            "devices": [dev],
            "stalls": [{**where, "start_ns": T0 + 1 * MS, "end_ns": T0 + 10 * MS, "duration_ns": 9 * MS,
                        "cause": "storage", "via": ["wait:pid 100"], "culprit": culprit, "evidence": evidence},
                       {**where, "start_ns": T0 + 20 * MS, "end_ns": T0 + 22 * MS, "duration_ns": 2 * MS,
                        "cause": "unknown", "via": [], "culprit": {}, "evidence": []}]}


def test_stalls_with_flows_from_evidence(tmp_path: Path) -> None:
    recs = _proc(100, "trainer", (101, "loader")) + [
        GpuDevice(0, "Simulated A100", True, "sim-0", 100),
        OffCpu(100, 100, T0 + MS, T0 + 10 * MS, "S", T0 + 9 * MS, 100, 101, "loader"),
        Syscall(100, 101, "pread64", T0 + MS, T0 + 9 * MS, 65536, 5, "/data/shard-1.bin", 65536, 65536),
        BlockIO(100, 101, "loader", "loop0", 0, 65536, "R", T0 + 2 * MS, T0 + 6 * MS),
    ]
    check, result = _export(tmp_path, recs, report=_stall_report())
    stalls = check.track("stalls", parent="GPU 0: Simulated A100 (simulated)")
    top = [s for s in check.slices_on(stalls) if s.depth == 0]
    assert [(s.name, s.ts, s.dur) for s in top] == [("storage", T0 + MS, 9 * MS), ("unknown", T0 + 20 * MS, 2 * MS)]
    st = top[0]
    assert st.args["object"] == "/data/shard-1.bin" and st.args["culprit_pid"] == 100
    assert st.args["culprit_comm"] == "loader" and st.args["bytes"] == 65536 and st.args["via"] == "wait:pid 100"
    into = check.flows_into(stalls)
    sources = {(check.track_of(src).name, src.name) for src, _ in into}
    assert sources == {("loader", "pread64"), ("lane 0", "R 64 KiB"), ("off-CPU", "off-CPU (S)")}
    assert all(dst.name == "resume" and dst.ts == st.end for _, dst in into)
    assert any("1 stall evidence entr(ies) matched no slice" in n for n in result.notes)


def test_overlapping_backwards_and_nested_records_stay_valid(tmp_path: Path) -> None:
    rng = random.Random(3)
    recs: list[tuple[Any, ...]] = _proc(100, "x")
    for _ in range(200):  # hostile: overlapping calls on one thread, some ending before they begin
        s = T0 + rng.randrange(0, 50 * MS)
        e = s + rng.randrange(-MS, 5 * MS)
        recs.append(Syscall(100, 100, "read", s, e, 1, 3, "/f", 1, 1))
    for i in range(50):  # a runtime call with the driver call inside it, sometimes starting together
        s = T0 + i * MS
        inner = s if i % 3 == 0 else s + 1000
        recs += [CudaApi(100, 100, "cuLaunchKernel", inner, s + 5000, 0, "driver", 0),
                 CudaApi(100, 100, "cudaLaunchKernel", s, s + 9000, 0, "runtime", 0)]
    rng.shuffle(recs)
    check, result = _export(tmp_path, recs)
    assert len(check.slices_on(check.thread(100), deep=False)) + sum(
        len(check.slices_on(t)) for t in check.children(check.thread(100)) if t.name.startswith("syscalls")
    ) == 200
    assert any("ended before they began" in n for n in result.notes)
    api = [s for t in check.children(check.thread(100)) if t.name.startswith("CUDA API") for s in check.slices_on(t)]
    assert len(api) == 100


class _Foreign(NamedTuple):
    ts: int


class _Reader:
    """Stands in for a CaptureReader whose file holds a record kind this exporter version does not know."""

    def __init__(self, records: list[tuple[Any, ...]], fail_after: int | None = None) -> None:
        self._records, self._fail_after = records, fail_after
        self.header = {"start_ns": T0, "mono_to_realtime_ns": 0}
        self.complete, self.problem = True, ""

    def records(self) -> Iterator[tuple[Any, ...]]:
        for i, r in enumerate(self._records):
            if self._fail_after is not None and i == self._fail_after:
                raise OSError(5, "Input/output error")
            yield r


def test_unknown_and_undrawn_records_are_counted(tmp_path: Path) -> None:
    recs = _proc(1, "x") + [_Foreign(1), _Foreign(2), SyscallAgg(1, 1, "read", 10, 100), FdInfo(1, 1, 3, "file", "/f")]
    result = PerfettoExporter(tmp_path / "t.pftrace").write(_Reader(recs))  # type: ignore[arg-type]
    assert "skipped 2 _Foreign record(s): not known to the Perfetto exporter" in result.notes
    assert len(result.notes) == 1  # known kinds without a timeline are expected, not noted
    assert check_trace(tmp_path / "t.pftrace").ok


def test_failure_leaves_no_output(tmp_path: Path) -> None:
    recs = _proc(1, "x") + [Syscall(1, 1, "read", T0 + i, T0 + i + 1, 0, 0, "", 0, 0) for i in range(0, 100, 2)]
    with pytest.raises(OSError):
        PerfettoExporter(tmp_path / "t.pftrace").write(_Reader(recs, fail_after=20))  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []


def test_names_that_arrive_late_rename_tracks(tmp_path: Path) -> None:
    recs = [
        Syscall(7, 8, "read", T0, T0 + MS, 0, 0, "", 0, 0),
        GpuKernel(7, 1, 1, 3, T0, T0 + MS, 0, "k", (1, 1, 1), (1, 1, 1)),
        ProcInfo(T0, 7, 1, "late", ["late"], "/bin/late"),
        ThreadInfo(T0, 7, 8, "worker"),
        GpuDevice(1, "Late GPU", False, "u", 7),
        Syscall(7, 9, "read", T0, T0 + MS, 0, 0, "", 0, 0),
        BlockIO(7, 9, "renamed", "sda", 0, 512, "R", T0, T0 + MS),  # the thread set its own name since
    ]
    check, _ = _export(tmp_path, recs)
    assert check.thread(8).name == "worker" and check.process(7).name == "late"
    assert check.thread(9).name == "renamed"
    assert check.track("stream 3", parent="GPU 1: Late GPU").name == "stream 3"


def test_incomplete_capture_exports_what_was_readable(tmp_path: Path) -> None:
    recs = _proc(1, "x") + [Syscall(1, 1, "read", T0 + i * 10, T0 + i * 10 + 5, 0, 0, "", 0, 0) for i in range(3000)]
    data = _capture(tmp_path, recs, batch=100).read_bytes()
    cut = tmp_path / "cut.gputrace"
    cut.write_bytes(data[: len(data) // 2])
    with CaptureReader(cut) as reader:
        result = PerfettoExporter(tmp_path / "t.pftrace").write(reader)
    assert result.notes[0].startswith("capture incomplete: cut off")
    check = check_trace(tmp_path / "t.pftrace")
    assert check.ok and 0 < len(check.slices_on(check.thread(1))) < 3000


def test_drops_and_source_states_are_shown(tmp_path: Path) -> None:
    recs = [SourceStatus(T0, "ebpf", "started", ""), Drops(T0 + MS, "ebpf", "ringbuf", 12)]
    check, _ = _export(tmp_path, recs)
    meta = check.track("gputrace")
    assert [s.name for s in check.slices_on(meta)] == ["ebpf: started"]
    assert check.counters[check.track("drops ebpf.ringbuf").uuid] == [(T0 + MS, 12.0)]


GOLDEN_TREE = """\
process trainer
  thread trainer
    track off-CPU
    track CUDA API
  thread loader
process fuse-srv (untraced)
  thread fuse-srv
track GPU 0: NVIDIA H100 80GB HBM3
  track stream 7
  counter gpu_util_pct
  track stalls
track block loop0
  track lane 0"""


def test_golden_track_tree(tmp_path: Path) -> None:
    recs = _proc(100, "trainer", (101, "loader")) + [
        GpuDevice(0, "NVIDIA H100 80GB HBM3", False, H100_UUID, 100),
        OffCpu(100, 100, T0, T0 + MS, "S", T0 + MS // 2, 300, 301, "fuse-srv"),
        CudaApi(100, 100, "cudaLaunchKernel", T0 + MS, T0 + MS + 10, 1, "runtime", 0),
        GpuKernel(100, 0, 1, 7, T0 + 2 * MS, T0 + 3 * MS, 1, "k", (1, 1, 1), (1, 1, 1)),
        Syscall(100, 101, "pread64", T0, T0 + MS, 4096, 3, "/d", 4096, 4096),
        BlockIO(100, 101, "loader", "loop0", 0, 4096, "R", T0, T0 + MS),
        NvmlSample(T0, 0, "gpu_util_pct", 50.0),
    ]
    check, _ = _export(tmp_path, recs, report=_stall_report(simulated=False))
    assert check.tree() == GOLDEN_TREE


def test_wakeup_from_interrupt_context_has_no_arrow(tmp_path: Path) -> None:
    recs = _proc(100, "trainer") + [OffCpu(100, 100, T0, T0 + 2 * MS, "D", T0 + MS, 0, 0, "[softirq]")]
    check, _ = _export(tmp_path, recs)
    [off] = check.slices_on(check.track("off-CPU"))
    assert off.name == "off-CPU (D)" and off.args["waker_comm"] == "[softirq]" and off.args["waker_tid"] == 0
    assert check.flows == [] and [t.name for t in check.tracks.values() if t.kind == "thread"] == ["trainer"]


def test_records_with_broken_fields_are_skipped_whole(tmp_path: Path) -> None:
    recs: list[tuple[Any, ...]] = [
        ProcInfo(T0, 1, 0, "x", [1, None], "/x"),  # type: ignore[list-item]  # stringified, not fatal
        Syscall(1, 1, ["not", "hashable"], T0, T0 + MS, 0, 0, "", 0, 0),  # type: ignore[arg-type]
        OffCpu([1], 1, T0, T0 + MS, "S", T0 + 10, 2, 3, "w"),  # type: ignore[arg-type]
        OffCpu(1, 1, T0, T0 + MS, "S", T0 + 10, 2, 3, {"x"}),  # type: ignore[arg-type]  # stringified
        GpuKernel(1, 0, 0, 1, "soon", T0, 5, "k", (1, 1, 1), (1, 1, 1)),  # type: ignore[arg-type]
        Syscall(1, 1, "read", T0 + 2 * MS, T0 + 3 * MS, 0, 0, "", 0, 0),
    ]
    result = PerfettoExporter(tmp_path / "t.pftrace").write(_Reader(recs))  # type: ignore[arg-type]
    check = check_trace(tmp_path / "t.pftrace")
    assert check.problems == []
    assert "skipped 3 malformed record(s) (fields of the wrong type)" in result.notes
    assert [s.name for s in check.slices_on(check.thread(1))] == ["read"]
    assert check.process(1).name == "x"


def _stall_trace(tmp_path: Path, add: Any) -> tuple[dict[str, Any], TraceCheck]:
    """A trainer's stall [10, 40) ms made by ``add(builder)``: the report, and the trace exported with it."""
    from gputrace.analysis import analyze
    from gputrace.testing.synth import Builder

    b = Builder().proc(100, "trainer").device(100)
    b.op(100, 100, 0.0, 0.0, 10.0, "fwd")
    b.op(100, 100, 39.9, 40.0, 50.0, "bwd")
    add(b)
    cap = b.write(tmp_path / "s.gputrace")
    with CaptureReader(cap) as reader:
        report = analyze(reader)
    out = tmp_path / "s.pftrace"
    with CaptureReader(cap) as reader:
        result = PerfettoExporter(out, report=report).write(reader)
    check = check_trace(out)
    assert check.problems == [] and result.items == check.packets
    return report, check


def test_page_fault_slice_is_the_evidence_of_its_stall(tmp_path: Path) -> None:
    report, check = _stall_trace(tmp_path, lambda b: b.fault(100, 100, 10.5, 10.6, 39.5, "/data/shard.bin",
                                                             offset=4096))
    assert report["stalls"][0]["culprit"]["op"] == "page_fault"
    [fault] = [s for s in check.all_slices() if s.name == "page fault"]
    assert check.track_of(fault).name == "trainer"
    assert (fault.args["obj"], fault.args["offset"]) == ("/data/shard.bin", 4096)
    stalls = check.track("stalls", parent="GPU 0: sim-gpu (simulated)")
    assert "page fault" in {src.name for src, _ in check.flows_into(stalls)}


def test_a_pause_for_dirty_pages_is_drawn_and_points_at_its_stall(tmp_path: Path) -> None:
    report, check = _stall_trace(tmp_path, lambda b: b.syscall(100, 100, "write", 10.1, 39.8, "/data/state.bin",
                                                               64 << 10).dirty(100, 100, 10.2, 29.5))
    assert report["stalls"][0]["culprit"]["dirty_pauses"] == 1
    [pause] = [s for s in check.all_slices() if s.name == "paused for dirty pages on loop0"]
    assert check.track_of(pause).name == "dirty pages" and pause.dur == 29_500_000
    assert (pause.args["wb_dirty"], pause.args["wb_setpoint"]) == (256 << 10, 216 << 10)
    stalls = check.track("stalls", parent="GPU 0: sim-gpu (simulated)")
    assert "paused for dirty pages on loop0" in {src.name for src, _ in check.flows_into(stalls)}


def test_waits_still_open_at_stop_are_drawn_to_the_stop(tmp_path: Path) -> None:
    from gputrace.records import InProgress

    recs = _proc(100, "trainer") + [
        InProgress(100, 100, "read", T0 + MS, T0 + 9 * MS, "S", "/data/fifo", True),
        InProgress(100, 100, "", T0 + 10 * MS, T0 + 12 * MS, "D", "", False),
    ]
    check, _ = _export(tmp_path, recs)
    thread = next(t for t in check.tracks.values() if t.kind == "thread" and t.tid == 100)
    got = [(s.name, s.ts, s.dur, s.args.get("obj")) for s in check.slices_on(thread)]
    assert got == [("read (still waiting at stop)", T0 + MS, 8 * MS, "/data/fifo"),
                   ("off-CPU (still waiting at stop)", T0 + 10 * MS, 2 * MS, None)]


# ---------------------------------------------------------------------------------- CPU samples ---

HOT = ["decode_block (libjpeg.so.62)", "load_batch (python3.11)", "main (python3.11)"]  # leaf first
IDLE = ["poll (libc.so.6)", "load_batch (python3.11)", "main (python3.11)"]


def _interned(path: Path) -> dict[str, int]:
    """How many entries of each kind the trace interns (each should be interned once)."""
    from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

    trace = pb.Trace()
    trace.ParseFromString(path.read_bytes())
    kinds = ("function_names", "mapping_paths", "mappings", "frames", "callstacks")
    return {k: sum(len(getattr(p.interned_data, k)) for p in trace.packet) for k in kinds}


def test_cpu_samples_are_perf_samples_with_interned_root_first_callstacks(tmp_path: Path) -> None:
    recs = _proc(100, "trainer", (101, "loader")) + [
        StackSample(T0 + 1 * MS, 100, 101, 7),  # its frames come later: the sample waits for them
        StackFrames(100, 7, HOT),
        StackFrames(100, 8, IDLE),
        *[StackSample(T0 + (2 + i) * MS, 100, 101, 7 if i % 3 else 8, i % 2) for i in range(30)],
        StackSample(T0 + 40 * MS, 100, 100, 8, 1),
        StackFrames(200, 7, HOT),  # another process, the same stack: one callstack for both
        StackSample(T0 + 41 * MS, 200, 201, 7),  # no CPU recorded (an older capture)
    ]
    check, result = _export(tmp_path, recs)
    assert result.notes == []
    stacks = {(r.pid, r.stack): r.frames for r in recs if isinstance(r, StackFrames)}
    want = [(r.ts, r.pid, r.tid, r.cpu, stacks[(r.pid, r.stack)][::-1]) for r in recs if isinstance(r, StackSample)]
    assert sorted((s.ts, s.pid, s.tid, s.cpu, s.frames) for s in check.samples) == sorted(want)
    assert {s.cpu for s in check.samples} == {-1, 0, 1}
    assert check.samples[0].frames[0] == "main (python3.11)" and check.samples[0].leaf == HOT[0]
    # each name, module, frame and stack interned once, however many samples use it
    assert _interned(tmp_path / "t.pftrace") == {"function_names": 4, "mapping_paths": 3, "mappings": 3,
                                                 "frames": 4, "callstacks": 2}
    assert check.thread(101).name == "loader" and check.thread(201).name == "thread 201"  # described for them


def test_stacks_sharing_their_frames_resolve_to_their_own_frames(tmp_path: Path) -> None:
    """Hundreds of stacks drawn from a few frames (as a Python program's are: the same outer callers, a few
    leaves), with modules and without, and names holding parentheses: each sample's callstack is its stack's
    frames, root first, and each function, module, frame and stack is interned once."""
    rng = random.Random(5)
    pool = ["main (python3.11)", "run (python3.11)", "_PyEval_EvalFrameDefault (libpython3.11.so)", "[unknown]",
            "decode (libjpeg.so.62)", "operator() (libtorch.so)", "f(x) (a b.so)", "no_module", "(weird)",
            "poll (libc.so.6)", "load (python3.11)", "load (libc.so.6)"]  # fmt: skip
    stacks = {k: [rng.choice(pool) for _ in range(rng.randint(1, 30))] for k in range(300)}
    recs: list[tuple[Any, ...]] = _proc(100, "trainer")
    for k, frames in stacks.items():
        recs.append(StackFrames(100, k, frames))
        recs += [StackSample(T0 + (k * 3 + i) * MS, 100, 100, k) for i in range(2)]
    check, result = _export(tmp_path, recs)
    assert result.notes == [] and check.problems == []
    assert sorted((s.ts, s.frames) for s in check.samples) == sorted(
        (r.ts, stacks[r.stack][::-1]) for r in recs if isinstance(r, StackSample))
    split = {split_frame(f) for frames in stacks.values() for f in frames}
    assert _interned(tmp_path / "t.pftrace") == {
        "function_names": len({f for f, _ in split}), "mapping_paths": len({m for _, m in split if m}),
        "mappings": len({m for _, m in split}), "frames": len(split),
        "callstacks": len({tuple(frames) for frames in stacks.values()})}


def test_samples_whose_frames_never_arrive_are_drawn_unknown_and_noted(tmp_path: Path) -> None:
    recs = _proc(100, "trainer") + [StackSample(T0 + i * MS, 100, 100, 9) for i in range(16)]  # never named
    recs += [StackSample(T0 + (20 + i) * MS, 100, 100, 1) for i in range(4)]
    recs += [StackFrames(100, 1, HOT)]  # frames of stack 1 come last, after its 4 samples waited for them
    check, result = _export(tmp_path, recs, pending_cap=6)  # at most 6 samples wait; the oldest give up
    assert len(check.samples) == 20
    unknown = [s for s in check.samples if s.frames == ["[unknown]"]]
    hot = [s for s in check.samples if s.frames == HOT[::-1]]
    assert len(unknown) == 16 and len(hot) == 4
    assert result.notes == ["16 CPU sample(s) whose stack frames never arrived: drawn as [unknown]"]


def test_late_frames_beyond_the_buffer_still_count(tmp_path: Path) -> None:
    recs = _proc(100, "trainer") + [StackSample(T0 + i * MS, 100, 100, 1) for i in range(10)]
    check, result = _export(tmp_path, recs + [StackFrames(100, 1, HOT)], pending_cap=4)
    assert sorted(tuple(s.frames) for s in check.samples) == [("[unknown]",)] * 6 + [tuple(HOT[::-1])] * 4
    assert result.notes == ["6 CPU sample(s) whose stack frames never arrived: drawn as [unknown]"]


def test_broken_sample_records_are_skipped_whole(tmp_path: Path) -> None:
    recs: list[tuple[Any, ...]] = _proc(1, "x") + [
        StackFrames(1, 1, HOT),
        StackFrames(1, 2, "not a list"),  # type: ignore[arg-type]
        StackFrames(1, 3, [b"bytes"]),  # type: ignore[list-item]
        StackSample(T0, "1", 1, 1),  # type: ignore[arg-type]
        StackSample(T0, 1, -1, 1),
        StackSample("soon", 1, 1, 1),  # type: ignore[arg-type]
        StackSample(T0, 1, 1, [1]),  # type: ignore[arg-type]
        StackSample(T0 + MS, 1, 1, 1),
    ]
    result = PerfettoExporter(tmp_path / "t.pftrace").write(_Reader(recs))  # type: ignore[arg-type]
    check = check_trace(tmp_path / "t.pftrace")
    assert check.problems == []
    assert result.notes == ["skipped 6 malformed record(s) (fields of the wrong type)"]
    assert [(s.ts, s.frames) for s in check.samples] == [(T0 + MS, HOT[::-1])]


class _Stream(_Reader):
    """A reader whose records are generated as they are read: nothing of the input is held."""

    def __init__(self, n: int) -> None:
        super().__init__([])
        self.n = n

    def records(self) -> Iterator[tuple[Any, ...]]:
        yield from _proc(100, "trainer", *[(101 + k, f"loader{k}") for k in range(4)])
        for k in range(50):
            yield StackFrames(100, k, [f"f{k} (libx.so)", *HOT])
        for i in range(self.n):
            yield StackSample(T0 + i * 2000, 100, 101 + i % 4, i % 50)


_PEAK = """
import sys, tracemalloc
from pathlib import Path
from gputrace.exporters.perfetto.export import PerfettoExporter
from test_perfetto import _Stream
n = int(sys.argv[1])
tracemalloc.start()
PerfettoExporter(Path(sys.argv[2])).write(_Stream(n))
print(tracemalloc.get_traced_memory()[1])
"""


@pytest.mark.slow
def test_sample_state_is_bounded_by_stacks_not_samples(tmp_path: Path) -> None:
    def peak(n: int) -> int:
        """In an interpreter of its own: tracemalloc counts every thread's allocations, and threads other
        tests left behind in this one (a background unload, an agent's I/O) would count here too."""
        out = subprocess.run([sys.executable, "-c", _PEAK, str(n), str(tmp_path / f"{n}.pftrace")],
                             capture_output=True, text=True, timeout=120, cwd=Path(__file__).parent, check=True)
        return int(out.stdout)

    small, big = peak(2_000), peak(60_000)
    assert big < small + 256 * 1024, (small, big)  # 30x the samples, not 30x the memory
    check = check_trace(tmp_path / "60000.pftrace")
    assert check.problems == [] and len(check.samples) == 60_000
    assert _interned(tmp_path / "60000.pftrace")["callstacks"] == 50


def test_a_streams_work_arriving_grouped_by_kind_stays_on_one_track(tmp_path: Path) -> None:
    # As an agent's batch arrives (seen on an H100): a stream's kernels, then its copies, then its memsets, each
    # group in time order but hundreds of slices behind the last kernel. Nothing overlaps: one track. A copy
    # that does overlap a kernel (a broken clock, say) still gets a lane of its own.
    recs = _proc(200, "python", (201, "python")) + [GpuDevice(0, "NVIDIA H100 80GB HBM3", False, H100_UUID, 200)]
    n = 300  # the memsets arrive 600 slices behind (582 was the most seen), within Lane.KEEP_SEQUENTIAL
    at = [T0 + i * MS for i in range(n)]
    recs += [GpuKernel(200, 0, 1, 7, t, t + 300_000, 10_000 + i, f"k{i}", (1, 1, 1), (32, 1, 1))
             for i, t in enumerate(at)]  # fmt: skip
    recs += [GpuMemcpy(200, 0, 1, 7, t + 400_000, t + 500_000, 20_000 + i, 4096, "h2d", "pageable")
             for i, t in enumerate(at)]  # fmt: skip
    recs += [GpuMemset(200, 0, 1, 7, t + 600_000, t + 700_000, 30_000 + i, 512) for i, t in enumerate(at)]
    check, _ = _export(tmp_path, recs)
    dev = check.track("GPU 0: NVIDIA H100 80GB HBM3")
    assert [t.name for t in check.children(dev)] == ["stream 7"]
    assert len(check.slices_on(check.track("stream 7"))) == 3 * n
    clash = GpuMemcpy(200, 0, 1, 7, at[5] + 100_000, at[5] + 200_000, 40_000, 4096, "h2d", "pageable")
    (tmp_path / "clash").mkdir()
    check, _ = _export(tmp_path / "clash", [*recs, clash])
    assert sorted(t.name for t in check.children(dev)) == ["stream 7", "stream 7 #2"]
    # further behind than the lane remembers (more than KEEP_SEQUENTIAL slices): a lane of its own, though it
    # overlaps nothing, never a broken track
    many = [GpuKernel(200, 0, 1, 7, T0 + i * MS, T0 + i * MS + 1000, 60_000 + i, "k", (1, 1, 1), (32, 1, 1))
            for i in range(Lane.KEEP_SEQUENTIAL + EVICT + 1)]  # fmt: skip
    early = GpuKernel(200, 0, 1, 7, T0 - MS, T0 - MS + 1000, 70_000, "early", (1, 1, 1), (32, 1, 1))
    (tmp_path / "late").mkdir()
    check, _ = _export(tmp_path / "late", [*recs[: len(recs) - 3 * n], *many, early])
    assert sorted(t.name for t in check.children(dev)) == ["stream 7", "stream 7 #2"]
    assert [sl.name for sl in check.slices_on(check.track("stream 7 #2"))] == ["early"]
