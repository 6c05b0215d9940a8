"""Real OTLP receivers on 127.0.0.1 for the tests: gRPC traces (which can fail their first calls with given statuses,
a collector that is briefly unavailable, say) and gRPC and HTTP metrics. Each keeps every request it is sent."""

from __future__ import annotations

import gzip
import http.server
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent import futures
from contextlib import contextmanager
from typing import Any

import grpc
from google.protobuf.duration_pb2 import Duration
from google.rpc.error_details_pb2 import RetryInfo
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self, fail: Sequence[tuple[grpc.StatusCode, float | None]] = ()) -> None:
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []  # those accepted
        self.fail = list(fail)  # the answers to the first calls: (status, the retry delay it asks for, in s)
        self.calls: list[float] = []  # when each call came (time.monotonic())
        self.metadata: list[dict[str, str]] = []  # each call's metadata (headers)

    def Export(self, request: Any, context: Any) -> trace_service_pb2.ExportTraceServiceResponse:  # noqa: N802
        self.calls.append(time.monotonic())
        self.metadata.append({k: v for k, v in context.invocation_metadata() if isinstance(v, str)})
        if self.fail:
            code, delay = self.fail.pop(0)
            if delay is not None:
                retry = RetryInfo(retry_delay=Duration(seconds=int(delay), nanos=int(delay % 1 * 1e9)))
                context.set_trailing_metadata((("google.rpc.retryinfo-bin", retry.SerializeToString()),))
            context.abort(code, f"call {len(self.calls)} failed on purpose")
        self.requests.append(request)
        return trace_service_pb2.ExportTraceServiceResponse()


@contextmanager
def grpc_receiver(receiver: Receiver | None = None) -> Iterator[tuple[Receiver, int]]:
    """A started server on an ephemeral loopback port: (receiver, port)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    receiver = receiver or Receiver()
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield receiver, port
    finally:
        server.stop(None)


class MetricsReceiver(metrics_service_pb2_grpc.MetricsServiceServicer):
    """A real OTLP/gRPC metrics receiver: keeps every request, and wakes whoever waits for one."""

    def __init__(self) -> None:
        self.requests: list[metrics_service_pb2.ExportMetricsServiceRequest] = []
        self.arrived = threading.Condition()

    def Export(self, request: Any, context: Any) -> metrics_service_pb2.ExportMetricsServiceResponse:  # noqa: N802
        with self.arrived:
            self.requests.append(request)
            self.arrived.notify_all()
        return metrics_service_pb2.ExportMetricsServiceResponse()

    def points(self, name: str, request: Any = None) -> list[tuple[dict[str, str], float]]:
        """Every data point of metric ``name`` in ``request``, or in the last request that has it: (attributes,
        value)."""
        with self.arrived:
            requests = [request] if request is not None else list(self.requests)
        for request in reversed(requests):
            found = [_point(p) for rm in request.resource_metrics for sm in rm.scope_metrics
                     for m in sm.metrics if m.name == name for p in _data_points(m)]
            if found:
                return found
        return []


def _data_points(metric: Any) -> list[Any]:
    kind = metric.WhichOneof("data")
    return list(getattr(metric, kind).data_points) if kind in ("sum", "gauge") else []


def _point(p: Any) -> tuple[dict[str, str], float]:
    attrs = {kv.key: kv.value.string_value for kv in p.attributes}
    return attrs, p.as_double if p.WhichOneof("value") == "as_double" else float(p.as_int)


@contextmanager
def grpc_metrics_receiver() -> Iterator[tuple[MetricsReceiver, int]]:
    """A started metrics server on an ephemeral loopback port: (receiver, port)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    receiver = MetricsReceiver()
    metrics_service_pb2_grpc.add_MetricsServiceServicer_to_server(receiver, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield receiver, port
    finally:
        server.stop(None)


@contextmanager
def http_metrics_receiver() -> Iterator[tuple[MetricsReceiver, int]]:
    """The same receiver behind OTLP/HTTP (protobuf POSTs to /v1/metrics): (receiver, port)."""
    receiver = MetricsReceiver()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self) -> None:  # noqa: N802
            body = self.rfile.read(int(self.headers.get("Content-Length", 0)))
            if self.path != "/v1/metrics" or self.headers.get("Content-Type") != "application/x-protobuf":
                self.send_error(404)
                return
            if self.headers.get("Content-Encoding") == "gzip":
                body = gzip.decompress(body)
            reply = receiver.Export(metrics_service_pb2.ExportMetricsServiceRequest.FromString(body), None)
            data = reply.SerializeToString()
            self.send_response(200)
            self.send_header("Content-Type", "application/x-protobuf")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args: Any) -> None:
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield receiver, server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
