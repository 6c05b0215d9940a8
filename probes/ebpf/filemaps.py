"""Names of the files traced processes map, for the page faults that wait on them; names of the fds they
receive over unix sockets.

A fault event names its file by device and inode; the path is read from /proc/PID/maps while the mapping
exists (a file on overlayfs, whose maps line shows the overlay's inode, through its layers: see
probes/ebpf/overlay.py), and a FileMap record goes into the capture before the first fault event that needs
it. The kernel announces each (process, file) at its first fault (the faulting thread holds the mapping
then); a fault event whose file was not announced yet is resolved when it arrives, as a fallback.

A process can unmap the file, or exit, before its announcement is read (a fault on a page of libc
evicted under memory pressure, in the last milliseconds of a process, while its mappings are torn down).
What the maps of each process showed is kept for that (up to _KEPT_MAX files), through its exit for the
most recent ones: the same device and inode in the same process is the same file.

An fd received in an SCM_RIGHTS message is named the same way, from /proc/PID/fd/N: see ReceivedFds.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gputrace import clock
from gputrace.probes import procfs
from gputrace.probes.ebpf import events, overlay
from gputrace.records import FdInfo, FileMap

Key = tuple[int, str, int]  # (pid, "MAJ:MIN", inode)
_GONE_KEPT = 64  # processes whose last maps stay readable after their exit
_KEPT_MAX = 8192  # files kept per process, mapped now or before


@dataclass
class _Seen:
    """What was last read of one process: its mapped files, and its overlays (read once)."""

    maps: dict[tuple[str, int], str] = field(default_factory=dict)
    overlays: dict[str, overlay.Overlay] | None = None


class MappedFiles:
    def __init__(self, emit: Callable[[list[Any]], None], forget: Callable[[Key], None]) -> None:
        """``emit`` writes records after everything read so far; ``forget`` drops a key from the kernel's
        announced set, so that the file is announced again at its next fault."""
        self._emit = emit
        self._forget = forget
        self._written: set[Key] = set()
        self._live: dict[int, _Seen] = {}
        self._gone: OrderedDict[int, _Seen] = OrderedDict()  # the last _GONE_KEPT exits

    def named(self, key: Key) -> bool:
        """Whether (pid, "MAJ:MIN", inode) has its FileMap record."""
        return key in self._written

    def announced(self, raw: bytes) -> None:
        key = events.mapfile_key(raw)
        if key in self._written:
            return
        path = self._path(key)
        if path:
            self._write(key, path)
        else:  # not readable now: a later fault announces it again
            self._forget(key)

    def fault(self, raw: bytes) -> None:
        key = events.fault_key(raw)
        if key not in self._written:
            self._write(key, self._path(key))

    def process_gone(self, pid: int) -> None:
        """Its pid may be reused: the next process of that pid has its files read again. What was read of
        it stays at hand for the fault events still to come, until process_started(pid)."""
        seen = self._live.pop(pid, None)
        if seen is not None:
            self._gone[pid] = seen
            if len(self._gone) > _GONE_KEPT:
                self._gone.popitem(last=False)
        gone = [k for k in self._written if k[0] == pid]
        for key in gone:
            self._written.discard(key)
            self._forget(key)

    def process_started(self, pid: int) -> None:
        """A new process of this pid: nothing of an earlier one names its files."""
        self._gone.pop(pid, None)

    def _path(self, key: Key) -> str:
        pid, dev, ino = key
        live = procfs.mapped_files(pid)
        seen = self._live.get(pid) or self._gone.get(pid) or _Seen()
        path = live.get((dev, ino)) or seen.maps.get((dev, ino))
        if live and pid not in self._gone:  # not after its exit was seen: those maps may be partial
            # kept with what was mapped before: a process tearing down its mappings reads partial, too
            self._live[pid] = seen
            seen.maps = seen.maps | live if len(seen.maps) + len(live) <= _KEPT_MAX else live
        if path:
            return path
        if seen.overlays is None:
            seen.overlays = overlay.overlays(pid)
        return overlay.resolve(pid, dev, ino, live or seen.maps, seen.overlays)

    def _write(self, key: Key, path: str) -> None:
        self._written.add(key)
        pid, dev, ino = key
        self._emit([FileMap(clock.monotonic_ns(), pid, dev, ino, path)])


_MAX_PENDING = 4096


class ReceivedFds:
    """fds a traced recvmsg installed (SCM_RIGHTS). The kernel reports them twice: in the process-event ring,
    which is read promptly, so /proc/PID/fd/N is read while the fd most likely still holds the file (a name is
    taken only if the fd holds the inode the kernel saw it receive, where it says: gt_fdrecv_named); and in
    the events ring, in order with the process's other fd events. The FdInfo records go into the capture
    right after the latter, so the decoder applies them exactly where the fds appeared."""

    def __init__(self, emit: Callable[[list[Any]], None]) -> None:
        """``emit`` writes records after everything read so far from the events ring."""
        self._emit = emit
        self._early: dict[tuple[int, int, int], list[FdInfo]] = {}  # read, waiting for the events-ring copy
        self._late: set[tuple[int, int, int]] = set()  # read at the events-ring copy; process-ring copy to come
        self.named = 0  # fds named from /proc/PID/fd
        self.checked = 0  # of those, named after a check of their inode against the kernel's
        self.unnamed = 0  # fds closed (their number maybe used again), or their process gone, before they were read

    def announced(self, raw: bytes) -> None:
        """The process-event ring's copy: read the names now (checked against the inode each fd held when it
        was received, where the kernel gives them: gt_fdrecv_named)."""
        if len(raw) == events.FDRECV_NAMED.size:
            ev, inodes = events.fds_received_named(raw)
        else:
            ev, inodes = events.fds_received(raw), ()
        key = (ev.pid, ev.tid, ev.ts)
        if key in self._late:
            self._late.discard(key)
            return
        if len(self._early) >= _MAX_PENDING:  # events-ring copies lost: do not grow without bound
            self._early.clear()
        self._early[key] = self._read(ev, inodes)

    def in_order(self, raw: bytes) -> None:
        """The events ring's copy, just added to the batch: write the names after it."""
        ev = events.fds_received(raw)
        key = (ev.pid, ev.tid, ev.ts)
        infos = self._early.pop(key, None)
        if infos is None:
            infos = self._read(ev)
            if len(self._late) >= _MAX_PENDING:
                self._late.clear()
            self._late.add(key)
        if infos:
            self._emit(infos)

    def _read(self, ev: events.FdsReceived, inodes: tuple[int, ...] = ()) -> list[FdInfo]:
        """The fds' names from /proc; with ``inodes``, only of fds that hold the same inode before and after
        the name is read (an fd closed and its number used again since the recvmsg holds another file)."""
        held = dict(zip(ev.fds, inodes, strict=False))
        fds = [fd for fd in ev.fds if not held.get(fd) or procfs.fd_inode(ev.pid, fd) == held[fd]]
        infos = [i for i in procfs.fd_infos(ev.ts, ev.pid, fds)
                 if not held.get(i.fd) or procfs.fd_inode(ev.pid, i.fd) == held[i.fd]]
        self.named += len(infos)
        self.checked += sum(1 for i in infos if held.get(i.fd))
        self.unnamed += len(ev.fds) - len(infos)
        return infos
