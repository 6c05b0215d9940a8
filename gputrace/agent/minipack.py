"""A small msgpack encoder/decoder for the agent, for target interpreters that do not have msgpack.

The agent runs inside someone else's Python; its environment is not ours to extend. This covers what
the channel carries (nil, bool, int, float, str, bin, array, map) and produces the same bytes as
msgpack.packb(use_bin_type=True) for those types.
"""

from __future__ import annotations

import struct
from typing import Any


def packb(obj: Any) -> bytes:
    out = bytearray()
    _pack(obj, out)
    return bytes(out)


def _pack(o: Any, out: bytearray) -> None:  # noqa: C901 - one branch per msgpack type
    if o is None:
        out += b"\xc0"
    elif o is True or o is False:
        out += b"\xc3" if o else b"\xc2"
    elif isinstance(o, int):
        _pack_int(o, out)
    elif isinstance(o, float):
        out += b"\xcb" + struct.pack(">d", o)
    elif isinstance(o, str):
        _pack_len(len(b := o.encode("utf-8")), out, 0xA0, 31, (0xD9, 0xDA, 0xDB))
        out += b
    elif isinstance(o, bytes | bytearray | memoryview):
        _pack_len(len(b := bytes(o)), out, None, 0, (0xC4, 0xC5, 0xC6))
        out += b
    elif isinstance(o, list | tuple):
        _pack_len(len(o), out, 0x90, 15, (None, 0xDC, 0xDD))
        for x in o:
            _pack(x, out)
    elif isinstance(o, dict):
        _pack_len(len(o), out, 0x80, 15, (None, 0xDE, 0xDF))
        for k, v in o.items():
            _pack(k, out)
            _pack(v, out)
    else:
        raise TypeError(f"cannot serialize {type(o).__name__}")


def _pack_int(o: int, out: bytearray) -> None:
    if 0 <= o < 128:
        out.append(o)
    elif -32 <= o < 0:
        out += struct.pack(">b", o)
    elif o >= 0:
        for tag, fmt, top in ((0xCC, ">B", 1 << 8), (0xCD, ">H", 1 << 16), (0xCE, ">I", 1 << 32),
                              (0xCF, ">Q", 1 << 64)):
            if o < top:
                out += bytes([tag]) + struct.pack(fmt, o)
                return
        raise OverflowError("int too big for msgpack")
    else:
        for tag, fmt, low in ((0xD0, ">b", -(1 << 7)), (0xD1, ">h", -(1 << 15)), (0xD2, ">i", -(1 << 31)),
                              (0xD3, ">q", -(1 << 63))):
            if o >= low:
                out += bytes([tag]) + struct.pack(fmt, o)
                return
        raise OverflowError("int too small for msgpack")


def _pack_len(n: int, out: bytearray, fix: int | None, fixmax: int, tags: tuple[int | None, int, int]) -> None:
    if fix is not None and n <= fixmax:
        out.append(fix | n)
    elif tags[0] is not None and n < 1 << 8:
        out += bytes([tags[0], n])
    elif n < 1 << 16:
        out += bytes([tags[1]]) + struct.pack(">H", n)
    else:
        out += bytes([tags[2]]) + struct.pack(">I", n)


_FIXED = {0xCC: ">B", 0xCD: ">H", 0xCE: ">I", 0xCF: ">Q", 0xD0: ">b", 0xD1: ">h", 0xD2: ">i", 0xD3: ">q",
          0xCA: ">f", 0xCB: ">d"}
_LENGTH = {0xD9: (">B", "str"), 0xDA: (">H", "str"), 0xDB: (">I", "str"), 0xC4: (">B", "bin"),
           0xC5: (">H", "bin"), 0xC6: (">I", "bin"), 0xDC: (">H", "array"), 0xDD: (">I", "array"),
           0xDE: (">H", "map"), 0xDF: (">I", "map")}


def unpackb(data: bytes) -> Any:
    value, end = _unpack(memoryview(data), 0, 0)
    if end != len(data):
        raise ValueError("extra data after the msgpack object")
    return value


def _unpack(d: memoryview, i: int, depth: int) -> tuple[Any, int]:  # noqa: C901
    if depth > 32:
        raise ValueError("msgpack nesting too deep")
    t = d[i]
    i += 1
    if t < 0x80:
        return t, i
    if t >= 0xE0:
        return t - 0x100, i
    if 0xA0 <= t <= 0xBF:
        return _take(d, i, t & 0x1F, "str")
    if 0x90 <= t <= 0x9F:
        return _items(d, i, t & 0x0F, "array", depth)
    if 0x80 <= t <= 0x8F:
        return _items(d, i, t & 0x0F, "map", depth)
    if t in (0xC0, 0xC2, 0xC3):
        return {0xC0: None, 0xC2: False, 0xC3: True}[t], i
    if t in _FIXED:
        size = struct.calcsize(_FIXED[t])
        return struct.unpack_from(_FIXED[t], d, i)[0], i + size
    if t in _LENGTH:
        fmt, kind = _LENGTH[t]
        n = struct.unpack_from(fmt, d, i)[0]
        i += struct.calcsize(fmt)
        return _items(d, i, n, kind, depth) if kind in ("array", "map") else _take(d, i, n, kind)
    raise ValueError(f"unsupported msgpack type 0x{t:02x}")


def _take(d: memoryview, i: int, n: int, kind: str) -> tuple[Any, int]:
    if i + n > len(d):
        raise ValueError("truncated msgpack data")
    raw = bytes(d[i : i + n])
    return (raw.decode("utf-8") if kind == "str" else raw), i + n


def _items(d: memoryview, i: int, n: int, kind: str, depth: int) -> tuple[Any, int]:
    if n > len(d) - i:
        raise ValueError("truncated msgpack data")
    if kind == "array":
        items = []
        for _ in range(n):
            v, i = _unpack(d, i, depth + 1)
            items.append(v)
        return items, i
    mapping = {}
    for _ in range(n):
        k, i = _unpack(d, i, depth + 1)
        v, i = _unpack(d, i, depth + 1)
        if not isinstance(k, str | bytes | int):
            raise ValueError("unhashable msgpack map key")
        mapping[k] = v
    return mapping, i
