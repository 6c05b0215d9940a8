"""Peers and pidfds: who is on the other end of a unix socket, and handles that name one process for good.

A pid names whichever process holds it now; a pidfd names one process for good. Checking a process through
/proc and then confirming its pidfd has not exited proves the check was about that process: its pid cannot
pass to another before it exits. Who is on the other end of a unix socket comes from the kernel (SO_PEERCRED,
SO_PEERPIDFD), never from anything the peer sent. The service authorises callers with these; the capture
session knows its agents by them.
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import socket
import struct
from collections.abc import Callable

SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)  # Linux 6.5; Python 3.11 does not name it


def peer_credentials(conn: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the connected peer, from the kernel (SO_PEERCRED), not from anything it sent."""
    data = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", data)
    return pid, uid, gid


def peer_pidfd(conn: socket.socket) -> int | None:
    """A pidfd for the process that connected ``conn`` (SO_PEERPIDFD), or None where the kernel has none.

    Raises ProcessLookupError when the peer is already gone and the kernel cannot pin it (before 6.16).
    """
    try:
        return conn.getsockopt(socket.SOL_SOCKET, SO_PEERPIDFD)
    except OSError as e:
        if e.errno == errno.ENOPROTOOPT:
            return None
        if e.errno in (errno.ESRCH, errno.EINVAL, errno.ENODATA):
            raise ProcessLookupError(e.errno, "peer has exited") from None
        raise


def open_pidfd(pid: int) -> int | None:
    """pidfd_open(pid), or None where the kernel (or a seccomp filter) does not offer it.

    Raises ProcessLookupError when no process has that pid (a thread id is not a process).
    """
    try:
        return os.pidfd_open(pid)
    except OSError as e:
        if e.errno in (errno.ENOSYS, errno.EPERM):
            return None
        if e.errno in (errno.ESRCH, errno.ENOENT, errno.EINVAL):
            raise ProcessLookupError(e.errno, f"no process {pid}") from None
        raise


def pidfd_exited(pidfd: int) -> bool:
    """Whether the process behind ``pidfd`` has exited: a pidfd polls readable from then on."""
    poller = select.poll()
    poller.register(pidfd, select.POLLIN)
    return bool(poller.poll(0))


def pidfd_support() -> tuple[bool, bool]:
    """(SO_PEERPIDFD, pidfd_open) on this kernel: probed, never guessed from its version."""
    return _works(_own_peer_pidfd), _works(lambda: open_pidfd(os.getpid()))


def _own_peer_pidfd() -> int | None:
    a, b = socket.socketpair()
    with a, b:
        return peer_pidfd(a)


def _works(get: Callable[[], int | None]) -> bool:
    try:
        fd = get()
    except OSError:
        return False
    if fd is not None:
        os.close(fd)
    return fd is not None


def close_pidfds(pidfds: dict[int, int]) -> None:
    for fd in pidfds.values():
        with contextlib.suppress(OSError):
            os.close(fd)
