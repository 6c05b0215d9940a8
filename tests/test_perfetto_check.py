"""The trace validator: hand-built traces (official protos), valid and broken, must be judged right."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from perfetto.protos.perfetto.trace import perfetto_trace_pb2 as pb

from gputrace.errors import UserError
from gputrace.testing.perfetto_check import check_trace

B, E, INST, C = 1, 2, 3, 4


class _Trace:
    def __init__(self, *, snapshot: bool = True, clock: int | None = 3) -> None:
        self.trace = pb.Trace()
        if snapshot:
            pkt = self.trace.packet.add()
            pkt.clock_snapshot.clocks.add(clock_id=6, timestamp=1000)
            pkt.clock_snapshot.clocks.add(clock_id=3, timestamp=1000)
        self.clock = clock

    def thread(self, uuid: int, pid: int, tid: int, name: str) -> _Trace:
        td = self.trace.packet.add().track_descriptor
        td.uuid, td.thread.pid, td.thread.tid, td.thread.thread_name = uuid, pid, tid, name
        return self

    def track(self, uuid: int, name: str, parent: int = 0, counter: bool = False) -> _Trace:
        td = self.trace.packet.add().track_descriptor
        td.uuid, td.name = uuid, name
        if parent:
            td.parent_uuid = parent
        if counter:
            td.counter.unit_name = "%"
        return self

    def ev(self, t: int, ts: int, uuid: int, name: str = "", flows: tuple[int, ...] = (), **kw: Any) -> _Trace:
        pkt = self.trace.packet.add()
        pkt.timestamp, pkt.trusted_packet_sequence_id = ts, 1
        if self.clock is not None:
            pkt.timestamp_clock_id = self.clock
        te = pkt.track_event
        te.type, te.track_uuid = t, uuid
        if name:
            te.name = name
        te.flow_ids.extend(flows)
        for k, v in kw.items():
            a = te.debug_annotations.add(name=k)
            a.int_value = v
        return self

    def counter(self, ts: int, uuid: int, value: float) -> _Trace:
        self.ev(C, ts, uuid)
        self.trace.packet[-1].track_event.double_counter_value = value
        return self

    def save(self, path: Path) -> Path:
        path.write_bytes(self.trace.SerializeToString())
        return path


def test_valid_trace_is_parsed(tmp_path: Path) -> None:
    t = (_Trace().thread(1, 10, 11, "worker").track(2, "off-CPU", parent=1).track(3, "util", counter=True)
         .ev(B, 100, 1, "read", flows=(5,), fd=3).ev(B, 110, 1, "inner").ev(E, 120, 1).ev(E, 200, 1)
         .ev(INST, 150, 1, "mark").ev(B, 300, 2, "off-CPU (S)", flows=(5,)).ev(E, 400, 2)
         .counter(100, 3, 1.5).counter(200, 3, 2.5))
    check = check_trace(t.save(tmp_path / "ok.pftrace"))
    assert check.problems == []
    read, inner, mark = check.slices_on(check.thread(11))
    assert (read.name, read.ts, read.dur, read.depth, read.args) == ("read", 100, 100, 0, {"fd": 3})
    assert (inner.depth, mark.depth, mark.instant) == (1, 1, True)
    [(src, dst)] = check.flows
    assert src is read and dst.name == "off-CPU (S)"
    assert check.parent_name(check.track("off-CPU")) == "worker"
    assert check.counters[3] == [(100, 1.5), (200, 2.5)]
    assert check.tree() == "thread worker\n  track off-CPU\ntrack util".replace("track util", "counter util")


def _problems(tmp_path: Path, t: _Trace) -> str:
    check = check_trace(t.save(tmp_path / "bad.pftrace"))
    assert not check.ok
    return "\n".join(check.problems)


def test_event_before_descriptor(tmp_path: Path) -> None:
    t = _Trace().ev(B, 100, 1, "x").ev(E, 200, 1).thread(1, 10, 11, "w")
    assert "before (or without) its descriptor" in _problems(tmp_path, t)


def test_child_before_parent(tmp_path: Path) -> None:
    t = _Trace().track(2, "child", parent=1).track(1, "parent")
    assert "parent 1 not described before it" in _problems(tmp_path, t)


def test_unbalanced_slices(tmp_path: Path) -> None:
    t = _Trace().track(1, "t").ev(B, 100, 1, "open-ended").ev(E, 50, 1).ev(E, 60, 1)
    text = _problems(tmp_path, t)
    assert "ends (50) before it begins (100)" in text and "with no open slice" in text
    t = _Trace().track(1, "t").ev(B, 100, 1, "never")
    assert "'never' at 100 never ends" in _problems(tmp_path, t)


def test_partial_overlap_on_one_track(tmp_path: Path) -> None:
    t = _Trace().track(1, "t").ev(B, 0, 1, "a").ev(E, 10, 1).ev(B, 5, 1, "b").ev(E, 15, 1)
    assert "overlaps" in _problems(tmp_path, t)


def test_equal_timestamps_resolved_by_file_order(tmp_path: Path) -> None:
    # b written before a's end, both at 10: Perfetto would close b with a's end.
    t = _Trace().track(1, "t").ev(B, 10, 1, "b").ev(E, 20, 1).ev(B, 0, 1, "a").ev(E, 10, 1)
    assert "overlaps" in _problems(tmp_path, t)
    ok = _Trace().track(1, "t").ev(B, 0, 1, "a").ev(E, 10, 1).ev(B, 10, 1, "b").ev(E, 20, 1)
    assert check_trace(ok.save(tmp_path / "ok.pftrace")).ok


def test_dangling_flow(tmp_path: Path) -> None:
    t = _Trace().track(1, "t").ev(B, 0, 1, "a", flows=(77,)).ev(E, 10, 1)
    assert "flow 77 has one end only" in _problems(tmp_path, t)


def test_wrong_clock_and_missing_snapshot(tmp_path: Path) -> None:
    t = _Trace(clock=6).track(1, "t").ev(INST, 0, 1, "a")
    assert "clock 6, not CLOCK_MONOTONIC" in _problems(tmp_path, t)
    t = _Trace(clock=None).track(1, "t").ev(INST, 0, 1, "a")  # no defaults: BOOTTIME
    assert "clock 6" in _problems(tmp_path, t)
    t = _Trace(snapshot=False).track(1, "t").ev(INST, 0, 1, "a")
    assert "no clock snapshot" in _problems(tmp_path, t)


def test_sequence_defaults_count_as_monotonic(tmp_path: Path) -> None:
    t = _Trace(clock=None)
    pkt = t.trace.packet.add()
    pkt.trusted_packet_sequence_id = 1
    pkt.trace_packet_defaults.timestamp_clock_id = 3
    t.track(1, "t").ev(INST, 0, 1, "a")
    assert check_trace(t.save(tmp_path / "ok.pftrace")).ok


def test_counter_on_slice_track_and_redescribed_track(tmp_path: Path) -> None:
    t = _Trace().track(1, "t").counter(0, 1, 1.0)
    assert "counter value on non-counter track" in _problems(tmp_path, t)
    t = _Trace().track(1, "t").thread(1, 5, 6, "w")
    assert "re-described as a different track" in _problems(tmp_path, t)


def test_not_a_trace(tmp_path: Path) -> None:
    p = tmp_path / "x.pftrace"
    p.write_bytes(b"\x0a\xff\xff\xff\xff\x0f")
    with pytest.raises(UserError, match="not a Perfetto trace"):
        check_trace(p)


def _cli(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gputrace.testing.perfetto_check", str(path), "--tree"],
                          capture_output=True, text=True, timeout=60)


def test_command_line(tmp_path: Path) -> None:
    good = _Trace().thread(1, 10, 11, "w").ev(B, 0, 1, "a").ev(E, 5, 1).save(tmp_path / "good.pftrace")
    r = _cli(good)
    assert r.returncode == 0 and r.stdout.splitlines() == ["thread w", "OK: 4 packets, 1 tracks, 1 slices, "
                                                           "0 flows, 0 counter values, 0 CPU samples"]
    bad = _Trace().track(1, "t").ev(B, 0, 1, "a").save(tmp_path / "bad.pftrace")
    r = _cli(bad)
    assert r.returncode == 1 and "never ends" in r.stdout
    (tmp_path / "junk").write_bytes(b"\x0a\xff\xff\xff\xff\x0f")
    r = _cli(tmp_path / "junk")
    assert r.returncode == 2 and "not a Perfetto trace" in r.stderr


# ---------------------------------------------------------------------------------- CPU samples ---

NEEDS = pb.TracePacket.SEQ_NEEDS_INCREMENTAL_STATE


class _Samples(_Trace):
    """A trace with a thread, a cleared sequence, and interned stacks as traced_perf writes them."""

    def __init__(self, *, cleared: bool = True) -> None:
        super().__init__()
        if cleared:
            pkt = self.trace.packet.add()
            pkt.trusted_packet_sequence_id = 1
            pkt.sequence_flags = pb.TracePacket.SEQ_INCREMENTAL_STATE_CLEARED
        self.thread(1, 10, 11, "worker")

    def intern(self, names: tuple[str, ...] = ("main", "decode"), frames: tuple[tuple[int, int, int], ...] = (
            (1, 1, 1), (2, 2, 1)), stacks: tuple[tuple[int, tuple[int, ...]], ...] = ((1, (1, 2)),)) -> _Samples:
        pkt = self.trace.packet.add()
        pkt.trusted_packet_sequence_id, pkt.sequence_flags = 1, NEEDS
        data = pkt.interned_data
        for i, name in enumerate(names, 1):
            data.function_names.add(iid=i, str=name.encode())
        data.mapping_paths.add(iid=1, str=b"worker")
        data.mappings.add(iid=1, path_string_ids=[1])
        for iid, name, mapping in frames:
            data.frames.add(iid=iid, function_name_id=name, mapping_id=mapping)
        for iid, ids in stacks:
            data.callstacks.add(iid=iid, frame_ids=ids)
        return self

    def sample(self, ts: int, cs: int, pid: int = 10, tid: int = 11, flags: int = NEEDS) -> _Samples:
        pkt = self.trace.packet.add()
        pkt.timestamp, pkt.timestamp_clock_id, pkt.trusted_packet_sequence_id = ts, 3, 1
        pkt.sequence_flags = flags
        pkt.perf_sample.pid, pkt.perf_sample.tid, pkt.perf_sample.callstack_iid = pid, tid, cs
        return self


def test_samples_resolve_their_interned_callstacks(tmp_path: Path) -> None:
    check = check_trace(_Samples().intern().sample(100, 1).sample(200, 1).save(tmp_path / "ok.pftrace"))
    assert check.problems == []
    assert [(s.ts, s.pid, s.tid, s.frames, s.leaf) for s in check.samples] == [
        (ts, 10, 11, ["main (worker)", "decode (worker)"], "decode (worker)") for ts in (100, 200)]


def test_sample_with_undefined_ids(tmp_path: Path) -> None:
    t = _Samples().intern().sample(100, 9)
    assert "CPU sample uses callstacks iid 9, not interned before" in _problems(tmp_path, t)
    t = _Samples().intern(stacks=((1, (1, 7)),)).sample(100, 1)
    assert "callstack 1 uses frames iid 7" in _problems(tmp_path, t)
    t = _Samples().intern(frames=((1, 5, 1), (2, 2, 3))).sample(100, 1)
    problems = _problems(tmp_path, t)
    assert "frame 1 uses function_names iid 5" in problems and "frame 2 uses mappings iid 3" in problems


def test_interned_data_is_per_sequence_and_cleared(tmp_path: Path) -> None:
    t = _Samples().intern()
    t.trace.packet[-1].trusted_packet_sequence_id = 2  # interned on another sequence
    t.sample(100, 1)
    assert "interned data before its sequence cleared" in _problems(tmp_path, t)
    t = _Samples().intern()
    t.trace.packet.add(trusted_packet_sequence_id=1, sequence_flags=1)  # state cleared again: ids forgotten
    t.sample(100, 1)
    assert "callstacks iid 1, not interned before" in _problems(tmp_path, t)
    t = _Samples(cleared=False).sample(100, 1)
    assert "before its sequence cleared" in _problems(tmp_path, t)


def test_bad_callstacks_flags_threads_and_timestamps(tmp_path: Path) -> None:
    t = _Samples().intern(stacks=((1, ()),)).sample(100, 1)
    assert "callstack 1 has no frames" in _problems(tmp_path, t)
    t = _Samples().intern().sample(100, 1, flags=0)
    assert "without SEQ_NEEDS_INCREMENTAL_STATE" in _problems(tmp_path, t)
    t = _Samples().intern().sample(100, 1, pid=77, tid=78)
    assert "pid 77 tid 78: no such thread or process" in _problems(tmp_path, t)
    t = _Samples().intern().sample(0, 1)
    assert "without a plausible timestamp (0)" in _problems(tmp_path, t)
    t = _Samples().intern()
    t.intern(names=("other", "decode"))  # iid 1 now means another name
    assert "function_names iid 1 redefined" in _problems(tmp_path, t)
    ok = _Samples().intern().sample(100, 1, tid=12)  # an undescribed thread of a known process is accepted
    assert check_trace(ok.save(tmp_path / "ok.pftrace")).ok
