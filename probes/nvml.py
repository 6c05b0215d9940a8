"""NVML sampler: per-device counters beside the trace (utilization, SM clock, memory, power, PCIe, NVLink, GPM).

Utilization comes from nvmlDeviceGetSamples, which returns the driver's own timestamped samples (CLOCK_REALTIME
µs, converted through gputrace.clock), so the counter track shows when the driver measured, not when we
asked. Instantaneous readings (clock, memory, power, PCIe) are stamped when read; NVLink counters become
rates between two reads; GPM's SM activity is computed from two GPM samples, on GPUs that support it.

pynvml (nvidia-ml-py) is imported in start(); a host without the NVIDIA driver gets a SourceStatus saying
so and the capture goes on. A metric a device does not support is dropped for that device once, and named;
a read that fails costs that tick's sample of its metric group only, is counted (the `nvml.errors` drop)
and named with its last error at the end.
"""

from __future__ import annotations

import contextlib
import importlib
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from gputrace import clock
from gputrace.records import NvmlSample, SourceStatus
from gputrace.source import Sink
from gputrace.threads import Thread

UINT_MAX = 0xFFFFFFFF  # NVML scope id: all NVLink links together
KIB = 1024
PCIE_EVERY_S = 1.0  # PCIe throughput is read about this often (NVML measures it over 20 ms per call)

# NVML value types (nvmlValueType_t) → the union member holding the value
VALUE_MEMBERS = {0: "dVal", 1: "uiVal", 2: "ulVal", 3: "ullVal", 4: "sllVal", 5: "siVal", 6: "usVal"}

ToMonotonic = Callable[[int], int]


def sample_value(value_type: int, value: Any) -> float:
    """The number in an nvmlValue_t union, read by its declared type."""
    return float(getattr(value, VALUE_MEMBERS.get(value_type, "uiVal")))


def util_records(
    device: int, metric: str, value_type: int, samples: Sequence[Any], since_us: int, to_mono: ToMonotonic
) -> tuple[list[NvmlSample], int]:
    """Records for the driver's samples newer than ``since_us`` and the newest timestamp seen.

    The driver keeps a ring of samples and returns all it has: older ones were reported before (or precede
    the capture) and are skipped.
    """
    out = []
    newest = since_us
    for s in sorted(samples, key=lambda s: s.timeStamp):
        if s.timeStamp <= since_us:
            continue
        out.append(NvmlSample(to_mono(s.timeStamp * 1000), device, metric, sample_value(value_type, s.sampleValue)))
        newest = s.timeStamp
    return out, newest


def counter_rate(prev: tuple[int, float] | None, cur: tuple[int, float]) -> float | None:
    """Bytes/s between two (timestamp µs, cumulative KiB) readings; None without a usable earlier one."""
    if prev is None or cur[0] <= prev[0] or cur[1] < prev[1]:
        return None
    return (cur[1] - prev[1]) * KIB * 1e6 / (cur[0] - prev[0])


def field_reading(field: Any) -> tuple[int, float] | None:
    """(timestamp µs, value) of an nvmlFieldValue_t, None when NVML could not read it."""
    if field.nvmlReturn != 0:
        return None
    return int(field.timestamp), sample_value(field.valueType, field.value)


class _Device:
    """One GPU's sampling state: what it supports, the last samples seen, the previous counter readings."""

    def __init__(self, nv: Any, index: int, since_us: int) -> None:
        self.nv, self.index = nv, index
        self.handle = nv.nvmlDeviceGetHandleByIndex(index)
        self.name = _text(nv.nvmlDeviceGetName(self.handle))
        self.uuid = _text(nv.nvmlDeviceGetUUID(self.handle))
        self.since = {"gpu_util_pct": since_us, "mem_util_pct": since_us}
        self.unsupported: set[str] = set()
        self.nvlink_prev: dict[str, tuple[int, float]] = {}
        self.gpm_prev: Any = None
        self.gpm_samples: list[Any] = []
        self.failures: dict[str, tuple[int, str]] = {}  # metric group → (failed reads, the last error)
        self.cpu_ns: dict[str, int] = {}  # metric group → CPU time its reads took, summed
        self.reads: dict[str, int] = {}

    def sample(self, to_mono: ToMonotonic, tick: int = 0, pcie_every: int = 1) -> list[NvmlSample]:
        """This tick's records; a group of metrics whose read fails costs that group's sample only. PCIe
        throughput is read every ``pcie_every`` ticks: NVML measures it over a 20 ms window per call."""
        out: list[NvmlSample] = []
        for metric, read in (("util", self._utilization), ("scalars", self._scalars), ("pcie", self._pcie),
                             ("nvlink", self._nvlink), ("gpm_sm_util_pct", self._gpm)):  # fmt: skip
            if metric in self.unsupported or (metric == "pcie" and tick % pcie_every):
                continue
            cpu = time.thread_time_ns()
            out += self._guard(metric, read, to_mono)
            self.cpu_ns[metric] = self.cpu_ns.get(metric, 0) + time.thread_time_ns() - cpu
            self.reads[metric] = self.reads.get(metric, 0) + 1
        return out

    def cost_text(self) -> str:
        """CPU time per read of each metric group, as this sampler measured it."""
        return ", ".join(f"{m} {self.cpu_ns[m] / max(1, self.reads[m]) / 1e3:.0f} us" for m in sorted(self.cpu_ns))

    def _guard(self, metric: str, read: Callable[[ToMonotonic], list[NvmlSample]], to_mono: ToMonotonic) -> list[Any]:
        try:
            return read(to_mono)
        except self.nv.NVMLError as e:
            if _not_supported(self.nv, e):
                self.unsupported.add(metric)
                return []
            self._failed(metric, e)
        except Exception as e:  # noqa: BLE001 - a failing read (GPU fell off the bus) costs that sample only
            self._failed(metric, e)
        return []

    def _failed(self, metric: str, e: Exception) -> None:
        n, _ = self.failures.get(metric, (0, ""))
        self.failures[metric] = (n + 1, f"{type(e).__name__}: {e}"[:120])

    def _utilization(self, to_mono: ToMonotonic) -> list[NvmlSample]:
        nv, out = self.nv, []
        try:
            for metric, kind in (("gpu_util_pct", nv.NVML_GPU_UTILIZATION_SAMPLES),
                                 ("mem_util_pct", nv.NVML_MEMORY_UTILIZATION_SAMPLES)):  # fmt: skip
                try:
                    vtype, samples = nv.nvmlDeviceGetSamples(self.handle, kind, self.since[metric])
                except nv.NVMLError as e:
                    if getattr(e, "value", None) == nv.NVML_ERROR_NOT_FOUND:
                        continue  # no sample newer than the last one seen: the driver samples every ~1/6 s
                    raise
                recs, self.since[metric] = util_records(self.index, metric, vtype, samples, self.since[metric], to_mono)
                out += recs
            return out
        except nv.NVMLError as e:
            if not _not_supported(nv, e):
                raise
        rates = nv.nvmlDeviceGetUtilizationRates(self.handle)  # no sample buffer (vGPU, old GPUs): read now
        now = clock.monotonic_ns()
        return [NvmlSample(now, self.index, "gpu_util_pct", float(rates.gpu)),
                NvmlSample(now, self.index, "mem_util_pct", float(rates.memory))]  # fmt: skip

    def _scalars(self, to_mono: ToMonotonic) -> list[NvmlSample]:
        nv, h = self.nv, self.handle
        values: dict[str, float] = {}
        reads: tuple[tuple[str, Callable[[], Any]], ...] = (
            ("sm_clock_mhz", lambda: nv.nvmlDeviceGetClockInfo(h, nv.NVML_CLOCK_SM)),
            ("mem_used_bytes", lambda: nv.nvmlDeviceGetMemoryInfo(h).used),
            ("power_mw", lambda: nv.nvmlDeviceGetPowerUsage(h)),
        )
        for metric, read in reads:
            if metric in self.unsupported:
                continue
            try:
                values[metric] = float(read())
            except nv.NVMLError as e:
                if _not_supported(nv, e):
                    self.unsupported.add(metric)
                else:
                    self._failed(metric, e)  # this metric's sample only; the others of the group stand
        now = clock.monotonic_ns()
        return [NvmlSample(now, self.index, m, v) for m, v in values.items()]

    def _pcie(self, to_mono: ToMonotonic) -> list[NvmlSample]:
        nv, h = self.nv, self.handle
        rx = nv.nvmlDeviceGetPcieThroughput(h, nv.NVML_PCIE_UTIL_RX_BYTES) * KIB
        tx = nv.nvmlDeviceGetPcieThroughput(h, nv.NVML_PCIE_UTIL_TX_BYTES) * KIB
        now = clock.monotonic_ns()
        return [NvmlSample(now, self.index, "pcie_rx_bps", float(rx)),
                NvmlSample(now, self.index, "pcie_tx_bps", float(tx))]

    def _nvlink(self, to_mono: ToMonotonic) -> list[NvmlSample]:
        nv = self.nv
        ids = [(nv.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_RX, UINT_MAX),
               (nv.NVML_FI_DEV_NVLINK_THROUGHPUT_DATA_TX, UINT_MAX)]  # fmt: skip
        fields = nv.nvmlDeviceGetFieldValues(self.handle, ids)
        out = []
        for metric, field in zip(("nvlink_rx_bps", "nvlink_tx_bps"), fields, strict=True):
            cur = field_reading(field)
            if cur is None:
                self.unsupported.add("nvlink")
                return []
            rate = counter_rate(self.nvlink_prev.get(metric), cur)
            self.nvlink_prev[metric] = cur
            if rate is not None:
                out.append(NvmlSample(to_mono(cur[0] * 1000), self.index, metric, rate))
        return out

    def _gpm(self, to_mono: ToMonotonic) -> list[NvmlSample]:
        nv = self.nv
        if not self.gpm_samples:
            if not nv.nvmlGpmQueryDeviceSupport(self.handle).isSupportedDevice:
                self.unsupported.add("gpm_sm_util_pct")
                return []
            self.gpm_samples = [nv.nvmlGpmSampleAlloc(), nv.nvmlGpmSampleAlloc()]
        cur = self.gpm_samples[0] if self.gpm_prev is not self.gpm_samples[0] else self.gpm_samples[1]
        nv.nvmlGpmSampleGet(self.handle, cur)
        now = clock.monotonic_ns()
        prev, self.gpm_prev = self.gpm_prev, cur
        if prev is None:
            return []
        req = nv.c_nvmlGpmMetricsGet_t()
        req.version, req.numMetrics, req.sample1, req.sample2 = nv.NVML_GPM_METRICS_GET_VERSION, 1, prev, cur
        req.metrics[0].metricId = nv.NVML_GPM_METRIC_SM_UTIL
        m = nv.nvmlGpmMetricsGet(req).metrics[0]
        return [NvmlSample(now, self.index, "gpm_sm_util_pct", float(m.value))] if m.nvmlReturn == 0 else []

    def close(self) -> None:
        for s in self.gpm_samples:
            with contextlib.suppress(Exception):  # freeing at shutdown; nothing to report
                self.nv.nvmlGpmSampleFree(s)


class NvmlSource:
    """gputrace.source.Source sampling every NVIDIA device every ``period_s`` from its own thread."""

    name = "nvml"

    def __init__(self, *, period_s: float = 0.1) -> None:
        self.period_s = period_s
        self.pcie_every = max(1, round(PCIE_EVERY_S / period_s))  # ticks between PCIe throughput reads
        self.devices: list[_Device] = []
        self.errors = 0
        self._nv: Any = None
        self._sink: Sink | None = None
        self._clock: clock.RealtimeConverter | None = None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._ticks = -1  # the first tick reads every group

    def start(self, sink: Sink) -> None:
        self._sink = sink
        why = self._open()
        if why:
            self._status("missing", why)
            return
        sink.emit_meta(self.name, {"devices": [{"index": d.index, "name": d.name, "uuid": d.uuid}
                                                for d in self.devices]})  # fmt: skip
        self._status("started", f"{len(self.devices)} device(s), every {self.period_s * 1000:.0f} ms")
        self._thread = Thread(target=self._run, name="gputrace-nvml", daemon=True)
        self._thread.start()

    def _open(self) -> str:
        """Initialise NVML and list the devices; the reason when that is impossible."""
        try:
            nv = importlib.import_module("pynvml")
        except ImportError:
            return "nvidia-ml-py is not installed (pip install nvidia-ml-py)"
        try:
            nv.nvmlInit()
        except nv.NVMLError as e:
            return f"NVML unavailable (no NVIDIA driver?): {e}"
        self._nv = nv
        self._clock = clock.RealtimeConverter()
        since_us = self._clock.to_realtime(clock.monotonic_ns()) // 1000
        try:
            self.devices = [_Device(nv, i, since_us) for i in range(nv.nvmlDeviceGetCount())]
        except nv.NVMLError as e:
            return f"NVML cannot list devices: {e}"
        return "" if self.devices else "NVML sees no devices"

    def stop(self) -> None:
        if self._thread is None:
            return
        self._stop.set()
        self._thread.join()
        self._thread = None
        self._tick()
        costs = "; ".join(f"gpu{d.index}: {d.cost_text()}" for d in self.devices if d.cpu_ns)
        if costs:
            self._status("stopped", f"CPU per read: {costs}")
        gaps = {f"{d.index}": sorted(d.unsupported) for d in self.devices if d.unsupported}
        if gaps:
            self._status("degraded", "not supported: " + "; ".join(f"gpu{i}: {', '.join(m)}" for i, m in gaps.items()))
        failed = [f"gpu{d.index}: {metric} {n} failed reads (last: {why})"
                  for d in self.devices for metric, (n, why) in sorted(d.failures.items())]  # fmt: skip
        if failed:
            self._status("degraded", "read errors: " + "; ".join(failed))
        for d in self.devices:
            d.close()
        with contextlib.suppress(Exception):
            self._nv.nvmlShutdown()

    def drops(self) -> dict[str, int]:
        return {"errors": self.errors} if self.errors else {}

    def _run(self) -> None:
        while not self._stop.wait(self.period_s):
            self._tick()

    def _tick(self) -> None:
        assert self._clock is not None and self._sink is not None
        self._clock.maybe_resample()
        records: list[NvmlSample] = []
        self._ticks += 1
        for d in self.devices:
            records += d.sample(self._clock.to_monotonic, self._ticks, self.pcie_every)
        self.errors = sum(n for d in self.devices for n, _ in d.failures.values())
        if records:
            self._sink.emit(records)

    def _status(self, status: str, detail: str) -> None:
        if self._sink is not None:
            self._sink.emit([SourceStatus(clock.monotonic_ns(), self.name, status, detail)])


def _not_supported(nv: Any, e: Exception) -> bool:
    return getattr(e, "value", None) in (nv.NVML_ERROR_NOT_SUPPORTED, nv.NVML_ERROR_FUNCTION_NOT_FOUND)


def _text(v: Any) -> str:
    return v.decode() if isinstance(v, bytes) else str(v)


class SharedNvml:
    """One NvmlSource for every job of the watch service: NVML is read once per device whatever the number of
    jobs (each job's own sampler read every device: three jobs on one GPU read it three times), and its samples
    and statuses go to every job present. A job that joins a running sampler is given the devices' metadata and
    the sampler's start status first. The sampler starts with the first job and stops with the last."""

    def __init__(self, *, period_s: float = 1.0) -> None:
        self.period_s = period_s
        self.joins = threading.Lock()  # one job joins or leaves at a time (a sampler's start is not cut into)
        self.lock = threading.Lock()  # the sinks, metadata and statuses the fan-out reads
        self.sinks: list[Sink] = []
        self.source: NvmlSource | None = None
        self.meta: list[tuple[str, dict[str, Any]]] = []
        self.started: list[SourceStatus] = []  # the sampler's statuses at its start, for jobs that join later
        self.starting = False

    def view(self) -> NvmlView:
        return NvmlView(self)

    def join(self, sink: Sink) -> int:
        """Add ``sink``; returns the sampler's read errors so far (the joiner's drops count from there)."""
        with self.joins:
            with self.lock:
                self.sinks.append(sink)
                if self.source is not None:
                    for name, meta in self.meta:
                        sink.emit_meta(name, meta)
                    if self.started:
                        sink.emit(self.started)
                    return self.source.errors
                self.source = source = NvmlSource(period_s=self.period_s)
                self.starting = True
            try:
                source.start(_Fanout(self))  # its metadata and statuses come back through the fan-out
            finally:
                self.starting = False
            return 0

    def leave(self, sink: Sink) -> None:
        with self.joins:
            with self.lock:
                last = self.sinks == [sink]
                source = self.source
                if not last:
                    with contextlib.suppress(ValueError):
                        self.sinks.remove(sink)
            if source is None:
                return
            if not last:
                sink.emit([SourceStatus(clock.monotonic_ns(), "nvml", "stopped", "left the service's shared NVML "
                                        "sampler; it goes on for the other watched jobs")])  # fmt: skip
                return
            source.stop()  # its last statuses (CPU per read, read errors) go to the last job
            with self.lock:  # the next job starts a new sampler
                self.sinks.clear()
                self.source, self.meta, self.started = None, [], []


class _Fanout:
    """The shared sampler's sink: every record to every job's sink present."""

    def __init__(self, shared: SharedNvml) -> None:
        self.shared = shared

    def emit(self, records: Sequence[tuple[Any, ...]]) -> None:
        with self.shared.lock:
            sinks = list(self.shared.sinks)
            if self.shared.starting:  # what it said as it started: said again to the jobs that join later
                self.shared.started += [r for r in records if type(r) is SourceStatus]
        for sink in sinks:
            sink.emit(records)

    def emit_kernel(self, blob: bytes, nevents: int) -> None:
        raise AssertionError("NVML emits no kernel events")

    def emit_meta(self, source: str, meta: dict[str, Any]) -> None:
        with self.shared.lock:
            self.shared.meta.append((source, meta))
            sinks = list(self.shared.sinks)
        for sink in sinks:
            sink.emit_meta(source, meta)


class NvmlView:
    """A job's handle on the service's shared NVML sampler (a gputrace.source.Source to its session)."""

    name = "nvml"

    def __init__(self, shared: SharedNvml) -> None:
        self.shared = shared
        self.sink: Sink | None = None
        self.base_errors = 0
        self.final_errors: int | None = None

    def start(self, sink: Sink) -> None:
        self.sink = sink
        self.base_errors = self.shared.join(sink)

    def stop(self) -> None:
        if self.sink is not None:
            self.final_errors = self._errors()
            self.shared.leave(self.sink)
            self.sink = None

    def _errors(self) -> int:
        source = self.shared.source
        return max(0, (source.errors if source is not None else 0) - self.base_errors)

    def drops(self) -> dict[str, int]:
        n = self.final_errors if self.final_errors is not None else self._errors()
        return {"errors": n} if n else {}
