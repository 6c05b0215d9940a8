"""OTLP/gRPC span exporter on a channel of ours: spans encoded by the OTel SDK's public encoder, sent with
grpcio's TraceService stub, each answer shown to the caller (its ``partial_success``: spans the collector
received but rejected, which the SDK's own exporter never reads).

Failures follow the OTLP specification: the transient status codes are retried, with exponential backoff and
jitter or the delay the collector asks for (``google.rpc.RetryInfo``), RESOURCE_EXHAUSTED only when it asks;
every attempt of one batch shares one deadline (the timeout). The SDK exporter's environment settings for
traces are honoured: headers, compression, the TLS certificate and client key.

Import this module after ``GRPC_VERBOSITY`` is set (gRPC reads it when first imported).
"""

from __future__ import annotations

import os
import random
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import grpc
from google.rpc.error_details_pb2 import RetryInfo
from opentelemetry.exporter.otlp.proto.common.trace_encoder import encode_spans
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from opentelemetry.proto.collector.trace.v1.trace_service_pb2_grpc import TraceServiceStub
from opentelemetry.sdk import environment_variables as env
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.util.re import parse_env_headers

from gputrace import __version__
from gputrace.errors import UserError

# The OTLP specification's retryable codes; RESOURCE_EXHAUSTED only with a RetryInfo (the collector can recover)
RETRYABLE = frozenset({grpc.StatusCode.CANCELLED, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.ABORTED,
                       grpc.StatusCode.OUT_OF_RANGE, grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DATA_LOSS})
MAX_TRIES = 6  # per batch, within its deadline
FIRST_BACKOFF_S = 0.5  # doubled after each failed try, ±20% jitter
_COMPRESSION = {"gzip": grpc.Compression.Gzip, "deflate": grpc.Compression.Deflate,
                "none": grpc.Compression.NoCompression}
_STUB: Callable[[grpc.Channel], Any] = TraceServiceStub  # generated code, untyped


class GrpcSpanExporter(SpanExporter):
    """Sends each batch as one ExportTraceServiceRequest. ``on_response`` sees every answer; ``errors`` gets a
    line for each batch that failed (the status, its details, the tries), for the caller to report."""

    def __init__(self, target: str, *, secure: bool, timeout_s: float,
                 on_response: Callable[[ExportTraceServiceResponse], None], errors: list[str]) -> None:
        self.target = target
        self.timeout_s = timeout_s
        self.on_response = on_response
        self.errors = errors
        self.metadata = _headers()
        self.compression = _compression()
        self.credentials = _credentials() if secure else None
        self.tries = 0  # requests made, retries included
        self._channel: grpc.Channel | None = None
        self._stub: Any = None
        self._connect()

    def _connect(self) -> None:
        """A fresh channel: one in connection backoff fails every call at once, so a retry gets a new one."""
        if self._channel is not None:
            self._channel.close()
        options = [("grpc.primary_user_agent", f"gputrace/{__version__}")]
        if self.credentials is None:
            self._channel = grpc.insecure_channel(self.target, options=options, compression=self.compression)
        else:
            self._channel = grpc.secure_channel(self.target, self.credentials, options=options,
                                                 compression=self.compression)
        self._stub = _STUB(self._channel)

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        if self._channel is None:
            self.errors.append("the gRPC exporter is shut down")
            return SpanExportResult.FAILURE
        request = encode_spans(spans)
        t0 = time.monotonic()
        deadline = t0 + self.timeout_s
        for attempt in range(MAX_TRIES):
            self.tries += 1
            try:
                response = self._stub.Export(request, timeout=max(0.0, deadline - time.monotonic()),
                                             metadata=self.metadata)
            except grpc.RpcError as error:
                code, delay = _status(error), _retry_delay(error)
                retryable = code in RETRYABLE or (code is grpc.StatusCode.RESOURCE_EXHAUSTED and delay is not None)
                backoff = delay if delay is not None else FIRST_BACKOFF_S * 2 ** attempt * random.uniform(0.8, 1.2)
                if not retryable or attempt + 1 == MAX_TRIES or time.monotonic() + backoff >= deadline:
                    name = code.name if code is not None else "error"
                    details = (_details(error) or "no details").splitlines()[0][:300]
                    tries = f" ({attempt + 1} tries in {time.monotonic() - t0:.1f} s)" if attempt else ""
                    self.errors.append(f"gRPC {name}: {details}{tries}")
                    return SpanExportResult.FAILURE
                time.sleep(backoff)
                if code is grpc.StatusCode.UNAVAILABLE:
                    self._connect()
                continue
            self.on_response(response)
            return SpanExportResult.SUCCESS
        return SpanExportResult.FAILURE  # not reached: the last try returns above

    def shutdown(self) -> None:
        if self._channel is not None:
            self._channel.close()
            self._channel = None

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        return True  # nothing is buffered here


def _status(error: grpc.RpcError) -> grpc.StatusCode | None:
    code = getattr(error, "code", None)  # a call's error is also a grpc.Call; others carry no status
    return code() if callable(code) else None


def _details(error: grpc.RpcError) -> str:
    details = getattr(error, "details", None)
    return str(details() or "") if callable(details) else str(error)


def _retry_delay(error: grpc.RpcError) -> float | None:
    """The delay the collector asked for (a ``google.rpc.RetryInfo`` in the trailing metadata), if any."""
    trailing = getattr(error, "trailing_metadata", None)
    for key, value in (trailing() or ()) if callable(trailing) else ():
        if key == "google.rpc.retryinfo-bin":
            delay = RetryInfo.FromString(value).retry_delay
            return float(delay.seconds + delay.nanos / 1e9)
    return None


def _setting(name: str) -> str:
    """An OTLP exporter setting: the traces-specific variable, else the generic one."""
    generic = getattr(env, f"OTEL_EXPORTER_OTLP_{name}")
    return os.environ.get(getattr(env, f"OTEL_EXPORTER_OTLP_TRACES_{name}")) or os.environ.get(generic) or ""


def _headers() -> tuple[tuple[str, str], ...]:
    text = _setting("HEADERS")
    return tuple((k.lower(), v) for k, v in parse_env_headers(text, liberal=True).items()) if text else ()


def _compression() -> grpc.Compression:
    name = _setting("COMPRESSION").strip().lower() or "none"
    if name not in _COMPRESSION:
        raise UserError(f"unknown OTLP compression {name!r} (OTEL_EXPORTER_OTLP_COMPRESSION); use gzip, deflate "
                        "or none")
    return _COMPRESSION[name]


def _credentials() -> grpc.ChannelCredentials:
    """TLS credentials: the system's roots, or the certificate (and client key and certificate) named."""
    files = {}
    for name in ("CERTIFICATE", "CLIENT_KEY", "CLIENT_CERTIFICATE"):
        path = _setting(name)
        if path:
            try:
                files[name] = Path(path).read_bytes()
            except OSError as e:
                raise UserError(f"cannot read {path} (OTEL_EXPORTER_OTLP_{name}): {e.strerror or e}") from None
    return grpc.ssl_channel_credentials(root_certificates=files.get("CERTIFICATE"),
                                        private_key=files.get("CLIENT_KEY"),
                                        certificate_chain=files.get("CLIENT_CERTIFICATE"))
