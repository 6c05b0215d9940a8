"""Session-side plumbing of the agent channel (daemon/agents.py): listening sockets and the hand-off
from the socket thread to the capture's sink."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from gputrace.errors import UserError
from gputrace.source import Sink


class Forwarder:
    """Bounded hand-off from the socket thread to the sink; overflow is counted, never waited on."""

    def __init__(self, sink: Sink, limit: int) -> None:
        self.sink, self.limit, self.dropped = sink, limit, 0
        self._batches: deque[Sequence[tuple[Any, ...]]] = deque()
        self._queued = 0
        self._cond = threading.Condition()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name="gputrace-agents-fwd", daemon=True)
        self._thread.start()

    def put(self, records: Sequence[tuple[Any, ...]]) -> None:
        with self._cond:
            if self._queued + len(records) > self.limit:
                self.dropped += len(records)
                return
            self._batches.append(records)
            self._queued += len(records)
            self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._batches and not self._closing:
                    self._cond.wait()
                if not self._batches:
                    return
                batch = self._batches.popleft()
                self._queued -= len(batch)
            self.sink.emit(batch)

    def close(self) -> None:
        """Hand everything queued to the sink, then stop."""
        with self._cond:
            self._closing = True
            self._cond.notify()
        self._thread.join()


def listen_at(path: Path) -> tuple[socket.socket, int]:
    """A listening socket at ``path`` and the inode it got (so we only ever remove our own)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        if path.is_socket() or path.is_symlink():
            path.unlink()  # left by a session that died; a live one would own a fresh inode
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


def unlink_if_ours(path: Path, ino: int) -> None:
    with contextlib.suppress(OSError):
        if os.lstat(path).st_ino == ino:
            path.unlink()
