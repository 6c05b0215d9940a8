"""Captures are read from anywhere (copied from another host, damaged on disk, made by hand): every byte
sequence must come out as a report or a one-line error, never a traceback, within bounded time and memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import msgpack
import pytest

from gputrace.capture import CaptureReader, open_capture
from gputrace.errors import UserError
from gputrace.records import GpuKernel, Syscall
from gputrace.testing.synth import Builder

ROOT = Path(__file__).resolve().parent.parent
RUNNER = Path(__file__).with_name("fuzz_capture_runner.py")


@pytest.mark.slow
def test_thousands_of_mutated_captures_never_escape_as_a_traceback(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run([sys.executable, str(RUNNER), str(tmp_path), "23", "2000"], capture_output=True,
                          text=True, timeout=300, env=env, cwd=tmp_path)
    lines = [json.loads(x) for x in proc.stdout.splitlines() if x.startswith("{")]
    escaped = [x for x in lines if "case" in x]
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert lines and lines[-1].get("done", 0) >= 2000, proc.stderr[-3000:]
    assert not escaped, json.dumps(escaped[:5], indent=1)


def _capture(path: Path) -> bytes:
    b = Builder().proc(100, "python").device(100)
    for i in range(3):
        b.op(100, 101, i * 10, i * 10 + 1, i * 10 + 5)
    b.syscall(100, 101, "read", 50, 60, obj="/x")
    return b.write(path).read_bytes()


@pytest.mark.parametrize("head", [b"\xdb\xff\xff\xff\xf0", b"\xc6\xff\xff\xff\xf0", b"\xdd\x7f\xff\xff\xff"],
                         ids=["str32", "bin32", "array32"])
def test_a_huge_length_mid_file_costs_only_its_frame(tmp_path: Path, head: bytes) -> None:
    good = _capture(tmp_path / "good.gputrace")
    frames = list(msgpack.Unpacker(__import__("io").BytesIO(good), raw=False, strict_map_key=False))
    kernels_at = next(i for i, f in enumerate(frames) if f[:2] == ["R", "GpuKernel"])
    cut = sum(len(msgpack.packb(f, use_bin_type=True)) for f in frames[:kernels_at])
    bad = tmp_path / "bad.gputrace"
    bad.write_bytes(good[:cut] + head + good[cut:])
    with CaptureReader(bad) as r:
        records = list(r.records())
        assert r.problem.startswith(f"corrupt frame at byte {cut}")
        assert r.trailer is not None and not r.complete  # the trailer, after the damage, was read
    assert sum(isinstance(x, GpuKernel) for x in records) == 3  # the frames after it are all there
    assert sum(isinstance(x, Syscall) for x in records) == 1


def test_wrong_typed_rows_are_counted_and_the_rest_of_their_frame_read(tmp_path: Path) -> None:
    from gputrace.capture import CaptureWriter, host_header

    w = CaptureWriter(tmp_path / "c.gputrace", host_header(["t"]))
    w.write_rows("GpuKernel", [[1, 0, 1, 7, "soon", 5, 1, "k", [1, 1, 1], [1, 1, 1]],
                               [1, 0, 1, 7, 2, 5, 2, "k", [1, 1, 1], [1, 1, 1]]])
    w.close({"end_ns": 9})
    with CaptureReader(tmp_path / "c.gputrace") as r:
        kernels = [x for x in r.records() if isinstance(x, GpuKernel)]
        assert [k.correlation_id for k in kernels] == [2] and r.malformed == 1


def test_report_of_a_killed_capture_names_its_cut_off_file(tmp_path: Path) -> None:
    partial = tmp_path / ".run.gputrace.999999999.partial"  # a pid no process has
    _capture(partial)
    with pytest.raises(UserError, match=r"cut off .*gputrace report .*\.run\.gputrace\.999999999\.partial"):
        open_capture(tmp_path / "run.gputrace")
    proc = subprocess.run([sys.executable, "-m", "gputrace", "report", str(tmp_path / "run.gputrace")],
                          capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.count("\n") == 1 and ".run.gputrace.999999999.partial" in proc.stderr
