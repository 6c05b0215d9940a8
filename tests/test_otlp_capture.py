"""End to end: a capture analysed for real, sent by `gputrace export --otlp` to a real gRPC receiver."""

from __future__ import annotations

import re
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from concurrent import futures
from pathlib import Path
from typing import Any

import grpc
import pytest
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2_grpc
from otlp_receiver import Receiver, grpc_receiver
from signals import with_default

from gputrace.capture import open_capture
from gputrace.testing.synth import Builder, ns

pytestmark = pytest.mark.kernel  # root and the host's kernel (see tests/conftest.py)

TRAINER, WORKER = 100, 200
PATH = "/data/shard-0042.bin"


@pytest.fixture
def receiver() -> Iterator[tuple[Receiver, int]]:
    with grpc_receiver() as served:
        yield served


def _capture(tmp_path: Path) -> Path:
    """A trainer whose GPU waits 30 ms while its DataLoader worker preads a shard."""
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


class _Stalling(Receiver):
    """Takes the first request, then holds every later one until released."""

    def __init__(self) -> None:
        super().__init__()
        self.holding, self.release = threading.Event(), threading.Event()

    def Export(self, request: Any, context: Any) -> Any:  # noqa: N802
        if self.requests:
            self.holding.set()
            self.release.wait(30)
        return super().Export(request, context)


def test_ctrl_c_during_a_send_says_how_many_spans_were_delivered(tmp_path: Path) -> None:
    b = Builder().proc(TRAINER, "python").device(TRAINER)
    for i in range(700):  # 699 unexplained stalls of 2 ms: more spans than one request carries (512)
        b.op(TRAINER, TRAINER, 3.0 * i, 3.0 * i, 3.0 * i + 1, f"k{i}")
    path = b.write(tmp_path / "many.gputrace")
    rec = _Stalling()
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(rec, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        # Ctrl-C's default action in the export, as a shell in a terminal gives it, not a SIG_IGN this run
        # inherited (a job started in the background)
        argv = [sys.executable, "-m", "gputrace", "export", str(path), "--otlp", f"127.0.0.1:{port}"]
        p = subprocess.Popen(with_default(signal.SIGINT, argv), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True)
        assert rec.holding.wait(60), "the second request never came"
        p.send_signal(signal.SIGINT)
        out, err = p.communicate(timeout=30)
    finally:
        rec.release.set()
        server.stop(None)
    assert p.returncode == 130, out + err
    delivered = sum(len(ss.spans) for req in rec.requests[:1] for rs in req.resource_spans for ss in rs.scope_spans)
    assert delivered == 512
    said = re.search(rf"warning: interrupted after 512 of ([\d,]+) spans were delivered to 127.0.0.1:{port}: "
                     "the trace there is partial", err)
    assert said and int(said[1].replace(",", "")) > 699, err  # a span per stall and its evidence
    assert "Traceback" not in err and "Sent " not in out
