"""The session's agent-socket directory: made so that a later session can tell whether its owner still runs.

A session killed with SIGKILL cannot remove its directory, so the name says whose it is: the session's pid
namespace, pid and that process's start time (``gputrace-agent.NS.PID.START.XXXXXXXX``). The start time tells
a reused pid apart; the namespace keeps a session from judging pids it cannot see (another pid namespace
sharing this /tmp). Being in the name, these are there from the moment the directory exists: no window in
which a directory lies without its owner recorded.

Each new session removes the directories of dead sessions before it makes its own
(:func:`remove_stale_socket_dirs`), and only those that are unmistakably a session's of this user: a real
directory (never a link, never followed), owned by this effective uid, mode 0711 as made, named as above, in
this pid namespace, its process gone (or a zombie). Inside, only the entries a session makes are removed (its
socket, injected scripts), each by name relative to the directory's descriptor, never following a link; an
injected script whose process is still alive is kept with its directory, as the session itself keeps it
(daemon/agents/server.py, keep_unrun_scripts).
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import stat
import tempfile
from pathlib import Path

PREFIX = "gputrace-agent."
MODE = 0o711  # any traced process may pass through to the socket; nobody else may list or write
SOCKET = "agent.sock"
# mkdtemp's random part: 8 of [a-z0-9_]
_NAME_RE = re.compile(r"gputrace-agent\.(\d+)\.(\d+)\.(\d+)\.[a-z0-9_]{8}")
_SCRIPT_RE = re.compile(r"inject-(\d+)\.py")


def _pid_ns() -> int:
    return os.stat("/proc/self/ns/pid").st_ino


def _start_time(pid: int) -> tuple[int, str] | None:
    """(start time in clock ticks since boot, state letter) of ``pid``, or None when it does not exist."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            text = f.read().decode("ascii", "replace")
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = text[text.rfind(")") + 2:].split()  # comm may hold spaces and parentheses
    return int(fields[19]), fields[0]


def _alive(pid: int, start: int) -> bool:
    """Whether the process that had ``pid`` at ``start`` still runs (a zombie holds no socket: it does not)."""
    now = _start_time(pid)
    return now is not None and now[0] == start and now[1] != "Z"


def make_socket_dir(base: str | None = None) -> Path:
    """A new 0711 directory for this session's agent socket, named after this process (see the module)."""
    me = os.getpid()
    start = _start_time(me)
    assert start is not None
    path = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{_pid_ns()}.{me}.{start[0]}.", dir=base))
    os.chmod(path, MODE)  # mkdtemp makes it 0700; the socket must be reachable by traced processes of any user
    return path


def remove_stale_socket_dirs(base: str | None = None) -> list[str]:
    """Remove the socket directories of this user's sessions that are gone; returns the names removed.

    Never raises for what it finds: a directory it cannot judge or empty is left as it is."""
    base = base or tempfile.gettempdir()
    try:
        base_fd = os.open(base, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return []
    removed = []
    try:
        ns, me = _pid_ns(), os.geteuid()
        for name in os.listdir(base_fd):
            m = _NAME_RE.fullmatch(name)
            if m is None or int(m[1]) != ns or int(m[2]) == os.getpid():
                continue
            if _alive(int(m[2]), int(m[3])):
                continue
            with contextlib.suppress(OSError):
                if _remove_one(base_fd, name, me):
                    removed.append(name)
    finally:
        os.close(base_fd)
    return removed


def _remove_one(base_fd: int, name: str, uid: int) -> bool:
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=base_fd)
    except OSError as e:
        if e.errno in (errno.ELOOP, errno.ENOTDIR, errno.ENOENT):
            return False  # a link or a file by our name (planted, or not ours): left alone
        raise
    try:
        st = os.fstat(fd)
        if st.st_uid != uid or stat.S_IMODE(st.st_mode) != MODE:
            return False  # someone else's, or changed since it was made: not ours to judge
        doomed = []
        for entry in os.listdir(fd):
            est = os.stat(entry, dir_fd=fd, follow_symlinks=False)
            script = _SCRIPT_RE.fullmatch(entry)
            sock = entry == SOCKET and stat.S_ISSOCK(est.st_mode)
            if sock or (script is not None and stat.S_ISREG(est.st_mode) and _start_time(int(script[1])) is None):
                doomed.append(entry)
            else:
                # Something no session makes (not ours to remove), or an injected script whose process lives:
                # its sys.remote_exec request cannot be withdrawn, and the script gone, it would print a
                # traceback into that process's stderr. The directory stays, whole.
                return False
        for entry in doomed:
            os.unlink(entry, dir_fd=fd)
    finally:
        os.close(fd)
    os.rmdir(name, dir_fd=base_fd)
    return True
