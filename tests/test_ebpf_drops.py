"""A consumer that cannot keep up loses events in the kernel, and every one of them is counted."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from workloads.ebpfcap import of, read_capture

from gputrace.capture import CaptureWriter, host_header
from gputrace.daemon.writer import QueueSink
from gputrace.probes.ebpf.source import EbpfSource
from gputrace.records import Drops, Syscall

N = 100_000
LOOP = f"""
import os, sys
fd = os.open("/etc/hostname", os.O_RDONLY)
sys.stdin.readline()
for _ in range({N}):
    os.pread(fd, 16, 0)
"""


class StalledSink(QueueSink):
    """Holds the first kernel batch until released, so the ring buffer behind it fills up."""

    def __init__(self, writer: CaptureWriter) -> None:
        super().__init__(writer)
        self.release = threading.Event()

    def emit_kernel(self, blob: bytes, nevents: int) -> None:
        self.release.wait()
        super().emit_kernel(blob, nevents)


@pytest.mark.kernel
def test_ring_overflow_is_counted_exactly(tmp_path: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-c", LOOP], stdin=subprocess.PIPE)
    assert proc.stdin is not None
    path = tmp_path / "drops.gputrace"
    writer = CaptureWriter(path, host_header(["test"]))
    sink = StalledSink(writer)
    src = EbpfSource([proc.pid], threshold_ns=0, ring_mib=1)
    src.start(sink)
    proc.stdin.write(b"go\n")
    proc.stdin.close()
    assert proc.wait(timeout=60) == 0
    sink.release.set()
    src.stop()
    sink.close()
    drops: dict[str, Any] = src.drops()
    writer.close({"drops": drops, "complete": True})

    records, _ = read_capture(path)
    preads = [s for s in of(records, Syscall) if s.name == "pread64" and s.pid == proc.pid]
    lost = drops["ringbuf"]
    assert 0 < len(preads) < N and lost > 0
    # Every pread was either recorded or counted lost (the rest of the losses: other events of the run).
    assert len(preads) + lost >= N
    assert len(preads) + lost <= N + 1000
    stored = {d.what: d.count for d in of(records, Drops)}
    assert stored["ringbuf"] == lost
