"""NVML sampler: the real missing-driver path on this host, and sample → record conversion on pynvml's own
ctypes structures filled with values shaped like an H100's."""

from __future__ import annotations

import threading
import time
import types
from pathlib import Path
from typing import Any

import pynvml
import pytest

from gputrace.clock import RealtimeConverter, monotonic_ns
from gputrace.probes.nvml import (
    NvmlSource,
    SharedNvml,
    _Device,
    counter_rate,
    field_reading,
    sample_value,
    util_records,
)
from gputrace.records import NvmlSample, SourceStatus


class ListSink:
    def __init__(self) -> None:
        self.records: list[Any] = []
        self.meta: dict[str, Any] = {}
        self.lock = threading.Lock()

    def emit(self, records: Any) -> None:
        with self.lock:
            self.records.extend(records)

    def emit_kernel(self, blob: bytes, nevents: int) -> None:
        raise AssertionError

    def emit_meta(self, source: str, meta: dict[str, Any]) -> None:
        self.meta[source] = meta


def test_no_driver_here_says_missing_and_capture_goes_on(monkeypatch: pytest.MonkeyPatch) -> None:
    if Path("/dev/nvidiactl").exists():  # a GPU host: hide its driver from pynvml's own library loading
        monkeypatch.setattr(pynvml, "nvmlLib", None)
        monkeypatch.setattr(pynvml, "CDLL", lambda name, *a, **k: (_ for _ in ()).throw(OSError(name)))
    sink = ListSink()
    src = NvmlSource()
    src.start(sink)  # must not raise
    src.stop()
    (status,) = sink.records
    assert type(status) is SourceStatus and (status.source, status.status) == ("nvml", "missing")
    assert "NVML" in status.detail
    assert src.drops() == {}


def samples(*pairs: tuple[int, int]) -> list[Any]:
    arr = (pynvml.c_nvmlSample_t * len(pairs))()
    for s, (ts, v) in zip(arr, pairs, strict=True):
        s.timeStamp, s.sampleValue.uiVal = ts, v
    return list(arr)


def test_util_samples_on_driver_clock_skip_seen_ones() -> None:
    clock = RealtimeConverter(3600)
    now_us = clock.to_realtime(monotonic_ns()) // 1000
    got = samples((now_us - 200_000, 11), (now_us - 100_000, 55), (now_us - 300_000, 99), (now_us - 50_000, 97))
    recs, newest = util_records(1, "gpu_util_pct", pynvml.NVML_VALUE_TYPE_UNSIGNED_INT, got, now_us - 150_000,
                                clock.to_monotonic)  # fmt: skip
    assert [r.value for r in recs] == [55.0, 97.0]
    assert newest == now_us - 50_000
    assert recs[0] == NvmlSample(clock.to_monotonic((now_us - 100_000) * 1000), 1, "gpu_util_pct", 55.0)
    assert util_records(1, "x", 1, got, newest, clock.to_monotonic) == ([], newest)


def test_value_types_and_nvlink_rates() -> None:
    v = pynvml.c_nvmlValue_t()
    v.dVal = 12.5
    assert sample_value(pynvml.NVML_VALUE_TYPE_DOUBLE, v) == 12.5
    v.ullVal = 3 << 40
    assert sample_value(pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, v) == float(3 << 40)
    f = pynvml.c_nvmlFieldValue_t()
    f.fieldId, f.timestamp, f.valueType, f.nvmlReturn = 139, 2_000_000, pynvml.NVML_VALUE_TYPE_UNSIGNED_LONG_LONG, 0
    f.value.ullVal = 1_000_000
    cur = field_reading(f)
    assert cur == (2_000_000, 1_000_000.0)
    assert counter_rate((1_500_000, 500_000.0), cur) == pytest.approx(500_000 * 1024 / 0.5)
    assert counter_rate(None, cur) is None and counter_rate(cur, (1, 0.0)) is None
    f.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
    assert field_reading(f) is None


class H100:
    """The pynvml calls _Device makes, answering like an H100 without NVLink or GPM data here."""

    NVMLError = pynvml.NVMLError

    def __init__(self) -> None:
        for k in dir(pynvml):
            if k.startswith("NVML_") or k.startswith("c_nvml"):
                setattr(self, k, getattr(pynvml, k))
        self.t_us = 0

    def nvmlDeviceGetHandleByIndex(self, i: int) -> str:  # noqa: N802 - pynvml's names
        return f"h{i}"

    def nvmlDeviceGetName(self, h: str) -> bytes:  # noqa: N802
        return b"NVIDIA H100 80GB HBM3"

    def nvmlDeviceGetUUID(self, h: str) -> str:  # noqa: N802
        return "GPU-10111213-1415-1617-1819-1a1b1c1d1e1f"

    def nvmlDeviceGetSamples(self, h: str, kind: int, since: int) -> tuple[int, list[Any]]:  # noqa: N802
        self.t_us = since + 100_000
        return 1, samples((since, 1), (since + 50_000, 60 + kind), (self.t_us, 70 + kind))

    def nvmlDeviceGetClockInfo(self, h: str, which: int) -> int:  # noqa: N802
        return 1980

    def nvmlDeviceGetMemoryInfo(self, h: str) -> Any:  # noqa: N802
        return types.SimpleNamespace(used=12 << 30)

    def nvmlDeviceGetPowerUsage(self, h: str) -> int:  # noqa: N802
        raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_SUPPORTED)

    def nvmlDeviceGetPcieThroughput(self, h: str, which: int) -> int:  # noqa: N802
        return 2000 if which == pynvml.NVML_PCIE_UTIL_RX_BYTES else 10

    def nvmlDeviceGetFieldValues(self, h: str, ids: list[Any]) -> Any:  # noqa: N802
        arr = (pynvml.c_nvmlFieldValue_t * len(ids))()
        for f in arr:
            f.nvmlReturn = pynvml.NVML_ERROR_NOT_SUPPORTED
        return arr

    def nvmlGpmQueryDeviceSupport(self, h: str) -> Any:  # noqa: N802
        return types.SimpleNamespace(isSupportedDevice=0)


def started(
    monkeypatch: pytest.MonkeyPatch, nv: H100, devices: int = 1, period_s: float = 3600
) -> tuple[NvmlSource, ListSink]:
    """An NvmlSource started on ``nv`` as its pynvml (a long period: the test drives the ticks)."""
    nv.nvmlInit = lambda: None  # type: ignore[attr-defined]
    nv.nvmlShutdown = lambda: None  # type: ignore[attr-defined]
    nv.nvmlDeviceGetCount = lambda: devices  # type: ignore[attr-defined]
    monkeypatch.setattr("gputrace.probes.nvml.importlib.import_module", lambda name: nv)
    sink = ListSink()
    src = NvmlSource(period_s=period_s)
    src.start(sink)
    return src, sink


def test_device_sampling_drops_unsupported_metrics_once() -> None:
    nv, clock = H100(), RealtimeConverter(3600)
    dev = _Device(nv, 0, since_us=5_000_000)
    first = dev.sample(clock.to_monotonic)
    by_metric = {(r.metric, r.value) for r in first}
    assert {("gpu_util_pct", 61.0), ("gpu_util_pct", 71.0), ("mem_util_pct", 62.0), ("mem_util_pct", 72.0)} <= by_metric
    assert {("sm_clock_mhz", 1980.0), ("mem_used_bytes", float(12 << 30)), ("pcie_rx_bps", 2000.0 * 1024),
            ("pcie_tx_bps", 10.0 * 1024)} <= by_metric  # fmt: skip
    assert dev.unsupported == {"power_mw", "nvlink", "gpm_sm_util_pct"}
    assert (dev.name, dev.uuid) == ("NVIDIA H100 80GB HBM3", "GPU-10111213-1415-1617-1819-1a1b1c1d1e1f")
    second = dev.sample(clock.to_monotonic)
    assert [r.value for r in second if r.metric == "gpu_util_pct"] == [61.0, 71.0]  # only the new ones


def test_source_samples_at_its_period_from_its_own_thread(monkeypatch: pytest.MonkeyPatch) -> None:
    src, sink = started(monkeypatch, H100(), devices=2, period_s=0.02)
    time.sleep(0.2)
    src.stop()
    clocks = [r for r in sink.records if type(r) is NvmlSample and r.metric == "sm_clock_mhz"]
    assert {r.device for r in clocks} == {0, 1} and len(clocks) >= 8
    statuses = [(r.status, r.detail) for r in sink.records if type(r) is SourceStatus]
    assert statuses[0] == ("started", "2 device(s), every 20 ms")
    assert statuses[-1][0] == "degraded" and "power_mw" in statuses[-1][1]
    assert [d["index"] for d in sink.meta["nvml"]["devices"]] == [0, 1]


class FlakyH100(H100):
    """An H100 whose sample ring has nothing new on every other read and whose clock read fails at times."""

    def __init__(self) -> None:
        super().__init__()
        self.calls = {"samples": 0, "clock": 0}

    def nvmlDeviceGetSamples(self, h: str, kind: int, since: int) -> tuple[int, list[Any]]:  # noqa: N802
        self.calls["samples"] += 1
        if self.calls["samples"] % 4 in (3, 0):  # both metrics of every second tick
            raise pynvml.NVMLError(pynvml.NVML_ERROR_NOT_FOUND)
        return super().nvmlDeviceGetSamples(h, kind, since)

    def nvmlDeviceGetClockInfo(self, h: str, which: int) -> int:  # noqa: N802
        self.calls["clock"] += 1
        if self.calls["clock"] == 2:
            raise pynvml.NVMLError(pynvml.NVML_ERROR_UNKNOWN)
        return 1980


def test_no_new_samples_is_not_an_error_and_a_failed_read_costs_its_group_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    src, sink = started(monkeypatch, FlakyH100())
    src.pcie_every = 10  # as at the default 100 ms a tick (the long period here keeps the thread from ticking)
    for _ in range(4):
        src._tick()
    src.stop()  # a fifth tick
    samples = [r for r in sink.records if type(r) is NvmlSample]
    util = [r for r in samples if r.metric == "gpu_util_pct"]
    assert len(util) == 2 * 3  # ticks 1, 3 and 5 had new samples, two new ones each
    assert len([r for r in samples if r.metric == "mem_used_bytes"]) == 5  # every tick, the failed clock read's too
    assert len([r for r in samples if r.metric == "pcie_rx_bps"]) == 1  # the first tick, then every 10th
    assert len([r for r in samples if r.metric == "sm_clock_mhz"]) == 4
    assert src.drops() == {"errors": 1}  # the one failed clock read; "nothing new" is not a loss
    (status,) = [r for r in sink.records if type(r) is SourceStatus and r.detail.startswith("read errors")]
    assert status.detail == "read errors: gpu0: sm_clock_mhz 1 failed reads (last: NVMLError_Unknown: Unknown Error)"


def test_pcie_is_read_about_once_a_second_at_any_period() -> None:
    """PCIe throughput costs a 20 ms window of NVML's per read: once a second at a capture's 100 ms ticks,
    every tick at watch mode's 1 s."""
    assert [NvmlSource(period_s=p).pcie_every for p in (0.1, 0.25, 1.0, 5.0)] == [10, 4, 1, 1]


def test_a_failing_group_is_counted_and_named(monkeypatch: pytest.MonkeyPatch) -> None:
    nv = H100()

    def broken(h: str, ids: list[Any]) -> Any:
        raise pynvml.NVMLError(pynvml.NVML_ERROR_GPU_IS_LOST)

    nv.nvmlDeviceGetFieldValues = broken  # type: ignore[method-assign]
    src, sink = started(monkeypatch, nv)
    for _ in range(2):
        src._tick()
    src.stop()
    assert src.drops() == {"errors": 3}
    assert len([r for r in sink.records if type(r) is NvmlSample and r.metric == "sm_clock_mhz"]) == 3
    statuses = [r.detail for r in sink.records if type(r) is SourceStatus and r.status == "degraded"]
    assert any(d.startswith("read errors: gpu0: nvlink 3 failed reads") and "GPU is lost" in d for d in statuses)


def test_watch_modes_one_sampler_gives_every_job_the_same_samples(monkeypatch: pytest.MonkeyPatch) -> None:
    """Watch mode reads NVML once for all its jobs: a job that joins later gets the devices' metadata and the
    start status first, every job present gets each tick's samples, a job that leaves is told the sampler goes
    on, and the last one gets its final statuses and stops it."""
    nv = H100()
    nv.nvmlInit = lambda: None  # type: ignore[attr-defined]
    nv.nvmlShutdown = lambda: None  # type: ignore[attr-defined]
    nv.nvmlDeviceGetCount = lambda: 1  # type: ignore[attr-defined]
    monkeypatch.setattr("gputrace.probes.nvml.importlib.import_module", lambda name: nv)
    shared = SharedNvml(period_s=3600)  # the test drives the ticks
    a, b = ListSink(), ListSink()
    va, vb = shared.view(), shared.view()
    va.start(a)
    source = shared.source
    assert source is not None
    source._tick()
    vb.start(b)
    assert shared.source is source  # one sampler
    assert a.meta["nvml"] == b.meta["nvml"] and b.meta["nvml"]["devices"][0]["name"] == "NVIDIA H100 80GB HBM3"
    assert [r.detail for r in b.records if type(r) is SourceStatus] == ["1 device(s), every 3600000 ms"]
    source._tick()
    samples_a = [r for r in a.records if type(r) is NvmlSample]
    samples_b = [r for r in b.records if type(r) is NvmlSample]
    assert samples_b and samples_a[-len(samples_b):] == samples_b  # b has the second tick's, as a has
    va.stop()
    assert shared.source is source and source._thread is not None  # it goes on for b
    assert "goes on for the other watched jobs" in [r for r in a.records if type(r) is SourceStatus][-1].detail
    vb.stop()
    assert shared.source is None and source._thread is None
    assert any(r.detail.startswith("CPU per read") for r in b.records if type(r) is SourceStatus)
    assert va.drops() == vb.drops() == {}
