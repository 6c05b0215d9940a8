"""Feeds damaged and hostile captures to `gputrace report --json` and `gputrace export --perfetto`, in one
process (a fresh interpreter per case would cost the run minutes), each case under a time limit, the whole
run under an address-space limit. Prints one JSON line per case that escaped as anything but the CLI's
one-line error: the exception and where it was raised. Used by tests/test_capture_fuzz.py.

    python tests/fuzz_capture_runner.py WORKDIR SEED COUNT
"""

from __future__ import annotations

import contextlib
import copy
import functools
import io
import json
import random
import resource
import signal
import sys
import traceback
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgpack

CASE_TIMEOUT_S = 10
ADDRESS_SPACE = 3 << 30
# Lengths that claim far more than any file holds: str32, bin32, array32, map32, ext32.
HUGE_LENGTHS = (b"\xdb\xff\xff\xff\xf0", b"\xc6\xff\xff\xff\xf0", b"\xdd\x7f\xff\xff\xff", b"\xdf\x7f\xff\xff\xff",
                b"\xc9\x7f\xff\xff\xff\x01")  # fmt: skip
WRONG_VALUES: list[Any] = [0, -1, (1 << 64) - 1, -(1 << 63), 1.5, "x", "", b"\x00\xff", None, True, [], [1], [[]],
                           {}, {"a": 1}, {1: [2]}, ["R", "GpuKernel", []]]  # fmt: skip


class CaseTimeout(Exception):
    pass


def base_capture(path: Path) -> bytes:
    """A small capture with every frame kind: metadata (eBPF, NVML), records of several kinds, raw kernel
    events, a trailer."""
    from gputrace.testing.synth import Builder

    b = Builder().proc(100, "python").thread(100, 101, "python").device(100).nvml_devices("uuid-100-0")
    b.op(100, 101, 1, 2, 5)
    b.op(100, 101, 6, 7, 9, memcpy=True)
    b.syscall(100, 101, "read", 5, 6, obj="/data/x")
    b.fd(100, 3, "/data/x", "file")
    b.kernel_call(100, 101, "read", 3, 4)
    b.samples(100, 101, 1, 3, ["f", "main"])
    return b.write(path, drops={"agent.queue": 1}).read_bytes()


def frames_of(data: bytes) -> list[Any]:
    return list(msgpack.Unpacker(io.BytesIO(data), raw=False, strict_map_key=False))


def pack(frames: list[Any]) -> bytes:
    return b"".join(msgpack.packb(f, use_bin_type=True) for f in frames)


def hand_made(data: bytes) -> Iterator[tuple[str, bytes]]:
    """The wrong types and lengths met in practice, one at a time."""
    frames = frames_of(data)

    def at(tag: str, name: str | None = None) -> int:
        return next(i for i, f in enumerate(frames) if f[0] == tag and (name is None or f[1] == name))

    def edit(change: Callable[[list[Any]], None]) -> bytes:
        fr = copy.deepcopy(frames)
        change(fr)
        return pack(fr)

    t, ebpf, nvml = at("T"), at("M", "ebpf"), at("M", "nvml")
    yield "trailer not a map", edit(lambda fr: fr.__setitem__(t, ["T", [1, 2]]))
    yield "a later trailer a list", edit(lambda fr: fr.append(["T", [1]]))
    yield "trailer end_ns a string", edit(lambda fr: fr[t][1].__setitem__("end_ns", "x"))
    yield "trailer end_ns a list", edit(lambda fr: fr[t][1].__setitem__("end_ns", [1]))
    yield "trailer drops a list", edit(lambda fr: fr[t][1].__setitem__("drops", [1]))
    yield "ebpf metadata not a map", edit(lambda fr: fr.__setitem__(ebpf, ["M", "ebpf", [1]]))
    yield "ebpf syscalls an int", edit(lambda fr: fr[ebpf][2].__setitem__("syscalls", 5))
    yield "ebpf devices a list", edit(lambda fr: fr[ebpf][2].__setitem__("devices", [1]))
    yield "nvml devices an int", edit(lambda fr: fr[nvml][2].__setitem__("devices", 7))
    yield "header mounts an int", edit(lambda fr: fr[0][1].__setitem__("mounts", 5))
    yield "header start_ns a map", edit(lambda fr: fr[0][1].__setitem__("start_ns", {}))
    yield "a frame that is a map", edit(lambda fr: fr.insert(3, {"R": 1}))
    yield "a frame of one item", edit(lambda fr: fr.insert(3, ["R"]))
    mid = len(pack(frames[:4]))
    for head in HUGE_LENGTHS:
        yield f"a huge length {head.hex()} mid-file", data[:mid] + head + data[mid:]


def _paths(obj: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[Any, ...]]:
    yield path
    if isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, (*path, i))
    elif isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, (*path, k))


def _replace(obj: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    inner = obj
    for key in path[:-1]:
        inner = inner[key]
    inner[path[-1]] = value
    return obj


def mutations(data: bytes, rng: random.Random, count: int) -> Iterator[tuple[str, bytes]]:
    """Half byte-level damage (flips, cuts, insertions, huge lengths), half a value anywhere in a frame
    replaced by one of another type."""
    frames = frames_of(data)
    for n in range(count):
        if n % 2:
            fr = copy.deepcopy(frames)
            for _ in range(rng.randint(1, 2)):
                i = rng.randrange(len(fr))
                path = rng.choice(list(_paths(fr[i])))
                fr[i] = _replace(fr[i], path, copy.deepcopy(rng.choice(WRONG_VALUES)))
            yield f"typed #{n}", pack(fr)
            continue
        b = bytearray(data)
        for _ in range(rng.randint(1, 4)):
            op, pos = rng.random(), rng.randrange(len(b))
            if op < 0.5:
                b[pos] = rng.randrange(256)
            elif op < 0.7:
                del b[pos : pos + rng.randint(1, 16)]
            elif op < 0.85:
                b[pos:pos] = rng.randbytes(rng.randint(1, 8))
            else:
                b[pos:pos] = rng.choice(HUGE_LENGTHS)
        yield f"bytes #{n}", bytes(b)


def run_cli(argv: list[str]) -> None:
    import gputrace.cli

    # The parser is the same for every case and building it is most of a small case's time (argparse looks up a
    # translation for each of its strings): built once, what each case runs is the command itself.
    if not hasattr(gputrace.cli.build_parser, "cache_info"):
        gputrace.cli.build_parser = functools.cache(gputrace.cli.build_parser)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        gputrace.cli.main(argv)


def _alarm(*_: object) -> None:
    raise CaseTimeout


def main() -> int:
    work, seed, count = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    resource.setrlimit(resource.RLIMIT_AS, (ADDRESS_SPACE, ADDRESS_SPACE))
    signal.signal(signal.SIGALRM, _alarm)
    data = base_capture(work / "base.gputrace")
    cases = [*hand_made(data), *mutations(data, random.Random(seed), count)]
    capture, out = work / "case.gputrace", work / "case.pftrace"
    every_export = 4  # the exporter reads as report does; every 4th case through it keeps the run short
    for n, (name, blob) in enumerate(cases):
        capture.write_bytes(blob)
        runs = [["report", str(capture), "--json"]]
        if n < 32 or n % every_export == 0:
            runs.append(["export", str(capture), "--perfetto", str(out), "--force"])
        for argv in runs:
            signal.alarm(CASE_TIMEOUT_S)
            try:
                run_cli(argv)
            except BaseException as e:  # noqa: BLE001 - every escape is the finding
                where = traceback.extract_tb(e.__traceback__)[-1]
                print(json.dumps({"case": name, "command": argv[0], "error": f"{type(e).__name__}: {e}"[:300],
                                  "at": f"{where.filename}:{where.lineno}", "bytes": blob.hex()[:4000]}))
                sys.stdout.flush()
            finally:
                signal.alarm(0)
    print(json.dumps({"done": len(cases)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
