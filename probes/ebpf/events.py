"""Decodes the eBPF source's raw kernel events into typed records, at read time.

Pure Python (no bcc): every machine that reads a capture can decode it. The struct formats mirror
probes/bpf/gputrace.h once; tests/test_ebpf_layout.py checks them against the compiler's layout. The
capture stores the kernel's bytes as they came out of the ring buffer; resolving fds to paths and peers
happens here, from the fd events, the /proc snapshot (FdInfo) and fork inheritance.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import struct
from collections.abc import Iterator
from typing import Any, NamedTuple

from gputrace.probes.ebpf.epolls import EPOLL_CTL_ADD, EVENTPOLL, EpollTables
from gputrace.probes.ebpf.fdtable import FdTable
from gputrace.probes.ebpf.uring import XFER, uring_op
from gputrace.records import (
    BlockIO,
    DirtyPause,
    EpollEntry,
    FdInfo,
    FileMap,
    InProgress,
    IoUringRequest,
    OffCpu,
    PageFault,
    ProcFork,
    Syscall,
)

LAYOUT = 6
KNOWN_LAYOUTS = (1, 2, 3, 4, 5, 6)  # 2 added EV_FAULT, 3 EV_FDRECV, 4 EV_OFFCPU2 (in place of EV_OFFCPU), 5 EV_URING,
# 6 EV_DIRTY
AT_FDCWD = -100
PATH_MAX_DATA = 255  # GT_DATA_LEN - 1: a path event's string of this length may have been cut short

EV_SYS, EV_PATH, EV_BLOCK, EV_OFFCPU, EV_FORK, EV_EXEC, EV_EXIT, EV_FAULT = 1, 2, 3, 4, 5, 6, 7, 8
EXEC_LEFT_OUT = 0x1  # GT_EXEC_LEFT_OUT: an exec event's flags when the process was left out (ProcLeftOut)

F_FD = 0x1
F_XFER = 0x2
F_PATH = 0x4
F_SOCKADDR = 0x8
F_SOCKADDR_PLEN = 0x10
F_FDTABLE = 0x20
F_PIPE = 0x40
F_TIMESPEC = 0x80
F_PATH0 = 0x200  # with F_PATH: the path is the first argument, relative to the cwd (chdir)
F_DUPFD = 0x400  # an fd-table change when the second argument is F_DUPFD / F_DUPFD_CLOEXEC (fcntl)
F_MSGHDR = 0x800  # fds received in an SCM_RIGHTS message are reported (recvmsg)
F_POLLFD = 0x1000  # poll/ppoll: the first argument reports the one fd polled, else the first ready one, else -1
F_EPOLLFD = 0x2000  # earlier versions' epoll waits: the first argument is the first ready event's data taken as an fd
F_EPOLLDATA = 0x4000  # epoll waits: a0 the epoll fd (| EPOLL_DATA_OK), a1 the first ready event's data word
F_EPOLLCTL = 0x8000  # epoll_ctl: a0 the epoll fd (| EPOLL_DATA_OK), a1 the data word, arg the target fd | op << 32
F_SELECTFD = 0x10000  # select/pselect6: the first argument reports the one fd watched, else the first ready, else -1
F_URING = 0x20000  # io_uring_enter: the first argument is a ring; the kernel names it in its requests' events
EPOLL_DATA_OK = 1 << 32  # in a0 of an F_EPOLLDATA / F_EPOLLCTL event: a1 holds a data word
F_DUPFD_CMDS = (0, 1030)  # F_DUPFD, F_DUPFD_CLOEXEC

DROP_REASONS = ("ringbuf", "procbuf", "syscall_inflight", "syscall_agg", "block", "offcpu", "targets", "fault",
                "layout", "uring")
# The `drops` array's slots after the reasons (gputrace.bpf.c offcpu_unreported, unreported_switch_away): switches of
# a traced thread on or off a CPU the kernel did not report, whose off-CPU spans are bounded by what was seen instead,
# and of those the spans lost for want of any bound (a preempted thread has no wakeup). Like the probe runs the kernel
# skipped, they are the kernel's omissions, reported beside those under these names.
UNREPORTED_SWITCHES = ("sched_switch.unreported", "sched_switch.unreported_lost")
# fds received over a unix socket (SCM_RIGHTS) closed, or their process gone, before /proc/PID/fd/N could be read:
# the calls on them name no file. Reported beside the kernel's omissions under this name.
FDS_UNNAMED = "recvmsg.fds_unnamed"

SYS = struct.Struct("<IIIIQQqQQQ")  # gt_sys_event
PATH = struct.Struct("<IIIIQQqQQQII256s")  # gt_path_event
BLOCK = struct.Struct("<IIIIQQQIi8s16s")  # gt_block_event
OFFCPU = struct.Struct("<IIIIQQQII16s")  # gt_offcpu_event (layouts 1-3)
OFFCPU2 = struct.Struct("<IIIIQQQII16sII16sQ")  # gt_offcpu2_event
EV_OFFCPU2 = 12
PROC = struct.Struct("<IIIIQII16s128s")  # gt_proc_event
FAULT = struct.Struct("<IIIIQQQQQ")  # gt_fault_event
MAPFILE = struct.Struct("<IIIIQQ")  # gt_mapfile_event (process-event ring only)
EV_MAPFILE = 9
FDRECV_MAX = 16
FDRECV = struct.Struct(f"<IIIIQ{FDRECV_MAX}i")  # gt_fdrecv_event (both rings)
FDRECV_NAMED = struct.Struct(f"<IIIIQ{FDRECV_MAX}i{FDRECV_MAX}Q")  # gt_fdrecv_named (process-event ring)
EV_FDRECV = 11
URING = struct.Struct("<IIIIQQiiiIQII")  # gt_uring_event
EV_URING = 13
DIRTY = struct.Struct("<IIIIQqQQQQQ32s")  # gt_dirty_event
EV_DIRTY = 14
# Written by the reader at stop, not the kernel: a call in flight and/or an off-CPU span not yet ended, in
# the gt_sys_event layout (nr NO_CALL when in no syscall; ret: the off-CPU state bits, -1 when on CPU; a1: 1
# when the call was under way before it was first seen).
EV_UNFINISHED = 10
NO_CALL = 0xFFFFFFFF

SIZES = {EV_SYS: SYS.size, EV_PATH: PATH.size, EV_BLOCK: BLOCK.size, EV_OFFCPU: OFFCPU.size,
         EV_FORK: PROC.size, EV_EXEC: PROC.size, EV_EXIT: PROC.size, EV_FAULT: FAULT.size,
         EV_UNFINISHED: SYS.size, EV_FDRECV: FDRECV.size, EV_OFFCPU2: OFFCPU2.size, EV_URING: URING.size,
         EV_DIRTY: DIRTY.size}  # fmt: skip


# sched_switch prev_state: bit i set -> the i-th letter after "R" (TASK_REPORT order).
_STATES = "SDTtXZPI"
_AF_UNIX, _AF_INET, _AF_INET6 = 1, 2, 10


def cstr(b: bytes) -> str:
    return b.split(b"\0", 1)[0].decode("utf-8", "backslashreplace")


def state_bits(letter: str) -> int:
    """The sched_switch prev_state bits of a /proc state letter (0 for "R" and unknown letters)."""
    i = _STATES.find(letter) if letter else -1
    return 1 << i if i >= 0 else 0


def task_state(raw: int) -> str:
    bits = raw & 0xFF
    if not bits:
        return "R"
    low = (bits & -bits).bit_length() - 1
    return _STATES[low] if low < len(_STATES) else "?"


def majmin(devt: int) -> str:
    """A kernel dev_t (MAJ << 20 | MIN) as "MAJ:MIN"."""
    return f"{devt >> 20}:{devt & 0xFFFFF}"


def dev_name(devt: int, names: dict[str, str]) -> str:
    key = majmin(devt)
    return names.get(key, key)


def fault_key(raw: bytes) -> tuple[int, str, int]:
    """(pid, "MAJ:MIN", inode) of a raw fault event: the live reader resolves these to paths."""
    _, dev, pid, _tid, *_rest, ino, _index = FAULT.unpack_from(raw)
    return pid, majmin(dev), ino


def mapfile_key(raw: bytes) -> tuple[int, str, int]:
    """(pid, "MAJ:MIN", inode) of a mapped-file announcement from the process-event ring."""
    etype, dev, pid, _tid, _ts, ino = MAPFILE.unpack_from(raw)
    if etype != EV_MAPFILE:
        raise ValueError(f"bad mapped-file event type {etype}")
    return pid, majmin(dev), ino


class FdsReceived(NamedTuple):
    """A gt_fdrecv_event: fds a recvmsg installed (SCM_RIGHTS)."""

    pid: int
    tid: int
    ts: int
    fds: tuple[int, ...]


def fds_received(raw: bytes, off: int = 0) -> FdsReceived:
    f = FDRECV.unpack_from(raw, off)
    etype, count, pid, tid, ts = f[:5]
    if etype != EV_FDRECV:
        raise ValueError(f"bad fd-receive event type {etype}")
    return FdsReceived(pid, tid, ts, tuple(f[5 : 5 + min(count, FDRECV_MAX)]))


def fds_received_named(raw: bytes) -> tuple[FdsReceived, tuple[int, ...]]:
    """A gt_fdrecv_named: the event, and each fd's inode number when it was received (0: not read)."""
    ev = fds_received(raw)
    return ev, FDRECV_NAMED.unpack_from(raw)[5 + FDRECV_MAX : 5 + FDRECV_MAX + len(ev.fds)]


def sockaddr_str(data: bytes) -> str:
    """A peer as ``host:port`` / ``[v6]:port`` / a unix path; "" when unreadable. Bytes are untrusted."""
    if len(data) < 2:
        return ""
    family = int.from_bytes(data[:2], "little")
    if family == _AF_INET and len(data) >= 8:
        return f"{ipaddress.IPv4Address(data[4:8])}:{int.from_bytes(data[2:4], 'big')}"
    if family == _AF_INET6 and len(data) >= 24:
        return f"[{ipaddress.IPv6Address(data[8:24])}]:{int.from_bytes(data[2:4], 'big')}"
    if family == _AF_UNIX:
        path = data[2:]
        if path[:1] == b"\0":
            return "unix:@" + cstr(path[1:])
        return "unix:" + cstr(path) if cstr(path) else "unix:(unnamed)"
    return f"sockaddr(family {family})"


class KernelDecoder:
    """Turns raw event blobs into Syscall, BlockIO and OffCpu records, resolving fds as it goes."""

    def __init__(self, meta: dict[str, Any]) -> None:
        if meta.get("layout") not in KNOWN_LAYOUTS:
            raise ValueError(f"eBPF event layout {meta.get('layout')!r}, this reader knows {KNOWN_LAYOUTS}")
        self.threshold_ns = int(meta.get("threshold_ns", 0))
        self.page_size = int(meta.get("page_size", 4096))
        self._names: dict[int, str] = {int(k): str(v) for k, v in meta.get("syscalls", {}).items()}
        self._flags: dict[int, int] = {int(k): int(v) for k, v in meta.get("sysflags", {}).items()}
        self._devices: dict[str, str] = {str(k): str(v) for k, v in meta.get("devices", {}).items()}
        self._fds: dict[int, FdTable] = {}
        self._maps: dict[tuple[int, str, int], str] = {}  # (pid, "MAJ:MIN", inode) -> path
        self._forked: set[int] = set()
        self._fork_markers = bool(meta.get("fork_markers", False))
        self._epolls = EpollTables()
        # Whether the capture can say what an epoll data word stands for: it traced epoll_ctl (its /proc
        # snapshot then has each epoll fd's earlier registrations). Earlier versions' captures took the word
        # for the fd in the kernel (F_EPOLLFD waits, read like any fd).
        self._epoll_ctl_traced = "epoll_ctl" in self._names.values()
        self._ops: dict[int, int] = {}  # syscall nr -> what its call does to the fd table (_fd_op), once asked

    # ------------------------------------------------------------------------------ fd tables ---

    def note_fd(self, info: FdInfo) -> None:
        self._table(info.pid, info.ts)[info.fd] = info.obj
        self._epolls.fd_gone(info.pid, info.fd)
        if info.obj == EVENTPOLL:  # its registrations follow, as EpollEntry records
            self._epolls.created(info.pid, info.fd)

    def _table(self, pid: int, now: int) -> FdTable:
        """``pid``'s fd table, about to be changed by an event of time ``now``."""
        table = self._fds.get(pid)
        if table is None:
            table = self._fds[pid] = FdTable()
        table.now = now
        return table

    def note_epoll(self, e: EpollEntry) -> None:
        self._epolls.ctl(e.pid, e.epfd, EPOLL_CTL_ADD, e.fd, e.data, self.fd_obj(e.pid, e.fd))

    def note_map(self, m: FileMap) -> None:
        self._maps[(m.pid, m.dev, m.ino)] = m.path

    def note_fork(self, fork: ProcFork) -> None:
        """A ProcFork record read from the capture. Sources that put fork markers in the kernel stream
        (``fork_markers`` in their meta) are followed by those instead: a marker sits at the exact point
        of the fork among the parent's fd events, where a record may come earlier or later."""
        if not self._fork_markers:
            self._inherit(fork)

    def _inherit(self, fork: ProcFork) -> None:
        """A child process starts with a copy of its parent's fd table (once: later calls are no-ops)."""
        if fork.is_thread or fork.child_pid in self._forked:
            return
        self._forked.add(fork.child_pid)
        self._fds[fork.child_pid] = FdTable(self._fds.get(fork.parent_pid, {}))
        self._epolls.fork(fork.parent_pid, fork.child_pid)

    def fd_obj(self, pid: int, fd: int) -> str:
        table = self._fds.get(pid)
        return table.get(fd, "") if table is not None else ""

    # ---------------------------------------------------------------------------------- decode ---

    def decode(self, blob: bytes) -> Iterator[Any]:
        off, end = 0, len(blob)
        u32 = _U32.unpack_from
        while off < end:
            if end - off < 4:
                raise ValueError(f"kernel event cut short at offset {off}")
            etype = u32(blob, off)[0]
            size = SIZES.get(etype)
            if size is None or off + size > end:
                raise ValueError(f"bad kernel event type {etype} at offset {off}")
            rec = self._decode_one(etype, blob, off)
            off += size
            if rec is not None:
                yield rec

    def _decode_one(self, etype: int, blob: bytes, off: int) -> Any:
        if etype == EV_SYS:
            return self._syscall(SYS.unpack_from(blob, off), b"")
        if etype == EV_PATH:
            f = PATH.unpack_from(blob, off)
            return self._syscall(f[:10], f[12][: min(f[10], 256)])
        if etype == EV_BLOCK:
            return self._block(BLOCK.unpack_from(blob, off))
        if etype == EV_OFFCPU2:
            return self._offcpu(OFFCPU2.unpack_from(blob, off))
        if etype == EV_OFFCPU:
            return self._offcpu(OFFCPU.unpack_from(blob, off))
        if etype == EV_FAULT:
            return self._fault(FAULT.unpack_from(blob, off))
        if etype == EV_UNFINISHED:
            return self._unfinished(SYS.unpack_from(blob, off))
        if etype == EV_FDRECV:
            self._received(fds_received(blob, off))
            return None
        if etype == EV_URING:
            return self._uring(URING.unpack_from(blob, off))
        if etype == EV_DIRTY:
            return self._dirty(DIRTY.unpack_from(blob, off))
        self._proc(PROC.unpack_from(blob, off))
        return None

    def _syscall(self, f: tuple[Any, ...], data: bytes) -> Syscall | None:
        _, nr, pid, tid, start, end, ret, a0, a1, arg = f
        flags = self._flags.get(nr, 0)
        if flags & F_EPOLLCTL:
            fd, obj, arg = self._epoll_ctl(pid, ret, a0, a1, arg)
        elif flags & F_EPOLLDATA:
            fd, obj = self._epoll_ready(pid, a0, a1)
        else:
            a0 = _int(a0)
            fd = a0 if flags & F_FD else -1
            op = self._ops.get(nr)
            if op is None:
                op = self._ops[nr] = _fd_op(self._names.get(nr, ""), flags)
            if op == _OP_LOOKUP:  # most calls: the object their fd holds, the table unchanged
                table = self._fds.get(pid)
                obj = table.get(a0, "") if table is not None and flags & F_FD else ""
            else:
                obj = self._object(op, pid, self._table(pid, start), nr, flags, ret, a0, _int(a1), data)
        if end - start < self.threshold_ns:
            return None  # emitted only to keep the fd table right; its time is in SyscallAgg
        if flags & F_PATH:  # an open returns its fd; chdir (F_PATH0) returns 0, no fd
            fd = ret if ret >= 0 and flags & F_FDTABLE and not flags & F_PATH0 else -1
        nbytes = ret if flags & F_XFER and ret > 0 else 0
        return Syscall(pid, tid, self._names.get(nr, f"syscall_{nr}"), start, end, ret, fd, obj, nbytes, arg)

    def _epoll_ctl(self, pid: int, ret: int, a0: int, a1: int, arg: int) -> tuple[int, str, int]:
        """(fd, object, arg) of an epoll_ctl: the epoll fd, its object and the op. A successful one changes the
        instance's registrations."""
        epfd, op, fd = _int(a0), arg >> 32, _int(arg)
        if ret == 0:
            self._epolls.ctl(pid, epfd, op, fd, a1 if a0 & EPOLL_DATA_OK else None, self.fd_obj(pid, fd))
        return epfd, self.fd_obj(pid, epfd), op

    def _epoll_ready(self, pid: int, a0: int, a1: int) -> tuple[int, str]:
        """(fd, object) an epoll wait names: the fd registered with its first ready event's data word; none
        when no registration had that word, or several did. A capture that did not trace epoll_ctl cannot
        know its registrations: it takes the word's low half for the fd (where asyncio, libuv and libev put
        it), as earlier versions did."""
        if not a0 & EPOLL_DATA_OK:  # nothing was ready (or the event could not be read)
            return -1, ""
        if not self._epoll_ctl_traced:
            fd = _int(a1)
            return (fd, self.fd_obj(pid, fd)) if fd >= 0 else (-1, "")
        hit = self._epolls.ready(pid, _int(a0), a1)
        if hit is None:
            return -1, ""
        return hit.fd, (self.fd_obj(hit.pid, hit.fd) if hit.pid else "") or hit.obj

    def _object(self, op: int, pid: int, table: FdTable, nr: int, flags: int, ret: int, a0: int, a1: int,
                data: bytes) -> str:
        """The object of a call that may change the process's fd table (``op``: _fd_op's), updating it."""
        if op == _OP_PATH:
            path = _resolve_path(table, AT_FDCWD if flags & F_PATH0 else a0, cstr(data))
            if self._names.get(nr) == "chdir":
                if ret == 0:  # a path the event cut short is not the new cwd
                    _put(table, AT_FDCWD, path if path.startswith("/") and len(data) < PATH_MAX_DATA else "")
            elif flags & F_FDTABLE and ret >= 0:
                table[ret] = path
            return path
        if op == _OP_CLOSE:
            self._epolls.fd_gone(pid, a0)
            return table.drop(a0)
        if op == _OP_SOCKADDR:
            peer = sockaddr_str(data)
            if ret == 0 or ret == -errno.EINPROGRESS:
                table[a0] = peer
            return peer
        if op == _OP_SOCKADDR_PLEN:
            peer = sockaddr_str(data) or "socket"
            if ret >= 0:
                table[ret] = peer
            return peer
        if op == _OP_PIPE:
            if ret == 0:
                table[a0] = table[a1] = "pipe"
            return "pipe"
        name = self._names.get(nr, "")
        if op == _OP_NEW_FD:
            if ret >= 0:
                table[ret] = _NEW_FD[name]
            return _NEW_FD[name]
        if op == _OP_EPOLL_CREATE:
            if ret >= 0:
                table[ret] = EVENTPOLL
                self._epolls.created(pid, ret)
            return EVENTPOLL
        if op == _OP_DUP or (op == _OP_FCNTL and a1 in F_DUPFD_CMDS):
            obj = table.get(a0, "")
            if ret >= 0:  # an unknown source leaves the new fd unknown, not what it held before
                new = a1 if name in ("dup2", "dup3") else ret
                _put(table, new, obj)
                self._epolls.dup(pid, a0, new)
            return obj
        if name == "fchdir":
            obj = table.get(a0, "")
            if ret == 0:  # a directory fd of unknown path: later relative paths stay relative
                _put(table, AT_FDCWD, obj if obj.startswith("/") else "")
            return obj
        return table.get(a0, "") if flags & F_FD else ""

    def _received(self, ev: FdsReceived) -> None:
        """fds installed by a recvmsg: whatever those numbers held is gone. The live reader writes an FdInfo
        for each one it could name right after this event."""
        table = self._table(ev.pid, ev.ts)
        for fd in ev.fds:
            table.drop(fd)
            self._epolls.fd_gone(ev.pid, fd)

    def _uring(self, f: tuple[Any, ...]) -> IoUringRequest:
        """A request names the file its fd held when it was submitted (it may be closed before it completes)."""
        _, opcode, pid, tid, start, end, fd, res, ring_fd, flags, user_data, _cflags, _pad = f
        op = uring_op(opcode)
        table = self._fds.get(pid)
        obj = table.at(fd, start) if table is not None and fd >= 0 and res != -errno.EBADF else ""
        nbytes = res if res > 0 and op in XFER else 0
        return IoUringRequest(pid, tid, op, start, end, res, fd, obj, nbytes, ring_fd, flags, opcode, user_data)

    def _block(self, f: tuple[Any, ...]) -> BlockIO:
        _, dev, pid, tid, sector, issue, complete, nbytes, _err, rwbs, comm = f
        return BlockIO(pid, tid, cstr(comm), dev_name(dev, self._devices), sector, nbytes, cstr(rwbs),
                       issue, complete)  # fmt: skip

    def _offcpu(self, f: tuple[Any, ...]) -> OffCpu:
        _, state, pid, tid, start, end, wake, wpid, wtid, wcomm, *held = f  # held: (pid, tid, comm, pad) in layout 4
        rec = OffCpu(pid, tid, start, end, task_state(state), wake, wpid, wtid, cstr(wcomm))
        if held and held[1]:  # not the idle task: a task held the CPU until this one got it back
            rec = rec._replace(held_pid=held[0], held_tid=held[1], held_comm=cstr(held[2]))
        return rec

    def _dirty(self, f: tuple[Any, ...]) -> DirtyPause:
        _, _pad, pid, tid, ts, pause_ms, wb_dirty, wb_setpoint, dirty, limit, ratelimit_kb, bdi = f
        page, name = self.page_size, cstr(bdi)
        return DirtyPause(pid, tid, ts, max(pause_ms, 0) * 1_000_000, self._devices.get(name, name), wb_dirty * page,
                          wb_setpoint * page, dirty * page, limit * page, ratelimit_kb * 1024)

    def _fault(self, f: tuple[Any, ...]) -> PageFault:
        _, dev, pid, tid, fault_ns, start, end, ino, index = f
        key = majmin(dev)
        return PageFault(pid, tid, fault_ns, end, end - start, self._maps.get((pid, key, ino), ""),
                         index * self.page_size, key, ino)  # fmt: skip

    def _unfinished(self, f: tuple[Any, ...]) -> InProgress:
        _, nr, pid, tid, start, at, state, a0, before, _arg = f
        name, obj = "", ""
        if nr != NO_CALL:
            name = self._names.get(nr, f"syscall_{nr}")
            flags = self._flags.get(nr, 0)
            if flags & F_SELECTFD:  # the one fd it watches, noted at its entry, if any (a0: nfds | fd + 1 << 32)
                obj = self.fd_obj(pid, (a0 >> 32) - 1) if a0 >> 32 else ""
            elif flags & F_FD and not flags & F_POLLFD:  # looked up, never changed: the call did not complete
                obj = self.fd_obj(pid, _int(a0))  # (a poll's first argument is a pointer, no fd)
        return InProgress(pid, tid, name, start, at, task_state(state) if state >= 0 else "", obj, bool(before))

    def _proc(self, f: tuple[Any, ...]) -> None:
        etype, flags, pid, tid, ts, child_pid, child_tid, comm, _filename = f
        if etype == EV_FORK:
            self._inherit(ProcFork(ts, pid, tid, child_pid, child_tid, bool(flags), cstr(comm)))
        elif etype == EV_EXIT and flags:
            self._fds.pop(pid, None)  # the process is gone; its pid may be reused
            self._epolls.exit(pid)
            for key in [k for k in self._maps if k[0] == pid]:
                del self._maps[key]
            self._forked.discard(pid)


# Calls whose new fd is known by its kind alone: what the fd table holds for it
_NEW_FD = {"socket": "socket", "io_uring_setup": "anon_inode:[io_uring]"}
_U32 = struct.Struct("<I")  # an event's type: its first field
# What a call does to its process's fd table (_fd_op), each case of KernelDecoder._object
(_OP_LOOKUP, _OP_PATH, _OP_SOCKADDR, _OP_SOCKADDR_PLEN, _OP_PIPE, _OP_NEW_FD, _OP_EPOLL_CREATE, _OP_CLOSE, _OP_DUP,
 _OP_FCNTL, _OP_FCHDIR) = range(11)


def _fd_op(name: str, flags: int) -> int:
    """Which of ``KernelDecoder._object``'s cases a call of ``name`` (``flags``) is, by the first that applies:
    _OP_LOOKUP for a call that changes no fd table (its object is the one its fd holds, or none). _OP_FCNTL:
    a duplication where its command is F_DUPFD(_CLOEXEC), else a lookup."""
    if flags & F_PATH:
        return _OP_PATH
    if flags & F_SOCKADDR:
        return _OP_SOCKADDR
    if flags & F_SOCKADDR_PLEN:
        return _OP_SOCKADDR_PLEN
    if flags & F_PIPE:
        return _OP_PIPE
    if name in _NEW_FD:
        return _OP_NEW_FD
    if name.startswith("epoll_create"):
        return _OP_EPOLL_CREATE
    if name == "close":
        return _OP_CLOSE
    if name.startswith("dup"):
        return _OP_DUP
    if flags & F_DUPFD:
        return _OP_FCNTL
    return _OP_FCHDIR if name == "fchdir" else _OP_LOOKUP


def proc_record(raw: bytes) -> Any:
    """A process event from the live process ring as a ProcFork / ProcExec / ProcLeftOut / ProcExit record."""
    from gputrace.records import ProcExec, ProcExit, ProcLeftOut

    etype, flags, pid, tid, ts, child_pid, child_tid, comm, filename = PROC.unpack_from(raw)
    if etype == EV_FORK:
        return ProcFork(ts, pid, tid, child_pid, child_tid, bool(flags), cstr(comm))
    if etype == EV_EXEC and flags & EXEC_LEFT_OUT:
        return ProcLeftOut(ts, pid, tid, cstr(comm), cstr(filename))
    if etype == EV_EXEC:
        return ProcExec(ts, pid, tid, cstr(comm), cstr(filename))
    if etype == EV_EXIT:
        return ProcExit(ts, pid, tid, cstr(comm))
    raise ValueError(f"bad process event type {etype}")


def _put(table: FdTable, fd: int, obj: str) -> None:
    if obj:
        table[fd] = obj
    else:
        table.drop(fd)


def _resolve_path(table: FdTable, dirfd: int, path: str) -> str:
    if not path or path.startswith("/"):
        return path
    base = table.get(dirfd, "")
    return os.path.normpath(os.path.join(base, path)) if base.startswith("/") else path


def _int(v: int) -> int:
    """A C int argument (an fd, AT_FDCWD) from a 64-bit register whose upper half may be anything."""
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >= 1 << 31 else v
