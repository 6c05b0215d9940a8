"""A preempted thread's off-CPU record names the task its CPU went to: here a hog pinned to the same CPU."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from workloads.ebpfcap import ebpf_capture, of, read_capture

from gputrace.records import OffCpu

SPIN = """
import os, sys, time
os.sched_setaffinity(0, {0})
print(os.getpid(), flush=True)
if len(sys.argv) < 3:
    sys.stdin.readline()  # the victim spins once it is traced
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    pass
"""


@pytest.mark.parametrize("hook", ["raw", "classic"])
def test_a_preempted_thread_names_the_task_that_took_its_cpu(tmp_path: Path, hook: str) -> None:
    hog = subprocess.Popen([sys.executable, "-c", SPIN, "30", "hog"], stdout=subprocess.PIPE, text=True)
    victim = None
    try:
        assert hog.stdout is not None and int(hog.stdout.readline()) == hog.pid
        victim = subprocess.Popen([sys.executable, "-c", SPIN, "1.5"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True)
        assert victim.stdout is not None and victim.stdin is not None
        assert int(victim.stdout.readline()) == victim.pid
        with ebpf_capture(tmp_path / "p.gputrace", [victim.pid], threshold_ns=1_000_000, sched_hook=hook):
            victim.stdin.write("go\n")
            victim.stdin.flush()
            victim.wait(30)
            time.sleep(0.1)
    finally:
        for p in (hog, victim):
            if p is not None:
                p.kill()
                p.wait()
    records, _ = read_capture(tmp_path / "p.gputrace")
    preempted = [o for o in of(records, OffCpu) if o.pid == victim.pid and o.state == "R"]
    assert len(preempted) >= 5, of(records, OffCpu)[:5]  # two spinners share one CPU for 1.5 s
    to_hog = [o for o in preempted if o.ran_tid == hog.pid]
    assert len(to_hog) >= 0.8 * len(preempted), [(o.ran_pid, o.ran_tid, o.ran_comm) for o in preempted]
    assert all(o.ran_comm == "python3" or o.ran_comm.startswith("python") for o in to_hog), to_hog[:3]
    # the raw hook reads the task's process id too; the classic tracepoint has only its tid
    assert all(o.ran_pid == (hog.pid if hook == "raw" else 0) for o in to_hog), to_hog[:3]
    assert all(not o.wake_ns and not o.waker_tid for o in preempted)  # no waker is made up
    assert os.sched_getaffinity(0)  # the test process itself was never pinned
