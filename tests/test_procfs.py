"""What /proc says about a thread's syscall, for real threads."""

from __future__ import annotations

import os
import subprocess
import sys

from agent_harness import wait_for

from gputrace.probes import procfs


def test_blocked_syscall_of_a_reader_and_of_a_kernel_thread() -> None:
    r, w = os.pipe()
    p = subprocess.Popen([sys.executable, "-c", "import os, sys; os.read(int(sys.argv[1]), 1)", str(r)],
                         pass_fds=(r,))
    try:
        wait_for(lambda: procfs.thread_state(p.pid, p.pid) == "S" and procfs.blocked_syscall(p.pid, p.pid) == (0, r),
                 10, "the reader to block")
        assert procfs.blocked_syscall(p.pid, p.pid) == (0, r)  # read(2) is nr 0 on x86_64, its first argument the fd
    finally:
        os.write(w, b"x")
        p.wait(10)
        os.close(r)
        os.close(w)
    # kthreadd's /proc/2/syscall is all zeros: not "blocked in read(0)"
    assert procfs.comm(2) == "kthreadd"
    assert procfs.blocked_syscall(2, 2) is None
