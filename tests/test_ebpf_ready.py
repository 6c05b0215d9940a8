"""The fd a readiness wait names, with real processes and probes: epoll loops whose data words are tokens, not
fds (registered before the capture, during it, and waited on by a forked child), and select()."""

from __future__ import annotations

import os
import socket
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import pytest
from workloads.ebpfcap import ebpf_capture, of, read_capture
from workloads.piped import PipedChild

from gputrace.analysis.objects import classify
from gputrace.records import EpollEntry, Syscall

pytestmark = pytest.mark.kernel  # root and the host's kernel (see tests/conftest.py)

WORKLOAD = Path(__file__).parent / "workloads" / "readywaits.py"
THRESHOLD_NS = 50_000
HELD_S = 0.08  # how long the test keeps a wait waiting before it answers: what makes the wait recorded


class Run(NamedTuple):
    records: list[Any]
    pid: int
    sock: int  # the socket's fd in the workload
    file_fd: int
    pipe_fd: int
    peer: str
    pipe: str  # the pipe's object, as /proc names it
    lines: list[str]  # what each wait returned
    child: int  # the forked child that waited, else 0


@contextmanager
def _peer() -> Iterator[socket.socket]:
    server = socket.create_server(("127.0.0.1", 0))
    try:
        yield server
    finally:
        server.close()


def _run(tmp_path: Path, mode: str, answers: list[str], hook: str = "auto") -> Run:
    """Runs readywaits.py MODE under the capture; before each wait answers with the peer's bytes ("peer"), a
    byte in the pipe ("pipe"), or nothing ("" : the wait times out)."""
    data = tmp_path / "data.bin"
    data.write_bytes(b"x" * 4096)
    rfd, wfd = os.pipe()
    path = tmp_path / f"{mode}.gputrace"
    with _peer() as server:
        port = server.getsockname()[1]
        child = PipedChild([sys.executable, str(WORKLOAD), mode, str(port), str(data), str(rfd)], pass_fds=(rfd,))
        try:
            conn, _ = server.accept()
            words = child.readline().split()
            assert words[:1] == ["ready"], words
            with conn, ebpf_capture(path, [child.pid], threshold_ns=THRESHOLD_NS, syscall_hook=hook):
                child.send("go")
                lines = [_answer(child, conn, wfd, a) for a in answers]
                done = child.readline().split()
                assert done[:1] == ["done"], done
                assert child.proc.wait(timeout=10) == 0
        finally:
            child.proc.kill()
            child.proc.wait()
    pipe = f"pipe:[{os.fstat(rfd).st_ino}]"
    os.close(rfd)
    os.close(wfd)
    records, _ = read_capture(path)
    return Run(records, child.pid, int(words[1]), int(words[2]), rfd, f"127.0.0.1:{port}", pipe, lines,
               int(done[1]) if len(done) > 1 else 0)  # fmt: skip


def _answer(child: PipedChild, conn: socket.socket, wfd: int, answer: str) -> str:
    assert child.readline() == "waiting"
    if answer:
        time.sleep(HELD_S)  # held on purpose: the wait's length is what makes it a recorded call
        if answer == "peer":
            conn.sendall(b"batch")
        else:
            os.write(wfd, b"x")
    return child.readline()


def _waits(run: Run, prefix: str) -> list[Syscall]:
    pid = run.child or run.pid
    return [s for s in of(run.records, Syscall)
            if s.pid == pid and s.name.startswith(prefix) and s.end_ns - s.start_ns >= HELD_S * 0.5e9]  # fmt: skip


@pytest.mark.parametrize(("mode", "hook"), [("epoll-before", "raw"), ("epoll-during", "classic"),
                                            ("epoll-fork", "raw")])  # fmt: skip
def test_an_epoll_token_names_the_fd_registered_with_it_never_the_fd_of_its_number(tmp_path: Path, mode: str,
                                                                                 hook: str) -> None:
    """mio/tokio register a token, not the fd: here the peer's socket's token is the number of an open regular
    file's fd, and the pipe's token the socket's fd number. Each wait names the fd registered with the token it
    found ready: the peer (network), then the pipe (a wait), never the file nor, for the pipe, the socket.
    Registered before the capture (from /proc's fdinfo), during it (epoll_ctl, one changed by EPOLL_CTL_MOD),
    and waited on by a forked child that inherited the epoll fd."""
    run = _run(tmp_path, mode, ["peer", "pipe"], hook)
    assert [line.split()[:3] for line in run.lines] == [["peer", "1", str(run.file_fd)],
                                                        ["pipe", "1", str(run.sock)]], run.lines  # fmt: skip
    peer, pipe = _waits(run, "epoll_")
    assert (peer.ret, peer.fd, peer.obj, classify(peer)) == (1, run.sock, run.peer, "network")
    assert (pipe.ret, pipe.fd, pipe.obj, classify(pipe)) == (1, run.pipe_fd, run.pipe, "wait")
    snapshot = [(e.fd, e.data) for e in of(run.records, EpollEntry) if e.pid == run.pid]
    if mode == "epoll-before":
        assert sorted(snapshot) == sorted([(run.sock, run.file_fd), (run.pipe_fd, run.sock)])
    else:
        assert snapshot == []


@pytest.mark.parametrize("hook", ["raw", "classic"])
def test_a_select_names_its_one_fd_or_the_first_ready_one(tmp_path: Path, hook: str) -> None:
    """select() as poll(): a select of one socket names it, answered or timed out (a socket read with a
    timeout); a select of several names the lowest ready fd when some were ready, and nothing when it timed out.
    Through pselect6 (glibc's select()) and the select syscall, on an fd past the first word of the fd_set."""
    run = _run(tmp_path, "select", ["peer", "", "peer", "", "peer", ""], hook)
    assert [line.split() for line in run.lines] == [["one", "1"], ["one-timeout", "0"], ["two", "1"],
                                                    ["two-timeout", "0"], ["high", "1"],
                                                    ["high-timeout", "0"]], run.lines  # fmt: skip
    waits = [s for s in _waits(run, "") if s.name in ("select", "pselect6")]
    got = [(s.ret, s.fd, s.obj, classify(s)) for s in waits]
    sock, high = (run.sock, run.peer, "network"), (100, run.peer, "network")
    assert got == [(1, *sock), (0, *sock), (1, *sock), (0, -1, "", "wait"), (1, *high), (0, *high)], waits
    assert [s.name for s in waits[4:]] == ["select", "select"]  # the first four: whichever glibc's select() calls
