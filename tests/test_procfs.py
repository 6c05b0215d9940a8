"""What /proc says about a thread's syscall, for real threads."""

from __future__ import annotations

import os
import subprocess
import sys

from waiting import wait_for

from gputrace.probes import procfs


def test_blocked_syscall_of_a_reader_and_of_a_kernel_thread() -> None:
    r, w = os.pipe()
    p = subprocess.Popen([sys.executable, "-c", "import os, sys; os.read(int(sys.argv[1]), 1)", str(r)],
                         pass_fds=(r,))
    try:
        wait_for(lambda: procfs.thread_state(p.pid, p.pid) == "S" and procfs.blocked_syscall(p.pid, p.pid) == (0, r),
                 10, "the reader to block")
        assert procfs.blocked_syscall(p.pid, p.pid) == (0, r)  # read(2) is nr 0 on x86_64, its first argument the fd
    finally:
        os.write(w, b"x")
        p.wait(10)
        os.close(r)
        os.close(w)
    # kthreadd's /proc/2/syscall is all zeros: not "blocked in read(0)"
    assert procfs.comm(2) == "kthreadd"
    assert procfs.blocked_syscall(2, 2) is None


LEADER_EXITS = """
import ctypes, sys, threading, time
def worker():
    sys.stdin.readline()
threading.Thread(target=worker).start()
print("ready", flush=True)
ctypes.CDLL(None).pthread_exit(None)  # the main thread ends alone; the process runs on
"""


def test_running_tells_a_zombie_from_a_live_process_and_a_leaderless_one() -> None:
    zombie = subprocess.Popen(["true"])  # exits at once and is not reaped until wait()
    wait_for(lambda: procfs.thread_state(zombie.pid, zombie.pid) == "Z", 10, "the child to exit")
    assert (procfs.PROC / str(zombie.pid)).is_dir() and not procfs.running(zombie.pid)
    zombie.wait()
    assert not procfs.running(zombie.pid)  # reaped: gone
    leaderless = subprocess.Popen([sys.executable, "-c", LEADER_EXITS], stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    try:
        assert leaderless.stdout is not None and leaderless.stdout.readline() == b"ready\n"
        wait_for(lambda: procfs.thread_state(leaderless.pid, leaderless.pid) == "Z", 10, "the main thread to end")
        assert procfs.running(leaderless.pid) and procfs.running(os.getpid())
    finally:
        leaderless.kill()
        leaderless.wait()


def test_the_snapshot_has_what_each_epoll_fd_watches_with_its_whole_data_word() -> None:
    """/proc/PID/fdinfo/EPFD of this process's own epoll fd: each registration's fd, events and 64-bit data word
    (Python's register() sets only the low half, the fd; the upper half is whatever was there)."""
    import select

    from gputrace.records import EpollEntry, FdInfo

    ep = select.epoll()
    epfd = ep.fileno()
    r, w = os.pipe()
    try:
        ep.register(r, select.EPOLLIN)
        ep.register(w, select.EPOLLOUT)
        snap = procfs.snapshot(os.getpid())
    finally:
        ep.close()
        os.close(r)
        os.close(w)
    assert [s.obj for s in snap if isinstance(s, FdInfo) and s.fd == epfd] == ["anon_inode:[eventpoll]"]
    io = select.EPOLLIN | select.EPOLLOUT  # the kernel adds EPOLLERR | EPOLLHUP
    entries = sorted((e.epfd, e.fd, e.events & io, e.data & 0xFFFFFFFF) for e in snap
                     if isinstance(e, EpollEntry) and e.epfd == epfd)  # not those of other tests' epoll fds
    assert entries == [(epfd, r, select.EPOLLIN, r), (epfd, w, select.EPOLLOUT, w)]
    assert snap.index(next(e for e in snap if isinstance(e, EpollEntry))) > max(
        i for i, s in enumerate(snap) if isinstance(s, FdInfo))  # the fds first: they name what is registered


def test_socket_fds_are_named_by_their_peers_and_the_tcp_tables_read_only_for_a_tcp_socket() -> None:
    """This process's own sockets: a listening TCP socket, a connected TCP pair and a named unix socket are
    each named by what /proc/PID/net says; asked only for the unix socket, the tables are read no further than
    the unix one (a TCP table's read walks the host's whole connection hash: milliseconds)."""
    import socket
    import tempfile

    from gputrace.records import FdInfo

    with tempfile.TemporaryDirectory() as d, socket.socket() as listener, \
            socket.socket(socket.AF_UNIX) as unix:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        unix.bind(f"{d}/u.sock")
        with socket.create_connection(("127.0.0.1", port)) as client:
            server, _ = listener.accept()
            with server:
                fds = {"listener": listener.fileno(), "unix": unix.fileno(), "client": client.fileno(),
                       "server": server.fileno()}
                inode = {k: os.fstat(fd).st_ino for k, fd in fds.items()}
                client_port = client.getsockname()[1]
                names = {i.fd: i.obj for i in procfs.fd_snapshot(os.getpid()) if isinstance(i, FdInfo)}
                only_unix = procfs.socket_peers(os.getpid(), {inode["unix"]})
                everything = procfs.socket_peers(os.getpid())
    assert names[fds["listener"]] == f"listen 127.0.0.1:{port}"
    assert names[fds["client"]] == f"127.0.0.1:{port}"
    assert names[fds["server"]] == f"127.0.0.1:{client_port}"
    assert names[fds["unix"]] == f"unix:{d}/u.sock"
    assert only_unix[inode["unix"]] == f"unix:{d}/u.sock"
    assert inode["client"] not in only_unix and inode["listener"] not in only_unix
    assert everything[inode["client"]] == f"127.0.0.1:{port}"
    assert everything[inode["unix"]] == f"unix:{d}/u.sock"
