"""What /proc says about a thread's syscall, for real threads."""

from __future__ import annotations

import os
import subprocess
import sys
import time

from gputrace.probes import procfs


def test_blocked_syscall_of_a_reader_and_of_a_kernel_thread() -> None:
    r, w = os.pipe()
    p = subprocess.Popen([sys.executable, "-c", "import os, sys; os.read(int(sys.argv[1]), 1)", str(r)],
                         pass_fds=(r,))
    try:
        deadline = time.monotonic() + 10
        got = None
        while time.monotonic() < deadline:
            got = procfs.blocked_syscall(p.pid, p.pid)
            if got == (0, r) and procfs.thread_state(p.pid, p.pid) == "S":
                break
            time.sleep(0.01)
        assert got == (0, r)  # read(2) is nr 0 on x86_64, its first argument the fd
    finally:
        os.write(w, b"x")
        p.wait(10)
        os.close(r)
        os.close(w)
    # kthreadd's /proc/2/syscall is all zeros: not "blocked in read(0)"
    assert procfs.comm(2) == "kthreadd"
    assert procfs.blocked_syscall(2, 2) is None
