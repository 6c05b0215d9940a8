"""Watch mode's jobs share one writer thread (daemon/writer.py, SharedWriter): each job's capture gets exactly its
own batches in the order they were queued, a sink's close returns once its batches are written while the others
go on, and a job with a long queue does not hold up another's writes."""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any

from gputrace.capture import CaptureReader, CaptureWriter, host_header
from gputrace.daemon.writer import TURN_BATCHES, QueueSink, SharedWriter
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
