"""The session's sink: a bounded queue drained by one writer thread into the capture file.

Sources call emit*() from their own threads. When the queue is full, a batch waits up to ``put_timeout_s``
(the kernel ring buffer absorbs the pause) and is then dropped and counted, never lost silently.

Watch mode's sessions share one writer thread (``SharedWriter``): each job keeps its own bounded queue and file,
and the one thread writes whichever queues have batches. The service's sources hand every job its batches at
the same moments (the shared kernel ring's drain, the shared NVML sampler), so one wakeup writes them all where
a thread per job woke once each.
"""

from __future__ import annotations

import queue
import threading
from collections import deque
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from gputrace.capture import CaptureWriter, host_header
from gputrace.threads import Thread

_STOP = object()
TURN_BATCHES = 256  # batches a shared writer writes of one sink before it turns to the next


class SharedWriter:
    """One thread writing the batches of many QueueSinks (watch mode's jobs), each sink's in its order."""

    def __init__(self, name: str = "gputrace-writer") -> None:
        self._cond = threading.Condition()
        self._ready: deque[QueueSink] = deque()  # sinks with batches queued, each once
        self._thread = Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def notify(self, sink: QueueSink) -> None:
        """``sink`` has a batch queued."""
        with self._cond:
            if not sink._flagged:
                sink._flagged = True
                self._ready.append(sink)
                self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._ready:
                    self._cond.wait()
                sink = self._ready.popleft()
                sink._flagged = False  # a batch queued from here on flags it again
            sink._write_queued()


class QueueSink:
    def __init__(self, writer: CaptureWriter, *, max_batches: int = 4096, put_timeout_s: float = 0.5,
                 shared: SharedWriter | None = None) -> None:
        self.writer = writer
        self._q: queue.Queue[Any] = queue.Queue(max_batches)
        self._timeout = put_timeout_s
        self.dropped_batches = 0
        self.dropped_records = 0
        self.error: BaseException | None = None
        self._shared = shared
        self._flagged = False  # (the shared writer's lock) in its ready list
        self._closed = threading.Event()  # (shared) the stop marker was reached
        self._thread: Thread | None = None
        if shared is None:
            self._thread = Thread(target=self._drain, name="gputrace-writer", daemon=True)
            self._thread.start()

    def emit(self, records: Sequence[tuple[Any, ...]]) -> None:
        if records:
            self._put(("R", list(records)), len(records))

    def emit_kernel(self, blob: bytes, nevents: int) -> None:
        if blob:
            self._put(("K", blob, nevents), nevents)

    def emit_meta(self, source: str, meta: dict[str, Any]) -> None:
        self._put(("M", source, meta), 0)

    def _put(self, item: tuple[Any, ...], n: int) -> None:
        try:
            self._q.put(item, timeout=self._timeout)
        except queue.Full:
            self.dropped_batches += 1
            self.dropped_records += n
            return
        if self._shared is not None:
            self._shared.notify(self)

    def _drain(self) -> None:
        while self._write(self._q.get()):
            pass

    def _write_queued(self) -> None:
        """(the shared writer's thread) Up to TURN_BATCHES of what is queued, up to the stop marker; a sink with
        more left goes to the back of the line, so that one busy job does not hold up the others' writes."""
        for _ in range(TURN_BATCHES):
            try:
                item = self._q.get_nowait()
            except queue.Empty:
                return
            if not self._write(item):
                self._closed.set()
                return
        if not self._q.empty():
            assert self._shared is not None
            self._shared.notify(self)

    def _write(self, item: Any) -> bool:
        """Write one queued batch; False at the stop marker."""
        if item is _STOP:
            return False
        if self.error is not None:
            return True  # the file is gone; keep draining so producers never block
        w = self.writer
        try:
            if item[0] == "K":
                w.write_kernel(item[1], item[2])
            elif item[0] == "R":
                w.write(item[1])
            else:
                w.write_meta(item[1], item[2])
        except BaseException as e:  # noqa: BLE001 - reported by close()
            self.error = e
        return True

    def close(self) -> None:
        """Write everything queued, then stop the writer thread, or with a shared writer wait until it has written
        it (the caller then closes the writer)."""
        self._q.put(_STOP)
        if self._thread is not None:
            self._thread.join()
        else:
            assert self._shared is not None
            self._shared.notify(self)
            self._closed.wait()
        if self.error is not None:
            raise self.error

    def drops(self) -> dict[str, int]:
        return {"queue": self.dropped_records}


@contextmanager
def source_capture(path: Path, src: Any, argv: list[str]) -> Iterator[Any]:
    """One source alone into a capture file at ``path`` (header argv ``argv``), written as the session
    writes it: started (the file removed again if it cannot start), yielded, stopped, its drops in the
    trailer. For tests and benchmarks."""
    writer = CaptureWriter(path, host_header(argv))
    sink = QueueSink(writer)
    try:
        src.start(sink)
    except BaseException:
        sink.close()
        writer.abort()
        raise
    try:
        yield src
    finally:
        src.stop()
        sink.close()
        writer.close({"drops": {f"{src.name}.{k}": v for k, v in src.drops().items()}, "complete": True})
