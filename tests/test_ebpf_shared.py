"""Watch mode's jobs share one set of kernel programs (probes/ebpf/shared.py): each job's capture holds its
own processes' events and only those, a child follows its parent's job, a job that ends leaves the others
traced, the programs' cost is split without counting it twice, and the set is unloaded with its last job."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest

from gputrace.capture import open_capture
from gputrace.daemon.session import CaptureOptions, CaptureResult, run_capture
from gputrace.probes.ebpf.bpfstats import RunStats
from gputrace.probes.ebpf.shared import SharedEbpf
from gputrace.records import ProcFork, ProcInfo, Syscall, SyscallAgg

pytestmark = pytest.mark.kernel  # root and the host's kernel (see tests/conftest.py)

# A job: waits for "go" on stdin, then forks a child that writes to a pipe every 20 ms while the parent
# blocks reading it (reads of ~20 ms: recorded); ``rounds`` writes, then both exit. Prints the child's pid.
JOB = r"""
import os, sys, time
sys.stdin.readline()
r, w = os.pipe()
child = os.fork()
if child == 0:
    os.close(r)
    for _ in range(int(sys.argv[1])):
        time.sleep(0.02)
        os.write(w, b"x")
    os._exit(0)
os.close(w)
print(child, flush=True)
while os.read(r, 1):
    pass
os.waitpid(child, 0)
"""


# A job whose child exists before tracing begins: it blocks reading a pipe its parent writes every 20 ms
# after "go". Prints the child's pid at once.
FORKED_FIRST = r"""
import os, sys, time
r, w = os.pipe()
child = os.fork()
if child == 0:
    os.close(w)
    while os.read(r, 1):
        pass
    os._exit(0)
os.close(r)
print(child, flush=True)
sys.stdin.readline()
for _ in range(int(sys.argv[1])):
    time.sleep(0.02)
    os.write(w, b"x")
os.close(w)
os.waitpid(child, 0)
"""


class _Job:
    def __init__(self, rounds: int, out: Path, shared: SharedEbpf, script: str = JOB) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", script, str(rounds)], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True)
        self.child: int | None = None
        if script == FORKED_FIRST:  # the child is there before the capture starts
            assert self.proc.stdout is not None
            self.child = int(self.proc.stdout.readline())
        self.tracing = threading.Event()
        self.result: CaptureResult | None = None
        self.error: BaseException | None = None
        self.opts = CaptureOptions(output=out, pids=[self.proc.pid], perfetto=False, progress=False, analyse=False,
                                   sample_hz=0, off=frozenset({"sampler"}), on_tracing=self.tracing.set,
                                   make_ebpf=shared.view)
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            self.result = run_capture(self.opts, log=lambda _msg: None)
        except BaseException as e:  # noqa: BLE001 - re-raised by the test
            self.error = e
            self.tracing.set()

    def go(self) -> int:
        """Let the job run; its child's pid."""
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        if self.child is None:  # JOB forks it after "go"
            self.child = int(self.proc.stdout.readline())
        return self.child

    def records(self) -> list[Any]:
        self.thread.join(60)
        assert not self.thread.is_alive(), "the capture did not end with its job"
        if self.error is not None:
            raise self.error
        assert self.result is not None
        with open_capture(self.result.capture_path) as reader:
            return list(reader.records())


def _pids(records: list[Any]) -> set[int]:
    out = set()
    for r in records:
        if isinstance(r, ProcFork):
            out |= {r.parent_pid, r.child_pid}
        elif isinstance(r, (Syscall, SyscallAgg)):
            out.add(r.pid)
    return out


def test_jobs_in_one_program_set_each_get_their_own_processes(tmp_path: Path) -> None:
    shared = SharedEbpf()
    short = _Job(25, tmp_path / "short.gputrace", shared)
    long = _Job(100, tmp_path / "long.gputrace", shared)
    try:
        for job in (short, long):
            assert job.tracing.wait(120), "a capture did not start"
            assert job.error is None, job.error
        assert shared.loaded == 1, "the second job loaded programs of its own"
        [sset] = shared.status()
        assert sset["jobs"] == 2
        short_child, long_child = short.go(), long.go()
        short_records = short.records()  # ends with its job, while the long job runs on
        long_records = long.records()
    finally:
        for job in (short, long):
            job.proc.kill()
            job.proc.wait()
    short_pids, long_pids = {short.proc.pid, short_child}, {long.proc.pid, long_child}
    for records, own in ((short_records, short_pids), (long_records, long_pids)):
        seen = _pids(records)
        assert seen <= own, f"another job's processes in this capture: {seen - own}"
        reads = [r for r in records if isinstance(r, Syscall) and r.name == "read" and r.pid in own]
        assert len(reads) >= 10, f"the job's blocking reads are missing: {len(reads)}"
        forks = [r for r in records if isinstance(r, ProcFork) and not r.is_thread]
        assert [f.child_pid for f in forks] == [c for c in own if c not in (short.proc.pid, long.proc.pid)]
        assert any(isinstance(r, SyscallAgg) and r.pid in own for r in records), "its short-call totals"
    # The long job was traced after the short one left: its reads go on past the short job's last one.
    short_end = max(r.end_ns for r in short_records if isinstance(r, Syscall))
    assert any(r.end_ns > short_end + 200_000_000 for r in long_records if isinstance(r, Syscall) and r.name == "read")
    assert shared.status() == [], "the programs stayed loaded after the last job"


def test_a_job_that_joins_the_set_brings_its_existing_children(tmp_path: Path) -> None:
    """The set is loaded already (another job's); the second job's child, forked before tracing, is its:
    its /proc state and its blocking reads are in the job's capture."""
    shared = SharedEbpf()
    first = _Job(150, tmp_path / "first.gputrace", shared)
    try:
        assert first.tracing.wait(120) and first.error is None, first.error
        second = _Job(25, tmp_path / "second.gputrace", shared, script=FORKED_FIRST)
        try:
            assert second.tracing.wait(120) and second.error is None, second.error
            assert shared.loaded == 1
            child = second.go()
            records = second.records()
        finally:
            second.proc.kill()
            second.proc.wait()
        first.go()
        first.records()
    finally:
        first.proc.kill()
        first.proc.wait()
    assert any(isinstance(r, ProcInfo) and r.pid == child for r in records), "the child's /proc state"
    reads = [r for r in records if isinstance(r, Syscall) and r.name == "read" and r.pid == child]
    assert len(reads) >= 10, f"the child's blocking reads: {len(reads)}"
    assert _pids(records) <= {second.proc.pid, child}


def test_the_programs_cost_is_split_between_the_jobs_not_counted_twice(tmp_path: Path) -> None:
    shared = SharedEbpf()
    views = [shared.view([job], off=("sampler",)) for job in _sleepers(2)]
    sinks = [_Counting(), _Counting()]
    stats = RunStats()
    stats.open()  # the kernel times BPF programs while this is held
    try:
        for view, sink in zip(views, sinks, strict=True):
            view.start(sink)
        pset = views[0].set
        assert pset is not None and views[1].set is pset
        base = pset.split_runs()  # the set's figures, and each view's part, at one instant
        parts0 = [dict(v.runs) for v in views]
        subprocess.run(["dd", "if=/dev/zero", "of=/dev/null", "bs=1", "count=20000"], check=True,
                       capture_output=True)  # syscalls on the host: every one runs the shared programs
        whole = pset.split_runs()
        parts = [dict(v.runs) for v in views]
        timed = stats.on
    finally:
        for view in views:
            view.stop()
        stats.close()
        for p in _SLEEPERS:
            p.kill()
            p.wait()
    if not timed:
        pytest.skip("the kernel's BPF statistics could not be turned on")
    ran = sum(n for n, _ in whole.values()) - sum(n for n, _ in base.values())
    split = sum(sum(n for n, _ in p.values()) for p in parts) - sum(sum(n for n, _ in p.values()) for p in parts0)
    assert ran >= 40000, "the programs did not run for dd's syscalls"
    assert ran - 2 * len(whole) <= split <= ran, (ran, split)  # the whole, once (less each program's rounding)
    for p, p0 in zip(parts, parts0, strict=True):
        mine = sum(n for n, _ in p.values()) - sum(n for n, _ in p0.values())
        assert abs(mine - split / 2) <= len(whole), "an even split"
    assert shared.status() == []


_SLEEPERS: list[subprocess.Popen[bytes]] = []


def _sleepers(n: int) -> list[int]:
    for _ in range(n):
        _SLEEPERS.append(subprocess.Popen(["sleep", "60"]))
    return [p.pid for p in _SLEEPERS[-n:]]


class _Counting:
    def __init__(self) -> None:
        self.kernel = 0

    def emit(self, records: Any) -> None:
        pass

    def emit_kernel(self, blob: bytes, nevents: int) -> None:
        self.kernel += nevents

    def emit_meta(self, source: str, meta: dict[str, Any]) -> None:
        pass
