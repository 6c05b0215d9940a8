"""Real slow things for the ground-truth scenarios: a throttled loop-device filesystem, a FUSE filesystem
that delays reads, a slow TCP peer. Each is a context manager that cleans up after itself."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:  # tests/, where the shared `workloads` helpers live
    sys.path.insert(0, str(HERE.parent))

from workloads import loopdev, uring_reader  # noqa: E402
from workloads.cpu_cgroup import cpu_cgroup  # noqa: E402, F401  (the cpu_throttled scenario's)

BLKIO = Path("/sys/fs/cgroup/blkio")


@contextlib.contextmanager
def loop_filesystem(workdir: Path) -> Iterator[tuple[Path, str]]:
    """An ext4 filesystem on a fresh loop device (tests/workloads/loopdev.py): (mount point, "MAJ:MIN")."""
    with loopdev.loop_filesystem(workdir, size_mib=48) as fs:
        yield fs.mountpoint, fs.majmin


def uring_lib(workdir: Path) -> str:
    """The io_uring reader library (tests/workloads/uring_read.c) built in ``workdir``."""
    return str(uring_reader.build(workdir))


def make_files(directory: Path, prefix: str, count: int, size: int) -> list[str]:
    paths = []
    for i in range(count):
        p = directory / f"{prefix}-{i:03d}.bin"
        p.write_bytes(os.urandom(size))
        paths.append(str(p))
    os.sync()  # clean pages can be dropped from the cache by the readers' fadvise
    return paths


@contextlib.contextmanager
def blkio_cgroups(devnum: str, read_bps: list[int], write_bps: int = 0) -> Iterator[list[str]]:
    """One cgroup v1 blkio group per rate, each throttling reads of ``devnum`` (and writes, to ``write_bps``,
    where given: an fsync's writeback is its caller's)."""
    groups = []
    try:
        for i, bps in enumerate(read_bps):
            g = BLKIO / f"gputrace-scenario-{os.getpid()}-{i}"
            g.mkdir()
            groups.append(g)
            (g / "blkio.throttle.read_bps_device").write_text(f"{devnum} {bps}\n")
            if write_bps:
                (g / "blkio.throttle.write_bps_device").write_text(f"{devnum} {write_bps}\n")
        yield [str(g) for g in groups]
    finally:
        for g in groups:
            _rmdir_cgroup(g)


def _rmdir_cgroup(g: Path) -> None:
    for _ in range(100):  # its last member may still be exiting
        try:
            g.rmdir()
            return
        except OSError:
            time.sleep(0.02)


@contextlib.contextmanager
def fuse_filesystem(workdir: Path, files: dict[str, int], slow: set[str], delay_ms: float) -> Iterator[Path]:
    """A FUSE filesystem served by a separate process; reads of ``slow`` files wait ``delay_ms`` first."""
    mnt = workdir / "fuse"
    mnt.mkdir()
    spec = ";".join(f"{name}:{size}:{int(name in slow)}" for name, size in files.items())
    proc = subprocess.Popen([sys.executable, str(HERE / "fuse_server.py"), str(mnt), str(delay_ms), spec],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        deadline = time.monotonic() + 10
        while not os.path.ismount(mnt):
            if proc.poll() is not None or time.monotonic() > deadline:
                err = proc.stderr.read().decode() if proc.stderr else ""
                raise RuntimeError(f"FUSE server did not mount {mnt}: {err}")
            time.sleep(0.02)
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=False, capture_output=True)
        try:
            proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextlib.contextmanager
def slow_peer(delay_ms: float) -> Iterator[int]:
    """A TCP peer on 127.0.0.1 that answers each request line after ``delay_ms``; yields its port."""
    proc = subprocess.Popen([sys.executable, str(HERE / "peer.py"), str(delay_ms)], stdout=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        line = proc.stdout.readline()
        if not line:
            raise RuntimeError("the peer did not start")
        yield int(line)
    finally:
        proc.kill()
        proc.wait()
