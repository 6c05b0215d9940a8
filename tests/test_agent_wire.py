"""The channel's framing, and the agent's own msgpack for interpreters that lack the library."""

from __future__ import annotations

import os
from pathlib import Path

import msgpack
import pytest
from agent_harness import Harness, of

from gputrace.agent import minipack, wire
from gputrace.records import GpuKernel

SAMPLES = [
    None, True, False, 0, 1, 127, 128, 255, 256, 65535, 65536, (1 << 32) - 1, 1 << 32, (1 << 64) - 1,
    -1, -32, -33, -128, -129, -32768, -32769, -(1 << 31), -(1 << 31) - 1, -(1 << 63), 1.5, -0.0,
    "", "x" * 31, "x" * 32, "ü" * 200, "y" * 70000, b"", b"\x00" * 300, b"z" * 70000,
    [], list(range(15)), list(range(16)), list(range(70000)), {}, {f"k{i}": i for i in range(15)},
    {f"k{i}": i for i in range(16)},
    {"type": "batch", "records": [["GpuKernel", [list(GpuKernel(1, 0, 1, 7, 10, 20, 3, "gemm", (1, 2, 3),
                                                                   (4, 5, 6)))]]]},
]


@pytest.mark.parametrize("value", SAMPLES, ids=lambda v: type(v).__name__)
def test_minipack_matches_msgpack(value: object) -> None:
    packed = minipack.packb(value)
    assert packed == msgpack.packb(value, use_bin_type=True)
    assert minipack.unpackb(packed) == msgpack.unpackb(packed, raw=False, strict_map_key=False)


@pytest.mark.parametrize("garbage", [b"\xc1", b"\x92\x01", b"\xdb\xff\xff\xff\xff", b"\x81\x90\x01", b"\x01\x02",
                                     b"\x91" * 100 + b"\x01"])
def test_minipack_refuses_garbage(garbage: bytes) -> None:
    with pytest.raises((ValueError, IndexError, TypeError)):
        minipack.unpackb(garbage)


def test_frames_split_and_oversized_frames_are_refused() -> None:
    frames = wire.encode({"type": "start"}) + wire.encode({"type": "stop"})
    buf = wire.FrameBuffer()
    got = [wire.decode_body(b) for i in range(len(frames)) for b in buf.feed(frames[i : i + 1])]
    assert [m["type"] for m in got] == ["start", "stop"] and buf.pending == 0
    with pytest.raises(wire.FrameError, match="oversized"):
        wire.FrameBuffer().feed(wire.HEADER.pack(wire.MAX_FRAME_BYTES + 1))
    with pytest.raises(wire.FrameError, match="exceeds"):
        wire.encode({"type": "batch", "blob": b"x" * wire.MAX_FRAME_BYTES})


def test_an_agent_without_msgpack_still_delivers(tmp_path: Path) -> None:
    blocker = tmp_path / "blocker"
    blocker.mkdir()
    (blocker / "msgpack.py").write_text("raise ImportError('msgpack is not installed here')\n")
    h = Harness(tmp_path)
    base = {k: v for k, v in os.environ.items() if not k.startswith("GPUTRACE_")}
    base["PYTHONPATH"] = str(blocker)
    p = h.spawn("""
import importlib.util
from gputrace.sim import Device
s = Device(0).stream()
s.launch("no_msgpack_here", duration_ms=2)
s.synchronize()
try:
    import msgpack
    print("msgpack importable")
except ImportError:
    print("no msgpack")
""", env={**base, **h.server.child_env(base)})
    out, err = p.communicate(timeout=20)
    assert (out.strip(), err) == ("no msgpack", "")
    recs = h.finish()
    assert [k.name for k in of(recs, "GpuKernel")] == ["no_msgpack_here"]
    assert [a.name for a in of(recs, "CudaApi")] == ["cudaLaunchKernel", "cudaStreamSynchronize"]


def test_a_frame_of_more_items_than_the_bound_is_refused_and_one_within_it_decoded() -> None:
    """An empty array is one byte sent and ~60 bytes decoded: the session counts the items of a frame as they are
    built (an array counts its elements and itself). A frame of at most half the bound's bytes cannot hold more
    (each item counts at most twice and takes a byte) and is decoded without counting; both give the same."""
    many = msgpack.packb({"type": "batch", "records": [[]] * 5000})
    with pytest.raises(wire.FrameError, match="over 10005 items"):  # 5000 arrays twice, the list, the map
        wire.decode_body(many, 10005)
    assert wire.decode_body(many, 10006) == wire.decode_body(many, 2 * len(many)) == wire.decode_body(many)
    with pytest.raises(wire.FrameError, match="over 9000 items"):
        wire.decode_body(msgpack.packb([[]] * 4499 + [list(range(100))]), 9000)  # counted: 4500 bytes and more
