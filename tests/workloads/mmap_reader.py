"""Reads one file through a memory mapping and another with pread(), for the page-fault tests.

    python mmap_reader.py MAPPED_FILE PREAD_FILE SCRATCH_DIR

Prints ``ready PID``, waits for ``go``, then:
1. maps MAPPED_FILE and touches one byte of every page (the pages come from the device: page faults that
   wait), prints ``mapped TID SUM``;
2. reads PREAD_FILE with pread() (waits inside a syscall, not a fault), prints ``read BYTES``;
3. dirties 8 MiB in SCRATCH_DIR, write-faults a page of a cached shared mapping (a file fault that does
   not wait) and at once calls sync() (not a traced syscall: it waits in D, but not in that fault),
   prints ``synced``;
4. waits for ``exit`` (or the end of its input), unmaps MAPPED_FILE and exits. The mapping lives until
   then, so a tracer busy elsewhere can still read its name in /proc/PID/maps.
"""

from __future__ import annotations

import mmap
import os
import sys
import threading

PAGE = mmap.PAGESIZE


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def touch_mapped(path: str) -> tuple[mmap.mmap, int]:
    fd = os.open(path, os.O_RDONLY)
    try:
        m = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    total = 0
    for off in range(0, len(m), PAGE):
        total += m[off]
    return m, total


def pread_all(path: str) -> int:
    fd = os.open(path, os.O_RDONLY)
    total = 0
    while data := os.pread(fd, 128 << 10, total):
        total += len(data)
    os.close(fd)
    return total


def fault_then_sync(scratch: str) -> None:
    with open(os.path.join(scratch, "dirty.bin"), "wb") as f:
        f.write(os.urandom(8 << 20))
    path = os.path.join(scratch, "shared.bin")
    with open(path, "wb") as f:
        f.write(b"\1" * PAGE)
    fd = os.open(path, os.O_RDWR)
    m = mmap.mmap(fd, PAGE, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    m[0] = 2  # a write fault on a cached page: it reaches the file (filemap) without waiting
    os.sync()
    m.close()
    os.close(fd)


def main() -> None:
    mapped, plain, scratch = sys.argv[1], sys.argv[2], sys.argv[3]
    say(f"ready {os.getpid()}")
    if sys.stdin.readline().strip() != "go":
        sys.exit(1)
    m, total = touch_mapped(mapped)
    say(f"mapped {threading.get_native_id()} {total}")
    say(f"read {pread_all(plain)}")
    fault_then_sync(scratch)
    say("synced")
    sys.stdin.readline()
    m.close()


if __name__ == "__main__":
    main()
