"""Watch mode's metrics by OTLP: the textfile's metrics (metrics.py) through opentelemetry-sdk's MeterProvider
and its OTLP metric exporter (gRPC, or HTTP/protobuf), every ``interval_s``.

Each metric is an observable instrument whose callback reads the watcher's figures when the periodic reader
collects them: nothing is recorded between exports, and no thread wakes but the reader's. Counters are
cumulative (a job's totals since it was first watched); a job's series end when the service forgets it.
Every export is counted, and every failed one (``exports``, ``failed``, ``error`` in `gputrace daemon
status`), so a collector that is down shows there rather than only in a log. Imported only where --otlp
is given (the SDK and gRPC are large).
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

from opentelemetry.metrics import CallbackOptions, Observation
from opentelemetry.sdk.metrics import MeterProvider
from opentelemetry.sdk.metrics.export import MetricExporter, MetricExportResult, PeriodicExportingMetricReader
from opentelemetry.sdk.resources import Resource

from gputrace import __version__
from gputrace.daemon.watch.metrics import METRICS, Sample
from gputrace.errors import UserError

CACHE_S = 1.0  # one collection reads the figures once for all its instruments


class OtlpMetrics:
    """Started at construction; ``shutdown()`` sends the last figures and stops the reader's thread."""

    def __init__(self, endpoint: str, protocol: str, figures: Callable[[], list[Sample]], *,
                 interval_s: float = 60.0, timeout_s: float = 10.0) -> None:
        if not 0 < interval_s < float("inf"):
            raise UserError("the OTLP metrics interval must be a number of seconds > 0")
        self.figures = figures
        self.target = f"{protocol} {endpoint}"
        self.exporter = _Counting(_exporter(endpoint, protocol, timeout_s))
        reader = PeriodicExportingMetricReader(self.exporter, export_interval_millis=interval_s * 1000,
                                               export_timeout_millis=timeout_s * 1000)
        resource = Resource.create({"service.name": "gputraced", "service.version": __version__,
                                    "host.name": socket.gethostname()})
        self.provider = MeterProvider(metric_readers=[reader], resource=resource)
        meter = self.provider.get_meter("gputrace.watch", __version__)
        for name, (kind, unit, help_text) in METRICS.items():
            make = meter.create_observable_counter if kind == "counter" else meter.create_observable_gauge
            make(name, callbacks=[partial(self._observe, name)], unit=unit, description=help_text)
        self._lock = threading.Lock()
        self._cached: list[Sample] = []
        self._cached_at = float("-inf")

    def _observe(self, name: str, options: CallbackOptions) -> Iterable[Observation]:
        return [Observation(s.value, s.labels) for s in self._samples() if s.name == name]

    def _samples(self) -> list[Sample]:
        with self._lock:
            now = time.monotonic()
            if now - self._cached_at > CACHE_S:
                self._cached, self._cached_at = self.figures(), now
            return self._cached

    def status(self) -> dict[str, Any]:
        e = self.exporter
        return {"target": self.target, "exports": e.exports, "failed": e.failed,
                **({"error": e.error} if e.error else {})}

    def shutdown(self) -> None:
        self.provider.shutdown()


def _exporter(endpoint: str, protocol: str, timeout_s: float) -> Any:
    from gputrace.exporters.otlp import parse_endpoint

    url, _, _, secure = parse_endpoint(endpoint, protocol)
    if protocol == "grpc":
        os.environ.setdefault("GRPC_VERBOSITY", "ERROR")  # as for the spans: one error said, not gRPC's log
        from opentelemetry.exporter.otlp.proto.grpc.metric_exporter import OTLPMetricExporter as Grpc

        return Grpc(endpoint=url, insecure=not secure, timeout=timeout_s)
    from opentelemetry.exporter.otlp.proto.http.metric_exporter import OTLPMetricExporter as Http

    return Http(endpoint=url.removesuffix("/v1/traces") + "/v1/metrics", timeout=timeout_s)


class _Counting(MetricExporter):
    """The SDK's exporter, each export's outcome counted (the periodic reader only logs a failure)."""

    def __init__(self, inner: Any) -> None:
        super().__init__(preferred_temporality=inner._preferred_temporality,
                         preferred_aggregation=inner._preferred_aggregation)
        self.inner = inner
        self.exports = self.failed = 0
        self.error = ""

    def export(self, metrics_data: Any, timeout_millis: float = 10_000, **kwargs: Any) -> MetricExportResult:
        try:
            result: MetricExportResult = self.inner.export(metrics_data, timeout_millis=timeout_millis, **kwargs)
        except Exception as e:  # noqa: BLE001 - counted and said in status; the reader goes on
            result, self.error = MetricExportResult.FAILURE, f"{type(e).__name__}: {e}"
        self.exports += 1
        if result != MetricExportResult.SUCCESS:
            self.failed += 1
            self.error = self.error or "the collector rejected or did not answer the export"
        return result

    def force_flush(self, timeout_millis: float = 10_000) -> bool:
        return bool(self.inner.force_flush(timeout_millis=timeout_millis))

    def shutdown(self, timeout_millis: float = 30_000, **kwargs: Any) -> None:
        self.inner.shutdown(timeout_millis=timeout_millis, **kwargs)
