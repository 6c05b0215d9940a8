"""Watch mode's jobs share one writer thread (daemon/writer.py, SharedWriter): each job's capture gets exactly its
own batches in the order they were queued, a sink's close returns once its batches are written while the others
go on, and a job with a long queue does not hold up another's writes. Paced, it writes every job's batches in
one round at most that often, and what must not wait (a control record, a close, a queue filling up) at once."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any

from gputrace.capture import CaptureReader, CaptureWriter, host_header
from gputrace.daemon.writer import KERNEL_BYTES_URGENT, TURN_BATCHES, QueueSink, SharedWriter
from gputrace.records import SourceStatus


class _Noting(CaptureWriter):
    """A capture writer that notes the threads it was called in."""

    def __init__(self, path: Path) -> None:
        super().__init__(path, host_header(["test"]))
        self.threads: set[int] = set()

    def write(self, records: Any) -> None:
        self.threads.add(threading.get_ident())
        super().write(records)


def test_each_job_gets_its_own_batches_in_order_from_one_thread(tmp_path: Path) -> None:
    shared = SharedWriter()
    writers = [_Noting(tmp_path / f"{i}.gputrace") for i in range(3)]
    sinks = [QueueSink(w, shared=shared) for w in writers]

    def produce(i: int) -> None:  # each job's batches, from threads of their own, interleaved
        for n in range(300):
            sinks[i].emit([SourceStatus(n, f"job{i}", "running", str(n))])
            if n % 50 == 0:
                sinks[i].emit_meta(f"meta{i}", {"n": n})

    producers = [threading.Thread(target=produce, args=(i,)) for i in range(3)]
    for t in producers:
        t.start()
    for t in producers:
        t.join()
    for sink, w in zip(sinks, writers, strict=True):
        sink.close()
        w.close({"complete": True})
    threads = set().union(*(w.threads for w in writers))
    assert len(threads) == 1 and threading.get_ident() not in threads, threads
    for i in range(3):
        with CaptureReader(tmp_path / f"{i}.gputrace") as reader:
            got = [(r.source, r.ts) for r in reader.records() if isinstance(r, SourceStatus)]
            assert reader.meta[f"meta{i}"] == {"n": 250} and set(reader.meta) >= {f"meta{i}"}
        assert got == [(f"job{i}", n) for n in range(300)]
    assert all(s.dropped_records == 0 for s in sinks)


class _Gated:
    """A writer whose first write waits for ``gate``; notes every batch it writes, in order, with ``log``."""

    def __init__(self, name: str, log: list[str], gate: threading.Event, entered: threading.Event) -> None:
        self.name, self.log, self.gate, self.entered = name, log, gate, entered

    def write(self, records: Any) -> None:
        if not self.entered.is_set():
            self.entered.set()
            assert self.gate.wait(30)
        self.log.append(self.name)

    def write_kernel(self, blob: bytes, n: int) -> None:
        self.log.append(self.name)

    def write_meta(self, source: str, meta: dict[str, Any]) -> None:
        self.log.append(self.name)


def test_a_long_queue_takes_turns_with_the_others(tmp_path: Path) -> None:
    shared = SharedWriter()
    log: list[str] = []
    gate, entered = threading.Event(), threading.Event()
    busy = QueueSink(_Gated("busy", log, gate, entered), max_batches=10_000, shared=shared)  # type: ignore[arg-type]
    other = QueueSink(_Gated("other", log, threading.Event(), entered), shared=shared)  # type: ignore[arg-type]
    try:
        busy.emit([SourceStatus(0, "x", "running", "")])
        assert entered.wait(30)  # the writer is in busy's first batch
        for n in range(3 * TURN_BATCHES):
            busy.emit([SourceStatus(n, "x", "running", "")])
        other.emit([SourceStatus(0, "y", "running", "")])
    finally:
        gate.set()
        busy.close()
        other.close()
    assert log.count("busy") == 3 * TURN_BATCHES + 1 and log.count("other") == 1
    assert log.index("other") <= 2 * TURN_BATCHES + 1, "the other job waited for the whole of the busy one's queue"


def test_closing_one_sink_leaves_the_others_writing(tmp_path: Path) -> None:
    shared = SharedWriter()
    first, second = _Noting(tmp_path / "a.gputrace"), _Noting(tmp_path / "b.gputrace")
    a, b = QueueSink(first, shared=shared), QueueSink(second, shared=shared)
    a.emit([SourceStatus(1, "a", "running", "")])
    a.close()  # returns once its batch is written
    first.close({"complete": True})
    with CaptureReader(tmp_path / "a.gputrace") as reader:
        assert [r.source for r in reader.records() if isinstance(r, SourceStatus)] == ["a"]
    b.emit([SourceStatus(2, "b", "running", "")])
    b.close()
    second.close({"complete": True})
    with CaptureReader(tmp_path / "b.gputrace") as reader:
        assert [r.source for r in reader.records() if isinstance(r, SourceStatus)] == ["b"]


def _status(n: int) -> list[SourceStatus]:
    return [SourceStatus(n, "x", "running", "")]


def _until(what: Any, timeout_s: float = 30.0) -> None:
    """Wait for ``what()`` to hold (another thread makes it so)."""
    deadline = time.monotonic() + timeout_s
    while not what():
        assert time.monotonic() < deadline, "not within 30 s"
        time.sleep(0.005)


class _Log:
    """A writer that notes each batch it writes, with the writer's round."""

    def __init__(self, name: str, log: list[tuple[str, int]], shared: SharedWriter) -> None:
        self.name, self.log, self.shared = name, log, shared

    def write(self, records: Any) -> None:
        self.log.append((self.name, self.shared.rounds))

    def write_kernel(self, blob: bytes, n: int) -> None:
        self.log.append((self.name + "/kernel", self.shared.rounds))

    def write_meta(self, source: str, meta: dict[str, Any]) -> None:
        self.log.append((self.name + "/meta", self.shared.rounds))


def test_a_paced_writer_writes_every_jobs_batches_in_one_round_and_control_records_at_once() -> None:
    shared = SharedWriter(pace_s=3600.0)  # after its first round, only what must not wait starts another
    log: list[tuple[str, int]] = []
    a = QueueSink(_Log("a", log, shared), shared=shared)  # type: ignore[arg-type]
    b = QueueSink(_Log("b", log, shared), shared=shared)  # type: ignore[arg-type]
    a.emit(_status(0))  # the first batch after a quiet while is written at once
    _until(lambda: shared.rounds == 1)
    for n in range(1, 4):
        a.emit(_status(n))
        b.emit(_status(n))
    a.emit_meta("control", {"rotate": True})  # a rotation is waited for: it takes the others along
    _until(lambda: shared.rounds == 2)
    assert log == [("a", 0)] + sorted([("a", 1)] * 3 + [("a/meta", 1)] + [("b", 1)] * 3), log
    b.emit(_status(4))
    b.close()  # a close does not wait for the pace either
    a.close()
    assert log[-1] == ("b", 2) and shared.rounds >= 3, log


def test_a_paced_writer_writes_at_its_pace_and_a_filling_queue_at_once() -> None:
    shared = SharedWriter(pace_s=0.2)
    log: list[tuple[str, int]] = []
    a = QueueSink(_Log("a", log, shared), shared=shared)  # type: ignore[arg-type]
    a.emit(_status(0))
    _until(lambda: shared.rounds == 1)
    a.emit(_status(1))  # nothing else comes: the next round writes it
    _until(lambda: len(log) == 2)
    a.close()

    slow = SharedWriter(pace_s=3600.0)
    log = []
    small = QueueSink(_Log("s", log, slow), max_batches=8, shared=slow)  # type: ignore[arg-type]
    kernel = QueueSink(_Log("k", log, slow), shared=slow)  # type: ignore[arg-type]
    small.emit(_status(0))
    _until(lambda: slow.rounds == 1)
    small.emit(_status(1))
    small.emit(_status(2))  # a quarter of its queue: written without waiting an hour
    _until(lambda: slow.rounds == 2)
    assert log == [("s", 0), ("s", 1), ("s", 1)], log
    kernel.emit_kernel(b"\0" * (KERNEL_BYTES_URGENT // 2), 1)
    kernel.emit_kernel(b"\0" * (KERNEL_BYTES_URGENT // 2), 1)  # KERNEL_BYTES_URGENT of kernel events held
    _until(lambda: slow.rounds == 3)
    assert log[3:] == [("k/kernel", 2)] * 2, log
    small.close()
    kernel.close()
