"""Naming a file on overlayfs (a container's root) from the inode its page fault names.

A fault names the inode the data lives on: the upper or a lower layer's, on that layer's device.
/proc/PID/maps shows the overlay's device (and, with xino, its own inode number), so the two do not
match. The overlay's mount in /proc/PID/mountinfo lists its layer directories; a mapped overlay path whose
file in some layer has exactly the fault's device and inode is that file. Nothing is guessed: layer
directories that are relative or not visible from gputrace's mount namespace name nothing.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import NamedTuple

from gputrace.capture import unescape_mount_field
from gputrace.probes import procfs

_LAYER_KEYS = ("upperdir", "lowerdir", "lowerdir+", "datadir+")
_MAX_MOUNTINFO = 4 << 20


class Overlay(NamedTuple):
    mountpoint: str
    root: str  # the directory of the filesystem mounted there ("/" unless a bind of a subdirectory)
    layers: tuple[str, ...]  # absolute layer directories, upper first


def parse_mountinfo(text: str) -> dict[str, Overlay]:
    """Overlay mounts by device ("MAJ:MIN", as the kernel numbers them) from mountinfo text."""
    out: dict[str, Overlay] = {}
    for line in text.splitlines():
        head, sep, tail = line.partition(" - ")
        fields, after = head.split(), tail.split()
        if not sep or len(fields) < 5 or len(after) < 3 or after[0] != "overlay":
            continue
        layers: list[str] = []
        for option in after[2].split(","):
            key, _, value = option.partition("=")
            if key in _LAYER_KEYS:
                layers += [unescape_mount_field(d) for d in re.split(r"(?<!\\):", value) if d]
        out[fields[2]] = Overlay(unescape_mount_field(fields[4]), unescape_mount_field(fields[3]), tuple(layers))
    return out


def overlays(pid: int) -> dict[str, Overlay]:
    return parse_mountinfo(procfs.read_text(procfs.PROC / str(pid) / "mountinfo", _MAX_MOUNTINFO))


def resolve(pid: int, dev: str, ino: int, mapped: dict[tuple[str, int], str] | None = None,
            mounts: dict[str, Overlay] | None = None) -> str:
    """The path `pid` mapped whose overlay file is inode `ino` on device `dev` of a layer; "" if none.
    Paths with the same inode number are tried first (overlays without xino show the layer's number).
    ``mounts``: `pid`'s overlays when the caller has them already (read from its mountinfo otherwise)."""
    if mounts is None:
        mounts = overlays(pid)
    if not mounts:
        return ""
    if mapped is None:
        mapped = procfs.mapped_files(pid)
    candidates = [(mdev, mino, path) for (mdev, mino), path in mapped.items() if mdev in mounts]
    candidates.sort(key=lambda c: c[1] != ino)
    for mdev, _, path in candidates:
        if _in_layer(mounts[mdev], path, dev, ino):
            return path
    return ""


def _in_layer(mount: Overlay, path: str, dev: str, ino: int) -> bool:
    rel = _relative(mount, path)
    if rel is None:
        return False
    for layer in mount.layers:
        if not layer.startswith("/"):
            continue
        try:
            st = os.lstat(Path(layer) / rel)
        except (OSError, ValueError):
            continue
        if st.st_ino == ino and f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}" == dev:
            return True
    return False


def _relative(mount: Overlay, path: str) -> str | None:
    """`path` (as maps shows it) inside the overlay's filesystem, relative to the layer roots."""
    point = mount.mountpoint.rstrip("/")
    if path != point and not path.startswith(point + "/"):
        return None
    rel = path[len(point):].lstrip("/")
    if path.endswith(" (deleted)") or "\\012" in rel or ".." in rel.split("/"):
        return None  # unlinked, a name maps had to escape, or not canonical: no layer path to look at
    return os.path.join(mount.root, rel).lstrip("/")
