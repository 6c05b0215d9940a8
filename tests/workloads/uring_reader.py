"""Reads files through io_uring (tests/workloads/uring_read.c, built by ``build``) when told to.

    python uring_reader.py LIB.so

Prints ``ready PID RINGFD`` once the ring exists, then for each stdin line ``PATH CHUNK DEPTH FLAGS`` reads
the whole file through the ring and prints ``read TID FD BYTES REQUESTS`` (FD: the file's fd while it was
read; REQUESTS: the read requests it took).
Flags: 1 drop the file from the page cache first, 2 IOSQE_ASYNC (an io-wq worker does the reads).
"""

from __future__ import annotations

import ctypes
import subprocess
import sys
import threading
from pathlib import Path

SOURCE = Path(__file__).resolve().parent / "uring_read.c"
DROP_CACHE, ASYNC = 1, 2  # gt_uring_read_file's flags


def build(out_dir: Path) -> Path:
    """uring_read.c as a shared library in ``out_dir`` (no liburing: raw io_uring syscalls)."""
    lib = out_dir / "libgt_uring_read.so"
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-Wall", "-Werror", "-o", str(lib), str(SOURCE)], check=True)
    return lib


def load(path: str | Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(path))
    lib.gt_uring_open.argtypes = [ctypes.c_uint]
    lib.gt_uring_read_file.restype = ctypes.c_long
    lib.gt_uring_read_file.argtypes = [ctypes.c_char_p, ctypes.c_uint, ctypes.c_uint, ctypes.c_int]
    lib.gt_uring_requests.restype = ctypes.c_long
    return lib


def main() -> None:
    lib = load(sys.argv[1])
    ring = lib.gt_uring_open(8)
    if ring < 0:
        raise SystemExit(f"io_uring_setup failed: {-ring}")
    print("ready", threading.get_native_id(), ring, flush=True)
    for line in sys.stdin:
        path, chunk, depth, flags = line.split()
        before = lib.gt_uring_requests()
        n = lib.gt_uring_read_file(path.encode(), int(chunk), int(depth), int(flags))
        made = lib.gt_uring_requests() - before
        print("read", threading.get_native_id(), lib.gt_uring_last_fd(), n, made, flush=True)
    lib.gt_uring_close()


if __name__ == "__main__":
    main()
