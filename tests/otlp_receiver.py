"""A real OTLP/gRPC trace receiver on 127.0.0.1 for the tests: it keeps every request it is sent."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent import futures
from contextlib import contextmanager
from typing import Any

import grpc
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
