"""A trace drawn by two processes at once (PerfettoExporter's ``jobs``: the kernel probes' records by a second one,
forked) holds what one process draws: the same tracks, named alike, the same slices, instants, counters, CPU
samples and arrows (stall evidence included), and the same notes. Only the uuids, the arrows' ids, the packets'
order and the descriptors the two parts both write differ, so traces are compared by what they show."""

from __future__ import annotations

import io
import lzma
import os
import shutil
from collections import Counter
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest

from gputrace.capture import CaptureReader, CaptureWriter, host_header
from gputrace.documents import Report
from gputrace.errors import JobEnded, UserError
from gputrace.exporters import ExportResult
from gputrace.exporters.perfetto import export
from gputrace.exporters.perfetto.export import PerfettoExporter
from gputrace.exporters.perfetto.tracks import PacketSink
from gputrace.pipeline import analyse
from gputrace.records import (
    AgentInfo,
    BlockIO,
    CudaApi,
    Drops,
    GpuDevice,
    GpuKernel,
    InProgress,
    NvmlSample,
    OffCpu,
    PageFault,
    ProcExec,
    ProcExit,
    ProcFork,
    ProcInfo,
    StackFrames,
    StackSample,
    Syscall,
    ThreadInfo,
)
from gputrace.testing import scale
from gputrace.testing.perfetto_check import TraceCheck, check_trace

MS = 1_000_000
T0 = 10_000 * MS
CAPTURES = Path(__file__).parent / "data" / "captures"


def _capture(path: Path, records: Sequence[tuple[Any, ...]]) -> Path:
    """A capture of ``records`` in their order, each run of one kind a frame of its own."""
    w = CaptureWriter(path, host_header(["test"]))
    run: list[tuple[Any, ...]] = []
    for rec in records:
        if run and type(rec) is not type(run[0]):
            w.write_rows(type(run[0]).__name__, run)
            run = []
        run.append(rec)
    if run:
        w.write_rows(type(run[0]).__name__, run)
    return w.close({"complete": True})


def _draw(cap: Path, out: Path, report: Report | None, jobs: int) -> tuple[TraceCheck, ExportResult]:
    with CaptureReader(cap) as reader:
        exporter = PerfettoExporter(out, report=report, jobs=jobs, parallel_min_bytes=0)
        result = exporter.write(reader)
    assert exporter.parts == jobs
    check = check_trace(out)
    assert check.problems == [] and result.items == check.packets
    return check, result


def _same_either_way(tmp: Path, cap: Path, report: Report | None = None) -> tuple[TraceCheck, TraceCheck]:
    one, one_result = _draw(cap, tmp / "one.pftrace", report, 1)
    two, two_result = _draw(cap, tmp / "two.pftrace", report, 2)
    a, b = one.shown(), two.shown()
    for what in a:
        if isinstance(a[what], Counter):
            assert a[what] == b[what], (what, list((a[what] - b[what]).items())[:3],
                                        list((b[what] - a[what]).items())[:3])
        else:
            assert a[what] == b[what], what
    assert one_result.notes == two_result.notes
    assert sorted(p.name for p in tmp.iterdir()) == sorted({cap.name, "one.pftrace", "two.pftrace"})
    return one, two


def _proc(pid: int, comm: str, *threads: tuple[int, str]) -> list[tuple[Any, ...]]:
    return [ProcInfo(T0, pid, 1, comm, [comm, "run.py"], f"/usr/bin/{comm}")] + [
        ThreadInfo(T0, pid, tid, name) for tid, name in threads]


def _names_from_both_parts() -> list[tuple[Any, ...]]:
    """Threads named by records of either part: a waker first seen untraced, named later by its process's records
    and drawn on by the other part; a thread drawn on by the other part renamed by its block requests; threads
    drawn on by the rest part alone, named only by a block request and a wakeup; a fork, an exec and an exit."""
    return [
        *_proc(100, "trainer", (101, "loader")),
        OffCpu(100, 101, T0 + 2 * MS, T0 + 8 * MS, "S", T0 + 7 * MS, 300, 301, "fuse-srv"),
        OffCpu(100, 100, T0 + 3 * MS, T0 + 4 * MS, "R", 0, 0, 0, "", 700, 701, "hog"),
        OffCpu(100, 100, T0 + 5 * MS, T0 + 6 * MS, "D", T0 + 5 * MS + 10, 0, 0, "[softirq]"),
        CudaApi(100, 101, "cudaLaunchKernel", T0 + 9 * MS, T0 + 10 * MS, 1, "runtime", 0),
        BlockIO(100, 101, "loader-renamed", "loop0", 8, 4096, "R", T0 + 10 * MS, T0 + 12 * MS),
        Syscall(100, 101, "pread64", T0 + MS, T0 + 9 * MS, 65536, 5, "/data/shard-1.bin", 65536, 65536),
        ProcInfo(T0, 300, 1, "fuse", ["fuse"], "/usr/bin/fuse"),
        ThreadInfo(T0, 300, 301, "fuse-main"),
        CudaApi(300, 301, "cudaMemcpyAsync", T0 + 20 * MS, T0 + 21 * MS, 2, "runtime", 0),
        OffCpu(100, 101, T0 + 22 * MS, T0 + 24 * MS, "S", T0 + 23 * MS, 300, 301, "fuse-worker"),
        BlockIO(100, 102, "io-thread", "loop0", 16, 4096, "R", T0 + 13 * MS, T0 + 14 * MS),
        OffCpu(100, 100, T0 + 14 * MS, T0 + 16 * MS, "S", T0 + 15 * MS, 400, 401, "helper"),
        CudaApi(100, 102, "cudaLaunchKernel", T0 + 17 * MS, T0 + 18 * MS, 3, "runtime", 0),
        CudaApi(400, 401, "cudaLaunchKernel", T0 + 17 * MS, T0 + 18 * MS, 4, "runtime", 0),
        ProcFork(T0 + 25 * MS, 100, 100, 200, 200, False, "spawn"),
        ProcExec(T0 + 26 * MS, 200, 200, "tool", "/usr/bin/tool"),
        Syscall(200, 200, "read", T0 + 27 * MS, T0 + 28 * MS, 0, 3, "", 0, 0),
        ProcExit(T0 + 29 * MS, 200, 200, "tool"),
        AgentInfo(T0, 100, 100, "3.11", "12.4", "550", "sim"),
        Drops(T0 + 30 * MS, "ebpf", "ringbuf", 3),
    ]


def _gpu_and_stalls() -> tuple[list[tuple[Any, ...]], Report]:
    """Launches and their kernels, CPU samples and counters (the rest part), and a stall whose evidence is in both
    parts: a syscall, a block request, an off-CPU wait and a page fault (kernel part), a kernel (rest)."""
    recs: list[tuple[Any, ...]] = [
        *_proc(100, "trainer", (101, "loader")),
        GpuDevice(0, "Simulated A100", True, "sim-0", 100),
        StackFrames(100, 1, ["leaf (libc.so.6)", "main (python3)"]),
        OffCpu(100, 100, T0 + MS, T0 + 10 * MS, "S", T0 + 9 * MS, 100, 101, "loader"),
        Syscall(100, 101, "pread64", T0 + MS, T0 + 9 * MS, 65536, 5, "/data/shard-1.bin", 65536, 65536),
        BlockIO(100, 101, "loader", "loop0", 0, 65536, "R", T0 + 2 * MS, T0 + 6 * MS),
        PageFault(100, 101, T0 + 9 * MS, T0 + 9 * MS + 500_000, 400_000, "/data/idx.bin", 4096, "7:0", 12),
    ]
    for k in range(6):
        t = T0 + 10 * MS + k * MS
        recs += [CudaApi(100, 100, "cudaLaunchKernel", t, t + 10_000, 10 + k, "runtime", 0),
                 GpuKernel(100, 0, 1, 7, t + 20_000, t + 500_000, 10 + k, "gemm", (1, 1, 1), (128, 1, 1)),
                 StackSample(t, 100, 100, 1), NvmlSample(t, 0, "gpu_util", 50.0 + k)]
    recs.append(InProgress(100, 101, "read", T0 + 30 * MS, T0 + 40 * MS, "S", "/data/slow.bin", False))
    culprit = {"pid": 100, "tid": 101, "comm": "loader", "op": "pread64", "object": "/data/shard-1.bin",
               "bytes": 65536, "duration_ns": 8 * MS}
    evidence = [
        {"pid": 100, "tid": 101, "kind": "syscall", "what": "pread64", "start_ns": T0 + MS, "end_ns": T0 + 9 * MS},
        {"pid": 100, "tid": 101, "kind": "block", "what": "R", "start_ns": T0 + 2 * MS, "end_ns": T0 + 6 * MS},
        {"pid": 100, "tid": 100, "kind": "wakeup", "what": "woken", "start_ns": T0 + MS, "end_ns": T0 + 10 * MS},
        {"pid": 100, "tid": 101, "kind": "offcpu", "what": "fault", "start_ns": T0 + 9 * MS, "end_ns": T0 + 10 * MS},
        {"pid": 100, "tid": 0, "kind": "gpu", "what": "gemm", "start_ns": T0 + 10 * MS + 20_000,
         "end_ns": T0 + 10 * MS + 500_000},
        {"pid": 100, "tid": 101, "kind": "syscall", "what": "never recorded", "start_ns": 5, "end_ns": 6},
    ]
    report: Report = {"schema": "gputrace.report/1",  # type: ignore[typeddict-item]  # the fields drawn
              "devices": [{"id": 0, "name": "Simulated A100", "simulated": True, "busy_ns": 0, "idle_ns": 0,
                           "pid": 100, "cuda_ids": [{"pid": 100, "id": 0}]}],
              "stalls": [{"device": 0, "device_pid": 100, "start_ns": T0 + MS, "end_ns": T0 + 11 * MS,
                          "duration_ns": 10 * MS, "cause": "storage", "via": [], "culprit": culprit,
                          "evidence": evidence}]}
    return recs, report


def _named(check: TraceCheck) -> dict[tuple[Any, ...], tuple[str, str]]:
    """Each process and thread track's name and description, by its kind and ids."""
    return {(t.kind, t.pid, t.tid): (t.name, t.description) for t in check.tracks.values()
            if t.kind in ("process", "thread")}


def _part_named(cap: Path, role: str) -> dict[tuple[Any, ...], tuple[str, str]]:
    """``_named`` of what one part of a trace drawn in two writes alone: the last description of each of its
    process and thread tracks (a trace holds both parts, and its reader shows the last description of each)."""
    from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

    out = io.BytesIO()
    sink = PacketSink(out)
    with CaptureReader(cap) as reader:
        run = export._Run(sink, reader.header, None, 50_000, role=role)
        run.feed_reader(reader)
        if role == export.REST_PART:
            run.finish()  # (the launches that waited for their kernels)
    sink.flush()
    trace = pb.Trace()
    trace.ParseFromString(out.getvalue())
    named: dict[tuple[Any, ...], tuple[str, str]] = {}
    for p in trace.packet:
        td = p.track_descriptor
        if p.HasField("track_descriptor") and td.HasField("thread"):
            named[("thread", td.thread.pid, td.thread.tid)] = (td.thread.thread_name, td.description)
        elif p.HasField("track_descriptor") and td.HasField("process"):
            named[("process", td.process.pid, None)] = (td.process.process_name, td.description)
    return named


def test_names_given_by_either_part_name_the_tracks_alike(tmp_path: Path) -> None:
    cap = _capture(tmp_path / "c.gputrace", _names_from_both_parts())
    one, two = _same_either_way(tmp_path, cap)
    assert two.thread(101).name == "loader-renamed" and two.thread(301).name == "fuse-worker"
    assert two.process(300).name == "fuse" and not two.thread(301).description  # traced after all
    assert two.process(200).name == "tool" and two.thread(102).name == "io-thread"
    assert two.thread(401).name == "helper" and two.process(400).name == "helper (untraced)"
    # each part names every track it describes as one process does, whichever part's records named it
    named = _named(one)
    kernel, rest = _part_named(cap, export.KERNEL_PART), _part_named(cap, export.REST_PART)
    assert ("thread", 100, 102) in rest and ("thread", 100, 102) not in kernel  # the rest part's alone
    for part in (kernel, rest):
        assert {k: named[k] for k in part} == part


def test_stall_arrows_from_either_part(tmp_path: Path) -> None:
    recs, report = _gpu_and_stalls()
    _, two = _same_either_way(tmp_path, _capture(tmp_path / "c.gputrace", recs), report)
    stalls = two.track("stalls", parent="GPU 0: Simulated A100 (simulated)")
    sources = {(two.track_of(src).name, src.name) for src, _ in two.flows_into(stalls)}
    assert sources == {("loader", "pread64"), ("lane 0", "R 64 KiB"), ("off-CPU", "off-CPU (S)"),
                       ("loader", "page fault"), ("stream 7", "gemm")}
    assert len(two.samples) == 6 and len(two.find("cudaLaunchKernel")) == 6


def test_broken_records_are_counted_once(tmp_path: Path) -> None:
    # (the reader leaves out rows with fields of the wrong type; a span that ends before it begins is drawn, fixed)
    recs: list[tuple[Any, ...]] = [
        ProcInfo(T0, 1, 0, "x", [1, None], "/x"),  # type: ignore[list-item]  # stringified, not fatal
        Syscall(1, 1, ["not", "hashable"], T0, T0 + MS, 0, 0, "", 0, 0),  # type: ignore[arg-type]
        OffCpu([1], 1, T0, T0 + MS, "S", T0 + 10, 2, 3, "w"),  # type: ignore[arg-type]
        BlockIO(1, [1], "x", "sda", 0, 512, "R", T0, T0 + MS),  # type: ignore[arg-type]
        GpuKernel(1, 0, 0, 1, "soon", T0, 5, "k", (1, 1, 1), (1, 1, 1)),  # type: ignore[arg-type]
        Syscall(1, 1, "read", T0 + 3 * MS, T0 + 2 * MS, 0, 0, "", 0, 0),  # ends before it begins: fixed
        Syscall(1, 1, "read", T0 + 4 * MS, T0 + 5 * MS, 0, 0, "", 0, 0),
    ]
    cap = _capture(tmp_path / "c.gputrace", recs)
    with CaptureReader(cap) as reader:
        result = PerfettoExporter(tmp_path / "t.pftrace", jobs=2, parallel_min_bytes=0).write(reader)
    assert result.notes == ["1 record(s) ended before they began; drawn with zero duration"]
    (tmp_path / "t.pftrace").unlink()
    _same_either_way(tmp_path, cap)


def test_a_generated_job_with_its_report(tmp_path: Path) -> None:
    cap = tmp_path / "scale.gputrace"
    scale.generate(cap, 30_000, relay=True)
    with CaptureReader(cap) as reader:
        report = analyse(reader)
    assert report["stalls"]
    one, _ = _same_either_way(tmp_path, cap, report)
    assert len(one.flows) > len(report["stalls"])


def test_a_recorded_h100_capture(tmp_path: Path) -> None:
    cap = tmp_path / "h100-cold-throttled.gputrace"
    with lzma.open(CAPTURES / "h100-cold-throttled.gputrace.xz") as src, open(cap, "wb") as dst:
        shutil.copyfileobj(src, dst)
    with CaptureReader(cap) as reader:
        report = analyse(reader)
    one, _ = _same_either_way(tmp_path, cap, report)
    assert len(one.flows) > 1000 and sum(1 for _ in one.all_slices()) > 10_000
    named = _named(one)  # its kernel events are decoded to records: each part's names from those too
    for role in (export.KERNEL_PART, export.REST_PART):
        part = _part_named(cap, role)
        assert {k: named[k] for k in part} == part, role


def test_a_small_capture_is_drawn_by_one_process(tmp_path: Path) -> None:
    cap = _capture(tmp_path / "c.gputrace", _names_from_both_parts())
    with CaptureReader(cap) as reader:
        exporter = PerfettoExporter(tmp_path / "t.pftrace", jobs=2)  # under PARALLEL_MIN_BYTES
        exporter.write(reader)
    assert exporter.parts == 1 and check_trace(tmp_path / "t.pftrace").ok


def _leaves_nothing(tmp_path: Path, cap: Path) -> None:
    assert sorted(os.listdir(tmp_path)) == [cap.name]


def test_a_failing_kernel_part_fails_the_export_and_leaves_nothing(tmp_path: Path,
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    cap = _capture(tmp_path / "c.gputrace", _names_from_both_parts())

    def broken(self: Any) -> dict[str, Any]:
        raise RuntimeError("the kernel part broke")

    monkeypatch.setattr(export._Run, "part_result", broken)  # (inherited by the forked process)
    with CaptureReader(cap) as reader, pytest.raises(UserError, match="kernel records failed: the kernel part broke"):
        PerfettoExporter(tmp_path / "t.pftrace", jobs=2, parallel_min_bytes=0).write(reader)
    _leaves_nothing(tmp_path, cap)

    def killed(self: Any) -> dict[str, Any]:
        os._exit(3)

    monkeypatch.setattr(export._Run, "part_result", killed)
    with CaptureReader(cap) as reader, pytest.raises(JobEnded, match=r"ended without them \(exit status 3\); "
                                                                      "--jobs 1 draws the whole trace"):
        PerfettoExporter(tmp_path / "t.pftrace", jobs=2, parallel_min_bytes=0).write(reader)
    _leaves_nothing(tmp_path, cap)


class _Interrupted(CaptureReader):
    """A capture whose reading is interrupted (Ctrl-C) after its first frame, in this process only."""

    def batches(self, exact: Any = ()) -> Iterator[Any]:
        for n, batch in enumerate(super().batches(exact)):
            if n == 1:
                raise KeyboardInterrupt
            yield batch


def test_an_interrupted_export_ends_its_kernel_part_and_leaves_nothing(tmp_path: Path) -> None:
    cap = _capture(tmp_path / "c.gputrace", _names_from_both_parts())
    with _Interrupted(cap) as reader, pytest.raises(KeyboardInterrupt):
        PerfettoExporter(tmp_path / "t.pftrace", jobs=2, parallel_min_bytes=0).write(reader)
    _leaves_nothing(tmp_path, cap)


def test_no_process_to_fork_draws_the_trace_in_one(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cap = _capture(tmp_path / "c.gputrace", _names_from_both_parts())

    def no_fork() -> int:
        raise BlockingIOError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(os, "fork", no_fork)
    with CaptureReader(cap) as reader:
        exporter = PerfettoExporter(tmp_path / "t.pftrace", jobs=2, parallel_min_bytes=0)
        exporter.write(reader)
    assert exporter.parts == 1 and check_trace(tmp_path / "t.pftrace").ok
    assert sorted(os.listdir(tmp_path)) == ["c.gputrace", "t.pftrace"]
