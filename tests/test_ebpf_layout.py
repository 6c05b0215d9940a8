"""probes/ebpf/events.py mirrors probes/bpf/gputrace.h: the compiler's layout and the struct formats agree."""

from __future__ import annotations

import ctypes
import warnings
from typing import Any

import pytest

from gputrace.probes.ebpf import events, uring
from gputrace.probes.ebpf import source as ebpf

pytestmark = pytest.mark.kernel  # root and the host's kernel (see tests/conftest.py)


@pytest.fixture(scope="module")
def bpf() -> Any:
    bcc = ebpf.check_host()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        b = bcc.BPF(src_file=str(ebpf.BPF_DIR / "gputrace.bpf.c"), cflags=[f"-I{ebpf.BPF_DIR}"])
    yield b
    b.cleanup()


@pytest.mark.parametrize(
    ("table", "fmt", "first_fields"),
    [
        ("layout_sys", events.SYS, ["type", "nr", "pid", "tid", "start_ns", "end_ns", "ret", "a0", "a1", "arg"]),
        ("layout_block", events.BLOCK, ["type", "dev", "pid", "tid", "sector", "issue_ns", "complete_ns",
                                        "nbytes", "error", "rwbs", "comm"]),
        ("layout_offcpu", events.OFFCPU, ["type", "state", "pid", "tid", "start_ns", "end_ns", "wake_ns",
                                          "waker_pid", "waker_tid", "waker_comm"]),
        ("layout_offcpu2", events.OFFCPU2, ["type", "state", "pid", "tid", "start_ns", "end_ns", "wake_ns",
                                            "waker_pid", "waker_tid", "waker_comm", "held_pid", "held_tid",
                                            "held_comm", "pad"]),
        ("layout_proc", events.PROC, ["type", "flags", "pid", "tid", "ts", "child_pid", "child_tid", "comm",
                                      "filename"]),
        ("layout_fault", events.FAULT, ["type", "dev", "pid", "tid", "fault_ns", "start_ns", "end_ns", "ino",
                                        "index"]),
        ("layout_mapfile", events.MAPFILE, ["type", "dev", "pid", "tid", "ts", "ino"]),
        ("layout_uring", events.URING, ["type", "opcode", "pid", "tid", "start_ns", "end_ns", "fd", "res",
                                        "ring_fd", "flags", "user_data", "cflags", "pad"]),
        ("layout_dirty", events.DIRTY, ["type", "pad", "pid", "tid", "ts", "pause_ms", "wb_dirty", "wb_setpoint",
                                        "dirty", "limit", "task_ratelimit", "bdi"]),
    ],
)  # fmt: skip
def test_struct_layout_matches(bpf: Any, table: str, fmt: Any, first_fields: list[str]) -> None:
    leaf = bpf[table.encode()].Leaf
    assert ctypes.sizeof(leaf) == fmt.size
    names = [f[0] for f in leaf._fields_]
    assert names == first_fields
    offsets = [getattr(leaf, n).offset for n in names]
    assert offsets == _format_offsets(fmt.format)


def test_path_event_layout(bpf: Any) -> None:
    leaf = bpf[b"layout_path"].Leaf
    assert ctypes.sizeof(leaf) == events.PATH.size
    assert leaf.len.offset == events.SYS.size and leaf.data.offset == events.SYS.size + 8


def test_every_event_type_has_a_size() -> None:
    assert set(events.SIZES) == {1, 2, 3, 4, 5, 6, 7, 8, events.EV_UNFINISHED, events.EV_FDRECV, events.EV_OFFCPU2,
                                 events.EV_URING, events.EV_DIRTY}
    assert events.SIZES[events.EV_SYS] == 64 and events.SIZES[events.EV_PATH] == 328
    # the live reader picks fault and fd-receive events out by size alone, in both rings
    assert [t for t, n in events.SIZES.items() if n == events.FAULT.size] == [events.EV_FAULT]
    assert [t for t, n in events.SIZES.items() if n == events.FDRECV.size] == [events.EV_FDRECV]
    assert events.FDRECV.size not in (events.PROC.size, events.MAPFILE.size)
    # an io_uring request's event is told apart by its type: its size must not pass for either of those
    assert events.URING.size not in (events.FAULT.size, events.FDRECV.size, events.PROC.size, events.MAPFILE.size)
    assert events.DIRTY.size not in (events.FAULT.size, events.FDRECV.size, events.PROC.size, events.MAPFILE.size)


def test_fdrecv_event_layout(bpf: Any) -> None:
    leaf = bpf[b"layout_fdrecv"].Leaf
    assert ctypes.sizeof(leaf) == events.FDRECV.size == 88
    names = [f[0] for f in leaf._fields_]
    assert names == ["type", "count", "pid", "tid", "ts", "fds"]
    assert [getattr(leaf, x).offset for x in names] == [0, 4, 8, 12, 16, 24]


def _format_offsets(fmt: str) -> list[int]:
    """Offsets of each field of a little-endian, unpadded struct format like "<IIQ16s"."""
    import re
    import struct

    out, off = [], 0
    for count, code in re.findall(r"(\d*)([a-zA-Z])", fmt.lstrip("<")):
        n = int(count or 1)
        if code == "s":
            out.append(off)
            off += n
        else:
            for _ in range(n):
                out.append(off)
                off += struct.calcsize("<" + code)
    return out


def test_header_constants_match() -> None:
    """The layout number, the event types and the per-syscall flags the decoder reads from sysflags."""
    import re

    text = (ebpf.BPF_DIR / "gputrace.h").read_text()
    defs = {k: int(v, 0) for k, v in re.findall(r"^#define (GT_\w+) (0x[0-9a-fA-F]+|\d+)", text, re.M)}
    assert defs["GT_LAYOUT"] == events.LAYOUT and events.LAYOUT in events.KNOWN_LAYOUTS
    assert (defs["GT_EV_FAULT"], defs["GT_EV_MAPFILE"], defs["GT_EV_FDRECV"], defs["GT_EV_OFFCPU2"],
            defs["GT_EV_URING"]) == (events.EV_FAULT, events.EV_MAPFILE, events.EV_FDRECV, events.EV_OFFCPU2,
                                     events.EV_URING)  # fmt: skip
    assert defs["GT_FDRECV_MAX"] == events.FDRECV_MAX
    ok = re.search(r"^#define GT_EPOLL_DATA_OK \(1ULL << (\d+)\)", text, re.M)
    assert ok and 1 << int(ok.group(1)) == events.EPOLL_DATA_OK
    for name in ("FD", "XFER", "PATH", "SOCKADDR", "SOCKADDR_PLEN", "FDTABLE", "PIPE", "TIMESPEC", "PATH0",
                 "DUPFD", "MSGHDR", "POLLFD", "EPOLLFD", "EPOLLDATA", "EPOLLCTL", "SELECTFD", "URING"):  # fmt: skip
        assert defs[f"GT_F_{name}"] == getattr(events, f"F_{name}"), name
    # drop reasons: the kernel's indexes are the Python tuple's
    drops = {k.removeprefix("GT_DROP_").lower(): v for k, v in defs.items() if k.startswith("GT_DROP_")}
    assert drops.pop("max") == len(events.DROP_REASONS)
    assert [events.DROP_REASONS[i] for i in drops.values()] == [
        {"inflight": "syscall_inflight", "agg": "syscall_agg"}.get(k, k) for k in drops]
    # the io_uring event's flags and the short requests' pseudo syscall numbers
    assert (defs["GT_URING_FIXED"], defs["GT_URING_ASYNC"], defs["GT_URING_SQPOLL"], defs["GT_URING_MORE"]) == (
        uring.FIXED, uring.ASYNC, uring.SQPOLL, uring.MORE)  # fmt: skip
    source = (ebpf.BPF_DIR / "gputrace.bpf.c").read_text()
    assert f"#define GT_URING_AGG_NR {hex(uring.AGG_NR)}" in source
