"""A workload driven line by line: each request is a line on its stdin, each answer a line on its stdout."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence


class PipedChild:
    """A child process started with pipes for stdin and stdout; subclasses add the workload's handshake."""

    def __init__(self, argv: Sequence[str], pass_fds: Sequence[int] = ()) -> None:
        self.proc = subprocess.Popen(list(argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                     pass_fds=tuple(pass_fds))  # fmt: skip

    @property
    def pid(self) -> int:
        return self.proc.pid

    def readline(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().strip()

    def send(self, line: str) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(line + "\n")
        self.proc.stdin.flush()

    def close(self) -> None:
        """End of input: the workload finishes its loop and exits."""
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait(timeout=10)
