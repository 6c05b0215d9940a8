"""A real ext4 filesystem on a loop device, for tests that need real block I/O.

Tests take the ``loopfs`` fixture (tests/conftest.py) or use ``loop_filesystem(dir)``. Files
written with ``write_file`` and dropped with ``drop_cache`` are read from the device, not the page cache.
Needs root (losetup, mount).
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class LoopFs:
    mountpoint: Path
    device: str  # /dev/loopN
    name: str  # loopN, as BlockIO.dev names it
    majmin: str  # "7:N"


def _run(*cmd: str) -> str:
    return subprocess.run(cmd, check=True, capture_output=True, text=True).stdout.strip()


@contextmanager
def loop_filesystem(workdir: Path, size_mib: int = 64) -> Iterator[LoopFs]:
    """Create, mount, yield and then tear down an ext4 filesystem on a fresh loop device."""
    image = workdir / "disk.img"
    mnt = workdir / "mnt"
    mnt.mkdir()
    with open(image, "wb") as f:
        f.truncate(size_mib << 20)
    _run("mkfs.ext4", "-q", "-F", str(image))
    device = _run("losetup", "-f", "--show", str(image))
    try:
        _run("mount", "-t", "ext4", device, str(mnt))
        try:
            name = Path(device).name
            majmin = Path(f"/sys/class/block/{name}/dev").read_text().strip()
            default_limits(majmin)  # whatever an earlier user of this loop device set
            yield LoopFs(mnt, device, name, majmin)
        finally:
            subprocess.run(["umount", str(mnt)], check=False, capture_output=True)
    finally:
        subprocess.run(["losetup", "-d", device], check=False, capture_output=True)


def write_file(path: Path, nbytes: int) -> Path:
    """A file of ``nbytes`` of non-zero data, synced to the device and dropped from the page cache."""
    block = bytes(range(1, 256)) * 257  # 65535 bytes, no zero pages
    with open(path, "wb") as f:
        left = nbytes
        while left:
            left -= f.write(block[: min(left, len(block))])
    drop_cache(path)
    return path


def drop_cache(path: Path) -> None:
    """Make the next read of ``path`` go to the device."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


@contextmanager
def small_tmpfs(path: Path, size: str = "64k", inodes: int | None = None) -> Iterator[Path]:
    """A tmpfs of ``size`` mounted at ``path`` (made here): a real disk that fills up; with ``inodes``, one
    that holds that many inodes, its root directory one of them (2: room for one file, then ENOSPC)."""
    path.mkdir()
    opts = f"size={size}" + (f",nr_inodes={inodes}" if inodes is not None else "")
    subprocess.run(["mount", "-t", "tmpfs", "-o", opts, "gputrace-test", str(path)], check=True)
    try:
        yield path
    finally:
        subprocess.run(["umount", str(path)], check=True)


@contextmanager
def dirty_limit(devnum: str, max_bytes: int, writeback_bps: int) -> Iterator[None]:
    """Let the device's writers keep at most ``max_bytes`` of dirty pages (its bdi's strict limit) and write
    them back at ``writeback_bps`` (a throttle on the root blkio group, where the flusher's writeback is
    accounted): a writer that dirties more is paused in balance_dirty_pages until writeback catches up."""
    bdi = Path("/sys/class/bdi") / devnum
    root = Path("/sys/fs/cgroup/blkio") / "blkio.throttle.write_bps_device"
    try:
        (bdi / "strict_limit").write_text("1")
        (bdi / "max_bytes").write_text(str(max_bytes))
        root.write_text(f"{devnum} {writeback_bps}\n")
        yield
    finally:
        with suppress(OSError):
            root.write_text(f"{devnum} 0\n")  # 0 removes the rule
        default_limits(devnum)


def default_limits(devnum: str) -> None:
    """The kernel's defaults for the device's dirty pages (no strict limit, up to the whole dirty limit). A
    loop device keeps its settings from one attachment to the next."""
    bdi = Path("/sys/class/bdi") / devnum
    for k, v in (("strict_limit", "0"), ("max_ratio", "100")):
        with suppress(OSError):  # the loop device may be gone already
            (bdi / k).write_text(v)
