"""The capture file, NAME.gputrace: an append-only msgpack stream of frames.

    ["H", header]            first frame: format, host, kernel, boot id, clock, offsets, tool version, argv,
                             start_ns (when the file was opened: before the probes were compiled)
    ["M", source, meta]      a source's metadata, before its records (e.g. the eBPF syscall table); the
                             session's ("session") says when tracing began: {"tracing_ns": N}
    ["R", kind, [row, ...]]  a batch of typed records of one kind (gputrace.records), rows positional
    ["K", blob]              raw kernel events, decoded on read by gputrace.probes.ebpf.events
    ["T", trailer]           last frame: end time, when tracing began (tracing_ns), counts, drops, source states

The writer appends to a temporary file beside the output and renames it when the capture is complete, so
the final name never holds half a capture. A capture cut off by a crash stays readable: the reader yields
everything up to the cut and reports the capture incomplete.
"""

from __future__ import annotations

import contextlib
import functools
import glob
import operator
import os
import re
import shlex
import socket
import stat
from collections.abc import Callable, Container, Iterable, Iterator, Sequence
from itertools import chain, repeat
from pathlib import Path
from typing import Any, NamedTuple, NoReturn, Protocol

import msgpack

from gputrace import __version__, clock
from gputrace.errors import CaptureCutOff, CorruptCapture, OutputError, PermissionDenied, UserError
from gputrace.records import RECORD_TYPES

FORMAT = "gputrace.capture/1"
MAGIC = "gputrace"
MAX_FRAME_BYTES = 256 << 20
HEADER_PREFIX = b"\x92\xa1H"  # msgpack of a capture's first frame, ["H", {...}], up to the header map


def host_header(argv: Sequence[str]) -> dict[str, Any]:
    """The header fields describing this host and clock, taken now."""
    uname = os.uname()
    return {
        "magic": MAGIC,
        "format": FORMAT,
        "tool_version": __version__,
        "host": socket.gethostname(),
        "kernel": uname.release,
        "machine": uname.machine,
        "boot_id": _boot_id(),
        "clock": "CLOCK_MONOTONIC",
        "mono_to_realtime_ns": clock.realtime_offset_ns(),
        "mono_to_boottime_ns": clock.boottime_offset_ns(),
        "start_ns": clock.monotonic_ns(),
        "argv": list(argv),
        "mounts": mount_table(),
        "tracer_pid": os.getpid(),  # the capturing process: CPU it takes from the job is the tracing's
    }


def mount_table(mountinfo: str = "/proc/self/mountinfo", mounts: str = "/proc/self/mounts") -> list[list[str]]:
    """[mount point, filesystem type, source, "MAJ:MIN"] of every mount, so analysis can tell a FUSE or NFS
    path from a disk and find the block device under a path (source /dev/loop3, device 7:3). Readers must
    accept the older two-field rows."""
    try:
        text = Path(mountinfo).read_text(errors="backslashreplace")  # a mount point may be any bytes
    except OSError:
        return _mounts_fallback(mounts)
    out: list[list[str]] = []
    for line in text.splitlines():
        f = line.split()
        if "-" not in f[6:]:
            continue
        sep = f.index("-", 6)  # optional fields (shared:N ...) end at a lone "-"
        if len(f) >= sep + 3:
            out.append([unescape_mount_field(f[4]), f[sep + 1], unescape_mount_field(f[sep + 2]), f[2]])
    return out


def _mounts_fallback(path: str) -> list[list[str]]:
    out: list[list[str]] = []
    try:
        text = Path(path).read_text(errors="backslashreplace")
    except OSError:
        return out
    for line in text.splitlines():
        f = line.split()
        if len(f) >= 3:
            out.append([unescape_mount_field(f[1]), f[2], unescape_mount_field(f[0]), ""])
    return out


def unescape_mount_field(field: str) -> str:
    """The kernel writes blanks, tabs, newlines and backslashes in mount fields as octal (\\040)."""
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _boot_id() -> str:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    except OSError:
        return ""


def valid_text(obj: Any) -> Any:
    """``obj`` with every string made valid UTF-8: bytes Python kept as surrogate escapes (a file name, an
    argument) become backslash escapes (\\xff), as everything read from /proc and the kernel is decoded, so two
    names that differ only there stay apart."""
    if isinstance(obj, str):
        try:
            raw = obj.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:  # a lone surrogate that escapes no byte
            raw = obj.encode("utf-8", "replace")
        return raw.decode("utf-8", "backslashreplace")
    if isinstance(obj, dict):
        return {valid_text(k): valid_text(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [valid_text(v) for v in obj]
    return obj


def cut_off_captures(path: Path) -> list[Path]:
    """Temporary files of earlier captures to ``path`` whose process is gone (killed, or its machine lost
    power): what they wrote is readable, up to the cut, by `gputrace report`."""
    out = []
    for p in sorted(path.parent.glob(f".{glob.escape(path.name)}.*.partial")):
        pid = p.name[len(path.name) + 2 : -len(".partial")]
        if pid.isdigit() and int(pid) != os.getpid() and not os.path.exists(f"/proc/{pid}"):
            out.append(p)
    return out


class WriteBudget(Protocol):
    """Bytes a capture may take (gputraced's per-user quota, daemon/service/jobs.py)."""

    def take(self, n: int) -> bool:
        """Take ``n`` bytes if they are there; False (nothing taken) when they are not."""
        ...

    def refusal(self) -> str:
        """Why a take failed, as the end of "writing FILE: ..." says it."""
        ...


def by_kind(records: Iterable[tuple[Any, ...]]) -> dict[str, list[tuple[Any, ...]]]:
    """Records grouped by their kind's name, in order within each kind: what one frame per kind holds."""
    out: dict[str, list[tuple[Any, ...]]] = {}
    for r in records:
        out.setdefault(type(r).__name__, []).append(r)
    return out


class CaptureWriter:
    """Writes one capture. Not thread-safe: one thread (the session's writer) owns it."""

    def __init__(self, path: str | os.PathLike[str], header: dict[str, Any], *, force: bool = False,
                 budget: WriteBudget | None = None) -> None:
        self.path = Path(path)
        self.budget = budget  # bytes this capture may still take (gputraced's per-user quota); None: no limit
        self.counts: dict[str, int] = {}
        self._packer = msgpack.Packer(use_bin_type=True)
        self._good = 0  # bytes of whole frames written: where a failed write cuts the capture
        check_output_path(self.path, force=force)
        self.partial_path = self.path.with_name(f".{self.path.name}.{os.getpid()}.partial")
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        try:
            self._fd: int | None = os.open(self.partial_path, flags, 0o640)
        except FileExistsError:
            raise UserError(f"{self.partial_path} exists (an earlier capture was cut off?); remove it") from None
        except OSError as e:
            raise UserError(f"cannot create {self.partial_path}: {e.strerror}") from None
        try:
            self._frame(["H", header])
        except BaseException:
            self.abort()  # no temporary file left behind by a header that could not be written
            raise

    @property
    def written(self) -> int:
        """Bytes of whole frames written so far."""
        return self._good

    def write_meta(self, source: str, meta: dict[str, Any]) -> None:
        self._frame(["M", source, meta])

    def write(self, records: Iterable[tuple[Any, ...]]) -> None:
        """Write records of any kinds, one frame per kind."""
        for kind, rows in by_kind(records).items():
            self.write_rows(kind, rows)

    def write_rows(self, kind: str, rows: Sequence[Sequence[Any]]) -> None:
        if kind not in RECORD_TYPES:
            raise ValueError(f"unknown record kind {kind!r}")
        if rows:
            self._frame(["R", kind, list(rows)])
            self.counts[kind] = self.counts.get(kind, 0) + len(rows)

    def write_kernel(self, blob: bytes, nevents: int) -> None:
        if blob:
            self._frame(["K", blob])
            self.counts["kernel_events"] = self.counts.get("kernel_events", 0) + nevents

    def close(self, trailer: dict[str, Any]) -> Path:
        """Write the trailer, make the file durable and give it its final name."""
        trailer = {**trailer, "counts": {**self.counts, **trailer.get("counts", {})}}
        self._frame(["T", trailer])
        assert self._fd is not None
        try:
            os.fsync(self._fd)  # a device that failed a write earlier (EIO) or a network filesystem says so here
        except OSError as e:
            self.abort()  # its pages were not written: nothing under the final name claims to be whole
            raise OutputError(self.path, e) from None
        os.close(self._fd)
        self._fd = None
        try:
            os.rename(self.partial_path, self.path)
        except OSError as e:
            raise OutputError(self.path, e, f"the capture is whole under {self.partial_path} (rename it)") from None
        return self.path

    def abort(self) -> None:
        """Give up: remove the temporary file, leave nothing under the final name."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None
        self.partial_path.unlink(missing_ok=True)

    def _frame(self, obj: list[Any]) -> None:
        try:
            data = self._packer.pack(obj)
        except UnicodeEncodeError:  # a name read from the OS as undecodable bytes (surrogate escapes)
            data = self._packer.pack(valid_text(obj))
        if self._fd is None:
            raise ValueError("capture writer is closed")
        if self.budget is not None and not self.budget.take(len(data)):
            self._stop_at_frame(self.budget.refusal())  # as a full disk would, but before the frame is written
        view = memoryview(data)
        try:
            while view:
                n = os.write(self._fd, view)
                view = view[n:]
        except OSError as e:
            self._stop_at_frame(e.strerror or str(e))
        self._good += len(data)

    def _stop_at_frame(self, why: str) -> NoReturn:
        kept = self._cut_off() if self._good else None
        if kept is None:  # not even the header: nothing worth keeping
            self.abort()
            raise UserError(f"writing {self.path}: {why}; nothing was written under that name") from None
        raise CaptureCutOff(f"writing {self.path}: {why}; the capture is cut off there: {kept} "
                            f"holds its first {self._good:,} bytes (gputrace report reads it up to the cut)",
                            kept) from None

    def _cut_off(self) -> Path | None:
        """Keep what was written (a full disk mid-capture must not cost the whole capture): the partial frame
        truncated away, which needs no space, and the rest under the final name, without a trailer; under
        the temporary name where even the rename fails (a full directory block). None: nothing kept."""
        assert self._fd is not None
        try:
            os.ftruncate(self._fd, self._good)
            with contextlib.suppress(OSError):
                os.fsync(self._fd)
        except OSError:
            return None
        os.close(self._fd)
        self._fd = None
        try:
            os.rename(self.partial_path, self.path)
        except OSError:
            return self.partial_path
        return self.path


def check_output_path(path: Path, *, force: bool, source: str | os.PathLike[str] | None = None) -> None:
    """Refuse an existing output without --force, the capture being read (``source``) even with it, and an
    unwritable directory, before any work starts."""
    if path.is_dir():
        raise UserError(f"{path} is a directory")
    kind = _special_kind(path)
    if kind:  # the output replaces what is there: never a device node, FIFO or socket, even with --force
        raise UserError(f"{path} is {kind}, not a file; choose a file name")
    if os.path.lexists(path) and not force:  # lexists: a dangling symlink planted there counts too
        raise UserError(f"{path} exists; use --force to overwrite it")
    if source is not None and path.exists() and Path(source).exists() and path.samefile(source):
        raise UserError(f"{path} is the capture being read; choose another output name")
    parent = path.parent if str(path.parent) else Path(".")
    if not parent.is_dir():
        raise UserError(f"directory {parent} does not exist")
    if not os.access(parent, os.W_OK | os.X_OK):
        raise UserError(f"directory {parent} is not writable")


def _special_kind(path: Path) -> str:
    """What ``path`` is when it, or what it links to (/dev/stdout), is a device node, FIFO or socket ("" when
    it is a file, a link to one, a dangling link or nothing)."""
    for look, prefix in ((os.lstat, ""), (os.stat, "a link to ")):
        try:
            mode = look(path).st_mode
        except OSError:
            return ""
        for test, kind in ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                           (stat.S_ISFIFO, "a FIFO"), (stat.S_ISSOCK, "a socket")):  # fmt: skip
            if test(mode):
                return prefix + kind
    if os.path.islink(path) and os.readlink(path).startswith("/proc/"):
        return "a link to a process's open file"  # /dev/stdout redirected to a file: the link would be replaced
    return ""


# Fields readers use as typed; a capture of any origin may hold anything there. Others are kept as they are.
HEADER_FIELDS: dict[str, type | tuple[type, ...]] = {
    "tool_version": str, "host": str, "kernel": str, "machine": str, "boot_id": str, "clock": str,
    "mono_to_realtime_ns": int, "mono_to_boottime_ns": int, "start_ns": int, "argv": list, "mounts": list,
}  # fmt: skip
TRAILER_FIELDS: dict[str, type | tuple[type, ...]] = {
    "end_ns": int, "tracing_ns": int, "stop_reason": str, "drops": dict, "complete": bool, "sources": dict,
    "skipped": dict, "counts": dict,
}  # fmt: skip


def _wrong_fields(obj: dict[str, Any], fields: dict[str, type | tuple[type, ...]]) -> list[str]:
    """The keys of ``fields`` whose value in ``obj`` is not of their type (a bool is no int here)."""
    bad = []
    for key, want in fields.items():
        if key in obj and (not isinstance(obj[key], want) or (want is int and type(obj[key]) is bool)):
            bad.append(key)
    if isinstance(obj.get("mounts"), list) and not all(
        isinstance(m, list) and all(type(f) is str for f in m) for m in obj["mounts"]
    ):
        bad.append("mounts")
    if isinstance(obj.get("argv"), list) and not all(type(a) is str for a in obj["argv"]):
        bad.append("argv")
    return bad


# How a row's field of each declared type is checked: an expression on the field, ``{v}`` (compiled once per
# kind: a capture holds millions of rows). int fields take bools (a bool is an int to every reader) and float
# fields take ints; nothing is converted.
_STR_ONLY = frozenset({str})
_FIELD_CHECKS = {
    "int": "(type({v}) is int or type({v}) is bool)",
    "bool": "(type({v}) is bool or type({v}) is int)",
    "float": "(type({v}) is float or type({v}) is int)",
    "str": "type({v}) is str",
    "list[str]": "(type({v}) is list and set(map(type, {v})) <= _STR_ONLY)",  # the items' types: a C loop
    "tuple[int, int, int]": ("(type({v}) in (list, tuple) and len({v}) == 3 and type({v}[0]) is int"
                             " and type({v}[1]) is int and type({v}[2]) is int)"),
}


@functools.cache
def row_check(kind: str) -> Callable[[list[Any]], bool]:
    """Whether a row of ``kind`` (at least its required fields long) has every field of its declared type."""
    return _row_check(kind, whole=False)


@functools.cache
def whole_row_check(kind: str) -> Callable[[Any], bool]:
    """Whether a row is a list of exactly ``kind``'s number of fields, each of its declared type (``row_check``
    of a row known to be whole, in one expression)."""
    return _row_check(kind, whole=True)


def _row_check(kind: str, whole: bool) -> Callable[[Any], bool]:
    cls = RECORD_TYPES[kind]
    exprs = [f"type(r) is list and len(r) == {len(cls._fields)}"] if whole else []
    for i, name in enumerate(cls._fields):
        ann = cls.__annotations__[name]
        text = str(getattr(ann, "__forward_arg__", ann if isinstance(ann, str) else getattr(ann, "__name__", ann)))
        check = _FIELD_CHECKS.get(text.split(" = ")[0].strip())
        if check is None:  # a type no check is written for: taken as it is
            continue
        cond = check.format(v=f"r[{i}]")
        exprs.append(cond if whole or name not in cls._field_defaults else f"(len(r) <= {i} or {cond})")
    code = f"lambda r: {' and '.join(exprs) or 'True'}"
    fn: Callable[[Any], bool] = eval(code)  # noqa: S307 - built above from the record classes' own annotations, never from input
    return fn


# A column of a field of each declared type, checked whole (``exact_columns``): the types its values may have,
# and for a list field, those its items may have and how many it must hold (-1: any number)
_EXACT_TYPES: dict[str, tuple[frozenset[type], frozenset[type], int]] = {
    "int": (frozenset({int}), frozenset(), -1),
    "bool": (frozenset({bool}), frozenset(), -1),
    "float": (frozenset({float, int}), frozenset(), -1),
    "str": (frozenset({str}), frozenset(), -1),
    "list[str]": (frozenset({list}), frozenset({str}), -1),
    "tuple[int, int, int]": (frozenset({list}), frozenset({int}), 3),
}  # fmt: skip


@functools.cache
def _exact_fields(kind: str) -> tuple[int, int, tuple[tuple[int, frozenset[type], frozenset[type], int], ...]]:
    """(``kind``'s fields, how many a row must hold, (field index, value types, item types, items) of each field
    checked)."""
    cls = RECORD_TYPES[kind]
    checks = []
    for i, name in enumerate(cls._fields):
        ann = cls.__annotations__[name]
        text = str(getattr(ann, "__forward_arg__", ann if isinstance(ann, str) else getattr(ann, "__name__", ann)))
        want = _EXACT_TYPES.get(text.split(" = ")[0].strip())
        if want is not None:
            checks.append((i, *want))
    return len(cls._fields), len(cls._fields) - len(cls._field_defaults), tuple(checks)


def exact_columns(kind: str, rows: Sequence[Any]) -> list[tuple[Any, ...]] | None:
    """The fields of ``rows`` column by column (a field older rows lack: its default), where every row is a list
    of ``kind``'s fields, all as long, and each field holds exactly its declared type (no bool for an int:
    stricter than ``row_check``, so every such row is sound, and kept by analysis as it is); None otherwise.
    A frame's values are checked a column at a time, in C loops (``set(map(type, column))``)."""
    nfields, needed, checks = _exact_fields(kind)
    if set(map(type, rows)) != {list} or not needed <= len(rows[0]) <= nfields:
        return None
    try:
        columns = list(zip(*rows, strict=True))
    except ValueError:  # rows not all as long
        return None
    width = len(columns)
    for i, types, items, n in checks:
        if i >= width:
            break
        col = columns[i]
        if not set(map(type, col)) <= types:
            return None
        if items and not (set(map(type, chain.from_iterable(col))) <= items and (n < 0 or set(map(len, col)) == {n})):
            return None
    if width < nfields:
        defaults = RECORD_TYPES[kind]._field_defaults
        columns += [(defaults[f],) * len(rows) for f in RECORD_TYPES[kind]._fields[width:]]
    return columns


def records_of(kind: str, rows: Sequence[Sequence[Any]]) -> list[Any]:
    """The records of rows ``exact_columns`` took (all as long; fields they lack take their defaults), read as
    lists or (``rows_at``) as tuples."""
    cls = RECORD_TYPES[kind]
    make = functools.partial(tuple.__new__, cls)
    if not rows or len(rows[0]) == len(cls._fields):
        return list(map(make, rows))
    pad = [cls._field_defaults[f] for f in cls._fields[len(rows[0]) :]]
    return list(map(make, map(operator.add, rows, repeat(pad if type(rows[0]) is list else tuple(pad)))))


@functools.cache
def has_lists(kind: str) -> bool:
    """Whether a field of ``kind`` holds a list: its rows must be read as lists (``rows_at``)."""
    return any(items for _, _, items, _ in _exact_fields(kind)[2])


class RowsAt(Protocol):
    """``CaptureReader.rows_at``."""

    def __call__(self, offset: int, length: int, *, lists: bool = True) -> Sequence[Sequence[Any]]: ...


class Batch(NamedTuple):
    """The records of one frame (``CaptureReader.batches``); where ``columns`` is not None, ``records`` are the
    frame's rows as read (lists, exactly their kind's fields) and ``columns`` those fields column by column."""

    kind: str  # "" for a frame of kernel events (records of several kinds)
    records: list[Any]
    offset: int  # where the frame is in the file, and its length
    length: int
    columns: list[tuple[Any, ...]] | None


# How each frame after the header begins: a msgpack array of 3 or 2 items whose first is the 1-char tag.
_FRAME_STARTS = (b"\x93\xa1R", b"\x92\xa1K", b"\x93\xa1M", b"\x92\xa1T")


class CaptureReader:
    """Streams a capture file's records. After iterating, ``complete``, ``trailer`` and ``problem`` are set."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        try:
            self._file = open(self.path, "rb")  # noqa: SIM115 - closed by close() / the context manager
        except PermissionError as e:
            raise PermissionDenied(f"cannot open {self.path}: {e.strerror} (captures are mode 0640)") from None
        except OSError as e:
            raise UserError(f"cannot open {self.path}: {e.strerror}") from None
        self._unpacker = self._new_unpacker()
        self.header_problem = ""  # wrong-typed header fields, left out (see _read_header)
        self.header = self._read_header()
        self.meta: dict[str, dict[str, Any]] = {}
        self.trailer: dict[str, Any] | None = None
        self.problem = ""  # why the capture is incomplete, when it is (the first thing found)
        self.skipped_bytes = 0  # damaged bytes passed over to read the frames after them
        self.drops: dict[str, int] = {}
        self.unknown_kinds: dict[str, int] = {}  # rows of record kinds a later version added, skipped
        self.malformed = 0  # rows with a field of the wrong type, skipped

    def _new_unpacker(self) -> msgpack.Unpacker:
        return msgpack.Unpacker(
            self._file, raw=False, strict_map_key=False, max_buffer_size=MAX_FRAME_BYTES, use_list=True
        )

    def _read_header(self) -> dict[str, Any]:
        try:
            frame = self._unpacker.unpack()
        except msgpack.OutOfData:
            raise CorruptCapture(self._unreadable()) from None
        except Exception:
            raise CorruptCapture(self._unreadable(corrupt=True)) from None
        if not (isinstance(frame, list) and len(frame) == 2 and frame[0] == "H" and isinstance(frame[1], dict)):
            raise CorruptCapture(self._unreadable())
        header = frame[1]
        if header.get("magic") != MAGIC:
            raise CorruptCapture(f"{self.path} is not a gputrace capture (bad magic)")
        if header.get("format") != FORMAT:
            raise CorruptCapture(f"{self.path}: unsupported capture format {str(header.get('format'))[:80]!r}")
        bad = _wrong_fields(header, HEADER_FIELDS)
        if bad:  # readers use these fields as typed: a wrong one is left out (its default used) and told
            self.header_problem = f"corrupt header at byte 0: field(s) {', '.join(bad)} of the wrong type, ignored"
            for key in bad:
                del header[key]
        return header

    def _unreadable(self, corrupt: bool = False) -> str:
        """Why there is no header, from what the first bytes say the file is."""
        self._file.seek(0)
        head = self._file.read(16)
        if head.startswith(HEADER_PREFIX) and corrupt:
            return f"{self.path}: a capture with a corrupt header (damaged bytes): nothing can be read"
        if head.startswith(HEADER_PREFIX):
            return f"{self.path}: a capture cut off inside its header, before any record: nothing to read"
        if not head:
            why = "the file is empty"
        elif head[0] == 0x0A:  # field 1 (TracePacket), length-delimited: how every Perfetto trace begins
            why = f"it looks like a Perfetto trace; open it with: gputrace view {self.path}"
        else:
            why = "no gputrace header"
        return f"{self.path} is not a gputrace capture ({why})"

    @property
    def complete(self) -> bool:
        return self.trailer is not None and not self.problem and bool(self.trailer.get("complete", True))

    def __enter__(self) -> CaptureReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._file.close()

    def fileno(self) -> int:
        return self._file.fileno()

    def records(self) -> Iterator[tuple[Any, ...]]:
        """Every record in file order. Raw kernel events come out decoded, fds resolved to objects."""
        for batch in self.batches():
            yield from batch.records

    def batches(self, exact: Container[str] = ()) -> Iterator[Batch]:
        """Every record in file order, a frame at a time (``records()`` flattens these). A frame of a kind in
        ``exact`` whose rows are exactly that kind's fields, each of its declared type (``exact_columns``), comes
        as those rows with their ``columns``: no record is made for it, and ``rows_at`` reads them again."""
        self._file.seek(0)
        self._unpacker = self._new_unpacker()
        self._unpacker.skip()
        self.trailer, self.problem, self.drops = None, self.header_problem, {}
        self.meta = {}
        self.skipped_bytes = 0
        size = os.fstat(self._file.fileno()).st_size
        self.unknown_kinds = {}
        self.malformed = 0
        decoder = None
        base = 0  # the file offset the unpacker started at
        while True:
            offset = base + self._unpacker.tell()
            try:
                frame = self._unpacker.unpack()
            except msgpack.OutOfData:
                # Out of data before the end of the file: a length (str32, bin32, array32, ...) claimed more
                # than the rest of it. Either the last frame was cut off, or a damaged length mid-file hid
                # the frames after it: those are found by their first bytes and read.
                resume = self._next_frame(offset + 1) if offset < size else None
                if resume is not None:
                    self._problem(f"corrupt frame at byte {offset}: a length runs past the end of the file")
                    self.skipped_bytes += resume - offset
                    self._file.seek(resume)
                    self._unpacker, base = self._new_unpacker(), resume
                    continue
                if self.trailer is None:
                    self._problem(f"cut off at byte {offset} (no trailer: the capture did not end cleanly, "
                                  "or is still being written)")
                if self.skipped_bytes:
                    self.problem += f"; {self.skipped_bytes:,} damaged bytes skipped, the frames after them read"
                return
            except Exception as e:  # msgpack raises several types on garbage: go on at the next frame
                resume = self._next_frame(offset + 1)
                self._problem(f"corrupt frame at byte {offset}: undecodable ({type(e).__name__})")
                if resume is None:
                    return
                self.skipped_bytes += resume - offset
                self._file.seek(resume)
                self._unpacker, base = self._new_unpacker(), resume
                continue
            length = base + self._unpacker.tell() - offset
            out: list[Any] = []  # the frame's records: those read before a bad row or event are kept
            kind = ""
            try:
                if not (isinstance(frame, list) and 2 <= len(frame) <= 3 and isinstance(frame[0], str)):
                    raise ValueError("not a frame (a list of a tag and its content)")
                tag = frame[0]
                if tag in ("R", "M") and (len(frame) != 3 or not isinstance(frame[1], str)):
                    raise ValueError(f"a {tag} frame is not [{tag}, name, content]")
                if tag == "R" and not isinstance(frame[2], list):
                    raise ValueError(f"{frame[1][:64]!r} rows are not a list")
                if tag == "R" and frame[1] not in RECORD_TYPES:
                    # a kind a later version writes (its records are extra detail): skipped and counted, the
                    # capture is not damaged for that; a future reader is the one to read them
                    name = frame[1][:64]
                    self.unknown_kinds[name] = self.unknown_kinds.get(name, 0) + len(frame[2])
                elif tag == "R":
                    kind = frame[1]
                    if kind in exact and frame[2] and self._observer(kind, decoder) is None \
                            and (cols := exact_columns(kind, frame[2])) is not None:
                        yield Batch(kind, frame[2], offset, length, cols)
                        continue
                    sound = self._sound_rows(kind, frame[2], decoder)
                    if sound is not None:
                        out = sound
                    else:
                        self._rows(out, kind, frame[2], decoder)
                elif tag == "K":
                    if decoder is None:
                        raise ValueError("kernel events before the eBPF metadata")
                    out.extend(decoder.decode(frame[1]))
                elif tag == "M":
                    if not isinstance(frame[2], dict):
                        raise ValueError(f"{frame[1][:64]!r} metadata is not a map")
                    if frame[1] == "ebpf":
                        from gputrace.probes.ebpf.events import KernelDecoder

                        try:
                            decoder = KernelDecoder(frame[2])
                        except (TypeError, ValueError, AttributeError) as e:
                            raise ValueError(f"unreadable eBPF metadata: {str(e)[:100]}") from None
                    self.meta[frame[1]] = frame[2]  # only once it was read: readers take it for sound
                elif tag == "T":
                    self._trailer(frame)
                else:
                    raise ValueError(f"unknown frame {tag[:8]!r}")
            # AttributeError: a map expected where the file holds something else (hostile or damaged input)
            except (TypeError, ValueError, IndexError, KeyError, AttributeError) as e:  # this frame only
                self._problem(f"corrupt frame at byte {offset}: {str(e)[:200]}")
            if out:
                yield Batch(kind, out, offset, length, None)

    def rows_at(self, offset: int, length: int, *, lists: bool = True) -> Sequence[Sequence[Any]]:
        """The rows of the record frame ``batches`` gave at ``offset`` (``length`` bytes) with its columns, read
        again (they were checked then); as tuples unless ``lists`` (faster to make: a frame with no field that
        holds a list, ``has_lists``, reads the same either way)."""
        frame = msgpack.unpackb(os.pread(self._file.fileno(), length, offset), raw=False, strict_map_key=False,
                                use_list=lists)
        rows: Sequence[Sequence[Any]] = frame[2]
        return rows

    def _trailer(self, frame: list[Any]) -> None:
        """Take a "T" frame as the trailer; its fields of the wrong type are left out (and told)."""
        trailer = frame[1]
        if len(frame) != 2 or not isinstance(trailer, dict):
            raise ValueError("the trailer is not a map")
        bad = _wrong_fields(trailer, TRAILER_FIELDS)
        for key in bad:
            del trailer[key]
        self.trailer = trailer
        self.drops.update({str(k): v for k, v in trailer.get("drops", {}).items() if type(v) is int})
        if bad:
            raise ValueError(f"trailer field(s) {', '.join(bad)} of the wrong type, ignored")

    def _problem(self, why: str) -> None:
        """The first problem names the capture's; later ones are counted in ``skipped_bytes``, not told."""
        if not self.problem:
            self.problem = why

    def _next_frame(self, start: int) -> int | None:
        """The offset of the first frame start (a record, kernel-event, metadata or trailer frame) at or after
        ``start``, by its first bytes; None when there is none. A match inside damaged data fails to read in
        turn and the search goes on after it, so each byte is searched a bounded number of times."""
        self._file.seek(start)
        pos, tail = start, b""
        while True:
            chunk = self._file.read(1 << 20)
            if not chunk:
                return None
            data = tail + chunk
            hits = [i for i in (data.find(m) for m in _FRAME_STARTS) if i >= 0]
            if hits:
                return pos - len(tail) + min(hits)
            tail = data[-(len(_FRAME_STARTS[0]) - 1):]  # a start split across two reads
            pos += len(chunk)

    def _sound_rows(self, kind: str, rows: list[list[Any]], decoder: Any) -> list[Any] | None:
        """The frame's records made in one go, when every row is sound and as long as its kind and reading it asks
        nothing more (what nearly every frame is); else None, and ``_rows`` reads it row by row."""
        if self._observer(kind, decoder) is not None:
            return None
        cls = RECORD_TYPES[kind]
        if not all(map(whole_row_check(kind), rows)):
            return None
        return list(map(functools.partial(tuple.__new__, cls), rows))  # what cls._make does, less its length check

    def _rows(self, out: list[Any], kind: str, rows: list[list[Any]], decoder: Any) -> None:
        """The records of ``rows`` onto ``out``, up to a row that is not one (raised: the frame's problem)."""
        cls = RECORD_TYPES[kind]
        nfields = len(cls._fields)
        needed = nfields - len(cls._field_defaults)  # fields added later have defaults: older rows lack them
        make = cls._make
        note = self._observer(kind, decoder)
        sound = row_check(kind)
        for row in rows:
            if not isinstance(row, list):
                raise ValueError(f"{kind} row is not a list")
            if len(row) < needed:
                raise ValueError(f"{kind} row has {len(row)} fields, expected {nfields}")
            if not sound(row):  # one hostile or damaged row: counted and passed over, its frame's others read
                self.malformed += 1
                continue
            # a row longer than its kind: fields a later version added, which this one ignores
            rec = make(row) if len(row) == nfields else make(row[:nfields]) if len(row) > nfields else cls(*row)
            if note is not None:
                note(rec)
            out.append(rec)

    def _observer(self, kind: str, decoder: Any) -> Callable[[Any], None] | None:
        """What reading a row of ``kind`` must also do: keep drop counts, feed the kernel decoder's fd tables,
        epoll registrations and mapped files."""
        if kind == "Drops":
            return self._note_drops
        if decoder is None:
            return None
        return {"FdInfo": decoder.note_fd, "EpollEntry": decoder.note_epoll, "ProcFork": decoder.note_fork,
                "FileMap": decoder.note_map}.get(kind)  # fmt: skip

    def _note_drops(self, rec: Any) -> None:
        self.drops[f"{rec.source}.{rec.what}"] = rec.count


def open_capture(path: str | os.PathLike[str]) -> CaptureReader:
    """Open a capture for reading, with a clear error for a missing or foreign file."""
    p = Path(path)
    if not p.exists():
        cut = cut_off_captures(p) if p.parent.is_dir() else []
        if cut:  # its capture was killed before it could give the file its name: what it wrote is there
            names = " or ".join(shlex.quote(str(c)) for c in cut[-3:])
            raise UserError(f"{p}: no such capture file, but a capture to it was cut off (its process was "
                            f"killed); read what it wrote with: gputrace report {names}")
        raise UserError(f"{p}: no such capture file")
    if not p.is_dir() and not p.is_file():  # a pipe or a device: the reader seeks back for each pass
        raise UserError(f"{p} is not a regular file; a capture is read more than once: save it to a file first")
    if p.suffix == ".pftrace" and not _starts_with(p, HEADER_PREFIX):  # by the name, unless it is a capture
        raise UserError(f"{p} is a Perfetto trace, not a capture; open it with: gputrace view {p}")
    return CaptureReader(p)


def _starts_with(path: Path, prefix: bytes) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(len(prefix)) == prefix
    except OSError:
        return False
