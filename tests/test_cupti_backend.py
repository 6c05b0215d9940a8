"""CuptiBackend on a host without a GPU: discovery, refusal, and its lifecycle against CUPTI's API surface.

The real library is exercised by tests/test_gpu_real.py on a GPU machine. Here the lifecycle test stands a
small in-process object in for ``cupti.cupti`` (the functions the backend calls, with CUPTI's contract:
completed buffers arrive through the registered callback when flushed; the dropped count resets on read),
to pin down the backend's own behaviour: periodic non-forced flushes, a forced flush at stop, drop
counts read through the pointer CUPTI writes, and no exception ever raised back into CUPTI.
"""

from __future__ import annotations

import ctypes
import enum
import os
import subprocess
import sys
import threading
import time
import types
from pathlib import Path

import cupti_shapes as shapes
import pytest

from gputrace.agent.backend import GpuBackend
from gputrace.clock import monotonic_ns
from gputrace.probes import cupti as cupti_probe
from gputrace.probes.cupti import CuptiBackend, CuptiUnavailable, driver_version, find_libcuda, nvtx_injection_path
from gputrace.records import AgentThread, CudaApi, GpuKernel, GpuSync


def test_backend_satisfies_the_agent_protocol() -> None:
    assert isinstance(CuptiBackend(), GpuBackend)
    assert CuptiBackend.name == "cupti"


def test_unavailable_here_says_why_and_start_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    if Path("/dev/nvidiactl").exists():  # a GPU host: as if its driver were not installed
        monkeypatch.setattr(cupti_probe, "find_libcuda", lambda *a, **k: None)
    loaded = "cupti.cupti" in sys.modules
    ok, why = CuptiBackend.available()
    assert not ok
    assert "cupti-python" in why or "libcuda" in why
    with pytest.raises(CuptiUnavailable, match="cupti-python|libcuda"):
        CuptiBackend().start(lambda records: None)
    assert ("cupti.cupti" in sys.modules) == loaded  # refusing imported nothing


def test_find_libcuda_in_library_path_and_ld_cache(tmp_path: Path) -> None:
    lib = tmp_path / "drv" / "libcuda.so.1"
    lib.parent.mkdir()
    lib.write_bytes(b"\x7fELF")
    assert find_libcuda({"LD_LIBRARY_PATH": f"/nonexistent:{lib.parent}"}, tmp_path / "none") == str(lib)
    cache = tmp_path / "ld.so.cache"
    cache.write_bytes(b"glibc-ld.so.cache1.1\0libcuda.so.1\0" + str(lib).encode() + b"\0/usr/lib/libm.so.6\0")
    assert cupti_probe._in_ld_cache(cache, "libcuda.so.1") == str(lib)
    assert cupti_probe._in_ld_cache(tmp_path / "missing", "libcuda.so.1") is None


def test_nvtx_injection_path_from_pip_layout(tmp_path: Path) -> None:
    assert nvtx_injection_path([str(tmp_path)]) is None
    lib = tmp_path / "nvidia" / "cu13" / "lib" / "libcupti.so.13"
    lib.parent.mkdir(parents=True)
    lib.write_bytes(b"\x7fELF")
    assert nvtx_injection_path([str(tmp_path)]) == str(lib)


def test_driver_version_parsed(tmp_path: Path) -> None:
    f = tmp_path / "version"
    f.write_text(
        "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.65.06  Release Build  (dvs-builder@U16)\n"
        "GCC version:  gcc version 12.3.0\n"
    )
    assert driver_version(f) == "580.65.06"
    assert driver_version(tmp_path / "absent") == ""


class CuptiStandIn(types.ModuleType):
    """The slice of cupti.cupti the backend uses, holding delivered batches until a flush."""

    class cuptiError(Exception):  # noqa: N801 - the library's own name
        def __init__(self, status: int) -> None:
            super().__init__(f"CUPTI error ({status})")
            self.status = status

    def __init__(self, batches: list[list], dropped: int) -> None:
        super().__init__("cupti.cupti")
        self.batches, self.dropped = batches, dropped
        self.calls: list[tuple] = []
        self.lock = threading.Lock()

    def set_thread_id_type(self, t: int) -> None:
        self.calls.append(("thread_id_type", t))

    def activity_register_callbacks(self, requested, completed) -> None:  # type: ignore[no-untyped-def]
        self.requested, self.completed = requested, completed

    def activity_enable_and_dump(self, kind: int) -> None:
        self.calls.append(("enable_and_dump", kind))

    refuse: frozenset[int] = frozenset()

    def activity_enable(self, kind: int) -> None:
        if kind in self.refuse:
            raise self.cuptiError(1)  # CUPTI_ERROR_INVALID_PARAMETER
        self.calls.append(("enable", kind))

    def get_timestamp(self) -> int:
        return time.clock_gettime_ns(time.CLOCK_REALTIME)

    def activity_disable(self, kind: int) -> None:
        self.calls.append(("disable", kind))

    def activity_flush_all(self, flag: int) -> None:
        self.calls.append(("flush", flag))
        with self.lock:
            batch = self.batches.pop(0) if self.batches else None
        if batch is not None:
            self.completed(batch)

    def activity_get_num_dropped_records(self, context: int, stream: int, ptr: int) -> None:
        ctypes.c_size_t.from_address(ptr).value, self.dropped = self.dropped, 0

    def get_callback_name(self, domain: int, cbid: int) -> str:
        return shapes.api_name(domain, cbid)


@pytest.fixture
def stand_in(monkeypatch: pytest.MonkeyPatch):  # type: ignore[no-untyped-def]
    monkeypatch.setattr(CuptiBackend, "available", classmethod(lambda cls: (True, "stand-in")))
    monkeypatch.setattr(CuptiBackend, "native_flush", False)  # the stand-in's flush, not a real libcupti's
    package = types.ModuleType("cupti")

    def install(batches: list[list], dropped: int = 0) -> CuptiStandIn:
        mod = CuptiStandIn(batches, dropped)
        package.cupti = mod  # type: ignore[attr-defined]
        monkeypatch.setitem(sys.modules, "cupti", package)
        monkeypatch.setitem(sys.modules, "cupti.cupti", mod)
        return mod

    return install


def test_lifecycle_flushes_converts_counts_drops(stand_in) -> None:  # type: ignore[no-untyped-def]
    backend = CuptiBackend(flush_period_s=0.02)
    clock = cupti_probe.RealtimeConverter(3600)
    t0 = monotonic_ns()
    mod = stand_in([shapes.step(clock, t0), [], [object()], shapes.step_tail(clock, t0)], dropped=3)
    got: list = []
    backend.start(got.extend)
    deadline = time.monotonic() + 5
    while mod.batches and time.monotonic() < deadline:
        time.sleep(0.01)
    backend.stop()
    kinds = [c for c in mod.calls if c[0] != "flush"]
    assert kinds[0] == ("thread_id_type", 1)
    assert {k for op, k in kinds if op == "enable"} == {10, 1, 2, 5, 4, 38, 12}
    assert {k for op, k in kinds if op == "enable_and_dump"} == {9, 8}
    flushes = [c[1] for c in mod.calls if c[0] == "flush"]
    assert flushes[-2:] == [1, 1] and set(flushes[:-2]) == {0} and len(flushes) >= 5
    first_disable = next(i for i, c in enumerate(mod.calls) if c[0] == "disable")
    assert ("flush", 1) not in mod.calls[:first_disable]  # disabled before the forced flushes, not after
    assert len([r for r in got if type(r) is GpuKernel]) == 1
    assert [r.tid for r in got if type(r) is GpuSync] == [4243]
    assert {r.tid for r in got if type(r) is CudaApi} == {4243}
    drops = backend.drops()
    assert drops == {"cupti": 3, "convert": 1, "emit": 0, "incomplete": 0}
    assert backend.notes() == {}
    assert "convert" in backend.info()["errors"]
    assert {"cuda_version", "driver_version"} <= backend.info().keys()


def test_broken_emit_is_counted_not_raised(stand_in) -> None:  # type: ignore[no-untyped-def]
    clock = cupti_probe.RealtimeConverter(3600)
    stand_in([shapes.step(clock, monotonic_ns())])
    backend = CuptiBackend(flush_period_s=3600)

    def broken(records: object) -> None:
        raise BrokenPipeError("session gone")

    backend.start(broken)
    backend.stop()
    assert backend.drops()["emit"] > 0
    backend.stop()  # a second stop is harmless


def test_start_error_is_explained(stand_in) -> None:  # type: ignore[no-untyped-def]
    mod = stand_in([])

    def refuse(t: int) -> None:
        raise mod.cuptiError(39)

    mod.set_thread_id_type = refuse  # type: ignore[method-assign]
    with pytest.raises(CuptiUnavailable, match="another CUPTI client"):
        CuptiBackend().start(lambda r: None)
    assert os.getpid()  # the process goes on


def test_driver_version_proprietary_module_line(tmp_path: Path) -> None:
    f = tmp_path / "version"
    f.write_text("NVRM version: NVIDIA UNIX x86_64 Kernel Module  535.104.05  Sat Aug 19 01:15:15 UTC 2023\n")
    assert driver_version(f) == "535.104.05"


def test_refused_optional_kind_degrades_refused_kernels_fail(stand_in) -> None:  # type: ignore[no-untyped-def]
    mod = stand_in([])
    mod.refuse = frozenset({12})  # MARKER
    backend = CuptiBackend(flush_period_s=3600)
    backend.start(lambda r: None)
    backend.stop()
    info = backend.info()
    assert "activity_enable" in info["errors"] and abs(int(info["cupti_clock_skew_us"])) < 10_000
    mod.refuse = frozenset({10})  # CONCURRENT_KERNEL
    with pytest.raises(CuptiUnavailable, match="CUPTI could not start"):
        CuptiBackend().start(lambda r: None)


def test_cuda_version_read_only_from_an_already_loaded_driver(tmp_path: Path) -> None:
    src = tmp_path / "drv.c"
    src.write_text("int cuDriverGetVersion(int *v) { *v = 13020; return 0; }\n")
    lib = tmp_path / "libcuda.so.1"
    subprocess.run(["gcc", "-shared", "-fPIC", "-Wl,-soname,libcuda.so.1", "-o", str(lib), str(src)], check=True)
    probe = (
        "import ctypes, sys; from gputrace.probes.cupti import cuda_driver_api_version as v; "
        "before = v(); ctypes.CDLL(sys.argv[1]); print(repr(before), repr(v()))"
    )
    out = subprocess.run([sys.executable, "-c", probe, str(lib)], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["''", "'13.2'"]


class QuietCbids(enum.IntEnum):
    cudaGetDevice_v3020 = 17  # noqa: N815 - CUPTI's names
    cudaLaunchKernel_v7000 = 211  # noqa: N815
    cudaGetDeviceCount_v3020 = 16  # noqa: N815 - not a quiet one: only cudaGetDevice_* is


class QuietDriverCbids(enum.IntEnum):
    cuDevicePrimaryCtxGetState = 1101  # noqa: N815
    cuCtxGetDevice = 60  # noqa: N815
    cuCtxGetDevice_v2 = 770  # noqa: N815
    cuLaunchKernel = 307  # noqa: N815


def with_api_switches(mod: CuptiStandIn) -> list[tuple[str, int, int]]:
    calls: list[tuple[str, int, int]] = []
    mod.RuntimeApiTraceCbid = QuietCbids  # type: ignore[attr-defined]
    mod.DriverApiTraceCbid = QuietDriverCbids  # type: ignore[attr-defined]
    mod.activity_enable_runtime_api = lambda cbid, on: calls.append(("runtime", cbid, on))  # type: ignore[attr-defined]
    mod.activity_enable_driver_api = lambda cbid, on: calls.append(("driver", cbid, on))  # type: ignore[attr-defined]
    return calls


def test_quiet_lookups_are_turned_off_in_cupti(stand_in, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    calls = with_api_switches(stand_in([]))
    backend = CuptiBackend(flush_period_s=3600)
    backend.start(lambda records: None)
    backend.stop()
    assert sorted(calls) == [("driver", 60, 0), ("driver", 770, 0), ("driver", 1101, 0), ("runtime", 17, 0)]
    assert backend.quieted == 4
    calls.clear()
    monkeypatch.setenv("GPUTRACE_CUPTI_ALL_APIS", "1")
    everything = CuptiBackend(flush_period_s=3600)
    everything.start(lambda records: None)
    everything.stop()
    assert calls == [] and everything.quieted == 0


def test_quiet_lookups_are_found_by_name_where_cupti_python_has_no_enums(stand_in) -> None:  # type: ignore[no-untyped-def]
    """cupti-python 13.0 has the per-API switches but no callback-id enums: the ids are asked for by name."""
    mod = stand_in([])
    calls = with_api_switches(mod)
    del mod.RuntimeApiTraceCbid, mod.DriverApiTraceCbid
    names = {(1, m.value): m.name for m in QuietDriverCbids} | {(2, m.value): m.name for m in QuietCbids}
    mod.CallbackDomain = enum.IntEnum("CallbackDomain", {"DRIVER_API": 1, "RUNTIME_API": 2})  # type: ignore[attr-defined]

    def name_of(domain: int, cbid: int) -> str:
        if (domain, cbid) not in names:
            raise ValueError("CUPTI_ERROR_INVALID_PARAMETER")
        return names[(domain, cbid)]

    mod.get_callback_name = name_of  # type: ignore[attr-defined]
    backend = CuptiBackend(flush_period_s=3600)
    backend.start(lambda records: None)
    backend.stop()
    assert sorted(calls) == [("driver", 60, 0), ("driver", 770, 0), ("driver", 1101, 0), ("runtime", 17, 0)]
    assert backend.quieted == 4


def test_a_cupti_without_per_api_switches_still_drops_the_quiet_lookups(stand_in) -> None:  # type: ignore[no-untyped-def]
    clock = cupti_probe.RealtimeConverter(3600)
    t0 = monotonic_ns()
    r = lambda ms: clock.to_realtime(t0 + int(ms * 1e6))  # noqa: E731
    batch = [shapes.api(r(0.1), r(0.2), 1, 17), shapes.api(r(0.3), r(0.4), 2, 1101, driver=True),
             shapes.api(r(0.5), r(0.6), 3, 211)]  # fmt: skip
    stand_in([batch])
    got: list = []
    backend = CuptiBackend(flush_period_s=3600)
    backend.start(got.extend)
    backend.stop()
    assert [r.name for r in got if type(r) is CudaApi] == ["cudaLaunchKernel_v7000"]
    assert backend.notes() == {"quiet_api": 2} and backend.drops()["convert"] == 0


def test_a_big_buffer_is_converted_in_slices_handing_the_gil_over(stand_in, monkeypatch: pytest.MonkeyPatch) -> None:  # type: ignore[no-untyped-def]
    clock = cupti_probe.RealtimeConverter(3600)
    t0 = monotonic_ns()
    r = lambda us: clock.to_realtime(t0 + us * 1000)  # noqa: E731
    n = 2 * cupti_probe.CONVERT_SLICE + 10
    batch = [shapes.api(r(10 * i), r(10 * i + 5), i + 1, 211) for i in range(n)]
    stand_in([batch])
    yields: list[float] = []
    real_sleep = time.sleep
    monkeypatch.setattr(cupti_probe.time, "sleep", lambda s: yields.append(s) if s == 0 else real_sleep(s))
    got: list = []
    backend = CuptiBackend(flush_period_s=3600, yield_after_ns=0)  # hand over after every slice
    backend.start(got.extend)
    mod_flush(backend)
    backend.stop()
    assert [a.correlation_id for a in got if type(a) is CudaApi] == list(range(1, n + 1))
    assert yields == [0, 0]  # between the three slices, not before the first


def mod_flush(backend: CuptiBackend) -> None:
    """A flush while the backend runs: one a stop makes hands nothing over (the target is waiting anyway)."""
    backend._flush_all(0)


def test_native_flush_is_found_only_where_libcupti_is_mapped(tmp_path: Path) -> None:
    maps = tmp_path / "maps"
    maps.write_text("7f0000000000-7f0000001000 r-xp 00000000 08:01 42 /usr/lib/x86_64-linux-gnu/libc.so.6\n")
    assert cupti_probe.native_flush_all(str(maps)) is None
    maps.write_text("7f0000000000-7f0000001000 r-xp 00000000 08:01 42 /nonexistent/libcupti.so.13\n")
    assert cupti_probe.native_flush_all(str(maps)) is None  # mapped by name, but not loadable: no native flush


def test_native_flush_calls_the_mapped_libcupti_and_reports_its_errors(tmp_path: Path) -> None:
    # The real libcupti (the dev install's nvidia-cuda-cupti, or wherever NVTX injection would find it), called
    # through ctypes; with no driver CUPTI answers with an error, which must come back as an exception.
    found = cupti_probe.nvtx_injection_path()
    assert found, "cupti-python's libcupti (nvidia-cuda-cupti) is part of the dev install"
    maps = tmp_path / "maps"
    maps.write_text(f"7f0000000000-7f0000001000 r-xp 00000000 08:01 42 {found}\n")
    flush = cupti_probe.native_flush_all(str(maps))
    assert flush is not None
    if Path("/dev/nvidiactl").exists():
        assert flush(0) is None  # a driver answers: nothing to flush, no error
    else:
        with pytest.raises(RuntimeError, match="cuptiActivityFlushAll: CUPTI error"):
            flush(0)


def test_the_threads_that_flush_and_convert_are_named_as_the_agent_s(stand_in) -> None:  # type: ignore[no-untyped-def]
    """The flusher asks CUPTI for its buffers and converts them in the callback, under the target's GIL: its
    time is the tracing's, so the backend names it (once per role) for the analysis."""
    clock = cupti_probe.RealtimeConverter(3600)
    t0 = monotonic_ns()
    mod = stand_in([shapes.step(clock, t0), shapes.step_tail(clock, t0)])
    got: list = []
    backend = CuptiBackend(flush_period_s=0.01)
    backend.start(got.extend)
    assert backend._thread is not None
    flusher = backend._thread.native_id
    deadline = time.monotonic() + 5
    while mod.batches and time.monotonic() < deadline:
        time.sleep(0.01)
    backend.stop()
    own = [(r.pid, r.tid, r.role) for r in got if type(r) is AgentThread]
    assert sorted(own) == sorted([(os.getpid(), flusher, "cupti-flush"), (os.getpid(), flusher, "cupti-convert")])
