"""Perfetto exporter: a capture → a .pftrace of TrackEvents on CLOCK_MONOTONIC, written as it streams.

Track layout (see docs/perfetto.md):

    process <comm>                      ProcessDescriptor
      thread <comm>                     ThreadDescriptor; syscall slices
        off-CPU                         off-CPU / runqueue slices; "woken by" child at the wakeup
        io_uring                        the thread's io_uring requests, submission to completion
        CUDA API, NVTX                  host-side GPU calls and ranges
        collectives                     the thread's collective calls (torch.distributed's), arrival to completion
      (CPU samples)                     PerfSample packets with interned callstacks: Perfetto's own
                                        per-thread sample track and flame graph
    GPU <id>: <name> [(simulated)]
      stream <n>                        kernels, copies, memsets
      sync                              host waits on the device
      stalls                            idle gaps named by cause (with a report)
      <nvml metric>                     counters
    block <dev>
      lane 0, lane 1, ...               block requests, never overlapping within a lane
    gputrace                            source states; drop counters

Flows: launch → kernel/copy (correlation id), waker → wakee, stall evidence → stall (a late rank's collective
call or kernel, and what held it back, into the waits it caused).

One job's captures from several hosts (``write_joined``): each capture is written by a run of its own, its
records moved onto the first capture's clock by the join's shift, its pids and tids moved to a span of their
own and its top-level tracks named by its host; the joined report's stalls come last, each on its capture's
device, with arrows from evidence on any host (a late rank's read, on its host, into the wait it caused).
"""

from __future__ import annotations

import contextlib
import gc
import os
import signal
import stat
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from operator import itemgetter
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, TypeVar, cast

from gputrace.analysis.attribute import collective_object
from gputrace.analysis.devices import SHARED, DeviceKey, ReportDevices
from gputrace.analysis.timefmt import size_text
from gputrace.capture import CaptureReader, records_of
from gputrace.documents import Report, Stall
from gputrace.errors import JobEnded, OutputError, UserError
from gputrace.exporters import ExportResult
from gputrace.exporters.perfetto import proto as pp
from gputrace.exporters.perfetto.args import activity_fields, header_int, stall_args, unit_of, uring_flags
from gputrace.exporters.perfetto.canvas import Canvas
from gputrace.exporters.perfetto.links import CaptureLinks, FlowIds, LaunchMatcher, StallLinks, evidence_key
from gputrace.exporters.perfetto.samples import CpuSamples, StackInterner
from gputrace.exporters.perfetto.tracks import ID_SPAN, LaneSet, PacketSink, Tracks
from gputrace.forked import ended_how, quiet_child, receive_last, send
from gputrace.probes.ebpf import uring
from gputrace.records import (
    RECORD_TYPES,
    AgentInfo,
    AgentThread,
    BlockIO,
    Collective,
    CollectiveCall,
    CpuCgroup,
    CpuThrottle,
    CudaApi,
    DirtyPause,
    Drops,
    GpuDevice,
    GpuKernel,
    GpuMemcpy,
    GpuMemset,
    GpuSync,
    InProgress,
    IoUringRequest,
    NvmlSample,
    NvtxRange,
    OffCpu,
    PageFault,
    ProcExec,
    ProcExit,
    ProcFork,
    ProcInfo,
    SourceStatus,
    StackFrames,
    StackSample,
    Syscall,
    ThreadInfo,
    TracingCost,
)
from gputrace.signals import held

if TYPE_CHECKING:
    from gputrace.analysis.join import Joined

_CAT = {c: pp.category(c) for c in ("syscall", "sched", "block", "gpu", "cuda", "nvtx", "collective", "stall",
                                    "process")}
_CAT_SYSCALL, _CAT_SCHED, _CAT_BLOCK, _CAT_GPU, _CAT_CUDA = (_CAT[c] for c in ("syscall", "sched", "block", "gpu",
                                                                              "cuda"))
# Known kinds not placed on the timeline: fd and mapped-file paths (and what epoll data words stand for) are
# already on the syscalls and faults, aggregates are in the report. Counted in ``not_drawn`` but not noted:
# they are expected in every capture.
_NOT_DRAWN = {"FdInfo", "EpollEntry", "SyscallAgg", "FileMap"}
_COLLECTIVE_CAP = 10_000
# Captures one joined trace holds: each takes a span of ID_SPAN pids, and Perfetto's pids are 32-bit.
MAX_JOINED = (1 << 31) // ID_SPAN - 1
# Record fields that are times on the capture's clock (a joined trace shifts them onto the first capture's);
# in the second set 0 means "not seen" and stays 0.
_TIME_FIELDS = frozenset({"ts", "start_ns", "end_ns", "issue_ns", "complete_ns", "at_ns", "wake_ns", "prev_ts"})
_ZERO_IS_NONE = frozenset({"wake_ns", "prev_ts"})
_time_index: dict[type, tuple[tuple[int, bool], ...]] = {}
_MALFORMED = (TypeError, ValueError, AttributeError, OverflowError, IndexError)  # what a broken record raises

# Encoders of the annotations on the records drawn most, each giving the bytes pp.debug_args writes for its
# field; those of fields whose values recur (ids, sizes) keep each value's bytes.
_OBJ, _STATE, _COMM, _RWBS, _API = (pp.str_arg(n) for n in ("obj", "state", "comm", "rwbs", "api"))
_WAKER_COMM, _FROM_COMM = pp.str_arg("waker_comm"), pp.str_arg("cpu_from_comm")
_NBYTES, _RET, _FD, _ARG, _PID, _TID, _BYTES, _RESULT = (
    pp.int_arg(n, recurring=True) for n in ("nbytes", "ret", "fd", "arg", "pid", "tid", "bytes", "result"))
_WAKER_PID, _WAKER_TID, _FROM_PID, _FROM_TID, _WAKEE_PID, _WAKEE_TID = (
    pp.int_arg(n, recurring=True) for n in ("waker_pid", "waker_tid", "cpu_from_pid", "cpu_from_tid", "wakee_pid",
                                            "wakee_tid"))
_WAKE_NS, _SECTOR, _LATENCY, _CORRELATION = (pp.int_arg(n) for n in ("wake_ns", "sector", "latency_ns",
                                                                    "correlation_id"))
_CACHE_MAX = 1 << 14
_I64_MAX = (1 << 63) - 1
_K = TypeVar("_K")
_V = TypeVar("_V")


def _keep(cache: dict[_K, _V], key: _K, value: _V) -> _V:
    """``value``, kept in ``cache`` under ``key``; a cache of _CACHE_MAX entries is emptied first."""
    if len(cache) >= _CACHE_MAX:
        cache.clear()
    cache[key] = value
    return value

_WAKER_FIELDS = itemgetter(6, 7, 8)  # an OffCpu row's waker: pid, tid, comm
_THREAD_FIELDS = itemgetter(0, 1, 2)  # a BlockIO row's thread: pid, tid, comm


def _ignore(_: Any) -> None:
    """A record, or a frame's rows, that the other part of a trace drawn in two parts draws."""


def _quietly(fn: Callable[[Any], None]) -> Callable[[Any], None]:
    """``fn``, which notes names only, with a malformed record let go: the part that draws it counts it."""
    def noted(r: Any) -> None:
        with contextlib.suppress(*_MALFORMED):
            fn(r)
    return noted


def _clamped(s: Any, e: Any) -> tuple[int, int]:
    """``Canvas.span`` without counting a span fixed (the part that draws it counts it)."""
    s, e = pp.clamp_ts(s), pp.clamp_ts(e)
    return s, max(s, e)


# A frame's rows: lists of exactly their kind's fields, each of its declared type (capture.exact_columns), or
# the records themselves.
Rows = Sequence[Sequence[Any]]
_NO_HOLDER = (0, 0, "")  # an OffCpu row of a capture made before its held_* fields: their defaults
_SHORT_ROWS = frozenset({"OffCpu"})  # kinds whose row handlers also take such older, shorter rows


# The kinds the kernel part of a trace written in two parts draws (``PerfettoExporter`` with ``jobs``): the kernel
# probes' records, whose tracks and lanes (a thread's syscalls, off-CPU time, io_uring requests and dirty pauses;
# block devices) nothing else draws on. The other part draws the rest.
KERNEL_KINDS: tuple[type, ...] = (Syscall, OffCpu, BlockIO, PageFault, InProgress, IoUringRequest, DirtyPause)
KERNEL_PART, REST_PART = "kernel", "rest"
PARALLEL_MIN_BYTES = 8 << 20  # a smaller capture is drawn in one process: a second would cost more than it saves
_KERNEL_FLOWS = 1 << 48  # the kernel part's own flow ids (wakeups) start here; the other part's stay below
_KERNEL_TRACKS = 1 << 24  # likewise its own tracks' uuids (off-CPU, io_uring and block lanes), below SHARED_UUIDS


class PerfettoExporter:
    """Writes one Perfetto trace from a capture in a single streaming pass (bounded memory).

    With ``jobs`` above one, a capture file of ``parallel_min_bytes`` or more is drawn by two processes at once:
    this one, and one forked from it that reads the same file and draws the kernel probes' records (KERNEL_KINDS)
    into a file of its own, appended to the trace once both are done. Both name every process and thread alike
    (each notes the names the other's records give), give a process or thread track the uuid of its key
    (``Tracks``' hashed uuids), and the stall report's arrows the same ids; each part's own tracks and arrows take
    ids of their own. The trace holds what one process would write, its packets in another order (the kernel
    part's last) and some descriptors twice (a thread's, by both parts)."""

    def __init__(self, out_path: str | os.PathLike[str], *, report: Report | None = None,
                 pending_cap: int = 50_000, jobs: int = 1, parallel_min_bytes: int | None = None) -> None:
        """``parallel_min_bytes``: the smallest capture file drawn in two parts (None: PARALLEL_MIN_BYTES)."""
        self.out_path = Path(out_path)
        self.report = report
        self.pending_cap = pending_cap
        self.jobs = jobs
        self.parallel_min_bytes = PARALLEL_MIN_BYTES if parallel_min_bytes is None else parallel_min_bytes
        self.parts = 1  # processes that drew the last trace written

    def write(self, reader: CaptureReader) -> ExportResult:
        """Write the trace, under a temporary name renamed into place: a failed write (a full disk) leaves
        nothing behind and is an OutputError naming the file (write() errors carry no name); the reader's own
        errors pass through as they are."""
        self.parts = 2 if self.jobs > 1 and self._parallel(reader) else 1
        if self.parts == 2:
            return self._to_file(lambda sink: self._two_parts(sink, reader))
        return self._to_file(lambda sink: self._whole(sink, reader))

    def _whole(self, sink: PacketSink, reader: CaptureReader) -> list[str]:
        """The trace drawn by this process alone; its notes."""
        run = _Run(sink, reader.header, self.report, self.pending_cap)
        run.start()
        run.feed_reader(reader)
        run.finish()
        return run.notes(reader)

    def _parallel(self, reader: CaptureReader) -> bool:
        """Whether ``reader`` is a capture file large enough to be drawn in two parts."""
        if not isinstance(reader, CaptureReader):
            return False
        try:
            st = os.fstat(reader.fileno())
        except (OSError, ValueError):
            return False
        return stat.S_ISREG(st.st_mode) and st.st_size >= self.parallel_min_bytes

    def _two_parts(self, sink: PacketSink, reader: CaptureReader) -> list[str]:
        """The trace drawn by this process and, at once, its kernel part by one forked from it (see the class);
        that part's file is made here, before the fork, and removed whatever happens."""
        part = self.out_path.with_name(f".{self.out_path.name}.{os.getpid()}.kernel.partial")
        pid, r, fd = 0, -1, -1
        try:
            with held():  # (a stop signal is delivered once ``fd`` names the file, which is then removed)
                fd = _create_new(part, self.out_path)
            r, w = os.pipe()
            parent = os.getpid()
            try:
                pid = os.fork()
            except OSError:  # (no process to be had: EAGAIN, ENOMEM) drawn here alone, as with --jobs 1
                os.close(w)
                self.parts = 1
                return self._whole(sink, reader)
            if pid == 0:  # (the child: never returns)
                os.close(r)
                self._kernel_part(reader, fd, w, parent)
            os.close(w)
            run = _Run(sink, reader.header, self.report, self.pending_cap, role=REST_PART)
            run.start()
            run.feed_reader(reader)
            result = receive_last(r)  # (read to the end: the child has exited or closed its end)
            status = os.waitpid(pid, 0)[1]
            pid = 0
            if isinstance(result, str):
                raise UserError(f"the process drawing the trace's kernel records failed: {result}")
            if not isinstance(result, dict):
                raise JobEnded("the process drawing the trace's kernel records ended without them "
                               f"({ended_how(status)}); --jobs 1 draws the whole trace in this process")
            run.merge_part(result)
            run.finish()
            with open(f"/proc/self/fd/{fd}", "rb") as f:  # (made write-only: opened again to be read)
                sink.append(f, result["packets"])
            return run.notes(reader)
        finally:
            if pid:  # failed or interrupted here: the other part is of no use
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                with contextlib.suppress(ChildProcessError):
                    os.waitpid(pid, 0)
            if r >= 0:
                os.close(r)
            if fd >= 0:  # (else the file is not ours, or was never made)
                os.close(fd)
                part.unlink(missing_ok=True)

    def _kernel_part(self, reader: CaptureReader, fd: int, w: int, parent: int) -> None:
        """The forked process: the kernel part of the trace drawn into ``fd`` from the capture ``reader`` reads
        (opened again: the file's offset is the other process's), what the other part needs of it sent on ``w``
        (an error as its text), then gone."""
        code = 1
        try:
            quiet_child(parent, nice=0)  # (at the export's own priority: it waits for this part)
            with CaptureReader(f"/proc/self/fd/{reader.fileno()}") as own, \
                    open(fd, "wb", buffering=1 << 20, closefd=False) as f:
                sink = PacketSink(_Named(f, self.out_path))
                run = _Run(sink, own.header, self.report, self.pending_cap, role=KERNEL_PART)
                run.feed_reader(own)
                sink.flush()
                with _writing(self.out_path):
                    f.flush()
                send(w, run.part_result())
            code = 0
        except BaseException as e:
            with contextlib.suppress(BaseException):
                send(w, str(e) or type(e).__name__)
        finally:
            os._exit(code)

    def write_joined(self, readers: Sequence[CaptureReader], names: Sequence[str], joined: Joined) -> ExportResult:
        """One trace of a job's captures from several hosts, on the joined report's clock (``joined``:
        gputrace.analysis.join.join of the same readers, in the same order)."""
        if len(readers) > MAX_JOINED:
            raise UserError(f"{len(readers)} captures given; one Perfetto trace holds at most {MAX_JOINED}")
        report, parts = joined.report, joined.parts
        rows = report.get("captures", [])
        if len(parts) != len(readers) or len(rows) != len(readers):
            raise ValueError("the joined report is not of these captures")
        hosts = [str(row.get("host", "")) for row in rows]
        labels = _labels(hosts, names)
        cap_of = {id(st): i for i, part in enumerate(parts) for st in part.get("stalls", [])}

        def locate(stall: Stall, ev: Any) -> int:
            own = cap_of.get(id(stall), -1)
            host = ev.get("host") if isinstance(ev, dict) else None
            if own < 0 or not isinstance(host, str) or not host:
                return own  # untagged evidence is the stall's own capture's
            # tagged evidence is another capture's (a late rank's), even where two hosts share a name
            others = [j for j, h in enumerate(hosts) if h == host and j != own]
            return others[0] if others else (own if hosts[own] == host else -1)

        def body(sink: PacketSink) -> list[str]:
            flows = FlowIds()
            links = StallLinks(report, flows, locate)
            interner = StackInterner()  # interned ids belong to the trace's one sequence, not to a capture
            runs: list[_Run] = []
            notes: list[str] = []
            for i, reader in enumerate(readers):
                shift = rows[i].get("shift_ns", 0)
                part = _Part(i, shift if type(shift) is int else 0, labels[i], flows, links, interner)
                run = _Run(sink, reader.header, parts[i], self.pending_cap, part=part)
                if i == 0:  # every capture is on the first's clock: its snapshot places them all
                    run.start()
                run.feed(reader.records())
                run.finish()
                runs.append(run)
                notes += [f"{names[i]}: {n}" for n in run.notes(reader)]
            for k, st in enumerate(links.stalls):
                i = cap_of.get(id(st), -1)
                if i >= 0:
                    runs[i].guarded(runs[i].write_stall, st, links.flows_of(k))
            if links.malformed:
                notes.append(f"{links.malformed} malformed stall(s) in the report skipped")
            if links.unmatched:
                notes.append(f"{links.unmatched} stall evidence entr(ies) matched no slice: no flow")
            return notes

        return self._to_file(body)

    def _to_file(self, body: Callable[[PacketSink], list[str]]) -> ExportResult:
        tmp = self.out_path.with_name(f".{self.out_path.name}.{os.getpid()}.partial")
        f = None
        try:
            # A stop signal (its handler raises) must not land between the file's creation and ``f`` naming it:
            # held until then, it is delivered here, inside the try that removes the file.
            with held():
                fd = _create_new(tmp, self.out_path)
                f = open(fd, "wb", buffering=1 << 20)  # noqa: SIM115 - closed below, its errors named
            sink = PacketSink(_Named(f, self.out_path))
            with _gc_paused():
                notes = body(sink)
            sink.flush()
            with _writing(self.out_path):
                f.flush()
                os.fsync(f.fileno())
                f.close()
                os.replace(tmp, self.out_path)
        except BaseException:
            if f is not None:  # else the file is not ours (it existed) or was never made
                with contextlib.suppress(OSError):  # flushing the rest fails again: the first error is the one told
                    f.close()
                tmp.unlink(missing_ok=True)
            raise
        return ExportResult(target=str(self.out_path), items=sink.count, notes=notes)


def _labels(hosts: list[str], names: Sequence[str]) -> list[str]:
    """What each capture's tracks are named by: its host, and its file too where hosts share a name."""
    out = [h or str(n) for h, n in zip(hosts, names, strict=True)]
    return [f"{lab} [{n}]" if out.count(lab) > 1 else lab for lab, n in zip(out, names, strict=True)]


@dataclass
class _Part:
    """What sets one capture of a joined trace apart, and what its runs share."""

    index: int
    shift_ns: int
    host: str
    flows: FlowIds
    links: StallLinks
    interner: StackInterner


def _on_clock(rec: tuple[Any, ...], by: int) -> tuple[Any, ...]:
    """A record with its times moved by ``by`` (fields of the wrong type are left for its handler to refuse)."""
    t = type(rec)
    idx = _time_index.get(t)
    if idx is None:
        fields = getattr(t, "_fields", ())
        idx = _time_index[t] = tuple((i, f in _ZERO_IS_NONE) for i, f in enumerate(fields) if f in _TIME_FIELDS)
    if not idx:
        return rec
    values = list(rec)
    for i, zero_is_none in idx:
        v = values[i]
        if type(v) is int and not (zero_is_none and v == 0):
            values[i] = v + by
    return t._make(values)  # type: ignore[attr-defined, no-any-return]


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """The cyclic garbage collector paused while the trace is drawn, and resumed as it was. The export makes no
    reference cycles (what it reads and writes is freed by reference counting as it goes, so memory stays flat),
    but the capture's rows are millions of short-lived containers, and the collections they set off took about a
    tenth of the export's time."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


@contextlib.contextmanager
def _writing(out: Path) -> Iterator[None]:
    try:
        yield
    except OSError as e:
        raise OutputError(out, e) from None


class _Named:
    """The output file, its write errors named after the trace being written."""

    def __init__(self, f: BinaryIO, out: Path) -> None:
        self._f, self._out = f, out

    def write(self, data: bytes) -> int:
        with _writing(self._out):
            return self._f.write(data)


def _create_new(path: Path, out: Path) -> int:
    """A fresh file at ``path``: never an existing one, nor one a symlink planted there points to."""
    try:
        return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    except FileExistsError:
        raise UserError(f"{path} exists (an earlier export was cut off, or planted); remove it") from None
    except OSError as e:  # a full directory or inode table; a permission check lost since
        raise OutputError(out, e) from None


class _Run(Canvas):
    """The state of one export: tracks, lanes and pending flow ends — nothing per event."""

    def __init__(self, sink: PacketSink, header: dict[str, Any], report: Report | None,
                 pending_cap: int, *, part: _Part | None = None, role: str = "") -> None:
        """``role``: KERNEL_PART or REST_PART, for one of the two processes drawing a trace at once
        (``PerfettoExporter``); "" to draw all of it."""
        tracks = None
        if part is not None:  # 2^32 uuids a capture: no two captures' tracks meet
            tracks = Tracks(sink, uuid_base=part.index << 32, id_base=part.index * ID_SPAN, host=part.host)
        elif role:  # the parts' own tracks apart: the kernel part's from 2^24 (4-byte varints)
            tracks = Tracks(sink, hashed=True, uuid_base=_KERNEL_TRACKS if role == KERNEL_PART else 0)
        super().__init__(sink, tracks)
        self.header = header
        self.flows = part.flows if part is not None else FlowIds()
        self.stall_links: StallLinks | CaptureLinks = (
            CaptureLinks(part.links, part.index) if part is not None else StallLinks(report, self.flows))
        self.shift_ns = part.shift_ns if part is not None else 0
        self.launches = LaunchMatcher(self.flows, pending_cap)
        self.samples = CpuSamples(sink.put, self.tracks.thread, pending_cap,
                                  interner=part.interner if part is not None else None, ids=self.tracks.perfetto_id,
                                  put_framed=sink.put_framed)
        self.report = report
        self.devices = ReportDevices(report)
        self.collectives: dict[tuple[int, int], Collective] = {}
        self.skipped: dict[str, int] = {}
        self.not_drawn: dict[str, int] = {}
        self.malformed = 0
        self.cost_seen: dict[tuple[str, int], tuple[int, int]] = {}  # (source, pid) -> last (ts, cpu_ns)
        self._block_names: dict[tuple[str, int], bytes] = {}
        self._offcpu_names: dict[str, bytes] = {}  # task state -> its slices' name and category
        self._streams: dict[tuple[int, int, int], LaneSet] = {}  # (pid, CUDA id, stream) -> its lanes
        self.handlers: dict[type, Any] = {
            ProcInfo: self.proc_info, ThreadInfo: self.thread_info, ProcFork: self.fork, ProcExec: self.exec,
            ProcExit: self.exit, Syscall: self.syscall, OffCpu: self.offcpu, BlockIO: self.block,
            PageFault: self.page_fault, InProgress: self.in_progress, IoUringRequest: self.uring_request,
            DirtyPause: self.dirty_pause,
            GpuDevice: self.gpu_device, GpuKernel: self.activity, GpuMemcpy: self.activity,
            GpuMemset: self.activity, CudaApi: self.cuda_api, GpuSync: self.gpu_sync, NvtxRange: self.nvtx,
            Collective: self.collective, CollectiveCall: self.collective_call, NvmlSample: self.nvml,
            AgentInfo: self.agent,
            SourceStatus: self.source_status, Drops: self.drops, CpuThrottle: self.cpu_throttle,
            CpuCgroup: self.cpu_cgroup, TracingCost: self.tracing_cost, AgentThread: self.agent_thread,
            StackSample: self.samples.sample, StackFrames: self.samples.frames,
        }
        # The kinds most records are, drawn a frame at a time from their rows as read (feed_reader): the same
        # packets as their handlers above write, with each frame's lookups made once and what recurs kept encoded.
        self.row_handlers: dict[str, Callable[[Rows], None]] = {
            "Syscall": self.syscall_rows, "OffCpu": self.offcpu_rows, "BlockIO": self.block_rows,
            "CudaApi": self.cuda_api_rows, "GpuKernel": self.activity_rows(GpuKernel),
            "GpuMemcpy": self.activity_rows(GpuMemcpy), "GpuMemset": self.activity_rows(GpuMemset),
            "StackSample": self.samples.sample_rows,
        }
        self._syscall_slices: dict[tuple[Any, ...], pp.SliceTemplate] = {}
        self._offcpu_slices: dict[tuple[int, bytes], pp.SliceTemplate] = {}
        self._block_heads: dict[tuple[Any, ...], tuple[bytes, bytes]] = {}
        self._offcpu_heads: dict[tuple[Any, ...], bytes] = {}
        self._held: dict[tuple[Any, ...], bytes] = {}
        self._wake_heads: dict[tuple[int, int], bytes] = {}
        self._woken_heads: dict[tuple[Any, ...], bytes] = {}
        self._api_parts: dict[tuple[str, str, int], tuple[bytes, bytes]] = {}  # a launch's name, api and result
        self._kernel_heads: dict[tuple[Any, ...], tuple[bytes, bytes]] = {}
        if role == KERNEL_PART:
            self._draw_kernel_part()
        elif role == REST_PART:
            self._draw_rest_part()

    # -- a trace drawn in two parts -------------------------------------------------------------------

    def _draw_kernel_part(self) -> None:
        """Draw the kernel probes' records alone (KERNEL_KINDS), and note the names of processes and threads that
        the others give; any other record is the other part's, to draw and to count."""
        full: dict[type, Any] = {cls: self.handlers[cls] for cls in KERNEL_KINDS}
        names = {ProcInfo: _quietly(self.proc_info), ThreadInfo: _quietly(self.thread_info),
                 ProcFork: _quietly(self._fork_names), ProcExec: _quietly(self._exec_names)}
        self.handlers = {**dict.fromkeys(RECORD_TYPES.values(), _ignore), **names, **full}
        kinds = {cls.__name__ for cls in KERNEL_KINDS}
        self.row_handlers = {k: h if k in kinds else _ignore for k, h in self.row_handlers.items()}
        self.flows.skip_to(_KERNEL_FLOWS)
        assert isinstance(self.stall_links, StallLinks)
        self._evidence = self.stall_links.pending()

    def _draw_rest_part(self) -> None:
        """Draw every record but the kernel probes', whose part notes only the threads' names they give."""
        self.handlers.update(dict.fromkeys(KERNEL_KINDS, _ignore))
        self.handlers.update({OffCpu: _quietly(self._offcpu_wakers), BlockIO: _quietly(self._block_threads)})
        self.row_handlers.update({"Syscall": _ignore, "OffCpu": self._offcpu_wakers_rows,
                                  "BlockIO": self._block_threads_rows})

    def part_result(self) -> dict[str, Any]:
        """What the kernel part tells the other once drawn: its packets, what it could not draw, and the stall
        evidence it found the slices of."""
        assert isinstance(self.stall_links, StallLinks)
        return {"packets": self.sink.count, "malformed": self.malformed, "fixed": self.fixed,
                "taken": sorted(self._evidence - self.stall_links.pending())}

    def merge_part(self, result: dict[str, Any]) -> None:
        """The kernel part's ``part_result``, taken into this one's counts and stall arrows."""
        self.malformed += result["malformed"]
        self.fixed += result["fixed"]
        assert isinstance(self.stall_links, StallLinks)
        self.stall_links.take_entries(result["taken"])

    def _fork_names(self, r: ProcFork) -> None:
        if r.is_thread:
            self.tracks.note_thread(r.child_pid, r.child_tid, r.comm)
        else:
            self.tracks.note_process(r.child_pid, r.comm)

    def _exec_names(self, r: ProcExec) -> None:
        self.tracks.note_process(r.pid, r.comm)
        self.tracks.note_thread(r.pid, r.tid, r.comm)

    def _offcpu_wakers(self, r: OffCpu) -> None:
        s, e = _clamped(r.start_ns, r.end_ns)
        if r.wake_ns and s <= r.wake_ns <= e and r.waker_tid:
            self.tracks.name_waker(r.waker_pid, r.waker_tid, r.waker_comm)

    def _offcpu_wakers_rows(self, rows: Rows) -> None:
        """``offcpu_rows``' naming of the threads that woke others, alone: nothing where every waker of the frame
        is known by its name already, as they mostly are."""
        settled = self.tracks.settled_waker
        if all(not tid or settled(pid, tid, comm) for pid, tid, comm in set(map(_WAKER_FIELDS, rows))):
            return
        for row in rows:
            start, end, wake_ns, waker_tid = row[2], row[3], row[5], row[7]
            s, e = (start, end) if 0 <= start <= end <= _I64_MAX else _clamped(start, end)
            if wake_ns and s <= wake_ns <= e and waker_tid:
                self.tracks.name_waker(row[6], waker_tid, row[8])

    def _block_threads(self, r: BlockIO) -> None:
        _clamped(r.issue_ns, r.complete_ns)  # (raises where ``block`` would, before it names the thread)
        self.tracks.refresh_comm(r.pid, r.tid, r.comm)

    def _block_threads_rows(self, rows: Rows) -> None:
        """``block_rows``' naming of the threads whose requests they are, alone."""
        names = self.tracks.thread_name
        if all(not comm or names.get((pid, tid)) == comm for pid, tid, comm in set(map(_THREAD_FIELDS, rows))):
            return
        for pid, tid, comm, *_ in rows:
            if comm and names.get((pid, tid)) != comm:
                self.tracks.refresh_comm(pid, tid, comm)

    # -- frame ----------------------------------------------------------------------------------------

    def start(self) -> None:
        mono = header_int(self.header, "start_ns")
        real = mono + header_int(self.header, "mono_to_realtime_ns")
        boot = mono + header_int(self.header, "mono_to_boottime_ns")
        self.put(pp.clock_snapshot(mono, real, boot))
        self.put(pp.sequence_start())

    def record(self, rec: tuple[Any, ...]) -> None:
        self.feed((rec,))

    def feed_reader(self, reader: CaptureReader) -> None:
        """Draw a capture's records: a frame of a kind in ``row_handlers`` whose rows are exactly typed
        (``CaptureReader.batches``' ``exact``) goes to its row handler as read, any other record to ``feed``. A
        joined capture's records, moved onto another clock, and a reader that gives no frames go to ``feed``."""
        batches = getattr(reader, "batches", None)
        fast = self.row_handlers
        if batches is None or not fast or self.shift_ns:
            self.feed(reader.records())
            return
        for batch in batches(exact=frozenset(fast)):
            rows, kind = batch.records, batch.kind
            handler = fast.get(kind) if batch.columns is not None else None
            if handler is None:
                self.feed(rows)
            elif len(rows[0]) != len(RECORD_TYPES[kind]._fields) and kind not in _SHORT_ROWS:
                # an older capture's rows: the records hold the fields they lack at their defaults
                self.feed(records_of(kind, rows))
            else:
                handler(rows)
                self.sink.spill()

    def feed(self, records: Iterable[tuple[Any, ...]]) -> None:
        """Draw each record (the exporter's inner loop: its lookups made once, not per record)."""
        get = self.handlers.get
        shift = self.shift_ns
        for rec in records:
            handler = get(type(rec))
            if handler is None:
                kind = type(rec).__name__
                bucket = self.not_drawn if kind in _NOT_DRAWN else self.skipped
                bucket[kind] = bucket.get(kind, 0) + 1
                continue
            if shift:
                rec = _on_clock(rec, shift)
            try:
                handler(rec)
            except _MALFORMED:  # as in guarded()
                self.malformed += 1

    def finish(self) -> None:
        for rec, flow in self.launches.drain():
            self.guarded(self._write_gpu, rec, flow)
        self.samples.finish()
        self._write_stalls()

    def guarded(self, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except _MALFORMED:
            # Fields of the wrong type (a broken or hostile agent). Handlers encode a record's packets
            # before writing them, so a record lands whole or not at all.
            self.malformed += 1

    def notes(self, reader: CaptureReader) -> list[str]:
        notes = []
        if not reader.complete:
            notes.append(f"capture incomplete: {reader.problem or 'records were lost'}; exported what was readable")
        notes += [f"skipped {n} {kind} record(s): not known to the Perfetto exporter"
                  for kind, n in sorted(self.skipped.items())]
        malformed = self.malformed + self.samples.malformed
        if malformed:
            notes.append(f"skipped {malformed} malformed record(s) (fields of the wrong type)")
        if self.fixed:
            notes.append(f"{self.fixed} record(s) ended before they began; drawn with zero duration")
        if self.launches.unmatched:
            notes.append(f"{self.launches.unmatched} launch/GPU record(s) without their other end: no flow")
        if self.stall_links.malformed:
            notes.append(f"{self.stall_links.malformed} malformed stall(s) in the report skipped")
        if self.stall_links.unmatched:
            notes.append(f"{self.stall_links.unmatched} stall evidence entr(ies) matched no slice: no flow")
        return notes + self.samples.notes()

    # -- processes ------------------------------------------------------------------------------------

    def proc_info(self, r: ProcInfo) -> None:
        self.tracks.note_process(r.pid, r.comm, list(r.cmdline or []))

    def thread_info(self, r: ThreadInfo) -> None:
        self.tracks.note_thread(r.pid, r.tid, r.comm)

    def fork(self, r: ProcFork) -> None:
        if r.is_thread:
            self.tracks.note_thread(r.child_pid, r.child_tid, r.comm)
            what = f"clone → tid {r.child_tid}"
        else:
            self.tracks.note_process(r.child_pid, r.comm)
            what = f"fork → pid {r.child_pid}"
        self.instant(self.tracks.thread(r.parent_pid, r.parent_tid), r.ts, what, _CAT["process"],
                     {"child_pid": r.child_pid, "child_tid": r.child_tid})

    def exec(self, r: ProcExec) -> None:
        self.tracks.note_process(r.pid, r.comm)
        self.tracks.note_thread(r.pid, r.tid, r.comm)  # exec renames the thread too (a launcher's fork)
        self.instant(self.tracks.thread(r.pid, r.tid), r.ts, f"exec {r.filename}", _CAT["process"], {})

    def exit(self, r: ProcExit) -> None:
        self.instant(self.tracks.thread(r.pid, r.tid), r.ts, "exit", _CAT["process"], {})

    # -- kernel ---------------------------------------------------------------------------------------

    def evidence(self, kind: str, pid: int, tid: int, start_ns: int) -> list[int]:
        """Flow ids into the stalls whose evidence is the slice being written (none without a report)."""
        links = self.stall_links
        return links.take(evidence_key(kind, pid, tid, start_ns)) if links.waiting else []

    def syscall(self, r: Syscall) -> None:
        s, e = self.span(r.start_ns, r.end_ns)
        lane = self.thread_lanes(r.pid, r.tid, "").place(s, e)
        flows = self.evidence("syscall", r.pid, r.tid, r.start_ns)
        fields = b"".join((pp.event_name(r.name), _CAT_SYSCALL, _OBJ(r.obj) if r.obj else b"", _NBYTES(r.nbytes),
                           _RET(r.ret), _FD(r.fd), _ARG(r.arg), pp.flow_ids(flows) if flows else b""))
        self.put_framed(pp.framed_slice(s, e, lane.uuid, fields), 2)

    def syscall_rows(self, rows: Rows) -> None:
        """``syscall()`` of each row: each distinct call on each thread track is encoded once
        (``pp.slice_template``) and framed around its times; a call that is stall evidence the plain way."""
        out, lanes, links, templates = self.sink.buf, self.lanes, self.stall_links, self._syscall_slices
        packets = 0
        for row in rows:
            try:
                pid, tid, name, start, end, ret, fd, obj, nbytes, arg = row
                s, e = (start, end) if 0 <= start <= end <= _I64_MAX else self.span(start, end)
                lane = (lanes.get(("tl", pid, tid, "")) or self.thread_lanes(pid, tid, "")).place(s, e)
                flows = links.take(evidence_key("syscall", pid, tid, start)) if links.waiting else None
                if flows:
                    fields = self._syscall_fields(name, ret, fd, obj, nbytes, arg) + pp.flow_ids(flows)
                    out += pp.framed_slice(s, e, lane.uuid, fields)
                else:
                    key = (lane.uuid, name, ret, fd, obj, nbytes, arg)
                    t = templates.get(key)
                    if t is None:
                        t = _keep(templates, key,
                                  pp.slice_template(lane.uuid, self._syscall_fields(name, ret, fd, obj, nbytes, arg)))
                    out += pp.framed_slice_of(s, e, t)
                packets += 2
            except _MALFORMED:
                self.malformed += 1
        self.sink.count += packets

    @staticmethod
    def _syscall_fields(name: str, ret: int, fd: int, obj: str, nbytes: int, arg: int) -> bytes:
        """A syscall slice's name, category and annotations, encoded."""
        return b"".join((pp.event_name(name), _CAT_SYSCALL, _OBJ(obj) if obj else b"", _NBYTES(nbytes), _RET(ret),
                         _FD(fd), _ARG(arg)))

    def page_fault(self, r: PageFault) -> None:
        """On the syscall lane: the thread is in the kernel, waiting for a mapped file's page."""
        s, e = self.span(r.start_ns, r.end_ns)
        lane = self.thread_lanes(r.pid, r.tid, "").place(s, e)
        args: dict[str, Any] = {"obj": r.obj or f"inode {r.ino} on {r.dev}", "offset": r.offset, "wait_ns": r.wait_ns}
        # the report names a fault's wait as offcpu evidence starting where the fault does
        flows = self.evidence("offcpu", r.pid, r.tid, r.start_ns)
        self.slice(lane.uuid, s, e, "page fault", _CAT["syscall"], args, flows)

    def dirty_pause(self, r: DirtyPause) -> None:
        """On the thread's "dirty pages" track: the pause the kernel set (its sleep is on the off-CPU track)."""
        s, e = self.span(r.ts, r.ts + r.pause_ns)
        lane = self.thread_lanes(r.pid, r.tid, "dirty pages").place(s, e)
        args = {"dev": r.dev, "pause_ns": r.pause_ns, "wb_dirty": r.wb_dirty, "wb_setpoint": r.wb_setpoint,
                "dirty": r.dirty, "limit": r.limit, "ratelimit_bps": r.ratelimit}
        flows = self.evidence("dirty", r.pid, r.tid, r.ts)
        self.slice(lane.uuid, s, e, f"paused for dirty pages on {r.dev}", _CAT["syscall"], args, flows)

    def uring_request(self, r: IoUringRequest) -> None:
        """On the submitting thread's "io_uring" track: requests overlap each other and the thread's calls."""
        s, e = self.span(r.start_ns, r.end_ns)
        lane = self.thread_lanes(r.pid, r.tid, "io_uring").place(s, e)
        args: dict[str, Any] = {"obj": r.obj} if r.obj else {}
        args.update(op=r.op, fd=r.fd, res=r.res, nbytes=r.nbytes, ring_fd=r.ring_fd, user_data=r.user_data,
                    flags=uring_flags(r.flags))
        name = f"{r.op} {size_text(r.nbytes)}" if r.nbytes else r.op
        if r.flags & uring.UNFINISHED:
            name += " (in flight at stop)"
        # the report names a request as syscall evidence: its thread, from its submission
        flows = self.evidence("syscall", r.pid, r.tid, r.start_ns)
        self.slice(lane.uuid, s, e, name, _CAT["syscall"], args, flows)

    def in_progress(self, r: InProgress) -> None:
        """A wait the capture stopped in the middle of: drawn up to the stop, on the syscall lane."""
        s, e = self.span(r.start_ns, r.at_ns)
        lane = self.thread_lanes(r.pid, r.tid, "").place(s, e)
        args: dict[str, Any] = {"state": r.state, "since_before_capture": bool(r.before)}
        if r.obj:
            args["obj"] = r.obj
        self.slice(lane.uuid, s, e, f"{r.name or 'off-CPU'} (still waiting at stop)", _CAT["syscall"], args)

    def offcpu(self, r: OffCpu) -> None:
        s, e = self.span(r.start_ns, r.end_ns)
        lane = self.thread_lanes(r.pid, r.tid, "off-CPU").place(s, e)
        state, wake_ns = r.state, r.wake_ns
        begin = (self._offcpu_names.get(state) if type(state) is str else None) or self._offcpu_name(state)
        begin += _STATE(state)
        woken = wake_ns and s <= wake_ns <= e
        if woken:
            begin += _WAKER_PID(r.waker_pid) + _WAKER_TID(r.waker_tid) + _WAKER_COMM(r.waker_comm) + _WAKE_NS(wake_ns)
        if r.held_tid:  # who had the CPU until this thread got it back
            begin += _FROM_PID(r.held_pid) + _FROM_TID(r.held_tid) + _FROM_COMM(r.held_comm)
        flows = self.evidence("offcpu", r.pid, r.tid, r.start_ns)
        if flows:
            begin += pp.flow_ids(flows)
        # tid 0 is every CPU's idle task: a wakeup from interrupt context has no thread to draw an arrow from.
        if not (woken and r.waker_tid):
            self.put_framed(pp.framed_slice(s, e, lane.uuid, begin), 2)
            return
        arrow = pp.flow_id(self.flows.new())
        wake = pp.clamp_ts(wake_ns)
        # The waker's side goes first: at equal timestamps, file order gives the arrow direction.
        packets = b"".join((
            pp.framed_event(pp.INSTANT, wake, self.waker_track(r), b"".join((
                pp.event_name(f"wake tid {r.tid}"), _CAT_SCHED, _WAKEE_PID(r.pid), _WAKEE_TID(r.tid), arrow))),
            pp.framed_event(pp.SLICE_BEGIN, s, lane.uuid, begin),
            pp.framed_slice(wake, e, lane.uuid, b"".join((
                pp.event_name(f"woken by {r.waker_comm or r.waker_tid}"), _CAT_SCHED, _WAKER_PID(r.waker_pid),
                _WAKER_TID(r.waker_tid), arrow))),
            pp.framed_end(e, lane.uuid)))
        lane.add(wake, e)
        self.put_framed(packets, 5)  # all encoded first: a broken record writes nothing

    def offcpu_rows(self, rows: Rows) -> None:
        """``offcpu()`` of each row, the annotations that recur (a task state and its waker, the thread that
        held the CPU, a wakeup's two names) kept encoded."""
        out, lanes, links, flows_new = self.sink.buf, self.lanes, self.stall_links, self.flows.new
        heads, held, wake_heads, woken_heads = self._offcpu_heads, self._held, self._wake_heads, self._woken_heads
        waker, templates = self.tracks.waker, self._offcpu_slices
        packets = 0
        for row in rows:
            try:
                pid, tid, start, end, state, wake_ns, waker_pid, waker_tid, waker_comm, *holder = row
                held_pid, held_tid, held_comm = holder if len(holder) == 3 else (*holder, *_NO_HOLDER[len(holder):])
                s, e = (start, end) if 0 <= start <= end <= _I64_MAX else self.span(start, end)
                lane = (lanes.get(("tl", pid, tid, "off-CPU")) or self.thread_lanes(pid, tid, "off-CPU")).place(s, e)
                uuid = lane.uuid
                woken = bool(wake_ns and s <= wake_ns <= e)
                key = (state, woken, waker_pid, waker_tid, waker_comm)
                begin = heads.get(key)
                if begin is None:
                    begin = self._offcpu_name(state) + _STATE(state)
                    if woken:
                        begin += _WAKER_PID(waker_pid) + _WAKER_TID(waker_tid) + _WAKER_COMM(waker_comm)
                    _keep(heads, key, begin)
                if woken:
                    begin += _WAKE_NS(wake_ns)
                if held_tid:
                    hkey = (held_pid, held_tid, held_comm)
                    h = held.get(hkey)
                    if h is None:
                        h = _keep(held, hkey, _FROM_PID(held_pid) + _FROM_TID(held_tid) + _FROM_COMM(held_comm))
                    begin += h
                flows = links.take(evidence_key("offcpu", pid, tid, start)) if links.waiting else None
                if flows:
                    begin += pp.flow_ids(flows)
                if not (woken and waker_tid):
                    if woken or flows:  # a time or an arrow in it: framed as it is
                        out += pp.framed_slice(s, e, uuid, begin)
                    else:  # a wait nobody was seen ending (a preemption): the same slice on its track, kept
                        t = templates.get((uuid, begin))
                        if t is None:
                            t = _keep(templates, (uuid, begin), pp.slice_template(uuid, begin))
                        out += pp.framed_slice_of(s, e, t)
                    packets += 2
                    continue
                flow = flows_new()
                wake = wake_ns
                wuuid = waker(waker_pid, waker_tid, waker_comm)
                wake_head = wake_heads.get((pid, tid))
                if wake_head is None:
                    wake_head = _keep(wake_heads, (pid, tid), b"".join((pp.event_name(f"wake tid {tid}"), _CAT_SCHED,
                                                                        _WAKEE_PID(pid), _WAKEE_TID(tid))))
                wkey = (waker_comm, waker_pid, waker_tid)
                woken_head = woken_heads.get(wkey)
                if woken_head is None:
                    woken_head = _keep(woken_heads, wkey, b"".join((
                        pp.event_name(f"woken by {waker_comm or waker_tid}"), _CAT_SCHED, _WAKER_PID(waker_pid),
                        _WAKER_TID(waker_tid))))
                packets_ = pp.framed_wakeup(s, wake, e, uuid, begin, wuuid, wake_head, woken_head, flow)
                lane.add(wake, e)
                out += packets_
                packets += 5
            except _MALFORMED:
                self.malformed += 1
        self.sink.count += packets

    def _offcpu_name(self, state: str) -> bytes:
        """An off-CPU slice's encoded name and category, kept per task state."""
        enc = pp.event_name("runqueue" if state == "R" else f"off-CPU ({state})") + _CAT_SCHED
        if type(state) is str and len(self._offcpu_names) < _CACHE_MAX:
            self._offcpu_names[state] = enc
        return enc

    def waker_track(self, r: OffCpu) -> int:
        return self.tracks.waker(r.waker_pid, r.waker_tid, r.waker_comm)

    def block(self, r: BlockIO) -> None:
        s, e = self.span(r.issue_ns, r.complete_ns)
        dev = r.dev or "?"
        self.tracks.refresh_comm(r.pid, r.tid, r.comm)
        lane = self.block_lanes(dev).place(s, e)
        flows = self.evidence("block", r.pid, r.tid, r.issue_ns)
        fields = b"".join((self.block_name(r.rwbs, r.nbytes), _CAT_BLOCK, _PID(r.pid), _TID(r.tid), _COMM(r.comm),
                           _SECTOR(r.sector), _BYTES(r.nbytes), _RWBS(r.rwbs), _LATENCY(e - s),
                           pp.flow_ids(flows) if flows else b""))
        self.put_framed(pp.framed_slice(s, e, lane.uuid, fields), 2)

    def block_rows(self, rows: Rows) -> None:
        """``block()`` of each row, the annotations that recur (the request's name, thread, size and kind) kept
        encoded."""
        out, lanes, links, heads = self.sink.buf, self.lanes, self.stall_links, self._block_heads
        thread_name = self.tracks.thread_name
        packets = 0
        for row in rows:
            try:
                pid, tid, comm, dev, sector, nbytes, rwbs, issue, complete = row
                s, e = (issue, complete) if 0 <= issue <= complete <= _I64_MAX else self.span(issue, complete)
                dev = dev or "?"
                if comm and thread_name.get((pid, tid)) != comm:
                    self.tracks.refresh_comm(pid, tid, comm)
                lane = (lanes.get(("blk", dev)) or self.block_lanes(dev)).place(s, e)
                flows = links.take(evidence_key("block", pid, tid, issue)) if links.waiting else None
                key = (rwbs, nbytes, pid, tid, comm)
                h = heads.get(key)
                if h is None:
                    h = _keep(heads, key, (b"".join((self.block_name(rwbs, nbytes), _CAT_BLOCK, _PID(pid), _TID(tid),
                                                     _COMM(comm))), _BYTES(nbytes) + _RWBS(rwbs)))
                fields = b"".join((h[0], _SECTOR(sector), h[1], _LATENCY(e - s),
                                   pp.flow_ids(flows) if flows else b""))
                out += pp.framed_slice(s, e, lane.uuid, fields)
                packets += 2
            except _MALFORMED:
                self.malformed += 1
        self.sink.count += packets

    def block_lanes(self, dev: str) -> LaneSet:
        ls = self.lanes.get(("blk", dev))
        if ls is not None:
            return ls

        def make(n: int) -> int:
            parent = self.tracks.track(("blk", dev), f"block {dev}")
            return self.tracks.track(("blk", dev, n), f"lane {n}", parent)

        return self.laneset(("blk", dev), make)

    def block_name(self, rwbs: str, nbytes: int) -> bytes:
        """A block request's encoded name ("R 512 KiB"), kept per kind and size: requests repeat them."""
        if type(nbytes) is not int or type(rwbs) is not str:  # a bool is not the int it equals; no list is a key
            return pp.event_name(f"{rwbs} {size_text(nbytes)}")
        key = (rwbs, nbytes)
        name = self._block_names.get(key)
        if name is None:
            if len(self._block_names) >= _CACHE_MAX:
                self._block_names.clear()
            name = self._block_names[key] = pp.event_name(f"{rwbs} {size_text(nbytes)}")
        return name

    # -- GPU ------------------------------------------------------------------------------------------

    def device_track(self, key: DeviceKey) -> int:
        return self.tracks.track(("gpu", *key), self.devices.label(key))

    def gpu_device(self, r: GpuDevice) -> None:
        self._streams.clear()  # which device a stream's (pid, CUDA id) names may change here
        changed = self.devices.seen(r)
        if changed is not None:
            self.tracks.rename(("gpu", *changed), self.devices.label(changed))

    def cuda_api(self, r: CudaApi) -> None:
        for rec, flow in self.launches.api(r):
            self._write_gpu(rec, flow)

    def activity(self, r: Any) -> None:
        for rec, flow in self.launches.activity(r):
            self._write_gpu(rec, flow)

    def cuda_api_rows(self, rows: Rows) -> None:
        """``cuda_api()`` of each row."""
        new, api, write = tuple.__new__, self.launches.api, self._write_gpu
        for row in rows:
            try:
                for rec, flow in api(new(CudaApi, row)):
                    write(rec, flow)
            except _MALFORMED:
                self.malformed += 1

    def activity_rows(self, cls: type) -> Callable[[Rows], None]:
        """The row handler of GPU work of kind ``cls`` (kernels, copies or memsets): ``activity()`` of each row."""
        kernels = cls is GpuKernel
        heads: dict[tuple[Any, ...], tuple[bytes, bytes]] = {}  # see _activity_head

        def draw(rows: Rows) -> None:
            new, activity, write, take_api = tuple.__new__, self.launches.activity, self._write_gpu, \
                self.launches.take_api
            event_name, framed_slice, flow_id = pp.event_name, pp.framed_slice, pp.flow_id
            out, streams, links, lanes = self.sink.buf, self._streams, self.stall_links, self.lanes
            collectives, api_parts = self.collectives, self._api_parts
            packets = 0
            for row in rows:
                try:
                    pid, device, context, stream, start, end, corr, *rest = row
                    hit = take_api((pid, corr))
                    if hit is None:  # no launch waits for it: activity() decides
                        for rec, flow in activity(new(cls, row)):
                            write(rec, flow)
                        continue
                    api, flow = hit
                    corr_enc = _CORRELATION(corr)
                    arrow = flow_id(flow)
                    # The launch's slice here where its fields are of their declared types (its correlation id
                    # the same as its work's), with the arrows of stall evidence it is, else _write_gpu's.
                    apid, tid, aname, a, b, acorr, kind, result = api
                    if not (type(a) is type(b) is type(acorr) is type(result) is int
                            and type(aname) is type(kind) is str):
                        write(api, flow)
                    else:
                        taken = links.take(evidence_key("gpu", apid, 0, a)) if links.waiting else None
                        a, b = (a, b) if 0 <= a <= b <= _I64_MAX else self.span(a, b)
                        alane = (lanes.get(("tl", apid, tid, "CUDA API"))
                                 or self.thread_lanes(apid, tid, "CUDA API")).place(a, b)
                        parts = api_parts.get((aname, kind, result)) or self._api_head(aname, kind, result, typed=True)
                        arrows = pp.flow_ids([flow, *taken]) if taken else arrow
                        out += framed_slice(a, b, alane.uuid, b"".join((parts[0], corr_enc, parts[1], arrows)))
                        packets += 2
                    s, e = (start, end) if 0 <= start <= end <= _I64_MAX else self.span(start, end)
                    lane = (streams.get((pid, device, stream)) or self.gpu_lanes(pid, device, stream)).place(s, e)
                    if links.waiting:
                        arrow = pp.flow_ids([flow, *links.take(evidence_key("gpu", pid, 0, start))])
                    coll = collectives.pop((pid, corr), None) if collectives else None
                    if coll is None and kernels:  # names vary (a step's number in them): looked up apart
                        key = (pid, context, *rest[1], *rest[2])
                        head = heads.get(key) or self._activity_head(heads, key, new(cls, row))
                        fields = b"".join((event_name(rest[0]), _CAT_GPU, corr_enc, head[1], arrow))
                    elif coll is None:
                        key = (pid, context, *rest)
                        head = heads.get(key) or self._activity_head(heads, key, new(cls, row))
                        fields = b"".join((head[0], corr_enc, head[1], arrow))
                    else:
                        name, args = activity_fields(new(cls, row), coll)
                        fields = b"".join((name, _CAT_GPU, args, arrow))
                    out += framed_slice(s, e, lane.uuid, fields)
                    packets += 2
                except _MALFORMED:
                    self.malformed += 1
            self.sink.count += packets
        return draw

    def _api_head(self, name: Any, api: Any, result: Any, *, typed: bool) -> tuple[bytes, bytes]:
        """A launch slice's encoded name and category, and its api and result annotations; kept per (name, api,
        result) where they are of their declared types (``typed``), until _CACHE_MAX are."""
        parts = self._api_parts.get((name, api, result)) if typed else None
        if parts is None:
            parts = (pp.event_name(name) + _CAT_CUDA, _API(api) + _RESULT(result))
            if typed and len(self._api_parts) < _CACHE_MAX:
                self._api_parts[(name, api, result)] = parts
        return parts

    @staticmethod
    def _activity_head(heads: dict[tuple[Any, ...], tuple[bytes, bytes]], key: tuple[Any, ...],
                       r: Any) -> tuple[bytes, bytes]:
        """What GPU work's slice holds around its correlation id (its name and category; its pid, context and
        kind's own annotations), kept under ``key``: the fields of ``activity_fields(r, None)`` (a kernel's key
        leaves out its name, and the name kept is not used)."""
        name, args = activity_fields(r, None)
        corr = _CORRELATION(r.correlation_id)
        return _keep(heads, key, (name + _CAT_GPU, args[len(corr):]))

    def _write_gpu(self, r: Any, flow: int) -> None:
        """A launch's or GPU work's slice, with the arrow ``flow`` (0: none) and any stall evidence's arrows. What
        recurs is kept encoded: a call's api and result; a kernel's name, pid, context, grid and block (where
        they are ints, as a capture's are)."""
        flows: list[int] = [flow] if flow else []
        links = self.stall_links
        if type(r) is CudaApi or isinstance(r, CudaApi):
            pid, tid, name, start, end, corr, api, result = r
            s, e = (start, end) if type(start) is int and type(end) is int and 0 <= start <= end <= _I64_MAX \
                else self.span(start, end)
            lane = (self.lanes.get(("tl", pid, tid, "CUDA API")) or self.thread_lanes(pid, tid, "CUDA API")).place(s, e)
            if links.waiting:
                flows += links.take(evidence_key("gpu", pid, 0, start))
            parts = self._api_head(name, api, result,
                                   typed=type(name) is str and type(api) is str and type(result) is int)
            fields = b"".join((parts[0], _CORRELATION(corr), parts[1],
                               (pp.flow_id(flows[0]) if len(flows) == 1 else pp.flow_ids(flows)) if flows else b""))
            self.put_framed(pp.framed_slice(s, e, lane.uuid, fields), 2)
            return
        pid, device, _, stream, start, end, corr = r[:7]
        s, e = (start, end) if type(start) is int and type(end) is int and 0 <= start <= end <= _I64_MAX \
            else self.span(start, end)
        ls = self._streams.get((pid, device, stream)) or self.gpu_lanes(pid, device, stream)
        lane = ls.place(s, e)
        coll = self.collectives.pop((pid, corr), None) if self.collectives else None
        head = (self._kernel_head(r) if coll is None and type(r) is GpuKernel else None) or activity_fields(r, coll)
        if links.waiting:
            flows += links.take(evidence_key("gpu", pid, 0, start))
        fields = b"".join((head[0], _CAT_GPU, head[1], pp.flow_ids(flows) if flows else b""))
        self.put_framed(pp.framed_slice(s, e, lane.uuid, fields), 2)

    def _kernel_head(self, r: GpuKernel) -> tuple[bytes, bytes] | None:
        """``activity_fields(r, None)`` of a kernel whose name is a string and whose pid, context, grid and block
        are ints: its name, pid, context, grid and block kept encoded (its correlation id goes between them).
        None for any other kernel."""
        pid, _, context, _, _, _, corr, name, grid, block = r
        grid, block = cast(Any, grid), cast(Any, block)  # as read: lists (a record made in code may hold tuples)
        if not (type(grid) is list and type(block) is list and len(grid) == 3 and len(block) == 3
                and type(name) is str):
            return None
        g0, g1, g2 = grid
        b0, b1, b2 = block
        if not (type(pid) is type(context) is type(g0) is type(g1) is type(g2) is type(b0) is type(b1) is type(b2)
                is int):
            return None
        key = (name, pid, context, g0, g1, g2, b0, b1, b2)
        parts = self._kernel_heads.get(key)
        if parts is None:
            name_enc, args = activity_fields(r, None)
            corr_enc = _CORRELATION(corr)
            if not args.startswith(corr_enc):  # never: activity_fields begins with the correlation id
                return name_enc, args
            parts = _keep(self._kernel_heads, key, (name_enc, args[len(corr_enc):]))
        return parts[0], _CORRELATION(corr) + parts[1]

    def gpu_lanes(self, pid: int, device: int, stream: int) -> LaneSet:
        """A stream's lanes, by the (pid, CUDA id) its records name (stream_lanes, remembered)."""
        key = (pid, device, stream)
        ls = self._streams.get(key)
        if ls is None:
            ls = self._streams[key] = self.stream_lanes(self.devices.key(pid, device), pid, stream)
        return ls

    def stream_lanes(self, dev: DeviceKey, pid: int, stream: int) -> LaneSet:
        def make(n: int) -> int:
            parent = self.device_track(dev)
            label = f"stream {stream}" + (f" #{n + 1}" if n else "")
            return self.tracks.track(("stream", *dev, pid, stream, n), label, parent, f"pid {pid}")
        return self.laneset(("stream", *dev, pid, stream), make)

    def gpu_sync(self, r: GpuSync) -> None:
        s, e = self.span(r.start_ns, r.end_ns)
        dev = self.devices.key(r.pid, r.device)

        def make(n: int) -> int:
            return self.tracks.track(("sync", *dev, n), "sync" + (f" #{n + 1}" if n else ""),
                                     self.device_track(dev), "host waits for the device")

        lane = self.laneset(("sync", *dev), make).place(s, e)
        args = {"pid": r.pid, "tid": r.tid, "kind": r.kind, "stream": r.stream, "correlation_id": r.correlation_id}
        self.slice(lane.uuid, s, e, f"sync {r.kind}", _CAT["gpu"], args)

    def nvtx(self, r: NvtxRange) -> None:
        s, e = self.span(r.start_ns, r.end_ns)
        lane = self.thread_lanes(r.pid, r.tid, "NVTX").place(s, e)
        self.slice(lane.uuid, s, e, r.name, _CAT["nvtx"], {"domain": r.domain} if r.domain else {})

    def collective(self, r: Collective) -> None:
        if len(self.collectives) >= _COLLECTIVE_CAP:
            self.collectives.pop(next(iter(self.collectives)))
        self.collectives[(r.pid, r.correlation_id)] = r

    def collective_call(self, r: CollectiveCall) -> None:
        """On the calling thread's "collectives" track: one rank's call of a collective instance, named as the
        report names it ("all_reduce #17"), from its arrival to its completion where the host saw it. A
        collective stall's evidence names the waiting rank's call and the late rank's: arrows from both."""
        s, e = self.span(r.start_ns, r.end_ns)
        lane = self.thread_lanes(r.pid, r.tid, "collectives").place(s, e)
        args = {"comm": r.comm, "seq": r.seq, "rank": r.rank, "world": r.world, "bytes": r.nbytes,
                "backend": r.backend, "waited": bool(r.waited)}
        flows = self.evidence("collective", r.pid, r.tid, r.start_ns)
        self.slice(lane.uuid, s, e, collective_object(str(r.name), int(r.seq)), _CAT["collective"], args, flows)

    def nvml(self, r: NvmlSample) -> None:
        dev = (SHARED, r.device)  # NVML's index: a real device's key (analysis/devices.py)
        uuid = self.tracks.counter(("nvml", *dev, r.metric), r.metric, self.device_track(dev), unit_of(r.metric))
        self.put(pp.counter_event(r.ts, uuid, r.value))

    # -- bookkeeping ----------------------------------------------------------------------------------

    def agent(self, r: AgentInfo) -> None:
        args = {"interpreter": r.interpreter, "cuda": r.cuda_version, "driver": r.driver_version}
        self.instant(self.tracks.thread(r.pid, r.tid), r.ts, f"GPU agent ({r.source})", _CAT["cuda"], args)

    def agent_thread(self, r: AgentThread) -> None:
        """A thread of the agent in the target, named where it first worked: its time there is the tracing's."""
        self.instant(self.tracks.thread(r.pid, r.tid), r.ts, f"gputrace agent thread: {r.role}", _CAT["process"], {})

    def source_status(self, r: SourceStatus) -> None:
        self.instant(self.meta_track(), r.ts, f"{r.source}: {r.status}", _CAT["process"], {"detail": r.detail})

    def cpu_throttle(self, r: CpuThrottle) -> None:
        """A cpu cgroup's throttled time so far (ms), one counter per cgroup: its steps are the throttles that
        ended, the cpu.throttled stalls' evidence."""
        if r.error:
            self.instant(self.meta_track(), r.ts, f"cpu cgroup {r.path}: unreadable", _CAT["sched"], {"error": r.error})
            return
        name = f"cpu cgroup {r.path} throttled"
        uuid = self.tracks.counter(("cpu_throttled", r.path), name, self.meta_track(), "ms")
        self.put(pp.counter_event(r.ts, uuid, r.throttled_ns / 1e6))

    def cpu_cgroup(self, r: CpuCgroup) -> None:
        what = f"cpu cgroup {r.path or '(none)'}" + (f" (v{r.version})" if r.version else "")
        self.instant(self.meta_track(), r.ts, f"pid {r.pid} in {what}", _CAT["sched"], {"error": r.error})

    def tracing_cost(self, r: TracingCost) -> None:
        """What tracing cost, per source, as a share of one CPU between two of the capture's cost readings
        (each second): the counter track beside the job's own."""
        key = (r.source, r.pid)
        last, self.cost_seen[key] = self.cost_seen.get(key), (r.ts, r.cpu_ns)
        if last is None or r.ts <= last[0]:
            return
        name = f"gputrace cost: {r.source}" + (f" (pid {r.pid})" if r.pid else "")
        uuid = self.tracks.counter(("tracing_cost", *key), name, self.meta_track(), "% of a CPU")
        self.put(pp.counter_event(r.ts, uuid, 100.0 * max(0, r.cpu_ns - last[1]) / (r.ts - last[0])))

    def drops(self, r: Drops) -> None:
        uuid = self.tracks.counter(("drops", r.source, r.what), f"drops {r.source}.{r.what}", self.meta_track(), "")
        self.put(pp.counter_event(r.ts, uuid, r.count))

    # -- stalls (from the report) ---------------------------------------------------------------------

    def _write_stalls(self) -> None:
        for i, stall in enumerate(self.stall_links.stalls):
            self.guarded(self.write_stall, stall, self.stall_links.flows_of(i))

    def write_stall(self, st: Stall, flows: list[int]) -> None:
        num, pid = st.get("device", 0), st.get("device_pid", SHARED)
        dev = (pid if type(pid) is int and pid >= 0 else SHARED, num if type(num) is int else 0)
        s, e = self.span(int(st["start_ns"]), int(st["end_ns"]))

        def make(n: int) -> int:
            return self.tracks.track(("stalls", *dev, n), "stalls" + (f" #{n + 1}" if n else ""),
                                     self.device_track(dev), "GPU idle gaps and what they waited on")

        lane = self.laneset(("stalls", *dev), make).place(s, e)
        cause = str(st.get("cause", "unknown"))
        args = stall_args(st, e - s)
        self.put(pp.track_event(pp.SLICE_BEGIN, s, lane.uuid, cause, category=_CAT["stall"],
                                annots=pp.debug_args(args)))
        # Arrows point at the moment the GPU resumed: evidence may begin after the stall did.
        self.instant(lane.uuid, e, "resume", _CAT["stall"], {"cause": cause}, flows)
        self.put(pp.track_event(pp.SLICE_END, e, lane.uuid))
