"""Where a running process has a few functions: symbol values from its ELF files, plus where they are mapped.

The ptrace attach (gputrace.daemon.attach.pyattach) calls ``Py_AddPendingCall``, ``PyRun_SimpleString`` and libc's
``mmap`` in the target by address. Looked up here, before the target is stopped, from its files as it maps
them (through /proc/PID/root: in a container they are not at the same path as on the host).

Every byte here is the target's to choose: its maps, and the files they name (through /proc/PID/root, which
a container controls). So a file is opened without blocking, only if it is the very one mapped (the inode
the maps line gives), read with bounds on every size, and its values are used only as numbers.
"""

from __future__ import annotations

import mmap
import os
import re
import stat
import struct
from dataclasses import dataclass
from pathlib import Path

from gputrace.errors import UserError

MAX_FILE_BYTES = 1 << 30  # an interpreter or libc is tens of MB at most
MAX_TABLE_BYTES = 64 << 20
_SHT_SYMTAB, _SHT_DYNSYM, _PT_LOAD, _STT_FUNC = 2, 11, 1, 2
_MACHINES = {"x86_64": 62, "aarch64": 183}
_MAPS_RE = re.compile(rb"^([0-9a-f]+)-([0-9a-f]+) (\S{4}) ([0-9a-f]+) ([0-9a-f]+):([0-9a-f]+) (\d+) +(.*)$")
_LIBC_RE = re.compile(r"/(libc\.so\.6|libc-[0-9.]+\.so|ld-musl-[a-z0-9_]+\.so\.1)$")
_LIBPYTHON_RE = re.compile(r"/libpython3\.\d+[a-z]*\.so(\.[0-9.]+)?$")


@dataclass(frozen=True)
class Mapping:
    start: int
    offset: int
    inode: int
    path: str


def maps(pid: int) -> list[Mapping]:
    """The file mappings of ``pid`` (raises OSError when it is gone)."""
    out: list[Mapping] = []
    with open(f"/proc/{int(pid)}/maps", "rb") as f:
        for line in f.read(64 << 20).splitlines():
            m = _MAPS_RE.match(line)
            if m is None or not m.group(8).startswith(b"/"):
                continue
            path = m.group(8).decode("utf-8", "surrogateescape")
            out.append(Mapping(int(m.group(1), 16), int(m.group(4), 16), int(m.group(7)), path))
    return out


def symbols(fd: int, names: set[str]) -> dict[str, int]:
    """Values of the defined functions ``names`` in the ELF file open as ``fd`` (.dynsym, then .symtab)."""
    size = os.fstat(fd).st_size
    if not 64 <= size <= MAX_FILE_BYTES:
        return {}
    with mmap.mmap(fd, size, prot=mmap.PROT_READ) as data:
        return _symbols(data, size, names)


def _symbols(data: mmap.mmap, size: int, names: set[str]) -> dict[str, int]:
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:  # 64-bit little-endian, as we are
        return {}
    shoff, = struct.unpack_from("<Q", data, 0x28)
    shentsize, shnum = struct.unpack_from("<HH", data, 0x3A)
    if shentsize != 64 or shnum == 0 or shoff + shnum * 64 > size:
        return {}
    sections = [struct.unpack_from("<IIQQQQIIQQ", data, shoff + i * 64) for i in range(shnum)]
    found: dict[str, int] = {}
    wanted = {n.encode() for n in names}
    for kind in (_SHT_DYNSYM, _SHT_SYMTAB):
        for _name, typ, _fl, _addr, off, sz, link, _info, _al, entsize in sections:
            if typ != kind or entsize != 24 or sz > MAX_TABLE_BYTES or off + sz > size or link >= shnum:
                continue
            stroff, strsz = sections[link][4], sections[link][5]
            if strsz > MAX_TABLE_BYTES or stroff + strsz > size:
                continue
            for i in range(sz // 24):
                st_name, st_info, _other, shndx, value, _size = struct.unpack_from("<IBBHQQ", data, off + i * 24)
                # a GNU indirect function's value is its resolver, not the function: never one to call
                if shndx == 0 or value == 0 or st_info & 0xF != _STT_FUNC or st_name >= strsz:
                    continue
                start = stroff + st_name
                end = data.find(b"\0", start, min(stroff + strsz, start + 256))
                name = data[start:end] if end > 0 else b""
                if name in wanted and name.decode() not in found:
                    found[name.decode()] = value
        if len(found) == len(names):
            break
    return found


def first_load_vaddr(fd: int) -> int | None:
    """The page-aligned virtual address of an ELF file's first loadable segment (the one mapped at offset 0),
    and that the file is for this machine; None when it is not an ELF file we can call into."""
    head = os.pread(fd, 64, 0)
    if len(head) < 64 or head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
        return None
    machine, = struct.unpack_from("<H", head, 0x12)
    if machine != _MACHINES.get(os.uname().machine, -1):
        return None
    phoff, = struct.unpack_from("<Q", head, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", head, 0x36)
    if phentsize != 56 or not 0 < phnum <= 256:
        return None
    table = os.pread(fd, 56 * phnum, phoff)
    loads = [struct.unpack_from("<IIQQ", table, i * 56) for i in range(len(table) // 56)]
    vaddrs = [vaddr for typ, _flags, _off, vaddr in loads if typ == _PT_LOAD]
    return min(vaddrs) & ~(mmap.PAGESIZE - 1) if vaddrs else None


@dataclass(frozen=True)
class Resolved:
    """Absolute addresses in the target, and which file each came from (for messages)."""

    addresses: dict[str, int]
    files: dict[str, str]


def resolve(pid: int, exe: str, python_names: tuple[str, ...], libc_names: tuple[str, ...]) -> Resolved:
    """The addresses of ``python_names`` (in the interpreter's executable, or the libpython it maps) and of
    ``libc_names`` (in its C library) in process ``pid``. UserError naming the first symbol missing."""
    try:
        mapped = maps(pid)
    except OSError:
        raise UserError(f"pid {pid} has exited") from None
    addresses: dict[str, int] = {}
    files: dict[str, str] = {}
    # The interpreter: its executable first (Debian's and most builds link libpython in), then a libpython.
    exe_maps = [m for m in mapped if m.path == exe]
    lib_maps = [m for m in mapped if _LIBPYTHON_RE.search(m.path)]
    for candidates in (exe_maps, lib_maps):
        left = [n for n in python_names if n not in addresses]
        if not left or not candidates:
            continue
        got = _lookup(pid, candidates, set(left), is_exe=candidates is exe_maps)
        for name, addr in got.items():
            addresses[name], files[name] = addr, candidates[0].path
    for name in python_names:
        if name not in addresses:
            where = " or ".join(sorted({m.path for m in exe_maps + lib_maps[:1]})) or exe
            raise UserError(f"pid {pid}: symbol {name} not found in {where} (a static or stripped interpreter?); "
                            "start it armed instead: see `gputrace env`")
    libc = [m for m in mapped if _LIBC_RE.search(m.path)]
    got = _lookup(pid, libc, set(libc_names), is_exe=False) if libc else {}
    for name in libc_names:
        if name not in got:
            raise UserError(f"pid {pid}: symbol {name} not found in its C library "
                            f"({libc[0].path if libc else 'none mapped'}); start it armed instead")
        addresses[name], files[name] = got[name], libc[0].path
    return Resolved(addresses, files)


def _lookup(pid: int, mapped: list[Mapping], names: set[str], *, is_exe: bool) -> dict[str, int]:
    """Absolute addresses of ``names`` in one mapped file (all of ``mapped`` name the same path)."""
    first = next((m for m in mapped if m.offset == 0), None)
    if first is None:
        return {}
    fd = _open_mapped(pid, first, is_exe=is_exe)
    try:
        vaddr = first_load_vaddr(fd)
        if vaddr is None:
            raise UserError(f"pid {pid}: {first.path} is not an ELF file for this machine ({os.uname().machine})")
        base = first.start - vaddr
        return {name: base + value for name, value in symbols(fd, names).items()}
    finally:
        os.close(fd)


def _open_mapped(pid: int, m: Mapping, *, is_exe: bool) -> int:
    """The file mapped at ``m``, opened read-only: /proc/PID/exe for the executable (the kernel's own
    reference to it), else its path inside the process's root, accepted only if it is the inode mapped (a
    link or another file put at that path in a container would otherwise make us read a file of ours).

    The maps name a file of another mount namespace by its path from that namespace's mount, which need not
    be the path the process sees (a container's root mounted at /tmp/x/root shows as /tmp/x/root/usr/lib/...):
    so shorter and shorter tails of the path are tried, inside its root, until one is the very file."""
    flags = os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY
    if is_exe:
        try:
            return os.open(f"/proc/{int(pid)}/exe", flags)
        except OSError as e:
            raise UserError(f"pid {pid}: cannot read {m.path}: {e.strerror}") from None
    parts = [p for p in m.path.split("/") if p][:64]
    for i in range(len(parts)):
        try:
            fd = os.open(Path(f"/proc/{int(pid)}/root", *parts[i:]), flags)
        except OSError:
            continue
        st = os.fstat(fd)
        if st.st_ino == m.inode and stat.S_ISREG(st.st_mode):
            return fd
        os.close(fd)
    raise UserError(f"pid {pid}: {m.path} is not found as the file it has mapped; cannot look up its symbols")


