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

"""

from __future__ import annotations

import ctypes
import os
import select
import socket
import sys

EPOLL_CTL_ADD, EPOLL_CTL_MOD = 1, 3
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


def main() -> None:
    mode, port, path, pipe_fd = sys.argv[1], int(sys.argv[2]), sys.argv[3], int(sys.argv[4])
    sock = socket.create_connection(("127.0.0.1", port))
    file_fd = os.open(path, os.O_RDONLY)
    say("done", epoll(mode, sock, file_fd, pipe_fd))


if __name__ == "__main__":
    main()
