"""Names of mapped files for fault events, read from a real process's /proc/PID/maps: while it runs, after
it unmapped a file, and after it exited (a fault in its last milliseconds, read late); names of received fds,
read from its /proc/PID/fd, and those it closed first counted."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys
from pathlib import Path

from gputrace.analysis.notes import caveats
from gputrace.probes.ebpf import events
from gputrace.probes.ebpf.filemaps import MappedFiles, ReceivedFds
from gputrace.records import FdInfo, FileMap

MAPPER = """
import mmap, sys
maps = []
for path in sys.argv[1:]:
    with open(path, "rb") as f:
        maps.append(mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ))
print("mapped", flush=True)
sys.stdin.readline()
maps.pop().close()
print("unmapped", flush=True)
sys.stdin.readline()
"""


def _fault(pid: int, path: Path) -> bytes:
    st = path.stat()
    devt = os.major(st.st_dev) << 20 | os.minor(st.st_dev)
    return events.FAULT.pack(events.EV_FAULT, devt, pid, pid, 1, 2, 3, st.st_ino, 0)


def test_a_file_is_named_after_its_unmap_and_after_the_exit(tmp_path: Path) -> None:
    files = [tmp_path / name for name in ("a.bin", "b.bin", "c.bin", "never.bin")]
    for f in files:
        f.write_bytes(b"x" * 8192)
    a, b, c, never = files
    emitted: list[FileMap] = []
    forgotten: list[tuple[int, str, int]] = []
    names = MappedFiles(emitted.extend, forgotten.append)
    proc = subprocess.Popen([sys.executable, "-c", MAPPER, str(a), str(b), str(c)], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert proc.stdin is not None and proc.stdout is not None
    try:
        assert proc.stdout.readline().strip() == "mapped"
        names.fault(_fault(proc.pid, a))  # read while everything is mapped
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.stdout.readline().strip() == "unmapped"
        names.fault(_fault(proc.pid, c))  # c is gone from maps now: the earlier read names it
        proc.stdin.write("\n")
        proc.stdin.flush()
        assert proc.wait(10) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    names.process_gone(proc.pid)
    names.fault(_fault(proc.pid, b))  # after the exit
    names.fault(_fault(proc.pid, never))  # never mapped: no name, and none made up
    assert [(m.pid, m.path) for m in emitted] == [(proc.pid, str(p)) for p in (a, c, b)] + [(proc.pid, "")]
    assert all(m.dev == f"{os.major(a.stat().st_dev)}:{os.minor(a.stat().st_dev)}" for m in emitted)
    assert {k[2] for k in forgotten} == {a.stat().st_ino, c.stat().st_ino}  # announced again if pid reused


def test_a_new_process_of_the_same_pid_is_read_afresh(tmp_path: Path) -> None:
    """What an exited process had mapped does not name files for the next process of its pid."""
    a = tmp_path / "a.bin"
    a.write_bytes(b"x" * 4096)
    emitted: list[FileMap] = []
    names = MappedFiles(emitted.extend, lambda _key: None)
    me = os.getpid()
    with a.open("rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ):
        names.fault(_fault(me, a))
    names.process_gone(me)  # as if this pid had exited ...
    names.fault(_fault(me, a))  # ... with this fault of its last moments still to be read
    names.process_started(me)  # ... and this process were the next one of that pid
    names.process_gone(me)
    names.fault(_fault(me, a))  # which has not mapped it
    assert [m.path for m in emitted] == [str(a), str(a), ""]


HOLDER = """
import os, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
print(fd, flush=True)
sys.stdin.readline()
"""


def _received(pid: int, ts: int, *fds: int) -> bytes:
    return events.FDRECV.pack(events.EV_FDRECV, len(fds), pid, pid, ts, *fds, *[0] * (events.FDRECV_MAX - len(fds)))


def test_received_fds_are_named_while_open_and_counted_when_gone(tmp_path: Path) -> None:
    shard = tmp_path / "shard.bin"
    shard.write_bytes(b"x")
    emitted: list[FdInfo] = []
    received = ReceivedFds(emitted.extend)
    child = subprocess.Popen([sys.executable, "-c", HOLDER, str(shard)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert child.stdout is not None and child.stdin is not None
    fd = int(child.stdout.readline())
    closed = 1000  # no such fd in the child: it was closed before /proc was read
    received.announced(_received(child.pid, 1, fd, closed))  # the process ring's copy, read at once
    child.stdin.close()
    assert child.wait(timeout=30) == 0
    received.in_order(_received(child.pid, 1, fd, closed))  # the events ring's: what was read then is written
    assert [(r.fd, r.kind, r.obj) for r in emitted] == [(fd, "file", str(shard))]
    received.in_order(_received(child.pid, 2, fd))  # first seen in the events ring, after the exit: nothing to read
    received.announced(_received(child.pid, 2, fd))  # its late process-ring copy is not counted again
    assert len(emitted) == 1 and (received.named, received.unnamed) == (1, 2)
    # with the inodes the kernel saw at the recvmsg: a name is taken only where the fd holds that inode still
    child = subprocess.Popen([sys.executable, "-c", HOLDER, str(shard)], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True)  # fmt: skip
    assert child.stdout is not None and child.stdin is not None
    fd = int(child.stdout.readline())
    ino = shard.stat().st_ino
    fds = [fd, *[0] * (events.FDRECV_MAX - 1)]
    for ts, held in ((3, ino), (4, ino + 1), (5, 0)):  # the same file; another (the number used again); unread
        inodes = [held, *[0] * (events.FDRECV_MAX - 1)]
        received.announced(events.FDRECV_NAMED.pack(events.EV_FDRECV, 1, child.pid, child.pid, ts, *fds, *inodes))
        received.in_order(_received(child.pid, ts, fd))
    child.stdin.close()
    assert child.wait(timeout=30) == 0
    assert [(r.ts, r.obj) for r in emitted[1:]] == [(3, str(shard)), (5, str(shard))]
    assert (received.named, received.checked, received.unnamed) == (3, 1, 3)
    notes = [text for _, text in caveats({"skipped_probes": {f"ebpf.{events.FDS_UNNAMED}": 2}})]
    assert any("2 fds received over unix sockets (SCM_RIGHTS) closed before their names" in n for n in notes), notes
