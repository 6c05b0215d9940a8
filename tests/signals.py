"""A program run with a signal's default action, whatever this run inherited: ``nohup`` ignores SIGHUP, a shell's
background job SIGINT, and an ignored signal stays ignored across exec. The action is set by a small Python that
then execs the program: nothing runs between fork and exec in this process (a ``preexec_fn`` would, in a child
of a process with threads: a gRPC server's, say).

Importable from every test (tests/ is on sys.path through tests/conftest.py).
"""

from __future__ import annotations

import signal
import sys

_RESET = "import os, signal, sys; signal.signal(int(sys.argv[1]), signal.SIG_DFL); os.execv(sys.argv[2], sys.argv[2:])"


def with_default(sig: signal.Signals, argv: list[str]) -> list[str]:
    """The command line that runs ``argv`` (its first word a path) with ``sig``'s default action."""
    return [sys.executable, "-c", _RESET, str(int(sig)), *argv]
