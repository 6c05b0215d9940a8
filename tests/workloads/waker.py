"""Writes one line to a pipe once a given thread is blocked reading it; named ``gt-waker`` (its comm).

    python waker.py PID TID READ_NR FD

Waits by watching /proc/PID/task/TID/syscall until the thread sits in syscall READ_NR, so the write is
certain to wake it (no sleeping and hoping). Prints its own pid and tid before exiting.
"""

from __future__ import annotations

import ctypes
import os
import sys
import threading
import time

PR_SET_NAME = 15


def main() -> None:
    pid, tid, read_nr, fd = (int(a) for a in sys.argv[1:5])
    ctypes.CDLL(None).prctl(PR_SET_NAME, b"gt-waker", 0, 0, 0)
    path = f"/proc/{pid}/task/{tid}/syscall"
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        with open(path) as f:
            if f.read().split(" ", 1)[0] == str(read_nr):
                break
        os.sched_yield()
    else:
        sys.exit(f"thread {tid} never blocked in syscall {read_nr}")
    os.write(fd, b"woken")
    print(os.getpid(), threading.get_native_id(), flush=True)


if __name__ == "__main__":
    main()
