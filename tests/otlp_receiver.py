"""Real OTLP/gRPC trace and metrics receivers on 127.0.0.1 for the tests: they keep every request they are sent."""

from __future__ import annotations

import gzip
import http.server
import threading
from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from typing import Any

import grpc
from opentelemetry.proto.collector.metrics.v1 import metrics_service_pb2, metrics_service_pb2_grpc
from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc


class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
    def __init__(self) -> None:
        self.requests: list[trace_service_pb2.ExportTraceServiceRequest] = []

    def Export(self, request: Any, context: Any) -> trace_service_pb2.ExportTraceServiceResponse:  # noqa: N802
        self.requests.append(request)
        return trace_service_pb2.ExportTraceServiceResponse()


@contextmanager
def grpc_receiver() -> Iterator[tuple[Receiver, int]]:
    """A started server on an ephemeral loopback port: (receiver, port)."""
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    receiver = Receiver()
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

    def points(self, name: str) -> list[tuple[dict[str, str], float]]:
        """Every data point of metric ``name`` in the last request that has it: (attributes, value)."""
        with self.arrived:
            requests = list(self.requests)
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
