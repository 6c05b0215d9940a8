"""End to end: a real workload captured with real eBPF and the simulated GPU, then its Perfetto trace checked."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from gputrace.exporters.perfetto_check import check_trace

WORKLOAD = r"""
import os, sys, threading, time
from gputrace.sim import Device

data, mib = sys.argv[1], 1 << 20

def name(comm):
    with open(f"/proc/self/task/{threading.get_native_id()}/comm", "w") as f:
        f.write(comm)

def loader():
    name("loader")
    fd = os.open(data, os.O_RDONLY)
    os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the read must reach the disk
    assert len(os.pread(fd, 2 * mib, 0)) == 2 * mib
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
    os.sync()
    r = subprocess.run([sys.executable, "-m", "gputrace", "capture", "-o", "run.gputrace", "--",
                        sys.executable, "-c", WORKLOAD, str(data)],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    main_tid = int(r.stdout.split()[-1])
    check = check_trace(tmp_path / "run.pftrace")
    assert check.problems == []

    [loader] = check.tracks_named("loader")
    reads = [s for s in check.slices_on(loader) if s.name == "pread64"]
    assert [(s.args["obj"], s.args["nbytes"]) for s in reads] == [(str(data), 2 << 20)]
    disk = [s for t in check.tracks.values() if t.name.startswith("block ")
            for lane in check.children(t) for s in check.slices_on(lane) if s.args["tid"] == loader.tid]
    assert sum(s.args["bytes"] for s in disk if "R" in s.args["rwbs"]) >= 2 << 20

    main = check.thread(main_tid)
    [offcpu] = [t for t in check.children(main) if t.name == "off-CPU"]
    wakes = [(src, dst) for src, dst in check.flows_into(offcpu) if check.track_of(src).name == "writer"]
    assert wakes, "the pipe writer's wakeup of the main thread has no flow"
    src, dst = wakes[0]
    assert src.name == f"wake tid {main_tid}" and dst.name == "woken by writer" and dst.depth == 1

    gpu = next(t for t in check.tracks.values() if t.name.startswith("GPU 0") and t.name.endswith("(simulated)"))
    kernels = [s for s in check.slices_on(gpu, deep=True) if s.name.startswith("step")]
    assert [k.name for k in kernels] == ["step0", "step1", "step2"]
    assert all(1_800_000 <= k.dur <= 2_200_000 for k in kernels)
    launched = {dst.name for src, dst in check.flows if src.name == "cudaLaunchKernel"}
    assert launched >= {"step0", "step1", "step2"}
