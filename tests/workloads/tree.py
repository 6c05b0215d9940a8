"""A traced process tree for the eBPF tests, driven line by line over stdin/stdout.

    python tree.py FILE_A FILE_B PIPE_FD

Prints ``ready PID``, then waits for ``go``. Then: starts a thread that blocks reading PIPE_FD (prints
``thread TID``), forks a worker that reads FILE_A with read() and FILE_B with pread() (prints ``worker PID
BYTES_A BYTES_B``), waits for the worker and the thread, prints ``done`` and exits.
"""

from __future__ import annotations

import os
import sys
import threading

CHUNK = 128 << 10


def read_all(path: str) -> int:
    fd = os.open(path, os.O_RDONLY)
    total = 0
    while data := os.read(fd, CHUNK):
        total += len(data)
    os.close(fd)
    return total


def pread_all(path: str) -> int:
    fd = os.open(path, os.O_RDONLY)
    total = 0
    while data := os.pread(fd, CHUNK, total):
        total += len(data)
    os.close(fd)
    return total


def say(line: str) -> None:
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main() -> None:
    file_a, file_b, pipe_fd = sys.argv[1], sys.argv[2], int(sys.argv[3])
    say(f"ready {os.getpid()}")
    if sys.stdin.readline().strip() != "go":
        sys.exit(1)
    got: list[bytes] = []
    tid_known = threading.Event()
    tids: list[int] = []

    def blocked_reader() -> None:
        tids.append(threading.get_native_id())
        tid_known.set()
        got.append(os.read(pipe_fd, 64))

    t = threading.Thread(target=blocked_reader, name="pipe-reader")
    t.start()
    tid_known.wait()
    say(f"thread {tids[0]}")
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        os.write(w, f"{os.getpid()} {read_all(file_a)} {pread_all(file_b)}".encode())
        os._exit(0)
    os.close(w)
    report = os.read(r, 100).decode()
    os.waitpid(pid, 0)
    say(f"worker {report}")
    t.join()
    say(f"done {got[0].decode()}")


if __name__ == "__main__":
    main()
