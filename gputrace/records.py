"""Typed records: what sources emit, the capture file stores, and analysis and exporters read.

Every time is CLOCK_MONOTONIC nanoseconds (see gputrace.clock). ``pid`` is a tgid, ``tid`` a kernel tid.
Records are NamedTuples so the capture file stores them as plain positional rows; a record's kind is its
class name. Adding a field at the end is backwards compatible (old rows are padded with defaults); never
reorder or remove fields.
"""

from __future__ import annotations

from typing import Any, NamedTuple

# --------------------------------------------------------------------------------------- processes ----


class ProcInfo(NamedTuple):
    """Metadata of a traced process, taken from /proc when it is first seen. ``nspid``: its pid in its own
    pid namespace (a container) when that is not the session's, else 0."""

    ts: int
    pid: int
    ppid: int
    comm: str
    cmdline: list[str]
    exe: str
    nspid: int = 0


class ThreadInfo(NamedTuple):
    ts: int
    pid: int
    tid: int
    comm: str


class ProcFork(NamedTuple):
    """A new task. ``is_thread``: a thread in the parent's process (child_pid == parent_pid)."""

    ts: int
    parent_pid: int
    parent_tid: int
    child_pid: int
    child_tid: int
    is_thread: bool
    comm: str


class ProcExec(NamedTuple):
    ts: int
    pid: int
    tid: int
    comm: str
    filename: str


class ProcExit(NamedTuple):
    ts: int
    pid: int
    tid: int
    comm: str


class FdInfo(NamedTuple):
    """A file descriptor that existed when tracing of ``pid`` began (from /proc/PID/fd).

    ``kind``: file, socket, pipe, anon, other. ``obj``: path, peer ``host:port``, or the /proc link text.
    """

    ts: int
    pid: int
    fd: int
    kind: str
    obj: str


class EpollEntry(NamedTuple):
    """A registration of epoll fd ``epfd`` of ``pid`` when tracing of it began (from /proc/PID/fdinfo/EPFD): fd
    ``fd`` (a number in ``pid``'s table) watched for ``events`` with the 64-bit ``data`` word that its ready
    events carry. Later registrations are the ``epoll_ctl`` calls in the kernel events."""

    ts: int
    pid: int
    epfd: int
    fd: int
    events: int
    data: int


# ---------------------------------------------------------------------------------------- kernel -----


class Syscall(NamedTuple):
    """A syscall at least as long as the capture's threshold.

    ``obj``: the file path / peer address / pipe the fd refers to ("" when unknown or not fd-based).
    ``nbytes``: bytes transferred (read/write/recv/send family), else 0. ``arg``: the call's main
    argument besides the fd (requested count, futex address, sleep request in ns, ioctl cmd).
    """

    pid: int
    tid: int
    name: str
    start_ns: int
    end_ns: int
    ret: int
    fd: int
    obj: str
    nbytes: int
    arg: int


class SyscallAgg(NamedTuple):
    """Calls shorter than the threshold, aggregated in the kernel per thread and syscall."""

    pid: int
    tid: int
    name: str
    count: int  # type: ignore[assignment]  # a field, shadowing tuple.count by design
    total_ns: int


class BlockIO(NamedTuple):
    """One block request, attributed to the task that submitted it."""

    pid: int
    tid: int
    comm: str
    dev: str
    sector: int
    nbytes: int
    rwbs: str
    issue_ns: int
    complete_ns: int


class OffCpu(NamedTuple):
    """A traced thread off CPU for at least the threshold.

    ``state``: the task state when it left the CPU ("S" sleeping, "D" uninterruptible, "R" preempted,
    ...). ``wake_ns`` is when it was woken (0: never seen woken, e.g. preempted), and the waker fields
    name who did it, traced or not (a FUSE daemon, a peer). The ``held_*`` fields name the task that had
    the CPU until this thread got it back: for a thread preempted, or woken and then kept waiting for a CPU,
    one that held the CPU it waited for (empty: the CPU was idle, or a capture made before they existed).
    """

    pid: int
    tid: int
    start_ns: int
    end_ns: int
    state: str
    wake_ns: int
    waker_pid: int
    waker_tid: int
    waker_comm: str
    held_pid: int = 0
    held_tid: int = 0
    held_comm: str = ""


class PageFault(NamedTuple):
    """A traced thread waited in a page fault on a file mapping (an mmap'd file read from its device).

    One record per wait of at least the threshold; the waits of one fault share its ``start_ns`` (when the
    fault reached the file). ``end_ns``: when the thread came back from this wait (the fault completes
    microseconds after its last); ``wait_ns``: the time off CPU in this wait.
    ``obj``: the mapped file's path ("" when it could not be resolved); ``offset``: the faulting page's
    byte offset in the file; ``dev`` ("MAJ:MIN") and ``ino`` identify the file either way.
    """

    pid: int
    tid: int
    start_ns: int
    end_ns: int
    wait_ns: int
    obj: str
    offset: int
    dev: str
    ino: int


class InProgress(NamedTuple):
    """A traced thread caught waiting when the capture stopped: the syscall it was in and/or its off-CPU state.

    ``name``: the syscall ("syscall_N" for one gputrace does not trace, "" when in none); ``start_ns``: when
    that call (else the off-CPU span)
    began; ``at_ns``: when the capture stopped; ``state``: the task state it left the CPU in ("S", "D", ...;
    "" when it was on CPU or runnable); ``obj``: the call's file or peer, when its fd is known.
    ``before``: the call was already under way when it was first seen (a thread blocked since before tracing
    began): it started at or before ``start_ns``, the first moment it was seen.
    """

    pid: int
    tid: int
    name: str
    start_ns: int
    at_ns: int
    state: str
    obj: str
    before: bool


class IoUringRequest(NamedTuple):
    """One io_uring request of a traced process, from its submission to its completion (the CQE posted), at
    least the capture's threshold long. The work may have been done inline, by an interrupt's completion or
    by an io-wq worker thread of the process ("iou-wrk-TID"); ``tid`` is the thread that submitted it.

    ``op``: the opcode's name as the kernel prints it (READ, RECV, ...; ``OP_N`` for one this version does
    not know), ``opcode`` its number. ``res``: the completion's result (bytes, an fd, or -errno). ``fd``: the
    file's fd (-1 when unknown: a registered file, an op without one) and ``obj`` what it held when the
    request was submitted (path, peer), "" when unknown. ``nbytes``: ``res`` for ops that move bytes, else 0.
    ``ring_fd``: the io_uring_enter fd it was submitted through (-1: by the ring's SQPOLL thread).
    ``flags``: 1 a registered file, 2 IOSQE_ASYNC, 4 submitted by SQPOLL, 8 one completion of a multishot
    request with more to come (the next one starts where it ends), 16 still in flight when the capture stopped
    (``end_ns`` is the stop, ``res`` 0), 32 submitted with IOSQE_CQE_SKIP_SUCCESS. ``user_data``: the program's
    tag.
    """

    pid: int
    tid: int
    op: str
    start_ns: int
    end_ns: int
    res: int
    fd: int
    obj: str
    nbytes: int
    ring_fd: int
    flags: int
    opcode: int
    user_data: int


class DirtyPause(NamedTuple):
    """The kernel paused a traced thread for dirtying page cache faster than its device's writeback cleaned
    it (balance_dirty_pages): a timed sleep from just after ``ts``, inside the write() or page fault that
    dirtied the pages. ``pause_ns``: how long the kernel set it for (whole milliseconds). ``dev``: the device
    (its block device's name, else the kernel's name for it, "MAJ:MIN"). In bytes of page cache:
    ``wb_dirty`` dirty or under writeback for that device and ``wb_setpoint`` the level the kernel steers it
    to; ``dirty`` and ``limit`` of the whole dirty domain (the host, or the writer's memory cgroup).
    ``ratelimit``: bytes/s the kernel let the thread dirty at that point.
    """

    pid: int
    tid: int
    ts: int
    pause_ns: int
    dev: str
    wb_dirty: int
    wb_setpoint: int
    dirty: int
    limit: int
    ratelimit: int


class FileMap(NamedTuple):
    """The path of a file mapped by ``pid``, read from /proc/PID/maps when one of its pages was waited for."""

    ts: int
    pid: int
    dev: str
    ino: int
    path: str


# ------------------------------------------------------------------------------------------- GPU -----


class GpuDevice(NamedTuple):
    id: int
    name: str
    simulated: bool
    uuid: str
    pid: int


class GpuKernel(NamedTuple):
    pid: int
    device: int
    context: int
    stream: int
    start_ns: int
    end_ns: int
    correlation_id: int
    name: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]


class GpuMemcpy(NamedTuple):
    """``kind``: h2d, d2h, d2d, h2h, p2p (pageable/pinned noted in ``memory``)."""

    pid: int
    device: int
    context: int
    stream: int
    start_ns: int
    end_ns: int
    correlation_id: int
    nbytes: int
    kind: str
    memory: str


class GpuMemset(NamedTuple):
    pid: int
    device: int
    context: int
    stream: int
    start_ns: int
    end_ns: int
    correlation_id: int
    nbytes: int


class CudaApi(NamedTuple):
    """A CUDA runtime or driver API call on a host thread (``api``: runtime, driver, enqueue-only)."""

    pid: int
    tid: int
    name: str
    start_ns: int
    end_ns: int
    correlation_id: int
    api: str
    result: int


class GpuSync(NamedTuple):
    """A host wait for the device (``kind``: stream, context, event, stream_wait_event)."""

    pid: int
    tid: int
    device: int
    context: int
    stream: int
    start_ns: int
    end_ns: int
    correlation_id: int
    kind: str


class NvtxRange(NamedTuple):
    pid: int
    tid: int
    name: str
    start_ns: int
    end_ns: int
    domain: str


class Collective(NamedTuple):
    """Metadata of one collective operation on one rank, linked to its kernel by correlation id."""

    pid: int
    device: int
    correlation_id: int
    name: str
    seq: int
    rank: int
    world: int
    nbytes: int
    # The communicator every rank of the group shares (NCCL's unique id, the simulated group's id): with
    # ``seq`` it names one collective instance across processes and hosts. "" in captures from before.
    comm: str = ""


class CollectiveCall(NamedTuple):
    """One rank's call of a collective on the host (torch.distributed's all_reduce, broadcast, ...), recorded by
    the agent in the target: with ``comm`` and ``seq`` it names one collective instance across processes and
    hosts. ``start_ns``: the rank arrived (the call entered). ``end_ns``: the collective completed where the
    host sees it (gloo: the call returned, or an async op's work finished), else the call returned (NCCL: it
    enqueued the kernel, whose own record says when it ran). ``waited``: the calling thread was blocked in
    the call until completion (a synchronous gloo op): its time there waited for the others."""

    pid: int
    tid: int
    name: str
    comm: str
    seq: int
    rank: int
    world: int
    nbytes: int
    backend: str
    start_ns: int
    end_ns: int
    waited: bool


class NvmlSample(NamedTuple):
    """``metric``: gpu_util_pct, mem_util_pct, sm_clock_mhz, mem_used_bytes, power_mw, pcie_rx_bps, ..."""

    ts: int
    device: int
    metric: str
    value: float


class AgentInfo(NamedTuple):
    """An in-process GPU agent said hello. ``source``: cupti, sim, uprobe."""

    ts: int
    pid: int
    tid: int
    interpreter: str
    cuda_version: str
    driver_version: str
    source: str


class AgentThread(NamedTuple):
    """A thread of an in-process agent: everything it does is the tracing's, never the job's (the time it
    holds the target's GIL converting or sending records, its CPU). Sent once per thread, when it first
    works. ``role``: io (the agent's I/O thread: encodes and sends batches), cupti-flush (asks CUPTI for its
    completed buffers), cupti-convert (converts a completed CUPTI buffer: CUPTI's own thread, or the flusher).
    """

    ts: int
    pid: int
    tid: int
    role: str


# ------------------------------------------------------------------------------------- bookkeeping ---


class SourceStatus(NamedTuple):
    """``status``: started, degraded, missing, ended_early, stopped."""

    ts: int
    source: str
    status: str
    detail: str


class Drops(NamedTuple):
    """Cumulative records lost by ``source`` (``what`` says where: ringbuf, cupti, queue, ...)."""

    ts: int
    source: str
    what: str
    count: int  # type: ignore[assignment]  # a field, shadowing tuple.count by design


RECORD_TYPES: dict[str, type[Any]] = {
    cls.__name__: cls
    for cls in (
        ProcInfo, ThreadInfo, ProcFork, ProcExec, ProcExit, FdInfo, EpollEntry,
        Syscall, SyscallAgg, BlockIO, OffCpu, PageFault, FileMap, InProgress, IoUringRequest, DirtyPause,
        GpuDevice, GpuKernel, GpuMemcpy, GpuMemset, CudaApi, GpuSync, NvtxRange, Collective, CollectiveCall,
        NvmlSample,
        AgentInfo, AgentThread, SourceStatus, Drops,
    )
}  # fmt: skip

GPU_ACTIVITY = (GpuKernel, GpuMemcpy, GpuMemset)


def kind_of(record: tuple[Any, ...]) -> str:
    return type(record).__name__


# -------------------------------------------------------------------------------------- sampling ----


class StackSample(NamedTuple):
    """A traced thread was on CPU ``cpu`` at ``ts`` (a CPU-clock sample) running user stack ``stack``."""

    ts: int
    pid: int
    tid: int
    stack: int  # key of a StackFrames record of the same pid
    cpu: int = -1  # -1: not recorded (captures written before the field existed)


class StackFrames(NamedTuple):
    """The symbolized user stack ``stack`` of ``pid``, leaf first, each ``func (module)``; names come from
    the traced process's files (untrusted, capped in count and length)."""

    pid: int
    stack: int
    frames: list[str]


RECORD_TYPES.update({cls.__name__: cls for cls in (StackSample, StackFrames)})


# ---------------------------------------------------------------------------------- left out ----


class ProcLeftOut(NamedTuple):
    """A traced process gained privileges the capture's owner lacks (a setuid, setgid or setcap program, or one
    its user may not read), so from ``ts`` on nothing of it, nor of children it makes later, is in the capture.
    Only in captures made for a non-root owner (gputraced). ``filename``: the program it exec'd; "" when it
    was already privileged when tracing of it would have begun."""

    ts: int
    pid: int
    tid: int
    comm: str
    filename: str


RECORD_TYPES[ProcLeftOut.__name__] = ProcLeftOut


class TracingCost(NamedTuple):
    """What tracing has cost the host so far in this capture: CPU time (ns) since tracing began, summed.
    ``source``: ``ebpf``, ``sampler``, ``uprobe`` (their kernel programs' run time; ``runs``: how many times
    they ran), ``session`` (the capturing process), ``agent`` (the agent's own threads and work in traced
    process ``pid``)."""

    ts: int
    source: str
    cpu_ns: int
    runs: int = 0
    pid: int = 0


RECORD_TYPES[TracingCost.__name__] = TracingCost


# ------------------------------------------------------------------------------------- cpu cgroups ----


class CpuCgroup(NamedTuple):
    """The cpu cgroup traced process ``pid`` was seen in at ``ts`` (from /proc/PID/cgroup, its main thread's):
    recorded when the process is first seen and whenever it moves. ``path`` is the cgroup's path under the cpu
    controller's hierarchy as the host names it ("/kubepods/pod1/c2"); ``version`` 1 (the v1 cpu controller)
    or 2 (the unified hierarchy), 0 when no cpu cgroup was found. ``error``: why it could not be read ("": it
    was)."""

    ts: int
    pid: int
    path: str
    version: int
    error: str


class CpuThrottle(NamedTuple):
    """A sample of the CFS bandwidth of cpu cgroup ``path`` (version 1 or 2): its quota and period, and its
    cpu.stat counters as of ``ts``, recorded when first read and whenever they changed since the sample at
    ``prev_ts``, which still read as the record before this one did (so a change happened in (prev_ts, ts]).
    ``quota_us`` -1: no limit. ``nr_throttled`` counts periods in which the group was throttled and
    ``throttled_ns`` its time throttled (v1 throttled_time; v2 throttled_usec * 1000), added to when the
    group is let run again. ``error``: why a file of it could not be read ("": read; the counters are then 0).
    """

    ts: int
    prev_ts: int
    path: str
    version: int
    quota_us: int
    period_us: int
    nr_periods: int
    nr_throttled: int
    throttled_ns: int
    error: str


RECORD_TYPES.update({cls.__name__: cls for cls in (CpuCgroup, CpuThrottle)})
