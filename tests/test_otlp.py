"""OTLP export into real receivers: an in-process gRPC TraceService and an HTTP /v1/traces endpoint."""

from __future__ import annotations

import http.server
import os
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import grpc
import otlp_receiver
import pytest
from google.protobuf.duration_pb2 import Duration
from google.rpc.error_details_pb2 import RetryInfo
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from otlp_receiver import Receiver

from gputrace.capture import CaptureReader, CaptureWriter, host_header
from gputrace.errors import UserError
from gputrace.exporters.otlp import OtlpExporter, OtlpUnreachable, count_spans, parse_endpoint

START = 5_000_000_000


def _report() -> dict[str, Any]:
    stall = {
        "device": 0, "start_ns": START + 10_000_000, "end_ns": START + 41_000_000, "duration_ns": 31_000_000,
        "cause": "storage", "via": ["wait:pid 4242"],
        "culprit": {"pid": 4242, "tid": 4243, "comm": "worker", "op": "pread64", "object": "/data/shard-0042.bin",
                    "bytes": 1 << 20, "duration_ns": 28_000_000},
        "evidence": [
            {"pid": 4242, "tid": 4243, "kind": "syscall", "what": "pread64 /data/shard-0042.bin",
             "start_ns": START + 11_000_000, "end_ns": START + 39_000_000},
            {"pid": 4242, "tid": 4243, "kind": "block", "what": "loop0 R 1048576",
             "start_ns": START + 12_000_000, "end_ns": START + 38_000_000},
        ],
    }
    sleep = {"device": 0, "start_ns": START + 50_000_000, "end_ns": START + 52_000_000, "duration_ns": 2_000_000,
             "cause": "sleep", "via": [], "culprit": {"pid": 4000, "tid": 4000, "comm": "python", "op": "nanosleep"},
             "evidence": []}
    return {
        "schema": "gputrace.report/1",
        "capture": {"start_ns": START, "end_ns": START + 100_000_000, "pids": [4000], "host": "gpu-host-7",
                    "drops": {"ebpf.ringbuf": 0}, "complete": True},
        "devices": [{"id": 0, "name": "sim0", "simulated": True, "busy_ns": 67_000_000, "idle_ns": 33_000_000}],
        "summary": {"window_ns": 100_000_000, "busy_ns": 67_000_000, "stall_ns": 33_000_000,
                    "by_cause": {"storage": 31_000_000, "sleep": 2_000_000}},
        "stalls": [stall, sleep],
    }


@pytest.fixture
def capture(tmp_path: Path) -> Iterator[CaptureReader]:
    header = host_header(["test"])
    header["mono_to_realtime_ns"] = 1_700_000_000_000_000_000
    w = CaptureWriter(tmp_path / "c.gputrace", header)
    path = w.close({"end_ns": START + 100_000_000, "complete": True})
    with CaptureReader(path) as r:
        yield r


def _value(v: AnyValue) -> Any:
    kind = v.WhichOneof("value")
    assert kind is not None
    if kind == "array_value":
        return [_value(x) for x in v.array_value.values]
    return getattr(v, kind)


def _spans(requests: list[trace_service_pb2.ExportTraceServiceRequest]) -> tuple[dict[str, Any], list[Any]]:
    resource: dict[str, Any] = {}
    spans = []
    for req in requests:
        for rs in req.resource_spans:
            resource.update({kv.key: _value(kv.value) for kv in rs.resource.attributes})
            for ss in rs.scope_spans:
                spans.extend(ss.spans)
    return resource, spans


def _attrs(span: Any) -> dict[str, Any]:
    return {kv.key: _value(kv.value) for kv in span.attributes}


@pytest.fixture
def grpc_receiver() -> Iterator[tuple[Receiver, int]]:
    with otlp_receiver.grpc_receiver() as served:
        yield served



def _reply(handler: http.server.BaseHTTPRequestHandler, body: bytes) -> None:
    """An OTLP/HTTP response: 200 with a serialized protobuf."""
    handler.send_response(200)
    handler.send_header("Content-Type", "application/x-protobuf")
    handler.send_header("Content-Length", str(len(body)))
    handler.end_headers()
    handler.wfile.write(body)

class _HttpHandler(http.server.BaseHTTPRequestHandler):
    requests: list[trace_service_pb2.ExportTraceServiceRequest]
    content_types: list[str]

    def do_POST(self) -> None:  # noqa: N802
        body = self.rfile.read(int(self.headers["Content-Length"]))
        if self.path != "/v1/traces":
            self.send_error(404)
            return
        self.content_types.append(self.headers["Content-Type"])
        req = trace_service_pb2.ExportTraceServiceRequest()
        req.ParseFromString(body)
        self.requests.append(req)
        _reply(self, trace_service_pb2.ExportTraceServiceResponse().SerializeToString())

    def log_message(self, *args: Any) -> None:
        pass


@pytest.fixture
def http_receiver() -> Iterator[tuple[type[_HttpHandler], int]]:
    handler = type("H", (_HttpHandler,), {"requests": [], "content_types": []})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield handler, server.server_address[1]
    server.shutdown()
    server.server_close()


def _check_delivery(requests: list[Any]) -> None:
    resource, spans = _spans(requests)
    assert resource["service.name"] == "gputrace"
    assert resource["host.name"] == "gpu-host-7"
    assert resource["gputrace.capture.pids"] == [4000] and resource["process.pid"] == 4000
    by_name = {s.name: s for s in spans}
    assert set(by_name) == {"gputrace capture", "gpu.stall storage", "gpu.stall sleep",
                            "syscall pread64 /data/shard-0042.bin", "block loop0 R 1048576"}
    offset = 1_700_000_000_000_000_000
    stall = by_name["gpu.stall storage"]
    assert stall.start_time_unix_nano == offset + START + 10_000_000
    assert stall.end_time_unix_nano == offset + START + 41_000_000
    a = _attrs(stall)
    assert a["gpu.device"] == 0 and a["gputrace.cause"] == "storage" and a["gputrace.simulated"] is True
    assert a["gputrace.culprit.object"] == "/data/shard-0042.bin" and a["gputrace.culprit.pid"] == 4242
    assert a["gputrace.via"] == ["wait:pid 4242"] and a["gputrace.capture.host"] == "gpu-host-7"
    root = by_name["gputrace capture"]
    assert stall.parent_span_id == root.span_id and stall.trace_id == root.trace_id
    read = by_name["syscall pread64 /data/shard-0042.bin"]
    assert read.parent_span_id == stall.span_id
    assert read.start_time_unix_nano == offset + START + 11_000_000
    assert _attrs(read)["thread.id"] == 4243
    assert len({s.trace_id for s in spans}) == 1


def test_grpc_delivers_stalls_with_times_and_attributes(
        capture: CaptureReader, grpc_receiver: tuple[Receiver, int]) -> None:
    receiver, port = grpc_receiver
    result = OtlpExporter(f"127.0.0.1:{port}", "grpc", report=_report(), batch_size=2).write(capture)
    assert (result.items, result.dropped) == (5, 0)
    assert len(receiver.requests) == 3, "batches of 2 spans: 2 + 2 + 1"
    _check_delivery(receiver.requests)


def test_http_delivers_protobuf_to_v1_traces(
        capture: CaptureReader, http_receiver: tuple[type[_HttpHandler], int]) -> None:
    handler, port = http_receiver
    result = OtlpExporter(f"http://127.0.0.1:{port}", "http", report=_report()).write(capture)
    assert (result.items, result.dropped) == (5, 0)
    assert handler.content_types == ["application/x-protobuf"]
    _check_delivery(handler.requests)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_unreachable_endpoint_counts_every_span(capture: CaptureReader, protocol: str) -> None:
    port = _free_port()
    with pytest.raises(OtlpUnreachable) as err:
        OtlpExporter(f"127.0.0.1:{port}", protocol, report=_report(), timeout_s=2).write(capture)
    assert "unreachable" in str(err.value) and "refused" in str(err.value).lower()
    assert "5 spans not delivered" in str(err.value)
    assert err.value.result.dropped == count_spans(_report()) == 5 and err.value.result.items == 0


def test_collector_that_rejects_counts_drops(capture: CaptureReader) -> None:
    class Failing(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request: Any, context: Any) -> Any:  # noqa: N802
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, "no thanks")

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Failing(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        with pytest.raises(OtlpUnreachable) as err:
            OtlpExporter(f"127.0.0.1:{port}", report=_report(), timeout_s=2).write(capture)
    finally:
        server.stop(None)
    assert err.value.result.dropped == 5 and "failed" in str(err.value)


@contextmanager
def _collector(protocol: str, servicer: Any, handler: type[http.server.BaseHTTPRequestHandler]) -> Iterator[str]:
    if protocol == "grpc":
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        trace_service_pb2_grpc.add_TraceServiceServicer_to_server(servicer, server)
        port = server.add_insecure_port("127.0.0.1:0")
        server.start()
        try:
            yield f"127.0.0.1:{port}"
        finally:
            server.stop(None)
        return
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=httpd.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{httpd.server_address[1]}"
    finally:
        httpd.shutdown()
        httpd.server_close()


class _Unavailable(trace_service_pb2_grpc.TraceServiceServicer):
    """Answers every request at once that it is unavailable, and to retry in 0.3 s (gRPC's RetryInfo)."""

    def Export(self, request: Any, context: Any) -> Any:  # noqa: N802
        retry = RetryInfo(retry_delay=Duration(nanos=300_000_000)).SerializeToString()
        context.set_trailing_metadata((("google.rpc.retryinfo-bin", retry),))
        context.abort(grpc.StatusCode.UNAVAILABLE, "overloaded")


class _Http503(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers["Content-Length"]))
        self.send_response(503)
        self.send_header("Retry-After", "0.3")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *args: Any) -> None:
        pass


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_collector_that_stays_unavailable_costs_one_timeout(capture: CaptureReader, protocol: str) -> None:
    """Each batch is retried (every 0.3 s, as the collector asks) until the exporter gives up, ~1.5 s: once
    failed batches have taken the timeout in all, the rest are counted without being sent, not retried too."""
    report = _report()
    report["stalls"] = [report["stalls"][0]] * 100  # 301 spans, 16 batches of 20
    with _collector(protocol, _Unavailable(), _Http503) as endpoint:
        exporter = OtlpExporter(endpoint, protocol, report=report, batch_size=20, timeout_s=2.0)
        t0 = time.monotonic()
        with pytest.raises(OtlpUnreachable) as err:
            exporter.write(capture)
        elapsed = time.monotonic() - t0
    assert (err.value.result.items, err.value.result.dropped) == (0, 301)
    assert elapsed < 8.0, f"{elapsed:.1f} s: the exporter's retries once per batch"
    assert "were not sent: failed requests had taken" in str(err.value), str(err.value)
    assert ("overloaded" if protocol == "grpc" else "(last error: Service Unavailable)") in str(err.value)


def _partial_success() -> trace_service_pb2.ExportTraceServiceResponse:
    partial = trace_service_pb2.ExportTracePartialSuccess(rejected_spans=2, error_message="spans too old")
    return trace_service_pb2.ExportTraceServiceResponse(partial_success=partial)


class _PartialGrpc(trace_service_pb2_grpc.TraceServiceServicer):
    def Export(self, request: Any, context: Any) -> Any:  # noqa: N802
        return _partial_success()


class _PartialHttp(http.server.BaseHTTPRequestHandler):
    def do_POST(self) -> None:  # noqa: N802
        self.rfile.read(int(self.headers["Content-Length"]))
        _reply(self, _partial_success().SerializeToString())

    def log_message(self, *args: Any) -> None:
        pass


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_spans_a_collector_rejects_are_counted(capture: CaptureReader, protocol: str) -> None:
    """A collector may accept a request and reject part of it (OTLP partial success, status OK): those spans
    were not delivered, and the export must not say they were."""
    with _collector(protocol, _PartialGrpc(), _PartialHttp) as endpoint:
        result = OtlpExporter(endpoint, protocol, report=_report()).write(capture)
    assert (result.items, result.dropped) == (3, 2)
    assert any("rejected 2 of the spans it received (partial success): spans too old" in n for n in result.notes)


@pytest.mark.parametrize(("code", "delay"), [(grpc.StatusCode.UNAVAILABLE, None),
                                           (grpc.StatusCode.DEADLINE_EXCEEDED, None),
                                           (grpc.StatusCode.RESOURCE_EXHAUSTED, 0.2)])
def test_a_transient_grpc_failure_is_retried_then_delivered(
        capture: CaptureReader, code: grpc.StatusCode, delay: float | None) -> None:
    """The OTLP specification's transient codes are retried after a backoff (or the delay the collector asks
    for); the batch then arrives once, and nothing is counted as lost."""
    with otlp_receiver.grpc_receiver(Receiver(fail=[(code, delay)])) as (receiver, port):
        result = OtlpExporter(f"127.0.0.1:{port}", report=_report(), timeout_s=5).write(capture)
    assert (result.items, result.dropped, result.notes) == (5, 0, [])
    assert len(receiver.calls) == 2 and len(receiver.requests) == 1
    waited = receiver.calls[1] - receiver.calls[0]
    assert waited >= (delay if delay is not None else 0.4), f"retried after {waited:.2f} s"
    _check_delivery(receiver.requests)


def test_resource_exhausted_without_a_retry_delay_is_not_retried(capture: CaptureReader) -> None:
    """RESOURCE_EXHAUSTED is transient only when the collector says when to come back (OTLP specification)."""
    with otlp_receiver.grpc_receiver(Receiver(fail=[(grpc.StatusCode.RESOURCE_EXHAUSTED, None)])) as served:
        receiver, port = served
        with pytest.raises(OtlpUnreachable) as err:
            OtlpExporter(f"127.0.0.1:{port}", report=_report(), timeout_s=5).write(capture)
    assert len(receiver.calls) == 1 and err.value.result.dropped == 5
    assert "failed: gRPC RESOURCE_EXHAUSTED: call 1 failed on purpose; 5 spans not delivered" in str(err.value)


def test_grpc_sends_the_headers_of_the_otlp_environment(
        capture: CaptureReader, grpc_receiver: tuple[Receiver, int], monkeypatch: pytest.MonkeyPatch) -> None:
    """A hosted collector wants an API key: OTEL_EXPORTER_OTLP_HEADERS (or its _TRACES_ form) says it."""
    receiver, port = grpc_receiver
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_HEADERS", "x-api-key=secret%20one,X-Team=gpu")
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_COMPRESSION", "gzip")
    result = OtlpExporter(f"127.0.0.1:{port}", report=_report()).write(capture)
    assert (result.items, result.dropped) == (5, 0)
    assert receiver.metadata[0]["x-api-key"] == "secret one" and receiver.metadata[0]["x-team"] == "gpu"
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_COMPRESSION", "zstd")
    with pytest.raises(UserError, match="unknown OTLP compression 'zstd'"):
        OtlpExporter(f"127.0.0.1:{port}", report=_report()).write(capture)


def test_endpoint_parsing() -> None:
    assert parse_endpoint("collector", "grpc") == ("collector:4317", "collector", 4317, False)
    assert parse_endpoint("http://c:9000", "http")[0] == "http://c:9000/v1/traces"
    assert parse_endpoint("https://c/v1/traces", "http")[0] == "https://c:4318/v1/traces"
    for bad in ("", "ftp://x", "http://x:notaport"):
        with pytest.raises(UserError):
            parse_endpoint(bad, "grpc")
    with pytest.raises(UserError):
        OtlpExporter("x", "thrift")


def test_a_failing_grpc_connection_is_one_error_without_grpc_log_lines(
        tmp_path: Path, grpc_receiver: tuple[Receiver, int]) -> None:
    """TLS to a plaintext collector: gRPC's core would log every failed handshake to stderr around the error."""
    _, port = grpc_receiver
    w = CaptureWriter(tmp_path / "c.gputrace", host_header(["test"]))
    cap = w.close({"end_ns": START, "complete": True})
    code = ("import sys\nfrom gputrace.capture import CaptureReader\nfrom gputrace.exporters.otlp import OtlpExporter\n"
            f"with CaptureReader({str(cap)!r}) as r:\n"
            f"    OtlpExporter('https://127.0.0.1:{port}', timeout_s=1.5).write(r)\n")
    env = {k: v for k, v in os.environ.items() if k != "GRPC_VERBOSITY"}
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=env)
    assert "OtlpUnreachable" in r.stderr and "handshake failed" in r.stderr.lower()
    assert "ssl_transport_security" not in r.stderr, r.stderr
