"""Who may ask gputraced for what: callers known by the kernel, targets they own.

Each request is authorised with the peer's SO_PEERCRED credentials: a caller may capture only processes that
exist and that it owns (real, effective and saved uid all equal to the caller's), root may capture any. The
caller and every target are pinned by pidfd where the kernel offers one, so each check is about the process
that was asked about, never about one that took its pid since.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from gputrace.daemon.service.protocol import ProtocolError
from gputrace.pidfds import close_pidfds, open_pidfd, peer_credentials, peer_pidfd, pidfd_exited


def process_uids(pid: int) -> tuple[int, int, int]:
    """(real, effective, saved) uid of a live process."""
    try:
        text = Path(f"/proc/{pid}/status").read_text(errors="replace")  # Name: any bytes
    except (FileNotFoundError, ProcessLookupError):
        raise ProtocolError(f"no process with pid {pid}") from None
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    if fields.get("State", "").strip()[:1] in ("Z", "X"):
        raise ProtocolError(f"process {pid} has exited")
    real, eff, saved = (int(x) for x in fields["Uid"].split()[:3])
    return real, eff, saved


@dataclass(frozen=True)
class Caller:
    """Who asked: the peer's SO_PEERCRED pid, uid and gid, and a pidfd pinning that process (None without
    SO_PEERPIDFD)."""

    pid: int
    uid: int
    gid: int
    pidfd: int | None


def caller_of(conn: socket.socket, creds: tuple[int, int, int] | None = None) -> Caller:
    """Who is on the other end of ``conn`` (``creds``: its SO_PEERCRED, when the caller read it already)."""
    pid, uid, gid = creds or peer_credentials(conn)
    try:
        return Caller(pid, uid, gid, peer_pidfd(conn))
    except ProcessLookupError:
        raise ProtocolError(f"caller pid {pid} has exited; request dropped") from None


def confirm_caller(caller: Caller) -> None:
    """The process that connected is still there and still has the uid it connected with. Checked through
    its pidfd, so never about a process that took its pid since; without SO_PEERPIDFD there is nothing to
    check and SO_PEERCRED's uid alone decides."""
    if caller.pidfd is None:
        return
    try:
        euid = process_uids(caller.pid)[1] if caller.pid > 0 else caller.uid  # 0: from another pid namespace
    except ProtocolError:
        euid = None
    if euid is None or pidfd_exited(caller.pidfd):
        raise ProtocolError(f"caller pid {caller.pid} has exited; request dropped")
    if euid != caller.uid:
        raise ProtocolError(f"caller pid {caller.pid} now runs as uid {euid}, not uid {caller.uid} as when it "
                            "connected; reconnect")


def authorize(uid: int, pids: list[int], *, on_checked: Callable[[int], None] | None = None) -> dict[int, int]:
    """Root may capture anything; anyone else only processes that are entirely theirs.

    Each pid is pinned (pidfd_open) before /proc is read, and its pidfd is confirmed not to have exited
    after: the check was about the process the pidfd refers to, not a successor that took its pid. Returns
    {pid: pidfd} (empty where the kernel has no pidfd_open); the caller owns them. ``on_checked(pid)`` runs
    between the /proc check and that confirmation (a seam for tests).
    """
    pinned: dict[int, int] = {}
    try:
        for pid in pids:
            pidfd = _pin(pid)
            if pidfd is not None:
                pinned[pid] = pidfd
            uids = process_uids(pid)
            if on_checked is not None:
                on_checked(pid)
            if pidfd is not None and pidfd_exited(pidfd):
                raise ProtocolError(f"process {pid} exited while being authorised")
            if uid != 0 and any(u != uid for u in uids):
                raise ProtocolError(f"not allowed: pid {pid} is not yours (uid {uids[1]}); "
                                    "only root may capture other users' processes")
            if uid != 0 and not dumpable_by(pid, uid):
                raise ProtocolError(f"not allowed: pid {pid} is not dumpable (it set PR_SET_DUMPABLE 0, or changed "
                                    "credentials); the kernel lets only root trace it, and so does gputraced")
    except BaseException:
        close_pidfds(pinned)
        raise
    return pinned


def dumpable_by(pid: int, uid: int) -> bool:
    """Whether ``uid`` could ptrace ``pid`` as far as dumpability goes (the kernel's ptrace_may_access): the
    kernel gives the files of a process's /proc directory to root while the process is not dumpable (prctl
    PR_SET_DUMPABLE 0, a setuid or file-capability exec, a credential change), and to its euid otherwise."""
    try:
        return os.stat(f"/proc/{pid}/status").st_uid == uid
    except FileNotFoundError:
        raise ProtocolError(f"no process with pid {pid}") from None


def _pin(pid: int) -> int | None:
    try:
        return open_pidfd(pid)
    except ProcessLookupError:
        if Path(f"/proc/{pid}").is_dir():
            raise ProtocolError(f"pid {pid} is a thread, not a process; give its process id") from None
        raise ProtocolError(f"no process with pid {pid}") from None
