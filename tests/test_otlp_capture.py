"""End to end: a capture analysed for real, sent by `gputrace export --otlp` to a real gRPC receiver."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from otlp_receiver import Receiver, grpc_receiver

from gputrace.analysis.synth import Builder, ns
from gputrace.capture import open_capture

TRAINER, WORKER = 100, 200
PATH = "/data/shard-0042.bin"


@pytest.fixture
def receiver() -> Iterator[tuple[Receiver, int]]:
    with grpc_receiver() as served:
        yield served


def _capture(tmp_path: Path) -> Path:
    """A trainer whose GPU waits 30 ms while its DataLoader worker preads a shard (DESIGN §5 rule 3)."""
    b = Builder().proc(TRAINER, "python").device(TRAINER)
    b.op(TRAINER, TRAINER, 0.0, 0.0, 10.0, "step_fwd")
    b.op(TRAINER, TRAINER, 39.95, 40.0, 50.0, "step_bwd")
    b.syscall(TRAINER, TRAINER, "futex", 9.0, 39.9)
    b.offcpu(TRAINER, TRAINER, 9.0, 39.85, "S", 39.8, (WORKER, WORKER, "pt_data_worker"))
    b.proc(WORKER, "pt_data_worker", TRAINER)
    b.syscall(WORKER, WORKER, "pread64", 12.0, 38.0, PATH, 1 << 20)
    b.block(WORKER, WORKER, 12.1, 37.9, 1 << 20)
    b.offcpu(WORKER, WORKER, 12.2, 37.95, "D", waker=(0, 0, "swapper/1"))
    return b.write(tmp_path / "run.gputrace")


def test_export_cli_sends_analysed_stalls(tmp_path: Path, receiver: tuple[Receiver, int]) -> None:
    rec, port = receiver
    path = _capture(tmp_path)
    r = subprocess.run([sys.executable, "-m", "gputrace", "export", str(path), "--otlp", f"127.0.0.1:{port}"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "Sent " in r.stdout and "dropped" not in r.stdout
    with open_capture(path) as reader:
        offset = reader.header["mono_to_realtime_ns"]
    spans = [s for req in rec.requests for rs in req.resource_spans for ss in rs.scope_spans for s in ss.spans]
    stalls = [s for s in spans if s.name.startswith("gpu.stall ")]
    assert len(stalls) == 1, [s.name for s in spans]
    stall = stalls[0]
    attrs = {kv.key: kv.value for kv in stall.attributes}
    assert stall.name == "gpu.stall storage"
    assert attrs["gputrace.culprit.object"].string_value == PATH
    assert attrs["gputrace.culprit.pid"].int_value == WORKER
    assert stall.start_time_unix_nano == ns(10) + offset and stall.end_time_unix_nano == ns(40) + offset
    children = [s for s in spans if s.parent_span_id == stall.span_id]
    assert any(PATH in s.name for s in children), [s.name for s in children]


def test_export_cli_unreachable_is_one_clear_line(tmp_path: Path) -> None:
    path = _capture(tmp_path)
    r = subprocess.run([sys.executable, "-m", "gputrace", "export", str(path), "--otlp", "127.0.0.1:9"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2, r.stdout + r.stderr
    line = r.stderr.strip().splitlines()[-1]
    assert line.startswith("gputrace: error: OTLP endpoint 127.0.0.1:9 (grpc) unreachable: Connection refused")
    assert "spans not delivered" in line and "Traceback" not in r.stderr
