"""Capture with the eBPF source alone (no session), as the tests do: start, run the workload, stop, read."""

from __future__ import annotations

import subprocess
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


@contextmanager
def driven(argv: list[str]) -> Iterator[subprocess.Popen[str]]:
    """A workload driven by lines on its stdin and stdout (``tell``), killed if it still runs when left."""
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        yield proc
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait()


def tell(proc: subprocess.Popen[str], line: str) -> None:
    assert proc.stdin is not None
    proc.stdin.write(line + "\n")
    proc.stdin.flush()


def read_capture(path: Path) -> tuple[list[Any], CaptureReader]:
    reader = CaptureReader(path)
    records = list(reader.records())
    reader.close()
    assert reader.problem == "", reader.problem
    return records, reader


def of(records: list[Any], kind: type) -> list[Any]:
    return [r for r in records if isinstance(r, kind)]
