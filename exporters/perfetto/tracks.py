"""Track bookkeeping for the Perfetto exporter: uuids, descriptors emitted before first use, and lanes.

All state here is bounded by the number of tracks (processes, threads, devices, streams), never by the
number of events.
"""

from __future__ import annotations

import bisect
import hashlib
from collections import deque
from collections.abc import Callable
from typing import BinaryIO, Protocol

from gputrace.exporters.perfetto import proto as pp

UNTRACED = "not traced by gputrace; shown because it woke a traced thread"
ID_SPAN = 1 << 22  # pid_max's ceiling: each host's pids and tids get a span of their own in a joined trace


class Writes(Protocol):
    def write(self, data: bytes, /) -> int: ...


FLUSH_BYTES = 1 << 16  # the file's own buffer gathers these into larger writes


class PacketSink:
    """Writes framed packets to the output as they are made, and counts them. Packets gather in a buffer of
    about ``FLUSH_BYTES`` written at once (a write call per packet costs more than encoding it); ``flush()``
    writes the rest."""

    def __init__(self, out: BinaryIO | Writes) -> None:
        self._write = out.write
        self.buf = bytearray()  # the same object for the whole export: frame handlers append to it directly
        self.count = 0

    def put(self, packet: bytes) -> None:
        self.put_framed(pp.framed(packet), 1)

    def put_framed(self, data: bytes, packets: int) -> None:
        """``packets`` packets framed already (pp.framed_event, pp.framed_slice)."""
        buf = self.buf
        buf += data
        self.count += packets
        if len(buf) >= FLUSH_BYTES:
            self.flush()

    def spill(self) -> None:
        """Write the buffer once it holds ``FLUSH_BYTES`` (after packets appended to ``buf`` directly)."""
        if len(self.buf) >= FLUSH_BYTES:
            self.flush()

    def flush(self) -> None:
        if self.buf:
            data = bytes(self.buf)
            self.buf.clear()
            self._write(data)

    def append(self, f: BinaryIO, packets: int) -> None:
        """The ``packets`` framed packets another writer left in ``f``, written after what this one wrote."""
        self.flush()
        while chunk := f.read(1 << 20):
            self._write(chunk)
        self.count += packets


EVICT = 256  # slices a full sequential lane forgets at once


class Lane:
    """One track's placed slices: enough to decide whether a new slice nests or follows cleanly.

    Perfetto replays begin/end events per track in time order (ties in file order), so a slice may go on a
    lane only if it is disjoint from, or strictly nested with, everything already there. Records need not
    arrive in time order: an agent's batch holds a stream's kernels, then its copies, then its memsets
    (hundreds apart on an H100). A nesting lane keeps its last few slices exactly; a sequential one keeps
    its last ``KEEP_SEQUENTIAL`` sorted by start, so a late slice that overlaps none of them still fits.
    Older ones are kept only as the latest end among them (``floor``): nothing may start before it.
    """

    __slots__ = ("uuid", "nest", "maxend", "floor", "recent", "starts", "ends")
    KEEP = 8
    KEEP_SEQUENTIAL = 1024

    def __init__(self, uuid: int, nest: bool) -> None:
        self.uuid = uuid
        self.nest = nest
        self.maxend = -1
        self.floor = -1
        self.recent: deque[tuple[int, int]] = deque()  # nesting lanes: in the order placed
        self.starts: list[int] = []  # sequential lanes: disjoint slices, sorted
        self.ends: list[int] = []

    def fits(self, s: int, e: int) -> bool:
        if s >= self.maxend:
            return True
        if s < self.floor:
            return False
        if self.nest:
            return all(_compatible(s, e, ys, ye) for ys, ye in self.recent)
        i = bisect.bisect_left(self.starts, s)  # the lane's slices are disjoint: only the neighbours can clash
        if i and self.ends[i - 1] > s:
            return False
        return i == len(self.starts) or e < self.starts[i]

    def add(self, s: int, e: int) -> None:
        if self.nest:
            self.recent.append((s, e))
            if len(self.recent) > self.KEEP:
                self.floor = max(self.floor, self.recent.popleft()[1])
        else:
            if not self.starts or s >= self.starts[-1]:
                self.starts.append(s)  # the common case: in time order
                self.ends.append(e)
            else:
                i = bisect.bisect_left(self.starts, s)
                self.starts.insert(i, s)
                self.ends.insert(i, e)
            if len(self.starts) > self.KEEP_SEQUENTIAL + EVICT:
                self.evict()
        if e > self.maxend:
            self.maxend = e

    def evict(self) -> None:
        """Forget a sequential lane's oldest slices, in chunks: cheap per slice."""
        self.floor = max(self.floor, *self.ends[:EVICT])
        del self.starts[:EVICT], self.ends[:EVICT]


def _compatible(s: int, e: int, ys: int, ye: int) -> bool:
    """Can [s, e], written after [ys, ye], share its track? Ties are safe only where file order resolves them."""
    if s >= ye:  # after: the earlier slice's end was written first
        return True
    if e < ys:  # before: strictly, else our end would sort after its begin
        return True
    if ys < s and e <= ye:  # inside
        return True
    return s < ys and ye <= e  # around


_SEQUENTIAL_MAX = Lane.KEEP_SEQUENTIAL + EVICT  # slices a sequential lane holds before it forgets EVICT of them


class LaneSet:
    """Slices of one logical track; overlapping ones go to extra lanes instead of breaking the nesting.

    ``nest``: a slice may sit inside another on the same lane (CUDA runtime → driver calls, NVTX ranges);
    otherwise lanes hold strictly sequential slices (block requests, kernels on a stream).
    """

    __slots__ = ("_make", "_nest", "lanes")

    def __init__(self, make: Callable[[int], int], nest: bool = False) -> None:
        self._make = make  # lane index -> track uuid (describes the track)
        self._nest = nest
        self.lanes: list[Lane] = []

    def place(self, s: int, e: int) -> Lane:
        """The first lane ``[s, e]`` fits on (``s <= e``), a new one if none does."""
        for lane in self.lanes:
            if s >= lane.maxend:  # after all of it: add()'s in-order case, without the call
                if lane.nest:
                    recent = lane.recent
                    recent.append((s, e))
                    if len(recent) > Lane.KEEP:
                        end = recent.popleft()[1]
                        if end > lane.floor:
                            lane.floor = end
                else:
                    starts = lane.starts
                    starts.append(s)
                    lane.ends.append(e)
                    if len(starts) > _SEQUENTIAL_MAX:
                        lane.evict()
                if e > lane.maxend:
                    lane.maxend = e
                return lane
            if lane.fits(s, e):
                lane.add(s, e)
                return lane
        lane = Lane(self._make(len(self.lanes)), self._nest)
        self.lanes.append(lane)
        lane.add(s, e)
        return lane


SHARED_KEYS = ("p", "t")  # the keys of process and thread tracks, which both parts of a trace drawn in two describe
SHARED_UUIDS = 1 << 47  # their uuids (hashed) from here; every other track's below


def shared_uuid(key: tuple[object, ...]) -> int:
    """A process or thread track's uuid from its key alone (its repr the same in any process): 47 bits of its hash,
    above SHARED_UUIDS. Two of 10,000 threads share one with odds of 4e-7."""
    digest = hashlib.blake2b(repr(key).encode("utf-8", "backslashreplace"), digest_size=8).digest()
    return SHARED_UUIDS | (int.from_bytes(digest, "little") & (SHARED_UUIDS - 1))


class Tracks:
    """Allocates track uuids and writes each descriptor before the track's first event."""

    def __init__(self, sink: PacketSink, *, uuid_base: int = 0, id_base: int = 0, host: str = "",
                 hashed: bool = False) -> None:
        """``uuid_base``, ``id_base`` and ``host`` set one capture apart in a trace of several hosts: its track
        uuids, its pids and tids as Perfetto sees them (Perfetto merges processes by pid, and two hosts' pids
        may be equal), and the host its top-level tracks and processes are named by. ``hashed``: a process or
        thread track's uuid is its key's hash (``shared_uuid``), not its place in the order of first use, so that
        the two writers of a trace drawn in two parts (export._Run's roles), each drawing its own records, give it
        the same one; their other tracks are their own, numbered from their own ``uuid_base``."""
        self._put = sink.put
        self._hashed = hashed
        self._uuid_base = uuid_base
        self._id_base = id_base
        self.host = host
        self._uuids: dict[tuple[object, ...], int] = {}
        self._described: set[int] = set()
        self._threads: dict[tuple[int, int], int] = {}  # thread tracks described: (pid, tid) -> uuid
        self.proc_name: dict[int, tuple[str, list[str]]] = {}
        self.thread_name: dict[tuple[int, int], str] = {}
        self.untraced_pids: set[int] = set()
        self.untraced_threads: set[tuple[int, int]] = set()

    def _uuid(self, key: tuple[object, ...]) -> int:
        u = self._uuids.get(key)
        if u is None:
            u = self._uuids[key] = (shared_uuid(key) if self._hashed and key[0] in SHARED_KEYS
                                    else self._uuid_base + len(self._uuids) + 1)
        return u

    def perfetto_id(self, n: int) -> int:
        """A pid or tid as this capture's host writes it into the trace (0, the idle task, and ids no kernel
        hands out are left as they are: a hostile one is the record's problem, not another host's)."""
        return n + self._id_base if self._id_base and type(n) is int and 0 < n < ID_SPAN else n

    def _named(self, name: str) -> str:
        return f"{self.host}: {name}" if self.host else name

    # -- processes and threads -------------------------------------------------------------------------

    def process(self, pid: int) -> int:
        u = self._uuid(("p", pid))
        if u not in self._described:
            self._describe_process(pid, u)
        return u

    def _describe_process(self, pid: int, u: int) -> None:
        name, cmdline = self.proc_name.get(pid, (f"pid {pid}", []))
        untraced = pid in self.untraced_pids
        shown = f"{name} (untraced)" if untraced else name
        if self._id_base:  # the pid Perfetto shows is this host's span's: say the real one
            shown += f" (pid {pid})"
        self._put(pp.track_descriptor(u, description=UNTRACED if untraced else "",
                                      process=(self.perfetto_id(pid), self._named(shown), cmdline)))
        self._described.add(u)

    def note_process(self, pid: int, comm: str, cmdline: list[str] | None = None) -> None:
        """A traced process's name; re-describes the tracks already written under a provisional name."""
        old = self.proc_name.get(pid)
        self.proc_name[pid] = (comm, cmdline if cmdline is not None else (old[1] if old else []))
        was_untraced = pid in self.untraced_pids
        self.untraced_pids.discard(pid)
        u = self._uuids.get(("p", pid))
        if u in self._described and (old != self.proc_name[pid] or was_untraced):
            self._describe_process(pid, u)
        if (pid, pid) not in self.thread_name:
            self.note_thread(pid, pid, comm)

    def thread(self, pid: int, tid: int) -> int:
        u = self._threads.get((pid, tid))
        if u is not None:  # described already (a track stays described)
            return u
        u = self._uuid(("t", pid, tid))
        if u not in self._described:
            self.process(pid)
            self._describe_thread(pid, tid, u)
        self._threads[(pid, tid)] = u
        return u

    def _describe_thread(self, pid: int, tid: int, u: int) -> None:
        name = self.thread_name.get((pid, tid)) or self._default_thread_name(pid, tid)
        desc = UNTRACED if (pid, tid) in self.untraced_threads else ""
        self._put(pp.track_descriptor(u, description=desc,
                                      thread=(self.perfetto_id(pid), self.perfetto_id(tid), name)))
        self._described.add(u)

    def _default_thread_name(self, pid: int, tid: int) -> str:
        if tid == pid and pid in self.proc_name:
            return self.proc_name[pid][0]
        return f"thread {tid}"

    def note_thread(self, pid: int, tid: int, comm: str) -> None:
        old = self.thread_name.get((pid, tid))
        self.thread_name[(pid, tid)] = comm
        was_untraced = (pid, tid) in self.untraced_threads
        self.untraced_threads.discard((pid, tid))
        u = self._uuids.get(("t", pid, tid))
        if u in self._described and (old != comm or was_untraced):
            self._describe_thread(pid, tid, u)

    def refresh_comm(self, pid: int, tid: int, comm: str) -> None:
        """A thread's comm as a later event saw it (threads rename themselves: prctl, pthread_setname_np)."""
        if comm and self.thread_name.get((pid, tid)) != comm:
            self.thread_name[(pid, tid)] = comm
            u = self._uuids.get(("t", pid, tid))
            if u in self._described:
                self._describe_thread(pid, tid, u)

    def untraced_thread(self, pid: int, tid: int, comm: str) -> int:
        """A thread seen only as a waker: described by its comm and marked untraced."""
        self._note_untraced(pid, tid, comm)
        return self.thread(pid, tid)

    def _note_untraced(self, pid: int, tid: int, comm: str) -> None:
        if (pid, tid) not in self.thread_name:
            self.thread_name[(pid, tid)] = comm
            self.untraced_threads.add((pid, tid))
            if pid not in self.proc_name:
                self.proc_name[pid] = (comm, [])
                self.untraced_pids.add(pid)

    def settled_waker(self, pid: int, tid: int, comm: str) -> bool:
        """Whether ``waker(pid, tid, comm)`` would name nothing anew (the thread is known by that name)."""
        name = self.thread_name.get((pid, tid))
        return name is not None and (name == comm or not comm)

    def name_waker(self, pid: int, tid: int, comm: str) -> None:
        """What ``waker`` notes of a thread's name, its track not described: for a writer that draws no wakeups
        but must name the threads as the one that does."""
        if not self.settled_waker(pid, tid, comm):
            self._note_untraced(pid, tid, comm)
            self.refresh_comm(pid, tid, comm)

    def waker(self, pid: int, tid: int, comm: str) -> int:
        """``untraced_thread`` then ``refresh_comm``: the track of a thread seen waking another, by the comm its
        wakeup names; looked up alone where that changes nothing (the thread is named so, and described)."""
        name = self.thread_name.get((pid, tid))
        if name is not None and (name == comm or not comm):
            u = self._threads.get((pid, tid))
            if u is not None:
                return u
        u = self.untraced_thread(pid, tid, comm)
        self.refresh_comm(pid, tid, comm)
        return u

    # -- plain and counter tracks -----------------------------------------------------------------------

    def track(self, key: tuple[object, ...], name: str, parent: int = 0, description: str = "") -> int:
        """A plain track (a child of ``parent`` when given), described on first use."""
        u = self._uuid(key)
        if u not in self._described:
            self._put(pp.track_descriptor(u, name=name if parent else self._named(name), parent=parent,
                                          description=description))
            self._described.add(u)
        return u

    def rename(self, key: tuple[object, ...], name: str, parent: int = 0, description: str = "") -> None:
        """Re-describe a plain track already written (e.g. a device whose name arrived late)."""
        u = self._uuids.get(key)
        if u is not None and u in self._described:
            self._put(pp.track_descriptor(u, name=name if parent else self._named(name), parent=parent,
                                          description=description))

    def counter(self, key: tuple[object, ...], name: str, parent: int, unit: str) -> int:
        u = self._uuid(key)
        if u not in self._described:
            self._put(pp.track_descriptor(u, name=name if parent else self._named(name), parent=parent,
                                          counter_unit=unit))
            self._described.add(u)
        return u

    def __len__(self) -> int:
        return len(self._described)
