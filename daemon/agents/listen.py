"""Session-side plumbing of the agent channel (server.py): listening sockets, also inside another process's root (a
container's), and the hand-off from the socket thread to the capture's sink."""

from __future__ import annotations

import contextlib
import ctypes
import os
import socket
import stat
import threading
from collections import deque
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from gputrace.daemon.attach import nsexec
from gputrace.errors import UserError
from gputrace.probes import procfs
from gputrace.source import Sink
from gputrace.threads import Thread


class Forwarder:
    """Bounded hand-off from the socket thread to the sink, in records and in bytes (as the batches came on the
    wire: a record's strings can be large); overflow is counted, never waited on."""

    def __init__(self, sink: Sink, limit: int, max_bytes: int = 1 << 62) -> None:
        self.sink, self.limit, self.max_bytes, self.dropped = sink, limit, max_bytes, 0
        self._batches: deque[tuple[Sequence[tuple[Any, ...]], int]] = deque()
        self._queued = 0
        self._queued_bytes = 0
        self._cond = threading.Condition()
        self._closing = False
        self._thread = Thread(target=self._run, name="gputrace-agents-fwd", daemon=True)
        self._thread.start()

    def put(self, records: Sequence[tuple[Any, ...]], nbytes: int = 0) -> None:
        with self._cond:
            if self._queued + len(records) > self.limit or self._queued_bytes + nbytes > self.max_bytes:
                self.dropped += len(records)
                return
            self._batches.append((records, nbytes))
            self._queued += len(records)
            self._queued_bytes += nbytes
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._batches and not self._closing:
                    self._cond.wait()
                if not self._batches:
                    return
                batch, nbytes = self._batches.popleft()
                self._queued -= len(batch)
                self._queued_bytes -= nbytes
            self.sink.emit(batch)

    def close(self) -> None:
        """Hand everything queued to the sink, then stop."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join()


def listen_at(path: Path) -> tuple[socket.socket, int]:
    """A listening socket at ``path`` and the inode it got (so we only ever remove our own)."""
    inode = procfs.unix_listener(str(path)) if path.is_socket() else 0
    if inode:
        holder = procfs.socket_holder(inode)
        service = _watch_service_socket(holder) if holder is not None else None
        if service is not None:
            pid = path.stem if path.stem.isdigit() else "PID"
            sock = f" --socket {service}" if service else ""
            raise UserError(f"{path} is the gputrace service's (pid {holder}), which watches that process: "
                            f"`gputrace daemon dump {pid}{sock}` writes what it recorded (one session at a time)")
        who = f" (pid {holder})" if holder is not None else ""
        raise UserError(f"{path} is another gputrace session's{who}, still live: that process is being captured "
                        "already (one session at a time; stop the other first)")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        if path.is_socket() or path.is_symlink():
            path.unlink()  # left by a session that died: nothing listens there
        s.bind(str(path))
        # Anyone may connect; only traced pids (checked by SO_PEERCRED) are listened to.
        os.chmod(path, 0o666)
        s.listen(64)
        ino = os.stat(path).st_ino
    except OSError as e:
        s.close()
        raise UserError(f"agent socket {path}: {e.strerror}") from None
    s.setblocking(False)
    return s, ino


def _watch_service_socket(pid: int) -> str | None:
    """Where process ``pid`` is the gputrace service in watch mode (``gputraced --watch`` or ``gputrace daemon
    --watch`` on its command line): the request socket it serves on when not the default, "" for the default;
    None where it is not that service."""
    from gputrace.daemon.service.server import DEFAULT_SOCKET

    info = procfs.proc_info(pid)
    argv = info.cmdline if info is not None else []
    if "--watch" not in argv or not any(a == "daemon" or a.endswith("gputraced") for a in argv):
        return None
    sock = ""
    for i, a in enumerate(argv):
        if a == "--socket" and i + 1 < len(argv):
            sock = argv[i + 1]
        elif a.startswith("--socket="):
            sock = a[len("--socket="):]
    return "" if sock == str(DEFAULT_SOCKET) else sock


def unlink_if_ours(path: Path, ino: int) -> None:
    with contextlib.suppress(OSError):
        if os.lstat(path).st_ino == ino:
            path.unlink()


class Listener:
    """A listening socket the session made at ``path`` (inode ``ino``), in a directory it holds open
    (``dir_fd``, for one inside another process's root, where ``path_inside`` is its path as seen there).
    ``files``: names of other files the session made in that directory, removed with the socket."""

    def __init__(self, sock: socket.socket, path: Path, ino: int, dir_fd: int | None = None,
                 path_inside: Path | None = None) -> None:
        self.sock, self.path, self.ino, self.dir_fd = sock, path, ino, dir_fd
        self.path_inside = path_inside or path
        self.files: list[str] = []
        self.pid = 0  # the process it was made for (the session's pid for it), when an offer
        self.closed = False

    def close(self) -> None:
        """Remove the socket file if it is still ours, and the other files; close everything."""
        if self.closed:
            return
        self.unlink()
        if self.dir_fd is not None:
            os.close(self.dir_fd)
        self.sock.close()
        self.closed = True

    def unlink(self) -> None:
        """Remove the socket file if it is still ours, and the other files (the sockets stay open)."""
        if self.closed:
            return
        if self.dir_fd is None:
            unlink_if_ours(self.path, self.ino)
            for name in self.files:
                with contextlib.suppress(OSError):
                    (self.path.parent / name).unlink()
        else:
            with contextlib.suppress(OSError):
                if os.stat(self.path.name, dir_fd=self.dir_fd, follow_symlinks=False).st_ino == self.ino:
                    os.unlink(self.path.name, dir_fd=self.dir_fd)
            for name in self.files:
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=self.dir_fd)


def own_namespace(pid: int, ns: str) -> bool:
    """Whether ``pid`` shares our namespace ``ns`` (an unreadable one counts as shared)."""
    try:
        a, b = os.stat(f"/proc/self/ns/{ns}"), os.stat(f"/proc/{int(pid)}/ns/{ns}")
    except OSError:
        return True
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def foreign_root(pid: int) -> bool:
    """Whether ``pid`` sees another filesystem than ours: another mount namespace or root. Our paths do not
    name its files then (a container's; or a host process seen from gputraced, whose /tmp is private), so
    what it must open is made through /proc/PID/root, in the directory as it sees it (``listen_in_root``).
    Whether that filesystem is a container's, to be entered, is another question: ``in_container``."""
    try:
        ours = [os.stat(f"/proc/self/{p}") for p in ("ns/mnt", "root")]
        theirs = [os.stat(f"/proc/{pid}/{p}") for p in ("ns/mnt", "root")]
    except OSError:
        return False
    return any((a.st_dev, a.st_ino) != (b.st_dev, b.st_ino) for a, b in zip(ours, theirs, strict=True))


def in_container(pid: int, ns: str) -> bool:
    """Whether ``pid``'s namespace ``ns`` is a container's: neither ours nor the host's (pid 1's), as the
    attach helper decides what to enter (gputrace.daemon.attach.nsexec.container_namespace). A host process is in
    none, even for gputraced, which runs in a mount and network namespace of its own. An unreadable one
    counts as shared."""
    try:
        proc = os.open(f"/proc/{int(pid)}", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        return nsexec.container_namespace(ns, proc)
    except OSError:
        return False
    finally:
        os.close(proc)


def container_root(pid: int) -> bool:
    """Whether ``pid``'s files are a container's (its mount namespace is one) or a chroot's: where the attach
    helper enters its root (gputrace.daemon.attach.nsexec.container_root). False for a host process, even seen from
    gputraced's own mount namespace; True when it cannot be told."""
    try:
        proc = os.open(f"/proc/{int(pid)}", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return foreign_root(pid)
    try:
        return nsexec.container_root(proc)
    except OSError:
        return True
    finally:
        os.close(proc)


def listen_in_root(pid: int, directory: Path, name: str) -> Listener:
    """A listening socket at ``directory/name`` as process ``pid`` sees it (inside its container).

    The directory is walked from the process's root one component at a time without following symlinks
    (a link planted in the container cannot send root's mkdir or chmod to a host path), and missing ones are
    made (0755). The socket is made world-connectable through a handle on the file just bound, never through
    its name. UserError says what was wrong."""
    where = f"{directory} in the root of pid {pid}"
    if not directory.is_absolute() or ".." in directory.parts or not name or "/" in name:
        raise UserError(f"agent socket {where}: not a plain absolute path")
    owner = owner_for(pid)
    try:
        root = os.open(f"/proc/{pid}/root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)
        with as_owner(owner):
            fd = _walk(root, directory.parts[1:])
    except OSError as e:
        raise UserError(f"agent socket {where}: {e.strerror or e} (a symlink on the way is refused)") from None
    try:
        with as_owner(owner):
            listener = _bind_in(fd, name)
    except OSError as e:
        os.close(fd)
        raise UserError(f"agent socket {where}/{name}: {e.strerror or e}") from None
    listener.path_inside = directory / name
    return listener


def owner_for(pid: int) -> tuple[int, int] | None:
    """Whose files we make for ``pid``: root's (None), unless it lives in another user namespace (a
    rootless container), where our root has no name (its file systems refuse files of unnamed owners) and
    its agent would not trust root's files; there, its own user's, the owner besides root it trusts."""
    if own_namespace(pid, "user"):
        return None
    try:
        st = os.stat(f"/proc/{pid}")
    except OSError:
        return None
    return st.st_uid, st.st_gid


@contextlib.contextmanager
def as_owner(owner: tuple[int, int] | None) -> Iterator[None]:
    """Files made by this thread meanwhile belong to ``owner`` (uid, gid), and access to existing ones is
    checked as theirs: the file-system ids, which are the calling thread's alone, are switched."""
    if owner is None:
        yield
        return
    libc = ctypes.CDLL(None, use_errno=True)
    old_gid = libc.setfsgid(owner[1])
    old_uid = libc.setfsuid(owner[0])
    try:
        yield
    finally:
        libc.setfsuid(old_uid)
        libc.setfsgid(old_gid)


def _walk(fd: int, parts: tuple[str, ...]) -> int:
    """The directory ``parts`` below ``fd`` (which it takes over), made where missing."""
    flags = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        for part in parts:
            try:
                nxt = os.open(part, flags, dir_fd=fd)
            except FileNotFoundError:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(part, 0o755, dir_fd=fd)
                nxt = os.open(part, flags, dir_fd=fd)
            os.close(fd)
            fd = nxt
    except BaseException:
        os.close(fd)
        raise
    return fd


def _bind_in(dir_fd: int, name: str) -> Listener:
    with contextlib.suppress(FileNotFoundError):
        old = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        if stat.S_ISSOCK(old.st_mode) or stat.S_ISLNK(old.st_mode):
            os.unlink(name, dir_fd=dir_fd)  # left by a session that died
    path = Path(f"/proc/self/fd/{dir_fd}") / name
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        s.bind(str(path))
        handle = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        try:
            st = os.fstat(handle)
            if not stat.S_ISSOCK(st.st_mode):
                raise OSError(f"{name} was replaced while it was being made")
            os.chmod(f"/proc/self/fd/{handle}", 0o666)
        finally:
            os.close(handle)
        s.listen(64)
    except BaseException:
        s.close()
        raise
    s.setblocking(False)
    return Listener(s, path, st.st_ino, dir_fd)
