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
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

from gputrace.analysis.attribute import collective_object
from gputrace.analysis.devices import SHARED, DeviceKey, ReportDevices
from gputrace.analysis.timefmt import size_text
from gputrace.capture import CaptureReader
from gputrace.documents import Report, Stall
from gputrace.errors import OutputError, UserError
from gputrace.exporters import ExportResult
from gputrace.exporters.perfetto import proto as pp
from gputrace.exporters.perfetto.args import activity_slice, header_int, stall_args, unit_of, uring_flags
from gputrace.exporters.perfetto.canvas import Canvas
from gputrace.exporters.perfetto.links import CaptureLinks, FlowIds, LaunchMatcher, StallLinks, evidence_key
from gputrace.exporters.perfetto.samples import CpuSamples, StackInterner
from gputrace.exporters.perfetto.tracks import ID_SPAN, LaneSet, PacketSink, Tracks
from gputrace.probes.ebpf import uring
from gputrace.records import (
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


class PerfettoExporter:
    """Writes one Perfetto trace from a capture in a single streaming pass (bounded memory)."""

    def __init__(self, out_path: str | os.PathLike[str], *, report: Report | None = None,
                 pending_cap: int = 50_000) -> None:
        self.out_path = Path(out_path)
        self.report = report
        self.pending_cap = pending_cap

    def write(self, reader: CaptureReader) -> ExportResult:
        """Write the trace, under a temporary name renamed into place: a failed write (a full disk) leaves
        nothing behind and is an OutputError naming the file (write() errors carry no name); the reader's own
        errors pass through as they are."""
        def body(sink: PacketSink) -> list[str]:
            run = _Run(sink, reader.header, self.report, self.pending_cap)
            run.start()
            for rec in reader.records():
                run.record(rec)
            run.finish()
            return run.notes(reader)

        return self._to_file(body)

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
                for rec in reader.records():
                    run.record(rec)
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
            notes = body(sink)
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
                 pending_cap: int, *, part: _Part | None = None) -> None:
        tracks = None
        if part is not None:  # 2^32 uuids a capture: no two captures' tracks meet
            tracks = Tracks(sink, uuid_base=part.index << 32, id_base=part.index * ID_SPAN, host=part.host)
        super().__init__(sink, tracks)
        self.header = header
        self.flows = part.flows if part is not None else FlowIds()
        self.stall_links: StallLinks | CaptureLinks = (
            CaptureLinks(part.links, part.index) if part is not None else StallLinks(report, self.flows))
        self.shift_ns = part.shift_ns if part is not None else 0
        self.launches = LaunchMatcher(self.flows, pending_cap)
        self.samples = CpuSamples(sink.put, self.tracks.thread, pending_cap,
                                  interner=part.interner if part is not None else None, ids=self.tracks.perfetto_id)
        self.report = report
        self.devices = ReportDevices(report)
        self.collectives: dict[tuple[int, int], Collective] = {}
        self.skipped: dict[str, int] = {}
        self.not_drawn: dict[str, int] = {}
        self.malformed = 0
        self.cost_seen: dict[tuple[str, int], tuple[int, int]] = {}  # (source, pid) -> last (ts, cpu_ns)
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

    # -- frame ----------------------------------------------------------------------------------------

    def start(self) -> None:
        mono = header_int(self.header, "start_ns")
        real = mono + header_int(self.header, "mono_to_realtime_ns")
        boot = mono + header_int(self.header, "mono_to_boottime_ns")
        self.put(pp.clock_snapshot(mono, real, boot))
        self.put(pp.sequence_start())

    def record(self, rec: tuple[Any, ...]) -> None:
        handler = self.handlers.get(type(rec))
        if handler is not None:
            if self.shift_ns:
                rec = _on_clock(rec, self.shift_ns)
            self.guarded(handler, rec)
            return
        kind = type(rec).__name__
        bucket = self.not_drawn if kind in _NOT_DRAWN else self.skipped
        bucket[kind] = bucket.get(kind, 0) + 1

    def finish(self) -> None:
        for rec, flow in self.launches.drain():
            self.guarded(self._write_gpu, rec, flow)
        self.samples.finish()
        self._write_stalls()

    def guarded(self, fn: Any, *args: Any) -> None:
        try:
            fn(*args)
        except (TypeError, ValueError, AttributeError, OverflowError, IndexError):
            # Fields of the wrong type (a broken or hostile agent). Handlers encode a record's packets
            # before writing them, so a record lands whole or not at all.
            self.malformed += 1

    def notes(self, reader: CaptureReader) -> list[str]:
        notes = []
        if not reader.complete:
            notes.append(f"capture incomplete: {reader.problem or 'records were lost'}; exported what was readable")
        notes += [f"skipped {n} {kind} record(s): not known to the Perfetto exporter"
                  for kind, n in sorted(self.skipped.items())]
        if self.malformed:
            notes.append(f"skipped {self.malformed} malformed record(s) (fields of the wrong type)")
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

    def syscall(self, r: Syscall) -> None:
        s, e = self.span(r.start_ns, r.end_ns)
        lane = self.thread_lanes(r.pid, r.tid, "").place(s, e)
        args: dict[str, Any] = {"obj": r.obj} if r.obj else {}
        args.update(nbytes=r.nbytes, ret=r.ret, fd=r.fd, arg=r.arg)
        flows = self.stall_links.take(evidence_key("syscall", r.pid, r.tid, r.start_ns))
        self.slice(lane.uuid, s, e, r.name, _CAT["syscall"], args, flows)

    def page_fault(self, r: PageFault) -> None:
        """On the syscall lane: the thread is in the kernel, waiting for a mapped file's page."""
        s, e = self.span(r.start_ns, r.end_ns)
        lane = self.thread_lanes(r.pid, r.tid, "").place(s, e)
        args: dict[str, Any] = {"obj": r.obj or f"inode {r.ino} on {r.dev}", "offset": r.offset, "wait_ns": r.wait_ns}
        # the report names a fault's wait as offcpu evidence starting where the fault does
        flows = self.stall_links.take(evidence_key("offcpu", r.pid, r.tid, r.start_ns))
        self.slice(lane.uuid, s, e, "page fault", _CAT["syscall"], args, flows)

    def dirty_pause(self, r: DirtyPause) -> None:
        """On the thread's "dirty pages" track: the pause the kernel set (its sleep is on the off-CPU track)."""
        s, e = self.span(r.ts, r.ts + r.pause_ns)
        lane = self.thread_lanes(r.pid, r.tid, "dirty pages").place(s, e)
        args = {"dev": r.dev, "pause_ns": r.pause_ns, "wb_dirty": r.wb_dirty, "wb_setpoint": r.wb_setpoint,
                "dirty": r.dirty, "limit": r.limit, "ratelimit_bps": r.ratelimit}
        flows = self.stall_links.take(evidence_key("dirty", r.pid, r.tid, r.ts))
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
        flows = self.stall_links.take(evidence_key("syscall", r.pid, r.tid, r.start_ns))
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
        name = "runqueue" if r.state == "R" else f"off-CPU ({r.state})"
        args: dict[str, Any] = {"state": r.state}
        if r.wake_ns and s <= r.wake_ns <= e:
            args.update(waker_pid=r.waker_pid, waker_tid=r.waker_tid, waker_comm=r.waker_comm,
                        wake_ns=r.wake_ns)
        if r.held_tid:  # who had the CPU until this thread got it back
            args.update(cpu_from_pid=r.held_pid, cpu_from_tid=r.held_tid, cpu_from_comm=r.held_comm)
        flows = self.stall_links.take(evidence_key("offcpu", r.pid, r.tid, r.start_ns))
        packets = [pp.track_event(pp.SLICE_BEGIN, s, lane.uuid, name, category=_CAT["sched"],
                                  annots=pp.debug_args(args), flows=flows)]
        # tid 0 is every CPU's idle task: a wakeup from interrupt context has no thread to draw an arrow from.
        if r.wake_ns and s <= r.wake_ns <= e and r.waker_tid:
            flow = self.flows.new()
            wake = pp.clamp_ts(r.wake_ns)
            # The waker's side goes first: at equal timestamps, file order gives the arrow direction.
            packets.insert(0, pp.track_event(pp.INSTANT, wake, self.waker_track(r), f"wake tid {r.tid}",
                                             category=_CAT["sched"], flows=(flow,),
                                             annots=pp.debug_args({"wakee_pid": r.pid, "wakee_tid": r.tid})))
            packets += [pp.track_event(pp.SLICE_BEGIN, wake, lane.uuid, f"woken by {r.waker_comm or r.waker_tid}",
                                       category=_CAT["sched"], flows=(flow,),
                                       annots=pp.debug_args({"waker_pid": r.waker_pid, "waker_tid": r.waker_tid})),
                        pp.track_event(pp.SLICE_END, e, lane.uuid)]
            lane.add(wake, e)
        packets.append(pp.track_event(pp.SLICE_END, e, lane.uuid))
        for packet in packets:  # all encoded first: a broken record writes nothing
            self.put(packet)

    def waker_track(self, r: OffCpu) -> int:
        uuid = self.tracks.untraced_thread(r.waker_pid, r.waker_tid, r.waker_comm)
        self.tracks.refresh_comm(r.waker_pid, r.waker_tid, r.waker_comm)
        return uuid

    def block(self, r: BlockIO) -> None:
        s, e = self.span(r.issue_ns, r.complete_ns)
        dev = r.dev or "?"
        self.tracks.refresh_comm(r.pid, r.tid, r.comm)

        def make(n: int) -> int:
            parent = self.tracks.track(("blk", dev), f"block {dev}")
            return self.tracks.track(("blk", dev, n), f"lane {n}", parent)

        lane = self.laneset(("blk", dev), make).place(s, e)
        args = {"pid": r.pid, "tid": r.tid, "comm": r.comm, "sector": r.sector, "bytes": r.nbytes,
                "rwbs": r.rwbs, "latency_ns": e - s}
        flows = self.stall_links.take(evidence_key("block", r.pid, r.tid, r.issue_ns))
        self.slice(lane.uuid, s, e, f"{r.rwbs} {size_text(r.nbytes)}", _CAT["block"], args, flows)

    # -- GPU ------------------------------------------------------------------------------------------

    def device_track(self, key: DeviceKey) -> int:
        return self.tracks.track(("gpu", *key), self.devices.label(key))

    def gpu_device(self, r: GpuDevice) -> None:
        changed = self.devices.seen(r)
        if changed is not None:
            self.tracks.rename(("gpu", *changed), self.devices.label(changed))

    def cuda_api(self, r: CudaApi) -> None:
        for rec, flow in self.launches.api(r):
            self._write_gpu(rec, flow)

    def activity(self, r: Any) -> None:
        for rec, flow in self.launches.activity(r):
            self._write_gpu(rec, flow)

    def _write_gpu(self, r: Any, flow: int) -> None:
        flows: tuple[int, ...] = (flow,) if flow else ()
        if isinstance(r, CudaApi):
            s, e = self.span(r.start_ns, r.end_ns)
            lane = self.thread_lanes(r.pid, r.tid, "CUDA API").place(s, e)
            flows += tuple(self.stall_links.take(evidence_key("gpu", r.pid, 0, r.start_ns)))
            self.slice(lane.uuid, s, e, r.name, _CAT["cuda"],
                       {"correlation_id": r.correlation_id, "api": r.api, "result": r.result}, flows)
            return
        s, e = self.span(r.start_ns, r.end_ns)
        lane = self.stream_lanes(self.devices.key(r.pid, r.device), r.pid, r.stream).place(s, e)
        name, args = activity_slice(r, self.collectives.pop((r.pid, r.correlation_id), None))
        flows = flows + tuple(self.stall_links.take(evidence_key("gpu", r.pid, 0, r.start_ns)))
        self.slice(lane.uuid, s, e, name, _CAT["gpu"], args, flows)

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
        flows = self.stall_links.take(evidence_key("collective", r.pid, r.tid, r.start_ns))
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
