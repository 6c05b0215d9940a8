"""What a process forked to share gputrace's work (a window's explanation, a part of a Perfetto trace) does to
stay out of the way, and how it sends its result back to the process that forked it."""

from __future__ import annotations

import ctypes
import os
import pickle
import signal
from typing import Any

PR_SET_PDEATHSIG = 1  # prctl(2): the signal a process gets when its parent dies
JOB_NICE = 10  # how much lower a forked process's CPU priority is than the one that forked it


def quiet_child(parent: int, nice: int = JOB_NICE) -> None:
    """A forked process leaves Ctrl-C to the one that forked it, ``parent`` (which ends it then), ends quietly
    when that one ends it (SIGTERM, SIGHUP: not the handlers it may have inherited, gputrace.cli's) and when that
    one dies (killed: nothing would read its results), and runs ``nice`` lower in CPU priority (by default
    ``JOB_NICE``: a job running beside it keeps the CPUs it needs)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGHUP, signal.SIG_DFL)
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
    if os.getppid() != parent:  # it died before that was set
        os._exit(1)
    if nice:
        os.nice(nice)


def send(fd: int, message: Any) -> None:
    """``message`` pickled, after its length, on the pipe ``fd``."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    view = memoryview(len(data).to_bytes(8, "little") + data)
    while view:
        view = view[os.write(fd, view):]


def receive_last(fd: int) -> Any:
    """The one message (``send``'s) a process wrote on the pipe ``fd`` before it ended, read to the end: None
    when it ended without one (or cut one off)."""
    chunks = []
    while chunk := os.read(fd, 1 << 20):
        chunks.append(chunk)
    data = b"".join(chunks)
    if len(data) < 8 or len(data) != 8 + int.from_bytes(data[:8], "little"):
        return None
    return pickle.loads(data[8:])


def ended_how(status: int) -> str:
    """How a process that was waited for ended, from its wait status (as a message says it)."""
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        return f"killed by {signal.Signals(sig).name}" + (" (out of memory?)" if sig == signal.SIGKILL else "")
    return f"exit status {os.WEXITSTATUS(status)}"
