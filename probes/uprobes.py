"""libcuda uprobes: host-side timing of CUDA driver calls in processes that have no agent.

Finds the CUDA driver library in each target's /proc/PID/maps, attaches an entry and a return probe to the
launch, copy and synchronize entry points it exports, and turns each call into a CudaApi record with
``api="enqueue-only"``: these are host-side times only — when a launch was enqueued and how long a
synchronize blocked — with no device-side kernel times (that needs the agent). A target that has not
loaded the library yet is watched until it does.
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from gputrace import clock
from gputrace.errors import PermissionDenied, UserError
from gputrace.probes.ebpf.host import compile_bpf, program_runs, unload
from gputrace.probes.ebpf.owner import LEFT_OUT_WHY, foreign, owner_cflags
from gputrace.records import CudaApi, SourceStatus
from gputrace.source import Sink
from gputrace.threads import Thread

BPF_DIR = Path(__file__).resolve().parent / "bpf"
PROGRAM = BPF_DIR / "libcuda.bpf.c"
MAX_FUNCS = 24  # CU_MAX_FUNCS in bpf/libcuda.h
KERNEL_COUNTS = ("ringbuf", "inflight", "left_out")  # CU_DROP_*, CU_LEFT_OUT in bpf/libcuda.h
NOT_LOSSES = ("left_out",)  # calls of a process left out because it gained privileges: not recorded on purpose
API = "enqueue-only"

# Driver entry points that start or wait for device work. The _ptsz forms are what the runtime calls for
# per-thread default streams; a symbol the library lacks is skipped.
SYMBOLS = (
    "cuLaunchKernel", "cuLaunchKernelEx", "cuLaunchKernel_ptsz", "cuLaunchKernelEx_ptsz",
    "cuLaunchCooperativeKernel",
    "cuMemcpy", "cuMemcpyAsync", "cuMemcpyAsync_ptsz", "cuMemcpyHtoD_v2", "cuMemcpyDtoH_v2",
    "cuMemcpyDtoD_v2", "cuMemcpyHtoDAsync_v2", "cuMemcpyDtoHAsync_v2", "cuMemcpyDtoDAsync_v2",
    "cuMemcpyHtoDAsync_v2_ptsz", "cuMemcpyDtoHAsync_v2_ptsz",
    "cuStreamSynchronize", "cuStreamSynchronize_ptsz", "cuCtxSynchronize", "cuEventSynchronize",
    "cuStreamWaitEvent", "cuGraphLaunch",
)  # fmt: skip


# How bcc says a library lacks a symbol (any other failure to attach is the kernel refusing the probe).
BCC_NO_SYMBOL = "could not determine address of symbol"


class UprobeRefused(Exception):
    """The kernel refused a uprobe (its symbol is the argument)."""


class UprobeEvent(ctypes.Structure):
    """Mirrors struct cu_event in bpf/libcuda.h."""

    _fields_ = [
        ("start_ns", ctypes.c_uint64),
        ("end_ns", ctypes.c_uint64),
        ("pid", ctypes.c_uint32),
        ("tid", ctypes.c_uint32),
        ("fn", ctypes.c_uint32),
        ("ret", ctypes.c_int32),
    ]


def program_text() -> str:
    """The BPF program as compiled (for a hidden --ebpf flag)."""
    return PROGRAM.read_text()


def find_library(pid: int, prefix: str = "libcuda.so", proc: Path = Path("/proc")) -> str | None:
    """The path of the first mapped file of ``pid`` whose name starts with ``prefix``, as this process sees it.

    Raises ProcessLookupError when the process is gone.
    """
    try:
        maps = (proc / str(pid) / "maps").read_text(errors="replace")
    except FileNotFoundError:
        raise ProcessLookupError(pid) from None
    except OSError:
        return None
    for line in maps.splitlines():
        parts = line.split(None, 5)
        if len(parts) == 6 and parts[5].startswith("/") and os.path.basename(parts[5]).startswith(prefix):
            return visible_path(pid, parts[5], proc)
    return None


def visible_path(pid: int, path: str, proc: Path = Path("/proc")) -> str:
    """A path from another mount namespace (a container), reached through /proc/PID/root when needed."""
    if os.path.exists(path):
        return path
    return str(proc / str(pid) / "root" / path.lstrip("/"))


def to_record(e: UprobeEvent, symbols: Sequence[str]) -> CudaApi:
    name = symbols[e.fn] if e.fn < len(symbols) else f"fn{e.fn}"
    return CudaApi(e.pid, e.tid, name, e.start_ns, e.end_ns, 0, API, e.ret)


class UprobeSource:
    """Source of enqueue-only CudaApi records for ``pids`` (gputrace.source.Source)."""

    name = "uprobe"

    def __init__(
        self, pids: Iterable[int], *, library: str = "libcuda.so", symbols: Sequence[str] = SYMBOLS,
        rescan_s: float = 0.5, ringbuf_pages: int = 256, owner_uid: int | None = None, poll_ms: int = 100,
    ) -> None:  # fmt: skip
        """``owner_uid``: the capture is for this non-root user: a process holding privileges it lacks is not
        probed, and no call is recorded of one that gains them later (at an exec)."""
        if len(symbols) > MAX_FUNCS:
            raise ValueError(f"at most {MAX_FUNCS} symbols")
        self.pids = list(dict.fromkeys(pids))
        self.library = library
        self.symbols = tuple(symbols)
        self.rescan_s = rescan_s
        self.poll_ms = poll_ms  # the ring's poll when no call wakes it
        self.ringbuf_pages = ringbuf_pages
        self.attached: dict[int, tuple[str, list[str]]] = {}  # pid → (library path, symbols attached)
        self.watching: set[int] = set()
        self.owner_uid = owner_uid
        self.left_out: set[int] = set()  # pids not probed: privileged for their owner when found
        self.refused: dict[str, list[str]] = {}  # library path -> the symbols whose probes the kernel refused
        self.unprobed: set[str] = set()  # libraries whose first probe was refused: none is tried again
        self._bpf: Any = None
        self._sink: Sink | None = None
        self._batch: list[tuple[Any, ...]] = []
        self._malformed = 0
        self._final_counts: dict[str, int] = dict.fromkeys(KERNEL_COUNTS, 0)
        self._final_runs: dict[str, tuple[int, int]] | None = None
        self._lock = threading.Lock()
        self._attach_lock = threading.Lock()  # bcc's attach bookkeeping is not thread-safe
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # --------------------------------------------------------------------------------- lifecycle --

    def start(self, sink: Sink) -> None:
        self._sink = sink
        self._bpf = self._load()
        self._bpf[b"events"].open_ring_buffer(self._on_event)
        sink.emit_meta(self.name, {"api": API, "symbols": list(self.symbols), "library": self.library})
        for pid in self.pids:
            self._try_attach(pid)
        self._thread = Thread(target=self._run, name="gputrace-uprobe", daemon=True)
        self._thread.start()

    def add_pid(self, pid: int) -> None:
        """Also trace ``pid`` (a process found after start, e.g. a new child)."""
        with self._lock:
            if pid in self.pids:
                return
            self.pids.append(pid)
        if self._bpf is not None:
            self._try_attach(pid)

    def stop(self) -> None:
        if self._bpf is None:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._bpf.ring_buffer_consume()
        self._flush()
        self._final_counts = self._read_counts()
        self._final_runs = program_runs(self._bpf)
        unload(self._bpf)
        self._bpf = None
        left = self._final_counts["left_out"]
        if left:
            self._status("stopped", f"{left} calls not recorded, of processes left out: {LEFT_OUT_WHY}")

    def program_runs(self) -> dict[str, tuple[int, int]]:
        """(run count, run time ns) of each of this source's kernel programs (see ebpf.host.program_runs)."""
        return program_runs(self._bpf, final=self._final_runs)

    def drops(self) -> dict[str, int]:
        counts = self._read_counts() if self._bpf is not None else dict(self._final_counts)
        out = {k: v for k, v in counts.items() if k not in NOT_LOSSES}
        out["malformed"] = self._malformed
        return out

    # --------------------------------------------------------------------------------- internals --

    def _load(self) -> Any:
        if os.geteuid() != 0:
            raise PermissionDenied("libcuda uprobes need root (CAP_BPF and CAP_PERFMON)")
        try:
            from bcc import BPF
        except ImportError:
            raise UserError("bcc is not importable: install python3-bpfcc (run setup.sh)") from None
        cflags = [f"-I{BPF_DIR}", f"-DRINGBUF_PAGES={self.ringbuf_pages}", *owner_cflags(self.owner_uid)]
        try:
            return compile_bpf(BPF, src_file=str(PROGRAM).encode(), cflags=cflags)
        except Exception as e:  # noqa: BLE001 - bcc raises bare Exceptions for compile failures
            raise UserError(f"cannot load {PROGRAM.name}: {e}") from None

    def _try_attach(self, pid: int) -> None:
        with self._attach_lock:
            self._attach_locked(pid)

    def _attach_locked(self, pid: int) -> None:
        if self.owner_uid is not None and os.path.isdir(f"/proc/{pid}") and foreign(pid, self.owner_uid):
            self.watching.discard(pid)  # not even its maps read for the owner
            self.left_out.add(pid)
            self._status("degraded", f"pid {pid} left out: it holds privileges you lack (setuid/setgid/setcap)")
            return
        try:
            path = find_library(pid, self.library)
        except ProcessLookupError:
            self._status("degraded", f"pid {pid} is gone")
            self.watching.discard(pid)
            return
        if path is None:
            if pid not in self.watching:
                self._status("degraded", f"pid {pid}: no {self.library}* mapped (no CUDA yet); watching for it")
            self.watching.add(pid)
            return
        self.watching.discard(pid)
        if path in self.unprobed:  # tried again, it would be refused again (and libbcc say so again)
            self.attached[pid] = (path, [])
            self._status("degraded", f"pid {pid}: not probed: the kernel refused uprobes on {path}")
            return
        done: list[str] = []
        refused: list[str] = []
        for i, sym in enumerate(self.symbols):
            try:
                if self._attach_one(path, sym, i, pid):
                    done.append(sym)
            except UprobeRefused:
                refused.append(sym)
                if not done:  # the kernel probes none of this library (no uprobe support, its filesystem)
                    self.unprobed.add(path)
                    break
        self.attached[pid] = (path, done)
        if refused:
            self.refused[path] = sorted({*self.refused.get(path, []), *refused})
        if path in self.unprobed:
            self._status("degraded", f"pid {pid}: the kernel refused a uprobe on {path} ({refused[0]}; libbcc "
                                     "says why on the tracer's stderr): its CUDA calls are not probed")  # fmt: skip
        elif done:
            extra = f"; refused by the kernel: {', '.join(refused)}" if refused else ""
            self._status("started", f"pid {pid}: {len(done)} probes on {path} (host-side, enqueue-only timing){extra}")
        else:
            self._status("degraded", f"pid {pid}: {path} exports none of the traced CUDA symbols")

    def _attach_one(self, path: str, sym: str, index: int, pid: int) -> bool:
        """Whether ``sym`` was probed; False where the library lacks it. Raises UprobeRefused where the kernel
        refused the probe (no uprobe support, an instruction it cannot probe)."""
        assert self._bpf is not None
        try:
            self._bpf.attach_uprobe(name=path.encode(), sym=sym.encode(), fn_name=f"enter_{index}".encode(), pid=pid)
        except Exception as e:  # noqa: BLE001 - bcc raises bare Exceptions
            if str(e).startswith(BCC_NO_SYMBOL):
                return False
            raise UprobeRefused(sym) from None
        try:
            self._bpf.attach_uretprobe(
                name=path.encode(), sym=sym.encode(), fn_name=f"leave_{index}".encode(), pid=pid
            )
        except Exception:  # noqa: BLE001
            self._bpf.detach_uprobe(name=path.encode(), sym=sym.encode(), pid=pid)
            raise UprobeRefused(sym) from None
        return True

    def _run(self) -> None:
        next_scan = clock.monotonic_ns()
        while not self._stop.is_set():
            self._bpf.ring_buffer_poll(self.poll_ms)
            self._flush()
            now = clock.monotonic_ns()
            if self.watching and now >= next_scan:
                for pid in sorted(self.watching):
                    self._try_attach(pid)
                next_scan = now + int(self.rescan_s * 1e9)

    def _on_event(self, ctx: Any, data: Any, size: int) -> None:
        if size != ctypes.sizeof(UprobeEvent):
            self._malformed += 1
            return
        e = ctypes.cast(data, ctypes.POINTER(UprobeEvent)).contents
        self._batch.append(to_record(e, self.symbols))

    def _flush(self) -> None:
        if self._batch and self._sink is not None:
            batch, self._batch = self._batch, []
            self._sink.emit(batch)

    def _read_counts(self) -> dict[str, int]:
        table = self._bpf[b"drops"]
        return {name: int(table[ctypes.c_int(i)].value) for i, name in enumerate(KERNEL_COUNTS)}

    def _status(self, status: str, detail: str) -> None:
        if self._sink is not None:
            self._sink.emit([SourceStatus(clock.monotonic_ns(), self.name, status, detail)])
