"""Waits in page faults on file mappings, traced for real: a file read through a mapping on a loop-device
ext4, next to a pread() of another file and a sync() right after a file fault that did not wait; the same
file seen through an overlayfs mount (a container's root), named by its overlay path."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from workloads.ebpfcap import driven, ebpf_capture, of, read_capture, tell
from workloads.loopdev import LoopFs, loop_filesystem, write_file

from gputrace.probes.ebpf.host import file_faults_supported
from gputrace.records import BlockIO, FileMap, OffCpu, PageFault, Syscall

pytestmark = pytest.mark.kernel  # root and the host's kernel (see tests/conftest.py)

WORKLOADS = Path(__file__).parent / "workloads"
MAPPED_SIZE, PLAIN_SIZE = 2 << 20, 1 << 20


def inside(t: int, a: int, b: int) -> bool:
    return a <= t <= b


def test_mapped_reads_are_page_faults_on_the_file(tmp_path: Path) -> None:
    assert file_faults_supported(), "filemap:mm_filemap_fault is missing on this kernel"
    with loop_filesystem(tmp_path) as fs:
        mapped = write_file(fs.mountpoint / "mapped.bin", MAPPED_SIZE)
        plain = write_file(fs.mountpoint / "plain.bin", PLAIN_SIZE)
        scratch = fs.mountpoint / "scratch"
        scratch.mkdir()
        records, tid = _run(tmp_path / "f.gputrace", fs, mapped, plain, scratch)
    pid = next(m.pid for m in of(records, FileMap))
    maps = {(m.dev, m.ino): m.path for m in of(records, FileMap) if m.pid == pid}
    assert (fs.majmin, _inode(records, mapped)) in maps

    every = [f for f in of(records, PageFault) if f.tid == tid]
    faults = [f for f in every if f.dev == fs.majmin]
    assert faults, "no page fault recorded"
    # every recorded wait on the test's device is on the mapped file, at a page of it; none on the sync()
    # after the shared write. Under memory pressure the thread also waits on pages of its own code
    # (python, libc): those are named too, even when the process has exited before they are read.
    assert {f.obj for f in faults} == {str(mapped)}, {f.obj for f in faults}
    assert all(f.obj for f in every), [f for f in every if not f.obj]
    assert all(0 <= f.offset < MAPPED_SIZE and f.offset % 4096 == 0 for f in faults)
    assert all(f.start_ns < f.end_ns and 0 < f.wait_ns <= f.end_ns - f.start_ns for f in every)
    # each is a real off-CPU wait in D of that thread, ending where the fault's record ends
    waits = [o for o in of(records, OffCpu) if o.tid == tid and o.state == "D"]
    for f in every:
        assert any(o.end_ns == f.end_ns and f.start_ns <= o.start_ns for o in waits), f
    # faults never overlap the thread's syscalls (the pread() waits are the syscall's)
    calls = [s for s in of(records, Syscall) if s.tid == tid]
    preads = [s for s in calls if s.name == "pread64" and s.obj == str(plain)]
    assert preads
    for f in every:
        assert not any(s.start_ns < f.end_ns and f.start_ns < s.end_ns for s in calls), f
    # the device's read requests: the mapped file's under the faults, the plain file's under the preads
    reads = [b for b in of(records, BlockIO) if b.dev == fs.name and "R" in b.rwbs and b.tid == tid]
    under_faults = sum(b.nbytes for b in reads if any(inside(b.issue_ns, f.start_ns, f.end_ns) for f in faults))
    under_preads = sum(b.nbytes for b in reads if any(inside(b.issue_ns, s.start_ns, s.end_ns) for s in preads))
    assert MAPPED_SIZE <= under_faults <= MAPPED_SIZE + (64 << 10), under_faults
    assert PLAIN_SIZE <= under_preads <= PLAIN_SIZE + (64 << 10), under_preads
    # sync() waited in D right after a file fault, outside any traced syscall: still not a fault's wait
    last = max(f.end_ns for f in faults)
    assert any(o.start_ns > last for o in waits), "sync() did not wait in D: the check proves nothing"


@contextmanager
def overlay_mount(lower: Path, work: Path) -> Iterator[Path]:
    """An overlayfs mount of `lower` with a fresh upper layer beside it, at work/merged; absolute layer
    paths, as container runtimes give them."""
    upper, scratch, merged = work / "upper", work / "work", work / "merged"
    for d in (upper, scratch, merged):
        d.mkdir()
    subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                    f"lowerdir={lower},upperdir={upper},workdir={scratch}", str(merged)],
                   check=True, capture_output=True)  # fmt: skip
    try:
        yield merged
    finally:
        subprocess.run(["umount", str(merged)], check=False, capture_output=True)


def test_faults_on_an_overlay_file_name_the_overlay_path(tmp_path: Path) -> None:
    """The fault names the lower layer's inode on the loop device; maps shows the overlay's device. The
    FileMap record still carries the path the process mapped."""
    with loop_filesystem(tmp_path) as fs:
        lower = fs.mountpoint / "lower"
        lower.mkdir()
        write_file(lower / "mapped.bin", MAPPED_SIZE)
        write_file(lower / "plain.bin", PLAIN_SIZE)
        (lower / "scratch").mkdir()
        layer_ino = (lower / "mapped.bin").stat().st_ino
        with overlay_mount(lower, fs.mountpoint) as merged:
            mapped = merged / "mapped.bin"
            merged_dev = mapped.stat().st_dev
            records, tid = _run(tmp_path / "o.gputrace", fs, mapped, merged / "plain.bin", merged / "scratch")
    assert f"{os.major(merged_dev)}:{os.minor(merged_dev)}" != fs.majmin  # maps and the fault disagree
    names = {(m.dev, m.ino): m.path for m in of(records, FileMap)}
    assert names.get((fs.majmin, layer_ino)) == str(mapped), names
    faults = [f for f in of(records, PageFault) if f.tid == tid and f.dev == fs.majmin]  # not python's own
    waits = [o for o in of(records, OffCpu) if o.tid == tid and o.state == "D"]
    assert faults and {f.obj for f in faults} == {str(mapped)}, (of(records, PageFault), waits[:20])


def _inode(records: list[object], path: Path) -> int:
    return next(m.ino for m in of(records, FileMap) if m.path == str(path))


def _run(out: Path, fs: LoopFs, mapped: Path, plain: Path, scratch: Path) -> tuple[list[object], int]:
    argv = [sys.executable, str(WORKLOADS / "mmap_reader.py"), str(mapped), str(plain), str(scratch)]
    with driven(argv) as proc:
        assert proc.stdout is not None
        pid = int(proc.stdout.readline().split()[1])
        with ebpf_capture(out, [pid], threshold_ns=0) as src:
            assert not [m for m in src.missing if "filemap" in m]
            tell(proc, "go")
            tid = int(proc.stdout.readline().split()[1])
            assert proc.stdout.readline().startswith("read ")
            assert proc.stdout.readline().strip() == "synced"
            # the mapping lives until "exit": a capture whose reader lags (a loaded machine) reads the
            # file's name while it is still mapped; a mapping gone before that is a documented limit
            key = (pid, fs.majmin, mapped.stat().st_ino)
            deadline = time.monotonic() + 10
            while not src.named_mapping(*key) and time.monotonic() < deadline:
                time.sleep(0.01)
            tell(proc, "exit")
            assert proc.wait(timeout=30) == 0
    records, reader = read_capture(out)
    assert reader.complete
    assert reader.drops["ebpf.fault"] == 0 and reader.drops["ebpf.ringbuf"] == 0
    return records, tid


# Writes to every page of a cached file through a fresh private mapping, over and over, on its CPU: file faults
# that never wait (a write fault on a private mapping reads the page from the page cache, one fault per page: no
# fault-around). A real-time priority keeps other work on the host (a CPU hog) from preempting it.
TOUCHER = """
import mmap, os, sys, threading
os.sched_setscheduler(0, os.SCHED_FIFO, os.sched_param(1))
fd = os.open(sys.argv[1], os.O_RDONLY)
print(threading.get_native_id(), flush=True)
sys.stdin.readline()
while not os.path.exists(sys.argv[2]):
    m = mmap.mmap(fd, 0, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    for i in range(0, len(m), mmap.PAGESIZE):
        m[i] = 0
        for _ in range(1000):  # some work between faults
            pass
    m.close()
"""


def test_a_fault_wait_whose_switch_back_was_not_reported_is_still_the_fault_s(tmp_path: Path) -> None:
    """A thread asleep in a file fault that comes back unseen (a task the kernel reports nothing for held the CPU:
    see tests/test_ebpf_unreported.py) has its entry ended by the thread's next file fault, or a timer tick, or a
    call's return (see tests/test_ebpf_dirty.py): that span is still the fault's wait, with a PageFault record to
    the same end; and the next fault's program, which runs on the thread's CPU, ends it. The test writes such an
    entry (in D, inside the fault the thread last took, not woken) whenever the toucher is on its CPU."""
    from gputrace.probes.ebpf import events

    with loop_filesystem(tmp_path) as fs:
        cached = fs.mountpoint / "cached.bin"
        cached.write_bytes(bytes(range(1, 256)) * (4 << 12))  # ~4 MiB in the page cache
        stop = tmp_path / "stop"
        child = subprocess.Popen([sys.executable, "-c", TOUCHER, str(cached), str(stop)], stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True)  # fmt: skip
        assert child.stdin is not None and child.stdout is not None
        cpus = sorted(os.sched_getaffinity(0))  # the toucher and this thread on CPUs of their own
        planted: dict[int, int] = {}  # the planted entry's start -> the fault it is inside
        seen: set[int] = set()  # the ts of every fault this thread saw in the map
        try:
            tid = int(child.stdout.readline())
            if len(cpus) > 1:
                os.sched_setaffinity(child.pid, cpus[1:])
                os.sched_setaffinity(0, cpus[:1])
            with ebpf_capture(tmp_path / "fault.gputrace", [child.pid], threshold_ns=0) as src:
                offcpu, faults = src._bpf[b"offcpu"], src._bpf[b"faults"]  # noqa: SLF001 - plays the kernel
                key = offcpu.Key(tid)
                child.stdin.write("go\n")
                child.stdin.flush()
                deadline = time.monotonic() + 20
                while len(planted) < 20 and time.monotonic() < deadline and child.poll() is None:
                    try:
                        fault = faults[faults.Key(tid)]
                    except KeyError:
                        continue  # no file fault yet
                    seen.add(fault.ts)
                    if fault.ts + 1 in planted:
                        continue  # this fault's wait is planted already
                    try:
                        offcpu[key]
                        continue  # an entry open: off its CPU, or a planted one not ended yet
                    except KeyError:
                        pass
                    leaf = offcpu.Leaf()
                    leaf.ts = fault.ts + 1  # as if it had slept in that fault and not been seen since
                    leaf.pid, leaf.state, leaf.fault_ns = child.pid, 2, fault.ts  # D
                    offcpu[key] = leaf
                    planted[leaf.ts] = fault.ts
                while True:  # the last one ended too (a fault, a tick): the span is in the capture
                    try:
                        offcpu[key]
                    except KeyError:
                        break
                stop.touch()
                assert child.wait(timeout=30) == 0
                skipped = src.skipped()
        finally:
            os.sched_setaffinity(0, cpus)
            if child.poll() is None:
                child.kill()
                child.wait()
    assert planted, "the toucher never took a file fault"
    records, reader = read_capture(tmp_path / "fault.gputrace")
    spans = {o.start_ns: o for o in of(records, OffCpu) if o.tid == tid and o.start_ns in planted}
    waits = {(f.start_ns, f.end_ns): f for f in of(records, PageFault) if f.tid == tid}
    assert spans, planted
    # A planted entry is the fault's wait while that fault is still the thread's last: the toucher may take its
    # next fault between this thread reading the map and writing the entry (the wait then names no fault).
    theirs = {(start, o.end_ns): waits.get((planted[start], o.end_ns)) for start, o in spans.items()}
    found = [(start, f) for (start, _), f in theirs.items() if f is not None]
    assert found, (sorted(spans.items()), sorted(waits))
    assert all(f.obj == str(cached) and f.wait_ns == spans[start].end_ns - start for start, f in found), found
    ended = [w for w in waits if w[0] in planted.values()]
    assert len(ended) == len(found), (ended, found)  # none that is not a planted span's, to its end
    assert [o for o in spans.values() if o.end_ns in seen], "no planted wait ended at the toucher's next fault"
    assert skipped[events.UNREPORTED_SWITCHES[0]] >= len(spans)
    assert reader.trailer is not None and not any(reader.trailer["drops"].values())
