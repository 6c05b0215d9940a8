"""A read-only FUSE filesystem whose chosen files answer reads slowly, like a remote store.

    python fuse_server.py MOUNTPOINT DELAY_MS "name:size:slow;name:size:slow;..."

File contents are a repeating byte pattern. Runs in the foreground until unmounted.
"""

from __future__ import annotations

import errno
import stat
import sys
import time
from typing import Any

from fuse import FUSE, FuseOSError, Operations


class SlowFS(Operations):  # type: ignore[misc]
    def __init__(self, files: dict[str, tuple[int, bool]], delay_s: float) -> None:
        self.files, self.delay_s = files, delay_s
        self.now = time.time()

    def getattr(self, path: str, fh: Any = None) -> dict[str, Any]:
        base = {"st_uid": 0, "st_gid": 0, "st_atime": self.now, "st_mtime": self.now, "st_ctime": self.now}
        if path == "/":
            return {**base, "st_mode": stat.S_IFDIR | 0o755, "st_nlink": 2}
        entry = self.files.get(path.lstrip("/"))
        if entry is None:
            raise FuseOSError(errno.ENOENT)
        return {**base, "st_mode": stat.S_IFREG | 0o444, "st_nlink": 1, "st_size": entry[0]}

    def readdir(self, path: str, fh: Any) -> list[str]:
        return [".", "..", *self.files]

    def open(self, path: str, flags: int) -> int:
        if path.lstrip("/") not in self.files:
            raise FuseOSError(errno.ENOENT)
        return 0

    def read(self, path: str, size: int, offset: int, fh: Any) -> bytes:
        total, slow = self.files[path.lstrip("/")]
        if slow:
            time.sleep(self.delay_s)
        n = max(0, min(size, total - offset))
        return bytes((offset + i) & 0xFF for i in range(n))


def main() -> None:
    mountpoint, delay_ms, spec = sys.argv[1], float(sys.argv[2]), sys.argv[3]
    files = {}
    for item in spec.split(";"):
        name, size, slow = item.split(":")
        files[name] = (int(size), slow == "1")
    FUSE(SlowFS(files, delay_ms / 1e3), mountpoint, foreground=True, ro=True, nothreads=True, direct_io=True)


if __name__ == "__main__":
    main()
