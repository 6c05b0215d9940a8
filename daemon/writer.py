"""The session's sink: a bounded queue drained by one writer thread into the capture file.

Sources call emit*() from their own threads. When the queue is full, a batch waits up to ``put_timeout_s``
(the kernel ring buffer absorbs the pause) and is then dropped and counted, never lost silently.
"""

from __future__ import annotations

import queue
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from gputrace.capture import CaptureWriter, host_header
from gputrace.threads import Thread

_STOP = object()


class QueueSink:
    def __init__(self, writer: CaptureWriter, *, max_batches: int = 4096, put_timeout_s: float = 0.5) -> None:
        self.writer = writer
        self._q: queue.Queue[Any] = queue.Queue(max_batches)
        self._timeout = put_timeout_s
        self.dropped_batches = 0
        self.dropped_records = 0
        self.error: BaseException | None = None
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

    def _drain(self) -> None:
        w = self.writer
        while True:
            item = self._q.get()
            if item is _STOP:
                return
            if self.error is not None:
                continue  # the file is gone; keep draining so producers never block
            try:
                if item[0] == "K":
                    w.write_kernel(item[1], item[2])
                elif item[0] == "R":
                    w.write(item[1])
                else:
                    w.write_meta(item[1], item[2])
            except BaseException as e:  # noqa: BLE001 - reported by close()
                self.error = e

    def close(self) -> None:
        """Write everything queued, then stop the writer thread (the caller then closes the writer)."""
        self._q.put(_STOP)
        self._thread.join()
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
