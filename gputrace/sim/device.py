"""A simulated GPU: streams run "kernels" and copies for given durations on background threads.

Host calls behave as CUDA's: a launch enqueues and returns at once with a correlation id shared by its
CudaApi record and its GpuKernel/GpuMemcpy record; ``synchronize()`` really blocks on a condition that the
stream's thread signals, so eBPF sees a futex wait woken by that thread. Device times are the stream's
schedule: an operation starts when it is dequeued or when the one before it ends (back to back, as a
GPU runs queued work) and lasts exactly its duration; the host is released when that end has passed.
"""

from __future__ import annotations

import itertools
import numbers
import os
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

from gputrace.records import Collective, CudaApi, GpuDevice, GpuKernel, GpuMemcpy, GpuMemset, GpuSync
from gputrace.sim.backend import BACKEND

if TYPE_CHECKING:
    from gputrace.sim.collective import ProcessGroup

COPY_KINDS = ("h2d", "d2h", "d2d", "h2h", "p2p")
_correlation = itertools.count(1)

MAX_DURATION_MS = 86_400_000.0  # a day: longer is a mistake, and would overflow the stream's clock


def _now() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def next_correlation_id() -> int:
    return next(_correlation)


def _sleep_until(deadline_ns: int) -> None:
    while True:
        left = deadline_ns - _now()
        if left <= 0:
            return
        time.sleep(left / 1e9)


Dims = tuple[int, int, int]


def _dims(d: tuple[int, ...]) -> Dims:
    dims = tuple(int(x) for x in d)
    if len(dims) != 3 or min(dims) < 1:
        raise ValueError(f"grid and block are three positive ints, not {d!r}")
    return dims[0], dims[1], dims[2]


class _Op(NamedTuple):
    kind: str  # kernel, memcpy, memset, collective
    name: str
    duration_ns: int
    correlation_id: int
    nbytes: int
    copy_kind: str
    memory: str
    # For a collective: blocks until every rank arrived; returns the time the transfer may begin.
    rendezvous: Callable[[int], int] | None
    grid: Dims = (1, 1, 1)
    block: Dims = (1, 1, 1)
    enqueued_ns: int = 0


class Stream:
    """An in-order queue of device work, executed by one thread. Create with ``Device.stream()``."""

    def __init__(self, device: Device, stream_id: int) -> None:
        self.device = device
        self.id = stream_id
        self._owner = 0
        self._start_worker()

    def _start_worker(self) -> None:
        self._owner = os.getpid()
        self._cond = threading.Condition()
        self._ops: deque[_Op] = deque()
        self._submitted = 0
        self._completed = 0
        self._busy_until = 0
        self._thread = threading.Thread(target=self._work, name=f"sim-gpu{self.device.id}-s{self.id}", daemon=True)
        self._thread.start()

    # --------------------------------------------------------------------------------- host API ---
    def launch(self, name: str, duration_ms: float, *, grid: tuple[int, int, int] = (1, 1, 1),
               block: tuple[int, int, int] = (128, 1, 1)) -> int:
        """Enqueue a kernel; returns its correlation id at once."""
        if not isinstance(name, str) or not name:
            raise ValueError("a kernel needs a name")
        return self._enqueue("kernel", "cudaLaunchKernel", name, duration_ms, grid=grid, block=block)

    def memcpy(self, nbytes: int, duration_ms: float, kind: str = "h2d", *, memory: str = "pageable") -> int:
        if kind not in COPY_KINDS:
            raise ValueError(f"memcpy kind must be one of {', '.join(COPY_KINDS)}, not {kind!r}")
        return self._enqueue("memcpy", "cudaMemcpyAsync", "", duration_ms, nbytes, kind, memory)

    def memset(self, nbytes: int, duration_ms: float) -> int:
        return self._enqueue("memset", "cudaMemsetAsync", "", duration_ms, nbytes)

    def all_reduce(self, group: ProcessGroup, nbytes: int, duration_ms: float) -> int:
        """Enqueue an all-reduce over ``group``: its kernel ends ``duration_ms`` after the last rank arrives."""
        seq = group.next_seq()
        cid = self._enqueue("collective", "cudaLaunchKernel", "ncclDevKernel_AllReduce_Sum_f32_RING (simulated)",
                            duration_ms, nbytes, rendezvous=lambda start: group.rendezvous(seq, start))
        if BACKEND.enabled:
            BACKEND.emit([Collective(os.getpid(), self.device.id, cid, "all_reduce", seq, group.rank, group.world,
                                     int(nbytes), group.comm_id)])
        return cid

    def synchronize(self) -> None:
        """Block until everything enqueued so far has finished (cudaStreamSynchronize)."""
        t0, cid = _now(), next_correlation_id()
        self.wait_idle()
        if BACKEND.enabled:
            t1, tid = _now(), threading.get_native_id()
            pid, dev = os.getpid(), self.device
            BACKEND.emit([
                CudaApi(pid, tid, "cudaStreamSynchronize", t0, t1, cid, "runtime", 0),
                GpuSync(pid, tid, dev.id, dev.context, self.id, t0, t1, cid, "stream"),
            ])

    def wait_idle(self) -> None:
        self._check_fork()
        with self._cond:
            target = self._submitted
            while self._completed < target:
                self._cond.wait()

    def query(self) -> bool:
        """True when the stream has no unfinished work (cudaStreamQuery)."""
        t0, cid = _now(), next_correlation_id()
        with self._cond:
            idle = self._completed >= self._submitted
        if BACKEND.enabled:
            BACKEND.emit([CudaApi(os.getpid(), threading.get_native_id(), "cudaStreamQuery", t0, _now(), cid,
                                  "runtime", 0 if idle else 600)])  # 600: cudaErrorNotReady
        return idle

    # -------------------------------------------------------------------------------- internals ---
    def _enqueue(self, kind: str, api: str, name: str, duration_ms: float, nbytes: int = 0,
                 copy_kind: str = "", memory: str = "",
                 rendezvous: Callable[[int], int] | None = None, grid: tuple[int, ...] = (1, 1, 1),
                 block: tuple[int, ...] = (1, 1, 1)) -> int:
        if isinstance(duration_ms, bool) or not isinstance(duration_ms, numbers.Real) \
                or not 0 <= duration_ms <= MAX_DURATION_MS:
            raise ValueError(f"duration_ms must be a number of milliseconds in [0, {MAX_DURATION_MS:g}], "
                             f"not {duration_ms!r}")
        if isinstance(nbytes, bool) or not isinstance(nbytes, numbers.Integral) or nbytes < 0:
            raise ValueError(f"nbytes must be an int >= 0, not {nbytes!r}")
        self._check_fork()
        t0, cid = _now(), next_correlation_id()
        dims = _dims(grid), _dims(block)
        with self._cond:
            op = _Op(kind, name, int(duration_ms * 1e6), cid, int(nbytes), copy_kind, memory, rendezvous,
                     *dims, _now())
            self._ops.append(op)
            self._submitted += 1
            self._cond.notify_all()
        if BACKEND.enabled:
            BACKEND.emit([CudaApi(os.getpid(), threading.get_native_id(), api, t0, _now(), cid, "runtime", 0)])
        return cid

    def _check_fork(self) -> None:
        """A forked child inherits the stream but not its thread: give it a fresh, empty one."""
        if self._owner != os.getpid():
            self._start_worker()

    def _work(self) -> None:
        while True:
            with self._cond:
                while not self._ops:
                    self._cond.wait()
                op = self._ops[0]
            start, end = self._run(op)
            if BACKEND.enabled:  # before the host is released: what it synchronized on is on record
                BACKEND.emit([self._record(op, start, end)])
            with self._cond:
                self._ops.popleft()
                self._completed += 1
                self._cond.notify_all()

    def _run(self, op: _Op) -> tuple[int, int]:
        # Queued work runs back to back; work arriving at an idle stream starts when it was enqueued.
        start = max(op.enqueued_ns, self._busy_until)
        if op.rendezvous is not None:
            ready = op.rendezvous(start)  # a late peer holds this kernel on the device
            end = max(ready, start) + op.duration_ns
        else:
            end = start + op.duration_ns
        _sleep_until(end)
        self._busy_until = end
        return start, end

    def _record(self, op: _Op, start: int, end: int) -> tuple[Any, ...]:
        pid, dev = os.getpid(), self.device
        if op.kind in ("kernel", "collective"):
            return GpuKernel(pid, dev.id, dev.context, self.id, start, end, op.correlation_id, op.name,
                             op.grid, op.block)
        if op.kind == "memcpy":
            return GpuMemcpy(pid, dev.id, dev.context, self.id, start, end, op.correlation_id,
                             op.nbytes, op.copy_kind, op.memory)
        return GpuMemset(pid, dev.id, dev.context, self.id, start, end, op.correlation_id, op.nbytes)


class Device:
    """A simulated GPU. Every record it produces says so (GpuDevice.simulated, "Simulated" in the name)."""

    def __init__(self, device_id: int = 0) -> None:
        if not isinstance(device_id, int) or device_id < 0:
            raise ValueError(f"device id must be an int >= 0, not {device_id!r}")
        self.id = device_id
        self.context = device_id + 1
        self.name = f"Simulated GPU {device_id} (gputrace.sim)"
        self.streams: list[Stream] = []
        self._lock = threading.Lock()
        self.default_stream = self.stream()
        BACKEND.add_device(device_id, self.record)

    def record(self) -> GpuDevice:
        return GpuDevice(self.id, self.name, True, f"SIM-{os.getpid()}-{self.id}", os.getpid())

    def stream(self) -> Stream:
        with self._lock:
            s = Stream(self, len(self.streams) + 1)
            self.streams.append(s)
        return s

    def synchronize(self) -> None:
        """Block until every stream of this device is idle (cudaDeviceSynchronize)."""
        t0, cid = _now(), next_correlation_id()
        for s in list(self.streams):
            s.wait_idle()
        if BACKEND.enabled:
            t1, tid, pid = _now(), threading.get_native_id(), os.getpid()
            BACKEND.emit([
                CudaApi(pid, tid, "cudaDeviceSynchronize", t0, t1, cid, "runtime", 0),
                GpuSync(pid, tid, self.id, self.context, 0, t0, t1, cid, "context"),
            ])
