"""Block requests a kernel worker dispatches for a traced read: blk-throttle holds a throttled cgroup's bios
and a kworker submits them later, so the reader never submits its own requests. The kernel records them
while a traced task waits in D; analysis ties them to the read on the path's device."""

from __future__ import annotations

import contextlib
import random
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from workloads.ebpfcap import ebpf_capture, of, read_capture
from workloads.loopdev import LoopFs, loop_filesystem, write_file

from gputrace.analysis import analyze
from gputrace.analysis.objects import MountTable, block_device_of
from gputrace.capture import open_capture
from gputrace.exporters.perfetto.export import PerfettoExporter
from gputrace.records import BlockIO, Syscall
from gputrace.testing.perfetto_check import check_trace
from gputrace.testing.synth import Builder, ns
from gputrace.viewer.terminal import describe

pytestmark = pytest.mark.kernel  # root and the host's kernel (see tests/conftest.py)

SCENARIOS = Path(__file__).resolve().parent / "scenarios"
sys.path.insert(0, str(SCENARIOS))

import fixtures  # noqa: E402
import harness  # noqa: E402

KIB = 1024
SIZE = 320 * KIB
RATE = 1 << 20  # 1 MiB/s: the read spends ~200 ms held by the throttle

# Joins the throttled cgroup, says ready, reads the (cold) file on "go", reports the bytes read, then
# sleeps on stdin (state S) until told to exit.
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
sys.stdin.readline()
"""

# An untraced process reading a cold file: prints its pid when done.
BYSTANDER = """
import os, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
while os.read(fd, 1 << 20):
    pass
print(os.getpid())
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


def _say(proc: subprocess.Popen[str], line: str) -> None:
    assert proc.stdin is not None
    proc.stdin.write(line + "\n")
    proc.stdin.flush()


def test_throttled_read_has_dispatched_block_requests(throttled: tuple[LoopFs, str], tmp_path: Path) -> None:
    fs, group = throttled
    data = write_file(fs.mountpoint / "cold.bin", SIZE)
    other = write_file(fs.mountpoint / "other.bin", SIZE)
    proc = subprocess.Popen(
        [sys.executable, "-c", READER, group, str(data)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        _expect(proc, "ready")
        with ebpf_capture(tmp_path / "t.gputrace", [proc.pid], threshold_ns=0) as src:
            _say(proc, "go")
            assert _expect(proc, "done") == [str(SIZE)]
            # the reader now sleeps in S: no traced task waits on I/O, so others' requests stay unrecorded
            assert src.io_waiting() == 0
            out = subprocess.run(
                [sys.executable, "-c", BYSTANDER, str(other)], capture_output=True, text=True, check=True
            )
            bystander = int(out.stdout)
            _say(proc, "exit")
            assert proc.wait(timeout=10) == 0
            assert src.io_waiting() == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    records, _ = read_capture(tmp_path / "t.gputrace")
    reads = [s for s in of(records, Syscall) if s.pid == proc.pid and s.name == "read" and s.obj == str(data)]
    assert sum(s.nbytes for s in reads) == SIZE
    start, end = min(s.start_ns for s in reads), max(s.end_ns for s in reads)
    all_blocks = of(records, BlockIO)
    blocks = [b for b in all_blocks if b.dev == fs.name and "R" in b.rwbs and start <= b.issue_ns <= end]
    dispatched = [b for b in blocks if b.pid != proc.pid]
    assert dispatched, f"no block request from another submitter during the read: {blocks}"
    assert all(b.comm.startswith("kworker") for b in dispatched), {b.comm for b in dispatched}
    # what the reader submitted itself plus what was dispatched for it: the file, and at most readahead more
    assert SIZE <= sum(b.nbytes for b in blocks) <= SIZE + 256 * KIB, blocks
    assert not [b for b in all_blocks if b.pid == bystander], "an untraced read recorded outside any I/O wait"


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
    # Perfetto: an arrow from each dispatched request's slice (on the device's block track) to its stall
    with open_capture(tmp_path / "storage.gputrace") as reader:
        PerfettoExporter(tmp_path / "s.pftrace", report=report).write(reader)
    trace = check_trace(tmp_path / "s.pftrace")
    linked = [(a, b) for a, b in trace.flows if a.name.startswith("RA ") and trace.track_of(b).name == "stalls"]
    assert len(linked) >= sum(c["culprit"]["block_requests"] for c in stalls) > 0, trace.flows


# ------------------------------------------------------------------- analysis, synthetic captures ---

TRAINER, READER2, KWORKER, OTHER = 100, 300, 42, 77
DATA = "/data/shard-0042.bin"
MOUNTS = [["/", "ext4", "/dev/vda", "254:0"], ["/data", "ext4", "/dev/loop3", "7:3"]]


def _stall_on_read(b: Builder) -> Builder:
    """The trainer's GPU idles [10, 40) ms while the trainer reads DATA (12-38 ms), off CPU in D."""
    b.proc(TRAINER, "python").device(TRAINER)
    b.op(TRAINER, TRAINER, 0.0, 0.0, 10.0, "fwd")
    b.op(TRAINER, TRAINER, 39.95, 40.0, 50.0, "bwd")
    b.syscall(TRAINER, TRAINER, "pread64", 12.0, 38.0, DATA, 256 << 10)
    return b.offcpu(TRAINER, TRAINER, 12.1, 37.9, "D", waker=(0, 0, "[softirq]"))


def _analyze(b: Builder, tmp_path: Path, mounts: list[list[str]] = MOUNTS) -> dict[str, Any]:
    path = b.write(tmp_path / "s.gputrace", header={"mounts": mounts})
    with open_capture(path) as reader:
        report = analyze(reader)
    assert len(report["stalls"]) == 1, report["stalls"]
    return report["stalls"][0]


def test_requests_a_kworker_dispatched_go_under_the_read(tmp_path: Path) -> None:
    b = _stall_on_read(Builder())
    b.block(KWORKER, KWORKER, 30.0, 30.5, 128 << 10, "loop3", "kworker/u4:2")
    b.block(KWORKER, KWORKER, 36.0, 37.5, 128 << 10, "loop3", "kworker/u4:2")
    b.block(KWORKER, KWORKER, 20.0, 21.0, 4096, "vda", "kworker/u4:2")  # another device
    b.block(KWORKER, KWORKER, 25.0, 25.1, 4096, "loop3", "kworker/u4:2", rwbs="WS")  # a write (journal)
    b.block(KWORKER, KWORKER, 11.0, 13.0, 4096, "loop3", "kworker/u4:2")  # issued before the read began
    b.proc(OTHER, "other").block(OTHER, OTHER, 31.0, 32.0, 4096, "loop3", "other")  # a traced process's own
    s = _analyze(b, tmp_path)
    c = s["culprit"]
    assert s["cause"] == "storage" and (c["pid"], c["object"]) == (TRAINER, DATA)
    assert (c["block_requests"], c["block_device"], c["block_latency_ns"]) == (2, "loop3", 1_500_000)
    assert c["block_bytes"] == 256 << 10
    assert (c["block_attribution"], c["dispatched_by"], c["block_shared"]) == ("dispatched", "kworker/u4:2", False)
    blocks = [e for e in s["evidence"] if e["kind"] == "block"]
    assert [(e["pid"], e["tid"], e["start_ns"]) for e in blocks] == [
        (KWORKER, KWORKER, ns(30)),
        (KWORKER, KWORKER, ns(36)),
    ]
    assert KWORKER not in analyze_pids(tmp_path), "a kernel worker is not a traced process"
    assert describe(s) == ("pid 100 (python) pread64 /data/shard-0042.bin, 2 block requests (256 KiB) on loop3, "
                           "1.5 ms device latency (dispatched by kworker/u4:2) [ext4]")


def analyze_pids(tmp_path: Path) -> list[int]:
    with open_capture(tmp_path / "s.gputrace") as reader:
        return analyze(reader)["capture"]["pids"]


def test_own_requests_are_submitted_and_win(tmp_path: Path) -> None:
    b = _stall_on_read(Builder())
    b.block(TRAINER, TRAINER, 12.5, 20.0, 128 << 10, "loop3", "python")
    b.block(KWORKER, KWORKER, 30.0, 30.5, 128 << 10, "loop3", "kworker/u4:2")
    c = _analyze(b, tmp_path)["culprit"]
    assert (c["block_requests"], c["block_attribution"]) == (1, "submitted")
    assert "dispatched_by" not in c and "block_shared" not in c


def test_a_request_under_two_traced_reads_is_shared_not_given_to_one(tmp_path: Path) -> None:
    b = _stall_on_read(Builder())
    b.proc(READER2, "reader2").syscall(READER2, READER2, "read", 29.0, 45.0, "/data/other.bin", 4096)
    b.block(KWORKER, KWORKER, 30.0, 30.5, 128 << 10, "loop3", "kworker/u4:2")  # inside both reads
    b.block(KWORKER, KWORKER, 20.0, 20.5, 128 << 10, "loop3", "kworker/u4:2")  # inside the trainer's only
    c = _analyze(b, tmp_path)["culprit"]
    assert (c["pid"], c["object"], c["block_requests"]) == (TRAINER, DATA, 2)
    assert c["block_shared"] is True and c["block_shared_with"] == [READER2]


def test_without_the_mount_source_nothing_is_tied(tmp_path: Path) -> None:
    b = _stall_on_read(Builder())
    b.block(KWORKER, KWORKER, 30.0, 30.5, 128 << 10, "loop3", "kworker/u4:2")
    c = _analyze(b, tmp_path, mounts=[["/", "ext4"], ["/data", "ext4"]])["culprit"]  # an older capture
    assert c["object"] == DATA and c["bytes"] == 256 << 10 and "block_requests" not in c


def test_block_device_names_of_a_path() -> None:
    mounts = MountTable([
        ["/", "ext4", "/dev/vda", "254:0"],
        ["/data", "xfs", "/dev/mapper/vg-data", "253:0"],
        ["/mnt/fuse", "fuse.x", "x", "0:52"],
        ["/old", "ext4"],
    ])
    assert block_device_of("/data/a", mounts, {"253:0": "dm-0"}) == ["mapper/vg-data", "dm-0", "253:0"]
    assert block_device_of("/etc/passwd", mounts, {}) == ["vda", "254:0"]
    assert block_device_of("/mnt/fuse/a", mounts, {}) == []
    assert block_device_of("/old/a", mounts, {}) == []


def _scan(path: str, rows: list[object]) -> list[str]:
    """The mount row holding ``path`` by a scan of every row: the longest mount point that is the path or
    begins it followed by "/" (a point's trailing "/" aside), the first of equal ones."""
    best: list[str] = []
    best_len = -1
    for entry in rows:
        if not (isinstance(entry, (list, tuple)) and len(entry) >= 2):
            continue
        point = str(entry[0])
        if (path == point or path.startswith(point.rstrip("/") + "/")) and len(point) > best_len:
            best, best_len = [str(x) for x in entry], len(point)
    return best


def test_mount_table_finds_the_row_a_scan_finds() -> None:
    """Looked up by a path's ancestors, the row is the one a scan of every row picks: nested and overmounted
    points, points with trailing slashes, "/" and "//", a point that only begins another's name, malformed
    rows; and a path no row holds."""
    rng = random.Random(7)
    parts = ["data", "database", "d", "mnt", "fuse", "x", ""]
    points = ["/", "//", "/data", "/data/", "/database", "/data/x", "/mnt/fuse", "/mnt/fuse/", "data", "/d//x"]
    paths = ["/", "//", "", "data", "/data", "/data/", "/data/x", "/data/xy", "/database/a", "/mnt", "/mnt/fuse",
             "/mnt/fuse/a/b", "/d//x/y", "/d/x", "no-slash", "/data//x"]
    paths += ["/" + "/".join(rng.choice(parts) for _ in range(rng.randint(1, 4))) for _ in range(200)]
    for trial in range(300):
        rows: list[object] = []
        for k in range(rng.randint(0, 12)):
            point = rng.choice(points)
            rows.append(rng.choice([[point, f"fs{k}"], [point, f"fs{k}", f"/dev/sd{k}", f"8:{k}"], (point, k),
                                    [point], "junk", None, {point: 1}]))
        table = MountTable(rows)
        for path in paths:
            assert table.row(path) == _scan(path, rows), (trial, path, rows)
    assert MountTable([]).row("/data") == []
    # each answer is the caller's own list
    table = MountTable([["/", "ext4"]])
    table.row("/a").append("x")
    assert table.row("/a") == ["/", "ext4"]
