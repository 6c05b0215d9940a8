"""Block requests a kernel worker dispatches for a traced read: blk-throttle holds a throttled cgroup's bios
and a kworker submits them later, so the reader never submits its own requests. The kernel records them
while a traced task waits in D; analysis ties them to the read on the path's device."""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from workloads.ebpfcap import ebpf_capture, of, read_capture
from workloads.loopdev import LoopFs, loop_filesystem, write_file

from gputrace.records import BlockIO, Syscall

SCENARIOS = Path(__file__).resolve().parent / "scenarios"
sys.path.insert(0, str(SCENARIOS))

import fixtures  # noqa: E402
import harness  # noqa: E402

KIB = 1024
SIZE = 320 * KIB
RATE = 1 << 20  # 1 MiB/s: the read spends ~200 ms held by the throttle

# Joins the throttled cgroup, says ready, reads the (cold) file on "go", reports the bytes read.
READER = """
import os, sys
with open(os.path.join(sys.argv[1], "cgroup.procs"), "w") as f:
    f.write(str(os.getpid()))
print("ready", flush=True)
sys.stdin.readline()
fd = os.open(sys.argv[2], os.O_RDONLY)
os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
n = 0
while chunk := os.read(fd, 1 << 20):
    n += len(chunk)
print("done", n, flush=True)
"""


@pytest.fixture
def throttled(tmp_path: Path) -> Iterator[tuple[LoopFs, str]]:
    """A loop-device ext4 and one blkio cgroup that throttles its reads."""
    with loop_filesystem(tmp_path) as fs, fixtures.blkio_cgroups(fs.majmin, [RATE]) as groups:
        yield fs, groups[0]


def _expect(proc: subprocess.Popen[str], word: str) -> list[str]:
    assert proc.stdout is not None
    line = proc.stdout.readline().split()
    assert line and line[0] == word, f"expected {word!r}, got {line!r}"
    return line[1:]


def test_throttled_read_has_dispatched_block_requests(throttled: tuple[LoopFs, str], tmp_path: Path) -> None:
    fs, group = throttled
    data = write_file(fs.mountpoint / "cold.bin", SIZE)
    proc = subprocess.Popen([sys.executable, "-c", READER, group, str(data)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    try:
        _expect(proc, "ready")
        with ebpf_capture(tmp_path / "t.gputrace", [proc.pid], threshold_ns=0):
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
            assert _expect(proc, "done") == [str(SIZE)]
            assert proc.wait(timeout=10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    records, _ = read_capture(tmp_path / "t.gputrace")
    reads = [s for s in of(records, Syscall) if s.pid == proc.pid and s.name == "read" and s.obj == str(data)]
    assert sum(s.nbytes for s in reads) == SIZE
    start, end = min(s.start_ns for s in reads), max(s.end_ns for s in reads)
    blocks = [b for b in of(records, BlockIO) if b.dev == fs.name and "R" in b.rwbs
              and start <= b.issue_ns <= end]
    dispatched = [b for b in blocks if b.pid != proc.pid]
    assert dispatched, f"no block request from another submitter during the read: {blocks}"
    assert all(b.comm.startswith("kworker") for b in dispatched), {b.comm for b in dispatched}
    # what the reader submitted itself plus what was dispatched for it: the file, and at most readahead more
    assert SIZE <= sum(b.nbytes for b in blocks) <= SIZE + 256 * KIB, blocks


def test_stall_on_a_throttled_read_names_the_dispatched_requests(tmp_path: Path) -> None:
    device: list[str] = []

    def one_worker(w: Path, st: contextlib.ExitStack) -> dict[str, Any]:
        fs = st.enter_context(loop_filesystem(w, size_mib=48))
        device.append(fs.name)
        files = fixtures.make_files(fs.mountpoint, "shard", 3, 192 * KIB)
        cgroups = st.enter_context(fixtures.blkio_cgroups(fs.majmin, [RATE]))
        return {"workers": 1, "steps": 3, "files": files, "cgroups": cgroups}

    score, report = harness.run("storage", tmp_path, setup=one_worker)
    assert score.passed(), score.misses
    stalls = [s for s in report["stalls"] if s["cause"] == "storage"]
    assert len(stalls) >= 3, report["stalls"]
    for s in stalls:
        c = s["culprit"]
        assert c["object"].endswith(".bin") and c["op"] == "read" and c["bytes"] == 192 * KIB, c
        assert c["block_requests"] > 0 and c["block_device"] == device[0], c
        assert c["block_attribution"] == "dispatched" and c["dispatched_by"].startswith("kworker"), c
        assert c["block_shared"] is False and 0 < c["block_latency_ns"] < c["duration_ns"], c
        blocks = [e for e in s["evidence"] if e["kind"] == "block"]
        assert blocks and all(e["pid"] != c["pid"] for e in blocks), s["evidence"]
