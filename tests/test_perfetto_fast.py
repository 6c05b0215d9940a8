"""The exporter's hot path against the plain encoding: the same bytes.

proto.py's framed_slice, framed_event, int_arg, str_arg, ... must write exactly what framed(track_event(...)) and
debug_args(...) write; the exporter's record handlers, which use them, must write exactly what the plain
handlers below (each record's annotations as a dict, each packet through track_event) write for the same records,
edge values and broken fields included.
"""

from __future__ import annotations

import random
from collections import deque
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gputrace.analysis.timefmt import size_text
from gputrace.capture import CaptureReader, CaptureWriter, exact_columns, host_header
from gputrace.exporters.perfetto import export
from gputrace.exporters.perfetto import proto as pp
from gputrace.exporters.perfetto.args import _DIRECTION
from gputrace.exporters.perfetto.export import _CAT, PerfettoExporter, _Run
from gputrace.exporters.perfetto.links import evidence_key
from gputrace.exporters.perfetto.samples import CpuSamples
from gputrace.exporters.perfetto.tracks import Lane, LaneSet, Tracks
from gputrace.pipeline import analyse
from gputrace.records import (
    BlockIO,
    Collective,
    CudaApi,
    Drops,
    GpuDevice,
    GpuKernel,
    GpuMemcpy,
    GpuMemset,
    GpuSync,
    NvmlSample,
    NvtxRange,
    OffCpu,
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
from gputrace.testing.perfetto_check import check_trace

T0 = 5_000_000_000_000  # above 2**28: timestamps take the split path
EDGE_TS = [0, 1, 127, 128, (1 << 28) - 1, 1 << 28, (1 << 28) + 1, (1 << 42) - 1, 1 << 42, T0, (1 << 63) - 1]
EDGE_INTS = [0, 1, 127, 128, 0x3FFF, 0x4000, (1 << 28) - 1, 1 << 28, (1 << 63) - 1, 1 << 63, 1 << 70, -1, -(1 << 63),
             -(1 << 63) - 1, True, False, 1.5, float("nan"), "7", None, (1, 2), [3]]


# -- the primitives --------------------------------------------------------------------------------------------


def test_timestamp_varints() -> None:
    rng = random.Random(1)
    for ts in EDGE_TS + [rng.randrange(1 << 63) for _ in range(2000)] + [rng.randrange(1 << 40) for _ in range(2000)]:
        assert pp.ts_varint(ts) == pp.varint(ts), ts


def test_framed_events_are_the_plain_packets() -> None:
    rng = random.Random(2)
    fields = [b"", pp.event_name("read") + pp.category("syscall") + pp.debug_args({"fd": 3, "obj": "/x"}),
              pp.debug_args({"long": "x" * 20_000})]  # an event over 16 KiB: its length past 14 bits
    stamps = EDGE_TS + [rng.randrange(1 << 63) for _ in range(300)]
    for _ in range(3000):
        s = rng.choice(stamps)
        e = rng.choice([s, s + 1, s + rng.randrange(1 << 30), rng.choice(stamps)])  # e < s too
        e = min(e, (1 << 63) - 1)
        uuid = rng.choice([1, 127, 128, 20_000, (7 << 32) + 5, rng.randrange(1 << 40)])
        f = rng.choice(fields)
        plain_begin = pp.framed(pp.track_event(pp.SLICE_BEGIN, s, uuid, extra=f))
        plain_end = pp.framed(pp.track_event(pp.SLICE_END, e, uuid))
        assert pp.framed_slice(s, e, uuid, f) == plain_begin + plain_end, (s, e, uuid)
        assert pp.framed_end(e, uuid) == plain_end
        assert pp.framed_slice_of(s, e, pp.slice_template(uuid, f)) == plain_begin + plain_end, (s, e, uuid)
        for etype in (pp.SLICE_BEGIN, pp.INSTANT, pp.COUNTER):
            assert pp.framed_event(etype, s, uuid, f) == pp.framed(pp.track_event(etype, s, uuid, extra=f))


def test_a_wakeup_is_its_plain_packets() -> None:
    rng = random.Random(4)
    fields = [b"", pp.event_name("wake tid 5") + pp.category("sched") + pp.debug_args({"wakee_pid": 5}),
              pp.debug_args({"long": "x" * 20_000})]
    stamps = EDGE_TS + [rng.randrange(1 << 63) for _ in range(300)]
    for _ in range(2000):
        s, wake, e = sorted(rng.choice(stamps) for _ in range(3))
        lane, waker = (rng.choice([1, 127, 128, 20_000, (7 << 32) + 5]) for _ in range(2))
        begin, wake_fields, woken_fields = (rng.choice(fields) for _ in range(3))
        flow = rng.choice([1, 300, 2**64 - 1])
        arrow = pp.flow_id(flow)
        plain = b"".join((pp.framed(pp.track_event(pp.INSTANT, wake, waker, extra=wake_fields, flows=[flow])),
                          pp.framed(pp.track_event(pp.SLICE_BEGIN, s, lane, extra=begin)),
                          pp.framed_slice(wake, e, lane, woken_fields + arrow), pp.framed_end(e, lane)))
        assert pp.framed_wakeup(s, wake, e, lane, begin, waker, wake_fields, woken_fields, flow) == plain


def test_event_fields_are_track_events() -> None:
    for name in ["", "pread64", "bad\udcff name", "x" * 300, 0, 7]:
        plain = pp.track_event(pp.INSTANT, 1, 1, name)  # type: ignore[arg-type]
        assert pp.framed_event(pp.INSTANT, 1, 1, pp.event_name(name)) == pp.framed(plain)  # type: ignore[arg-type]
    flows = [1, 2**64 - 1, -1, 2**70]
    assert pp.flow_ids(flows) == pp.track_event(pp.INSTANT, 1, 1, flows=flows)[len(pp.track_event(pp.INSTANT, 1, 1)):]
    assert all(pp.flow_id(f) == pp.flow_ids([f]) for f in flows)
    rng = random.Random(3)
    for _ in range(500):
        ts, fields, iid = rng.choice(EDGE_TS), pp.sample_fields(rng.randrange(1 << 32), 7, rng.choice([-1, 3])), \
            rng.choice([1, 200, 70_000])
        assert pp.framed_perf_sample(ts, fields, iid) == pp.framed(pp.perf_sample(ts, fields, iid))
        assert pp.framed_sample(ts, pp.sample_tail(fields, iid)) == pp.framed(pp.perf_sample(ts, fields, iid))


@pytest.mark.parametrize("recurring", [False, True])
def test_annotation_encoders_are_debug_args(recurring: bool) -> None:
    encode_int, encode_str = pp.int_arg("nbytes", recurring), pp.str_arg("obj")
    texts = ["", "/data/ä.bin", "bad\udcff", "x" * 20_000]
    for value in EDGE_INTS + texts:
        for _ in range(2):  # the second time from the encoders' caches
            assert encode_int(value) == pp.debug_args({"nbytes": value}), value
            assert encode_str(value) == pp.debug_args({"obj": value}), value
    assert pp.debug_arg("x", 5) == pp.debug_args({"x": 5})


# -- the handlers ----------------------------------------------------------------------------------------------


def _activity_slice(r: Any, coll: Collective | None) -> tuple[str, dict[str, Any]]:
    args: dict[str, Any] = {"correlation_id": r.correlation_id, "pid": r.pid, "context": r.context}
    if isinstance(r, GpuKernel):
        args.update(grid=_dims(r.grid), block=_dims(r.block))
        if coll is not None:
            args.update(collective=coll.name, seq=coll.seq, rank=coll.rank, world=coll.world, bytes=coll.nbytes)
        return r.name, args
    if isinstance(r, GpuMemcpy):
        args.update(bytes=r.nbytes, direction=r.kind, memory=r.memory)
        return f"Memcpy {_DIRECTION.get(r.kind, r.kind)}", args
    args.update(bytes=r.nbytes)
    return "Memset", args


def _dims(v: Any) -> str:
    try:
        return "x".join(str(int(x)) for x in v)
    except (TypeError, ValueError):
        return str(v)


class _PlainRun(_Run):
    """The exporter's run with its handlers written the plain way: annotations as dicts, packets through
    pp.track_event and the sink's put, spans clamped field by field."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.handlers[StackSample] = lambda r: _plain_sample(self.samples, r)
        self.row_handlers = {}  # every record through the plain handlers above, none a frame's rows at a time

    def slice(self, uuid: int, s: int, e: int, name: str, cat: bytes, args: dict[str, Any],
              flows: list[int] | tuple[int, ...] = ()) -> None:
        self.put(pp.track_event(pp.SLICE_BEGIN, s, uuid, name, category=cat, annots=pp.debug_args(args),
                                flows=flows))
        self.put(pp.track_event(pp.SLICE_END, e, uuid))

    def instant(self, uuid: int, ts: int, name: str, cat: bytes, args: dict[str, Any],
                flows: list[int] | tuple[int, ...] = ()) -> None:
        self.put(pp.track_event(pp.INSTANT, ts, uuid, name, category=cat, annots=pp.debug_args(args), flows=flows))

    def span(self, s: int, e: int) -> tuple[int, int]:
        s, e = pp.clamp_ts(s), pp.clamp_ts(e)
        if e < s:
            self.fixed += 1
            e = s
        return s, e

    def syscall(self, r: Syscall) -> None:
        s, e = self.span(r.start_ns, r.end_ns)
        lane = self.thread_lanes(r.pid, r.tid, "").place(s, e)
        args: dict[str, Any] = {"obj": r.obj} if r.obj else {}
        args.update(nbytes=r.nbytes, ret=r.ret, fd=r.fd, arg=r.arg)
        flows = self.stall_links.take(evidence_key("syscall", r.pid, r.tid, r.start_ns))
        self.slice(lane.uuid, s, e, r.name, _CAT["syscall"], args, flows)

    def offcpu(self, r: OffCpu) -> None:
        s, e = self.span(r.start_ns, r.end_ns)
        lane = self.thread_lanes(r.pid, r.tid, "off-CPU").place(s, e)
        name = "runqueue" if r.state == "R" else f"off-CPU ({r.state})"
        args: dict[str, Any] = {"state": r.state}
        if r.wake_ns and s <= r.wake_ns <= e:
            args.update(waker_pid=r.waker_pid, waker_tid=r.waker_tid, waker_comm=r.waker_comm, wake_ns=r.wake_ns)
        if r.held_tid:
            args.update(cpu_from_pid=r.held_pid, cpu_from_tid=r.held_tid, cpu_from_comm=r.held_comm)
        flows = self.stall_links.take(evidence_key("offcpu", r.pid, r.tid, r.start_ns))
        packets = [pp.track_event(pp.SLICE_BEGIN, s, lane.uuid, name, category=_CAT["sched"],
                                  annots=pp.debug_args(args), flows=flows)]
        if r.wake_ns and s <= r.wake_ns <= e and r.waker_tid:
            flow = self.flows.new()
            wake = pp.clamp_ts(r.wake_ns)
            packets.insert(0, pp.track_event(pp.INSTANT, wake, self.waker_track(r), f"wake tid {r.tid}",
                                             category=_CAT["sched"], flows=(flow,),
                                             annots=pp.debug_args({"wakee_pid": r.pid, "wakee_tid": r.tid})))
            packets += [pp.track_event(pp.SLICE_BEGIN, wake, lane.uuid, f"woken by {r.waker_comm or r.waker_tid}",
                                       category=_CAT["sched"], flows=(flow,),
                                       annots=pp.debug_args({"waker_pid": r.waker_pid, "waker_tid": r.waker_tid})),
                        pp.track_event(pp.SLICE_END, e, lane.uuid)]
            lane.add(wake, e)
        packets.append(pp.track_event(pp.SLICE_END, e, lane.uuid))
        for packet in packets:
            self.put(packet)

    def block(self, r: BlockIO) -> None:
        s, e = self.span(r.issue_ns, r.complete_ns)
        dev = r.dev or "?"
        self.tracks.refresh_comm(r.pid, r.tid, r.comm)

        def make(n: int) -> int:
            parent = self.tracks.track(("blk", dev), f"block {dev}")
            return self.tracks.track(("blk", dev, n), f"lane {n}", parent)

        lane = self.laneset(("blk", dev), make).place(s, e)
        args = {"pid": r.pid, "tid": r.tid, "comm": r.comm, "sector": r.sector, "bytes": r.nbytes,
                "rwbs": r.rwbs, "latency_ns": e - s}
        flows = self.stall_links.take(evidence_key("block", r.pid, r.tid, r.issue_ns))
        self.slice(lane.uuid, s, e, f"{r.rwbs} {size_text(r.nbytes)}", _CAT["block"], args, flows)

    def _write_gpu(self, r: Any, flow: int) -> None:
        flows: tuple[int, ...] = (flow,) if flow else ()
        if isinstance(r, CudaApi):
            s, e = self.span(r.start_ns, r.end_ns)
            lane = self.thread_lanes(r.pid, r.tid, "CUDA API").place(s, e)
            flows += tuple(self.stall_links.take(evidence_key("gpu", r.pid, 0, r.start_ns)))
            self.slice(lane.uuid, s, e, r.name, _CAT["cuda"],
                       {"correlation_id": r.correlation_id, "api": r.api, "result": r.result}, flows)
            return
        s, e = self.span(r.start_ns, r.end_ns)
        lane = self.stream_lanes(self.devices.key(r.pid, r.device), r.pid, r.stream).place(s, e)
        name, args = _activity_slice(r, self.collectives.pop((r.pid, r.correlation_id), None))
        flows = flows + tuple(self.stall_links.take(evidence_key("gpu", r.pid, 0, r.start_ns)))
        self.slice(lane.uuid, s, e, name, _CAT["gpu"], args, flows)


def _plain_sample(self: CpuSamples, r: StackSample) -> None:
    key = (r.pid, r.stack)
    ready = self._ready(r)
    if key in self._stacks:
        self._write(ready, key)
        return
    self._pending.setdefault(key, deque()).append(ready)
    self._npending += 1
    if self._npending > self._cap:
        self._evict_oldest()


def _plain_place(self: LaneSet, s: int, e: int) -> Lane:
    for lane in self.lanes:
        if lane.fits(s, e):
            lane.add(s, e)
            return lane
    lane = Lane(self._make(len(self.lanes)), self._nest)
    self.lanes.append(lane)
    lane.add(s, e)
    return lane


def _plain_thread(self: Tracks, pid: int, tid: int) -> int:
    u = self._uuid(("t", pid, tid))
    if u not in self._described:
        self.process(pid)
        self._describe_thread(pid, tid, u)
    return u


def _both(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, write: Any) -> tuple[bytes, bytes, list[str]]:
    """What ``write(out)`` writes with the exporter as it is, and with its plain handlers."""
    fast = write(tmp_path / "fast.pftrace")
    with monkeypatch.context() as m:
        m.setattr(export, "_Run", _PlainRun)
        m.setattr(LaneSet, "place", _plain_place)
        m.setattr(Tracks, "thread", _plain_thread)
        plain = write(tmp_path / "plain.pftrace")
    assert (fast.items, fast.notes) == (plain.items, plain.notes)
    return (tmp_path / "fast.pftrace").read_bytes(), (tmp_path / "plain.pftrace").read_bytes(), fast.notes


class _Reader:
    def __init__(self, records: list[tuple[Any, ...]]) -> None:
        self._records = records
        self.header = {"start_ns": T0, "mono_to_realtime_ns": 0}
        self.complete, self.problem = True, ""

    def records(self) -> Iterator[tuple[Any, ...]]:
        yield from self._records


def _mixed(rng: random.Random, n: int) -> list[tuple[Any, ...]]:
    """Every kind the fast handlers draw, with edge values: small and huge times, ends before starts, bools and
    floats and strings in int fields, wakeups inside and outside the wait and from interrupts, launches before and
    after their work, a device named after its kernels, samples before their stacks."""
    recs: list[tuple[Any, ...]] = [ProcInfo(0, 1, 0, "trainer", ["python", "t.py"], "/usr/bin/python3"),
                                   ThreadInfo(0, 1, 2, "loader"), StackSample(T0 + 5, 1, 2, 9, 3)]
    vals: list[Any] = [0, 5, 4096, 1 << 20, (1 << 28) + 3, 1 << 40, (1 << 63) - 1, 1 << 64, -1, -11, True, False]
    for i in range(n):
        t = rng.choice([T0 + i * 10_000, T0 + i * 10_000, rng.choice(EDGE_TS), 100 + i])
        d = rng.choice([0, 1, 5_000, 1 << 29, -3])
        pid, tid = rng.choice([(1, 2), (1, 1), (3, 4), (True, 2), ((1 << 22) + 1, 9)])
        v = rng.choice(vals)
        corr = rng.choice([0, i + 1, i // 2 + 1, i])
        recs += [
            Syscall(pid, tid, rng.choice(["pread64", "read", "", "fütex"]), t, t + d, v, rng.choice([3, -1, v]),
                    rng.choice(["", "/data/ä.bin", "pipe"]), rng.choice([v, 0, 4096]), rng.choice([0, v])),
            OffCpu(pid, tid, t, t + d, rng.choice(["S", "R", "D"]), rng.choice([0, t, t + d // 2, t + d + 1, True]),
                   rng.choice([0, 7, 300]), rng.choice([0, 301, 2, True]), rng.choice(["", "fuse-srv", "wörker"]),
                   rng.choice([0, 5]), rng.choice([0, 6, 1]), rng.choice(["", "other"])),
            BlockIO(pid, tid, rng.choice(["loader", ""]), rng.choice(["loop0", "", "nvme0n1"]), rng.choice([i, v]),
                    rng.choice([4096, 512 << 10, 3, True, v]), rng.choice(["R", "WS"]), t, t + d),
            CudaApi(pid, tid, rng.choice(["cudaLaunchKernel", "cudaMemcpyAsync", "cudaGetDevice"]), t, t + 9, corr,
                    "runtime", rng.choice([0, 2, True])),
            rng.choice([
                GpuKernel(pid, 0, 1, rng.choice([7, 8]), t + 10, t + 10 + d, corr, "gemm",
                          rng.choice([(1, 1, 1), [2, 3, 4], (True, 1, 1), (1.5, 2, 3), "abc", [1, 2]]), (128, 1, 1)),
                GpuMemcpy(pid, 0, 1, 7, t + 10, t + 10 + d, corr, v, rng.choice(["h2d", "zz"]), "pinned"),
                GpuMemset(pid, 0, 1, 7, t + 10, t + 10 + d, corr, v),
            ]),
            StackSample(t, pid, tid, rng.randrange(12), rng.choice([-1, 0, 3])),
        ]
        if i % 17 == 0:
            recs += [Collective(1, 0, corr, "all_reduce", i, 0, 2, 1 << 20, "nccl"),
                     StackFrames(1, rng.randrange(12), [f"f{i} (libx.so)", "main (python3)", "noparen"])]
        if i % 29 == 0:
            recs += [GpuDevice(0, "sim", True, "uuid", 1), GpuSync(1, 2, 0, 1, 7, t, t + d, corr, "stream"),
                     NvtxRange(1, 2, "step", t, t + d, "dom"), NvmlSample(t, 0, "gpu_util_pct", 50.0),
                     Drops(t, "ebpf", "events", i), ProcFork(t, 1, 2, 1, 50 + i, True, "w"),
                     ProcExec(t, 1, 2, "x", "/bin/x"), ProcExit(t, 1, 2, "x")]
    broken: list[Any] = [  # fields no reader lets through: refused whole
        Syscall(1, 2, ["x"], T0, T0 + 1, 0, 3, "", 0, 0), OffCpu(1, 2, "soon", T0, "S", 0, 0, 0, ""),
        BlockIO([1], 2, "c", "d", 0, 1, "R", T0, T0 + 1), CudaApi(1, 2, None, T0, T0 + 1, 5, "runtime", 0),
        GpuKernel([1], 0, 1, 7, T0, T0 + 1, 0, "k", (1, 1, 1), (1, 1, 1)), StackSample(T0, "1", 2, 1),
        OffCpu(1, 2, T0, T0 + 1, ["S"], 0, 0, 0, ""), BlockIO(1, 2, "c", "d", 0, 1, ["R"], T0, T0 + 1)]
    for r in broken:
        recs.insert(rng.randrange(len(recs)), r)
    return recs


def _report(recs: list[tuple[Any, ...]]) -> dict[str, Any]:
    """Stalls whose evidence names some of the records' slices, so their arrows are drawn."""
    ev = []
    for r in recs[::7]:
        if isinstance(r, Syscall):
            ev.append({"kind": "syscall", "pid": r.pid, "tid": r.tid, "start_ns": r.start_ns})
        elif isinstance(r, OffCpu):
            ev.append({"kind": "wakeup", "pid": r.pid, "tid": r.tid, "start_ns": r.start_ns})
        elif isinstance(r, BlockIO):
            ev.append({"kind": "block", "pid": r.pid, "tid": r.tid, "start_ns": r.issue_ns})
        elif isinstance(r, CudaApi | GpuKernel | GpuMemcpy | GpuMemset):
            ev.append({"kind": "gpu", "pid": r.pid, "start_ns": r.start_ns})
    stalls = [{"start_ns": 0, "end_ns": (1 << 63) - 1, "cause": "io", "device": 0, "evidence": ev[k::3]}
              for k in range(3)]
    return {"stalls": stalls, "devices": [{"id": 0, "pid": 1, "name": "sim", "simulated": True,
                                           "cuda_ids": [{"pid": 1, "id": 0}]}]}


@pytest.mark.parametrize(("seed", "pending_cap", "with_report"), [(1, 50_000, False), (2, 3, False), (3, 50_000, True),
                                                                  (4, 2, True)])
def test_fast_handlers_write_what_the_plain_ones_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int,
                                                      pending_cap: int, with_report: bool) -> None:
    recs = _mixed(random.Random(seed), 400)
    report = _report(recs) if with_report else None

    def write(out: Path) -> Any:
        return PerfettoExporter(out, report=report, pending_cap=pending_cap).write(_Reader(recs))  # type: ignore[arg-type]

    fast, plain, notes = _both(tmp_path, monkeypatch, write)
    assert len(fast) > 100_000 and fast == plain
    assert any("malformed" in n for n in notes)  # the edge values did reach the handlers' error paths


def test_fast_handlers_on_a_capture_with_its_report(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cap = tmp_path / "scale.gputrace"
    scale.generate(cap, 6_000, relay=True)
    with CaptureReader(cap) as reader:
        report = analyse(reader)
    assert report["stalls"]

    def write(out: Path) -> Any:
        with CaptureReader(cap) as reader:
            return PerfettoExporter(out, report=report).write(reader)

    fast, plain, _ = _both(tmp_path, monkeypatch, write)
    assert fast == plain
    check = check_trace(tmp_path / "fast.pftrace")
    assert check.problems == [] and check.flows  # the stalls' arrows are drawn


@pytest.mark.parametrize(("seed", "pending_cap", "with_report", "exact_only"),
                         [(5, 50_000, False, True), (6, 3, True, True), (7, 50_000, True, False)])
def test_row_handlers_write_what_the_plain_ones_write(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int,
                                                      pending_cap: int, with_report: bool, exact_only: bool) -> None:
    """A capture's frames of exactly typed rows go to the row handlers (the rest to the record handlers): the
    same file as the plain handlers write, edge values included."""
    def storable(r: tuple[Any, ...]) -> bool:  # msgpack holds ints up to 2**64 - 1
        return all(not (type(v) is int and v >= 1 << 64) for v in r)

    def exact(r: tuple[Any, ...]) -> bool:
        return exact_columns(type(r).__name__, [[list(v) if type(v) is tuple else v for v in r]]) is not None

    recs = [r for r in _mixed(random.Random(seed), 400) if storable(r) and (exact(r) or not exact_only)]
    cap = tmp_path / "mixed.gputrace"
    w = CaptureWriter(cap, host_header(["test"]))
    for i in range(0, len(recs), 300):
        w.write(recs[i:i + 300])
    w.close({"complete": True})
    report: Any = _report(recs) if with_report else None

    def write(out: Path) -> Any:
        with CaptureReader(cap) as reader:
            return PerfettoExporter(out, report=report, pending_cap=pending_cap).write(reader)

    fast, plain, _ = _both(tmp_path, monkeypatch, write)
    assert len(fast) > 100_000 and fast == plain
