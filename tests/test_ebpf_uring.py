"""io_uring reads traced for real: a process reads a cold file on a loop-device ext4 through a ring
(tests/workloads/uring_read.c, raw syscalls), inline and through io-wq worker threads (IOSQE_ASYNC), and
waits in io_uring_enter(GETEVENTS). One record per request names the file, fd, opcode and bytes; the wait is
an io_uring_enter syscall record; the requests show in Perfetto on the submitting thread."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import NamedTuple

import pytest
from workloads import uring_reader
from workloads.ebpfcap import ebpf_capture, of, read_capture
from workloads.loopdev import LoopFs, write_file

from gputrace.analysis import analyze, summary_lines
from gputrace.capture import open_capture
from gputrace.exporters.perfetto.export import PerfettoExporter
from gputrace.probes.ebpf import events, final, hooks, uring
from gputrace.probes.ebpf.host import uring_supported
from gputrace.records import BlockIO, Drops, InProgress, IoUringRequest, OffCpu, Syscall, SyscallAgg
from gputrace.testing.perfetto_check import check_trace

pytestmark = pytest.mark.kernel  # root and the host's kernel (see tests/conftest.py)

WORKLOADS = Path(__file__).parent / "workloads"
SIZE, CHUNK, DEPTH = (3 << 20) + 4096, 1 << 20, 2
DROP_CACHE, ASYNC = uring_reader.DROP_CACHE, uring_reader.ASYNC


@pytest.fixture(scope="module")
def lib(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return uring_reader.build(tmp_path_factory.mktemp("uring"))


class Reader:
    """tests/workloads/uring_reader.py, driven line by line."""

    def __init__(self, lib: Path) -> None:
        self.proc = subprocess.Popen([sys.executable, str(WORKLOADS / "uring_reader.py"), str(lib)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)  # fmt: skip
        word, pid, ring = self._line()
        assert word == "ready", word
        self.pid, self.ring = int(pid), int(ring)

    def _line(self) -> list[str]:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().split()

    def read(self, path: Path, flags: int, chunk: int = CHUNK, depth: int = DEPTH) -> tuple[int, int, int, int]:
        """(tid, the file's fd, bytes read, requests made)."""
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{path} {chunk} {depth} {flags}\n")
        self.proc.stdin.flush()
        word, tid, fd, n, made = self._line()
        assert word == "read", word
        return int(tid), int(fd), int(n), int(made)

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.mark.parametrize("hook", ["raw", "classic"])
def test_io_uring_reads_are_recorded_per_request(lib: Path, loopfs: LoopFs, tmp_path: Path, hook: str) -> None:
    """Both kinds of tracepoint record the same: raw ones (io_kiocb's layout from BTF, which this kernel has)
    and the classic ones, which the scheduler's classic hook brings."""
    assert uring_supported(), "io_uring tracepoints with the expected fields are missing on this kernel"
    inline, worked = write_file(loopfs.mountpoint / "inline.bin", SIZE), write_file(loopfs.mountpoint / "w.bin", SIZE)
    reader = Reader(lib)
    try:
        with ebpf_capture(tmp_path / "u.gputrace", [reader.pid], threshold_ns=0, sched_hook=hook) as src:
            assert not [m for m in src.missing if "io_uring" in m], src.missing
            assert hooks.uring_hook(src.sched) == (hook, ""), hooks.uring_hook(src.sched)
            runs = {inline: reader.read(inline, DROP_CACHE), worked: reader.read(worked, DROP_CACHE | ASYNC)}
    finally:
        reader.close()
    records, _ = read_capture(tmp_path / "u.gputrace")
    assert all(n == SIZE for _, _, n, _ in runs.values()), runs
    mine = [r for r in of(records, IoUringRequest) if r.pid == reader.pid]
    enters = [s for s in of(records, Syscall) if s.pid == reader.pid and s.name == "io_uring_enter"]
    assert enters and all(s.fd == reader.ring and s.obj == "anon_inode:[io_uring]" for s in enters), enters
    waited = 0
    for path, (tid, fd, _n, made) in runs.items():
        reqs = [r for r in mine if r.obj == str(path)]
        assert len(reqs) == made, (len(reqs), made)
        data = [r for r in reqs if r.res > 0]
        # one record per request: every byte of the file once, in chunks, then reads at the end of the file
        assert sum(r.nbytes for r in data) == SIZE and len(data) == -(-SIZE // CHUNK), data
        assert all(r.res == 0 for r in reqs if r not in data) and len(reqs) > len(data)
        assert {(r.op, r.opcode, r.fd, r.tid, r.ring_fd) for r in reqs} == {("READ", 22, fd, tid, reader.ring)}
        assert sorted(r.user_data for r in sorted(reqs, key=lambda r: r.start_ns)[:DEPTH]) == list(range(DEPTH))
        # each was submitted inside an io_uring_enter call of its thread. An inline one also completed inside
        # one (task work, in the submitter's context); an IOSQE_ASYNC one completes on an io-wq worker whenever
        # its read ends, maybe while the reader is between calls (seen in CI): a later call of the reader reaps it
        for r in reqs:
            assert any(s.start_ns <= r.start_ns <= s.end_ns for s in enters), r
            if r.flags & uring.ASYNC:
                assert any(s.end_ns >= r.end_ns for s in enters), r
            else:
                assert any(s.start_ns <= r.end_ns <= s.end_ns for s in enters), r
        # the thread's waits in the calls that read this file (blocked 100 us or more) are covered by a request
        # in flight then: the blocked part, up to the wakeup; what follows it is time waiting for a CPU
        first, last = min(r.start_ns for r in reqs), max(r.end_ns for r in reqs)
        calls = [s for s in enters if first <= s.end_ns and s.start_ns <= last]
        waits = [o for o in of(records, OffCpu) if o.tid == tid and o.state != "R" and o.end_ns - o.start_ns >= 1e5
                 and any(s.start_ns <= o.start_ns and o.end_ns <= s.end_ns for s in calls)]  # fmt: skip
        waited += len(waits)
        for o in waits:
            woken = o.wake_ns if o.start_ns < o.wake_ns <= o.end_ns else o.end_ns
            covered = max(min(r.end_ns, woken) - max(r.start_ns, o.start_ns) for r in reqs)
            assert covered >= 0.9 * (woken - o.start_ns), o
    assert waited, "the reader never waited in io_uring_enter: the check proves nothing"
    inline_reqs = [r for r in mine if r.obj == str(inline)]
    worked_reqs = [r for r in mine if r.obj == str(worked)]
    assert not [r for r in inline_reqs if r.flags & uring.ASYNC]
    assert all(r.flags & uring.ASYNC for r in worked_reqs)
    # the block requests of the worked file were issued by the process's io-wq worker threads
    blocks = [b for b in of(records, BlockIO) if b.dev == loopfs.name and b.pid == reader.pid and "R" in b.rwbs]
    assert any(b.comm.startswith("iou-wrk-") for b in blocks), {b.comm for b in blocks}
    assert SIZE <= sum(b.nbytes for b in blocks) <= 2 * SIZE + (512 << 10), blocks
    drops = {d.what: d.count for d in of(records, Drops) if d.source == "ebpf"}
    assert drops.get("uring") == 0 and not any(drops.values()), drops
    # Perfetto: each request a slice on the submitting thread's io_uring track
    with open_capture(tmp_path / "u.gputrace") as cap:
        PerfettoExporter(tmp_path / "u.pftrace").write(cap)
    trace = check_trace(tmp_path / "u.pftrace")
    assert not trace.problems, trace.problems[:5]
    slices = [s for s in trace.all_slices() if trace.track_of(s).name.startswith("io_uring")]
    assert len(slices) == len(mine)
    assert {s.args.get("obj") for s in slices} == {str(inline), str(worked)}
    assert any(s.name == "READ 1 MiB" and s.args["nbytes"] == CHUNK and s.args["op"] == "READ" for s in slices)


def test_short_requests_are_summed_not_dropped(lib: Path, tmp_path: Path) -> None:
    """With the default threshold (100 us) page-cache reads are too short to record one by one: they are
    summed per thread and opcode, as short syscalls are."""
    f = tmp_path / "cached.bin"
    f.write_bytes(b"x" * (256 << 10))
    reader = Reader(lib)
    try:
        reader.read(f, 0)  # into the page cache
        with ebpf_capture(tmp_path / "s.gputrace", [reader.pid]):
            tid, _fd, n, _made = reader.read(f, 0)
    finally:
        reader.close()
    assert n == 256 << 10
    records, _ = read_capture(tmp_path / "s.gputrace")
    summed = [a for a in of(records, SyscallAgg) if a.name == "io_uring:READ" and a.tid == tid]
    recorded = [r for r in of(records, IoUringRequest) if r.tid == tid]
    assert summed and summed[0].count + len(recorded) >= 2, (summed, recorded)
    assert all(r.end_ns - r.start_ns >= 100_000 for r in recorded)


def test_a_full_request_map_is_counted(lib: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """With room for 2 requests in flight and 8 submitted at once, the others are lost and counted as
    ``uring`` drops: recorded plus lost requests account for every read."""
    from gputrace.probes.ebpf import build as ebpf_build

    real = ebpf_build.cflags
    monkeypatch.setattr(ebpf_build, "cflags", lambda *a, **k: [*real(*a, **k), "-DMAX_URING=2"])
    f = tmp_path / "f.bin"
    f.write_bytes(b"y" * (64 << 10))
    reader = Reader(lib)
    try:
        with ebpf_capture(tmp_path / "d.gputrace", [reader.pid], threshold_ns=0):
            _tid, _fd, n, made = reader.read(f, 0, 4096, 8)  # 16 reads of 4 KiB, 8 at a time, then past the end
    finally:
        reader.close()
    records, _ = read_capture(tmp_path / "d.gputrace")
    recorded = [r for r in of(records, IoUringRequest) if r.pid == reader.pid]
    lost = {d.what: d.count for d in of(records, Drops) if d.source == "ebpf"}["uring"]
    assert n == 64 << 10 and lost > 0 and len(recorded) + lost == made, (len(recorded), lost, made)


def test_a_request_in_flight_at_stop_names_what_the_waiting_thread_waits_for(lib: Path, tmp_path: Path) -> None:
    """A reader stuck in io_uring_enter on a read of a FIFO nobody writes, when the capture stops: the request
    still in flight is recorded up to the stop (flagged, result 0) with the FIFO's path, the report's thread
    caught waiting names it, and Perfetto draws it."""
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    writer = os.open(fifo, os.O_RDWR | os.O_NONBLOCK)  # the reader's open does not block; its read does
    reader = Reader(lib)
    try:
        out = tmp_path / "f.gputrace"
        with ebpf_capture(out, [reader.pid], threshold_ns=100_000):
            assert reader.proc.stdin is not None
            reader.proc.stdin.write(f"{fifo} 4096 1 0\n")
            reader.proc.stdin.flush()
            time.sleep(0.4)
            stopped = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
        os.write(writer, b"z" * 10)
        os.close(writer)  # the read completes with 10 bytes, the next one with EOF
        word, tid, _fd, n, _made = reader._line()
        assert (word, int(n)) == ("read", 10)
    finally:
        reader.close()
    records, _ = read_capture(out)
    mine = [r for r in of(records, IoUringRequest) if r.pid == reader.pid]
    assert len(mine) == 1, mine
    req = mine[0]
    waiting = {w.tid: w for w in of(records, InProgress)}[int(tid)]
    assert waiting.name == "io_uring_enter" and waiting.state == "S"
    assert (req.op, req.obj, req.res, req.nbytes, req.tid, req.ring_fd) == ("READ", str(fifo), 0, 0, int(tid),
                                                                            reader.ring)  # fmt: skip
    assert req.flags & uring.UNFINISHED and req.end_ns == waiting.at_ns >= stopped
    assert waiting.start_ns <= req.start_ns and req.end_ns - req.start_ns >= 300_000_000
    with open_capture(out) as cap:
        report = analyze(cap)
        PerfettoExporter(tmp_path / "f.pftrace").write(cap)
    row = next(r for r in report["capture"]["in_progress"] if r["tid"] == int(tid))
    assert row["requests_in_flight"] == 1 and row["requests"][0]["object"] == str(fifo)
    text = "\n".join(summary_lines(report))
    assert f"in flight: io_uring read({fifo}) for" in text, text
    trace = check_trace(tmp_path / "f.pftrace")
    assert not trace.problems, trace.problems[:5]
    slices = [s for s in trace.all_slices() if trace.track_of(s).name.startswith("io_uring")]
    assert [(s.name, s.args["flags"]) for s in slices] == [("READ (in flight at stop)", "in flight at stop")]


class _Leaf(NamedTuple):
    ts: int
    pid: int
    tid: int
    fd: int
    ring_fd: int
    opcode: int
    flags: int
    user_data: int


def test_requests_that_may_be_done_without_a_completion_are_counted_not_written() -> None:
    """An entry of a request submitted with IOSQE_CQE_SKIP_SUCCESS may be long done: it is counted, never
    written as in flight; nor are entries of processes no longer traced, or shorter than the threshold."""
    now = 10_000_000
    leaves = [_Leaf(1_000, 7, 8, 3, 4, 22, 0, 1), _Leaf(2_000, 7, 8, 3, 4, 22, uring.SKIP_CQE, 2),
              _Leaf(3_000, 9, 9, 3, 4, 22, 0, 3), _Leaf(now - 50, 7, 8, 3, 4, 22, 0, 4)]  # fmt: skip
    out, unsure = final.unfinished_requests(leaves, {7}, now, 100_000)
    assert unsure == 1 and len(out) == 1
    f = events.URING.unpack(out[0])
    assert (f[0], f[1], f[2], f[4], f[5], f[7], f[9], f[10]) == (events.EV_URING, 22, 7, 1_000, now, 0,
                                                                 uring.UNFINISHED, 1)  # fmt: skip
