"""gputraced's wire protocol, shared by the service and its client: frames and the request schema.

Every byte from a client is hostile: one length-prefixed JSON frame per request (at most MAX_REQUEST bytes),
schema-checked before anything happens. A client-supplied name is a plain file name, never a path.

Wire format (both directions): 4-byte big-endian length, then a UTF-8 JSON object.
    {"op": "capture", "pids": [4242], "duration_s": 10, "name": "run1.gputrace", "min_gap_ms": 1, "wait": true}
    {"op": "list"}    {"op": "status"}    {"op": "stop", "job": 3}    {"op": "dump", "pid": 4242}
Replies carry "ok": true/false and "error" when false; a waited capture gets a second frame when it ends.
"""

from __future__ import annotations

import json
import re
import socket
import struct
import time
from typing import Any

MAX_REQUEST = 64 << 10
MAX_REPLY = 16 << 20
MAX_PIDS = 64
PID_MAX = 1 << 22
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,100}")
OPS = {"capture": {"pids", "duration_s", "name", "min_gap_ms", "wait", "off"}, "list": set(), "status": set(),
       "stop": {"job"}, "dump": {"pid"}}


class ProtocolError(Exception):
    """A request that breaks the protocol or the schema; the message goes back to the client."""


# -------------------------------------------------------------------------------------------- frames ---


def send_frame(sock: socket.socket, obj: dict[str, Any]) -> None:
    data = json.dumps(obj, separators=(",", ":")).encode()
    sock.sendall(struct.pack(">I", len(data)) + data)


def recv_frame(sock: socket.socket, limit: int, within_s: float | None = None) -> dict[str, Any] | None:
    """One frame, or None when the peer closed cleanly before sending one. ``within_s``: the whole frame
    must arrive within that many seconds (the socket's own timeout bounds each recv only, so a peer
    sending a byte at a time would never hit it)."""
    deadline = None if within_s is None else time.monotonic() + within_s
    timeout = sock.gettimeout()
    try:
        head = _recv_exact(sock, 4, allow_eof=True, deadline=deadline)
        if head is None:
            return None
        (size,) = struct.unpack(">I", head)
        if size > limit:
            raise ProtocolError(f"frame of {size} bytes exceeds the limit of {limit}")
        body = _recv_exact(sock, size, allow_eof=False, deadline=deadline)
    finally:
        sock.settimeout(timeout)  # replies are sent under the socket's own timeout again
    assert body is not None
    try:
        obj = json.loads(body.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ProtocolError(f"not a JSON frame: {type(e).__name__}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("a frame must be a JSON object")
    return obj


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


def _recv_exact(sock: socket.socket, n: int, *, allow_eof: bool, deadline: float | None = None) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        if deadline is not None:
            left = deadline - time.monotonic()
            if left <= 0:
                raise ProtocolError("request not received in time")
            sock.settimeout(left)
        try:
            chunk = sock.recv(n - len(buf))
        except TimeoutError:
            raise ProtocolError("request not received in time") from None
        if not chunk:
            if allow_eof and not buf:
                return None
            raise ProtocolError("connection closed mid-frame")
        buf += chunk
    return bytes(buf)


# ------------------------------------------------------------------------------------------- schema ---


def validate(req: dict[str, Any]) -> dict[str, Any]:
    """The request, checked against the schema: known op, known keys, types and ranges."""
    op = req.get("op")
    if not isinstance(op, str) or op not in OPS:
        raise ProtocolError(f"unknown op; expected one of {', '.join(sorted(OPS))}")
    extra = set(req) - OPS[op] - {"op"}
    if extra:
        raise ProtocolError(f"unexpected field(s) for {op}: {', '.join(sorted(map(str, extra)))[:200]}")
    if op == "stop":
        _int(req.get("job"), "job", 1, 1 << 31)
    if op == "dump":
        _int(req.get("pid"), "pid", 1, PID_MAX)
    if op == "capture":
        pids = req.get("pids")
        if not isinstance(pids, list) or not 1 <= len(pids) <= MAX_PIDS:
            raise ProtocolError(f"pids must be a list of 1 to {MAX_PIDS} pids")
        req["pids"] = sorted({_int(p, "pid", 1, PID_MAX) for p in pids})
        req["duration_s"] = _number(req.get("duration_s"), "duration_s", 0.001, 7 * 86400)
        req["min_gap_ms"] = _number(req.get("min_gap_ms", 1.0), "min_gap_ms", 0.001, 60_000)
        req["name"] = check_name(req["name"]) if req.get("name") is not None else None
        if not isinstance(req.get("wait", False), bool):
            raise ProtocolError("wait must be true or false")
        req["off"] = _families(req.get("off", []))
    return req


def _families(value: Any) -> list[str]:
    """Source families to turn off: names gputrace.families knows, at most one of each."""
    from gputrace.families import FAMILIES

    if not isinstance(value, list) or len(value) > len(FAMILIES) or not all(isinstance(v, str) for v in value):
        raise ProtocolError("off must be a list of source family names")
    unknown = sorted(set(value) - FAMILIES.keys())
    if unknown:
        raise ProtocolError(f"unknown source family {unknown[0][:40]!r} (one of: {', '.join(FAMILIES)})")
    return sorted(set(value))


def _int(value: Any, what: str, lo: int, hi: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise ProtocolError(f"{what} must be an integer in [{lo}, {hi}]")
    return value


def _number(value: Any, what: str, lo: float, hi: float) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not lo <= value <= hi:
        raise ProtocolError(f"{what} must be a number in [{lo:g}, {hi:g}]")
    return float(value)


def check_name(raw: Any) -> str:
    """A plain file name for the capture (".gputrace" added when missing); never a path."""
    if not isinstance(raw, str):
        raise ProtocolError("name must be a string")
    name: str = raw
    if "/" in name or "\0" in name or name in (".", "..") or name.startswith("."):
        raise ProtocolError("name must be a plain file name, not a path")
    if not name.endswith(".gputrace"):
        name += ".gputrace"
    if not NAME_RE.fullmatch(name) or ".." in name:
        raise ProtocolError("name may use letters, digits, '.', '_' and '-' (at most 100 characters)")
    return name
