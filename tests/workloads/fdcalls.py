"""Changes its fd table and working directory in the ways tests/test_ebpf_fds.py checks, over stdin/stdout.

    python fdcalls.py SCENARIO DIR [SOCK_FD]

Runs with DIR as its working directory. Prints ``ready PID``, waits for ``go``, runs SCENARIO, prints
``done [CHILD_PID]`` and exits. Every file read is read whole in one call (big enough to be recorded):

- chdir: chdir("data") (relative), read "shard-1.bin"; chdir(DIR/other) (absolute), read "shard-1.bin";
  fork a child that reads "shard-1.bin" (the inherited cwd).
- fchdir: fchdir() to an fd of DIR/data opened with openat, read "shard-1.bin"; then fchdir() to an fd of
  DIR/other opened with the legacy open syscall (which gputrace does not trace), read "shard-1.bin".
- dup: os.dup() (fcntl F_DUPFD_CLOEXEC) of an fd of DIR/data/shard-1.bin, close the original, read the
  duplicate; then 2000 fcntl(F_GETFL).
- lock: print ``locking``, lockf(F_LOCK) DIR/lockfile (fcntl F_SETLKW; the test holds the lock).
- recv: recvmsg() on the unix socket SOCK_FD, taking up to 4 fds (SCM_RIGHTS); read the first whole.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import socket
import sys

CHUNK = 8 << 20
_SYS_OPEN = 2  # x86_64 open(2): not traced, so its fd is unknown to the trace


def read_all(path_or_fd: str | int) -> None:
    fd = os.open(path_or_fd, os.O_RDONLY) if isinstance(path_or_fd, str) else path_or_fd
    assert len(os.read(fd, CHUNK)) == CHUNK
    os.close(fd)


def untraced_open_dir(path: str) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    libc.syscall.restype = ctypes.c_long
    fd = libc.syscall(_SYS_OPEN, path.encode(), os.O_RDONLY | os.O_DIRECTORY)
    if fd < 0:
        raise OSError(ctypes.get_errno(), path)
    return int(fd)


def chdir(base: str) -> str:
    os.chdir("data")
    read_all("shard-1.bin")
    os.chdir(os.path.join(base, "other"))
    read_all("shard-1.bin")
    child = os.fork()
    if child == 0:
        read_all("shard-1.bin")
        os._exit(0)
    os.waitpid(child, 0)
    return str(child)


def fchdir(base: str) -> str:
    known = os.open(os.path.join(base, "data"), os.O_RDONLY | os.O_DIRECTORY)
    os.fchdir(known)
    read_all("shard-1.bin")
    os.fchdir(untraced_open_dir(os.path.join(base, "other")))
    read_all("shard-1.bin")
    return ""


def dup(base: str) -> str:
    fd = os.open(os.path.join(base, "data", "shard-1.bin"), os.O_RDONLY)
    new = os.dup(fd)
    os.close(fd)
    read_all(new)
    keep = os.open(os.path.join(base, "data"), os.O_RDONLY)
    for _ in range(2000):
        fcntl.fcntl(keep, fcntl.F_GETFL)
    return ""


def lock(base: str) -> str:
    fd = os.open(os.path.join(base, "lockfile"), os.O_RDWR)
    print("locking", flush=True)
    fcntl.lockf(fd, fcntl.LOCK_EX)
    return ""


def recv(sock_fd: int) -> str:
    """Receives a file's fd and a pipe's, says so, and reads the file once told to (the fds stay open until
    then: their names are read from /proc meanwhile)."""
    with socket.socket(fileno=sock_fd) as s:
        _, fds, _, _ = socket.recv_fds(s, 16, 4)
    print("received", flush=True)
    if sys.stdin.readline().strip() != "read":
        sys.exit(1)
    read_all(fds[0])
    return ""


def main() -> None:
    scenario, base = sys.argv[1], sys.argv[2]
    os.chdir(base)
    print(f"ready {os.getpid()}", flush=True)
    if sys.stdin.readline().strip() != "go":
        sys.exit(1)
    if scenario == "recv":
        out = recv(int(sys.argv[3]))
    else:
        out = {"chdir": chdir, "fchdir": fchdir, "dup": dup, "lock": lock}[scenario](base)
    print(f"done {out}".strip(), flush=True)


if __name__ == "__main__":
    main()
