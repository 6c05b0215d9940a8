"""Struct member offsets of the running kernel, read from its BTF (/sys/kernel/btf/vmlinux).

bcc compiles against whatever kernel headers are installed, which may belong to another kernel (see
setup.sh), so `offsetof` there can be wrong for this one. The few fields our raw-tracepoint programs read
(`task_struct.pid`) take their offsets from here instead and go in as cflags. Only the parts of BTF needed
to walk struct members are decoded; every length is checked, and anything unexpected reads as absent.
"""

from __future__ import annotations

import struct
from pathlib import Path

VMLINUX = Path("/sys/kernel/btf/vmlinux")
MAGIC = 0xEB9F
_HEADER = struct.Struct("<HBBIIIII")  # magic, version, flags, hdr_len, type_off, type_len, str_off, str_len
_TYPE = struct.Struct("<III")  # name_off, info, size/type
_MEMBER = struct.Struct("<III")  # name_off, type, offset
KIND_PTR, KIND_STRUCT, KIND_UNION, KIND_TYPEDEF, KIND_FUNC_PROTO = 2, 4, 5, 8, 13
# Bytes after the common part, per kind: fixed, and per vlen entry.
_EXTRA = {1: (4, 0), 3: (12, 0), 4: (0, 12), 5: (0, 12), 6: (0, 8), 13: (0, 8), 14: (4, 0), 15: (0, 12),
          17: (4, 0), 19: (0, 12)}
_KNOWN_KINDS = frozenset(range(1, 20))


class BtfError(ValueError):
    """The data is not BTF this module can read."""


class Btf:
    """The types of one BTF blob, indexed by id; struct members read on demand."""

    def __init__(self, data: bytes) -> None:
        if len(data) < _HEADER.size:
            raise BtfError("shorter than a BTF header")
        magic, _version, _flags, hdr_len, type_off, type_len, str_off, str_len = _HEADER.unpack_from(data)
        if magic != MAGIC:
            raise BtfError(f"bad magic {magic:#x}")
        types_at, strings_at = hdr_len + type_off, hdr_len + str_off
        if types_at + type_len > len(data) or strings_at + str_len > len(data):
            raise BtfError("sections run past the end")
        self._data = data
        self._strings = data[strings_at:strings_at + str_len]
        self._offsets = self._index(types_at, types_at + type_len)
        self._found: dict[tuple[int, str], list[int]] = {}

    def _index(self, pos: int, end: int) -> list[int]:
        """Where each type starts; ids count from 1 (id 0 is void)."""
        offsets = [0]
        while pos < end:
            if pos + _TYPE.size > end:
                raise BtfError("type section ends inside a type")
            _, info, _ = _TYPE.unpack_from(self._data, pos)
            kind, vlen = info >> 24 & 0x1F, info & 0xFFFF
            if kind not in _KNOWN_KINDS:
                raise BtfError(f"unknown type kind {kind}")
            fixed, each = _EXTRA.get(kind, (0, 0))
            offsets.append(pos)
            pos += _TYPE.size + fixed + each * vlen
        if pos != end:
            raise BtfError("type section ends inside a type")
        return offsets

    def name(self, off: int) -> str:
        end = self._strings.find(b"\0", off)
        return self._strings[off:end if end >= 0 else None].decode(errors="replace")

    def _type(self, tid: int) -> tuple[str, int, int, int, int]:
        """(name, kind, kind_flag, vlen, where the members start) of type `tid`."""
        pos = self._offsets[tid]
        name_off, info, _ = _TYPE.unpack_from(self._data, pos)
        return self.name(name_off), info >> 24 & 0x1F, info >> 31, info & 0xFFFF, pos + _TYPE.size

    def find(self, kind: int, name: str) -> list[int]:
        """Ids of the types of `kind` called `name` (a name can repeat, e.g. a forward declaration). The name's
        places in the string section are found first (offset 0 is the empty name), so the scan compares numbers,
        not decoded names; each (kind, name) is scanned for once."""
        if (kind, name) not in self._found:
            self._found[(kind, name)] = self._scan(kind, name.encode())
        return self._found[(kind, name)]

    def _scan(self, kind: int, key: bytes) -> list[int]:
        needle = b"\0" + key + b"\0"
        offs, at = set(), self._strings.find(needle) if key and b"\0" not in key else -1
        while at >= 0:
            offs.add(at + 1)
            at = self._strings.find(needle, at + 1)
        if not offs:
            return []
        unpack, data = _TYPE.unpack_from, self._data
        return [tid for tid in range(1, len(self._offsets))
                if (t := unpack(data, self._offsets[tid]))[0] in offs and t[1] >> 24 & 0x1F == kind]  # fmt: skip

    def member_offset(self, tid: int, member: str) -> int | None:
        """Byte offset of `member` in struct/union `tid`, looking into anonymous struct/union members.
        None when absent or a bitfield."""
        found = self.member(tid, member)
        return found[0] if found else None

    def member(self, tid: int, member: str) -> tuple[int, int] | None:
        """(byte offset, type id) of `member` in struct/union `tid`, as member_offset() finds it."""
        _, kind, kind_flag, vlen, pos = self._type(tid)
        if kind not in (KIND_STRUCT, KIND_UNION):
            return None
        for i in range(vlen):
            name_off, mtype, bits = _MEMBER.unpack_from(self._data, pos + i * _MEMBER.size)
            if kind_flag:
                if bits >> 24:  # a bitfield has no byte offset
                    continue
                bits &= 0xFFFFFF
            mname = self.name(name_off)
            if mname == member:
                return None if bits % 8 else (bits // 8, mtype)
            if not mname and 0 < mtype < len(self._offsets):
                inner = self.member(self._resolve(mtype), member)
                if inner is not None:
                    return bits // 8 + inner[0], inner[1]
        return None

    def size_of(self, tid: int) -> int | None:
        """Bytes of type `tid` (typedefs and qualifiers skipped), for the kinds whose size BTF states: int,
        pointer (8: the 64-bit kernels the raw programs run on), struct, union, enum, array."""
        tid = self._resolve(tid)
        if not 0 < tid < len(self._offsets):
            return None
        _, kind, _, _, pos = self._type(tid)
        size = self._ref(tid)
        if kind in (1, KIND_STRUCT, KIND_UNION, 6, 19):
            return size
        if kind == 2:
            return 8
        if kind == 3:
            elem, _index, count = struct.unpack_from("<III", self._data, pos)
            inner = self.size_of(elem) if 0 < elem < len(self._offsets) else None
            return None if inner is None else inner * count
        return None

    def _ref(self, tid: int) -> int:
        """The third word of type `tid`: the type it refers to (pointer, typedef, qualifier) or its size."""
        ref: int = _TYPE.unpack_from(self._data, self._offsets[tid])[2]
        return ref

    def _valid(self, tid: int) -> bool:
        return 0 < tid < len(self._offsets)

    def type_text(self, tid: int) -> str:
        """A C spelling of type `tid` good enough to compare prototypes: 'struct io_kiocb *', 'int', 'void *'
        (typedefs by name, qualifiers dropped)."""
        if tid == 0:
            return "void"
        if not self._valid(tid):
            return "?"
        name, kind, _, _, _ = self._type(tid)
        if kind == KIND_PTR:
            return self.type_text(self._ref(tid)) + " *"
        if kind in (9, 10, 11, 18):  # volatile, const, restrict, type tag
            return self.type_text(self._ref(tid))
        return {KIND_STRUCT: "struct ", KIND_UNION: "union ", 6: "enum "}.get(kind, "") + name

    def tracepoint_args(self, name: str) -> list[str] | None:
        """The argument types a raw tracepoint program gets in ctx->args for tracepoint `name`: its
        ``btf_trace_<name>`` typedef is a pointer to a function whose first parameter (the probe's data) is
        not passed on. None when BTF does not have it in that shape."""
        for tid in self.find(KIND_TYPEDEF, f"btf_trace_{name}"):
            ptr = self._ref(tid)
            if not self._valid(ptr) or self._type(ptr)[1] != KIND_PTR or not self._valid(proto := self._ref(ptr)):
                continue
            _, kind, _, vlen, pos = self._type(proto)
            if kind != KIND_FUNC_PROTO or vlen < 1:
                continue
            params = [struct.unpack_from("<II", self._data, pos + 8 * i)[1] for i in range(vlen)]
            return [self.type_text(t) for t in params[1:]]
        return None

    def _resolve(self, tid: int) -> int:
        """Skip typedefs and qualifiers (const, volatile, restrict, type tags)."""
        for _ in range(32):
            _, kind, _, _, _ = self._type(tid)
            if kind not in (8, 9, 10, 11, 18):
                return tid
            tid = self._ref(tid)
            if not self._valid(tid):
                return 0
        return 0


def kernel_btf(path: Path = VMLINUX) -> Btf | None:
    """The running kernel's BTF, parsed (about a second, 15 MB while held): callers keep what they need
    from it (struct_offset), not the whole."""
    try:
        return Btf(path.read_bytes())
    except (OSError, BtfError):
        return None


def struct_member(struct_name: str, member: str, btf: Btf | None = None) -> tuple[int, int] | None:
    """(byte offset, size) of `struct_name.member` in the running kernel, or None when unknown (as
    struct_offset), or when its size is not one BTF states."""
    btf = btf if btf is not None else kernel_btf()
    if btf is None:
        return None
    found: set[tuple[int, int | None]] = set()
    for tid in btf.find(KIND_STRUCT, struct_name):
        m = btf.member(tid, member)
        if m is not None:
            found.add((m[0], btf.size_of(m[1])))
    if len(found) != 1:
        return None
    off, size = found.pop()
    return None if size is None else (off, size)


def struct_offset(struct_name: str, member: str, btf: Btf | None = None) -> int | None:
    """Byte offset of `struct_name.member` in the running kernel, or None when unknown (no BTF, no such
    struct, several definitions that disagree)."""
    btf = btf if btf is not None else kernel_btf()
    if btf is None:
        return None
    found = {btf.member_offset(tid, member) for tid in btf.find(KIND_STRUCT, struct_name)}
    found.discard(None)
    return found.pop() if len(found) == 1 else None
