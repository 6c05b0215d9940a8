"""Readiness waits whose ready fd tests/test_ebpf_ready.py checks, driven over stdin/stdout.

    python readywaits.py MODE PORT FILE PIPE_FD

Connects to 127.0.0.1:PORT (the slow peer, which answers when the test says) and opens FILE, a regular file.
PIPE_FD is the read end of a pipe the test writes to. Prints ``ready SOCK FILE_FD`` once set up and waits for
``go``. Before each wait it prints ``waiting``; after it, what the wait returned, then it reads what was
ready (the peer's bytes, the pipe's byte). At the end it prints ``done [CHILD_PID]`` and exits.

MODE, for an epoll loop whose data words are tokens, not fds (as Rust's mio/tokio register): the peer's
socket is registered with the number of FILE's fd as its token, the pipe with the socket's fd number, so an
fd taken from a token names the wrong file. Two waits: one woken by the peer, one by the pipe.

- epoll-before: registered before ``ready`` (before the capture: /proc's fdinfo has them).
- epoll-during: registered after ``go``: the socket first with another token, then changed (EPOLL_CTL_MOD).
- epoll-fork: registered after ``go``, then a forked child waits on the inherited epoll fd.

Or select(): ``select``: one socket that the peer answers; the same socket timing out (nothing sent); the
pipe and the socket, the socket ready; the pipe and the socket, neither ready (timing out). Python's select()
calls pselect6; then the select syscall itself, on a copy of the socket at fd 100 (its second fd_set word):
with the pipe, the socket ready; alone, timing out.
"""

from __future__ import annotations

import ctypes
import os
import select
import socket
import sys

EPOLL_CTL_ADD, EPOLL_CTL_MOD = 1, 3
SYS_SELECT = 23  # x86_64
HIGH_FD = 100
libc = ctypes.CDLL(None, use_errno=True)


class Event(ctypes.Structure):
    _pack_ = 1  # x86_64 packs struct epoll_event
    _fields_ = [("events", ctypes.c_uint32), ("data", ctypes.c_uint64)]


def say(*words: object) -> None:
    print(*words, flush=True)


def ctl(ep: int, op: int, fd: int, token: int) -> None:
    ev = Event(select.EPOLLIN, token)
    if libc.epoll_ctl(ep, op, fd, ctypes.byref(ev)) != 0:
        raise OSError(ctypes.get_errno(), "epoll_ctl")


def epoll_waits(ep: int, sock: socket.socket, pipe_fd: int) -> None:
    out = (Event * 4)()
    for source in ("peer", "pipe"):
        say("waiting")
        n = libc.epoll_wait(ep, out, 4, 10_000)
        say(source, n, out[0].data)
        if source == "peer":
            sock.recv(16)
        else:
            os.read(pipe_fd, 1)


def epoll(mode: str, sock: socket.socket, file_fd: int, pipe_fd: int) -> str:
    ep = libc.epoll_create1(0)
    if mode == "epoll-before":
        ctl(ep, EPOLL_CTL_ADD, sock.fileno(), file_fd)
        ctl(ep, EPOLL_CTL_ADD, pipe_fd, sock.fileno())
    say("ready", sock.fileno(), file_fd)
    sys.stdin.readline()
    if mode != "epoll-before":
        ctl(ep, EPOLL_CTL_ADD, sock.fileno(), 0x5EED)
        ctl(ep, EPOLL_CTL_MOD, sock.fileno(), file_fd)
        ctl(ep, EPOLL_CTL_ADD, pipe_fd, sock.fileno())
    if mode != "epoll-fork":
        epoll_waits(ep, sock, pipe_fd)
        return ""
    child = os.fork()
    if child == 0:
        epoll_waits(ep, sock, pipe_fd)
        sys.stdout.flush()
        os._exit(0)
    os.waitpid(child, 0)
    return str(child)


def selects(sock: socket.socket, file_fd: int, pipe_fd: int) -> str:
    say("ready", sock.fileno(), file_fd)
    sys.stdin.readline()
    for what, fds, timeout in (("one", [sock], 10.0), ("one-timeout", [sock], 0.06), ("two", [pipe_fd, sock], 10.0),
                               ("two-timeout", [pipe_fd, sock], 0.06)):  # fmt: skip
        say("waiting")
        ready, _, _ = select.select(fds, [], [], timeout)
        say(what, len(ready))
        if ready:
            sock.recv(16)
    high = os.dup2(sock.fileno(), HIGH_FD)
    for what, fds, timeout in (("high", [pipe_fd, high], 10.0), ("high-timeout", [high], 0.06)):
        say("waiting")
        n = raw_select(fds, timeout)
        say(what, n)
        if n:
            sock.recv(16)
    return ""


def raw_select(fds: list[int], timeout: float) -> int:
    """The select syscall (glibc's select() calls pselect6) for reading ``fds``."""
    words = (ctypes.c_uint64 * 16)()
    for fd in fds:
        words[fd // 64] |= 1 << (fd % 64)
    tv = (ctypes.c_long * 2)(int(timeout), int(timeout % 1 * 1e6))
    libc.syscall.restype = ctypes.c_long
    n = libc.syscall(ctypes.c_long(SYS_SELECT), ctypes.c_long(max(fds) + 1), words, None, None, tv)
    if n < 0:
        raise OSError(ctypes.get_errno(), "select")
    return int(n)


def main() -> None:
    mode, port, path, pipe_fd = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    sock = socket.create_connection(("127.0.0.1", port))
    file_fd = os.open(path, os.O_RDONLY)
    child = selects(sock, file_fd, pipe_fd) if mode == "select" else epoll(mode, sock, file_fd, pipe_fd)
    say("done", child)


if __name__ == "__main__":
    main()
