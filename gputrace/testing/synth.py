"""Synthetic captures for analysis tests and benchmarks: typed records in, a real capture file out.

Times are given in milliseconds from an arbitrary base and stored as CLOCK_MONOTONIC ns.
"""

from __future__ import annotations

import zlib
from pathlib import Path
from typing import Any

from gputrace.capture import CaptureWriter, host_header
from gputrace.probes.ebpf.uring import OPS as URING_OPS
from gputrace.records import (
    BlockIO,
    Collective,
    CpuCgroup,
    CpuThrottle,
    CudaApi,
    DirtyPause,
    Drops,
    EpollEntry,
    FdInfo,
    GpuDevice,
    GpuKernel,
    GpuMemcpy,
    GpuSync,
    IoUringRequest,
    NvmlSample,
    OffCpu,
    PageFault,
    ProcFork,
    ProcInfo,
    StackFrames,
    StackSample,
    Syscall,
    ThreadInfo,
)

BASE_NS = 1_000_000_000_000


def ns(ms: float) -> int:
    return BASE_NS + round(ms * 1_000_000)


class Builder:
    def __init__(self) -> None:
        self.records: list[Any] = []
        self.meta: dict[str, dict[str, Any]] = {}
        self.kernel: list[bytes] = []  # raw eBPF events, decoded (fds resolved) when the capture is read
        self._corr = 0

    def proc(self, pid: int, comm: str, ppid: int = 1) -> Builder:
        self.records.append(ProcInfo(ns(0), pid, ppid, comm, [comm], f"/usr/bin/{comm}"))
        return self

    def thread(self, pid: int, tid: int, comm: str) -> Builder:
        self.records.append(ThreadInfo(ns(0), pid, tid, comm))
        return self

    def fork(self, parent_pid: int, parent_tid: int, child_pid: int, child_tid: int, at_ms: float,
             comm: str = "python") -> Builder:
        """Thread ``parent_tid`` creates task ``child_tid`` at ``at_ms``: a thread of its own process when
        ``child_pid == parent_pid``, else a new process."""
        self.records.append(ProcFork(ns(at_ms), parent_pid, parent_tid, child_pid, child_tid,
                                     child_pid == parent_pid, comm))
        return self

    def device(self, pid: int, dev: int = 0, simulated: bool = True, name: str = "sim-gpu",
               uuid: str | None = None) -> Builder:
        """Process ``pid``'s CUDA device ``dev``. A real one's UUID defaults to one per ``dev``: processes
        naming the same id name the same GPU."""
        if uuid is None:
            uuid = f"uuid-{pid}-{dev}" if simulated else f"GPU-00000000-0000-0000-0000-{dev:012x}"
        self.records.append(GpuDevice(dev, name, simulated, uuid, pid))
        return self

    def nvml_devices(self, *uuids: str) -> Builder:
        """The NVML source's device list: index i is ``uuids[i]``."""
        self.meta["nvml"] = {"devices": [{"index": i, "name": "gpu", "uuid": u} for i, u in enumerate(uuids)]}
        return self

    def op(self, pid: int, tid: int, launch_ms: float, start_ms: float, end_ms: float, name: str = "k",
           dev: int = 0, stream: int = 7, memcpy: bool = False, api: bool = True) -> int:
        """A kernel (or an h2d copy) and the CUDA API call that launched it; returns its correlation id."""
        self._corr += 1
        c = self._corr
        if api:
            api_name = "cudaMemcpyAsync" if memcpy else "cudaLaunchKernel"
            self.records.append(CudaApi(pid, tid, api_name, ns(launch_ms), ns(launch_ms) + 5_000, c, "runtime", 0))
        if memcpy:
            self.records.append(GpuMemcpy(pid, dev, 1, stream, ns(start_ms), ns(end_ms), c, 1 << 20, "h2d", "pinned"))
        else:
            self.records.append(GpuKernel(pid, dev, 1, stream, ns(start_ms), ns(end_ms), c, name, (1, 1, 1),
                                          (128, 1, 1)))
        return c

    def collective(self, pid: int, corr: int, name: str, seq: int, rank: int, world: int, dev: int = 0,
                   comm: str = "") -> Builder:
        self.records.append(Collective(pid, dev, corr, name, seq, rank, world, 4 << 20, comm))
        return self

    def syscall(self, pid: int, tid: int, name: str, start_ms: float, end_ms: float, obj: str = "", nbytes: int = 0,
                fd: int = 3, arg: int = 0) -> Builder:
        self.records.append(Syscall(pid, tid, name, ns(start_ms), ns(end_ms), nbytes, fd, obj, nbytes, arg))
        return self

    def fd(self, pid: int, fd: int, obj: str, kind: str = "socket") -> Builder:
        """An fd of ``pid`` when tracing began (the /proc snapshot)."""
        self.records.append(FdInfo(ns(0), pid, fd, kind, obj))
        return self

    def epoll_entry(self, pid: int, epfd: int, fd: int, data: int) -> Builder:
        """A registration of epoll fd ``epfd`` when tracing began (the snapshot's fdinfo); ``epfd`` itself
        must be in the snapshot (``fd(pid, epfd, "anon_inode:[eventpoll]", "anon")``) before it."""
        self.records.append(EpollEntry(ns(0), pid, epfd, fd, 0x19, data))
        return self

    def ebpf(self, leave_out: tuple[str, ...] = (), flags: dict[str, int] | None = None) -> Builder:
        """The eBPF source's metadata, which raw ``kernel_call`` events are read by: every syscall it traces
        but ``leave_out``, each numbered by its place in probes/ebpf/syscalls.py, with ``flags`` replacing some
        syscalls' flags (as an earlier version recorded them)."""
        from gputrace.probes.ebpf.events import LAYOUT
        from gputrace.probes.ebpf.syscalls import SPECS

        specs = [(nr, spec) for nr, spec in enumerate(SPECS) if spec.name not in leave_out]
        self.meta["ebpf"] = {"layout": LAYOUT, "threshold_ns": 100_000, "syscalls": {nr: s.name for nr, s in specs},
                             "sysflags": {nr: (flags or {}).get(s.name, s.flags) for nr, s in specs}}  # fmt: skip
        return self

    def kernel_call(self, pid: int, tid: int, name: str, start_ms: float, end_ms: float, ret: int = 0, a0: int = 0,
                    a1: int = 0, arg: int = 0) -> Builder:
        """A syscall as the kernel program reports it (a gt_sys_event: a0, a1 and arg as its flags say); a call
        shorter than the threshold (0.1 ms) only updates the fd tables, as in a real capture."""
        from gputrace.probes.ebpf.events import EV_SYS, SYS

        if "ebpf" not in self.meta:
            self.ebpf()
        nr = next(int(k) for k, v in self.meta["ebpf"]["syscalls"].items() if v == name)
        self.kernel.append(SYS.pack(EV_SYS, nr, pid, tid, ns(start_ms), ns(end_ms), ret, a0 & (1 << 64) - 1, a1, arg))
        return self

    def block(self, pid: int, tid: int, issue_ms: float, done_ms: float, nbytes: int, dev: str = "loop0",
              comm: str = "worker", rwbs: str = "R") -> Builder:
        self.records.append(BlockIO(pid, tid, comm, dev, 2048, nbytes, rwbs, ns(issue_ms), ns(done_ms)))
        return self

    def fault(self, pid: int, tid: int, start_ms: float, wait_from_ms: float, end_ms: float, obj: str = "",
              offset: int = 0, dev: str = "7:0", ino: int = 12) -> Builder:
        """A wait in a page fault on a file mapping, with the off-CPU span it is made of."""
        self.records.append(PageFault(pid, tid, ns(start_ms), ns(end_ms), ns(end_ms) - ns(wait_from_ms), obj, offset,
                                      dev, ino))  # fmt: skip
        return self.offcpu(pid, tid, wait_from_ms, end_ms, "D", waker=(0, 0, "[irq]"))

    def dirty(self, pid: int, tid: int, at_ms: float, pause_ms: float, dev: str = "loop0", dirty: int = 256 << 10,
              setpoint: int = 216 << 10) -> Builder:
        """A pause for dirty pages set at ``at_ms``, with the killable sleep it is (off CPU in D, timer-woken)."""
        self.records.append(DirtyPause(pid, tid, ns(at_ms), round(pause_ms * 1_000_000), dev, dirty, setpoint, dirty,
                                       1 << 30, 0))
        return self.offcpu(pid, tid, at_ms + 0.005, at_ms + pause_ms, "D", waker=(0, 0, "[timer]"))

    def cpu_cgroup(self, pid: int, at_ms: float, path: str, version: int = 2, error: str = "") -> Builder:
        self.records.append(CpuCgroup(ns(at_ms), pid, path, version, error))
        return self

    def throttle(self, path: str, at_ms: float, prev_ms: float, throttled_ms: float, nr_throttled: int,
                 quota_us: int = 20_000, period_us: int = 100_000, version: int = 2, error: str = "") -> Builder:
        """A sample of ``path``'s counters at ``at_ms``; the previous sample (``prev_ms``) read as the record before."""
        self.records.append(CpuThrottle(ns(at_ms), ns(prev_ms), path, version, quota_us, period_us, nr_throttled + 1,
                                        nr_throttled, ns(throttled_ms), error))
        return self

    def offcpu(self, pid: int, tid: int, start_ms: float, end_ms: float, state: str = "S",
               wake_ms: float | None = None, waker: tuple[int, int, str] = (0, 0, ""),
               held: tuple[int, int, str] = (0, 0, "")) -> Builder:
        """``held``: (pid, tid, comm) of the task that had the CPU until the thread got it back."""
        wake = ns(wake_ms) if wake_ms is not None else (ns(end_ms) if waker[1] else 0)
        self.records.append(OffCpu(pid, tid, ns(start_ms), ns(end_ms), state, wake, *waker, *held))
        return self

    def uring(self, pid: int, tid: int, submit_ms: float, done_ms: float, obj: str = "", nbytes: int = 0,
              op: str = "READ", fd: int = 5, ring_fd: int = 4, res: int | None = None, flags: int = 0) -> Builder:
        """An io_uring request of ``pid`` submitted by ``tid`` through ring ``ring_fd`` (-1: SQPOLL), on ``obj``
        (its fd's path or peer, "" unknown), completed at ``done_ms`` with ``res`` (default ``nbytes``)."""
        opcode = URING_OPS.index(op) if op in URING_OPS else 255
        self.records.append(IoUringRequest(pid, tid, op, ns(submit_ms), ns(done_ms), nbytes if res is None else res,
                                           fd, obj, nbytes, ring_fd, flags, opcode, 0))  # fmt: skip
        return self

    def sync(self, pid: int, tid: int, start_ms: float, end_ms: float, dev: int = 0) -> Builder:
        self.records.append(GpuSync(pid, tid, dev, 1, 7, ns(start_ms), ns(end_ms), 0, "context"))
        return self

    def nvml(self, dev: int, at_ms: float, util: float) -> Builder:
        """A utilization sample of NVML's device ``dev`` (its index)."""
        self.records.append(NvmlSample(ns(at_ms), dev, "gpu_util_pct", util))
        return self

    def drops(self, at_ms: float, source: str, what: str, count: int) -> Builder:
        self.records.append(Drops(ns(at_ms), source, what, count))
        return self

    def samples(self, pid: int, tid: int, start_ms: float, end_ms: float, frames: list[str],
                every_ms: float = 1.0) -> Builder:
        """CPU samples of ``tid`` every ``every_ms`` in [start_ms, end_ms), all in the stack ``frames`` (leaf
        first), with that stack's StackFrames record (its id derived from the frames)."""
        stack = zlib.crc32("\n".join(frames).encode()) & 0x7FFFFFFF
        self.records.append(StackFrames(pid, stack, list(frames)))
        n = int((end_ms - start_ms) / every_ms)
        self.records += [StackSample(ns(start_ms + i * every_ms), pid, tid, stack) for i in range(n)]
        return self

    def write(self, path: Path, *, complete: bool = True, drops: dict[str, int] | None = None,
              header: dict[str, Any] | None = None, trailer: dict[str, Any] | None = None) -> Path:
        hdr = {**host_header(["synthetic"]), "start_ns": BASE_NS, "tracer_pid": 0, **(header or {})}
        w = CaptureWriter(path, hdr, force=True)
        for source, meta in self.meta.items():
            w.write_meta(source, meta)
        w.write(self.records)
        if self.kernel:
            w.write_kernel(b"".join(self.kernel), len(self.kernel))
        cut = w.partial_path.stat().st_size
        end = max((_end(r) for r in self.records), default=BASE_NS)
        w.close({"end_ns": end, "drops": drops or {}, "complete": True, **(trailer or {})})
        if not complete:  # as a crash leaves it: everything up to the trailer
            with open(path, "r+b") as f:
                f.truncate(cut)
        return path


def _end(r: Any) -> int:
    for f in ("end_ns", "complete_ns", "ts"):
        if hasattr(r, f):
            return int(getattr(r, f))
    return BASE_NS
