"""The pure-Python side of the eBPF source: peers, states, /proc parsing, and hostile event bytes."""

from __future__ import annotations

import socket
import struct
from pathlib import Path

import pytest

from gputrace.probes import events, procfs
from gputrace.probes.events import KernelDecoder, sockaddr_str, task_state
from gputrace.records import FdInfo, FileMap, PageFault, ProcFork

META = {"layout": events.LAYOUT, "threshold_ns": 0, "syscalls": {0: "read", 42: "connect"},
        "sysflags": {0: events.F_FD | events.F_XFER, 42: events.F_FD | events.F_SOCKADDR | events.F_FDTABLE},
        "devices": {"7:3": "loop3"}}  # fmt: skip


def test_sockaddr_forms() -> None:
    v4 = struct.pack("<H", socket.AF_INET) + struct.pack(">H", 8080) + socket.inet_aton("10.1.2.3") + bytes(8)
    assert sockaddr_str(v4) == "10.1.2.3:8080"
    v6 = (
        struct.pack("<H", socket.AF_INET6)
        + struct.pack(">H", 443)
        + bytes(4)
        + socket.inet_pton(socket.AF_INET6, "fe80::1")
        + bytes(4)
    )
    assert sockaddr_str(v6) == "[fe80::1]:443"
    assert sockaddr_str(struct.pack("<H", socket.AF_UNIX) + b"/run/x.sock\0junk") == "unix:/run/x.sock"
    assert sockaddr_str(struct.pack("<H", socket.AF_UNIX) + b"\0abstract\0") == "unix:@abstract"
    assert sockaddr_str(b"\x02") == "" and sockaddr_str(struct.pack("<H", 2) + b"\x00") == "sockaddr(family 2)"


def test_task_states() -> None:
    assert [task_state(x) for x in (0, 1, 2, 0x80, 0x100)] == ["R", "S", "D", "I", "R"]


def test_proc_net_addresses() -> None:
    assert procfs._hex_addr("0100007F:1F90") == "127.0.0.1:8080"
    assert procfs._hex_addr("00000000000000000000000001000000:0016") == "[::1]:22"
    assert procfs._hex_addr("0000000000000000FFFF00000100007F:0050") == "127.0.0.1:80"


def _sys(nr: int, pid: int, ret: int, a0: int, a1: int = 0) -> bytes:
    return events.SYS.pack(events.EV_SYS, nr, pid, pid, 10, 20, ret, a0, a1, 0)


def test_decoder_resolves_fds_from_snapshot_and_fork() -> None:
    d = KernelDecoder(META)
    d.note_fd(FdInfo(1, 100, 5, "file", "/data/x.bin"))
    d.note_fork(ProcFork(2, 100, 100, 200, 200, False, "python"))
    recs = list(d.decode(_sys(0, 100, 4096, 5) + _sys(0, 200, 10, 5)))
    assert [(r.pid, r.obj, r.nbytes) for r in recs] == [(100, "/data/x.bin", 4096), (200, "/data/x.bin", 10)]


def test_connect_event_names_the_peer() -> None:
    d = KernelDecoder(META)
    addr = struct.pack("<H", socket.AF_INET) + struct.pack(">H", 9000) + socket.inet_aton("127.0.0.1")
    head = events.SYS.pack(events.EV_PATH, 42, 7, 7, 1, 2, 0, 3, 16, 0)
    blob = head + struct.pack("<II", len(addr), 0) + addr.ljust(256, b"\0")
    assert len(blob) == events.PATH.size
    connect, read = d.decode(blob + _sys(0, 7, 5, 3))
    assert (connect.name, connect.obj, read.obj) == ("connect", "127.0.0.1:9000", "127.0.0.1:9000")


@pytest.mark.parametrize("blob", [b"\x01\x00", b"\x63\x00\x00\x00" + bytes(60), _sys(0, 1, 0, 0)[:40]])
def test_garbage_is_refused(blob: bytes) -> None:
    with pytest.raises(ValueError):
        list(KernelDecoder(META).decode(blob))


def test_foreign_layout_is_refused() -> None:
    with pytest.raises(ValueError, match="layout"):
        KernelDecoder({**META, "layout": 99})


def _fault(pid: int, dev: int = 7 << 20 | 3, ino: int = 12, index: int = 5) -> bytes:
    return events.FAULT.pack(events.EV_FAULT, dev, pid, pid + 1, 100, 150, 400, ino, index)


def test_fault_event_names_its_file_from_the_mapping_record() -> None:
    d = KernelDecoder({**META, "page_size": 4096})
    d.note_map(FileMap(1, 9, "7:3", 12, "/data/shard.bin"))
    named, other = d.decode(_fault(9) + _fault(9, ino=13))
    assert named == PageFault(9, 10, 100, 400, 250, "/data/shard.bin", 5 * 4096, "7:3", 12)
    assert (other.obj, other.ino, other.dev) == ("", 13, "7:3")  # no mapping record: unnamed, not guessed
    assert events.fault_key(_fault(9)) == (9, "7:3", 12)


def test_a_layout_1_capture_still_decodes() -> None:
    assert [r.obj for r in KernelDecoder({**META, "layout": 1}).decode(_sys(0, 1, 0, 0))] == [""]


def test_mapped_files_parses_proc_maps(tmp_path: Path) -> None:
    import mmap
    import os

    f = tmp_path / "with space\nand newline.bin"
    f.write_bytes(b"x" * 8192)
    with open(f, "rb") as fh, mmap.mmap(fh.fileno(), 0, prot=mmap.PROT_READ):
        st = os.stat(f)
        got = procfs.mapped_files(os.getpid())
    key = (f"{os.major(st.st_dev)}:{os.minor(st.st_dev)}", st.st_ino)
    assert got[key] == str(f).replace("\n", "\\012")  # the kernel escapes a newline; the rest is verbatim
    assert all(p.startswith("/") for p in got.values())
    assert procfs.mapped_files(2**22 + 1) == {}  # no such process
