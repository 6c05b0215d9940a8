"""Waiting for the event itself: a condition, a thread blocked in a system call, a line on a pipe, a socket
that accepts. Each wait has a generous deadline, only as the bound after which the test fails saying what it
waited for; none of them sleeps a fixed time and hopes.

Importable from every test (tests/ is on sys.path through tests/conftest.py).
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import IO, Any

from gputrace.probes import procfs

DEADLINE_S = 10.0


def wait_for(cond: Callable[[], Any], timeout_s: float = DEADLINE_S, what: str = "condition") -> Any:
    """``cond()``'s first truthy value, polled every 10 ms; AssertionError naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        value = cond()
        if value:
            return value
        time.sleep(0.01)
    raise AssertionError(f"timed out after {timeout_s:g} s waiting for {what}")


def blocked_in(pid: int, nr: int, tid: int | None = None, timeout_s: float = DEADLINE_S) -> None:
    """Until thread ``tid`` (default: the main thread) of ``pid`` sleeps in syscall ``nr``, read from
    /proc/PID/task/TID/syscall and its state: the handshake before a wait the test then measures or ends."""
    tid = pid if tid is None else tid

    def blocked() -> bool:
        got = procfs.blocked_syscall(pid, tid)
        return got is not None and got[0] == nr and procfs.thread_state(pid, tid) in ("S", "D")

    wait_for(blocked, timeout_s, f"tid {tid} of pid {pid} to block in syscall {nr}")


def connectable(path: Path, timeout_s: float = 30.0, alive: Callable[[], bool] | None = None) -> None:
    """Until a unix socket at ``path`` accepts a connection (its file alone may exist before listen());
    ``alive``, where given, fails the wait early once the server has died."""

    def accepts() -> bool:
        if alive is not None:
            assert alive(), f"the server of {path} exited before it listened"
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            try:
                s.connect(str(path))
            except OSError:
                return False
        return True

    wait_for(accepts, timeout_s, f"{path} to accept connections")


class LineLog:
    """A text stream (a child's stderr) read to its end by a thread of its own, so the child never blocks on
    a full pipe, and a test can wait for a line to appear."""

    def __init__(self, stream: IO[str]) -> None:
        self._lines: list[str] = []
        self._cond = threading.Condition()
        self._eof = False
        self._thread = threading.Thread(target=self._drain, args=(stream,), daemon=True)
        self._thread.start()

    def _drain(self, stream: IO[str]) -> None:
        for line in stream:
            with self._cond:
                self._lines.append(line)
                self._cond.notify_all()
        with self._cond:
            self._eof = True
            self._cond.notify_all()

    def wait_line(self, needle: str, timeout_s: float = 30.0) -> str:
        """The first line holding ``needle``; AssertionError after ``timeout_s`` or at the end of the stream."""
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                found = next((line for line in self._lines if needle in line), None)
                if found is not None:
                    return found
                left = deadline - time.monotonic()
                if self._eof or left <= 0:
                    tail = "".join(self._lines[-20:])
                    raise AssertionError(f"no line with {needle!r} ({'stream ended' if self._eof else 'timed out'})"
                                         f"; last lines:\n{tail}")
                self._cond.wait(left)

    def text(self, timeout_s: float = 30.0) -> str:
        """Everything read, once the stream has ended (the child closed it or exited)."""
        self._thread.join(timeout_s)
        with self._cond:
            return "".join(self._lines)
