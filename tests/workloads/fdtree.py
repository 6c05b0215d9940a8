"""Uses fds of every origin, for the fd-resolution tests, driven over stdin/stdout.

    python fdtree.py FILE PORT

Before ``ready PID``: opens FILE and connects a TCP socket to 127.0.0.1:PORT (so tracing finds both in
/proc). After ``go``: reads FILE and round-trips "ping" on that socket; connects a second socket and
round-trips on it; dup2()s the file fd to 42 and reads through it; forks a child that preads the
inherited fd. Prints ``done CHILD_PID`` and exits.
"""

from __future__ import annotations

import os
import socket
import sys


def roundtrip(s: socket.socket) -> None:
    s.sendall(b"ping")
    assert s.recv(16) == b"ping"


def main() -> None:
    path, port = sys.argv[1], int(sys.argv[2])
    fd = os.open(path, os.O_RDONLY)
    old = socket.create_connection(("127.0.0.1", port))
    print(f"ready {os.getpid()}", flush=True)
    if sys.stdin.readline().strip() != "go":
        sys.exit(1)
    os.read(fd, 4096)
    roundtrip(old)
    new = socket.create_connection(("127.0.0.1", port))
    roundtrip(new)
    os.dup2(fd, 42)
    os.pread(42, 100, 0)
    child = os.fork()
    if child == 0:
        os.pread(fd, 100, 0)
        os._exit(0)
    os.waitpid(child, 0)
    print(f"done {child}", flush=True)


if __name__ == "__main__":
    main()
