"""Least privilege for gputraced: the capabilities it keeps, and pidfds that pin the processes it authorises.

drop_privileges is called before any thread exists (capset changes only the calling thread; threads started
later inherit it). The same set is the systemd unit's CapabilityBoundingSet; each is justified there and here.

A pid names whichever process holds it now; a pidfd names one process for good. Checking a process through
/proc and then confirming its pidfd has not exited proves the check was about that process: its pid cannot
pass to another before it exits. Who is on the other end of a unix socket comes from the kernel (SO_PEERCRED,
SO_PEERPIDFD), never from anything the peer sent.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import select
import socket
import struct
from collections.abc import Callable
from pathlib import Path

SO_PEERPIDFD = getattr(socket, "SO_PEERPIDFD", 77)  # Linux 6.5; Python 3.11 does not name it

KEEP = {
    0: "CAP_CHOWN",             # hand finished captures to the caller (fchown)
    1: "CAP_DAC_OVERRIDE",      # link them into the caller's 0700 directory
    2: "CAP_DAC_READ_SEARCH",   # tracefs (root-only) and other users' files named by /proc links
    6: "CAP_SETGID",            # run the attach helper (sys.remote_exec) as the target's own user, never as
    7: "CAP_SETUID",            #   root: it executes the target's interpreter, a file its user chose
    19: "CAP_SYS_PTRACE",       # /proc/PID/fd, maps, exe of other users' processes; uprobes on their libcuda
    24: "CAP_SYS_RESOURCE",     # raise RLIMIT_MEMLOCK for BPF maps on kernels that still charge it
    38: "CAP_PERFMON",          # attach tracepoints and uprobes (perf_event_open), read kernel data in BPF
    39: "CAP_BPF",              # load BPF programs, create maps and ring buffers
}
_PR_CAPBSET_DROP = 24
_PR_SET_NO_NEW_PRIVS = 38
_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
_LINUX_CAPABILITY_VERSION_3 = 0x20080522


class _Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _Data(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _caps(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1], 16)
    return 0


def drop_privileges(keep: dict[int, str] | None = None) -> str:
    """Shrink the bounding, ambient, permitted and effective sets to ``keep``; set no_new_privs.

    Returns a line for the log naming what was kept.
    """
    keep = KEEP if keep is None else keep
    libc = ctypes.CDLL(None, use_errno=True)
    last = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    for cap in range(last + 1):
        if cap not in keep:
            libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0)  # fails without CAP_SETPCAP: capset below still applies
    libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    mask = sum(1 << c for c in keep) & _caps("CapPrm")
    header = _Header(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (_Data * 2)(_Data(mask & 0xFFFFFFFF, mask & 0xFFFFFFFF, 0), _Data(mask >> 32, mask >> 32, 0))
    if libc.capset(ctypes.byref(header), data) != 0:
        err = ctypes.get_errno()
        return f"could not drop capabilities (errno {err}); running with {_caps('CapEff'):#x}"
    libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    kept = [name for cap, name in sorted(keep.items()) if mask >> cap & 1]
    return f"capabilities kept: {', '.join(kept) or 'none'}"


# -------------------------------------------------------------------------------- peers and pidfds ---


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
