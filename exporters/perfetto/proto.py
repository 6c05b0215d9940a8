"""A small hand-written encoder for the Perfetto TracePacket fields gputrace writes.

Encoding bytes directly is about twice as fast as building protobuf message objects, and keeps the
exporter streaming. Field numbers are those of perfetto_trace.proto (the `perfetto` package ships the
official descriptors; tests/test_perfetto_proto.py decodes our bytes with them).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Mapping
from typing import Any

CLOCK_REALTIME = 1
CLOCK_MONOTONIC = 3
CLOCK_BOOTTIME = 6

SLICE_BEGIN = 1
SLICE_END = 2
INSTANT = 3
COUNTER = 4

SEQ_INCREMENTAL_STATE_CLEARED = 1
SEQ_NEEDS_INCREMENTAL_STATE = 2
SEQUENCE_ID = 1
CPU_MODE_USER = 2  # Profiling.CpuMode.MODE_USER

_U64 = (1 << 64) - 1
_I64_MIN, _I64_MAX = -(1 << 63), (1 << 63) - 1
_pack_q = struct.Struct("<Q").pack
_pack_d = struct.Struct("<d").pack


def _slow_varint(n: int) -> bytes:
    out = bytearray()
    while n >= 0x80:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)
    return bytes(out)


# Varints of values below 2**14, and 14-bit groups with their continuation bits: timestamps take 4 steps.
_SMALL = [_slow_varint(i) for i in range(1 << 14)]
_GROUP = [bytes(((i & 0x7F) | 0x80, ((i >> 7) & 0x7F) | 0x80)) for i in range(1 << 14)]


def varint(n: int) -> bytes:
    """Base-128 varint of a uint64; negative int64 values use their 64-bit two's complement."""
    if 0 <= n < 0x4000:
        return _SMALL[n]
    n &= _U64
    out = b""
    while n >= 0x4000:
        out += _GROUP[n & 0x3FFF]
        n >>= 14
    return out + _SMALL[n]


def _key(field: int, wire: int) -> bytes:
    return varint((field << 3) | wire)


def f_varint(field: int, value: int) -> bytes:
    return _key(field, 0) + varint(value)


def f_bytes(field: int, data: bytes) -> bytes:
    return _key(field, 2) + varint(len(data)) + data


def f_str(field: int, text: str) -> bytes:
    if type(text) is not str:  # a broken record must not stop the export
        text = str(text)
    return f_bytes(field, text.encode("utf-8", "replace"))


def f_fixed64(field: int, value: int) -> bytes:
    return _key(field, 1) + _pack_q(value & _U64)


def f_double(field: int, value: float) -> bytes:
    return _key(field, 1) + _pack_d(value)


# Keys used on the hot path, precomputed.
_K_TS = _key(8, 0)
_K_SEQ = f_varint(10, SEQUENCE_ID) + f_varint(58, CLOCK_MONOTONIC)  # trusted_packet_sequence_id, clock
_K_TRACK_EVENT = _key(11, 2)
_K_TYPE = (b"", f_varint(9, 1), f_varint(9, 2), f_varint(9, 3), f_varint(9, 4))
_K_UUID = _key(11, 0)
_K_ANNOT = _key(4, 2)
_K_FLOW = _key(47, 1)
_K_TERM_FLOW = _key(48, 1)
_PACKET = _key(1, 2)  # Trace.packet


def clamp_ts(ts: int) -> int:
    """Timestamps are uint64; a hostile or broken record must not wrap around."""
    ts = int(ts)
    if ts < 0:
        return 0
    return ts if ts <= _I64_MAX else _I64_MAX


_CACHE_MAX = 1 << 14
_names: dict[str, bytes] = {}
_strings: dict[str, bytes] = {}
_event_names: dict[str, bytes] = {}


def _cached_str(cache: dict[str, bytes], field: int, text: str) -> bytes:
    """Encoded string fields, cached: the same paths, names and comms recur on every event."""
    enc = cache.get(text)
    if enc is None:
        if len(cache) >= _CACHE_MAX:
            cache.clear()
        enc = cache[text] = f_str(field, text)
    return enc


def annotation(name: str, value: Any) -> bytes:
    """One DebugAnnotation: ints, floats, bools and strings; anything else as its text."""
    return (_names.get(name) or _cached_str(_names, 10, name)) + _value(value)


def _value(value: Any) -> bytes:
    t = type(value)
    if t is int and 0 <= value < 0x4000:
        n: int = value
        return b"\x20" + _SMALL[n]
    if t is str:
        s: str = value
        return _strings.get(s) or _cached_str(_strings, 6, s)
    if isinstance(value, bool):
        return b"\x10\x01" if value else b"\x10\x00"
    if isinstance(value, int):
        return b"\x20" + varint(value) if _I64_MIN <= value <= _I64_MAX else f_str(6, str(value))
    if isinstance(value, float):
        return f_double(5, value)
    return f_str(6, str(value))


def debug_args(values: Mapping[str, Any]) -> bytes:
    """Encoded debug_annotations fields of a TrackEvent, one per item."""
    out = b""
    names = _names
    for name, value in values.items():
        a = (names.get(name) or _cached_str(names, 10, name)) + _value(value)
        out += _K_ANNOT + varint(len(a)) + a
    return out


def track_event(
    etype: int,
    ts: int,
    uuid: int,
    name: str = "",
    *,
    category: bytes = b"",
    annots: bytes = b"",
    flows: Iterable[int] = (),
    terminating_flows: Iterable[int] = (),
    extra: bytes = b"",
) -> bytes:
    """A TracePacket holding one TrackEvent on the CLOCK_MONOTONIC timeline.

    ``category`` is a pre-encoded categories field (see ``category()``), ``annots`` pre-encoded debug
    annotations (see ``debug_args()``), ``extra`` any other pre-encoded TrackEvent fields.
    """
    ev = _K_TYPE[etype] + _K_UUID + varint(uuid)
    if name:
        ev += _cached_str(_event_names, 23, name)
    ev += category + annots + extra
    for f in flows:
        ev += _K_FLOW + _pack_q(f & _U64)
    for f in terminating_flows:
        ev += _K_TERM_FLOW + _pack_q(f & _U64)
    return _K_TS + varint(clamp_ts(ts)) + _K_SEQ + _K_TRACK_EVENT + varint(len(ev)) + ev


def category(name: str) -> bytes:
    return f_str(22, name)


def counter_event(ts: int, uuid: int, value: float) -> bytes:
    return track_event(COUNTER, ts, uuid, extra=f_double(44, float(value)))


def track_descriptor(
    uuid: int,
    *,
    name: str = "",
    parent: int = 0,
    description: str = "",
    process: tuple[int, str, list[str]] | None = None,
    thread: tuple[int, int, str] | None = None,
    counter_unit: str | None = None,
) -> bytes:
    """A TracePacket describing one track: a plain (child) track, a process, a thread or a counter."""
    td = f_varint(1, uuid)
    if name:
        td += f_str(2, name)
    if parent:
        td += f_varint(5, parent)
    if description:
        td += f_str(14, description)
    if process is not None:
        pid, pname, cmdline = process
        pd = f_varint(1, pid) + b"".join(f_str(2, a) for a in cmdline) + f_str(6, pname)
        td += f_bytes(3, pd)
    if thread is not None:
        pid, tid, tname = thread
        td += f_bytes(4, f_varint(1, pid) + f_varint(2, tid) + f_str(5, tname))
    if counter_unit is not None:
        td += f_bytes(8, f_str(6, counter_unit) if counter_unit else b"")
    return f_varint(10, SEQUENCE_ID) + f_bytes(60, td)


def clock_snapshot(monotonic_ns: int, realtime_ns: int, boottime_ns: int) -> bytes:
    """Ties CLOCK_MONOTONIC to BOOTTIME (the trace's default clock) and REALTIME (wall time in the UI)."""
    clocks = b"".join(
        f_bytes(1, f_varint(1, cid) + f_varint(2, clamp_ts(ts)))
        for cid, ts in ((CLOCK_BOOTTIME, boottime_ns), (CLOCK_MONOTONIC, monotonic_ns), (CLOCK_REALTIME, realtime_ns))
    )
    return f_varint(10, SEQUENCE_ID) + f_bytes(6, clocks)


def sequence_start() -> bytes:
    """The first packet of our sequence: clears incremental state and makes MONOTONIC the default clock."""
    defaults = f_varint(58, CLOCK_MONOTONIC)
    return f_varint(10, SEQUENCE_ID) + f_varint(13, SEQ_INCREMENTAL_STATE_CLEARED) + f_bytes(59, defaults)


# -- CPU samples: interned stacks (InternedData) and PerfSample packets ---------------------------------

_K_SAMPLE_SEQ = _K_SEQ + f_varint(13, SEQ_NEEDS_INCREMENTAL_STATE)  # sequence_flags: uses interned data
_K_PERF_SAMPLE = _key(66, 2)
_K_INTERNED = _key(12, 2)


def interned_string(field: int, iid: int, text: str) -> bytes:
    """An InternedString entry of InternedData (function_names = 5, mapping_paths = 17)."""
    return f_bytes(field, f_varint(1, iid) + f_str(2, text))


def interned_mapping(iid: int, path_iid: int) -> bytes:
    """InternedData.mappings: a module known by name only (no address range, no build id)."""
    return f_bytes(19, f_varint(1, iid) + (f_varint(7, path_iid) if path_iid else b""))


def interned_frame(iid: int, name_iid: int, mapping_iid: int) -> bytes:
    """InternedData.frames: a function in a module; symbolized already, so no address (rel_pc 0)."""
    return f_bytes(6, f_varint(1, iid) + f_varint(2, name_iid) + f_varint(3, mapping_iid) + f_varint(4, 0))


def interned_callstack(iid: int, frame_iids: Iterable[int]) -> bytes:
    """InternedData.callstacks: frame ids ordered root first (the outermost caller first)."""
    return f_bytes(7, f_varint(1, iid) + b"".join(f_varint(2, f) for f in frame_iids))


def perf_sample(ts: int, fields: bytes, callstack_iid: int, interned: bytes = b"") -> bytes:
    """A TracePacket with one PerfSample on CLOCK_MONOTONIC; ``fields`` from ``sample_fields()``,
    ``interned`` the InternedData entries first used here (the trace processor reads them first)."""
    body = fields + f_varint(4, callstack_iid)
    out = _K_TS + varint(clamp_ts(ts)) + _K_SAMPLE_SEQ
    if interned:
        out += _K_INTERNED + varint(len(interned)) + interned
    return out + _K_PERF_SAMPLE + varint(len(body)) + body


def sample_fields(pid: int, tid: int, cpu: int = -1) -> bytes:
    """PerfSample cpu (when known), pid, tid and cpu_mode (user stacks); encoded apart so a broken record
    fails before use."""
    where = f_varint(1, cpu) if cpu >= 0 else b""
    return where + f_varint(2, pid) + f_varint(3, tid) + f_varint(5, CPU_MODE_USER)


def framed(packet: bytes) -> bytes:
    """A packet as one `repeated TracePacket packet = 1` entry of the Trace message."""
    return _PACKET + varint(len(packet)) + packet
