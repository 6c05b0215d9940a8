"""Starting `-- CMD` held at a handshake, so tracing is attached before its first instruction runs."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import signal
from collections.abc import Mapping, Sequence

from gputrace.errors import UserError
from gputrace.signals import INHERITED_IGNORED


class HeldChild:
    """A forked child that waits on a pipe before exec'ing the command."""

    def __init__(self, argv: Sequence[str], env: Mapping[str, str]) -> None:
        exe = shutil.which(argv[0])
        if exe is None:
            raise UserError(_not_runnable(argv[0]))
        rfd, self._wfd = os.pipe2(os.O_CLOEXEC)
        errr, errw = os.pipe2(os.O_CLOEXEC)
        self.pid = os.fork()
        if self.pid == 0:  # pragma: no cover - the child only execs
            _child(rfd, self._wfd, errw, exe, list(argv), dict(env))
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


def _not_runnable(cmd: str) -> str:
    """Why shutil.which found nothing for ``cmd``."""
    if "/" in cmd and os.path.exists(cmd):
        if os.path.isdir(cmd):
            return f"cannot run {cmd}: it is a directory"
        return f"cannot run {cmd}: not executable (chmod +x, or run it through its interpreter)"
    return f"command not found: {cmd}"


def _child(rfd: int, wfd: int, errw: int, exe: str, argv: list[str], env: dict[str, str]) -> None:  # pragma: no cover
    try:
        os.close(wfd)  # the parent's end: if the parent dies before releasing us, the read sees EOF
        # The command gets the dispositions a shell would give it: Python ignores SIGPIPE and SIGXFSZ (execve
        # keeps an ignored signal ignored: `yes | head` would print "Broken pipe"), and our handlers for
        # SIGINT, SIGTERM and SIGHUP must not run Python code here before the exec: they go back to what
        # gputrace was started with (ignored under nohup, or in a script's background job; else default).
        for sig in (signal.SIGPIPE, signal.SIGXFSZ, signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, signal.SIG_IGN if sig in INHERITED_IGNORED else signal.SIG_DFL)
        if os.read(rfd, 2) != b"go":
            os._exit(127)
        try:
            os.execve(exe, argv, env)
        except OSError as e:
            if e.errno != errno.ENOEXEC:
                raise
            # A script with no #! line: run by /bin/sh, as execvp(3) and every shell do
            os.execve("/bin/sh", ["/bin/sh", exe, *argv[1:]], env)
    except OSError as e:
        os.write(errw, f"cannot run {argv[0]}: {_exec_failure(exe, e)}".encode())
    os._exit(127)


def _exec_failure(exe: str, e: OSError) -> str:
    """Why execve failed; for a script whose #! interpreter is missing, that interpreter, not the script."""
    if e.errno == errno.ENOENT and os.path.exists(exe):
        try:
            with open(exe, "rb") as f:
                first = f.readline(256)
        except OSError:
            first = b""
        if first.startswith(b"#!"):
            interp = first[2:].strip().split(b" ")[0].decode(errors="replace")
            return f"its interpreter {interp} (from its #! line) was not found"
    return e.strerror or str(e)
