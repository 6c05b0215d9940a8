"""The hand-written packet encoder, decoded with the official Perfetto protos."""

from __future__ import annotations

import pytest
from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

from gputrace.exporters.perfetto import proto as pp


def _packet(raw: bytes) -> pb.TracePacket:
    trace = pb.Trace()
    trace.ParseFromString(pp.framed(raw))
    assert len(trace.packet) == 1
    return trace.packet[0]


@pytest.mark.parametrize("n", [0, 1, 127, 128, 300, 2**32, 2**63 - 1, 2**64 - 1])
def test_varint_round_trip(n: int) -> None:
    pkt = _packet(pp.f_varint(8, n))
    assert pkt.timestamp == n


def test_track_event_fields() -> None:
    annots = pp.debug_args({"obj": "/data/ä.bin", "ret": -11, "nbytes": 4096, "ok": True, "x": 1.5,
                             "big": 2**70, "dims": (1, 2)})
    raw = pp.track_event(pp.SLICE_BEGIN, 123456789, 42, "pread64", category=pp.category("syscall"),
                         annots=annots, flows=(7, 2**64 - 1), terminating_flows=(9,))
    pkt = _packet(raw)
    assert pkt.timestamp == 123456789 and pkt.timestamp_clock_id == pp.CLOCK_MONOTONIC
    assert pkt.trusted_packet_sequence_id == pp.SEQUENCE_ID
    ev = pkt.track_event
    assert ev.type == pb.TrackEvent.TYPE_SLICE_BEGIN and ev.track_uuid == 42 and ev.name == "pread64"
    assert list(ev.categories) == ["syscall"]
    assert list(ev.flow_ids) == [7, 2**64 - 1] and list(ev.terminating_flow_ids) == [9]
    values = {a.name: getattr(a, a.WhichOneof("value")) for a in ev.debug_annotations}
    assert values == {"obj": "/data/ä.bin", "ret": -11, "nbytes": 4096, "ok": True, "x": 1.5,
                      "big": str(2**70), "dims": "(1, 2)"}


def test_negative_and_huge_timestamps_are_clamped() -> None:
    assert _packet(pp.track_event(pp.INSTANT, -5, 1)).timestamp == 0
    assert _packet(pp.track_event(pp.INSTANT, 2**70, 1)).timestamp == 2**63 - 1


def test_invalid_utf8_text_does_not_break_encoding() -> None:
    pkt = _packet(pp.track_event(pp.INSTANT, 1, 1, "bad\udcff name"))
    assert pkt.track_event.name.startswith("bad") and pkt.track_event.name.endswith("name")


def test_descriptors() -> None:
    proc = _packet(pp.track_descriptor(1, process=(4242, "python", ["python", "train.py"]))).track_descriptor
    assert proc.uuid == 1 and proc.process.pid == 4242 and proc.process.process_name == "python"
    assert list(proc.process.cmdline) == ["python", "train.py"]
    thr = _packet(pp.track_descriptor(2, thread=(4242, 4243, "loader"), description="d")).track_descriptor
    assert (thr.thread.pid, thr.thread.tid, thr.thread.thread_name, thr.description) == (4242, 4243, "loader", "d")
    child = _packet(pp.track_descriptor(3, name="off-CPU", parent=2)).track_descriptor
    assert child.name == "off-CPU" and child.parent_uuid == 2 and not child.HasField("thread")
    ctr = _packet(pp.track_descriptor(4, name="gpu_util_pct", parent=3, counter_unit="%")).track_descriptor
    assert ctr.HasField("counter") and ctr.counter.unit_name == "%"


def test_counter_clock_snapshot_and_sequence_start() -> None:
    ev = _packet(pp.counter_event(10, 4, 87.5)).track_event
    assert ev.type == pb.TrackEvent.TYPE_COUNTER and ev.double_counter_value == 87.5
    snap = _packet(pp.clock_snapshot(1000, 1_700_000_000_000_001_000, 1500)).clock_snapshot
    assert {c.clock_id: c.timestamp for c in snap.clocks} == {6: 1500, 3: 1000, 1: 1_700_000_000_000_001_000}
    start = _packet(pp.sequence_start())
    assert start.sequence_flags == pb.TracePacket.SEQ_INCREMENTAL_STATE_CLEARED
    assert start.trace_packet_defaults.timestamp_clock_id == pp.CLOCK_MONOTONIC


def test_perf_sample_and_interned_stack_entries() -> None:
    interned = (pp.interned_string(5, 1, "decode_block") + pp.interned_string(17, 1, "libjpeg.so.62")
                + pp.interned_mapping(1, 1) + pp.interned_mapping(2, 0) + pp.interned_frame(1, 1, 1)
                + pp.interned_callstack(1, [3, 2, 1]))
    pkt = _packet(pp.perf_sample(-1, pp.sample_fields(4242, 4243), 1, interned))
    assert pkt.timestamp == 0 and pkt.timestamp_clock_id == pp.CLOCK_MONOTONIC
    assert pkt.trusted_packet_sequence_id == pp.SEQUENCE_ID
    assert pkt.sequence_flags == pb.TracePacket.SEQ_NEEDS_INCREMENTAL_STATE
    ps = pkt.perf_sample
    assert (ps.pid, ps.tid, ps.callstack_iid, ps.cpu_mode) == (4242, 4243, 1, pb.Profiling.MODE_USER)
    assert not ps.HasField("cpu")  # records do not say which CPU
    data = pkt.interned_data
    assert [(s.iid, s.str) for s in data.function_names] == [(1, b"decode_block")]
    assert [(s.iid, s.str) for s in data.mapping_paths] == [(1, b"libjpeg.so.62")]
    assert [(m.iid, list(m.path_string_ids)) for m in data.mappings] == [(1, [1]), (2, [])]
    [f] = data.frames
    assert (f.iid, f.function_name_id, f.mapping_id, f.rel_pc) == (1, 1, 1, 0)
    assert [(c.iid, list(c.frame_ids)) for c in data.callstacks] == [(1, [3, 2, 1])]
    assert not _packet(pp.perf_sample(5, pp.sample_fields(1, 1), 1)).HasField("interned_data")
