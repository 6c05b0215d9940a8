"""What /proc says about a process when tracing of it begins: metadata, threads, open fds, children.

Everything read here is written by (or about) a traced process and is treated as untrusted: sizes are
capped, bytes decoded with replacement, and a process that vanishes mid-read yields what was read.
"""

from __future__ import annotations

import ipaddress
import os
import re
from collections.abc import Collection
from pathlib import Path
from typing import NamedTuple

from gputrace import clock
from gputrace.probes.ebpf.epolls import EVENTPOLL
from gputrace.probes.ebpf.events import AT_FDCWD
from gputrace.records import EpollEntry, FdInfo, ProcExec, ProcFork, ProcInfo, ThreadInfo

PROC = Path("/proc")
_MAX_CMDLINE = 64 << 10
_MAX_ARGS = 1024


def _read(path: Path, limit: int = 4096) -> bytes:
    try:
        with open(path, "rb") as f:
            return f.read(limit)
    except OSError:
        return b""


def _text(b: bytes) -> str:
    return b.decode("utf-8", "backslashreplace")


def readlink(path: Path) -> str:
    """Where a /proc link points (an executable, an fd's file), decoded like everything else read here:
    a path may be any bytes, and one that is not UTF-8 keeps them as backslash escapes (\\xe9). Raises
    OSError."""
    return _text(os.readlink(os.fsencode(path)))


def read_text(path: Path, limit: int = 4096) -> str:
    """At most `limit` bytes of `path`, decoded with backslash escapes for bytes that are not UTF-8; "" when
    unreadable."""
    return _text(_read(path, limit))


def comm(pid: int, tid: int | None = None) -> str:
    base = PROC / str(pid) if tid is None else PROC / str(pid) / "task" / str(tid)
    return _text(_read(base / "comm", 64)).rstrip("\n")


def ppid_of(pid: int) -> int:
    """The parent's pid from /proc/PID/stat (0 if unreadable); comm may hold spaces and parens."""
    stat = _read(PROC / str(pid) / "stat")
    close = stat.rfind(b")")
    fields = stat[close + 2 :].split()
    try:
        return int(fields[1])
    except (IndexError, ValueError):
        return 0


def proc_info(pid: int) -> ProcInfo | None:
    if not (PROC / str(pid)).is_dir():
        return None
    args = _read(PROC / str(pid) / "cmdline", _MAX_CMDLINE).split(b"\0")
    if args and args[-1] == b"":
        args.pop()
    try:
        exe = readlink(PROC / str(pid) / "exe")
    except OSError:
        exe = ""
    cmdline = [_text(a) for a in args[:_MAX_ARGS]]
    return ProcInfo(clock.monotonic_ns(), pid, ppid_of(pid), comm(pid), cmdline, exe, ns_pid(pid))


def ns_pid(pid: int, status: Path | None = None) -> int:
    """The pid that ``pid`` has in its own pid namespace when that is below the reader's; 0 otherwise."""
    chain = ns_chain(status or PROC / str(pid) / "status")
    return chain[-1] if len(chain) > 1 and chain[0] == pid else 0


def ns_chain(status: Path) -> list[int]:
    """The NSpid line of a status file: the id in each pid namespace, the reader's first, the task's own
    last; [] when unreadable (gone, or a kernel without the line)."""
    for line in _read(status, 8192).splitlines():
        if line.startswith(b"NSpid:"):
            try:
                return [int(x) for x in line.split()[1:]]
            except ValueError:
                return []
    return []


def thread_state(pid: int, tid: int) -> str:
    """The thread's state letter from /proc/PID/task/TID/stat ("R", "S", "D", ...; "" when gone)."""
    raw = _text(_read(PROC / str(pid) / "task" / str(tid) / "stat"))
    after = raw[raw.rfind(")") + 1 :].split()  # comm may hold spaces and parens
    return after[0] if after else ""


def running(pid: int) -> bool:
    """Whether process ``pid`` exists and has not exited: a zombie whose parent has not reaped it yet is
    gone, unless threads of it still run (its leader exited alone)."""
    state = thread_state(pid, pid)
    if state in ("Z", "X"):
        try:
            return len(os.listdir(PROC / str(pid) / "task")) > 1
        except OSError:
            return False
    return state != ""


def blocked_syscall(pid: int, tid: int) -> tuple[int, int] | None:
    """(syscall nr, first argument) a sleeping thread is blocked in, from /proc/PID/task/TID/syscall;
    None when it is running, in no syscall (-1: a fault or a stop), or gone."""
    parts = _text(_read(PROC / str(pid) / "task" / str(tid) / "syscall")).split()
    if len(parts) < 2 or not parts[0].isdigit():
        return None
    if len(parts) == 9 and parts[-2:] == ["0x0", "0x0"]:
        return None  # no user stack or pc: a kernel thread, never in a syscall (nr 0 would read as read())
    try:
        return int(parts[0]), int(parts[1], 16)
    except ValueError:
        return None


def unix_listener(path: str | bytes, pid: int | None = None) -> int:
    """The inode of a Unix socket that listens at ``path`` in the network namespace of ``pid`` (None: ours),
    from /proc/[PID/]net/unix (the listening flag, __SO_ACCEPTCON, and the path it was bound to), told
    without connecting to it; 0 where none does."""
    want = os.fsencode(path)
    try:
        with open(PROC / "net" / "unix" if pid is None else PROC / str(pid) / "net" / "unix", "rb") as f:
            for line in f:
                fields = line.rstrip(b"\n").split(None, 7)  # the path last, spaces and all
                if len(fields) == 8 and fields[7] == want and int(fields[3], 16) & 0x10000:
                    return int(fields[6])
    except (OSError, ValueError):
        return 0
    return 0


def socket_holder(inode: int) -> int | None:
    """A process holding socket ``inode`` open (found among every process's /proc/PID/fd links: a walk of the
    whole host, for saying who holds a socket, not for a hot path); None where none is seen (another pid
    namespace, or gone)."""
    target = f"socket:[{inode}]"
    for entry in os.scandir(PROC):
        if not entry.name.isdigit():
            continue
        try:
            with os.scandir(PROC / entry.name / "fd") as fds:
                if any(_link_is(fd.path, target) for fd in fds):
                    return int(entry.name)
        except OSError:
            continue
    return None


def _link_is(path: str, target: str) -> bool:
    try:
        return os.readlink(path) == target
    except OSError:
        return False


def thread_ids(pid: int) -> list[int]:
    try:
        return sorted(int(t) for t in os.listdir(PROC / str(pid) / "task") if t.isdigit())
    except OSError:
        return []


def threads(pid: int) -> list[ThreadInfo]:
    now = clock.monotonic_ns()
    return [ThreadInfo(now, pid, tid, comm(pid, tid)) for tid in thread_ids(pid)]


def descendants(pid: int) -> list[int]:
    """Every living process below ``pid`` (one pass over /proc)."""
    children: dict[int, list[int]] = {}
    for name in os.listdir(PROC):
        if name.isdigit():
            children.setdefault(ppid_of(int(name)), []).append(int(name))
    out, todo = [], list(children.get(pid, []))
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return sorted(out)


def _hex_addr(text: str) -> str:
    """``0100007F:1F90`` (as /proc/net/tcp prints it, host byte order per 32-bit word) → 127.0.0.1:8080."""
    addr, _, port = text.partition(":")
    raw = bytes.fromhex(addr)
    # Each 32-bit word is in host (little-endian) order.
    raw = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    host = ipaddress.ip_address(raw)
    if isinstance(host, ipaddress.IPv6Address) and host.ipv4_mapped:
        host = host.ipv4_mapped
    port_n = int(port, 16)
    return f"[{host}]:{port_n}" if host.version == 6 else f"{host}:{port_n}"


# /proc/PID/net's socket tables, cheapest first: a TCP table's read walks the whole connection hash, milliseconds
# on a host sized for many connections even when it holds none; the unix table names most of a job's sockets
_SOCKET_TABLES = ("unix", "udp", "udp6", "tcp", "tcp6")


def socket_peers(pid: int, wanted: Collection[int] | None = None) -> dict[int, str]:
    """socket inode → peer ``host:port`` (listening: ``listen host:port``) or unix path, in pid's netns. With
    ``wanted`` (socket inodes), the tables are read no further once each of those is named."""
    peers: dict[int, str] = {}
    left = set(wanted) if wanted is not None else None
    for proto in _SOCKET_TABLES:
        if left is not None and not left:
            break
        lines = _text(_read(PROC / str(pid) / "net" / proto, 4 << 20)).splitlines()[1:]
        for line in lines:
            if proto == "unix":
                f = line.split(maxsplit=7)
                if len(f) >= 7 and f[6].isdigit():
                    peers[int(f[6])] = "unix:" + (f[7] if len(f) > 7 else "(unnamed)")
                continue
            f = line.split()
            try:
                local, remote, inode = _hex_addr(f[1]), _hex_addr(f[2]), int(f[9])
            except (IndexError, ValueError):
                continue
            peers[inode] = remote if not remote.endswith(":0") else f"listen {local}"
        if left is not None:
            left.difference_update(peers)
    return peers


def _classify(link: str, peers: dict[int, str]) -> tuple[str, str]:
    if link.startswith("socket:["):
        inode = link[8:-1]
        return "socket", peers.get(int(inode), link) if inode.isdigit() else link
    if link.startswith("pipe:["):
        return "pipe", link
    if link.startswith("anon_inode:"):
        return "anon", link
    if link.startswith("/"):
        return "file", link
    return "other", link


def fd_snapshot(pid: int) -> list[FdInfo]:
    """The open fds of ``pid`` (plus its cwd as fd AT_FDCWD, kind "cwd", to resolve relative opens)."""
    base = PROC / str(pid)
    now = clock.monotonic_ns()
    try:
        cwd = FdInfo(now, pid, AT_FDCWD, "cwd", readlink(base / "cwd"))
        names = os.listdir(base / "fd")
    except OSError:
        return []
    return [cwd, *sorted(fd_infos(now, pid, [int(n) for n in names]), key=lambda r: r.fd)]


def fd_inode(pid: int, fd: int) -> int | None:
    """The inode number of what fd ``fd`` of ``pid`` holds (stat through /proc/PID/fd/N); None if gone."""
    try:
        return os.stat(PROC / str(pid) / "fd" / str(fd)).st_ino
    except OSError:
        return None


def fd_infos(ts: int, pid: int, fds: list[int]) -> list[FdInfo]:
    """fds ``fds`` of ``pid`` as FdInfo records dated ``ts``, read from /proc/PID/fd (gone ones left out);
    the socket tables are read once, and only as far as the sockets among them need (``socket_peers``)."""
    base = PROC / str(pid) / "fd"
    links: list[tuple[int, str]] = []
    for fd in fds:
        try:
            links.append((fd, readlink(base / str(fd))))
        except OSError:
            continue  # closed meanwhile
    sockets = {int(link[8:-1]) for _, link in links if link.startswith("socket:[") and link[8:-1].isdigit()}
    peers = socket_peers(pid, sockets) if sockets else {}
    return [FdInfo(ts, pid, fd, *_classify(link, peers)) for fd, link in links]


_MAX_FDINFO = 4 << 20  # an epoll fd's fdinfo: about 90 bytes per registration
_EPOLL_LINE = re.compile(rb"^tfd:\s*(\d+)\s+events:\s*([0-9a-f]+)\s+data:\s*([0-9a-f]+)", re.M)


def epoll_entries(pid: int, fds: list[FdInfo]) -> list[EpollEntry]:
    """The registrations of each epoll fd among ``fds``, from /proc/PID/fdinfo/EPFD (``tfd: 5 events: 19
    data: 7eff00000005 ...``, the numbers after events and data in hex); an fd closed meanwhile gives none."""
    out: list[EpollEntry] = []
    for info in fds:
        if info.obj != EVENTPOLL:
            continue
        text = _read(PROC / str(pid) / "fdinfo" / str(info.fd), _MAX_FDINFO)
        out += [EpollEntry(info.ts, pid, info.fd, int(fd), int(events, 16), int(data, 16))
                for fd, events, data in _EPOLL_LINE.findall(text)]  # fmt: skip
    return out


def snapshot(pid: int) -> list[ProcInfo | ThreadInfo | FdInfo | EpollEntry]:
    """What a process is when tracing of it begins: metadata, threads, open fds and what its epoll fds watch
    (after the fds: the decoder names each registered fd by them)."""
    info = proc_info(pid)
    if info is None:
        return []
    fds = fd_snapshot(pid)
    return [info, *threads(pid), *fds, *epoll_entries(pid, fds)]


def new_task_metadata(rec: object) -> list[ProcInfo | ThreadInfo]:
    """/proc metadata for a fork or exec event, read while the task exists."""
    if isinstance(rec, ProcFork):
        if rec.is_thread:
            return [t for t in threads(rec.child_pid) if t.tid == rec.child_tid]
        info = proc_info(rec.child_pid)
        return [info, *threads(rec.child_pid)] if info else []
    if isinstance(rec, ProcExec):
        info = proc_info(rec.pid)
        return [info] if info else []
    return []


def block_devices() -> dict[str, str]:
    """``major:minor`` → device name, for naming block requests."""
    out: dict[str, str] = {}
    try:
        entries = os.listdir("/sys/dev/block")
    except OSError:
        return out
    for majmin in entries:
        for line in _text(_read(Path("/sys/dev/block") / majmin / "uevent")).splitlines():
            if line.startswith("DEVNAME="):
                out[majmin] = line[8:]
    return out


MAX_MAPS = 32 << 20


class Mapping(NamedTuple):
    """One file-backed line of /proc/PID/maps."""

    start: int
    end: int
    perms: str  # "r-xp"
    offset: int  # in the file
    dev: str  # "MAJ:MIN", decimal
    ino: int
    path: str


def mappings(pid: int) -> list[Mapping]:
    """The file-backed mappings of ``pid``, in address order, from /proc/PID/maps.

    A maps line is ``start-end perms offset MAJ:MIN inode path`` with MAJ and MIN in hex; the kernel
    escapes a newline in a path as ``\\012`` and appends `` (deleted)`` to unlinked files. Anonymous
    mappings (inode 0) and pseudo-files (``[heap]``) are left out.
    """
    out = []
    for line in _text(_read(PROC / str(pid) / "maps", MAX_MAPS)).splitlines():
        parts = line.split(maxsplit=5)
        if len(parts) < 6 or not parts[5].startswith("/"):
            continue
        major, _, minor = parts[3].partition(":")
        try:
            start, end = (int(x, 16) for x in parts[0].split("-"))
            m = Mapping(start, end, parts[1], int(parts[2], 16), f"{int(major, 16)}:{int(minor, 16)}",
                        int(parts[4]), parts[5])  # fmt: skip
        except ValueError:
            continue
        if m.ino:
            out.append(m)
    return out


def mapped_files(pid: int) -> dict[tuple[str, int], str]:
    """("MAJ:MIN", inode) → path of every file ``pid`` has mapped."""
    out: dict[tuple[str, int], str] = {}
    for m in mappings(pid):
        out.setdefault((m.dev, m.ino), m.path)
    return out
