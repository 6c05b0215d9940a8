"""Writers the kernel pauses for dirty pages (balance_dirty_pages), recorded by the real eBPF source: a traced
writer and an untraced one save 2 MiB each to a loop device allowed 256 KiB of dirty pages and written back
at 4 MiB/s. The traced one's pauses are recorded, inside its write() calls and followed by its sleep; the
other's are not."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from workloads.ebpfcap import ebpf_capture, of, read_capture
from workloads.loopdev import LoopFs, dirty_limit, loop_filesystem

from gputrace.probes.ebpf.source import EbpfSource
from gputrace.records import DirtyPause, OffCpu, Syscall

pytestmark = pytest.mark.kernel  # root and the host's kernel (see tests/conftest.py)

WRITER = """
import os, sys, time
spin = sys.argv[2:] == ["spin"]
if spin:  # a real-time priority: not preempted by other work on the host (a CPU hog) while it spins
    os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
sys.stdin.readline()
chunk = os.urandom(64 << 10)
fd = os.open(sys.argv[1], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
longest = 0
for _ in range(32):
    t = time.monotonic_ns()
    while spin and time.monotonic_ns() - t < 1_000_000:  # on its CPU for 1 ms before each write
        pass
    t = time.monotonic_ns()
    os.write(fd, chunk)
    longest = max(longest, time.monotonic_ns() - t)
os.close(fd)
print(longest)
"""



@pytest.fixture
def throttled(tmp_path: Path) -> Iterator[LoopFs]:
    with loop_filesystem(tmp_path) as fs, dirty_limit(fs.majmin, 256 << 10, 4 << 20):
        yield fs


def _writer(path: Path, *how: str) -> subprocess.Popen[str]:
    return subprocess.Popen([sys.executable, "-c", WRITER, str(path), *how], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)


def _run(out: Path, traced: subprocess.Popen[str], *others: subprocess.Popen[str]) -> list[str]:
    """Capture ``traced`` while it and ``others`` are told to go and run to the end; their outputs."""
    procs = (traced, *others)
    try:
        with ebpf_capture(out, [traced.pid]):
            for p in procs:
                assert p.stdin is not None
                p.stdin.write("go\n")
                p.stdin.flush()
            outputs = [p.communicate(timeout=60)[0] for p in procs]
            assert [p.returncode for p in procs] == [0] * len(procs)
            return outputs
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


@contextlib.contextmanager
def _playing_the_kernel(out: Path, traced: subprocess.Popen[str]) -> Iterator[tuple[EbpfSource, Any, Any]]:
    """A capture of ``traced`` with the raw scheduler hooks, the writer told to go: the source, its real
    ``offcpu`` map and the writer's key in it, for a test to play the part of the kernel's missing events. The
    writer is killed if it still runs at the end."""
    try:
        with ebpf_capture(out, [traced.pid], sched_hook="raw") as src:
            table = src._bpf[b"offcpu"]  # noqa: SLF001 - the test plays the part of the kernel's missing events
            assert traced.stdin is not None
            traced.stdin.write("go\n")
            traced.stdin.flush()
            yield src, table, table.Key(traced.pid)
    finally:
        if traced.poll() is None:
            traced.kill()
            traced.wait()


def test_pauses_of_a_traced_writer_are_recorded_in_its_writes(throttled: LoopFs, tmp_path: Path) -> None:
    traced, other = _writer(throttled.mountpoint / "traced.bin"), _writer(throttled.mountpoint / "other.bin")
    out = tmp_path / "dirty.gputrace"
    longest = [int(x) for x in _run(out, traced, other)]
    records, _ = read_capture(out)
    pauses = of(records, DirtyPause)
    assert pauses and {p.pid for p in pauses} == {traced.pid}, pauses  # the untraced writer's are not recorded
    assert min(longest) >= 20_000_000, longest  # both were paused
    writes = [s for s in of(records, Syscall) if s.pid == traced.pid and s.name == "write"]
    offs = [o for o in of(records, OffCpu) if o.pid == traced.pid]
    for p in pauses:
        assert p.dev == throttled.name and p.pause_ns > 0 and p.wb_setpoint > 0, p
        # inside a write() of the saved file, and slept right after (killable: D), about as long as set
        call = next((s for s in writes if s.start_ns <= p.ts <= s.end_ns), None)
        assert call is not None and call.obj == str(throttled.mountpoint / "traced.bin"), (p, writes)
        sleep = next((o for o in offs if p.ts <= o.start_ns <= p.ts + 1_000_000), None)
        near = [o for o in offs if abs(o.start_ns - p.ts) < 50_000_000 or o.start_ns <= p.ts <= o.end_ns]
        assert sleep is not None and sleep.state == "D", (p, near)
        assert 0.5 * p.pause_ns <= sleep.end_ns - sleep.start_ns <= 2 * p.pause_ns + 20_000_000, (p, sleep)


STORES = """
import mmap, os, sys
sys.stdin.readline()
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o644)
os.ftruncate(fd, 2 << 20)
m = mmap.mmap(fd, 2 << 20, mmap.MAP_SHARED)
if sys.argv[2] == "read first":  # pages mapped read-only: each store takes a write-protect fault, no file fault
    sum(m[i] for i in range(0, 2 << 20, 4096))
for i in range(0, 2 << 20, 4096):
    m[i] = 1
"""


@pytest.mark.parametrize(("order", "op"), [("store", "page_fault"), ("read first", "balance_dirty_pages")])
def test_a_writer_through_a_shared_mapping_is_paused_outside_any_call(throttled: LoopFs, tmp_path: Path, order: str,
                                                                      op: str) -> None:
    """Stores to a shared file mapping dirty the pages in faults, with no write(): the pauses come there. The
    analysis names the sleeps they began as storage with the pauses: in the file's page fault where the
    fault probe saw one (the mapping's file named: a store to a page not mapped yet), else on the device (a
    store to a page mapped read-only by an earlier read: a write-protect fault, which reads no file); never
    unknown."""
    from gputrace.analysis.explain import Explainer
    from gputrace.analysis.load import load
    from gputrace.capture import CaptureReader

    proc = subprocess.Popen([sys.executable, "-c", STORES, str(throttled.mountpoint / "m.bin"), order],
                            stdin=subprocess.PIPE, text=True)
    out = tmp_path / "stores.gputrace"
    _run(out, proc)
    records, _ = read_capture(out)
    pauses = [p for p in of(records, DirtyPause) if p.pid == proc.pid]
    assert pauses and all(p.dev == throttled.name for p in pauses), pauses
    calls = [s for s in of(records, Syscall) if s.pid == proc.pid]
    assert not [p for p in pauses if any(s.start_ns <= p.ts <= s.end_ns for s in calls)], calls
    with CaptureReader(out) as reader:
        cap = load(reader)
    a, b = pauses[0].ts - 1_000_000, pauses[-1].ts + pauses[-1].pause_ns
    parts = Explainer(cap).explain(proc.pid, a, min(b, cap.last_ns))
    mapped = str(throttled.mountpoint / "m.bin")
    named = sum(p.ns for p in parts if p.cause == "storage" and p.culprit.get("dirty_pauses")
                and p.culprit["object"] in (mapped, throttled.name) and p.culprit["dirty_device"] == throttled.name)
    paused = sum(min(p.pause_ns, b - p.ts) for p in pauses)
    assert named >= 0.7 * paused, ([(p.cause, p.ns, p.culprit.get("op")) for p in parts], paused)
    assert sum(p.ns for p in parts if p.culprit.get("op") == op) >= 0.7 * paused, [p.culprit for p in parts]
    assert not [p for p in parts if p.cause == "unknown" and p.ns > 5_000_000], parts


def test_a_pause_whose_switch_away_was_not_reported_starts_at_the_pause(throttled: LoopFs, tmp_path: Path) -> None:
    """A dirty pause's sleep whose switch away the kernel did not report (see tests/test_ebpf_unreported.py) is
    found at its wakeup, and starts where the thread was last seen running in its write(): the pause, not the
    call's start; in the state it slept in (D). The test takes away the entry of each sleep it finds, before its
    wakeup, exactly what an unreported switch away leaves."""
    from gputrace.probes.ebpf import events

    traced = _writer(throttled.mountpoint / "traced.bin")
    out = tmp_path / "unreported.gputrace"
    taken: list[int] = []  # the start of each entry taken away
    with _playing_the_kernel(out, traced) as (src, table, key):
        while traced.poll() is None and len(taken) < 4:
            try:
                leaf = table[key]
            except KeyError:
                continue
            if leaf.state & 2 and not leaf.wake_ns and leaf.ts not in taken:  # asleep in D, not woken yet
                try:
                    del table[key]
                except KeyError:
                    continue  # its switch back came first: nothing taken
                taken.append(leaf.ts)
        assert traced.communicate(timeout=60)[1] is None and traced.returncode == 0
        skipped = src.skipped()
    assert taken, "the writer never slept in D"
    records, reader = read_capture(out)
    pauses = {p.ts for p in of(records, DirtyPause)}
    found = [o for o in of(records, OffCpu) if o.pid == traced.pid and o.start_ns in pauses and o.start_ns not in taken]
    assert found and all(o.state == "D" and o.wake_ns for o in found), (found, taken)
    assert skipped[events.UNREPORTED_SWITCHES[0]] >= len(found)
    assert reader.trailer is not None and not any(reader.trailer["drops"].values())


def test_a_sleep_whose_switch_back_was_not_reported_ends_at_the_next_pause(throttled: LoopFs, tmp_path: Path) -> None:
    """A pause's sleep whose timer fires while a task the kernel reports nothing for holds the CPU is woken
    unseen, and taking the CPU from that task it comes back unseen: its entry stays open, with no wakeup (see
    tests/test_ebpf_unreported.py). The writer then pauses again, often before any timer tick, and the switch
    away of that sleep would find the entry open and lose the span. The pause's program runs in the writer, on
    its CPU: the span ends there (off CPU at most that long). The test writes such an entry (in D, not woken)
    whenever the writer is on its CPU, and checks where each one ended."""
    from gputrace.probes.ebpf import events

    traced = _writer(throttled.mountpoint / "traced.bin", "spin")
    out = tmp_path / "unseen.gputrace"
    planted: list[int] = []
    # The writer and this thread on CPUs of their own: the real-time writer would otherwise keep this thread off
    # the CPU they share for exactly the time it is to be seen running.
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) > 1:
        os.sched_setaffinity(traced.pid, cpus[1:])
        os.sched_setaffinity(0, cpus[:1])
    try:
        with _playing_the_kernel(out, traced) as (src, table, key):
            while traced.poll() is None:
                try:
                    if table[key].ts not in planted:
                        continue  # off its CPU: the kernel's own entry
                except KeyError:
                    leaf = table.Leaf()
                    # as if it had left its CPU 5 ms ago (longer than the threshold) and not been seen since
                    leaf.ts = time.clock_gettime_ns(time.CLOCK_MONOTONIC) - 5_000_000
                    leaf.pid, leaf.state = traced.pid, 2  # D
                    table[key] = leaf
                    planted.append(leaf.ts)
            assert traced.communicate(timeout=60)[1] is None and traced.returncode == 0
            skipped = src.skipped()
    finally:
        os.sched_setaffinity(0, cpus)
    assert planted, "the writer was never seen on its CPU"
    records, _ = read_capture(out)
    pauses = {p.ts for p in of(records, DirtyPause)}
    spans = [o for o in of(records, OffCpu) if o.pid == traced.pid and o.start_ns in planted]
    assert all(o.state == "D" and o.end_ns > o.start_ns for o in spans), spans
    at_pause = [o for o in spans if o.end_ns in pauses]
    assert at_pause, (spans, sorted(pauses), planted)
    assert skipped[events.UNREPORTED_SWITCHES[0]] >= len(at_pause)


# Reads 64 MiB from /dev/zero into a buffer it has touched: a call of several ms on its CPU that never sleeps. A
# real-time priority keeps other work on the host (a CPU hog) from preempting it.
READER = """
import os, sys, threading
os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
buf = bytearray(64 << 20)
zero = open("/dev/zero", "rb", buffering=0)
print(threading.get_native_id(), flush=True)
for line in sys.stdin:
    zero.readinto(buf)
    print("done", flush=True)
"""


def test_a_pause_whose_sleep_went_unseen_ends_where_the_thread_is_found_running(tmp_path: Path) -> None:
    """Neither the switch away after a dirty pause nor the timer's wakeup reported (both while a task the kernel
    reports nothing for holds the CPU: see tests/test_ebpf_unreported.py) leaves no entry at all; the pause
    itself was seen, and a positive pause is slept right after it. The thread found running later in the same
    call (its return, a later pause or block request), with no switch away seen since the pause, was off CPU at
    most from the pause until then: that span is recorded, in D, counted with the unreported switches. A thread
    back sooner than half its pause (a nowait write returns instead of sleeping) did not sleep it: nothing. The
    test writes such a pause, at the call's start, into the in-flight slot of a long read() on its CPU."""
    from gputrace.probes.ebpf import events

    child = subprocess.Popen([sys.executable, "-c", READER], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdin is not None and child.stdout is not None
    out = tmp_path / "pause.gputrace"
    cpus = sorted(os.sched_getaffinity(0))  # the reader and this thread on CPUs of their own, as above
    planted: dict[str, int] = {}
    try:
        tid = int(child.stdout.readline())
        if len(cpus) > 1:
            os.sched_setaffinity(child.pid, cpus[1:])
            os.sched_setaffinity(0, cpus[:1])
        with ebpf_capture(out, [child.pid], threshold_ns=100_000) as src:
            table = src._bpf[b"inflight"]  # noqa: SLF001 - the test plays the part of the kernel's missing events
            key = table.Key(tid & 0xFFFF)
            for how, pause_ns in (("slept", 1_000_000), ("not slept", 10**12)):
                for _ in range(20):  # until a write lands while the read is still on its CPU
                    before = src.skipped()
                    child.stdin.write("go\n")
                    child.stdin.flush()
                    while table[key].tid != tid:
                        pass
                    slot = table[key]
                    slot.pause_ts, slot.pause_ns = slot.ts, pause_ns  # paused as the read began
                    table[key] = slot
                    back = table[key]
                    landed = back.tid == tid and back.pause_ts == slot.pause_ts  # before the call's return
                    assert child.stdout.readline() == "done\n"
                    if landed:
                        planted[how] = slot.pause_ts
                        counted = src.skipped()[events.UNREPORTED_SWITCHES[0]] - before[events.UNREPORTED_SWITCHES[0]]
                        assert counted >= (1 if how == "slept" else 0), (how, counted)
                        break
    finally:
        os.sched_setaffinity(0, cpus)
        child.kill()
        child.wait()
    assert set(planted) == {"slept", "not slept"}, planted
    records, reader = read_capture(out)
    spans = {o.start_ns: o for o in of(records, OffCpu) if o.tid == tid}
    read = next(c for c in of(records, Syscall) if c.tid == tid and c.start_ns == planted["slept"])
    o = spans[planted["slept"]]  # from the pause to the read's return: no wakeup, no waker, nobody held the CPU
    assert (o.state, o.end_ns, o.wake_ns, o.waker_tid, o.held_tid) == ("D", read.end_ns, 0, 0, 0), (o, read)
    assert planted["not slept"] not in spans
    assert reader.trailer is not None and not any(reader.trailer["drops"].values())
