"""A wait in io_uring_enter is named by the ring's requests that completed while it waited (analysis/uring.py):
synthetic captures in, expected stalls out, as in test_analysis.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from test_analysis import PATH, TRAINER, WORKER, only_stall, run, trainer, worker_reads

from gputrace.capture import CaptureWriter, host_header, open_capture
from gputrace.probes.ebpf import uring
from gputrace.testing.synth import Builder, ns

RING, FILE_FD = 4, 5
WRK = TRAINER + 5  # the trainer's io-wq worker thread
KWORKER = 55
MOUNTS = {"mounts": [["/", "ext4", "/dev/vda", "254:0"], ["/data", "ext4", "/dev/loop0", "7:0"]]}


def waiting(b: Builder, waker: tuple[int, int, str] = (0, 0, "[irq]"), start: float = 9.0, end: float = 39.9,
            ) -> Builder:  # fmt: skip
    """The trainer waits in io_uring_enter(RING, min_complete=1) over the stall, woken at the end by ``waker``."""
    b.syscall(TRAINER, TRAINER, "io_uring_enter", start, end, "anon_inode:[io_uring]", fd=RING, arg=1)
    return b.offcpu(TRAINER, TRAINER, start + 0.1, end - 0.05, "S", end - 0.1, waker)


def test_wait_in_io_uring_enter_is_storage_on_the_request_file(tmp_path: Path) -> None:
    """Read inline by the trainer's own submission: the request's file, bytes and the block requests it issued."""
    b = waiting(trainer())
    b.uring(TRAINER, TRAINER, 9.05, 39.8, PATH, 1 << 20, fd=FILE_FD, ring_fd=RING)
    b.block(TRAINER, TRAINER, 9.1, 30.0, 512 << 10).block(TRAINER, TRAINER, 9.2, 39.7, 512 << 10)
    b.block(TRAINER, TRAINER, 9.3, 20.0, 4096, dev="vda")  # on another device: not this request's
    s = only_stall(run(b, tmp_path, header=MOUNTS))
    assert (s["cause"], s["via"]) == ("storage", [])
    c = s["culprit"]
    assert (c["pid"], c["tid"], c["op"], c["object"], c["bytes"]) == (TRAINER, TRAINER, "io_uring read", PATH, 1 << 20)
    assert c["duration_ns"] == ns(39.8) - ns(9.05) and c["io_uring_requests"] == 1 and c["ring_fd"] == RING
    assert (c["block_requests"], c["block_device"], c["block_attribution"]) == (2, "loop0", "submitted")
    kinds = [(e["kind"], e["start_ns"], e["what"].split("(")[0]) for e in s["evidence"]]
    assert kinds[:2] == [("syscall", ns(9), "io_uring_enter"), ("syscall", ns(9.05), "io_uring read")]
    assert sum(1 for k in kinds if k[0] == "block") == 2
    assert run(b, tmp_path, header=MOUNTS)["summary"]["by_cause"]["storage"] >= 0.9 * (ns(40) - ns(10))


def test_a_read_done_by_an_io_wq_worker_is_the_request_not_the_worker(tmp_path: Path) -> None:
    """IOSQE_ASYNC: an iou-wrk thread of the trainer reads (its own block requests, no syscall), posts the
    completion and wakes the trainer. The wait is the request's file, not a hop to the worker's unknown time."""
    b = waiting(trainer(), waker=(TRAINER, WRK, f"iou-wrk-{TRAINER}")).thread(TRAINER, WRK, f"iou-wrk-{TRAINER}")
    b.uring(TRAINER, TRAINER, 9.05, 39.75, PATH, 1 << 20, fd=FILE_FD, flags=2)
    b.offcpu(TRAINER, WRK, 9.2, 39.7, "D", waker=(0, 0, "[irq]"))
    b.block(TRAINER, WRK, 9.3, 39.6, 1 << 20, comm=f"iou-wrk-{TRAINER}")
    s = only_stall(run(b, tmp_path, header=MOUNTS))
    c = s["culprit"]
    assert (s["cause"], s["via"], c["object"], c["tid"]) == ("storage", [], PATH, TRAINER)
    assert (c["block_requests"], c["block_attribution"]) == (1, "submitted")


def test_throttled_requests_dispatched_by_a_kworker_are_tied(tmp_path: Path) -> None:
    b = waiting(trainer())
    b.uring(TRAINER, TRAINER, 9.05, 39.8, PATH, 256 << 10, fd=FILE_FD)
    b.block(KWORKER, KWORKER, 20.0, 20.4, 128 << 10, comm="kworker/1:2").block(KWORKER, KWORKER, 39.0, 39.5, 128 << 10,
                                                                             comm="kworker/1:2")  # fmt: skip
    b.block(KWORKER, KWORKER, 25.0, 25.1, 4096, comm="kworker/1:2", rwbs="W")  # a write: not this read's
    c = only_stall(run(b, tmp_path, header=MOUNTS))["culprit"]
    assert (c["block_requests"], c["block_attribution"], c["dispatched_by"]) == (2, "dispatched", "kworker/1:2")


def test_the_last_request_to_complete_on_the_ring_names_the_wait(tmp_path: Path) -> None:
    """Several of the ring's requests complete during the wait: the last one let the thread go. Requests of
    another ring, of another process, or completed after the call returned are not this wait's."""
    other = "/data/other.bin"
    b = waiting(trainer())
    b.uring(TRAINER, TRAINER, 8.0, 15.0, other, 4096, fd=6)
    b.uring(TRAINER, TRAINER, 9.05, 39.7, PATH, 8192)
    b.uring(TRAINER, TRAINER, 9.05, 39.85, "/data/ring2.bin", 8192, ring_fd=9)  # another ring of the trainer
    b.proc(WORKER, "pt_data_worker", TRAINER).uring(WORKER, WORKER, 9.0, 39.88, "/data/w.bin", 1, ring_fd=RING)
    b.uring(TRAINER, TRAINER, 9.05, 40.5, "/data/late.bin", 1)  # completed after the call returned
    c = only_stall(run(b, tmp_path))["culprit"]
    assert (c["object"], c["bytes"], c["io_uring_requests"]) == (PATH, 8192, 2)
    # a request submitted by the ring's SQPOLL thread names no ring: it counts for any of the process's waits
    b.uring(TRAINER, TRAINER + 7, 20.0, 39.86, "/data/sqpoll.bin", 1, ring_fd=-1, flags=4)
    assert only_stall(run(b, tmp_path))["culprit"]["object"] == "/data/sqpoll.bin"


def test_a_request_on_a_socket_is_network(tmp_path: Path) -> None:
    b = waiting(trainer()).uring(TRAINER, TRAINER, 9.05, 39.8, "10.0.0.7:9000", 300, op="RECV")
    s = only_stall(run(b, tmp_path))
    assert (s["cause"], s["culprit"]["object"], s["culprit"]["op"]) == ("network", "10.0.0.7:9000", "io_uring recv")
    assert s["culprit"]["bytes"] == 300


def test_no_known_file_never_guesses_and_follows_the_waker(tmp_path: Path) -> None:
    """A registered (fixed) file names no path: the wait is followed like any other, here to an interrupt
    (unknown, empty culprit); with no request at all, to the task that woke it (a worker process that read)."""
    b = waiting(trainer()).uring(TRAINER, TRAINER, 9.05, 39.8, "", 1 << 20, fd=-1, flags=1)
    s = only_stall(run(b, tmp_path))
    assert s["cause"] == "unknown" and s["culprit"]["object"] == "" and s["culprit"]["pid"] == 0
    b = waiting(trainer(), waker=(WORKER, WORKER, "pt_data_worker"))
    worker_reads(b, WORKER)
    s = only_stall(run(b, tmp_path))
    assert (s["cause"], s["culprit"]["pid"], s["culprit"]["op"]) == ("storage", WORKER, "pread64")
    assert s["via"] == [f"wait:pid {WORKER}"]
    # a pipe read through the ring: another task fills it, so the wait is followed to that task as well
    b = waiting(trainer(), waker=(WORKER, WORKER, "pt_data_worker")).uring(TRAINER, TRAINER, 9.05, 39.8, "pipe", 64)
    worker_reads(b, WORKER)
    assert only_stall(run(b, tmp_path))["culprit"]["pid"] == WORKER


def test_hostile_request_records_are_counted_and_skipped(tmp_path: Path) -> None:
    path = waiting(trainer()).uring(TRAINER, TRAINER, 9.05, 39.8, PATH, 10).write(tmp_path / "ok.gputrace")
    w = CaptureWriter(tmp_path / "bad.gputrace", host_header(["t"]), force=True)
    with open_capture(path) as reader:
        w.write(list(reader.records()))
    row: list[Any] = [TRAINER, TRAINER, "READ", ns(9.1), ns(39.85), 5, 5, "/evil", 5, RING, 0, 22, 0]
    w.write_rows("IoUringRequest", [
        [*row[:3], "soon", *row[4:]],  # a time of the wrong type
        [*row[:7], ["/evil"], *row[8:]],  # an object that is not a string
        [*row[:3], ns(39.85), ns(9.1), *row[5:]],  # completed before it was submitted
        [*row[:9], None, *row[10:]],  # no ring
        [*row[:2], 22, *row[3:]],  # an op that is not a name
    ])  # fmt: skip
    huge = (1 << 63) - 1  # the most msgpack holds
    # every flag bit but "in flight at stop" (such a request completed nothing a wait could end on)
    w.write_rows("IoUringRequest", [[*row[:5], -huge, -1, "/data/huge.bin", huge, RING, ~uring.UNFINISHED, 999, huge]])
    bad = w.close({"end_ns": ns(60), "drops": {}})
    with open_capture(bad) as reader:
        from gputrace.analysis import analyze

        r = analyze(reader)
    assert r["capture"]["malformed_records"] == 5
    s = only_stall(r)
    assert s["cause"] == "storage" and s["culprit"]["object"] == "/data/huge.bin"  # the last, odd but well-typed
    assert s["culprit"]["bytes"] == huge


def test_requests_alone_change_nothing_outside_io_uring_waits(tmp_path: Path) -> None:
    """A request completing during a sleep, or while the thread runs, names nothing: only io_uring_enter asks."""
    b = trainer().syscall(TRAINER, TRAINER, "clock_nanosleep", 10.2, 39.8)
    b.uring(TRAINER, TRAINER, 9.05, 39.7, PATH, 10)
    assert only_stall(run(b, tmp_path))["cause"] == "sleep"


def test_perfetto_draws_the_request_and_an_arrow_from_it_to_the_stall(tmp_path: Path) -> None:
    from gputrace.analysis import analyze
    from gputrace.exporters.perfetto.export import PerfettoExporter
    from gputrace.testing.perfetto_check import check_trace

    b = waiting(trainer()).uring(TRAINER, TRAINER, 9.05, 39.8, PATH, 64 << 10, flags=2)
    b.uring(TRAINER, TRAINER, 9.06, 30.0, PATH, 4096)  # in flight beside it: a second lane
    path = b.write(tmp_path / "t.gputrace")
    with open_capture(path) as reader:
        report = analyze(reader)
    with open_capture(path) as reader:
        PerfettoExporter(tmp_path / "t.pftrace", report=report).write(reader)
    trace = check_trace(tmp_path / "t.pftrace")
    assert not trace.problems, trace.problems[:5]
    lanes = [t for t in trace.children(trace.thread(TRAINER)) if t.name.startswith("io_uring")]
    assert sorted(t.name for t in lanes) == ["io_uring", "io_uring #2"]
    (req,) = [s for s in trace.find("READ 64 KiB")]
    assert (req.ts, req.args["obj"], req.args["flags"], req.args["ring_fd"]) == (ns(9.05), PATH, "async", RING)
    linked = [a for a, b in trace.flows if trace.track_of(b).name == "stalls"]
    assert req in linked and any(a.name == "io_uring_enter" for a in linked), [a.name for a in linked]


def test_an_fsync_whose_writes_sat_in_the_throttle(tmp_path: Path) -> None:
    """A checkpoint's fsync: the thread itself only read some metadata (its own requests, reads); its data
    went out later, dispatched by the throttle's kworker. Both are the fsync's wait, and the kworker's read
    meanwhile (the other direction) is not. An fsync that wrote its own data keeps just its own requests."""
    ckpt = "/data/ckpt-001.pt"
    b = trainer()
    b.syscall(TRAINER, TRAINER, "fsync", 10.5, 39.8, ckpt).offcpu(TRAINER, TRAINER, 10.6, 39.75, "D",
                                                                  waker=(0, 0, "[irq]"))
    b.block(TRAINER, TRAINER, 10.55, 10.65, 1024, comm="python", rwbs="RAM")
    b.block(KWORKER, KWORKER, 20.0, 20.2, 4096, comm="kworker/1:2", rwbs="R")
    b.block(KWORKER, KWORKER, 39.0, 39.6, 256 << 10, comm="kworker/1:2", rwbs="WS")
    s = only_stall(run(b, tmp_path, header=MOUNTS))
    c = s["culprit"]
    assert (s["cause"], c["op"], c["object"], c["pid"]) == ("storage", "fsync", ckpt, TRAINER)
    assert (c["block_requests"], c["block_bytes"], c["block_attribution"], c["dispatched_by"]) == \
        (2, (256 << 10) + 1024, "dispatched", "kworker/1:2"), c
    assert [e["what"] for e in s["evidence"] if e["kind"] == "block"] == ["RAM 1024 B on loop0",
                                                                         "WS 262144 B on loop0"]

    b = trainer()
    b.syscall(TRAINER, TRAINER, "fsync", 10.5, 39.8, ckpt).offcpu(TRAINER, TRAINER, 10.6, 39.75, "D",
                                                                  waker=(0, 0, "[irq]"))
    b.block(TRAINER, TRAINER, 10.55, 39.6, 256 << 10, comm="python", rwbs="WS")
    b.block(KWORKER, KWORKER, 39.0, 39.6, 4096, comm="kworker/1:2", rwbs="WS")  # another writer's
    c = only_stall(run(b, tmp_path, header=MOUNTS))["culprit"]
    assert (c["block_requests"], c["block_bytes"], c["block_attribution"]) == (1, 256 << 10, "submitted"), c
    assert "dispatched_by" not in c
