"""Starting `-- CMD` held at a handshake, so tracing is attached before its first instruction runs."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
from collections.abc import Mapping, Sequence

from gputrace.errors import UserError


class HeldChild:
    """A forked child that waits on a pipe before exec'ing the command."""

    def __init__(self, argv: Sequence[str], env: Mapping[str, str]) -> None:
        exe = shutil.which(argv[0])
        if exe is None:
            raise UserError(f"command not found: {argv[0]}")
        rfd, self._wfd = os.pipe2(os.O_CLOEXEC)
        errr, errw = os.pipe2(os.O_CLOEXEC)
        self.pid = os.fork()
        if self.pid == 0:  # pragma: no cover - the child only execs
            _child(rfd, errw, exe, list(argv), dict(env))
        os.close(rfd)
        os.close(errw)
        self._errr = errr
        self.status: int | None = None
        self.released = False

    def release(self) -> None:
        """Let the command run; raise if it could not be executed."""
        os.write(self._wfd, b"go")
        os.close(self._wfd)
        self.released = True
        msg = os.read(self._errr, 4096)  # EOF on successful exec (CLOEXEC)
        os.close(self._errr)
        if msg:
            self.wait()
            raise UserError(msg.decode(errors="replace"))

    def kill(self) -> None:
        if self.status is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)
            self.wait()

    def poll(self) -> int | None:
        if self.status is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.status = os.waitstatus_to_exitcode(status)
        return self.status

    def wait(self) -> int:
        if self.status is None:
            _, status = os.waitpid(self.pid, 0)
            self.status = os.waitstatus_to_exitcode(status)
        return self.status

    @property
    def exit_code(self) -> int:
        """As a shell reports it: 128 + N for death by signal N."""
        status = self.wait()
        return 128 - status if status < 0 else status


def _child(rfd: int, errw: int, exe: str, argv: list[str], env: dict[str, str]) -> None:  # pragma: no cover
    try:
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        if os.read(rfd, 2) != b"go":
            os._exit(127)
        os.execve(exe, argv, env)
    except OSError as e:
        os.write(errw, f"cannot run {argv[0]}: {e.strerror}".encode())
    os._exit(127)
