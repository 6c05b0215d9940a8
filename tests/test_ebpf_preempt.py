"""Who had the CPU a traced thread waited for: each off-CPU record names the task the thread got its CPU
back from. A hog, a spinning process (preempted) and a sleeping one (woken, then waiting for the CPU) share
CPU 0."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from workloads.ebpfcap import ebpf_capture, of, read_capture

from gputrace.records import OffCpu

pytestmark = pytest.mark.kernel  # root and the host's kernel (see tests/conftest.py)

CHILD = """
import os, sys, time
os.sched_setaffinity(0, {0})
os.setpriority(os.PRIO_PROCESS, 0, -20)  # the three of them share CPU 0 among themselves, other work on the host aside
print(os.getpid(), flush=True)
if sys.argv[1] != "hog":
    sys.stdin.readline()  # starts once it is traced
end = time.monotonic() + (30 if sys.argv[1] == "hog" else 1.0)
while time.monotonic() < end:
    if sys.argv[1] == "sleep":
        time.sleep(0.002)
"""


def _start(kind: str) -> tuple[subprocess.Popen[str], int]:
    p = subprocess.Popen([sys.executable, "-c", CHILD, kind], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None
    return p, int(p.stdout.readline())


# One hook: the holder is read from `current` at the switch in, by code the raw and classic hooks share
# (tests/test_ebpf_hook.py checks the holder fields under both hooks).
@pytest.mark.parametrize("hook", ["raw"])
def test_off_cpu_records_name_the_task_that_had_the_cpu(tmp_path: Path, hook: str) -> None:
    procs = []
    try:
        for kind in ("hog", "spin", "sleep"):
            procs.append(_start(kind))
        (hog, _), (spin, _), (sleep, _) = procs
        with ebpf_capture(tmp_path / "p.gputrace", [spin.pid, sleep.pid], threshold_ns=1_000_000, sched_hook=hook):
            for p in (spin, sleep):
                assert p.stdin is not None
                p.stdin.write("go\n")
                p.stdin.flush()
            spin.wait(30)
            sleep.wait(30)
    finally:
        for p, _ in procs:
            p.kill()
            p.wait()
    records, _ = read_capture(tmp_path / "p.gputrace")
    offs = of(records, OffCpu)
    others = {(p.pid, p.pid): kind for (p, _), kind in zip(procs, ("hog", "spin", "sleep"), strict=True)}

    def holders(pid: int, state: str) -> list[str]:
        return [others.get((o.held_pid, o.held_tid), f"{o.held_pid}/{o.held_tid} {o.held_comm}") for o in offs
                if o.pid == pid and o.state == state and (state == "R" or o.wake_ns)]

    # the spinner, preempted: by the hog's turns, and by the sleeper's wakeups (it gets the CPU back from it)
    preempted = holders(spin.pid, "R")
    assert len(preempted) >= 5 and {"hog", "sleep"} <= set(preempted), preempted
    assert sum(h in ("hog", "sleep") for h in preempted) >= 0.8 * len(preempted), preempted
    woken = holders(sleep.pid, "S")  # the sleeper, woken and waiting behind the spinners
    assert len(woken) >= 20 and sum(h in ("hog", "spin") for h in woken) >= 0.8 * len(woken), woken
    assert all(not o.wake_ns and not o.waker_tid for o in offs if o.state == "R")  # no waker is made up
