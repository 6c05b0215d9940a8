"""A cgroup v1 cpu group with a CPU quota (a container's CPU limit), and a spinner to throttle in it."""

from __future__ import annotations

import contextlib
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

CPU = Path("/sys/fs/cgroup/cpu")

# Joins the cgroup given, then uses CPU time (not wall time: throttled time must not count) until the cgroup's
# nr_throttled has grown by N, and exits
SPINNER = r"""
import os, sys, time
group, n = sys.argv[1], int(sys.argv[2])
def throttled():
    with open(os.path.join(group, "cpu.stat")) as f:
        return next(int(l.split()[1]) for l in f if l.startswith("nr_throttled "))
with open(os.path.join(group, "cgroup.procs"), "w") as f:
    f.write(str(os.getpid()))
first = throttled()
while throttled() < first + n:
    end = time.thread_time_ns() + 1_000_000
    while time.thread_time_ns() < end:
        pass
"""


@contextlib.contextmanager
def cpu_cgroup(quota_us: int, period_us: int, shares: int = 0) -> Iterator[Path]:
    """A v1 cpu group allowed ``quota_us`` of CPU per ``period_us`` (and ``shares``, its weight against the
    tasks beside it, where given); the v1 cpu controller is mounted at
    /sys/fs/cgroup/cpu first where it is not (and unmounted after). The group is removed after its last
    member has gone."""
    mounted = False
    if not (CPU / "cpu.cfs_quota_us").exists():
        CPU.mkdir(exist_ok=True)
        r = subprocess.run(["mount", "-t", "cgroup", "-o", "cpu", "cgroup", str(CPU)], capture_output=True, text=True)
        if r.returncode != 0:
            raise RuntimeError(f"cannot mount the v1 cpu controller at {CPU}: {r.stderr.strip()}")
        mounted = True
    g = CPU / f"gputrace-test-{os.getpid()}-{time.monotonic_ns()}"
    try:
        g.mkdir()
        (g / "cpu.cfs_period_us").write_text(f"{period_us}\n")
        (g / "cpu.cfs_quota_us").write_text(f"{quota_us}\n")
        if shares:
            (g / "cpu.shares").write_text(f"{shares}\n")
        yield g
    finally:
        remove_group(g)
        if mounted:
            subprocess.run(["umount", str(CPU)], check=False, capture_output=True)


def remove_group(g: Path) -> None:
    """rmdir once empty: a member reaped by its parent may still be leaving the group (the kernel moves it out
    as it exits), so the group's own cgroup.procs is read until it is empty."""
    if not g.exists():
        return
    deadline = time.monotonic() + 10
    while (g / "cgroup.procs").read_text().strip() and time.monotonic() < deadline:
        time.sleep(0.01)
    g.rmdir()
