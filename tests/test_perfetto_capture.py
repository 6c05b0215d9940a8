"""End to end: real workloads captured with real eBPF (and the simulated GPU, and the stack sampler), then
their Perfetto traces checked."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from test_sampler import HOT, Spinner, sampled, spin  # noqa: F401  (spin: the fixture building the C workload)

from gputrace.capture import CaptureReader
from gputrace.exporters.perfetto.export import PerfettoExporter
from gputrace.records import BlockIO, InProgress, OffCpu, PageFault, StackFrames, StackSample, Syscall
from gputrace.testing.perfetto_check import check_trace

pytestmark = pytest.mark.kernel  # root and the host's kernel (see tests/conftest.py)

WORKLOAD = r"""
import mmap, os, sys, threading, time
from gputrace.sim import Device

data, mib = sys.argv[1], 1 << 20

def name(comm):
    with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as f:
        f.write(comm)

def loader():
    name("loader")
    fd = os.open(data, os.O_RDONLY | os.O_DIRECT)  # the read must reach the disk, whatever is cached
    buf = mmap.mmap(-1, 2 * mib)  # page-aligned, as O_DIRECT needs
    assert os.preadv(fd, [buf], 0) == 2 * mib
    os.close(fd)

r, w = os.pipe()
if os.fork() == 0:
    name("writer")
    time.sleep(0.05)
    os.write(w, b"x")
    os._exit(0)
assert os.read(r, 1) == b"x"  # blocks until the writer wakes us
os.wait()
t = threading.Thread(target=loader)
t.start()
t.join()
dev = Device(0)
s = dev.stream()
for i in range(3):
    s.launch(f"step{i}", duration_ms=2)
s.synchronize()
print("tid", threading.get_native_id(), flush=True)
"""


def test_captured_workload_trace(tmp_path: Path) -> None:
    data = tmp_path / "shard.bin"
    data.write_bytes(os.urandom(2 << 20))
    r = subprocess.run([sys.executable, "-m", "gputrace", "capture", "-o", "run.gputrace", "--",
                        sys.executable, "-c", WORKLOAD, str(data)],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    main_tid = int(r.stdout.split()[-1])
    with CaptureReader(tmp_path / "run.gputrace") as reader:
        recs = list(reader.records())
    check = check_trace(tmp_path / "run.pftrace")
    assert check.problems == []

    # What the workload did, as the user sees it.
    [loader] = check.tracks_named("loader")
    reads = [s for s in check.slices_on(loader) if s.name in ("preadv", "preadv2")]  # glibc picks
    assert [(s.args["obj"], s.args["nbytes"]) for s in reads] == [(str(data), 2 << 20)]
    disk = [s for t in check.tracks.values() if t.name.startswith("block ")
            for lane in check.children(t) for s in check.slices_on(lane)]
    mine = [s for s in disk if s.args["tid"] == loader.tid and "R" in s.args["rwbs"]]
    assert mine and all(reads[0].ts <= s.ts and s.end <= reads[0].end for s in mine)
    gpu = next(t for t in check.tracks.values() if t.name.startswith("GPU 0") and t.name.endswith("(simulated)"))
    kernels = [s for s in check.slices_on(gpu, deep=True) if s.name.startswith("step")]
    assert [k.name for k in kernels] == ["step0", "step1", "step2"]
    assert all(1_800_000 <= k.dur <= 2_200_000 for k in kernels)
    launched = {dst.name: check.track_of(src) for src, dst in check.flows if src.name == "cudaLaunchKernel"}
    assert set(launched) == {"step0", "step1", "step2"}
    assert all(t.name == "CUDA API" and t.parent == check.thread(main_tid).uuid for t in launched.values())

    # Everything the capture holds is in the trace.
    blocks = [x for x in recs if isinstance(x, BlockIO)]
    assert sorted((s.ts, s.args["sector"], s.args["bytes"], s.args["tid"]) for s in disk) == \
        sorted((b.issue_ns, b.sector, b.nbytes, b.tid) for b in blocks)
    woken = [o for o in recs if isinstance(o, OffCpu) and o.waker_tid and o.start_ns <= o.wake_ns <= o.end_ns]
    wake_flows = [(a, b) for a, b in check.flows if a.name.startswith("wake tid ")]
    assert len(wake_flows) == len(woken)  # (the unit tests prove the flows themselves)
    for src, dst in wake_flows:
        assert dst.name.startswith("woken by ") and check.track_of(dst).name == "off-CPU"
        assert check.track_of(src).tid == dst.args["waker_tid"] and src.ts == dst.ts
    # the syscall lane holds the syscalls, waits in page faults and waits still open at the stop
    syscalls = [x for x in recs if isinstance(x, Syscall)]
    in_kernel = syscalls + [x for x in recs if isinstance(x, PageFault | InProgress)]
    on_threads = [s for t in check.tracks.values() if t.kind == "thread" for s in check.slices_on(t)
                  if "syscall" in s.categories]
    assert len(on_threads) == len(in_kernel) and len(syscalls) > 0
    assert len(check.samples) == sum(isinstance(x, StackSample) for x in recs)  # the sampler's, as CPU samples


def test_sampled_stacks_become_perfetto_cpu_samples(spin: Path, tmp_path: Path) -> None:  # noqa: F811
    """The real sampler on a C program spinning in decode_jpeg_block: every sample is in the trace, on the
    right thread, its callstack root first, and the hot function is the leaf of most of them."""
    child = Spinner(spin)
    path = tmp_path / "spin.gputrace"
    try:
        with sampled(path, [child.proc.pid]):
            child.work(300)
    finally:
        child.close()
    out = tmp_path / "spin.pftrace"
    with CaptureReader(path) as reader:
        recs = list(reader.records())
    with CaptureReader(path) as reader:
        result = PerfettoExporter(out).write(reader)
    check = check_trace(out)
    assert check.problems == [] and result.notes == []

    stacks = {(r.pid, r.stack): r.frames for r in recs if isinstance(r, StackFrames)}
    want = sorted((r.ts, r.tid, r.cpu, stacks[(r.pid, r.stack)][::-1]) for r in recs if isinstance(r, StackSample))
    # 499 Hz for 300 ms on CPU is ~150 samples; fewer on a loaded machine
    assert sorted((s.ts, s.tid, s.cpu, s.frames) for s in check.samples) == want and len(want) >= 30
    assert {s.cpu for s in check.samples} <= set(range(os.cpu_count() or 1))  # each on the CPU it ran on
    hot = [s for s in check.samples if s.leaf == f"{HOT} (spin)"]
    assert len(hot) >= len(check.samples) // 2 and {s.tid for s in hot} == {child.tid}
    for s in hot:  # root first: main calls the hot function, and the C runtime calls main
        assert s.frames[-2:] == ["main (spin)", f"{HOT} (spin)"], s.frames
        assert s.frames.index("main (spin)") > 0 and "libc" in s.frames[0], s.frames
    assert check.thread(child.tid).pid == child.proc.pid
