"""The pure-Python side of the eBPF source: peers, states, /proc parsing, and hostile event bytes."""

from __future__ import annotations

import socket
import struct
from pathlib import Path
from typing import Any

import pytest

from gputrace.probes import procfs
from gputrace.probes.ebpf import events
from gputrace.probes.ebpf.epolls import EVENTPOLL
from gputrace.probes.ebpf.events import KernelDecoder, sockaddr_str, task_state
from gputrace.probes.ebpf.syscalls import SPECS
from gputrace.records import DirtyPause, EpollEntry, FdInfo, FileMap, PageFault, ProcFork

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


def test_a_dirty_pause_is_in_bytes_and_names_its_block_device() -> None:
    """Pages and KB/s as the tracepoint gives them become bytes and bytes/s; a bdi that is no block device (a
    FUSE or NFS mount's "0:52") keeps the kernel's name."""
    d = KernelDecoder({**META, "page_size": 4096})
    loop = events.DIRTY.pack(events.EV_DIRTY, 0, 9, 10, 500, 200, 64, 54, 103, 1000, 8, b"7:3")
    fuse = events.DIRTY.pack(events.EV_DIRTY, 0, 9, 10, 900, 12, 1, 1, 1, 1, 0, b"0:52")
    a, b = d.decode(loop + fuse)
    assert a == DirtyPause(9, 10, 500, 200_000_000, "loop3", 64 * 4096, 54 * 4096, 103 * 4096, 1000 * 4096, 8 * 1024)
    assert (b.dev, b.pause_ns) == ("0:52", 12_000_000)


def test_a_layout_1_capture_still_decodes() -> None:
    assert [r.obj for r in KernelDecoder({**META, "layout": 1}).decode(_sys(0, 1, 0, 0))] == [""]


def test_off_cpu_events_of_both_layouts() -> None:
    """Layout 3's event has no CPU holder; layout 4's names it, and names nobody for the idle task (tid 0)."""
    old = events.OFFCPU.pack(events.EV_OFFCPU, 0, 5, 6, 10, 20, 0, 0, 0, b"")
    new = events.OFFCPU2.pack(events.EV_OFFCPU2, 0, 5, 6, 10, 20, 0, 0, 0, b"", 7, 8, b"hog\0junk", 0)
    idle = events.OFFCPU2.pack(events.EV_OFFCPU2, 1, 5, 6, 10, 20, 15, 9, 9, b"waker", 0, 0, b"swapper/0", 0)
    (a,) = KernelDecoder({**META, "layout": 3}).decode(old)
    b, c = KernelDecoder(META).decode(new + idle)
    assert (a.state, a.held_pid, a.held_tid, a.held_comm) == ("R", 0, 0, "")
    assert (b.state, b.held_pid, b.held_tid, b.held_comm) == ("R", 7, 8, "hog")
    assert (c.state, c.waker_comm, c.held_tid, c.held_comm) == ("S", "waker", 0, "")


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


_CWD_META = {"layout": events.LAYOUT, "threshold_ns": 0,
             "syscalls": {0: "read", 72: "fcntl", 80: "chdir", 81: "fchdir", 257: "openat", 33: "dup2"},
             "sysflags": {0: events.F_FD | events.F_XFER, 72: events.F_FD | events.F_DUPFD,
                          80: events.F_PATH | events.F_PATH0 | events.F_FDTABLE, 81: events.F_FD | events.F_FDTABLE,
                          257: events.F_PATH | events.F_FDTABLE, 33: events.F_FD | events.F_FDTABLE}}  # fmt: skip


def _path_ev(nr: int, pid: int, ret: int, a0: int, path: bytes) -> bytes:
    head = events.SYS.pack(events.EV_PATH, nr, pid, pid, 10, 20, ret, a0 & 0xFFFFFFFFFFFFFFFF, 0, 0)
    return head + struct.pack("<II", len(path), 0) + path.ljust(256, b"\0")


def _open(pid: int, fd: int, path: bytes) -> bytes:
    return _path_ev(257, pid, fd, events.AT_FDCWD, path)


def _objs(d: KernelDecoder, blob: bytes) -> list[tuple[str, str]]:
    return [(r.name, r.obj) for r in d.decode(blob)]


def test_chdir_and_fchdir_move_the_cwd_relative_paths_resolve_against() -> None:
    d = KernelDecoder(_CWD_META)
    d.note_fd(FdInfo(1, 5, events.AT_FDCWD, "cwd", "/home/u"))
    blob = (_path_ev(80, 5, 0, 0, b"data") + _open(5, 3, b"a.bin")  # chdir relative to the cwd
            + _path_ev(80, 5, -2, 0, b"/nowhere") + _open(5, 4, b"b.bin")  # failed: the cwd stays
            + _open(5, 6, b"/srv") + _sys(81, 5, 0, 6) + _open(5, 7, b"c.bin")  # fchdir to a known dir
            + _sys(81, 5, 0, 9) + _open(5, 8, b"d.bin"))  # fchdir to an unknown fd  # fmt: skip
    want = ["/home/u/data", "/home/u/data/a.bin", "/nowhere", "/home/u/data/b.bin", "/srv", "/srv", "/srv/c.bin",
            "", "d.bin"]  # fmt: skip
    assert [o for _, o in _objs(d, blob)] == want
    assert [r.fd for r in d.decode(_path_ev(80, 5, 0, 0, b"/x"))] == [-1]  # chdir returns no fd


def test_a_chdir_path_cut_short_forgets_the_cwd() -> None:
    d = KernelDecoder(_CWD_META)
    d.note_fd(FdInfo(1, 5, events.AT_FDCWD, "cwd", "/home/u"))
    long = b"/" + b"d" * (events.PATH_MAX_DATA - 1)
    assert _objs(d, _path_ev(80, 5, 0, 0, long) + _open(5, 3, b"a.bin"))[1] == ("openat", "a.bin")


def test_fcntl_dupfd_copies_the_object_other_commands_do_not() -> None:
    d = KernelDecoder(_CWD_META)
    d.note_fd(FdInfo(1, 5, 3, "file", "/data/x.bin"))
    d.note_fd(FdInfo(1, 5, 9, "file", "/stale.bin"))
    blob = (_sys(72, 5, 7, 3, 1030) + _sys(0, 5, 1, 7)  # F_DUPFD_CLOEXEC: fd 7 is fd 3's file
            + _sys(72, 5, 8, 3, 3) + _sys(0, 5, 1, 8)  # F_GETFL returns flags, not an fd
            + _sys(33, 5, 9, 4, 9) + _sys(0, 5, 1, 9))  # dup2 of an unknown fd over 9  # fmt: skip
    assert [o for _, o in _objs(d, blob)] == ["/data/x.bin", "/data/x.bin", "/data/x.bin", "", "", ""]


def test_fds_received_forget_what_the_numbers_held_until_named() -> None:
    d = KernelDecoder(_CWD_META)
    d.note_fd(FdInfo(1, 5, 4, "file", "/old.bin"))
    marker = events.FDRECV.pack(events.EV_FDRECV, 2, 5, 5, 30, 4, 6, *[0] * (events.FDRECV_MAX - 2))
    assert events.fds_received(marker) == events.FdsReceived(5, 5, 30, (4, 6))
    assert _objs(d, _sys(0, 5, 1, 4) + marker + _sys(0, 5, 1, 4)) == [("read", "/old.bin"), ("read", "")]
    d.note_fd(FdInfo(30, 5, 4, "file", "/new.bin"))  # the live reader's record, right after the event
    assert _objs(d, _sys(0, 5, 1, 4)) == [("read", "/new.bin")]


@pytest.mark.kernel
def test_recursion_misses_are_read_from_a_real_programs_fdinfo() -> None:
    from bcc import BPF

    from gputrace.probes.ebpf.host import parse_recursion_misses, program_skips

    text = "prog_type:\t5\nrun_cnt:\t0\nrecursion_misses:\t17\nverified_insns:\t2\n"
    assert parse_recursion_misses(text) == 17 and parse_recursion_misses("prog_type:\t5\n") == 0
    b = BPF(text=b"TRACEPOINT_PROBE(sched, sched_waking) { return 0; }")
    try:
        fd = b.funcs[b"tracepoint__sched__sched_waking"].fd
        assert "recursion_misses" in Path(f"/proc/self/fdinfo/{fd}").read_text()  # what program_skips reads
        skips = program_skips(b)  # bcc attached it: a nested run may already have been skipped
        assert set(skips) == {"sched_waking"} and skips["sched_waking"] >= 0
    finally:
        b.cleanup()



# The eBPF source's syscall table, numbered by place (as gputrace.testing.synth.Builder.ebpf numbers it).
_EP_META = {"layout": events.LAYOUT, "threshold_ns": 0, "syscalls": {nr: s.name for nr, s in enumerate(SPECS)},
            "sysflags": {nr: s.flags for nr, s in enumerate(SPECS)}}  # fmt: skip
_NR = {s.name: nr for nr, s in enumerate(SPECS)}
_OK = events.EPOLL_DATA_OK


def _call(name: str, pid: int, ret: int, a0: int = 0, a1: int = 0, arg: int = 0) -> bytes:
    return events.SYS.pack(events.EV_SYS, _NR[name], pid, pid, 10, 20, ret, a0 & (1 << 64) - 1, a1, arg)


def _ctl(pid: int, epfd: int, op: int, fd: int, data: int | None) -> bytes:
    return _call("epoll_ctl", pid, 0, epfd | (_OK if data is not None else 0), data or 0, fd | op << 32)


def _ready(pid: int, epfd: int, data: int) -> bytes:
    return _call("epoll_wait", pid, 1, epfd | _OK, data)


def _named(d: KernelDecoder, blob: bytes) -> list[tuple[int, str]]:
    return [(r.fd, r.obj) for r in d.decode(blob) if r.name == "epoll_wait"]


def _loop(meta: dict[str, Any] = _EP_META) -> KernelDecoder:
    """A decoder whose process 5 has two peers' sockets (fds 4 and 7) and a file (fd 6) open."""
    d = KernelDecoder(meta)
    for fd, obj in ((4, "10.0.0.7:80"), (6, "/data/x.bin"), (7, "10.0.0.8:80")):
        d.note_fd(FdInfo(1, 5, fd, "socket", obj))
    return d


def test_an_epoll_data_word_names_the_fd_registered_with_it_as_registrations_change() -> None:
    """ADD, MOD and DEL in order; a word registered for two fds, or for none, names no fd; a closed fd's
    registration goes with it; a new epoll_create starts an empty instance."""
    d = _loop()
    blob = (_call("epoll_create1", 5, 3) + _ctl(5, 3, 1, 4, 6) + _ready(5, 3, 6)  # token 6: fd 4, not fd 6
            + _ctl(5, 3, 3, 4, 0xAB) + _ready(5, 3, 6) + _ready(5, 3, 0xAB)  # MOD: the old token is gone
            + _ctl(5, 3, 1, 7, 0xAB) + _ready(5, 3, 0xAB)  # two fds with one word: which fired is unknown
            + _ctl(5, 3, 2, 4, None) + _ready(5, 3, 0xAB)  # DEL (no event read): fd 7 alone has it again
            + _call("close", 5, 0, 7) + _ready(5, 3, 0xAB)  # closed: its registration went with its file
            + _ctl(5, 3, 1, 4, 9) + _call("epoll_create1", 5, 3) + _ready(5, 3, 9))  # a new instance at 3  # fmt: skip
    assert _named(d, blob) == [(4, "10.0.0.7:80"), (-1, ""), (4, "10.0.0.7:80"), (-1, ""), (7, "10.0.0.8:80"),
                               (-1, ""), (-1, "")]  # fmt: skip
    assert _named(d, _call("epoll_wait", 5, 0, 3)) == [(-1, "")]  # nothing ready


def test_epoll_registrations_follow_dup_fork_and_the_snapshot() -> None:
    """A dup of the epoll fd is the same instance; a forked child shares its parent's, and keeps naming the
    parent's registrations after the parent exited; registrations made before the capture come from fdinfo."""
    d = _loop()
    d.note_fd(FdInfo(1, 5, 3, "anon", EVENTPOLL))
    d.note_epoll(EpollEntry(1, 5, 3, 4, 0x19, 0x7F0000000004))
    blob = _ready(5, 3, 0x7F0000000004) + _call("dup", 5, 8, 3) + _ctl(5, 8, 1, 6, 1) + _ready(5, 3, 1)
    assert _named(d, blob) == [(4, "10.0.0.7:80"), (6, "/data/x.bin")]
    d.note_fork(ProcFork(2, 5, 5, 9, 9, False, "python"))  # a capture without fork markers
    gone = events.PROC.pack(events.EV_EXIT, 1, 5, 5, 30, 0, 0, b"python", b"")
    assert _named(d, gone + _ready(9, 8, 1) + _ready(9, 3, 0x7F0000000004)) == [(6, "/data/x.bin"),
                                                                                (4, "10.0.0.7:80")]  # fmt: skip
    d = _loop()  # the instance lives while an fd names it
    blob = (_call("epoll_create1", 5, 3) + _ctl(5, 3, 1, 4, 1) + _call("dup", 5, 8, 3) + _call("close", 5, 0, 3)
            + _ready(5, 8, 1) + _call("close", 5, 0, 8) + _ready(5, 8, 1))  # fmt: skip
    assert _named(d, blob) == [(4, "10.0.0.7:80"), (-1, "")]


def test_an_epoll_word_is_taken_for_an_fd_only_where_epoll_ctl_was_not_traced() -> None:
    """Without epoll_ctl in the capture nothing says what a word stands for: its low half is taken for the fd
    (asyncio's registration), as earlier versions did in the kernel (F_EPOLLFD: a0 is that fd)."""
    d = _loop({**_EP_META, "syscalls": {k: v for k, v in _EP_META["syscalls"].items() if v != "epoll_ctl"}})
    assert _named(d, _ready(5, 3, 0x7F0000000004) + _ready(5, 3, -3 & 0xFFFFFFFF)) == [(4, "10.0.0.7:80"), (-1, "")]
    d = _loop({**_EP_META, "sysflags": {**_EP_META["sysflags"], _NR["epoll_wait"]: events.F_FD | events.F_EPOLLFD}})
    assert _named(d, _call("epoll_wait", 5, 1, 4)) == [(4, "10.0.0.7:80")]


def test_a_wait_in_flight_at_stop_names_only_an_fd_it_watches() -> None:
    """A select caught waiting names the one fd it watches (noted at its entry in a0's upper half); a poll's
    first argument is a pointer, no fd."""
    d = _loop()
    sel = events.SYS.pack(events.EV_UNFINISHED, _NR["pselect6"], 5, 5, 10, 20, 1, 5 | 5 << 32, 0, 0)
    many = events.SYS.pack(events.EV_UNFINISHED, _NR["select"], 5, 5, 10, 20, 1, 8, 0, 0)
    poll = events.SYS.pack(events.EV_UNFINISHED, _NR["poll"], 5, 5, 10, 20, 1, 0x7FFF00000004, 0, 0)
    assert [r.obj for r in d.decode(sel + many + poll)] == ["10.0.0.7:80", "", ""]


_URING_META = {"layout": events.LAYOUT, "threshold_ns": 0,
               "syscalls": {3: "close", 257: "openat", 425: "io_uring_setup", 426: "io_uring_enter"},
               "sysflags": {3: events.F_FD | events.F_FDTABLE, 257: events.F_PATH | events.F_FDTABLE,
                            425: events.F_FDTABLE, 426: events.F_FD | events.F_URING}}  # fmt: skip


def _uring(pid: int, fd: int, res: int, start: int, end: int, opcode: int = 22, flags: int = 0) -> bytes:
    return events.URING.pack(events.EV_URING, opcode, pid, pid + 1, start, end, fd, res, 4, flags, 77, 0, 0)


def _timed(nr: int, pid: int, ret: int, a0: int, start: int, path: bytes = b"") -> bytes:
    head = events.SYS.pack(events.EV_PATH if path else events.EV_SYS, nr, pid, pid, start, start + 1, ret, a0, 0, 0)
    return head + (struct.pack("<II", len(path), 0) + path.ljust(256, b"\0") if path else b"")


def test_io_uring_request_names_its_file_as_of_its_submission() -> None:
    """The event comes at completion; the file is what its fd held when it was submitted, even where the program
    closed the fd (or reused its number) while the request was in flight."""
    d = KernelDecoder(_URING_META)
    blob = (_timed(425, 9, 4, 8, 10) + _timed(257, 9, 5, -100 & 0xFFFFFFFF, 20, b"/data/a.bin")
            + _timed(3, 9, 0, 5, 40) + _timed(257, 9, 5, -100 & 0xFFFFFFFF, 50, b"/data/b.bin")
            + _uring(9, 5, 4096, 30, 60) + _uring(9, 5, 100, 55, 70)
            + _uring(9, -1, 4096, 55, 70, flags=1)  # a registered file: no fd, no name
            + _uring(9, 5, -9, 55, 71)  # EBADF: the fd named nothing
            + _uring(9, 5, 3, 55, 72, opcode=200) + _uring(9, 5, 6, 55, 73, opcode=18))  # fmt: skip
    recs = list(d.decode(blob))
    setup = recs[0]
    assert (setup.name, setup.fd, setup.obj) == ("io_uring_setup", -1, "anon_inode:[io_uring]")
    a, b, fixed, badf, unknown, opened = (r for r in recs if type(r).__name__ == "IoUringRequest")
    assert (a.op, a.obj, a.nbytes, a.fd, a.ring_fd, a.tid, a.user_data) == ("READ", "/data/a.bin", 4096, 5, 4, 10, 77)
    assert (a.start_ns, a.end_ns, a.res, a.opcode) == (30, 60, 4096, 22)
    assert (b.obj, b.nbytes) == ("/data/b.bin", 100)
    assert (fixed.obj, fixed.fd, fixed.flags) == ("", -1, 1)
    assert (badf.obj, badf.nbytes) == ("", 0)
    assert (unknown.op, unknown.nbytes) == ("OP_200", 0)
    assert (opened.op, opened.res, opened.nbytes) == ("OPENAT", 6, 0)  # an fd, not bytes


def test_io_uring_request_of_an_unknown_process_names_nothing() -> None:
    (r,) = KernelDecoder(_URING_META).decode(_uring(9, 5, 4096, 30, 60))
    assert (r.obj, r.nbytes) == ("", 4096)
    with pytest.raises(ValueError):  # cut short
        list(KernelDecoder(_URING_META).decode(_uring(9, 5, 4096, 30, 60)[:40]))
    with pytest.raises(ValueError, match="layout"):  # a reader of layout 6 knows layout 6 and before
        KernelDecoder({**_URING_META, "layout": 7})
