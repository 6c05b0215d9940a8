"""Capture with the eBPF source alone (no session), as the tests do: start, run the workload, stop, read."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from gputrace.capture import CaptureReader
from gputrace.daemon.writer import source_capture
from gputrace.probes.ebpf.source import EbpfSource


@contextmanager
def ebpf_capture(path: Path, pids: list[int], **options: Any) -> Iterator[EbpfSource]:
    with source_capture(path, EbpfSource(pids, **options), ["pytest", *map(str, pids)]) as src:
        yield src


def read_capture(path: Path) -> tuple[list[Any], CaptureReader]:
    reader = CaptureReader(path)
    records = list(reader.records())
    reader.close()
    assert reader.problem == "", reader.problem
    return records, reader


def of(records: list[Any], kind: type) -> list[Any]:
    return [r for r in records if isinstance(r, kind)]
