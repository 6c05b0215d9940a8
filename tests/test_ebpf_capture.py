"""The eBPF source on a real process tree: forks followed, reads resolved, block I/O and wakeups attributed."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from waiting import wait_for
from workloads.ebpfcap import driven, ebpf_capture, of, read_capture, tell
from workloads.loopdev import LoopFs, write_file

from gputrace.probes import procfs
from gputrace.probes.ebpf.syscalls import syscall_numbers
from gputrace.records import BlockIO, OffCpu, ProcFork, Syscall, SyscallAgg

pytestmark = pytest.mark.kernel  # root and the host's kernel (see tests/conftest.py)

WORKLOADS = Path(__file__).parent / "workloads"
SIZE_A, SIZE_B = 3 << 20, (2 << 20) + 40960


class Tree:
    """tests/workloads/tree.py plus the untraced waker, driven through their handshakes."""

    def __init__(self, fs: LoopFs) -> None:
        self.file_a = write_file(fs.mountpoint / "a.bin", SIZE_A)
        self.file_b = write_file(fs.mountpoint / "b.bin", SIZE_B)
        self.pipe_r, self.pipe_w = os.pipe()
        self.proc = subprocess.Popen(
            [sys.executable, str(WORKLOADS / "tree.py"), str(self.file_a), str(self.file_b), str(self.pipe_r)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, pass_fds=(self.pipe_r,),
        )  # fmt: skip
        self.pid = int(self._expect("ready")[0])

    def _expect(self, word: str) -> list[str]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline().split()
        assert line and line[0] == word, f"expected {word!r} from tree.py, got {line!r}"
        return line[1:]

    def run(self) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        tid = int(self._expect("thread")[0])
        worker = [int(x) for x in self._expect("worker")]
        waker = subprocess.run(
            [sys.executable, str(WORKLOADS / "waker.py"), str(self.pid), str(tid),
             str(syscall_numbers()["read"]), str(self.pipe_w)],
            pass_fds=(self.pipe_w,), capture_output=True, text=True, check=True,
        )  # fmt: skip
        assert self._expect("done") == ["woken"]
        assert self.proc.wait(timeout=10) == 0
        wpid, wtid = (int(x) for x in waker.stdout.split())
        return {"thread": tid, "worker": worker[0], "bytes_a": worker[1], "bytes_b": worker[2],
                "waker_pid": wpid, "waker_tid": wtid}  # fmt: skip

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        os.close(self.pipe_r)
        os.close(self.pipe_w)


@pytest.fixture
def tree(loopfs: LoopFs) -> Iterator[Tree]:
    t = Tree(loopfs)
    yield t
    t.close()


def test_tree_is_followed_and_attributed(tree: Tree, loopfs: LoopFs, tmp_path: Path) -> None:
    path = tmp_path / "tree.gputrace"
    with ebpf_capture(path, [tree.pid], threshold_ns=0) as src:
        assert src.is_traced(tree.pid)
        got = tree.run()
    records, reader = read_capture(path)
    # every attached program's skip counter was read from the kernel (fdinfo recursion_misses)
    skipped = src.skipped()
    assert {"sched_switch", "sched_waking", "task_newtask", "block_rq_complete"} <= set(skipped), skipped
    assert {"sys_enter", "sys_exit"} <= set(skipped) or "sys_exit_pread64" in skipped, skipped
    assert all(type(v) is int and v >= 0 for v in skipped.values())
    worker = got["worker"]
    assert got["bytes_a"] == SIZE_A and got["bytes_b"] == SIZE_B

    forks = [f for f in of(records, ProcFork) if f.child_pid == worker]
    assert forks and forks[0].parent_pid == tree.pid and not forks[0].is_thread

    calls = [s for s in of(records, Syscall) if s.pid == worker]
    reads = [s for s in calls if s.name == "read" and s.obj == str(tree.file_a)]
    preads = [s for s in calls if s.name == "pread64" and s.obj == str(tree.file_b)]
    assert sum(s.nbytes for s in reads) == SIZE_A
    assert sum(s.nbytes for s in preads) == SIZE_B
    assert all(s.tid == worker and s.end_ns >= s.start_ns for s in reads + preads)

    blocks = [b for b in of(records, BlockIO) if b.dev == loopfs.name and "R" in b.rwbs]
    assert blocks, "no block reads on the loop device"
    assert {(b.pid, b.tid) for b in blocks} == {(worker, worker)}
    assert sum(b.nbytes for b in blocks) == SIZE_A + SIZE_B
    assert all(b.complete_ns > b.issue_ns for b in blocks)

    waits = [o for o in of(records, OffCpu) if o.tid == got["thread"] and o.waker_comm == "gt-waker"]
    assert len(waits) == 1, "\n".join(map(str, (o for o in of(records, OffCpu) if o.tid == got["thread"])))
    w = waits[0]
    assert (w.pid, w.waker_pid, w.waker_tid, w.state) == (tree.pid, got["waker_pid"], got["waker_tid"], "S")
    assert w.start_ns < w.wake_ns <= w.end_ns

    assert reader.drops and set(reader.drops.values()) == {0}, reader.drops


def test_short_calls_are_aggregated_not_lost(tree: Tree, tmp_path: Path) -> None:
    path = tmp_path / "agg.gputrace"
    with ebpf_capture(path, [tree.pid], threshold_ns=10_000_000_000):
        got = tree.run()
    records, _ = read_capture(path)
    worker = got["worker"]
    assert not [s for s in of(records, Syscall) if s.name in ("read", "pread64")]
    aggs = {a.name: a for a in of(records, SyscallAgg) if a.tid == worker}
    # 128 KiB chunks plus the final empty read that sees EOF.
    assert aggs["read"].count >= SIZE_A // (128 << 10) + 1
    assert aggs["pread64"].count >= -(-SIZE_B // (128 << 10)) + 1
    assert aggs["read"].total_ns > 0


def test_a_target_that_exited_before_tracing_began_is_not_live(tmp_path: Path) -> None:
    """A target can exit while the programs compile (seconds): unreaped, it is a zombie in the target set,
    whose exit the probes never saw. The capture must not wait on it (`capture -p` ends when no target runs)."""
    zombie = subprocess.Popen(["true"])
    live = subprocess.Popen(["sleep", "30"])
    try:
        wait_for(lambda: procfs.thread_state(zombie.pid, zombie.pid) == "Z", 10, "the child to exit")
        with ebpf_capture(tmp_path / "z.gputrace", [zombie.pid]) as src:
            assert zombie.pid in src.live_targets() and not src.any_live()
            src.add_target(live.pid)
            assert src.any_live()
    finally:
        live.kill()
        live.wait()
        zombie.wait()


SLEEPER = """
import ctypes, select, sys, threading, time
libc = ctypes.CDLL(None)
print("ready", flush=True)
sys.stdin.readline()
time.sleep(0.02)  # CPython >= 3.11: clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, deadline)
libc.usleep(20000)  # glibc: clock_nanosleep(CLOCK_REALTIME, 0, 20 ms)
select.epoll().poll(0.02)  # epoll_wait, 20 ms
select.poll().poll(20)
spinning = True
def spin():
    while spinning:
        pass
spinner = threading.Thread(target=spin)
spinner.start()
libc.clock_nanosleep(2, 0, (ctypes.c_long * 2)(0, 20_000_000), None)  # until 20 ms of the process's CPU time
spinning = False
spinner.join()
"""


def test_a_sleeps_time_is_recorded_as_its_deadline_or_its_duration(tmp_path: Path) -> None:
    """The eBPF source reads a sleep's timespec into ``arg`` without the call's flags: Python's time.sleep gives a
    CLOCK_MONOTONIC deadline (the records' clock), usleep a duration. The analysis tells them apart by the call's
    times (explain._sleep_deadline): each is due 20 ms after it began and returned after that. A sleep on a
    CPU-time clock, due when CPU time has passed, has none (0). A poll's and an epoll wait's ``arg`` is their
    timeout in ms (explain._poll_due)."""
    from gputrace.analysis.explain import _poll_due, _sleep_deadline

    path = tmp_path / "sleep.gputrace"
    with driven([sys.executable, "-c", SLEEPER]) as proc:
        assert proc.stdout is not None and proc.stdout.readline().split() == ["ready"]
        with ebpf_capture(path, [proc.pid]):
            tell(proc, "go")
            assert proc.wait(timeout=30) == 0
    records, _ = read_capture(path)
    sleeps = [s for s in of(records, Syscall) if s.pid == proc.pid and s.name == "clock_nanosleep"]
    assert len(sleeps) == 3, sleeps
    absolute, relative, cpu_time = sleeps
    assert cpu_time.arg == 0 and _sleep_deadline(cpu_time) is None, cpu_time
    assert absolute.start_ns < absolute.arg <= absolute.end_ns, absolute
    assert relative.arg == 20_000_000, relative
    polls = [s for s in of(records, Syscall) if s.pid == proc.pid and s.name in ("epoll_wait", "epoll_pwait", "poll")]
    assert [(s.arg, s.ret) for s in polls] == [(20, 0), (20, 0)], polls
    for s in polls:  # had it returned 10 ms late, it was due 20 ms and the timer's slack after it began
        assert s.end_ns - s.start_ns >= 20_000_000, s
        assert _poll_due(s._replace(end_ns=s.start_ns + 30_000_000)) == s.start_ns + 20_200_000, s
    for s in (absolute, relative):
        deadline = _sleep_deadline(s)
        # (time.sleep takes its deadline before the call: a thread preempted between the two enters it later)
        assert deadline is not None and 0 < deadline - s.start_ns <= 20_000_000 and deadline <= s.end_ns, s
