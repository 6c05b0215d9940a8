"""Threads still waiting when a capture stops are recorded: what a hung job is stuck in, real kernel."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from waiting import blocked_in
from workloads.ebpfcap import ebpf_capture, of, read_capture

from gputrace.analysis import analyze, summary_lines
from gputrace.capture import open_capture
from gputrace.records import InProgress

pytestmark = pytest.mark.kernel  # root and the host's kernel (see tests/conftest.py)
READ_NR = {"x86_64": 0, "aarch64": 63}[os.uname().machine]

# The main thread blocks reading a FIFO at once (before tracing begins); on "go" a second thread starts,
# prints its tid and blocks reading a pipe nobody writes.
STUCK = """
import os, sys, threading
fd = os.open(sys.argv[1], os.O_RDWR)
def late():
    sys.stdin.readline()
    r, w = os.pipe()
    print(threading.get_native_id(), flush=True)
    os.read(r, 1)
threading.Thread(target=late, daemon=True).start()
print(threading.get_native_id(), flush=True)
os.read(fd, 1)
"""


def test_blocked_calls_are_recorded_at_stop(tmp_path: Path) -> None:
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    proc = subprocess.Popen([sys.executable, "-c", STUCK, str(fifo)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None
    try:
        main_tid = int(proc.stdout.readline())
        blocked_in(proc.pid, READ_NR)  # in read() before tracing begins
        out = tmp_path / "stuck.gputrace"
        with ebpf_capture(out, [proc.pid], threshold_ns=100_000):
            began = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
            proc.stdin.write("go\n")
            proc.stdin.flush()
            late_tid = int(proc.stdout.readline())
            blocked_in(proc.pid, READ_NR, tid=late_tid)
            time.sleep(0.3)  # how long it has waited at stop: the time measured below
            stopped = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
    finally:
        proc.kill()
        proc.wait()
    records, _ = read_capture(out)
    waiting = {r.tid: r for r in of(records, InProgress)}
    old, new = waiting[main_tid], waiting[late_tid]
    # blocked since before tracing: named from /proc, dated from when tracing began, flagged as such
    assert (old.pid, old.name, old.obj, old.state, old.before) == (proc.pid, "read", str(fifo), "S", True)
    assert old.start_ns <= began and stopped <= old.at_ns
    # blocked during the capture: the call's own start, its fd resolved from the pipe() record
    assert (new.name, new.obj, new.state, new.before) == ("read", "pipe", "S", False)
    assert began <= new.start_ns <= stopped and new.at_ns - new.start_ns >= 250_000_000
    with open_capture(out) as reader:
        report = analyze(reader)
    rows = report["capture"]["in_progress"]
    assert [r["tid"] for r in rows[:2]] == [main_tid, late_tid]  # longest first
    assert rows[0]["since_before_capture"] and rows[0]["object"] == str(fifo)
    assert report["capture"]["in_progress_threads"] == len(waiting)
    text = "\n".join(summary_lines(report))
    assert "still waiting when the capture stopped" in text and f"read({fifo}) for more than" in text
