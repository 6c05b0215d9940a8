"""Reading struct member offsets from BTF: the running kernel's, and small blobs built here for the cases
the kernel's may not show (anonymous members, bitfields, qualifiers, damaged data)."""

from __future__ import annotations

import struct
from pathlib import Path

import pytest

from gputrace.probes.ebpf import btf


class Blob:
    """A BTF blob assembled type by type, as the kernel lays it out."""

    def __init__(self) -> None:
        self.strings = b"\0"
        self.types = b""
        self.count = 0

    def name(self, text: str) -> int:
        if not text:
            return 0
        off = len(self.strings)
        self.strings += text.encode() + b"\0"
        return off

    def add(self, kind: int, name: str, vlen: int, size_or_type: int, extra: bytes = b"",
            kind_flag: int = 0) -> int:
        info = kind_flag << 31 | kind << 24 | vlen
        self.types += struct.pack("<III", self.name(name), info, size_or_type) + extra
        self.count += 1
        return self.count

    def int_(self, name: str, size: int) -> int:
        return self.add(1, name, 0, size, struct.pack("<I", size * 8))

    def struct_(self, name: str, size: int, members: list[tuple[str, int, int]], kind: int = 4,
                kind_flag: int = 0) -> int:
        extra = b"".join(struct.pack("<III", self.name(m), t, off) for m, t, off in members)
        return self.add(kind, name, len(members), size, extra, kind_flag)

    def bytes(self) -> bytes:
        header = struct.pack("<HBBIIIII", btf.MAGIC, 1, 0, 24, 0, len(self.types), len(self.types),
                             len(self.strings))
        return header + self.types + self.strings


def _sample() -> bytes:
    b = Blob()
    u32 = b.int_("unsigned int", 4)  # 1
    b.add(8, "u32_t", 0, u32)  # 2: typedef
    inner = b.struct_("", 8, [("deep", u32, 0), ("pid", u32, 32)])  # 3: anonymous struct
    const_inner = b.add(10, "", 0, inner)  # 4: const of it
    union = b.struct_("", 8, [("", const_inner, 0), ("raw", u32, 0)], kind=5)  # 5: anonymous union
    b.struct_("task", 40, [("state", 2, 0), ("flags", u32, 1 << 24 | 35), ("", union, 64),
                           ("tgid", u32, 8 * 24)], kind_flag=1)  # 6: bitfield `flags`
    b.add(7, "task", 0, 0)  # 7: a forward declaration of the same name
    b.add(13, "", 2, 0, struct.pack("<IIII", 0, u32, 0, u32))  # 8: a function prototype, skipped over
    b.struct_("other", 8, [("pid", u32, 0)])  # 9
    b.struct_("other", 8, [("pid", u32, 32)])  # 10: a second definition that disagrees
    return b.bytes()


def test_members_found_through_anonymous_members_and_qualifiers() -> None:
    t = btf.Btf(_sample())
    assert btf.struct_offset("task", "state", t) == 0
    assert btf.struct_offset("task", "tgid", t) == 24
    assert btf.struct_offset("task", "deep", t) == 8  # union at 8, const struct at 0 of it, deep at 0
    assert btf.struct_offset("task", "pid", t) == 12
    assert btf.struct_offset("task", "raw", t) == 8
    assert btf.struct_offset("task", "flags", t) is None  # a bitfield has no byte offset
    assert btf.struct_offset("task", "absent", t) is None
    assert btf.struct_offset("nosuch", "pid", t) is None
    assert btf.struct_offset("other", "pid", t) is None  # two definitions, two answers: unknown


@pytest.mark.parametrize("damage", ["short", "magic", "past_end", "kind", "cut_type"])
def test_damaged_blobs_are_refused(damage: str) -> None:
    data = bytearray(_sample())
    if damage == "short":
        data = data[:10]
    elif damage == "magic":
        data[0] ^= 0xFF
    elif damage == "past_end":
        struct.pack_into("<I", data, 20, 1 << 20)  # str_len
    elif damage == "kind":
        struct.pack_into("<I", data, 24 + 4, 31 << 24)  # the first type's info: kind 31
    else:
        type_len = struct.unpack_from("<I", data, 12)[0]
        struct.pack_into("<I", data, 12, type_len - 4)  # the type section now ends inside a type
    with pytest.raises(btf.BtfError):
        btf.Btf(bytes(data))


def test_unreadable_kernel_btf_reads_as_absent(tmp_path: Path) -> None:
    junk = tmp_path / "vmlinux"
    junk.write_bytes(b"\x00" * 100)
    assert btf.kernel_btf(junk) is None
    assert btf.kernel_btf(tmp_path / "missing") is None


def test_running_kernel_task_struct() -> None:
    """This kernel's BTF: pid and tgid are neighbours in task_struct (both pid_t, declared together)."""
    pid, tgid = btf.struct_offset("task_struct", "pid"), btf.struct_offset("task_struct", "tgid")
    assert pid is not None and tgid == pid + 4
    assert btf.struct_offset("pt_regs", "orig_ax") == 15 * 8  # x86_64's fixed syscall ABI layout


def _tracepoint_blob(file_get_fd: str = "int") -> bytes:
    """btf_trace_* typedefs as the kernel declares them: a pointer to a prototype whose first parameter is
    the probe's data. io_uring_file_get's fd is ``file_get_fd`` ("int", or "long" for a kernel that differs)."""
    b = Blob()
    void_ptr = b.add(2, "", 0, 0)  # 1: void *
    kiocb = b.struct_("io_kiocb", 8, [])  # 2
    kiocb_ptr = b.add(2, "", 0, kiocb)  # 3
    const_kiocb = b.add(10, "", 0, kiocb)  # 4: const struct io_kiocb
    const_kiocb_ptr = b.add(2, "", 0, const_kiocb)  # 5
    fd = b.int_(file_get_fd, 4 if file_get_fd == "int" else 8)  # 6
    for name, params in (("io_uring_submit_req", [void_ptr, const_kiocb_ptr]),
                         ("io_uring_file_get", [void_ptr, kiocb_ptr, fd])):
        proto = b.add(13, "", len(params), 0, b"".join(struct.pack("<II", 0, t) for t in params))
        b.add(8, f"btf_trace_{name}", 0, b.add(2, "", 0, proto))
    b.add(8, "btf_trace_not_a_pointer", 0, fd)
    return b.bytes()


def test_tracepoint_arguments_from_their_btf_trace_typedef() -> None:
    t = btf.Btf(_tracepoint_blob())
    assert t.tracepoint_args("io_uring_submit_req") == ["struct io_kiocb *"]  # const dropped
    assert t.tracepoint_args("io_uring_file_get") == ["struct io_kiocb *", "int"]
    assert t.tracepoint_args("not_a_pointer") is None
    assert t.tracepoint_args("io_uring_complete") is None


def test_io_uring_programs_are_raw_only_with_the_layout_they_read() -> None:
    """This kernel's BTF gives every prototype and member the raw io_uring programs read; a kernel whose
    prototypes differ, or with no BTF, keeps the classic tracepoints and says why."""
    from gputrace.probes.ebpf import hooks

    flags, why = hooks.uring_layout(btf.kernel_btf())
    assert why == "" and {f.split("=")[0] for f in flags} == {f"-D{m}" for m, *_ in hooks._URING_FIELDS} | {
        "-DGT_REQ_FLAGS_SIZE"}, flags
    assert "-DGT_UCQE_RES_OFF=8" in flags and "-DGT_UCQE_FLAGS_OFF=12" in flags  # the UAPI io_uring_cqe
    assert hooks.uring_hook("raw") == ("raw", "") and hooks.uring_hook("classic") == ("classic", "")
    assert hooks.uring_layout(None) == ((), f"no readable BTF at {btf.VMLINUX}")
    flags, why = hooks.uring_layout(btf.Btf(_tracepoint_blob("long")))
    assert flags == () and why.startswith("io_uring_file_get passes ['struct io_kiocb *', 'long'], not"), why
