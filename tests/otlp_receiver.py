"""A real OTLP/gRPC trace receiver on 127.0.0.1 for the tests: it keeps every request it is sent, and can fail
its first calls with given statuses (a collector that is briefly unavailable, say)."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from concurrent import futures
from contextlib import contextmanager
from typing import Any

import grpc
from google.protobuf.duration_pb2 import Duration
from google.rpc.error_details_pb2 import RetryInfo
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
