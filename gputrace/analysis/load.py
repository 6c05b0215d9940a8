"""One streaming pass over a capture into the indexes attribution needs.

Only the kinds attribution uses are kept; everything else is counted. Per-thread records are sorted once
and searched with bisect, so each question about a thread's time costs O(log n + hits).
"""

from __future__ import annotations

import re
from bisect import bisect_left, bisect_right
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from itertools import chain, compress, repeat
from operator import and_, attrgetter, itemgetter, le, lt, mul
from typing import Any, Protocol, TypeVar

from gputrace.analysis.devices import DeviceKey, DeviceMap, nvml_uuids
from gputrace.analysis.uring import Completions
from gputrace.capture import CaptureReader
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
    OffCpu,
    PageFault,
    ProcExec,
    ProcFork,
    ProcInfo,
    StackFrames,
    StackSample,
    Syscall,
    ThreadInfo,
)

GpuOp = GpuKernel | GpuMemcpy | GpuMemset
_BY_TIMES = attrgetter("start_ns", "end_ns")  # how a device's ops are sorted
FAULT_OP = "page_fault"  # the name a PageFault takes among a thread's blocking calls
DIRTY_OP = "balance_dirty_pages"  # the op of a sleep a pause for dirty pages began outside any recorded call
# An interpreter with a global lock: its executable's name, or the agent's hello ("cpython 3.11.2 /usr/bin/python3")
_GIL_EXE = re.compile(r"^(python|pypy)[0-9.]*$")
_GIL_AGENT = ("cpython ", "pypy ")


class Intervals:
    """Records of one thread that do not overlap each other (a thread is in one syscall / off-CPU span at a
    time), sorted by start, with a bisect index."""

    def __init__(self, records: list[Any], start: str, end: str) -> None:
        by_start = attrgetter(start)
        records.sort(key=by_start)
        self.records = records
        self.starts = list(map(by_start, records))
        self.ends = list(map(attrgetter(end), records))

    def overlapping(self, a: int, b: int) -> list[Any]:
        """Records that intersect [a, b): from the last to start at or before ``a`` (none earlier can reach
        past it) to the last to start before ``b``, those ending after ``a``."""
        starts = self.starts
        i = max(bisect_right(starts, a) - 1, 0)
        j = bisect_left(starts, b, i)
        return list(compress(self.records[i:j], map(lt, repeat(a), self.ends[i:j])))

    def starting_in(self, a: int, b: int) -> list[Any]:
        """Records whose start lies in [a, b]."""
        return self.records[bisect_left(self.starts, a) : bisect_right(self.starts, b)]


class Samples:
    """The CPU samples of one thread, sorted by time: their stack ids, searched with bisect."""

    def __init__(self, rows: list[tuple[int, int]]) -> None:
        rows.sort()
        self.ts = [t for t, _ in rows]
        self.stacks = [s for _, s in rows]

    def between(self, a: int, b: int) -> list[int]:
        """Stack ids of the samples taken in [a, b)."""
        return self.stacks[bisect_left(self.ts, a) : bisect_left(self.ts, b)]


K = TypeVar("K")
V = TypeVar("V")
ASKED_ALONE = 4  # keys a Lazy index looks for one by one before it sorts all its records by key at once


class Lazy(Mapping[K, V]):
    """A window's index of records by thread (or device, process), each entry made when first asked for: a
    window's explanation asks for few of its threads. The same mapping, in the same order, with the same
    entries as the dict the records would make one by one (``key`` of each record, its entry ``make`` of the
    records with that key in the order they came, then ``extra``'s)."""

    def __init__(self, runs: list[list[Any]], key: Callable[[Any], K], make: Callable[[list[Any]], V],
                 extra: dict[K, list[Any]] | None = None) -> None:
        self._runs = runs
        self._keys = [list(map(key, run)) for run in runs]
        self._extra = extra or {}
        self._order = dict.fromkeys(chain(chain.from_iterable(self._keys), self._extra))
        self._make = make
        self._made: dict[K, V] = {}
        self._grouped: dict[K, list[Any]] | None = None

    def __getitem__(self, k: K) -> V:
        made = self._made.get(k)
        if made is None:
            if k not in self._order:
                raise KeyError(k)
            made = self._made[k] = self._make(self._records(k) + self._extra.get(k, []))
        return made

    def _records(self, k: K) -> list[Any]:
        """The records with key ``k``, in order: picked out of every run (a C loop each) for the first few keys
        asked for; past those, all records are sorted by key once."""
        if self._grouped is None and len(self._made) < ASKED_ALONE:
            return [r for run, keys in zip(self._runs, self._keys, strict=True)
                    for r in compress(run, map(k.__eq__, keys))]  # fmt: skip
        if self._grouped is None:
            grouped: dict[K, list[Any]] = {}
            for run, keys in zip(self._runs, self._keys, strict=True):
                for r, rk in zip(run, keys, strict=True):
                    grouped.setdefault(rk, []).append(r)
            self._grouped = grouped
        return list(self._grouped.get(k, ()))

    def get(self, k: Any, default: Any = None) -> Any:
        return self[k] if k in self._order else default

    def __contains__(self, k: object) -> bool:
        return k in self._order

    def __iter__(self) -> Iterator[K]:
        return iter(self._order)

    def __len__(self) -> int:
        return len(self._order)


def _intervals(start: str, end: str) -> Callable[[list[Any]], Intervals]:
    return lambda recs: Intervals(recs, start, end)


@dataclass
class Capture:
    """What attribution reads, indexed."""

    header: dict[str, Any]
    ops: dict[DeviceKey, list[GpuOp]] = field(default_factory=dict)
    devices: dict[DeviceKey, GpuDevice] = field(default_factory=dict)
    device_map: DeviceMap = field(default_factory=lambda: DeviceMap(()))
    launches: dict[tuple[int, int], CudaApi] = field(default_factory=dict)
    collectives: dict[tuple[int, int], Collective] = field(default_factory=dict)
    calls: list[CollectiveCall] = field(default_factory=list)  # host-side collectives (torch.distributed's)
    syscalls: Mapping[int, Intervals] = field(default_factory=dict)
    offcpu: Mapping[int, Intervals] = field(default_factory=dict)
    # a window's (analysis/windowed.py): tid -> the first and last start of its off-CPU records in the whole
    # capture, where the window's ``offcpu`` holds only some of them; empty for a whole capture's
    offcpu_span: dict[int, tuple[int, int]] = field(default_factory=dict)
    blocks: Mapping[int, Intervals] = field(default_factory=dict)  # by submitting tid
    blocks_by_dev: Mapping[str, Intervals] = field(default_factory=dict)  # every submitter, by device name
    block_names: dict[str, str] = field(default_factory=dict)  # "MAJ:MIN" -> device name, from the eBPF meta
    syncs: Mapping[int, Intervals] = field(default_factory=dict)
    dirty: Mapping[int, Intervals] = field(default_factory=dict)  # pauses for dirty pages by tid, by start (ts)
    uring: Mapping[int, Completions] = field(default_factory=dict)  # io_uring requests by pid, by completion
    in_progress: list[InProgress] = field(default_factory=list)  # threads caught waiting at stop
    cpu_cgroups: list[CpuCgroup] = field(default_factory=list)  # where each process was seen (analysis/throttle.py)
    cpu_throttles: list[CpuThrottle] = field(default_factory=list)  # the cgroups' quota and throttling counters
    samples: Mapping[int, Samples] = field(default_factory=dict)  # CPU stack samples by tid
    stacks: dict[tuple[int, int], list[str]] = field(default_factory=dict)  # (pid, stack id) -> frames, leaf first
    comms: dict[int, str] = field(default_factory=dict)  # pid or tid -> comm
    nspids: dict[int, int] = field(default_factory=dict)  # pid -> its pid in its own pid namespace, if other
    tgid: dict[int, int] = field(default_factory=dict)  # tid -> pid
    created: dict[int, list[tuple[int, int]]] = field(default_factory=dict)  # tid -> [(creation ns, creating tid)]
    pids: set[int] = field(default_factory=set)
    gil_pids: set[int] = field(default_factory=set)  # processes running an interpreter with a global lock
    agent_threads: dict[int, str] = field(default_factory=dict)  # tid -> its role in an in-process agent
    agent_from: dict[int, int] = field(default_factory=dict)  # pid -> when its agent said hello (device timing)
    kernel_pids: set[int] = field(default_factory=set)  # processes the kernel source watched
    kernel_seen: bool = False  # whether a kernel (eBPF) source contributed at all
    off: frozenset[str] = frozenset()  # source families the capture ran without (gputrace.families)
    nvml: dict[int, list[float]] = field(default_factory=dict)  # NVML index -> [sum, count] of gpu_util_pct
    drops: list[Drops] = field(default_factory=list)
    counts: dict[str, int] = field(default_factory=dict)
    malformed: int = 0  # records skipped because a field had the wrong type
    unknown_kinds: dict[str, int] = field(default_factory=dict)  # rows of kinds a later version wrote, skipped
    first_ns: int = 0
    last_ns: int = 0
    tracing_ns: int = 0  # when tracing began (0: a capture from before the session recorded it)
    complete: bool = True
    problem: str = ""
    reader_drops: dict[str, int] = field(default_factory=dict)
    trailer: dict[str, Any] = field(default_factory=dict)

    def comm(self, pid_or_tid: int) -> str:
        return self.comms.get(pid_or_tid, "")

    def pid_of(self, tid: int) -> int:
        return self.tgid.get(tid, 0)

    def creation(self, tid: int, before: int) -> tuple[int, int] | None:
        """(creation ns, creating tid) of the thread numbered ``tid`` just before ``before``: the last ProcFork
        record earlier than ``before`` naming it as the child; None where none was recorded (it existed
        before tracing began)."""
        made = self.created.get(tid)
        if not made:
            return None
        i = bisect_left(made, (before,)) - 1
        return made[i] if i >= 0 else None


class _Loader:
    def __init__(self, header: dict[str, Any], *, lazy: bool = False) -> None:
        """``lazy``: a window's loader, whose records all come through ``add_local`` and whose per-thread (per
        device, per process) indexes are made as they are asked for (``Lazy``)."""
        self.cap = Capture(header=header)
        # lazy: each per-thread table's runs of records, by table ("sys", ... as ``raw``; "dev", "samples", "uring")
        self.runs: dict[str, list[list[Any]]] | None = {k: [] for k in (*_LAZY_KEYS, "sys", "off", "blk", "sync",
                                                                            "dirty")} if lazy else None
        self.raw: dict[str, dict[int, list[Any]]] = {"sys": {}, "off": {}, "blk": {}, "sync": {}, "dirty": {}}
        self.by_dev: dict[str, list[BlockIO]] = {}
        self.gpu_devices: dict[tuple[int, int], GpuDevice] = {}
        self.faults: dict[tuple[int, int], PageFault] = {}  # (tid, start_ns) -> the fault, its last wait's end
        self.samples: dict[int, list[tuple[int, int]]] = {}  # tid -> [(ts, stack id)]
        self.uring: dict[int, list[IoUringRequest]] = {}  # pid -> its requests

    def add(self, r: Any) -> bool:
        """Count ``r`` and index it; False where it was skipped (a kind attribution does not use, or a field
        of the wrong type)."""
        kind = type(r).__name__
        counts = self.cap.counts
        counts[kind] = counts.get(kind, 0) + 1
        handler = _HANDLERS.get(kind)
        if handler is None:
            return False
        if not shaped(kind, r):
            self.cap.malformed += 1
            return False
        handler(self, r)
        return True

    def tell(self, r: Any) -> bool:
        """``add`` of a time-local record (``_TOLD``) but its indexing: what the whole capture learns of it, as
        ``note_columns`` of a frame of it alone (its count, its thread and process, the span, counted malformed);
        False where it was skipped (a field of the wrong type). A windowed analysis's first pass
        (analysis/windowed.py) keeps no time-local index of the whole capture."""
        kind = type(r).__name__
        cap = self.cap
        counts = cap.counts
        counts[kind] = counts.get(kind, 0) + 1
        if not shaped(kind, r):
            cap.malformed += 1
            return False
        start, end, told = _TOLD_AT[kind]
        if kind in _ORDERED and r[end] < r[start]:  # passed over (a request's counted malformed), as ``add`` does
            if kind == "IoUringRequest":
                cap.malformed += 1
            return True
        if told & _THREAD:
            pid, tid = r.pid, r.tid
            if tid and pid:
                cap.tgid.setdefault(tid, pid)
                cap.pids.add(pid)
            if kind == "OffCpu" and r.waker_tid and r.waker_pid > 0:  # as _offcpu: a waker may have no records
                cap.tgid.setdefault(r.waker_tid, r.waker_pid)
                cap.comms.setdefault(r.waker_tid, r.waker_comm)
                cap.comms.setdefault(r.waker_pid, r.waker_comm)
        if told & _KERNEL:
            cap.kernel_pids.add(r.pid)
        if start >= 0:
            self._span(r[start], r[end])
        return True

    def note_columns(self, kind: str, columns: list[tuple[Any, ...]]) -> None:
        """What ``add`` of each row of a frame of one of the ``COLUMN_KINDS`` tells the whole capture (its count,
        the threads and processes, the span, records it counts malformed), but for the indexes a window's
        Capture holds (analysis/windowed.py): computed column by column, in C loops. ``columns``: every field of
        rows ``capture.exact_columns`` took, each of exactly its declared type, which ``add`` takes as they are."""
        cap = self.cap
        cap.counts[kind] = cap.counts.get(kind, 0) + len(columns[0])
        if kind not in _TOLD_AT:  # counted only, or (SyscallAgg) its process one the kernel source watched
            if kind == "SyscallAgg":
                cap.kernel_pids.update(columns[0])
            return
        start, end, told = _TOLD_AT[kind]
        if kind in _ORDERED:  # a row ending before it starts is passed over (a request's counted malformed)
            ok = list(map(le, columns[start], columns[end]))
            if not all(ok):
                if kind == "IoUringRequest":
                    cap.malformed += ok.count(False)
                columns = [tuple(compress(c, ok)) for c in columns]
                if not columns[0]:
                    return
        fields = RECORD_TYPES[kind]._fields
        if told & _THREAD:
            pids, tids = columns[fields.index("pid")], columns[fields.index("tid")]
            if kind == "OffCpu":
                self._woken(pids, tids, columns[6], columns[7], columns[8])
            elif not set(tids) - {0} <= cap.tgid.keys():  # (else no setdefault would change tgid)
                self._first_pids(zip(map(mul, tids, map(bool, pids)), pids, strict=True))
            told_pids = set(compress(pids, tids))  # _thread: a process of a record with a thread
            told_pids.discard(0)
            cap.pids |= told_pids
        if told & _KERNEL:
            cap.kernel_pids.update(columns[fields.index("pid")])
        if start >= 0:
            first = min(columns[start])
            if first <= 0:  # (rare) a start not recorded: the first one that was
                first = min(filter((0).__lt__, columns[start]), default=0)
            if first and (cap.first_ns == 0 or first < cap.first_ns):
                cap.first_ns = first
            cap.last_ns = max(cap.last_ns, max(columns[end]))

    def _first_pids(self, pairs: Iterable[tuple[int, int]]) -> None:
        """``tgid.setdefault(tid, pid)`` for each (tid, pid) in order, tid 0 passed over: the same as over the
        distinct pairs in the order each first came (a pair seen again changes nothing)."""
        tgid = self.cap.tgid
        for tid, pid in dict.fromkeys(pairs):
            if tid and tid not in tgid:
                tgid[tid] = pid

    def _woken(self, pids: Sequence[int], tids: Sequence[int], waker_pids: Sequence[int], waker_tids: Sequence[int],
               waker_comms: Sequence[str]) -> None:
        """``_offcpu``'s thread and waker of each row, in the rows' order: the row's thread (``_thread``), then its
        waker's (where it names one: a tid and a pid > 0), whose comm names both too where none does yet."""
        named = list(map(and_, map(bool, waker_tids), map((0).__lt__, waker_pids)))
        if not (set(tids) | set(waker_tids)) - {0} <= self.cap.tgid.keys():  # (else no setdefault changes tgid)
            own = zip(map(mul, tids, map(bool, pids)), pids, strict=True)
            wakers = zip(map(mul, waker_tids, named), waker_pids, strict=True)
            self._first_pids(chain.from_iterable(zip(own, wakers, strict=True)))
        comms = self.cap.comms
        if (set(waker_tids) | set(waker_pids)) - {0} <= comms.keys():
            return
        by_tid = zip(map(mul, waker_tids, named), waker_comms, strict=True)
        by_pid = zip(map(mul, waker_pids, named), waker_comms, strict=True)
        for key, comm in dict.fromkeys(chain.from_iterable(zip(by_tid, by_pid, strict=True))):
            if key and key not in comms:
                comms[key] = comm

    def add_local(self, kind: str, recs: list[Any]) -> None:
        """Index records of one time-local kind as ``add`` does, each one ``add`` takes (as rows ``note_columns``
        took are): ``add`` is ``note_columns`` (what the whole capture is told: counts, threads, processes,
        span, records counted malformed) and this. A window's Capture (analysis/windowed.py) is only this: it
        shares the whole capture's."""
        cap = self.cap
        table = _LOCAL_TABLES.get(kind)
        runs = self.runs
        if runs is not None and kind in _LAZY_KINDS:
            self._add_run(runs, kind, recs)
        elif table is not None:
            _by_tid(self.raw[table], recs)
        elif kind in ("GpuKernel", "GpuMemcpy", "GpuMemset"):
            ok = list(map(le, map(_START, recs), map(_END, recs)))
            if not all(ok):  # an op cannot end before it starts
                recs = list(compress(recs, ok))
            devices = list(map(_PID_DEVICE, recs))
            for device in dict.fromkeys(devices):  # (few: a C loop each)
                cap.ops.setdefault(device, []).extend(compress(recs, map(device.__eq__, devices)))
        elif kind == "CudaApi":
            cap.launches.update(zip(map(_LAUNCH_KEY, recs), recs, strict=True))
            waits = {name for name in set(map(_NAME, recs)) if _synchronizes_by(name)}
            syncs = self.raw["sync"]
            for r in recs if waits else ():
                if r.name in waits:
                    syncs.setdefault(r.tid, []).append(r)
        elif kind == "BlockIO":
            _by_tid(self.raw["blk"], recs)
            by_dev = self.by_dev
            for r in recs:
                by_dev.setdefault(r.dev, []).append(r)
        elif kind == "StackSample":
            samples = self.samples
            for r in recs:
                samples.setdefault(r.tid, []).append((r.ts, r.stack))
        elif kind == "PageFault":
            faults = self.faults
            for r in recs:
                key = (r.tid, r.start_ns)
                prev = faults.get(key)
                if r.end_ns >= r.start_ns and (prev is None or r.end_ns > prev.end_ns):
                    faults[key] = r
        elif kind == "IoUringRequest":
            uring = self.uring
            for r in recs:
                if r.end_ns >= r.start_ns:  # (one ending before it starts: counted malformed by note_columns)
                    uring.setdefault(r.pid, []).append(r)
        else:
            raise ValueError(f"{kind} is not a time-local kind")

    def _thread(self, pid: int, tid: int) -> None:
        if tid and pid:
            self.cap.tgid.setdefault(tid, pid)
            self.cap.pids.add(pid)

    def _span(self, start: int, end: int) -> None:
        cap = self.cap
        if start > 0 and (cap.first_ns == 0 or start < cap.first_ns):
            cap.first_ns = start
        cap.last_ns = max(cap.last_ns, end)

    def op(self, r: GpuOp) -> None:
        if r.end_ns < r.start_ns:
            return  # hostile or broken: an op cannot end before it starts
        self.cap.ops.setdefault((r.pid, r.device), []).append(r)
        self._span(r.start_ns, r.end_ns)

    def per_tid(self, table: str, r: Any, start: int, end: int) -> None:
        self.raw[table].setdefault(r.tid, []).append(r)
        self._thread(r.pid, r.tid)
        if table != "sync":
            self.cap.kernel_pids.add(r.pid)
        self._span(start, end)

    def device(self, r: GpuDevice) -> None:
        self.gpu_devices[(r.pid, r.id)] = r

    def fault(self, r: PageFault) -> None:
        """A wait in a page fault on a file mapping is explained as a blocking call named "page_fault" (its
        ``arg`` the page's offset); the waits of one fault (same thread and start) make one call."""
        if r.end_ns < r.start_ns:
            return
        key = (r.tid, r.start_ns)
        prev = self.faults.get(key)
        if prev is None or r.end_ns > prev.end_ns:
            self.faults[key] = r
        self._thread(r.pid, r.tid)
        self.cap.kernel_pids.add(r.pid)
        self._span(r.start_ns, r.end_ns)

    def request(self, r: IoUringRequest) -> None:
        if r.end_ns < r.start_ns:
            self.cap.malformed += 1  # a request cannot complete before it was submitted
            return
        self.uring.setdefault(r.pid, []).append(r)
        self._thread(r.pid, r.tid)
        self.cap.kernel_pids.add(r.pid)
        self._span(r.start_ns, r.end_ns)

    def _add_run(self, runs: dict[str, list[list[Any]]], kind: str, recs: list[Any]) -> None:
        """A lazy loader's ``add_local``: the records kept as they came, for ``Lazy`` to index."""
        table = _LOCAL_TABLES.get(kind)
        if table is not None:
            runs[table].append(recs)
        elif kind == "CudaApi":
            self.cap.launches.update(zip(map(_LAUNCH_KEY, recs), recs, strict=True))
            waits = {name for name in set(map(_NAME, recs)) if _synchronizes_by(name)}
            if waits:
                runs["sync"].append([r for r in recs if r.name in waits])
        elif kind == "BlockIO":
            runs["blk"].append(recs)
            runs["dev"].append(recs)
        elif kind == "StackSample":
            runs["samples"].append(recs)
        elif kind == "IoUringRequest":
            runs["uring"].append([r for r in recs if r.end_ns >= r.start_ns])

    def finish(self, nvml_meta: Any = None) -> Capture:
        cap = self.cap
        faults: dict[int, list[Syscall]] = {}
        for f in self.faults.values():
            obj = f.obj or f"inode {f.ino} on {cap.block_names.get(f.dev, f.dev)}"
            faults.setdefault(f.tid, []).append(
                Syscall(f.pid, f.tid, FAULT_OP, f.start_ns, f.end_ns, 0, -1, obj, 0, f.offset))
        if self.runs is not None:
            self._finish_lazy(self.runs, faults)
        else:
            self._finish_eager(faults)
        for made in cap.created.values():
            made.sort()
        tracer = cap.header.get("tracer_pid")
        if type(tracer) is int and tracer > 0:  # gputrace's own process, named so whatever its threads are called
            cap.comms[tracer] = "gputrace"  # (each carries a name of its own: gt-writer, gt-agents, ...)
        self._merge_shared_devices(nvml_meta)
        for ops in cap.ops.values():
            ops.sort(key=_BY_TIMES)
        return cap

    def _finish_lazy(self, runs: dict[str, list[list[Any]]], faults: dict[int, list[Syscall]]) -> None:
        cap = self.cap
        cap.syscalls = Lazy(runs["sys"], _TID, _intervals("start_ns", "end_ns"), faults)
        cap.offcpu = Lazy(runs["off"], _TID, _intervals("start_ns", "end_ns"))
        cap.blocks = Lazy(runs["blk"], _TID, _intervals("issue_ns", "complete_ns"))
        cap.blocks_by_dev = Lazy(runs["dev"], _DEV, _intervals("issue_ns", "complete_ns"))
        cap.syncs = Lazy(runs["sync"], _TID, _intervals("start_ns", "end_ns"))
        cap.dirty = Lazy(runs["dirty"], _TID, _intervals("ts", "ts"))
        cap.samples = Lazy(runs["samples"], _TID, lambda recs: Samples(list(map(_TS_STACK, recs))))
        cap.uring = Lazy(runs["uring"], _PID, Completions)

    def _finish_eager(self, faults: dict[int, list[Syscall]]) -> None:
        cap, raw = self.cap, self.raw
        for tid, calls in faults.items():
            raw["sys"].setdefault(tid, []).extend(calls)
        cap.syscalls = {t: Intervals(v, "start_ns", "end_ns") for t, v in raw["sys"].items()}
        cap.offcpu = {t: Intervals(v, "start_ns", "end_ns") for t, v in raw["off"].items()}
        cap.blocks = {t: Intervals(v, "issue_ns", "complete_ns") for t, v in raw["blk"].items()}
        cap.blocks_by_dev = {d: Intervals(v, "issue_ns", "complete_ns") for d, v in self.by_dev.items()}
        cap.syncs = {t: Intervals(v, "start_ns", "end_ns") for t, v in raw["sync"].items()}
        cap.dirty = {t: Intervals(v, "ts", "ts") for t, v in raw["dirty"].items()}  # searched by start only
        cap.samples = {t: Samples(v) for t, v in self.samples.items()}
        cap.uring = {p: Completions(v) for p, v in self.uring.items()}

    def _merge_shared_devices(self, nvml_meta: Any) -> None:
        """One timeline per GPU, whichever processes use it and whatever they number it (analysis/devices.py)."""
        cap = self.cap
        cap.device_map = dmap = DeviceMap(self.gpu_devices.values(), nvml_uuids(nvml_meta))
        cap.devices = dict(dmap.by_key)
        merged: dict[DeviceKey, list[GpuOp]] = {}
        for (pid, dev), ops in cap.ops.items():
            merged.setdefault(dmap.key(pid, dev), []).extend(ops)
        cap.ops = merged


INT64 = 1 << 63
MAX_COLLECTIVE_NAME = 64


def _collective(ld: _Loader, r: Collective) -> None:
    """A collective's identity goes out as it is (OTLP attributes, trace ids): a number past what those hold,
    a negative sequence number, or an overlong name is a broken record, counted and skipped."""
    if not (0 <= r.seq < INT64 and -1 <= r.rank < INT64 and -1 <= r.world < INT64 and -1 <= r.nbytes < INT64
            and len(r.name) <= MAX_COLLECTIVE_NAME):
        ld.cap.malformed += 1
        return
    ld.cap.collectives[(r.pid, r.correlation_id)] = r


MAX_BACKEND = 32


def _call(ld: _Loader, r: CollectiveCall) -> None:
    """A host-side collective call: the same checks as a Collective record's, and a span that ends after it
    starts."""
    if not (0 <= r.seq < INT64 and -1 <= r.rank < INT64 and -1 <= r.world < INT64 and -1 <= r.nbytes < INT64
            and len(r.name) <= MAX_COLLECTIVE_NAME and len(r.backend) <= MAX_BACKEND and type(r.waited) is bool
            and 0 < r.start_ns <= r.end_ns):
        ld.cap.malformed += 1
        return
    ld.cap.calls.append(r)
    ld._thread(r.pid, r.tid)
    ld._span(r.start_ns, r.end_ns)


def link_device_calls(cap: Capture) -> None:
    """A collective whose call only enqueued device work (NCCL's) is identified on the device: the collective
    kernel launched on the calling thread inside the call gets a Collective record with the call's identity,
    as the simulated ProcessGroup writes one (docs/gpu.md, "Collectives on real GPUs")."""
    calls = [c for c in cap.calls if not c.waited]
    if not calls:
        return
    kernels = {(op.pid, op.correlation_id): op for ops in cap.ops.values() for op in ops if isinstance(op, GpuKernel)}
    launches: dict[int, list[CudaApi]] = {}
    for api in cap.launches.values():
        if (api.pid, api.correlation_id) in kernels:
            launches.setdefault(api.tid, []).append(api)
    for apis in launches.values():
        apis.sort(key=lambda a: a.start_ns)
    for c in calls:
        apis = launches.get(c.tid, [])
        i = bisect_left([a.start_ns for a in apis], c.start_ns)
        for api in apis[i:]:
            if api.start_ns > c.end_ns:
                break
            key = (api.pid, api.correlation_id)
            if key not in cap.collectives and _collective_name(kernels[key].name):
                op = kernels[key]
                cap.collectives[key] = Collective(c.pid, op.device, api.correlation_id, c.name, c.seq, c.rank,
                                                  c.world, c.nbytes, c.comm)
                break


def _collective_name(kernel: str) -> bool:
    low = kernel.lower()
    return "nccl" in low or "rccl" in low


def _nvml(ld: _Loader, r: NvmlSample) -> None:
    if r.metric == "gpu_util_pct" and type(r.value) in (int, float):
        acc = ld.cap.nvml.setdefault(r.device, [0.0, 0.0])
        acc[0] += float(r.value)
        acc[1] += 1


def _proc(ld: _Loader, r: ProcInfo) -> None:
    ld.cap.comms[r.pid] = r.comm
    _interpreter(ld, r.pid, r.exe)
    if type(r.nspid) is int and 0 < r.nspid != r.pid:
        ld.cap.nspids[r.pid] = r.nspid
    ld.cap.kernel_pids.add(r.pid)
    ld.cap.tgid.setdefault(r.pid, r.pid)
    ld.cap.pids.add(r.pid)


def _threadinfo(ld: _Loader, r: ThreadInfo) -> None:
    ld.cap.comms.setdefault(r.tid, r.comm)
    ld._thread(r.pid, r.tid)
    ld.cap.kernel_pids.add(r.pid)


def _fork(ld: _Loader, r: ProcFork) -> None:
    ld.cap.comms.setdefault(r.child_tid, r.comm)
    if not r.is_thread:
        ld.cap.comms.setdefault(r.child_pid, r.comm)
        if r.parent_pid in ld.cap.gil_pids:  # a forked interpreter (a multiprocessing worker) until it execs
            ld.cap.gil_pids.add(r.child_pid)
    ld._thread(r.child_pid, r.child_tid)
    ld.cap.kernel_pids.add(r.child_pid)
    # when and by which thread: before that, the time a wait chain finds on the child was its creator's
    ts, ptid, ppid = r.ts, r.parent_tid, r.parent_pid
    if type(ts) is int and type(ptid) is int and ts > 0 and ptid > 0 and r.child_tid > 0 and ptid != r.child_tid:
        ld.cap.created.setdefault(r.child_tid, []).append((ts, ptid))
        if type(ppid) is int and ppid > 0:
            ld.cap.tgid.setdefault(ptid, ppid)


def _exec(ld: _Loader, r: ProcExec) -> None:
    ld.cap.comms[r.pid] = r.comm
    ld.cap.comms[r.tid] = r.comm
    _interpreter(ld, r.pid, r.filename)


def _interpreter(ld: _Loader, pid: int, exe: Any) -> None:
    """Whether the program ``pid`` runs (its executable's path) is a Python interpreter with a global lock."""
    name = exe.rsplit("/", 1)[-1] if type(exe) is str else ""
    if _GIL_EXE.match(name):
        ld.cap.gil_pids.add(pid)
    elif name:
        ld.cap.gil_pids.discard(pid)


def _agent(ld: _Loader, r: AgentInfo) -> None:
    if type(r.ts) is int and type(r.pid) is int and r.ts > 0:
        first = ld.cap.agent_from.get(r.pid)
        ld.cap.agent_from[r.pid] = r.ts if first is None else min(first, r.ts)
    if type(r.interpreter) is str and r.interpreter.startswith(_GIL_AGENT) and type(r.pid) is int:
        ld.cap.gil_pids.add(r.pid)


def _agent_thread(ld: _Loader, r: AgentThread) -> None:
    """A thread of an agent. One that converts CUPTI's buffers may also flush them: converting is what costs
    the target its GIL, so that role is the one kept."""
    if ld.cap.agent_threads.get(r.tid) != "cupti-convert":
        ld.cap.agent_threads[r.tid] = r.role
    ld._thread(r.pid, r.tid)


def _api(ld: _Loader, r: CudaApi) -> None:
    ld.cap.launches[(r.pid, r.correlation_id)] = r
    ld._thread(r.pid, r.tid)
    if _synchronizes(r):
        ld.raw["sync"].setdefault(r.tid, []).append(r)


def _by_tid(table: dict[int, list[Any]], recs: list[Any]) -> None:
    """``table.setdefault(r.tid, []).append(r)`` for each record in order: of few threads, a C loop each."""
    tids = list(map(_TID, recs))
    threads = dict.fromkeys(tids)
    if len(threads) * 8 > len(recs):
        for r in recs:
            table.setdefault(r.tid, []).append(r)
        return
    for tid in threads:
        table.setdefault(tid, []).extend(compress(recs, map(tid.__eq__, tids)))


def _synchronizes(r: CudaApi) -> bool:
    """A host wait for the device, even where no synchronization activity was recorded (uprobes)."""
    return _synchronizes_by(r.name)


def _synchronizes_by(name: str) -> bool:
    return "Synchronize" in name or name.startswith(("cuStreamSynchronize", "cuCtxSynchronize"))


_LAUNCH_KEY, _NAME, _TID = attrgetter("pid", "correlation_id"), attrgetter("name"), attrgetter("tid")
_PID, _DEV, _TS_STACK = attrgetter("pid"), attrgetter("dev"), attrgetter("ts", "stack")
_START, _END, _PID_DEVICE = attrgetter("start_ns"), attrgetter("end_ns"), attrgetter("pid", "device")


def _block(ld: _Loader, r: BlockIO) -> None:
    """Indexed by submitter and by device. The submitter may be a kernel worker or an untraced process
    (requests dispatched while a traced task waited), so it does not join the traced processes."""
    ld.raw["blk"].setdefault(r.tid, []).append(r)
    ld.by_dev.setdefault(r.dev, []).append(r)
    ld._span(r.issue_ns, r.complete_ns)


def _offcpu(ld: _Loader, r: OffCpu) -> None:
    ld.per_tid("off", r, r.start_ns, r.end_ns)
    if r.waker_tid and r.waker_pid > 0:
        ld.cap.tgid.setdefault(r.waker_tid, r.waker_pid)  # a waker may have no records of its own
        ld.cap.comms.setdefault(r.waker_tid, r.waker_comm)
        ld.cap.comms.setdefault(r.waker_pid, r.waker_comm)


def _sample(ld: _Loader, r: StackSample) -> None:
    ld.samples.setdefault(r.tid, []).append((r.ts, r.stack))
    ld._thread(r.pid, r.tid)


def _frames(ld: _Loader, r: StackFrames) -> None:
    """A stack's frame names; anything but a list of strings (hostile input) is counted and skipped."""
    if type(r.frames) is not list or not set(map(type, r.frames)) <= _STR_ONLY:
        ld.cap.malformed += 1
        return
    ld.cap.stacks[(r.pid, r.stack)] = r.frames


_HANDLERS: dict[str, Any] = {
    "GpuKernel": _Loader.op,
    "GpuMemcpy": _Loader.op,
    "GpuMemset": _Loader.op,
    "GpuDevice": _Loader.device,
    "CudaApi": _api,
    "Collective": _collective,
    "CollectiveCall": _call,
    "Syscall": lambda ld, r: ld.per_tid("sys", r, r.start_ns, r.end_ns),
    "OffCpu": _offcpu,
    "BlockIO": _block,
    "PageFault": _Loader.fault,
    "IoUringRequest": _Loader.request,
    "DirtyPause": lambda ld, r: ld.per_tid("dirty", r, r.ts, r.ts),
    "GpuSync": lambda ld, r: ld.per_tid("sync", r, r.start_ns, r.end_ns),
    "ProcInfo": _proc,
    "ThreadInfo": _threadinfo,
    "ProcFork": _fork,
    "ProcExec": _exec,
    "AgentInfo": _agent,
    "AgentThread": _agent_thread,
    "NvmlSample": _nvml,
    "Drops": lambda ld, r: ld.cap.drops.append(r),
    "InProgress": lambda ld, r: ld.cap.in_progress.append(r),
    "CpuCgroup": lambda ld, r: ld.cap.cpu_cgroups.append(r),
    "CpuThrottle": lambda ld, r: ld.cap.cpu_throttles.append(r),
    "SyscallAgg": lambda ld, r: ld.cap.kernel_pids.add(r.pid),
    "StackSample": _sample,
    "StackFrames": _frames,
}


def _shape(cls: type[Any], ints: str, strs: str = "") -> tuple[tuple[int, ...], tuple[int, ...]]:
    fields = cls._fields
    return tuple(fields.index(f) for f in ints.split()), tuple(fields.index(f) for f in strs.split())


# Fields attribution computes with: a record whose values have other types is counted and skipped.
_SHAPES = {
    "GpuKernel": _shape(GpuKernel, "pid device start_ns end_ns correlation_id", "name"),
    "GpuMemcpy": _shape(GpuMemcpy, "pid device start_ns end_ns correlation_id"),
    "GpuMemset": _shape(GpuMemset, "pid device start_ns end_ns correlation_id"),
    "CudaApi": _shape(CudaApi, "pid tid start_ns end_ns correlation_id", "name"),
    "Collective": _shape(Collective, "pid device correlation_id seq rank world nbytes", "name"),
    "CollectiveCall": _shape(CollectiveCall, "pid tid seq rank world nbytes start_ns end_ns", "name comm backend"),
    "Syscall": _shape(Syscall, "pid tid start_ns end_ns nbytes", "name obj"),
    "OffCpu": _shape(OffCpu, "pid tid start_ns end_ns wake_ns waker_pid waker_tid", "state waker_comm"),
    "BlockIO": _shape(BlockIO, "pid tid nbytes issue_ns complete_ns", "dev rwbs comm"),
    "PageFault": _shape(PageFault, "pid tid start_ns end_ns offset ino", "obj dev"),
    "IoUringRequest": _shape(IoUringRequest, "pid tid start_ns end_ns res fd nbytes ring_fd flags opcode", "op obj"),
    "DirtyPause": _shape(DirtyPause, "pid tid ts pause_ns wb_dirty wb_setpoint dirty limit ratelimit", "dev"),
    "GpuSync": _shape(GpuSync, "pid tid start_ns end_ns"),
    "Drops": _shape(Drops, "ts count", "source what"),
    "ProcInfo": _shape(ProcInfo, "pid", "comm"),
    "ThreadInfo": _shape(ThreadInfo, "pid tid", "comm"),
    "ProcFork": _shape(ProcFork, "child_pid child_tid", "comm"),
    "ProcExec": _shape(ProcExec, "pid tid", "comm"),
    "AgentThread": _shape(AgentThread, "pid tid", "role"),
    "GpuDevice": _shape(GpuDevice, "id pid", "name"),
    "NvmlSample": _shape(NvmlSample, "device", "metric"),
    "InProgress": _shape(InProgress, "pid tid start_ns at_ns", "name state obj"),
    "CpuCgroup": _shape(CpuCgroup, "ts pid version", "path error"),
    "CpuThrottle": _shape(CpuThrottle, "ts prev_ts version quota_us period_us nr_periods nr_throttled throttled_ns",
                          "path error"),
    "StackSample": _shape(StackSample, "ts pid tid stack"),
    "StackFrames": _shape(StackFrames, "pid stack"),
}


def _shape_check(ints: tuple[int, ...], strs: tuple[int, ...]) -> Callable[[Any], bool]:
    """``shaped``'s test of one kind: the types of its fields taken at once (itemgetter, ``map``: C loops)."""
    fields = itemgetter(*ints, *strs) if len(ints) + len(strs) > 1 else None
    want = (int,) * len(ints) + (str,) * len(strs)
    if not want:
        return lambda r: True
    if fields is None:  # a single field: itemgetter gives it alone, not in a tuple
        only = (ints or strs)[0]
        return lambda r: type(r[only]) is want[0]
    return lambda r: tuple(map(type, fields(r))) == want


_SHAPED = {kind: _shape_check(ints, strs) for kind, (ints, strs) in _SHAPES.items()}


def shaped(kind: str, r: Any) -> bool:
    """Whether the fields attribution computes with hold their types in ``r`` (``_SHAPES``)."""
    check = _SHAPED.get(kind)
    return check is None or check(r)


_THREAD, _KERNEL = 1, 2
_STR_ONLY = frozenset({str})  # the types a list of strings holds
# What ``add`` tells the whole capture of a time-local record: (start field, end field) of its span (-1: none),
# and whether its thread and process (``_THREAD``), and its process as one the kernel source watched (``_KERNEL``)
_TOLD = {
    "GpuKernel": ("start_ns", "end_ns", 0), "GpuMemcpy": ("start_ns", "end_ns", 0),
    "GpuMemset": ("start_ns", "end_ns", 0), "CudaApi": ("", "", _THREAD),
    "Syscall": ("start_ns", "end_ns", _THREAD | _KERNEL), "OffCpu": ("start_ns", "end_ns", _THREAD | _KERNEL),
    "BlockIO": ("issue_ns", "complete_ns", 0), "PageFault": ("start_ns", "end_ns", _THREAD | _KERNEL),
    "IoUringRequest": ("start_ns", "end_ns", _THREAD | _KERNEL), "DirtyPause": ("ts", "ts", _THREAD | _KERNEL),
    "GpuSync": ("start_ns", "end_ns", _THREAD), "StackSample": ("", "", _THREAD),
}  # fmt: skip
_TOLD_AT: dict[str, tuple[int, int, int]] = {
    k: (RECORD_TYPES[k]._fields.index(a) if a else -1, RECORD_TYPES[k]._fields.index(b) if b else -1, told)
    for k, (a, b, told) in _TOLD.items()
}
# The kinds ``note_columns`` takes: the time-local ones, and those ``add`` only counts (or notes the process of)
COLUMN_KINDS = frozenset(_TOLD) | {"SyscallAgg"} | (RECORD_TYPES.keys() - _HANDLERS.keys())
_ORDERED = frozenset({"GpuKernel", "GpuMemcpy", "GpuMemset", "PageFault", "IoUringRequest"})  # end before start: out
_LOCAL_TABLES = {"Syscall": "sys", "OffCpu": "off", "DirtyPause": "dirty", "GpuSync": "sync"}  # per-tid tables
# What a lazy loader keeps as runs (``_add_run``), and the tables besides ``raw``'s it keeps them in
_LAZY_KINDS = frozenset({*_LOCAL_TABLES, "CudaApi", "BlockIO", "StackSample", "IoUringRequest"})
_LAZY_KEYS = ("dev", "samples", "uring")


class Source(Protocol):
    """What analysis reads besides the records: a CaptureReader once its records are read (or anything
    shaped like one: watch mode's segments)."""

    @property
    def header(self) -> Mapping[str, Any]: ...
    @property
    def meta(self) -> Mapping[str, Any]: ...
    @property
    def problem(self) -> str: ...
    @property
    def drops(self) -> Mapping[str, int]: ...
    @property
    def unknown_kinds(self) -> Mapping[str, int]: ...
    @property
    def trailer(self) -> Mapping[str, Any] | None: ...
    @property
    def malformed(self) -> int: ...
    @property
    def complete(self) -> bool: ...


def load(reader: CaptureReader) -> Capture:
    """Read every record of ``reader`` once; a truncated capture is loaded up to the cut."""
    ld = _Loader(reader.header)
    add = ld.add
    for r in reader.records():
        add(r)
    return finish_load(ld, reader)


def finish_load(ld: _Loader, reader: Source, *, link: bool = True) -> Capture:
    """The Capture of a loader that has seen every record of ``reader`` (``link``: and the device side of
    collectives called on the host, ``link_device_calls``)."""
    ld.cap.block_names = _block_names(reader.meta.get("ebpf"))
    cap = ld.finish(reader.meta.get("nvml"))
    cap.complete = reader.complete
    cap.problem = reader.problem
    cap.reader_drops = dict(reader.drops)
    cap.unknown_kinds = dict(reader.unknown_kinds)
    cap.trailer = dict(reader.trailer or {})
    cap.malformed += reader.malformed  # rows the reader passed over for a field of the wrong type
    cap.tracing_ns = _tracing_ns(cap.trailer, reader.meta.get("session"))
    kernel_kinds = ("Syscall", "OffCpu", "SyscallAgg", "BlockIO", "PageFault", "IoUringRequest", "DirtyPause")
    cap.kernel_seen = "ebpf" in reader.meta or any(cap.counts.get(k) for k in kernel_kinds)
    cap.off = _families_off(reader.header)
    if link:
        link_device_calls(cap)
    return cap


def _families_off(header: Any) -> frozenset[str]:
    """The families a capture ran without, as its header says (only names this version knows count)."""
    from gputrace.families import FAMILIES

    off = header.get("off") if isinstance(header, dict) else None
    return frozenset(n for n in off if isinstance(n, str) and n in FAMILIES) if isinstance(off, list) else frozenset()


def _tracing_ns(trailer: dict[str, Any], session: Any) -> int:
    """When tracing began: the trailer says so, and the session's metadata for a capture cut off before it."""
    for where in (trailer, session if isinstance(session, dict) else {}):
        ns = where.get("tracing_ns")
        if type(ns) is int and ns > 0:
            return ns
    return 0


def _block_names(meta: Any) -> dict[str, str]:
    """The eBPF source's "MAJ:MIN" -> device name table; anything else in it (hostile input) is ignored."""
    devices = meta.get("devices") if isinstance(meta, dict) else None
    if not isinstance(devices, dict):
        return {}
    return {k: v for k, v in devices.items() if isinstance(k, str) and isinstance(v, str)}
