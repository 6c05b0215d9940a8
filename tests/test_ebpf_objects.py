"""fds resolve to what they are: files and peers from the /proc snapshot, from fd events, across dup/fork."""

from __future__ import annotations

import socket
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from workloads.ebpfcap import ebpf_capture, of, read_capture
from workloads.piped import PipedChild

from gputrace.records import FdInfo, Syscall

pytestmark = pytest.mark.kernel  # root and the host's kernel (see tests/conftest.py)

WORKLOADS = Path(__file__).parent / "workloads"


@pytest.fixture
def echo_server() -> Iterator[int]:
    srv = socket.create_server(("127.0.0.1", 0))
    stop = threading.Event()

    def serve(conn: socket.socket) -> None:
        with conn:
            while data := conn.recv(64):
                conn.sendall(data)

    def accept() -> None:
        while not stop.is_set():
            try:
                conn, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(conn,), daemon=True).start()

    threading.Thread(target=accept, daemon=True).start()
    yield srv.getsockname()[1]
    stop.set()
    srv.close()


def test_fds_resolve_to_files_and_peers(tmp_path: Path, echo_server: int) -> None:
    data = tmp_path / "data.bin"
    data.write_bytes(b"x" * 8192)
    tree = PipedChild([sys.executable, str(WORKLOADS / "fdtree.py"), str(data), str(echo_server)])
    pid = int(tree.readline().split()[1])
    path = tmp_path / "fd.gputrace"
    with ebpf_capture(path, [pid], threshold_ns=0):
        tree.send("go")
        child = int(tree.readline().split()[1])
        assert tree.proc.wait(timeout=10) == 0
    records, _ = read_capture(path)
    peer = f"127.0.0.1:{echo_server}"

    snap = {r.fd: r for r in of(records, FdInfo) if r.pid == pid}
    assert any(r.kind == "file" and r.obj == str(data) for r in snap.values())
    assert any(r.kind == "socket" and r.obj == peer for r in snap.values())
    assert snap[-100].kind == "cwd"

    calls = [s for s in of(records, Syscall) if s.pid == pid]
    reads = [s for s in calls if s.name == "read" and s.nbytes == 4096]
    assert reads and reads[0].obj == str(data), "pre-existing file fd not resolved from /proc"
    sends = [s for s in calls if s.name in ("sendto", "sendmsg", "write") and s.obj == peer]
    assert len(sends) == 2, "sends on the old (snapshot) and the new (connect) socket"
    connects = [s for s in calls if s.name == "connect"]
    assert connects and connects[0].obj == peer and connects[0].ret == 0
    dup_read = [s for s in calls if s.name == "pread64" and s.fd == 42]
    assert dup_read and dup_read[0].obj == str(data)
    child_read = [s for s in of(records, Syscall) if s.pid == child and s.name == "pread64"]
    assert child_read and child_read[0].obj == str(data), "fd table not inherited across fork"
