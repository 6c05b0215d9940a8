"""What a syscall was waiting on, judged from its name and the object its fd refers to."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

SLEEP = frozenset({"nanosleep", "clock_nanosleep"})
POLLS = frozenset({"poll", "ppoll", "select", "pselect6", "epoll_wait", "epoll_pwait", "epoll_pwait2"})
WAIT = frozenset({
    "futex", "futex_waitv", "poll", "ppoll", "select", "pselect6", "epoll_wait", "epoll_pwait", "epoll_pwait2",
    "wait4", "waitid", "semop", "semtimedop", "msgrcv", "mq_timedreceive", "pause", "rt_sigtimedwait",
    "rt_sigsuspend", "sigsuspend", "flock",
})  # fmt: skip
FCNTL_LOCK_WAITS = (7, 38)  # F_SETLKW, F_OFD_SETLKW: blocked until the lock's holder lets go
FILE_IO = frozenset({
    "read", "pread64", "readv", "preadv", "preadv2", "write", "pwrite64", "writev", "pwritev", "pwritev2",
    "openat", "openat2", "open", "creat", "stat", "lstat", "fstat", "newfstatat", "statx", "access",
    "faccessat", "faccessat2", "getdents", "getdents64", "fsync", "fdatasync", "sync_file_range", "close",
    "readahead", "fadvise64", "mmap", "sendfile", "copy_file_range", "splice",
})  # fmt: skip
SOCKET_IO = frozenset({
    "recvfrom", "recvmsg", "recvmmsg", "sendto", "sendmsg", "sendmmsg", "connect", "accept", "accept4",
    "read", "readv", "write", "writev",
})  # fmt: skip

_PEER = re.compile(r"^(\[[0-9a-fA-F:.]+\]|[0-9]{1,3}(\.[0-9]{1,3}){3}|[A-Za-z0-9.-]+):[0-9]{1,5}$")
_KERNEL_COMMS = ("swapper", "kworker", "ksoftirqd", "irq/", "rcu_", "migration", "kthreadd", "jbd2", "loop")


def object_kind(obj: str) -> str:
    """file, peer (host:port), socket (unresolved or local), pipe, anon, or "" when unknown."""
    if not obj:
        return ""
    if obj.startswith("/"):
        return "socket" if obj.startswith("/dev/socket") else "file"
    if obj == "pipe" or obj.startswith("pipe:"):
        return "pipe"
    if obj == "socket" or obj.startswith(("socket:", "unix:", "@", "listen ", "sockaddr(")):
        return "socket"
    if obj.startswith("anon_inode:"):
        return "anon"
    if _PEER.match(obj):
        return "peer"
    return ""


def classify(sc: Any) -> str:
    """storage, network, sleep, wait (for another task), gpu (a driver call), uring (a wait for an io_uring
    ring's requests), or other."""
    name, kind = sc.name, object_kind(sc.obj)
    if name == "page_fault":  # a wait for a file mapping's page: the file's I/O, named or not
        return "storage"
    if name == "io_uring_enter":  # named by the ring's requests that completed meanwhile (analysis/uring.py)
        return "uring"
    if name in SLEEP:
        return "sleep"
    if kind == "peer" and name in POLLS:  # the socket polled, or the one found ready: its peer answered
        return "network"
    if name in WAIT or (name == "fcntl" and sc.arg in FCNTL_LOCK_WAITS):
        return "wait"
    if name == "ioctl":
        return "gpu" if "nvidia" in sc.obj else "other"
    if kind == "peer" and (name in SOCKET_IO or name.startswith(("recv", "send"))):
        return "network"
    if kind in ("pipe", "socket", "anon") and (name in SOCKET_IO or name.startswith(("recv", "send"))):
        return "wait"  # a pipe, a unix socket or an eventfd is filled by another task
    if name in FILE_IO and (kind == "file" or name.startswith(("open", "stat", "lstat", "newfstatat"))):
        return "storage"
    return "other"


def is_kernel_task(pid: int, comm: str) -> bool:
    """Wakeups from interrupts and kernel threads (block completion, timers) name no user-space culprit."""
    return pid <= 0 or comm.startswith(_KERNEL_COMMS)


class MountTable:
    """A capture's mount table (rows of mount point, filesystem type, source, MAJ:MIN; older captures' rows have
    the first two), asked which row holds a path: the longest mount point that is the path or one of its
    ancestors, the first row of equal ones. Looked up by the path's ancestors, a dictionary probe each, rather
    than by a scan of every row: a container host's table has hundreds."""

    def __init__(self, rows: Iterable[Any]) -> None:
        self._rows: list[list[str]] = []
        self._exact: dict[str, tuple[int, int]] = {}  # mount point -> (-its length, its row)
        self._under: dict[str, tuple[int, int]] = {}  # mount point less trailing "/" -> best (-length, row)
        for entry in rows:
            if not (isinstance(entry, (list, tuple)) and len(entry) >= 2):
                continue
            point = str(entry[0])
            rank = (-len(point), len(self._rows))
            self._rows.append([str(x) for x in entry])
            self._exact.setdefault(point, rank)
            key = point.rstrip("/")
            if key not in self._under or rank < self._under[key]:
                self._under[key] = rank

    def row(self, path: str) -> list[str]:
        """The row holding ``path`` (a fresh list of strings), or [] where none does."""
        best = self._exact.get(path)
        under = self._under
        i = path.find("/")
        while i >= 0:  # each ancestor: path[:i] + "/" begins the path
            rank = under.get(path[:i])
            if rank is not None and (best is None or rank < best):
                best = rank
            i = path.find("/", i + 1)
        return list(self._rows[best[1]]) if best is not None else []


def filesystem_of(path: str, mounts: MountTable) -> str:
    """The filesystem type of ``path`` from the capture's mount table."""
    entry = mounts.row(path)
    return entry[1] if entry else ""


def block_device_of(path: str, mounts: MountTable, names: dict[str, str]) -> list[str]:
    """Names a BlockIO record may give the device under ``path``: the mount source's name (/dev/loop3 ->
    loop3), the eBPF source's name for the mount's MAJ:MIN, and MAJ:MIN itself (a device it could not
    name). Rows from captures that predate the source and MAJ:MIN columns give none."""
    entry = mounts.row(path)
    if len(entry) < 4:
        return []
    source, majmin = entry[2], entry[3]
    out = [source.removeprefix("/dev/")] if source.startswith("/dev/") else []
    if majmin and not majmin.startswith("0:"):  # major 0: no block device (tmpfs, FUSE, NFS, btrfs subvols)
        out += [names.get(majmin, majmin), majmin]
    return list(dict.fromkeys(out))


REMOTE_FS = ("fuse", "nfs", "cifs", "smb3", "ceph", "9p", "glusterfs", "lustre", "gcsfuse", "s3fs")


def is_remote_fs(fstype: str) -> bool:
    return fstype.startswith(REMOTE_FS)
