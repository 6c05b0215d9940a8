"""The capture file: round trip, truncation, corruption, safe creation."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gputrace.capture import CaptureReader, CaptureWriter, host_header, open_capture
from gputrace.errors import CaptureCutOff, CorruptCapture, UserError
from gputrace.records import Drops, GpuKernel, ProcInfo, SourceStatus


def _write(path: Path, n: int = 100) -> Path:
    w = CaptureWriter(path, host_header(["test"]))
    w.write([ProcInfo(1, 42, 1, "python", ["python", "x.py"], "/usr/bin/python3")])
    w.write([GpuKernel(42, 0, 1, 7, i * 10, i * 10 + 5, i, f"k{i}", (1, 1, 1), (32, 1, 1)) for i in range(n)])
    w.write([Drops(5, "ebpf", "ringbuf", 0), SourceStatus(5, "ebpf", "started", "")])
    return w.close({"end_ns": 10_000, "drops": {"ebpf.ringbuf": 0}, "complete": True})


def test_round_trip(tmp_path: Path) -> None:
    path = _write(tmp_path / "a.gputrace")
    with CaptureReader(path) as r:
        recs = list(r.records())
        assert r.complete and r.problem == ""
        assert r.header["clock"] == "CLOCK_MONOTONIC"
        assert r.trailer is not None and r.trailer["counts"]["GpuKernel"] == 100
    kernels = [x for x in recs if isinstance(x, GpuKernel)]
    assert len(kernels) == 100 and kernels[3].name == "k3" and kernels[3].grid == [1, 1, 1]
    assert isinstance(recs[0], ProcInfo) and recs[0].cmdline == ["python", "x.py"]
    assert not list(tmp_path.glob(".*partial")), "temporary file left behind"


def test_truncated_file_reads_as_incomplete(tmp_path: Path) -> None:
    path = _write(tmp_path / "a.gputrace", n=2000)
    data = path.read_bytes()
    cut = tmp_path / "cut.gputrace"
    cut.write_bytes(data[: len(data) * 2 // 3])
    with CaptureReader(cut) as r:
        recs = list(r.records())
        assert not r.complete
        assert "cut off" in r.problem
    assert any(isinstance(x, ProcInfo) for x in recs)


def test_garbage_after_header_is_reported_corrupt(tmp_path: Path) -> None:
    path = _write(tmp_path / "a.gputrace")
    data = bytearray(path.read_bytes())
    data[-400:-340] = b"\xc1" * 60  # 0xc1 is never valid msgpack
    path.write_bytes(bytes(data))
    with CaptureReader(path) as r:
        list(r.records())
        assert not r.complete and r.problem


def test_a_damaged_frame_loses_only_itself(tmp_path: Path) -> None:
    """Bytes flipped inside one batch: the batches after it and the trailer (with its drop counts) are still
    read, and the capture says what was skipped."""
    w = CaptureWriter(tmp_path / "a.gputrace", host_header(["test"]))
    for batch in range(10):
        w.write([GpuKernel(42, 0, 1, 7, i * 10, i * 10 + 5, i, f"k{i}", (1, 1, 1), (32, 1, 1))
                 for i in range(batch * 100, batch * 100 + 100)])  # fmt: skip
    path = w.close({"end_ns": 10_000, "drops": {"ebpf.ringbuf": 7}, "complete": True})
    data = bytearray(path.read_bytes())
    frame5 = data.index(b"k500")  # inside the sixth batch
    data[frame5 : frame5 + 64] = bytes(b ^ 0xFF for b in data[frame5 : frame5 + 64])
    path.write_bytes(bytes(data))
    with CaptureReader(path) as r:
        names = {x.name for x in r.records() if isinstance(x, GpuKernel)}
        assert not r.complete and r.problem.startswith("corrupt frame at byte") and "damaged bytes skipped" in r.problem
        assert r.trailer is not None and r.drops == {"ebpf.ringbuf": 7} and r.skipped_bytes > 0
    assert len(names) == 900 and "k499" in names and "k600" in names and "k550" not in names


def test_a_damaged_header_is_not_called_cut_off(tmp_path: Path) -> None:
    path = _write(tmp_path / "a.gputrace")
    data = bytearray(path.read_bytes())
    data[300] = 0xC1  # never valid msgpack, inside the header's host metadata
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptCapture, match="a capture with a corrupt header"):
        open_capture(path)
    path.write_bytes(bytes(data[:200]))
    with pytest.raises(CorruptCapture, match="cut off inside its header"):
        open_capture(path)


def test_not_a_capture(tmp_path: Path) -> None:
    p = tmp_path / "x.gputrace"
    p.write_bytes(os.urandom(64))
    with pytest.raises(CorruptCapture):
        open_capture(p)
    with pytest.raises(UserError, match="no such capture"):
        open_capture(tmp_path / "missing.gputrace")


def test_existing_output_needs_force(tmp_path: Path) -> None:
    path = _write(tmp_path / "a.gputrace")
    with pytest.raises(UserError, match="--force"):
        CaptureWriter(path, host_header([]))
    w = CaptureWriter(path, host_header([]), force=True)
    w.close({"complete": True})


def test_unwritable_directory_is_refused(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="does not exist"):
        CaptureWriter(tmp_path / "nope" / "a.gputrace", host_header([]))


def test_a_header_that_cannot_be_written_leaves_no_file(tmp_path: Path) -> None:
    """The writer fails on its first frame (here a value msgpack cannot hold): the error is raised and neither
    the output nor its hidden temporary file is left behind in the user's directory."""
    with pytest.raises(TypeError):
        CaptureWriter(tmp_path / "a.gputrace", host_header([]) | {"targets": object()})
    assert list(tmp_path.iterdir()) == []


@pytest.mark.kernel
def test_full_disk_keeps_whole_frames(tmp_path: Path) -> None:
    """A real full filesystem (a tiny tmpfs): the error says so, and the file keeps every whole frame."""
    mnt = tmp_path / "small"
    mnt.mkdir()
    if os.system(f"mount -t tmpfs -o size=64k tmpfs {mnt}") != 0:
        pytest.fail("cannot mount tmpfs (tests run as root)")
    try:
        w = CaptureWriter(mnt / "a.gputrace", host_header([]))
        written = 0
        with pytest.raises(CaptureCutOff, match="No space left") as err:
            for _ in range(100):
                w.write([GpuKernel(1, 0, 0, 0, i, i + 1, i, "k" * 200, (1, 1, 1), (1, 1, 1)) for i in range(100)])
                written += 100
        assert err.value.path == mnt / "a.gputrace"
        assert [p.name for p in mnt.iterdir()] == ["a.gputrace"]
        w.abort()  # what the session does on the way out: the kept file stays
        with CaptureReader(mnt / "a.gputrace") as reader:
            kernels = list(reader.records())
            assert not reader.complete and reader.trailer is None and reader.skipped_bytes == 0
        assert 0 < written == len(kernels)
    finally:
        os.system(f"umount {mnt}")


def test_rows_written_before_a_field_was_added_still_read(tmp_path: Path) -> None:
    """StackSample gained `cpu` (default -1): a capture with 4-field rows reads; a row missing a field
    without a default is corrupt."""
    from gputrace.records import StackSample

    path = tmp_path / "old.gputrace"
    w = CaptureWriter(path, host_header(["test"]))
    w.write_rows("StackSample", [[100, 42, 43, 7], [101, 42, 43, 7, 1]])
    w.close({"complete": True})
    with CaptureReader(path) as r:
        samples = [x for x in r.records() if isinstance(x, StackSample)]
        assert r.problem == ""
    assert samples == [StackSample(100, 42, 43, 7, -1), StackSample(101, 42, 43, 7, 1)]
    bad = tmp_path / "bad.gputrace"
    w = CaptureWriter(bad, host_header(["test"]))
    w.write_rows("StackSample", [[100, 42, 43]])
    w.close({"complete": True})
    with CaptureReader(bad) as r:
        assert not [x for x in r.records() if isinstance(x, StackSample)]
        assert "StackSample row has 3 fields, expected 5" in r.problem


def test_record_kinds_of_a_later_version_are_skipped_and_counted(tmp_path: Path) -> None:
    """A capture written by a later gputrace, with a record kind this one does not know: the rest reads, the
    capture is not called damaged, and the report and the capture summary say what was skipped."""
    from gputrace.analysis import analyze, summary_lines

    path = tmp_path / "later.gputrace"
    w = CaptureWriter(path, host_header(["test"]))
    w.write([ProcInfo(1, 42, 1, "python", ["python"], "/usr/bin/python3")])
    w._frame(["R", "FutureThing", [[1, 2, 3], [4, 5, 6]]])
    w.write([GpuKernel(42, 0, 1, 7, 10, 15, 1, "k1", (1, 1, 1), (32, 1, 1))])
    w.close({"end_ns": 100, "complete": True})
    with CaptureReader(path) as r:
        recs = list(r.records())
        assert r.complete and r.problem == "" and r.unknown_kinds == {"FutureThing": 2}
    assert [type(x).__name__ for x in recs] == ["ProcInfo", "GpuKernel"]
    with open_capture(path) as r:
        report = analyze(r)
    assert report["capture"]["unknown_record_kinds"] == {"FutureThing": 2}
    assert ("note: 2 records of kinds this gputrace does not know were skipped: FutureThing (2); the capture was "
            "written by a later version, which reads them") in summary_lines(report)
