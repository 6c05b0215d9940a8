"""OTLP export: every GPU stall of a capture as an OpenTelemetry span, sent to a collector (Jaeger, Tempo, ...).

One trace per capture: a root span ``gputrace capture`` over the capture window, a child span
``gpu.stall <cause>`` per stall, and under each stall a child span per piece of evidence (the syscall,
block request, off-CPU wait or wakeup that explains it).

And one trace per collective instance, shared by every rank of the job on every host: its trace id is derived
from the communicator id and the sequence number alone (``collective_trace_id``), so each host's capture,
exported on its own, adds its ranks' spans ``collective <op> #<seq>`` to the same trace in the backend: no
coordinator joins them. A rank's span runs from its arrival (its kernel's start; a host call's entry, gloo's)
to the collective's completion, and carries the stall its arrival ended (a host call's: its thread's time
since its previous collective): why that rank got there when it did.

Times go out as epoch ns, converted with the capture header's monotonic->realtime offset through
gputrace.clock.

Spans are recorded with the OpenTelemetry SDK and handed to an OTLP exporter here, batch by batch, instead
of through a BatchSpanProcessor (which drops spans when its queue is full and only logs it): every span a
batch failed to deliver is counted in ``ExportResult.dropped``, and so is every span a collector received but
rejected (the response's ``partial_success``, which the SDK's exporters do not read). Over gRPC the exporter
is ours (exporters/otlp_grpc.py: the SDK's encoder, grpcio's stub, every answer read); over HTTP it is the
SDK's, on a requests Session whose response hook reads each answer.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import socket
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any
from urllib.parse import urlsplit

from google.protobuf.message import DecodeError
from opentelemetry import trace
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor, TracerProvider
from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator

from gputrace import __version__, clock
from gputrace.analysis.devices import SHARED, ReportDevices
from gputrace.analysis.report import holders_text
from gputrace.capture import CaptureReader
from gputrace.documents import CollectiveRow, Evidence, Report, Stall
from gputrace.errors import UserError
from gputrace.exporters import ExportResult

PROTOCOLS = ("grpc", "http")
DEFAULT_PORTS = {"grpc": 4317, "http": 4318}
_EXPORTER_LOGGERS = ("opentelemetry.exporter.otlp", "opentelemetry.sdk")


class OtlpUnreachable(UserError):
    """Nothing could be delivered. ``result`` holds the counts (every span dropped)."""

    def __init__(self, message: str, result: ExportResult) -> None:
        super().__init__(message)
        self.result = result


class OtlpExporter:
    """Ships a capture's stalls as OTLP spans over gRPC (default, port 4317) or HTTP/protobuf (4318)."""

    def __init__(
        self,
        endpoint: str,
        protocol: str = "grpc",
        *,
        report: Report | None = None,
        min_gap_ns: int = 1_000_000,
        batch_size: int = 512,
        timeout_s: float = 10.0,
    ) -> None:
        if protocol not in PROTOCOLS:
            raise UserError(f"unknown OTLP protocol {protocol!r}; use grpc or http")
        if batch_size < 1:
            raise UserError("OTLP batch size must be at least 1")
        self.protocol = protocol
        self.endpoint, self.host, self.port, self.secure = parse_endpoint(endpoint, protocol)
        self.report = report
        self.min_gap_ns = min_gap_ns
        self.batch_size = batch_size
        self.timeout_s = timeout_s
        self.result: ExportResult | None = None  # of the write under way, or the last one

    def write(self, reader: CaptureReader) -> ExportResult:
        report = self.report if self.report is not None else _analyze(reader, self.min_gap_ns)
        header = reader.header
        result = self.result = ExportResult(target=f"{self.protocol} {self.endpoint}")
        reason = self._unreachable_reason()
        if reason:
            result.dropped = count_spans(report)
            result.notes.append(reason)
            raise OtlpUnreachable(
                f"OTLP endpoint {self.endpoint} ({self.protocol}) unreachable: {reason}; "
                f"{result.dropped} spans not delivered", result)
        rejections = Rejections()
        with _quiet_exporter_logs() as errors:
            shipper = _BatchShipper(self._make_exporter(rejections, errors), self.batch_size, result, self.timeout_s,
                                    rejections)
            try:
                record_spans(report, header, shipper)
                shipper.flush()
            finally:
                shipper.exporter.shutdown()
        if result.dropped:
            failed = result.dropped - shipper.rejected  # in requests that failed, not rejected from one that worked
            detail = failure_detail(errors)
            if shipper.rejected:
                result.notes.append(rejections.describe())
                detail = detail if failed else rejections.describe()
            if failed:
                result.notes.append(f"{failed} spans not delivered: {detail}")
            given_up = ""
            if shipper.not_sent:  # said, so that a user does not wonder why the collector saw fewer requests
                given_up = (f" (the last {shipper.not_sent} were not sent: failed requests had taken "
                            f"{shipper.failed_s:.1f} s, the timeout)")
                result.notes.append(given_up.strip(" ()"))
            if not result.items:
                raise OtlpUnreachable(
                    f"OTLP export to {self.endpoint} ({self.protocol}) failed: {detail}; "
                    f"{result.dropped} spans not delivered{given_up}", result)
        return result

    def handled(self) -> int:
        """Spans the write under way has sent or counted as not delivered so far (for a progress line)."""
        return self.result.items + self.result.dropped if self.result else 0

    def _unreachable_reason(self) -> str:
        """Why a TCP connection to the endpoint fails, or "" (checked first: a refused port answers fast)."""
        try:
            with socket.create_connection((self.host, self.port), timeout=min(self.timeout_s, 5.0)):
                return ""
        except OSError as e:
            return e.strerror or str(e)

    def _make_exporter(self, rejections: Rejections, errors: list[str]) -> SpanExporter:
        """The transport: both read every answer's partial success into ``rejections``; a failed batch's error
        goes to ``errors`` (gRPC: said by ours; HTTP: logged by the SDK's exporter, collected there)."""
        if self.protocol == "grpc":
            # gRPC's core logs each failed connection attempt (a TLS handshake, say) straight to stderr, around
            # the one error said here; read when grpc is first imported, and a user's own setting is kept
            os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
            from gputrace.exporters.otlp_grpc import GrpcSpanExporter

            return GrpcSpanExporter(self.endpoint, secure=self.secure, timeout_s=self.timeout_s,
                                    on_response=rejections.note, errors=errors)
        import requests
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter as Http

        session = requests.Session()
        session.hooks["response"].append(rejections.on_http_response)
        return Http(endpoint=self.endpoint, timeout=self.timeout_s, session=session)


class Rejections:
    """Spans a collector received but rejected: an OTLP response's ``partial_success`` (the request succeeded,
    ``rejected_spans`` of it did not), which the SDK's exporters discard. Fed every response."""

    def __init__(self) -> None:
        self.spans = 0
        self.message = ""

    def note(self, response: ExportTraceServiceResponse) -> None:
        partial = response.partial_success
        self.spans += max(0, int(partial.rejected_spans))
        if partial.error_message:
            self.message = partial.error_message.splitlines()[0][:300]

    def describe(self) -> str:
        why = f": {self.message}" if self.message else ""
        return f"the collector rejected {self.spans} of the spans it received (partial success){why}"

    def on_http_response(self, response: Any, *args: Any, **kwargs: Any) -> None:
        """A requests response hook: a 200 answer's body is an ExportTraceServiceResponse (or empty)."""
        if response.status_code != 200 or not response.content:
            return
        with contextlib.suppress(DecodeError):  # not protobuf (a proxy's page, JSON): no rejection to read
            self.note(ExportTraceServiceResponse.FromString(response.content))


def parse_endpoint(endpoint: str, protocol: str) -> tuple[str, str, int, bool]:
    """(endpoint as the OTLP exporter wants it, host, port, TLS?) from ``host:port`` or a URL."""
    text = endpoint.strip()
    if not text:
        raise UserError("empty OTLP endpoint; give e.g. 127.0.0.1:4317 or http://collector:4318")
    parts = urlsplit(text if "://" in text else f"http://{text}")
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise UserError(f"bad OTLP endpoint {endpoint!r}; give host:port or an http(s):// URL")
    try:
        port = parts.port or DEFAULT_PORTS[protocol]
    except ValueError:
        raise UserError(f"bad port in OTLP endpoint {endpoint!r}") from None
    secure = parts.scheme == "https"
    host = parts.hostname
    netloc = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    if protocol == "grpc":
        return netloc, host, port, secure
    path = parts.path.rstrip("/") or ""
    if not path.endswith("/v1/traces"):
        path += "/v1/traces"
    return f"{parts.scheme}://{netloc}{path}", host, port, secure


def _analyze(reader: CaptureReader, min_gap_ns: int) -> Report:
    try:
        from gputrace.analysis import analyze
    except ImportError:
        raise UserError("stall analysis is not available in this installation; cannot build OTLP spans") from None
    report: Report = analyze(reader, min_gap_ns=min_gap_ns)
    return report


_TRANSIENT = "Transient error "  # how the SDK's HTTP exporter logs a failure it retries


def failure_detail(errors: Sequence[str]) -> str:
    """The exporter's last error message, with the cause of the last failure it retried when the message does
    not name one (the HTTP exporter ends with "due to timeout, max retries or shutdown")."""
    if not errors:
        return "the collector rejected or did not answer the request"
    causes = [e[len(_TRANSIENT):].split(" encountered while exporting")[0] for e in errors if e.startswith(_TRANSIENT)]
    if causes and causes[-1] not in errors[-1]:
        return f"{errors[-1].rstrip('.')} (last error: {causes[-1]})"
    return errors[-1]


def count_spans(report: Report) -> int:
    stalls = report.get("stalls", [])
    return 1 + len(stalls) + sum(len(s.get("evidence", [])) for s in stalls) + len(_joinable(report))


def _joinable(report: Report) -> list[CollectiveRow]:
    """The report's collective rows with an identity other hosts share (a communicator id)."""
    return [r for r in report.get("collectives", []) if isinstance(r, dict) and r.get("comm")]


def _digest(*parts: object) -> bytes:
    return hashlib.sha256("\x1f".join(str(p) for p in parts).encode("utf-8", "replace")).digest()


def collective_trace_id(comm: str, seq: int) -> int:
    """The trace id of one collective instance: the same on every host that exports a rank of it."""
    return int.from_bytes(_digest("gputrace.collective", comm, seq)[:16], "big") or 1


def _rank_span_id(row: CollectiveRow) -> int:
    """A rank's span id, from what names it: exporting the same capture again gives the same span."""
    return int.from_bytes(_digest(row.get("comm"), row.get("seq"), row.get("host"), row.get("pid"),
                                  row.get("rank"), row.get("device"))[:8], "big") or 1


class _Ids(IdGenerator):
    """Random ids, except for the span started while ``fixed`` holds (trace id, span id)."""

    def __init__(self) -> None:
        self.fixed: tuple[int, int] | None = None
        self._random = RandomIdGenerator()

    def generate_trace_id(self) -> int:
        return self.fixed[0] if self.fixed else self._random.generate_trace_id()

    def generate_span_id(self) -> int:
        return self.fixed[1] if self.fixed else self._random.generate_span_id()


class _BatchShipper(SpanProcessor):
    """Receives ended spans from the SDK and sends them in batches, counting what each batch fails to deliver."""

    def __init__(self, exporter: SpanExporter, batch_size: int, result: ExportResult,
                 timeout_s: float = 10.0, rejections: Rejections | None = None) -> None:
        self.exporter = exporter
        self.rejections = rejections or Rejections()
        self.rejected = 0  # spans of delivered batches that the collector rejected (partial success)
        self.batch_size = batch_size
        self.result = result
        self.timeout_s = timeout_s
        self.failed_s = 0.0  # time spent on batches that failed, retries included
        self.not_sent = 0  # spans counted as not delivered without being sent: failures took the whole timeout
        self._batch: list[ReadableSpan] = []

    def on_end(self, span: ReadableSpan) -> None:
        self._batch.append(span)
        if len(self._batch) >= self.batch_size:
            self.flush()

    def flush(self) -> None:
        batch, self._batch = self._batch, []
        if not batch:
            return
        if self.gave_up:  # a timeout (or the exporter's retries) per batch would make a large export hang for minutes
            self.result.dropped += len(batch)
            self.not_sent += len(batch)
            return
        t0 = time.monotonic()
        rejected_before = self.rejections.spans
        try:
            ok = self.exporter.export(batch) is SpanExportResult.SUCCESS
        except Exception as e:  # noqa: BLE001 - a transport error is a failed batch, counted below
            logging.getLogger(_EXPORTER_LOGGERS[0]).error("%s", e)
            ok = False
        if ok:  # delivered, less what the collector said it rejected
            rejected = min(len(batch), self.rejections.spans - rejected_before)
            self.rejected += rejected
            self.result.items += len(batch) - rejected
            self.result.dropped += rejected
        else:
            self.result.dropped += len(batch)
            self.failed_s += time.monotonic() - t0

    @property
    def gave_up(self) -> bool:
        """Failed batches have waited (on the collector, or between the exporter's retries) one timeout in all:
        the collector does not answer, or keeps answering that it is unavailable."""
        return self.failed_s >= 0.9 * self.timeout_s

    def force_flush(self, timeout_millis: int = 30000) -> bool:
        self.flush()
        return True


def resource_for(report: Report, header: dict[str, Any]) -> Resource:
    cap = report.get("capture", {})
    pids = [int(p) for p in cap.get("pids", [])]
    attrs: dict[str, Any] = {
        "service.name": "gputrace",
        "service.version": str(header.get("tool_version", __version__)),
        "host.name": str(cap.get("host") or header.get("host", "")),
        "os.type": "linux",
        "gputrace.capture.kernel": str(header.get("kernel", "")),
        "gputrace.capture.boot_id": str(header.get("boot_id", "")),
        "gputrace.capture.pids": pids,
        "gputrace.capture.complete": bool(cap.get("complete", True)),
        "gputrace.capture.drops": sum(int(v) for v in cap.get("drops", {}).values()),
    }
    if len(pids) == 1:
        attrs["process.pid"] = pids[0]
    return Resource.create(attrs)


def record_spans(report: Report, header: dict[str, Any], processor: SpanProcessor) -> None:
    """Record the capture's spans; each ends into ``processor``."""
    ids = _Ids()
    provider = TracerProvider(resource=resource_for(report, header), shutdown_on_exit=False, id_generator=ids)
    provider.add_span_processor(processor)
    tracer = provider.get_tracer("gputrace", __version__)
    offset = int(header["mono_to_realtime_ns"])
    cap = report.get("capture", {})
    start = int(cap.get("start_ns") or header.get("start_ns", 0))
    end = int(cap.get("end_ns") or start)
    devices = ReportDevices(report)
    host = str(cap.get("host") or header.get("host", ""))
    root = tracer.start_span("gputrace capture", start_time=clock.to_realtime_ns(start, offset),
                             attributes=_capture_attrs(report, host))
    ctx = trace.set_span_in_context(root)
    for stall in report.get("stalls", []):
        _stall_span(tracer, ctx, stall, offset, host, devices)
    root.end(end_time=clock.to_realtime_ns(max(end, start), offset))
    for row in _joinable(report):
        _rank_span(tracer, ids, row, offset)
    provider.shutdown()


def _rank_span(tracer: trace.Tracer, ids: _Ids, row: CollectiveRow, offset: int) -> None:
    """One rank's part in one collective instance, in the instance's own trace (no parent: every rank's span
    is a root there, as no rank's capture is the others')."""
    seq, op = int(row.get("seq", 0)), str(row.get("op", ""))
    started, completed = int(row.get("started_ns", 0)), int(row.get("completed_ns", 0))
    attrs: dict[str, Any] = {
        "gputrace.collective.comm": str(row.get("comm", "")), "gputrace.collective.seq": seq,
        "gputrace.collective.op": op, "gputrace.collective.bytes": int(row.get("bytes", -1)),
        "gputrace.collective.rank": int(row.get("rank", -1)), "gputrace.collective.world": int(row.get("world", -1)),
        "gputrace.collective.kernel": str(row.get("kernel", "")),
        "gputrace.collective.enqueued_ns": clock.to_realtime_ns(int(row.get("enqueued_ns", started)), offset),
        "gputrace.collective.waited_ns": int(row.get("waited_ns", 0)),
        "gputrace.collective.ranks_captured": int(row.get("ranks_captured", 1)),
        "gputrace.capture.host": str(row.get("host", "")), "process.pid": int(row.get("pid", 0)),
        "gpu.device": int(row.get("device", 0)),
    }
    if isinstance(row.get("late"), bool):
        attrs["gputrace.collective.late"] = row["late"]
    if row.get("backend"):  # a call on the host (torch.distributed's): its backend and calling thread
        attrs["gputrace.collective.backend"] = str(row["backend"])
    if type(row.get("tid")) is int:
        attrs["thread.id"] = row["tid"]
    arrival = row.get("arrival")
    if isinstance(arrival, dict):
        attrs["gputrace.arrival.cause"] = str(arrival.get("cause", ""))
        attrs["gputrace.arrival.stall_ns"] = int(arrival.get("stall_ns", 0))
        attrs["gputrace.arrival.via"] = [str(v) for v in arrival.get("via", [])]
        for key, value in (arrival.get("culprit") or {}).items():
            if isinstance(value, (str, bool, int, float)):
                attrs[f"gputrace.arrival.culprit.{key}"] = value
    ids.fixed = (collective_trace_id(str(row.get("comm", "")), seq), _rank_span_id(row))
    try:
        span = tracer.start_span(f"collective {op} #{seq}", context=trace.set_span_in_context(trace.INVALID_SPAN),
                                 attributes=attrs, start_time=clock.to_realtime_ns(started, offset))
    finally:
        ids.fixed = None
    span.end(end_time=clock.to_realtime_ns(max(completed, started), offset))


def _capture_attrs(report: Report, host: str) -> dict[str, Any]:
    summary = report.get("summary", {})
    attrs: dict[str, Any] = {
        "gputrace.capture.host": host,
        "gputrace.window_ns": int(summary.get("window_ns", 0)),
        "gputrace.busy_ns": int(summary.get("busy_ns", 0)),
        "gputrace.stall_ns": int(summary.get("stall_ns", 0)),
        "gputrace.stalls": len(report.get("stalls", [])),
    }
    for cause, ns in summary.get("by_cause", {}).items():
        attrs[f"gputrace.stall_ns.{cause}"] = int(ns)
    return attrs


def _stall_span(tracer: trace.Tracer, ctx: Any, stall: Stall, offset: int, host: str,
                devices: ReportDevices) -> None:
    device = int(stall.get("device", 0))
    pid = stall.get("device_pid")
    key = (int(pid), device) if type(pid) is int and pid >= 0 else (SHARED, device)
    cause = str(stall.get("cause", "unknown"))
    attrs: dict[str, Any] = {
        "gpu.device": device,
        "gputrace.cause": cause,
        "gputrace.duration_ns": int(stall.get("duration_ns", 0)),
        "gputrace.via": [str(v) for v in stall.get("via", [])],
        "gputrace.capture.host": host,
        "gputrace.simulated": devices.info.get(key, ("", False))[1],
    }
    if key[0] != SHARED:
        attrs["gputrace.device.pid"] = key[0]
    if key in devices.uuids:
        attrs["gputrace.device.uuid"] = devices.uuids[key]
    for name, value in stall.get("culprit", {}).items():
        if isinstance(value, (str, bool, int, float)):
            attrs[f"gputrace.culprit.{name}"] = value
        elif name == "cpu_held_by" and isinstance(value, list) and value:
            attrs["gputrace.culprit.cpu_held_by"] = holders_text(value)
    late = stall.get("late_rank")
    if isinstance(late, dict):  # why the rank this collective stall waited for was late, on its own host
        attrs["gputrace.late_rank.cause"] = str(late.get("cause", ""))
        for name, value in (late.get("culprit") or {}).items():
            if isinstance(value, (str, bool, int, float)):
                attrs[f"gputrace.late_rank.culprit.{name}"] = value
    span = tracer.start_span(f"gpu.stall {cause}", context=ctx, attributes=attrs,
                             start_time=clock.to_realtime_ns(int(stall["start_ns"]), offset))
    child_ctx = trace.set_span_in_context(span)
    for ev in stall.get("evidence", []):
        _evidence_span(tracer, child_ctx, ev, offset)
    span.end(end_time=clock.to_realtime_ns(int(stall["end_ns"]), offset))


def _evidence_span(tracer: trace.Tracer, ctx: Any, ev: Evidence, offset: int) -> None:
    kind = str(ev.get("kind", "evidence"))
    what = str(ev.get("what", ""))
    attrs: dict[str, Any] = {"gputrace.evidence.kind": kind, "gputrace.evidence.what": what,
                             "process.pid": int(ev.get("pid", 0)), "thread.id": int(ev.get("tid", 0))}
    start = int(ev.get("start_ns", 0))
    span = tracer.start_span(f"{kind} {what}".strip(), context=ctx, attributes=attrs,
                             start_time=clock.to_realtime_ns(start, offset))
    span.end(end_time=clock.to_realtime_ns(max(int(ev.get("end_ns", start)), start), offset))


class _ErrorList(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage().splitlines()[0][:300])


@contextmanager
def _quiet_exporter_logs() -> Iterator[list[str]]:
    """Collect the OTLP exporter's warnings (for one clear error) instead of letting them spill as log noise."""
    handler = _ErrorList()
    saved = []
    for name in _EXPORTER_LOGGERS:
        log = logging.getLogger(name)
        saved.append((log, log.propagate))
        log.addHandler(handler)
        log.propagate = False
    try:
        yield handler.messages
    finally:
        for log, propagate in saved:
            log.removeHandler(handler)
            log.propagate = propagate
