"""The agent channel's wire format, shared by the session (daemon/agents/server.py) and the agent runtime.

A unix stream socket carrying frames: a 4-byte big-endian length, then one msgpack map with a "type" key.

    agent -> session   hello  {pid, tid, interpreter, cuda_version, driver_version, backends, unavailable}
                       batch  {records: [[kind, [row, ...]], ...]}   rows positional, as gputrace.records
                                                                    (AgentThread rows name the agent's threads)
                       drops  {counts: {where: cumulative n}}
                       bye    {}
    session -> agent   start  {flush_ms}
                       stop   {}

This module imports only the standard library; msgpack is imported on first use so that arming a
process costs nothing until a session actually exists, and an interpreter without msgpack gets
gputrace.agent.minipack instead.
"""

from __future__ import annotations

import functools
import struct
from collections.abc import Callable
from typing import Any

MAX_FRAME_BYTES = 4 << 20
HEADER = struct.Struct(">I")
PROTOCOL = 1

# Environment that arms a process (read by boot/sitecustomize.py and gputrace.agent.runtime).
ENV_SOCKET = "GPUTRACE_AGENT_SOCK"  # connect to this session socket at startup (capture -- CMD)
ENV_ARMED = "GPUTRACE_AGENT"  # "1": stay dormant, attach when a session offers a socket
ENV_ATTACH_DIR = "GPUTRACE_ATTACH_DIR"  # where offers appear (default below); tests point it elsewhere
ENV_HOME = "GPUTRACE_HOME"  # directory holding the gputrace package, for interpreters that lack it
DEFAULT_ATTACH_DIR = "/run/gputrace/attach"


class FrameError(Exception):
    """A peer broke the protocol; the message is the reason it gets cut off."""


@functools.cache
def codec() -> tuple[Callable[[Any], bytes], Callable[[bytes], Any]]:
    """msgpack when the interpreter has it; else our own (a target's environment is not ours to extend)."""
    try:
        import msgpack
    except ImportError:
        from gputrace.agent import minipack

        return minipack.packb, minipack.unpackb
    return (
        lambda obj: msgpack.packb(obj, use_bin_type=True),
        lambda body: msgpack.unpackb(body, raw=False, strict_map_key=True, use_list=True),
    )


def encode(msg: dict[str, Any]) -> bytes:
    body = codec()[0](msg)
    if len(body) > MAX_FRAME_BYTES:
        raise FrameError(f"frame of {len(body)} bytes exceeds {MAX_FRAME_BYTES}")
    return HEADER.pack(len(body)) + body


class _TooManyItems(Exception):
    pass


def decode_body(body: bytes, max_items: int | None = None) -> dict[str, Any]:
    """One frame's body as a message map; anything else is a protocol error.

    ``max_items``: the most array elements it may hold in all (the session's bound, msgpack only). Decoded,
    an element costs far more than its byte on the wire (an empty array: 1 byte sent, ~60 bytes kept), so a
    frame within the byte limit could still take hundreds of MB while it is decoded; counted as arrays are
    built, such a frame is refused before it does."""
    try:
        # counted, an item is at most two (an element of its array, and an array itself) and takes at least a
        # byte: a body of at most half the bound's bytes cannot hold more, and is decoded without counting (a
        # call per array: a third of a batch's decoding)
        small = max_items is not None and 2 * len(body) <= max_items
        msg = codec()[1](body) if max_items is None or small else _decode_bounded(body, max_items)
    except _TooManyItems:
        raise FrameError(f"frame holds over {max_items} items") from None
    except Exception as e:  # decoders raise many types on garbage
        raise FrameError(f"undecodable frame ({type(e).__name__})") from None
    if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
        raise FrameError("frame is not a message map with a type")
    return msg


def _decode_bounded(body: bytes, max_items: int) -> Any:
    import msgpack

    left = [max_items]

    def counted(items: list[Any]) -> list[Any]:
        left[0] -= len(items) + 1
        if left[0] < 0:
            raise _TooManyItems
        return items

    def counted_map(items: dict[Any, Any]) -> dict[Any, Any]:
        left[0] -= 2 * len(items) + 1
        if left[0] < 0:
            raise _TooManyItems
        return items

    return msgpack.unpackb(body, raw=False, strict_map_key=True, use_list=True, list_hook=counted,
                           object_hook=counted_map)


class FrameBuffer:
    """Splits a byte stream into frame bodies; refuses oversized frames before buffering them."""

    def __init__(self, max_frame: int = MAX_FRAME_BYTES, first_max: int | None = None) -> None:
        self._buf = bytearray()
        self._max = max_frame
        self._first_max = first_max  # the first frame's limit, where it is smaller (a stranger's hello)

    def feed(self, data: bytes) -> list[bytes]:
        self._buf += data
        out: list[bytes] = []
        while len(self._buf) >= HEADER.size:
            (n,) = HEADER.unpack_from(self._buf)
            limit = self._max if self._first_max is None else self._first_max
            if n > limit:
                raise FrameError(f"oversized frame ({n} bytes, limit {limit})")
            if len(self._buf) < HEADER.size + n:
                break
            out.append(bytes(self._buf[HEADER.size : HEADER.size + n]))
            del self._buf[: HEADER.size + n]
            self._first_max = None
        return out

    def release(self) -> None:
        """Let go of what is held (a peer that is gone)."""
        self._buf = bytearray()

    @property
    def pending(self) -> int:
        return len(self._buf)
