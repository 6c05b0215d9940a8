"""Capture with the eBPF source alone (no session), as the tests do: start, run the workload, stop, read."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from gputrace.capture import CaptureReader, CaptureWriter, host_header
from gputrace.daemon.writer import QueueSink
from gputrace.probes.ebpf import EbpfSource


@contextmanager
def ebpf_capture(path: Path, pids: list[int], **options: Any) -> Iterator[EbpfSource]:
    with source_capture(path, EbpfSource(pids, **options), pids) as src:
        yield src


@contextmanager
def source_capture(path: Path, src: Any, pids: list[int]) -> Iterator[Any]:
    """Run one source alone into a real capture file, as the session would write it."""
    writer = CaptureWriter(path, host_header(["pytest", *map(str, pids)]))
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


def read_capture(path: Path) -> tuple[list[Any], CaptureReader]:
    reader = CaptureReader(path)
    records = list(reader.records())
    reader.close()
    assert reader.problem == "", reader.problem
    return records, reader


def of(records: list[Any], kind: type) -> list[Any]:
    return [r for r in records if isinstance(r, kind)]
