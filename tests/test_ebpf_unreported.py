"""A switch back to a traced thread that the kernel never reports: the thread's off-CPU span must still end, at
its wakeup or the return of the call it slept in, and be counted. Some kernels report no event while certain tasks
hold a CPU (this project's CI VM: its guest agent's threads), so a thread that takes the CPU from one comes back
unseen, and one a timer wakes meanwhile is woken unseen: its off-CPU entry stays open. The test leaves such an entry
itself: it writes one into the real program's `offcpu` map for a thread that is running, exactly what an unreported
switch back leaves, and the real programs must close it at the thread's next long call or its next switch away."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from waiting import blocked_in, wait_for
from workloads.ebpfcap import ebpf_capture, of, read_capture

from gputrace.probes import procfs
from gputrace.probes.ebpf import events
from gputrace.probes.ebpf.source import EbpfSource
from gputrace.records import OffCpu, Syscall

pytestmark = pytest.mark.kernel  # root and the host's kernel (see tests/conftest.py)

UNREPORTED, LOST = events.UNREPORTED_SWITCHES
READ_NR = {"x86_64": 0, "aarch64": 63}[os.uname().machine]

# Each line on stdin starts a round: say so, spin on the CPU (short calls only) until the round's flag file exists,
# then end the round with a long call: a sleep (the thread leaves its CPU) or a read of 16 MiB from /dev/zero (a
# long call that need not sleep), and say so. A real-time priority keeps other work on the host (a CPU hog) from
# preempting the spin.
CHILD = """
import os, sys, threading, time
os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
print(threading.get_native_id(), flush=True)
zero = os.open("/dev/zero", os.O_RDONLY)
for line in sys.stdin:
    flag, how = line.split()
    print("spinning", flush=True)
    while not os.path.exists(flag):
        pass
    if how == "sleep":
        time.sleep(0.05)
    else:
        os.read(zero, 16 << 20)
    print("done", flush=True)
"""


def _leave_open(src: EbpfSource, pid: int, tid: int, start: int, wake: int, since: int, state: int = 1) -> None:
    """The entry an unreported switch back leaves: the thread went off CPU at ``start``, was woken at ``wake``.
    Written while the thread is on its CPU: not while it is preempted, when the write would take the place of the
    preemption's own entry, which its reported switch back then ends as usual. An entry from before ``since``
    (the round began; the thread has spun since) is one the host itself left open, its switch back unreported:
    written over."""
    bpf: Any = src._bpf  # noqa: SLF001 - the test plays the part of the kernel's missing event
    table = bpf[b"offcpu"]
    key = table.Key(tid)

    def on_cpu() -> bool:
        try:
            return bool(table[key].ts < since)
        except KeyError:
            return True

    wait_for(on_cpu, what=f"tid {tid} back on its CPU")
    leaf = table.Leaf()
    leaf.ts, leaf.wake_ns, leaf.pid, leaf.state = start, wake, pid, state  # 1: S, asleep; 0: R, preempted
    leaf.waker_pid, leaf.waker_tid, leaf.waker_comm = 4242, 4243, b"test-waker"
    table[key] = leaf


def test_an_unreported_switch_back_ends_the_span_at_the_wakeup(tmp_path: Path) -> None:
    child = subprocess.Popen([sys.executable, "-c", CHILD], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdin is not None and child.stdout is not None
    out = tmp_path / "u.gputrace"
    planted: dict[str, tuple[int, int]] = {}  # round -> (start, wake) of the entry left open that was found
    bounds: dict[str, tuple[int, int]] = {}  # round -> (entry written, found by then)
    rounds = 0
    try:
        tid = int(child.stdout.readline())
        with ebpf_capture(out, [child.pid], threshold_ns=100_000) as src:
            # woken: whether the entry has a wakeup; ends: the call that ends the round (a sleep's switch away, or
            # a read's return); state: 1 asleep (S), 0 preempted (R). "tick": found while the thread still spins,
            # by a timer interrupt in it; "ret": found by the read's return, or a tick during the read; "lost":
            # found by the sleep's switch away before any tick, which has no end to give it
            for how, woken, ends, state in [("sleep", True, "sleep", 1), ("read", True, "read", 1),
                                            ("tick", False, "sleep", 0), ("ret", False, "read", 1),
                                            ("lost", False, "sleep", 1)]:
                # The thread spins on its CPU. Preempted between the check and the write, the write takes the place
                # of the preemption's own entry, which its reported switch back ends as usual; a tick between the
                # write and the "lost" round's sleep ends the entry: the round is played again. (The host's own
                # unreported switches may add to the counts.)
                for _ in range(10):
                    rounds += 1
                    flag = tmp_path / f"flag{rounds}"
                    since = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
                    child.stdin.write(f"{flag} {ends}\n")
                    child.stdin.flush()
                    assert child.stdout.readline() == "spinning\n"
                    before = src.skipped()
                    now = time.clock_gettime_ns(time.CLOCK_MONOTONIC)  # off CPU 60 ms ago, woken 20 ms later
                    start, wake = now - 60_000_000 - rounds, (now - 40_000_000 if woken else 0)
                    _leave_open(src, child.pid, tid, start, wake, since, state)
                    if how == "tick":  # the scheduler's tick comes to the spinning thread within a few ms
                        wait_for(lambda b=before: src.skipped()[UNREPORTED] > b[UNREPORTED],
                                 what="a timer interrupt to find the entry while the thread spins")
                    found = time.clock_gettime_ns(time.CLOCK_MONOTONIC)
                    flag.touch()
                    # found by a tick, the sleep's switch away or the read's return, before the thread says "done"
                    assert child.stdout.readline() == "done\n"
                    after = src.skipped()
                    lost = after[LOST] > before[LOST]
                    if after[UNREPORTED] > before[UNREPORTED] and lost == (how == "lost"):
                        planted[how], bounds[how] = (start, wake), (now, found)
                        break
        skipped = dict(src.skipped())
    finally:
        child.kill()
        child.wait()
    assert set(planted) == {"sleep", "read", "tick", "ret", "lost"}, (planted, rounds)
    records, reader = read_capture(out)
    ended = {r.start_ns: r for r in of(records, OffCpu) if r.tid == tid}
    for how in ("sleep", "read"):
        start, wake = planted[how]
        r = ended[start]  # ended at the wakeup, which it was off CPU until at least; who had the CPU unknown
        assert (r.end_ns, r.wake_ns, r.waker_tid, r.waker_comm, r.state) == (wake, wake, 4243, "test-waker", "S")
        assert (r.held_pid, r.held_tid, r.held_comm) == (0, 0, "")
    # preempted, no wakeup: ended by the tick that found the thread on its CPU (off CPU at most that long)
    r = ended[planted["tick"][0]]
    written, found = bounds["tick"]
    assert r.state == "R" and (r.wake_ns, r.held_tid) == (0, 0) and written <= r.end_ns <= found, (r, bounds)
    # no wakeup seen, asleep: ended by the return of the read (or a tick during it), which it was off CPU until at most
    r = ended[planted["ret"][0]]
    written = bounds["ret"][0]
    reads = [c.end_ns for c in of(records, Syscall) if c.tid == tid and c.name == "read" and c.end_ns > written]
    assert (r.wake_ns, r.held_tid) == (0, 0) and written <= r.end_ns <= min(reads), (r, reads)
    assert planted["lost"][0] not in ended  # no wakeup, no call's return, no tick to end it at: no record, counted lost
    # a kernel omission like a skipped probe run, not a loss of the capture's own: counted apart from the drops
    assert skipped[UNREPORTED] >= 5 and skipped[LOST] >= 1
    assert reader.trailer is not None and not any(reader.trailer["drops"].values())


READER = """
import os, threading
print(threading.get_native_id(), flush=True)
os.read(0, 1)  # once traced: the read that follows is the one the test wakes
print("reading", flush=True)
os.read(0, 1)
print("done", flush=True)
"""


def test_an_unreported_switch_away_starts_the_span_at_the_call_it_slept_in(tmp_path: Path) -> None:
    """The other half: a thread that leaves its CPU to such a task leaves no entry at all. Woken off its CPU (the
    raw sched_wakeup reads task_struct.on_cpu) with none, its switch away was not reported: asleep in a recorded
    call, it has been off CPU at most since that call began, and the span starts there. The test takes away the
    entry of a thread asleep in read(), exactly what an unreported switch away leaves, then wakes it."""
    child = subprocess.Popen([sys.executable, "-c", READER], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert child.stdin is not None and child.stdout is not None
    out = tmp_path / "a.gputrace"
    try:
        tid = int(child.stdout.readline())
        blocked_in(child.pid, READ_NR)  # asleep before tracing begins: no entry, and no recorded call
        with ebpf_capture(out, [child.pid], threshold_ns=100_000, sched_hook="raw") as src:
            bpf: Any = src._bpf  # noqa: SLF001 - the test plays the part of the kernel's missing event
            table = bpf[b"offcpu"]
            key = table.Key(tid)
            child.stdin.write(b"g")
            child.stdin.flush()
            assert child.stdout.readline() == b"reading\n"
            def asleep_a_while() -> bool:  # in read(), for longer than the threshold: a span to be recorded
                try:
                    since = table[key].ts
                except KeyError:
                    return False
                return (procfs.thread_state(child.pid, tid) == "S"
                        and time.clock_gettime_ns(time.CLOCK_MONOTONIC) - since > 1_000_000)

            wait_for(asleep_a_while, what=f"tid {tid} asleep in read() for over 1 ms")
            before = src.skipped()
            assert before[UNREPORTED] == 0, before  # woken from a sleep that began before tracing: not counted
            del table[key]
            child.stdin.write(b"x")
            child.stdin.flush()
            assert child.stdout.readline() == b"done\n"
            after = src.skipped()
    finally:
        child.kill()
        child.wait()
    assert (after[UNREPORTED] - before[UNREPORTED], after[LOST] - before[LOST]) >= (1, 0), (before, after)
    records, reader = read_capture(out)
    call = [c for c in of(records, Syscall) if c.tid == tid and c.name == "read" and c.ret == 1][-1]
    spans = [r for r in of(records, OffCpu) if r.tid == tid and r.start_ns == call.start_ns]
    assert len(spans) == 1, [r for r in of(records, OffCpu) if r.tid == tid]
    r = spans[0]  # from the call's start to its switch back, woken by the test's write
    assert r.state == "S" and r.start_ns < r.wake_ns <= r.end_ns <= call.end_ns, r
    assert r.waker_pid == os.getpid() and r.waker_tid == threading.get_native_id(), r
    assert reader.trailer is not None and not any(reader.trailer["drops"].values())
