"""Who had the CPU a traced thread waited for: each off-CPU record names the task the thread got its CPU
back from. Here a hog pinned to the same CPU, for a spinning thread (preempted) and a sleeping one (woken,
then waiting behind the hog)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from workloads.ebpfcap import ebpf_capture, of, read_capture

from gputrace.records import OffCpu

CHILD = """
import os, sys, time
os.sched_setaffinity(0, {0})
print(os.getpid(), flush=True)
if sys.argv[1] != "hog":
    sys.stdin.readline()  # starts once it is traced
end = time.monotonic() + (30 if sys.argv[1] == "hog" else 1.0)
while time.monotonic() < end:
    if sys.argv[1] == "sleep":
        time.sleep(0.002)
"""


def _held_by_hog(tmp_path: Path, hook: str, kind: str) -> tuple[list[OffCpu], int]:
    hog = subprocess.Popen([sys.executable, "-c", CHILD, "hog"], stdout=subprocess.PIPE, text=True)
    child = None
    try:
        assert hog.stdout is not None and int(hog.stdout.readline()) == hog.pid
        child = subprocess.Popen([sys.executable, "-c", CHILD, kind], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 text=True)
        assert child.stdout is not None and child.stdin is not None
        assert int(child.stdout.readline()) == child.pid
        with ebpf_capture(tmp_path / f"{kind}.gputrace", [child.pid], threshold_ns=1_000_000, sched_hook=hook):
            child.stdin.write("go\n")
            child.stdin.flush()
            child.wait(30)
    finally:
        for p in (hog, child):
            if p is not None:
                p.kill()
                p.wait()
    records, _ = read_capture(tmp_path / f"{kind}.gputrace")
    return [o for o in of(records, OffCpu) if o.pid == child.pid], hog.pid


@pytest.mark.parametrize("hook", ["raw", "classic"])
def test_a_preempted_thread_names_the_task_that_had_its_cpu(tmp_path: Path, hook: str) -> None:
    offs, hog = _held_by_hog(tmp_path, hook, "spin")
    preempted = [o for o in offs if o.state == "R"]
    assert len(preempted) >= 5, offs[:5]  # two spinners share one CPU for 1 s
    by_hog = [o for o in preempted if (o.held_pid, o.held_tid) == (hog, hog)]
    assert len(by_hog) >= 0.8 * len(preempted), [(o.held_pid, o.held_tid, o.held_comm) for o in preempted]
    assert all(o.held_comm.startswith("python") for o in by_hog), by_hog[:3]
    assert all(not o.wake_ns and not o.waker_tid for o in preempted)  # no waker is made up


@pytest.mark.parametrize("hook", ["raw", "classic"])
def test_a_woken_thread_names_the_task_it_waited_behind(tmp_path: Path, hook: str) -> None:
    offs, hog = _held_by_hog(tmp_path, hook, "sleep")
    woken = [o for o in offs if o.state == "S" and o.wake_ns]
    assert len(woken) >= 20, offs[:5]  # 2 ms sleeps for 1 s, each >= the 1 ms threshold
    by_hog = [o for o in woken if (o.held_pid, o.held_tid) == (hog, hog)]
    assert len(by_hog) >= 0.8 * len(woken), [(o.held_pid, o.held_tid, o.held_comm) for o in woken]
