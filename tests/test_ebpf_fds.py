"""fds and relative paths after chdir / fchdir, fcntl F_DUPFD, lock waits and SCM_RIGHTS, with real processes."""

from __future__ import annotations

import fcntl
import os
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
from waiting import blocked_in, wait_for
from workloads.ebpfcap import ebpf_capture, of, read_capture
from workloads.piped import PipedChild

from gputrace.analysis.objects import classify
from gputrace.probes.ebpf.hooks import cflags
from gputrace.probes.ebpf.syscalls import syscall_numbers
from gputrace.records import FdInfo, OffCpu, Syscall, SyscallAgg

pytestmark = pytest.mark.kernel  # root and the host's kernel (see tests/conftest.py)

WORKLOADS = Path(__file__).parent / "workloads"
CHUNK = 8 << 20  # fdcalls.py reads each file whole: about a millisecond, well over the threshold
THRESHOLD_NS = 50_000
F_SETLKW, F_GETFL = 7, 3


def _tree(base: Path) -> Path:
    """DIR/{shard-1.bin, data/shard-1.bin, other/shard-1.bin, lockfile}: the same relative name everywhere,
    so resolving it against the wrong directory still names a real file."""
    for sub in ("", "data", "other"):
        (base / sub).mkdir(exist_ok=True)
        (base / sub / "shard-1.bin").write_bytes(os.urandom(CHUNK))
    (base / "lockfile").write_bytes(b"\0")
    return base


class FdCalls(PipedChild):
    """tests/workloads/fdcalls.py: says "ready", waits for "go", runs its scenario, says "done ..."."""

    def __init__(self, scenario: str, base: Path, *extra: str, pass_fds: tuple[int, ...] = ()) -> None:
        super().__init__([sys.executable, str(WORKLOADS / "fdcalls.py"), scenario, str(base), *extra], pass_fds)
        line = self.readline().split()
        assert line[:1] == ["ready"], line

    def go(self) -> None:
        self.send("go")

    def done(self) -> list[str]:
        words = self.readline().split()
        assert words[:1] == ["done"], words
        assert self.proc.wait(timeout=30) == 0
        return words[1:]


@contextmanager
def _workload(scenario: str, base: Path, *extra: str, pass_fds: tuple[int, ...] = ()) -> Iterator[FdCalls]:
    child = FdCalls(scenario, base, *extra, pass_fds=pass_fds)
    try:
        yield child
    finally:
        child.proc.kill()
        child.proc.wait()


def _capture(tmp_path: Path, scenario: str, **kw: Any) -> tuple[list[Any], list[str], int]:
    base = _tree(tmp_path / "tree")
    path = tmp_path / f"{scenario}.gputrace"
    with _workload(scenario, base) as proc, ebpf_capture(path, [proc.pid], threshold_ns=THRESHOLD_NS, **kw):
        proc.go()
        out = proc.done()
    records, _ = read_capture(path)
    return records, out, proc.pid


def _reads(records: list[Any], pid: int) -> list[str]:
    return [s.obj for s in of(records, Syscall) if s.pid == pid and s.name == "read" and s.nbytes == CHUNK]


def test_chdir_moves_relative_paths_and_children_inherit_it(tmp_path: Path) -> None:
    records, out, pid = _capture(tmp_path, "chdir")
    base = tmp_path / "tree"
    assert _reads(records, pid) == [str(base / "data/shard-1.bin"), str(base / "other/shard-1.bin")]
    assert _reads(records, int(out[0])) == [str(base / "other/shard-1.bin")], "cwd not inherited across fork"
    snap = [r for r in of(records, FdInfo) if r.pid == pid and r.fd == -100]
    assert [r.obj for r in snap] == [str(base)]  # the snapshot's cwd, which the reads must not use


def test_fchdir_to_a_known_fd_moves_the_cwd_and_to_an_unknown_one_forgets_it(tmp_path: Path) -> None:
    records, _, pid = _capture(tmp_path, "fchdir")
    base = tmp_path / "tree"
    # The second directory fd came from a syscall the trace does not see: its reads stay relative.
    assert _reads(records, pid) == [str(base / "data/shard-1.bin"), "shard-1.bin"]


def test_os_dup_is_followed_and_short_fcntls_stay_aggregated(tmp_path: Path) -> None:
    records, _, pid = _capture(tmp_path, "dup")
    assert _reads(records, pid) == [str(tmp_path / "tree/data/shard-1.bin")]
    getfl = [s for s in of(records, Syscall) if s.pid == pid and s.name == "fcntl" and s.arg == F_GETFL]
    agg = sum(a.count for a in of(records, SyscallAgg) if a.pid == pid and a.name == "fcntl")
    assert all(s.end_ns - s.start_ns >= THRESHOLD_NS for s in getfl)  # only a call that was long
    assert agg + len(getfl) >= 2000 and agg >= 1900, (agg, len(getfl))


def test_a_lock_wait_names_the_file_and_is_a_wait_on_the_holder(tmp_path: Path) -> None:
    base = _tree(tmp_path / "tree")
    lockfile = base / "lockfile"
    path = tmp_path / "lock.gputrace"
    held = os.open(lockfile, os.O_RDWR)
    fcntl.lockf(held, fcntl.LOCK_EX)
    with _workload("lock", base) as proc, ebpf_capture(path, [proc.pid], threshold_ns=THRESHOLD_NS):
        proc.go()
        assert proc.readline() == "locking"
        blocked_in(proc.pid, syscall_numbers()["fcntl"])
        time.sleep(0.05)  # held on purpose: the wait's length is what the test measures
        fcntl.lockf(held, fcntl.LOCK_UN)
        proc.done()
    os.close(held)
    records, _ = read_capture(path)
    waits = [s for s in of(records, Syscall) if s.pid == proc.pid and s.name == "fcntl" and s.arg == F_SETLKW]
    assert len(waits) == 1, waits
    w = waits[0]
    assert (w.obj, w.ret) == (str(lockfile), 0) and w.end_ns - w.start_ns >= 50_000_000
    assert classify(w) == "wait"  # not storage: it did no I/O, it waited for the lock's holder
    # its sleeps inside the call, as the analysis reads them: a preemption after the wakeup (state R, on a
    # loaded machine) is a wait for a CPU, not the lock's
    slept = [o for o in of(records, OffCpu) if o.tid == w.tid and w.start_ns <= o.start_ns <= w.end_ns
             and o.state != "R" and o.wake_ns]
    assert slept and slept[-1].waker_pid == os.getpid(), ("the holder (this process) woke the waiter", slept)


def test_fds_received_over_a_unix_socket_are_named(tmp_path: Path) -> None:
    base = _tree(tmp_path / "tree")
    shard = base / "data/shard-1.bin"
    path = tmp_path / "recv.gputrace"
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    rpipe, wpipe = os.pipe()
    with ours, _workload("recv", base, str(theirs.fileno()), pass_fds=(theirs.fileno(),)) as proc:
        theirs.close()
        with ebpf_capture(path, [proc.pid], threshold_ns=THRESHOLD_NS) as src:
            proc.go()
            fd = os.open(shard, os.O_RDONLY)
            socket.send_fds(ours, [b"x"], [fd, rpipe])
            assert proc.readline() == "received"
            # both names read while the fds are open (a process that closes them first leaves them unnamed,
            # counted: test_a_received_fd_closed_before_it_is_read_is_counted_unnamed)
            # (each checked against the inode the kernel saw it receive, where BTF gives the file table's layout)
            checked = 2 if "-DGT_FILE_TABLE=1" in cflags("raw", "raw") else 0
            wait_for(lambda: src.received_fds() == (2, checked, 0), what="the received fds to be named")
            proc.send("read")
            proc.done()
            os.close(fd)
    records, _ = read_capture(path)
    assert _reads(records, proc.pid) == [str(shard)]
    infos = [r for r in of(records, FdInfo) if r.pid == proc.pid]
    snapshot_ts = next(r.ts for r in infos if r.kind == "cwd")
    received = sorted((r.kind, r.obj) for r in infos if r.ts != snapshot_ts)  # written at the recvmsg
    assert received == [("file", str(shard)), ("pipe", f"pipe:[{os.fstat(rpipe).st_ino}]")]
    os.close(rpipe)
    os.close(wpipe)


TIMED_RECV = """
import select, socket, sys
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
s.settimeout(10)  # Python waits for the data in poll() on the one socket, then reads it at once
print("ready", flush=True)
sys.stdin.readline()
got = s.recv(16)
p = select.poll()  # two fds polled: no one fd names the wait
for _ in range(2):
    p.register(__import__("os").pipe()[0], select.POLLIN)
p.poll(20)
print("done", got.decode(), s.fileno(), flush=True)
"""


def test_a_socket_read_with_a_timeout_waits_on_the_peer(tmp_path: Path) -> None:
    """A socket with a timeout (requests, grpc, socket.settimeout) waits in poll() on that one socket, not in
    recv(): the poll names the peer and is a network wait, not a wait for another task."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    child = PipedChild([sys.executable, "-c", TIMED_RECV, str(port)])
    try:
        conn, _ = server.accept()
        assert child.readline() == "ready"
        with ebpf_capture(tmp_path / "p.gputrace", [child.pid], threshold_ns=THRESHOLD_NS):
            child.send("go")
            blocked_in(child.pid, syscall_numbers()["poll"])
            time.sleep(0.08)  # held on purpose: the wait's length is what the test measures
            conn.sendall(b"batch")
            words = child.readline().split()
            assert words[:2] == ["done", "batch"], words
    finally:
        child.proc.kill()
        child.proc.wait()
        server.close()
    records, _ = read_capture(tmp_path / "p.gputrace")
    polls = [s for s in of(records, Syscall) if s.pid == child.pid and s.name == "poll"]
    [wait] = [s for s in polls if s.end_ns - s.start_ns > 50_000_000]
    assert (wait.fd, wait.obj, classify(wait)) == (int(words[2]), f"127.0.0.1:{port}", "network")
    two = [s for s in polls if s is not wait]
    assert two and all(s.fd == -1 and s.obj == "" for s in two), polls


READY_WAITS = """
import ctypes, os, select, socket, sys
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
r, w = os.pipe()
ep = select.epoll()  # asyncio's loop: the data word of each registration is the fd
ep.register(r, select.EPOLLIN)
ep.register(s.fileno(), select.EPOLLIN)
p = select.poll()  # several fds: the ready one is named
p.register(r, select.POLLIN)
p.register(s.fileno(), select.POLLIN)
libc = ctypes.CDLL(None, use_errno=True)
class Event(ctypes.Structure):  # x86_64 packs struct epoll_event
    _pack_ = 1
    _fields_ = [("events", ctypes.c_uint32), ("data", ctypes.c_uint64)]
raw = select.epoll()  # a loop whose data word is a pointer, not an fd (-100 in its low half: AT_FDCWD)
ev = Event(select.EPOLLIN, 0x7F00DEADFFFFFF9C)
assert libc.epoll_ctl(raw.fileno(), 1, s.fileno(), ctypes.byref(ev)) == 0
out = (Event * 4)()
print("ready", flush=True)
for kind in ("epoll", "poll", "raw"):
    sys.stdin.readline()
    if kind == "epoll":
        got = ep.poll(10)
    elif kind == "poll":
        got = p.poll(10000)
    else:
        got = libc.epoll_wait(raw.fileno(), out, 4, 10000)
    print(kind, got, s.recv(16).decode(), flush=True)
print("done", s.fileno(), flush=True)
"""


@pytest.mark.parametrize("hook", ["raw", "classic"])
def test_an_event_loop_wait_names_the_fd_found_ready(tmp_path: Path, hook: str) -> None:
    """An event loop (asyncio) waits in epoll_wait on many fds; the one it found ready names the wait: the peer's
    socket makes it a network wait. A poll of several fds names its ready one the same way. A loop whose data
    word is no fd (a pointer whose low half happens to be AT_FDCWD) names the fd registered with that word: all
    three were registered before the capture began, and are read from /proc's fdinfo when it does."""
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    child = PipedChild([sys.executable, "-c", READY_WAITS, str(port)])
    lines = []
    try:
        conn, _ = server.accept()
        assert child.readline() == "ready"
        with ebpf_capture(tmp_path / "p.gputrace", [child.pid], threshold_ns=THRESHOLD_NS, syscall_hook=hook):
            for call in ("epoll_wait", "poll", "epoll_wait"):
                child.send("go")
                blocked_in(child.pid, syscall_numbers()[call])
                time.sleep(0.08)  # held on purpose: the wait's length is what the test measures
                conn.sendall(b"batch")
                lines.append(child.readline())
            words = child.readline().split()
    finally:
        child.proc.kill()
        child.proc.wait()
        server.close()
    assert words[0] == "done" and all(line.endswith(" batch") for line in lines), (lines, words)
    records, _ = read_capture(tmp_path / "p.gputrace")
    waits = [s for s in of(records, Syscall) if s.pid == child.pid and s.end_ns - s.start_ns > 50_000_000]
    assert [s.name for s in waits] == ["epoll_wait", "poll", "epoll_wait"], waits
    epoll, poll, raw = waits
    peer, fd = f"127.0.0.1:{port}", int(words[1])
    assert (epoll.ret, epoll.fd, epoll.obj, classify(epoll)) == (1, fd, peer, "network")
    assert (poll.ret, poll.fd, poll.obj, classify(poll)) == (1, fd, peer, "network")
    assert (raw.ret, raw.fd, raw.obj, classify(raw)) == (1, fd, peer, "network")
