"""Threads named for the OS as for Python: ``top -H``, ``ps -T`` and /proc/PID/task/TID/comm then tell the
service's drain from its writers, agent servers and each job's session (Python before 3.14 names a thread for
itself only; the OS showed every one as the process)."""

from __future__ import annotations

import contextlib
import threading

PREFIXES = ("gputraced-", "gputrace-")  # the process is gputrace's already: shown as "gt-"
COMM_BYTES = 15  # the kernel keeps a task's name in 16 bytes, the last a NUL


def os_name(name: str) -> str:
    """``name`` as the OS shows it: gputrace's prefix made ``gt-``, cut to what the kernel keeps."""
    for prefix in PREFIXES:
        if name.startswith(prefix):
            name = "gt-" + name[len(prefix) :]
            break
    return name.encode("utf-8", "replace")[:COMM_BYTES].decode("utf-8", "ignore")


def name_this_thread(name: str) -> None:
    """The calling thread's OS name (``os_name``); a /proc that cannot be written leaves it as it was."""
    with contextlib.suppress(OSError), open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as f:
        f.write(os_name(name))


class Thread(threading.Thread):
    """A ``threading.Thread`` whose OS thread takes its name as it starts."""

    def run(self) -> None:
        name_this_thread(self.name)
        super().run()
