"""Function names for addresses in a traced process, from the symbol tables of the ELF files it maps.

An address is found in the process's executable mappings (/proc/PID/maps), turned into an offset in the
mapped file and then into the file's own virtual address through its loadable segments, and looked up among
the file's function symbols (.symtab where the file keeps one, and .dynsym). Files are opened through
/proc/PID/map_files (the very file mapped, even when deleted or in another mount namespace) and their
symbols are read once per file for every process that maps it. Code compiled at run time (a JIT, Python
3.12+ run with ``-X perf``) is named from the process's /tmp/perf-PID.map. Everything here comes from files
a traced process chose: sizes are capped, and a file that does not parse simply has no names.

C++ names are demangled with the C++ runtime's own __cxa_demangle where it is installed.
"""

from __future__ import annotations

import bisect
import ctypes
import ctypes.util
import functools
import os
import stat
import struct
import time
from array import array
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any

from gputrace.probes import procfs
from gputrace.probes.procfs import Mapping

_EHDR = struct.Struct("<16sHHIQQQIHHHHHH")
_PHDR = struct.Struct("<IIQQQQQQ")
_SHDR = struct.Struct("<IIQQQQIIQQ")
_SYM = struct.Struct("<IBBHQQ")
PT_LOAD, SHT_SYMTAB, SHT_DYNSYM = 1, 2, 11
STT_FUNC, STT_GNU_IFUNC = 2, 10
MAX_HEADERS = 1 << 16  # program or section headers per file
MAX_TABLE_BYTES = 256 << 20  # one symbol or string table
MAX_NAME = 4096
FILES_KEPT = 512  # files whose symbols stay read, most recently used first
NAMED_KEPT = 65536  # addresses of one process kept named; past it the cache starts over
REFRESH_S = 1.0  # at most this often per process, re-read its mappings for an address none holds


class ElfSymbols:
    """The function symbols of one ELF file (64-bit, little-endian): sorted starts, sizes and names."""

    def __init__(self, fd: int) -> None:
        head = os.pread(fd, _EHDR.size, 0)
        if len(head) < _EHDR.size or head[:4] != b"\x7fELF" or head[4] != 2 or head[5] != 1:
            raise ValueError("not a 64-bit little-endian ELF file")
        (_, _, _, _, _, phoff, shoff, _, _, phentsize, phnum, shentsize, shnum, _) = _EHDR.unpack(head)
        self.segments: list[tuple[int, int, int]] = [(off, vaddr, size) for ptype, _, off, vaddr, _, size, _, _ in
                         _table(fd, phoff, phentsize, phnum, _PHDR) if ptype == PT_LOAD]  # fmt: skip
        sections = _table(fd, shoff, shentsize, shnum, _SHDR)
        found: dict[int, tuple[int, int, int]] = {}  # start -> (size, string table, name offset), .symtab's first
        self._strtabs: list[bytes] = []
        for kind in (SHT_SYMTAB, SHT_DYNSYM):
            for _, stype, _, _, off, size, link, _, _, entsize in sections:
                if stype == kind and entsize == _SYM.size and link < len(sections):
                    self._strtabs.append(_read(fd, sections[link][4], sections[link][5]))
                    _add(_read(fd, off, size - size % _SYM.size), len(self._strtabs) - 1, found)
        self.starts = array("Q", sorted(found))
        self.ends = array("Q", (s + found[s][0] for s in self.starts))
        self._names = [found[s][1:] for s in self.starts]  # names are cut from their table when asked for

    def vaddr(self, file_offset: int) -> int | None:
        """The file's virtual address for an offset in it, through the segment that loads it."""
        for off, vaddr, size in self.segments:
            if off <= file_offset < off + size:
                return file_offset - off + vaddr
        return None

    def name(self, vaddr: int) -> bytes | None:
        """The function holding ``vaddr``: within its size, or the nearest below when sizes are not given."""
        i = bisect.bisect_right(self.starts, vaddr) - 1
        if i < 0:
            return None
        if self.ends[i] > self.starts[i] and vaddr >= self.ends[i]:
            return None
        table, name_at = self._names[i]
        strtab = self._strtabs[table]
        end = strtab.find(b"\0", name_at, name_at + MAX_NAME)
        return strtab[name_at:end] if end > name_at else None


def _add(table: bytes, strtab: int, found: dict[int, tuple[int, int, int]]) -> None:
    """The function symbols of one symbol table: naming them waits until one is looked up (a large library
    has hundreds of thousands, a stack names a few)."""
    for name_at, info, _, shndx, value, size in _SYM.iter_unpack(table):
        if info & 0xF in (STT_FUNC, STT_GNU_IFUNC) and shndx and value and name_at and value not in found:
            found[value] = (size, strtab, name_at)


def _read(fd: int, offset: int, size: int) -> bytes:
    if size <= 0 or size > MAX_TABLE_BYTES or not 0 <= offset < 1 << 62:
        return b""
    return os.pread(fd, size, offset)


def _table(fd: int, offset: int, entsize: int, count: int, shape: struct.Struct) -> list[tuple[Any, ...]]:
    if not offset or entsize != shape.size or count > MAX_HEADERS:
        return []
    raw = _read(fd, offset, entsize * count)
    return [shape.unpack_from(raw, i * entsize) for i in range(len(raw) // entsize)]


@functools.cache
def _cxa_demangle() -> tuple[Any, Any] | None:
    try:
        cxx = ctypes.CDLL(ctypes.util.find_library("stdc++") or "libstdc++.so.6")
        libc = ctypes.CDLL(None)
    except OSError:
        return None
    fn = cxx.__cxa_demangle
    fn.restype = ctypes.c_void_p
    fn.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.POINTER(ctypes.c_int)]
    libc.free.argtypes = [ctypes.c_void_p]
    return fn, libc.free


def demangle(name: bytes) -> bytes:
    """A C++ symbol's readable name (``at::native::add_kernel(...)``); any other name as it is."""
    tools = _cxa_demangle() if name.startswith(b"_Z") else None
    if tools is None:
        return name
    fn, free = tools
    status = ctypes.c_int(-1)
    out = fn(name, None, None, ctypes.byref(status))
    if not out:
        return name
    try:
        return ctypes.string_at(out) if status.value == 0 else name
    finally:
        free(out)


def executable_mappings(pid: int) -> list[Mapping]:
    """The file-backed executable mappings of ``pid``, by start address."""
    return [m for m in procfs.mappings(pid) if "x" in m.perms]


class PerfMap:
    """A JIT's or Python's (3.12+, ``-X perf``) /tmp/perf-PID.map: ``START SIZE name`` lines, in hex."""

    def __init__(self, text: str) -> None:
        rows = []
        for line in text.splitlines():
            parts = line.split(maxsplit=2)
            if len(parts) == 3:
                try:
                    start, size = int(parts[0], 16), int(parts[1], 16)
                except ValueError:
                    continue
                rows.append((start, start + size, parts[2][:MAX_NAME].encode()))
        rows.sort()
        self.starts = [r[0] for r in rows]
        self._rows = rows

    def name(self, addr: int) -> bytes | None:
        i = bisect.bisect_right(self.starts, addr) - 1
        return self._rows[i][2] if i >= 0 and addr < self._rows[i][1] else None


MAX_PERF_MAP = 64 << 20


def perf_map(pid: int, known: tuple[str, PerfMap, tuple[int, int]] | None = None,
             ) -> tuple[str, PerfMap, tuple[int, int]] | None:
    """The process's perf map (its name, its entries, its size and change time), read in its own mount
    namespace under the pid it knows itself by; ``known`` is kept while the file has not changed."""
    own = procfs.ns_pid(pid) or pid
    path = procfs.PROC / str(pid) / "root" / "tmp" / f"perf-{own}.map"
    try:
        st = path.stat()
    except OSError:
        return None
    if not stat.S_ISREG(st.st_mode):
        return None
    if known is not None and known[2] == (st.st_size, st.st_mtime_ns):
        return known
    return f"/tmp/perf-{own}.map", PerfMap(procfs.read_text(path, MAX_PERF_MAP)), (st.st_size, st.st_mtime_ns)


@dataclass
class _Process:
    maps: list[Mapping]
    starts: list[int]
    read_at: float
    perf: tuple[str, PerfMap, tuple[int, int]] | None = None
    perf_at: float = -REFRESH_S
    # Addresses already named from an ELF file. A Python stack is its interpreter's few frames in many
    # orders: nearly every stack is new, nearly none of its addresses is, and naming one costs a lookup
    # in the file's symbols and a demangle.
    named: dict[int, tuple[bytes | None, bytes | None]] = field(default_factory=dict)


class Symbolizer:
    """(function, module) names for the addresses of traced processes' stacks."""

    def __init__(self) -> None:
        self._procs: dict[int, _Process] = {}
        self._files: OrderedDict[tuple[str, int], ElfSymbols | None] = OrderedDict()

    def resolve(self, pid: int, addrs: list[int]) -> list[tuple[bytes | None, bytes | None]]:
        """(name, module path) for each address; None where it is not known."""
        proc = self._procs.get(pid) or self._read_maps(pid)
        out = []
        for addr in addrs:
            known = proc.named.get(addr)
            if known is not None:
                out.append(known)
                continue
            m = self._mapping(proc, addr)
            if m is None and time.monotonic() - proc.read_at >= REFRESH_S:  # a library loaded since (dlopen)
                proc = self._read_maps(pid)
                m = self._mapping(proc, addr)
            if m is None:  # anonymous memory: JIT code, named in the process's perf map if it keeps one
                out.append(self._jitted(pid, proc, addr))
                continue
            elf = self._elf(pid, m)
            if elf is None:  # not an ELF file: a JIT's double-mapped memfd or /dev/zero
                jitted = self._jitted(pid, proc, addr)
                out.append(jitted if jitted[0] is not None else (None, os.fsencode(m.path)))
                continue
            vaddr = elf.vaddr(addr - m.start + m.offset)
            name = elf.name(vaddr) if vaddr is not None else None
            out.append((demangle(name) if name else None, os.fsencode(m.path)))
            if len(proc.named) >= NAMED_KEPT:
                proc.named.clear()
            proc.named[addr] = out[-1]
        return out

    @staticmethod
    def _jitted(pid: int, proc: _Process, addr: int) -> tuple[bytes | None, bytes | None]:
        name = proc.perf[1].name(addr) if proc.perf is not None else None
        if name is None and time.monotonic() - proc.perf_at >= REFRESH_S:  # written as code is compiled
            proc.perf, proc.perf_at = perf_map(pid, proc.perf), time.monotonic()
            name = proc.perf[1].name(addr) if proc.perf is not None else None
        return (name, os.fsencode(proc.perf[0])) if name is not None and proc.perf is not None else (None, None)

    def forget(self, pid: int) -> None:
        self._procs.pop(pid, None)

    def pids(self) -> list[int]:
        return list(self._procs)

    def close(self) -> None:
        self._procs.clear()
        self._files.clear()

    def _read_maps(self, pid: int) -> _Process:
        maps = executable_mappings(pid)
        proc = self._procs[pid] = _Process(maps, [m.start for m in maps], time.monotonic())
        return proc

    @staticmethod
    def _mapping(proc: _Process, addr: int) -> Mapping | None:
        i = bisect.bisect_right(proc.starts, addr) - 1
        return proc.maps[i] if i >= 0 and addr < proc.maps[i].end else None

    def _elf(self, pid: int, m: Mapping) -> ElfSymbols | None:
        key = (m.dev, m.ino)
        if key in self._files:
            self._files.move_to_end(key)
            return self._files[key]
        elf = None
        for path in (f"/proc/{pid}/map_files/{m.start:x}-{m.end:x}", f"/proc/{pid}/root{m.path}"):
            try:
                fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK)
            except OSError:
                continue
            try:
                elf = ElfSymbols(fd) if stat.S_ISREG(os.fstat(fd).st_mode) else None
            except (OSError, ValueError, OverflowError, struct.error):
                elf = None
            finally:
                os.close(fd)
            break
        self._files[key] = elf
        if len(self._files) > FILES_KEPT:
            self._files.popitem(last=False)
        return elf
