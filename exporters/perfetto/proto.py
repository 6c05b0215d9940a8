"""A small hand-written encoder for the Perfetto TracePacket fields gputrace writes.

Encoding bytes directly is about twice as fast as building protobuf message objects, and keeps the
exporter streaming. Field numbers are those of perfetto_trace.proto (the `perfetto` package ships the
official descriptors; tests/test_perfetto_proto.py decodes our bytes with them).
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Iterable, Mapping, Sequence
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
    if n < 0x1000_0000:
        return _GROUP[n & 0x3FFF] + _SMALL[n >> 14]
    out = _GROUP[n & 0x3FFF] + _GROUP[(n >> 14) & 0x3FFF]  # timestamps: 28 bits in two steps
    n >>= 28
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


def debug_arg(name: str, value: Any) -> bytes:
    """One debug_annotations field: ``debug_args({name: value})``."""
    a = annotation(name, value)
    return _K_ANNOT + varint(len(a)) + a


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


# -- the exporter's hot path ------------------------------------------------------------------------------------
# The same bytes as framed(track_event(...)) and debug_args(...) above (tests/test_perfetto_fast.py compares them),
# with the per-event work cut down: a field's key, length and name are joined once per name, a slice's two packets
# are framed in one join, and event names and string annotations are looked up encoded. These are what the
# exporter spends its time in; the functions above stay the plain statement of the encoding.

Encode = Callable[[Any], bytes]
_NAME_OF = (b"", *(_key(9, 0) + _SMALL[t] + _K_UUID for t in (SLICE_BEGIN, SLICE_END, INSTANT, COUNTER)))
_SEQ_EVENT = _K_SEQ + _K_TRACK_EVENT
_BEGIN_UUID, _END_UUID = _NAME_OF[SLICE_BEGIN], _NAME_OF[SLICE_END]
_FIXED = len(_K_TS) + len(_SEQ_EVENT)  # a TrackEvent packet's bytes besides its timestamp, length and event
_PRE = [_PACKET + _SMALL[n] + _K_TS for n in range(1024)]  # a packet's framing and timestamp key, by its size


def int_arg(name: str, recurring: bool = False) -> Encode:
    """``lambda v: debug_arg(name, v)`` for a field that holds an int: the entry's key, length, name and value key
    are made once per length of the value's varint. Any other value (a bool, an int beyond int64) goes the
    general way. ``recurring``: a field whose values repeat (pids, tids, fds, sizes): each value's entry is kept
    (at most ``_CACHE_MAX``), as ``str_arg`` keeps strings'."""
    nm = f_str(10, name)
    heads = tuple(_K_ANNOT + varint(len(nm) + 1 + k) + nm + b"\x20" for k in range(11))
    small, group = _SMALL, _GROUP

    def encode(value: Any) -> bytes:
        if type(value) is int:
            if 0 <= value < 0x4000:
                v = small[value]
            elif 0x4000 <= value < 0x1000_0000:
                v = group[value & 0x3FFF] + small[value >> 14]
            elif 0 <= value <= _I64_MAX:  # times: their high bits looked up
                v = ts_varint(value)
            elif _I64_MIN <= value < 0:
                v = varint(value)
            else:
                return debug_arg(name, value)
            return heads[len(v)] + v
        return debug_arg(name, value)

    if not recurring:
        return encode
    cache: dict[int, bytes] = {}

    def encode_kept(value: Any) -> bytes:
        if type(value) is not int:
            return debug_arg(name, value)
        enc = cache.get(value)
        if enc is None:
            if len(cache) >= _CACHE_MAX:
                cache.clear()
            enc = cache[value] = encode(value)
        return enc

    return encode_kept


def str_arg(name: str) -> Encode:
    """``lambda v: debug_arg(name, v)`` for a field that holds a string, each string's entry kept encoded (paths,
    comms and states recur on every event; at most ``_CACHE_MAX`` are kept)."""
    cache: dict[str, bytes] = {}

    def encode(value: Any) -> bytes:
        if type(value) is not str:
            return debug_arg(name, value)
        enc = cache.get(value)
        if enc is None:
            if len(cache) >= _CACHE_MAX:
                cache.clear()
            enc = cache[value] = debug_arg(name, value)
        return enc

    return encode


def event_name(name: str) -> bytes:
    """A TrackEvent's name field as ``track_event`` writes it (none for an empty name)."""
    if not name:
        return b""
    return _event_names.get(name) or _cached_str(_event_names, 23, name)


def flow_ids(flows: Sequence[int]) -> bytes:
    """A TrackEvent's flow_ids fields, as ``track_event`` writes them."""
    if len(flows) == 1:  # the common case: one arrow
        return _K_FLOW + _pack_q(flows[0] & _U64)
    return b"".join([_K_FLOW + _pack_q(f & _U64) for f in flows])


def flow_id(flow: int) -> bytes:
    """``flow_ids((flow,))``."""
    return _K_FLOW + _pack_q(flow & _U64)


_HIGH: dict[int, bytes] = {}  # varints of timestamps' bits above the 28th: the same for 268 ms at a time


def _high(bits: int) -> bytes:
    """The varint of a timestamp's bits above the 28th (``bits``), kept."""
    if len(_HIGH) >= _CACHE_MAX:
        _HIGH.clear()
    v = _HIGH[bits] = varint(bits)
    return v


def ts_varint(ts: int) -> bytes:
    """``varint(ts)`` of a clamped timestamp (0 <= ts < 2**63), its high bits' varint looked up: a few small-int
    operations instead of a loop over a big int."""
    if ts < 0x1000_0000:
        return varint(ts)
    high = _HIGH.get(ts >> 28) or _high(ts >> 28)
    low = ts & 0xFFF_FFFF
    return _GROUP[low & 0x3FFF] + _GROUP[low >> 14] + high


def framed_event(etype: int, ts: int, uuid: int, fields: bytes) -> bytes:
    """``framed(track_event(etype, ts, uuid, ...))`` for ``ts`` clamped already (``clamp_ts``), where ``fields``
    are the event's encoded name, category, annotations, other fields and flows, in that order."""
    ev = _NAME_OF[etype] + varint(uuid) + fields
    lev = len(ev)
    vs = ts_varint(ts)
    le = _SMALL[lev] if lev < 0x4000 else varint(lev)
    n = _FIXED + len(vs) + len(le) + lev
    return b"".join((_PACKET, _SMALL[n] if n < 0x4000 else varint(n), _K_TS, vs, _SEQ_EVENT, le, ev))


_TRACKS: dict[int, tuple[bytes, tuple[bytes, ...], bytes]] = {}


def _track(uuid: int) -> tuple[bytes, tuple[bytes, ...], bytes]:
    """What a track's slices repeat: a begin event's type and track, the end packet's framing and timestamp key
    by the length of its timestamp's varint, and the end packet after its timestamp."""
    u = varint(uuid)
    end = _END_UUID + u  # the end event: its type and track, under 128 bytes
    tail = _SEQ_EVENT + _SMALL[len(end)] + end
    heads = tuple(_PACKET + varint(len(_K_TS) + k + len(tail)) + _K_TS for k in range(11))
    if len(_TRACKS) >= _CACHE_MAX:
        _TRACKS.clear()
    t = _TRACKS[uuid] = (_BEGIN_UUID + u, heads, tail)
    return t


def framed_slice(s: int, e: int, uuid: int, fields: bytes) -> bytes:
    """Both packets of a slice, ``framed_event(SLICE_BEGIN, s, uuid, fields) + framed_event(SLICE_END, e, uuid,
    b"")``, in one join (``s`` and ``e`` clamped already). Each timestamp's varint goes into the join in its
    pieces (ts_varint's), their high bits looked up once where both share them."""
    begin, heads, tail = _TRACKS.get(uuid) or _track(uuid)
    lev = len(begin) + len(fields)
    le = _SMALL[lev] if lev < 0x4000 else varint(lev)
    if s < 0x1000_0000 or e < s:  # timestamps near the clock's start (tests), or not a slice: the plain way
        vs, ve = varint(s), varint(e)
        n = _FIXED + len(vs) + len(le) + lev
        return b"".join((_PACKET, _SMALL[n] if n < 0x4000 else varint(n), _K_TS, vs, _SEQ_EVENT, le, begin, fields,
                         heads[len(ve)], ve, tail))
    hs, he = s >> 28, e >> 28
    high_s = _HIGH.get(hs) or _high(hs)
    high_e = high_s if he == hs else _HIGH.get(he) or _high(he)
    n = _FIXED + 4 + len(high_s) + len(le) + lev
    return b"".join((_PRE[n] if n < 1024 else _PACKET + varint(n) + _K_TS, _GROUP[s & 0x3FFF],
                     _GROUP[(s >> 14) & 0x3FFF], high_s, _SEQ_EVENT, le, begin, fields,
                     heads[4 + len(high_e)], _GROUP[e & 0x3FFF], _GROUP[(e >> 14) & 0x3FFF], high_e, tail))


# A slice whose track and fields recur (the same call on the same thread, a kernel's launch on its stream): its
# two packets but their timestamps, made once (``slice_template``) and framed around each slice's times.
SliceTemplate = tuple[bytes, int, tuple[bytes, ...], bytes]


def slice_template(uuid: int, fields: bytes) -> SliceTemplate:
    """What ``framed_slice(s, e, uuid, fields)`` writes besides the two timestamps: the begin packet after its
    timestamp, that packet's size less its timestamp's varint, and the end packet's heads (by the length of its
    timestamp's varint) and tail."""
    begin, heads, tail = _TRACKS.get(uuid) or _track(uuid)
    lev = len(begin) + len(fields)
    body = _SEQ_EVENT + (_SMALL[lev] if lev < 0x4000 else varint(lev)) + begin + fields
    return body, len(_K_TS) + len(body), heads, tail


def framed_slice_of(s: int, e: int, template: SliceTemplate) -> bytes:
    """``framed_slice(s, e, uuid, fields)`` from ``slice_template(uuid, fields)`` (``s`` and ``e`` clamped)."""
    body, base, heads, tail = template
    if s < 0x1000_0000 or e < s:
        vs, ve = varint(s), varint(e)
        n = base + len(vs)
        return b"".join((_PACKET, varint(n), _K_TS, vs, body, heads[len(ve)], ve, tail))
    hs, he = s >> 28, e >> 28
    high_s = _HIGH.get(hs) or _high(hs)
    high_e = high_s if he == hs else _HIGH.get(he) or _high(he)
    n = base + 4 + len(high_s)
    return b"".join((_PRE[n] if n < 1024 else _PACKET + varint(n) + _K_TS, _GROUP[s & 0x3FFF],
                     _GROUP[(s >> 14) & 0x3FFF], high_s, body, heads[4 + len(high_e)], _GROUP[e & 0x3FFF],
                     _GROUP[(e >> 14) & 0x3FFF], high_e, tail))


_ARROWED: dict[tuple[int, int, bytes], tuple[bytes, int]] = {}


def _arrowed(etype: int, uuid: int, fields: bytes) -> tuple[bytes, int]:
    """An event with one arrow after ``fields``, after its packet's timestamp: its bytes up to the flow id's
    value, and the packet's size less its timestamp's varint."""
    ev = _NAME_OF[etype] + varint(uuid) + fields + _K_FLOW
    lev = len(ev) + 8
    body = _SEQ_EVENT + (_SMALL[lev] if lev < 0x4000 else varint(lev)) + ev
    if len(_ARROWED) >= _CACHE_MAX:
        _ARROWED.clear()
    t = _ARROWED[(etype, uuid, fields)] = (body, len(_K_TS) + len(body) + 8)
    return t


def framed_wakeup(s: int, wake: int, e: int, lane: int, begin: bytes, waker: int, wake_fields: bytes,
                  woken_fields: bytes, flow: int) -> bytes:
    """The five packets of a wait ended by a thread's wakeup (times clamped, ``s <= wake <= e``): the waker's
    instant at ``wake`` on its track, the wait's slice on ``lane`` and the "woken by" slice from ``wake`` nested
    in it, both events with wakeup's arrow ``flow``. The bytes of ``framed_event(INSTANT, wake, waker,
    wake_fields + flow_id(flow)) + framed_event(SLICE_BEGIN, s, lane, begin) + framed_slice(wake, e, lane,
    woken_fields + flow_id(flow)) + framed_end(e, lane)``, what recurs of the two arrowed events kept."""
    q = _pack_q(flow & _U64)
    if s >= 0x1000_0000:  # ts_varint's of the three times, their high bits looked up once where they share them
        hs, hw, he = s >> 28, wake >> 28, e >> 28
        high = _HIGH.get(hs) or _high(hs)
        vs = _GROUP[s & 0x3FFF] + _GROUP[(s >> 14) & 0x3FFF] + high
        if hw != hs:
            high = _HIGH.get(hw) or _high(hw)
        vw = _GROUP[wake & 0x3FFF] + _GROUP[(wake >> 14) & 0x3FFF] + high
        if he != hw:
            high = _HIGH.get(he) or _high(he)
        ve = _GROUP[e & 0x3FFF] + _GROUP[(e >> 14) & 0x3FFF] + high
    else:
        vw, vs, ve = ts_varint(wake), ts_varint(s), ts_varint(e)
    body1, n1 = _ARROWED.get((INSTANT, waker, wake_fields)) or _arrowed(INSTANT, waker, wake_fields)
    body3, n3 = _ARROWED.get((SLICE_BEGIN, lane, woken_fields)) or _arrowed(SLICE_BEGIN, lane, woken_fields)
    begin_uuid, heads, tail = _TRACKS.get(lane) or _track(lane)
    lev = len(begin_uuid) + len(begin)
    le = _SMALL[lev] if lev < 0x4000 else varint(lev)
    n1 += len(vw)
    n2 = _FIXED + len(vs) + len(le) + lev
    n3 += len(vw)
    end = heads[len(ve)]
    return b"".join((_PRE[n1] if n1 < 1024 else _PACKET + varint(n1) + _K_TS, vw, body1, q,
                     _PRE[n2] if n2 < 1024 else _PACKET + varint(n2) + _K_TS, vs, _SEQ_EVENT, le, begin_uuid, begin,
                     _PRE[n3] if n3 < 1024 else _PACKET + varint(n3) + _K_TS, vw, body3, q,
                     end, ve, tail, end, ve, tail))


def framed_end(ts: int, uuid: int) -> bytes:
    """``framed_event(SLICE_END, ts, uuid, b"")``: a slice's end alone."""
    _, heads, tail = _TRACKS.get(uuid) or _track(uuid)
    v = ts_varint(ts)
    return heads[len(v)] + v + tail


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


_K_FRAME_ID = _key(2, 0)  # Callstack.frame_ids, one entry per frame (not packed)


def interned_callstack(iid: int, frame_iids: Iterable[int]) -> bytes:
    """InternedData.callstacks: frame ids ordered root first (the outermost caller first)."""
    small, k = _SMALL, _K_FRAME_ID
    ids = b"".join([k + (small[f] if 0 <= f < 0x4000 else varint(f)) for f in frame_iids])
    return f_bytes(7, f_varint(1, iid) + ids)


def perf_sample(ts: int, fields: bytes, callstack_iid: int, interned: bytes = b"") -> bytes:
    """A TracePacket with one PerfSample on CLOCK_MONOTONIC; ``fields`` from ``sample_fields()``,
    ``interned`` the InternedData entries first used here (the trace processor reads them first)."""
    body = fields + f_varint(4, callstack_iid)
    out = _K_TS + varint(clamp_ts(ts)) + _K_SAMPLE_SEQ
    if interned:
        out += _K_INTERNED + varint(len(interned)) + interned
    return out + _K_PERF_SAMPLE + varint(len(body)) + body


_K_CALLSTACK = _key(4, 0)  # PerfSample.callstack_iid


def sample_tail(fields: bytes, callstack_iid: int) -> bytes:
    """A PerfSample packet after its timestamp (``fields`` from ``sample_fields()``, its stack interned before):
    the same for every sample of a thread, CPU and stack."""
    body = fields + _K_CALLSTACK + varint(callstack_iid)
    return _K_SAMPLE_SEQ + _K_PERF_SAMPLE + varint(len(body)) + body


def framed_sample(ts: int, tail: bytes) -> bytes:
    """``framed_perf_sample(ts, fields, callstack_iid)`` from ``sample_tail(fields, callstack_iid)``."""
    v = ts_varint(ts)
    n = len(_K_TS) + len(v) + len(tail)
    return b"".join((_PRE[n] if n < 1024 else _PACKET + varint(n) + _K_TS, v, tail))


def framed_perf_sample(ts: int, fields: bytes, callstack_iid: int) -> bytes:
    """``framed(perf_sample(ts, fields, callstack_iid))`` for ``ts`` clamped already, its stack interned before."""
    body = fields + _K_CALLSTACK + varint(callstack_iid)
    tail = _K_SAMPLE_SEQ + _K_PERF_SAMPLE + varint(len(body)) + body
    v = ts_varint(ts)
    return b"".join((_PACKET, varint(len(_K_TS) + len(v) + len(tail)), _K_TS, v, tail))


def sample_fields(pid: int, tid: int, cpu: int = -1) -> bytes:
    """PerfSample cpu (when known), pid, tid and cpu_mode (user stacks); encoded apart so a broken record
    fails before use."""
    where = f_varint(1, cpu) if cpu >= 0 else b""
    return where + f_varint(2, pid) + f_varint(3, tid) + f_varint(5, CPU_MODE_USER)


def framed(packet: bytes) -> bytes:
    """A packet as one `repeated TracePacket packet = 1` entry of the Trace message."""
    return _PACKET + varint(len(packet)) + packet
