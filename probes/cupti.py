"""The real GPU backend of the in-process agent: CUPTI activity tracing through cupti-python.

CUPTI fills activity buffers on its own; a flusher thread here asks for the completed ones every
``flush_period_s`` (non-forced, so kernels still running are not cut), and ``stop()`` forces the rest out.
Each completed buffer is converted right in the callback (the record objects are views into a buffer
CUPTI reuses afterwards) by gputrace.probes.cupti_convert, on the capture clock via gputrace.clock.

cupti-python is imported only in ``start()``: the agent, and everything else, runs without it. Nothing here
may change what the target does: every error inside a callback is counted, never raised into CUDA.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import importlib
import importlib.util
import json
import os
import re
import sys
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from gputrace.agent.threads import CPU
from gputrace.clock import RealtimeConverter, monotonic_ns
from gputrace.probes.cupti_convert import (
    ALL_APIS_ENV,
    KIND_CONCURRENT_KERNEL,
    KIND_CONTEXT,
    KIND_DEVICE,
    KIND_DRIVER,
    KIND_MARKER,
    KIND_MEMCPY,
    KIND_MEMSET,
    KIND_RUNTIME,
    KIND_SYNCHRONIZATION,
    ActivityConverter,
    dump_activity,
    quiet_api,
)
from gputrace.records import AgentThread
from gputrace.threads import Thread

Emit = Callable[[Sequence[tuple[Any, ...]]], None]

# Device work and host calls; CONTEXT and DEVICE records name the hardware (enabled with a dump, so a
# late start still learns about contexts created before it).
TRACED_KINDS = (KIND_CONCURRENT_KERNEL, KIND_MEMCPY, KIND_MEMSET, KIND_RUNTIME, KIND_DRIVER,
                KIND_SYNCHRONIZATION, KIND_MARKER)  # fmt: skip
DUMPED_KINDS = (KIND_CONTEXT, KIND_DEVICE)
THREAD_ID_SYSTEM = 1  # CUpti_ActivityThreadIdType: kernel tids instead of pthread_self()
FLUSH_FORCED = 1
ERROR_MULTIPLE_SUBSCRIBERS = 39

LIBCUDA = "libcuda.so.1"
LD_CACHE = Path("/etc/ld.so.cache")
_LIB_DIRS = ("/usr/lib/x86_64-linux-gnu", "/usr/lib64", "/usr/lib", "/usr/local/nvidia/lib64",
             "/usr/lib/wsl/lib", "/usr/lib/aarch64-linux-gnu")  # fmt: skip


RECORD_ENV = "GPUTRACE_CUPTI_RECORD"
CONVERT_SLICE = 256  # records converted between two looks at the clock
YIELD_AFTER_NS = 2_000_000  # converting this long hands the GIL to a waiting thread (Python's own switch: 5 ms)
STOP_SETTLE_S = 0.02
_STARTED: list[CuptiBackend] = []  # backends started in this process, for the exit-time flush


def native_flush_all(maps: str = "/proc/self/maps") -> Callable[[int], None] | None:
    """cuptiActivityFlushAll of the libcupti this process loaded, called through ctypes (which releases the
    GIL for the call); None when no libcupti is mapped or it lacks the symbol."""
    try:
        with open(maps, encoding="utf-8", errors="replace") as f:
            path = next((line.split()[-1] for line in f if "/libcupti.so" in line), None)
        if path is None:
            return None
        fn = ctypes.CDLL(path).cuptiActivityFlushAll
    except (OSError, AttributeError):
        return None
    fn.argtypes, fn.restype = [ctypes.c_uint32], ctypes.c_int

    def activity_flush_all(flag: int) -> None:
        status = fn(flag)
        if status:
            raise RuntimeError(f"cuptiActivityFlushAll: CUPTI error {status}")

    return activity_flush_all


@atexit.register
def _flush_at_exit() -> None:
    """While Python still runs, hand back any buffer CUPTI kept after a backend stopped: CUPTI's own exit
    flush would call into a finalized interpreter. (A running backend is stopped by the agent at exit.)"""
    for backend in _STARTED:
        if backend._cupti is None:
            with contextlib.suppress(Exception):
                backend._flush_all(FLUSH_FORCED)


def quiet_in_cupti(cupti: Any) -> int:
    """Turn off CUPTI's records of the quiet lookups (cupti_convert.QUIET_APIS); how many APIs it took.

    Needs CUPTI 12.6 or later (cuptiActivityEnableRuntimeApi/DriverApi); an older one records them and the
    converter drops them instead, at a cost: cupti-python builds a Python object for every record of a
    buffer before the converter sees it, under the target's GIL. cupti-python 13.4 names the callback ids
    in enums; older releases (13.0) have the calls but no enums, so the ids are found by their names."""
    n = 0
    domains = (("RUNTIME_API", "RuntimeApiTraceCbid", "activity_enable_runtime_api"),
               ("DRIVER_API", "DriverApiTraceCbid", "activity_enable_driver_api"))  # fmt: skip
    for domain, enum_name, enable_name in domains:
        enable = getattr(cupti, enable_name, None)
        if enable is None:
            continue
        for cbid in _quiet_cbids(cupti, domain, enum_name):
            try:
                enable(cbid, 0)
            except Exception:  # noqa: BLE001 - not supported here: the converter filters instead
                break
            n += 1
    return n


MAX_CBID = 2048  # above every runtime and driver callback id CUDA 13 defines


def _quiet_cbids(cupti: Any, domain: str, enum_name: str) -> list[int]:
    """The callback ids of the quiet lookups in one API domain: from cupti-python's enum where it has one,
    else by asking CUPTI each id's name."""
    enum = getattr(cupti, enum_name, None)
    if enum is not None:
        return [int(member) for name, member in enum.__members__.items() if quiet_api(name)]
    domains = getattr(cupti, "CallbackDomain", None)
    name_of = getattr(cupti, "get_callback_name", None)
    if domains is None or name_of is None or not hasattr(domains, domain):
        return []
    out = []
    for cbid in range(1, MAX_CBID):
        try:
            name = name_of(int(getattr(domains, domain)), cbid)
        except Exception:  # noqa: BLE001 - an id CUPTI does not define
            continue
        if isinstance(name, str) and quiet_api(name):
            out.append(cbid)
    return out


class BatchRecorder:
    """Writes each completed buffer as one JSON line (after a meta line with the clock offset)."""

    def __init__(self, path: str, pid: int, realtime_offset_ns: int, api_name: Callable[[int, int], str]) -> None:
        path = path.replace("{pid}", str(pid))  # several CUDA processes in one tree: one file each
        self._file = open(path, "w", encoding="utf-8")  # noqa: SIM115 - closed at stop
        self._api_name = api_name
        meta = {"pid": pid, "realtime_offset_ns": realtime_offset_ns, "driver_version": driver_version(),
                "cupti_python": _dist_version("cupti-python")}  # fmt: skip
        self._file.write(json.dumps({"meta": meta}) + "\n")

    def write(self, activities: Iterable[Any]) -> None:
        batch = [dump_activity(a, self._api_name) for a in activities]
        self._file.write(json.dumps({"batch": batch}) + "\n")

    def close(self) -> None:
        self._file.close()


class CuptiUnavailable(RuntimeError):
    """CUPTI cannot trace this process; the message says why (the agent reports it and stays out of the way)."""


def find_libcuda(env: Mapping[str, str] | None = None, ld_cache: Path = LD_CACHE) -> str | None:
    """Where the dynamic loader would find libcuda.so.1, found without loading it."""
    search = (os.environ if env is None else env).get("LD_LIBRARY_PATH", "")
    dirs = [d for d in search.split(":") if d] + list(_LIB_DIRS)
    for d in dirs:
        p = Path(d) / LIBCUDA
        if p.exists():
            return str(p)
    return _in_ld_cache(ld_cache, LIBCUDA)


def _in_ld_cache(cache: Path, soname: str) -> str | None:
    try:
        data = cache.read_bytes()
    except OSError:
        return None
    for chunk in data.split(b"\0"):
        if chunk.startswith(b"/") and chunk.endswith(b"/" + soname.encode()) and Path(chunk.decode()).exists():
            return chunk.decode()
    return None


def nvtx_injection_path(search: Iterable[str] | None = None) -> str | None:
    """The libcupti to name in NVTX_INJECTION64_PATH (so NVTX ranges reach CUPTI), or None when absent.

    Looks where pip's nvidia-cuda-cupti wheels put it (``nvidia/cu*/lib``, ``nvidia/cuda_cupti/lib`` under
    each entry of ``search``, default sys.path), then in a CUDA toolkit (CUDA_HOME, /usr/local/cuda).
    """
    roots = list(sys.path if search is None else search)
    candidates: list[Path] = []
    for root in roots:
        base = Path(root or ".") / "nvidia"
        candidates += sorted(base.glob("cu*/lib/libcupti.so*"), reverse=True)
        candidates += sorted(base.glob("cuda_cupti/lib/libcupti.so*"), reverse=True)
    if search is None:
        for home in (os.environ.get("CUDA_HOME", ""), "/usr/local/cuda"):
            if home:
                candidates += sorted(Path(home).glob("extras/CUPTI/lib64/libcupti.so*"), reverse=True)
    for c in candidates:
        if c.is_file():
            return str(c)
    return None


def driver_version(path: Path = Path("/proc/driver/nvidia/version")) -> str:
    """The kernel driver's version (e.g. "580.65.06"), "" without the NVIDIA driver."""
    try:
        first = path.read_text().splitlines()[0]
    except (OSError, IndexError):
        return ""
    m = re.search(r"Module\b.*?\s(\d+\.\d+(?:\.\d+)?)\s", first + " ")
    return m.group(1) if m else ""


def cuda_driver_api_version() -> str:
    """cuDriverGetVersion of the libcuda already loaded into this process ("" when none is)."""
    try:
        lib = ctypes.CDLL(LIBCUDA, mode=os.RTLD_NOLOAD | os.RTLD_LAZY)
    except OSError:
        return ""
    v = ctypes.c_int(0)
    if lib.cuDriverGetVersion(ctypes.byref(v)) != 0:
        return ""
    return f"{v.value // 1000}.{(v.value % 1000) // 10}"


def real_gpu_missing() -> str:
    """Why this host cannot run the real GPU path with torch ("" when it can), found without loading CUDA."""
    if not Path("/dev/nvidiactl").exists():
        return "no NVIDIA GPU on this host (/dev/nvidiactl absent)"
    for module, dist in (("torch", "torch"), ("cupti", "cupti-python")):
        if importlib.util.find_spec(module) is None:
            return f"{dist} is not installed"
    ok, why = CuptiBackend.available()
    return "" if ok else why


class CuptiBackend:
    """GpuBackend (gputrace.agent.backend) recording CUPTI activity of this process."""

    name = "cupti"
    native_flush = True  # flush through ctypes when libcupti is mapped (tests of stand-ins turn it off)

    def __init__(
        self, *, flush_period_s: float = 0.25, resample_period_s: float = 1.0, buffer_bytes: int = 8 << 20,
        record_path: str | None = None, all_apis: bool | None = None, yield_after_ns: int = YIELD_AFTER_NS,
    ) -> None:  # fmt: skip
        self._all_apis = os.environ.get(ALL_APIS_ENV) == "1" if all_apis is None else all_apis
        self._yield_ns = yield_after_ns
        self._flush_all: Callable[[int], Any] = lambda flag: None
        self.quieted = 0  # quiet lookup APIs CUPTI was told not to record
        # Raw batches as JSON lines, for replay tests (tests/data/cupti); RECORD_ENV arms it in a target.
        self._record_path = record_path if record_path is not None else os.environ.get(RECORD_ENV) or None
        self._recorder: BatchRecorder | None = None
        self._flush_period = flush_period_s
        self._resample_period = resample_period_s
        self._buffer_bytes = buffer_bytes
        self._cupti: Any = None
        self._emit: Emit | None = None
        self._clock: RealtimeConverter | None = None
        self._conv: ActivityConverter | None = None
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._counts = {"cupti": 0, "convert": 0, "emit": 0}
        self._flusher = 0  # the flusher thread's ident once it runs
        self._own: set[tuple[int, str]] = set()  # (tid, role) of this backend's threads named since start
        self._errors: list[str] = []
        self._skew_us = ""

    @classmethod
    def available(cls) -> tuple[bool, str]:
        """Whether start() can work here, found without importing CUPTI or loading libcuda."""
        if importlib.util.find_spec("cupti") is None:
            return False, "cupti-python is not installed (pip install cupti-python)"
        if find_libcuda() is None:
            return False, f"no CUDA driver: {LIBCUDA} not found (is the NVIDIA driver installed?)"
        return True, "cupti-python and the CUDA driver are present"

    # ---------------------------------------------------------------------------------- lifecycle --

    def start(self, emit: Emit) -> None:
        ok, why = self.available()
        if not ok:
            raise CuptiUnavailable(why)
        try:
            cupti = importlib.import_module("cupti.cupti")
        except Exception as e:  # noqa: BLE001 - a broken install (missing libcupti, numpy) is a reason, not a crash
            raise CuptiUnavailable(f"cupti-python does not load: {e}") from None
        self._cupti, self._emit = cupti, emit
        self._own = set()  # each capture is told about them
        self._clock = RealtimeConverter(self._resample_period)
        self._conv = ActivityConverter(os.getpid(), self._clock.to_monotonic, cupti.get_callback_name,
                                       all_apis=self._all_apis)  # fmt: skip
        if self._record_path:
            self._recorder = BatchRecorder(self._record_path, os.getpid(), self._clock.offset_ns, self._conv.api_name)
        try:
            self._enable(cupti)
        except Exception as e:  # noqa: BLE001 - cuptiError, or cupti-python's NotSupportedError without a driver
            self._cupti = None  # nothing to stop
            if self._recorder is not None:
                self._recorder.close()
            raise CuptiUnavailable(_explain(e)) from None
        self._measure_skew(cupti)
        # cupti-python keeps the GIL through cuptiActivityFlushAll, which can block for hundreds of ms: the
        # target's threads would wait all that time (seen on an H100). ctypes lets the GIL go during the call.
        self._flush_all = (self.native_flush and native_flush_all()) or cupti.activity_flush_all
        if self not in _STARTED:  # a dormant service's backend starts again at each capture
            _STARTED.append(self)
        self._thread = Thread(target=self._flush_loop, name="gputrace-cupti-flush", daemon=True)
        self._thread.start()

    def _enable(self, cupti: Any) -> None:
        """Kernels are required; a kind this CUPTI refuses (and the hardware dumps) degrades, noted in info()."""
        cupti.set_thread_id_type(THREAD_ID_SYSTEM)
        cupti.activity_register_callbacks(self._buffer_requested, self._buffer_completed)
        cupti.activity_enable(KIND_CONCURRENT_KERNEL)
        for kind in DUMPED_KINDS:
            if not self._call(cupti.activity_enable_and_dump, kind):
                self._call(cupti.activity_enable, kind)
        for kind in TRACED_KINDS:
            if kind != KIND_CONCURRENT_KERNEL:
                self._call(cupti.activity_enable, kind)
        if not self._all_apis:
            self.quieted = quiet_in_cupti(cupti)

    def _measure_skew(self, cupti: Any) -> None:
        """How far CUPTI's clock, read as CLOCK_REALTIME, is from the capture clock now (should be ~0)."""
        assert self._clock is not None
        try:
            skew = self._clock.to_monotonic(int(cupti.get_timestamp())) - monotonic_ns()
        except Exception as e:  # noqa: BLE001
            self._note(f"get_timestamp: {e}")
            return
        self._skew_us = str(skew // 1000)
        if abs(skew) > 10_000_000:
            self._note(f"CUPTI's clock is {skew / 1e6:.1f} ms off CLOCK_REALTIME: GPU times will be shifted")

    def stop(self) -> None:
        cupti = self._cupti
        if cupti is None:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        # Disable first, then flush: a target that goes on launching after a capture (one attached to by pid)
        # would otherwise fill a buffer CUPTI keeps, and hand it to a finalized interpreter at exit (a crash,
        # seen on an H100). A call that was under way at the disable may still land: flushed once more.
        for kind in TRACED_KINDS + DUMPED_KINDS:
            self._call(cupti.activity_disable, kind)
        self._call(self._flush_all, FLUSH_FORCED)
        time.sleep(STOP_SETTLE_S)
        self._call(self._flush_all, FLUSH_FORCED)
        self._read_dropped()
        with self._lock:
            assert self._conv is not None
            tail = self._conv.finish()
        self._deliver(tail)
        if self._recorder is not None:
            self._recorder.close()
        self._cupti = None

    def drops(self) -> dict[str, int]:
        """Records lost: dropped by CUPTI, failed to convert or to send, or never completed on the device."""
        with self._lock:
            out = dict(self._counts)
            out["incomplete"] = self._conv.skipped.get("incomplete", 0) if self._conv is not None else 0
        return out

    def notes(self) -> dict[str, int]:
        """Records converted with a gap (a sync with no thread) or not at all though nothing was lost."""
        with self._lock:
            skipped = dict(self._conv.skipped) if self._conv is not None else {}
        skipped.pop("incomplete", None)
        return skipped

    def info(self) -> dict[str, str]:
        return {
            "cuda_version": cuda_driver_api_version(),
            "driver_version": driver_version(),
            "cupti_python": _dist_version("cupti-python"),
            "cupti_clock_skew_us": self._skew_us,
            "errors": "; ".join(self._errors[-3:]),
        }

    # ---------------------------------------------------------------------------------- callbacks --

    def _buffer_requested(self) -> tuple[int, int]:
        return self._buffer_bytes, 0  # 0: as many records as fit

    def _buffer_completed(self, activities: list[Any]) -> None:
        """Converts a buffer, handing the GIL to any waiting thread after each ``yield_after_ns`` of it:
        converting is Python under the target's GIL, and a training loop's main thread must not wait behind it."""
        records: list[tuple[Any, ...]] = self._own_thread("cupti-convert")
        done = 0
        cpu = time.thread_time_ns()
        try:
            if not isinstance(activities, list):
                activities = list(activities)
            if self._recorder is not None:
                with self._lock:
                    self._recorder.write(activities)
            last = time.perf_counter_ns()
            for done in range(0, len(activities), CONVERT_SLICE):
                if done and time.perf_counter_ns() - last >= self._yield_ns and not self._stop.is_set():
                    time.sleep(0)
                    last = time.perf_counter_ns()
                with self._lock:
                    assert self._conv is not None
                    records += self._conv.convert(activities[done : done + CONVERT_SLICE])
        except Exception as e:  # noqa: BLE001 - never raise into CUPTI's thread
            self._count("convert", len(activities) - done, e)
        self._deliver(records)
        if threading.get_ident() != self._flusher:  # the flusher's own thread is counted whole
            CPU.since(cpu)

    def _own_thread(self, role: str) -> list[tuple[Any, ...]]:
        """The calling thread as the agent's (an AgentThread record), the first time it works in ``role``:
        its time in the target is the tracing's."""
        tid = threading.get_native_id()
        with self._lock:
            if (tid, role) in self._own:
                return []
            self._own.add((tid, role))
        return [AgentThread(monotonic_ns(), os.getpid(), tid, role)]

    def _deliver(self, records: list[tuple[Any, ...]]) -> None:
        if not records or self._emit is None:
            return
        try:
            self._emit(records)
        except Exception as e:  # noqa: BLE001 - a broken channel must not break the target
            self._count("emit", len(records), e)

    def _flush_loop(self) -> None:
        assert self._clock is not None
        self._flusher = threading.get_ident()
        cpu = time.thread_time_ns()  # flushing, and the conversions CUPTI calls back into from here
        self._deliver(self._own_thread("cupti-flush"))
        while not self._stop.wait(self._flush_period):
            self._call(self._flush_all, 0)
            self._clock.maybe_resample()
            self._read_dropped()
            cpu = CPU.since(cpu)

    def _read_dropped(self) -> None:
        """Add CUPTI's count of records lost for want of buffer space (global queue; it resets on read)."""
        dropped = ctypes.c_size_t(0)
        if self._call(self._cupti.activity_get_num_dropped_records, 0, 0, ctypes.addressof(dropped)):
            self._count("cupti", dropped.value)

    def _call(self, fn: Callable[..., Any], *args: Any) -> bool:
        try:
            fn(*args)
            return True
        except Exception as e:  # noqa: BLE001 - recorded in info(); tracing degrades, the target goes on
            self._note(f"{getattr(fn, '__name__', 'cupti')}: {e}")
            return False

    def _count(self, where: str, n: int, error: BaseException | None = None) -> None:
        with self._lock:
            self._counts[where] += n
        if error is not None:
            self._note(f"{where}: {error!r}")

    def _note(self, message: str) -> None:
        if len(self._errors) < 100:
            self._errors.append(message)


def _explain(error: Any) -> str:
    status = getattr(error, "status", None) or (error.args[0] if getattr(error, "args", None) else None)
    if status == ERROR_MULTIPLE_SUBSCRIBERS:
        return "another CUPTI client (Nsight Systems, a profiler) already traces this process"
    return f"CUPTI could not start: {error}"


def _dist_version(dist: str) -> str:
    try:
        from importlib.metadata import version

        return version(dist)
    except Exception:  # noqa: BLE001
        return ""

