"""A full disk under any output: one line on stderr that names the file, and nothing half-written left
under its name. Real small filesystems (tmpfs mounted by the test), real `gputrace` processes."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from workloads.loopdev import small_tmpfs

from gputrace.testing.synth import Builder

pytestmark = pytest.mark.kernel  # root and the host's kernel (see tests/conftest.py)

GPUTRACE = [sys.executable, "-m", "gputrace"]
TRAINER = 100
NOSPACE = "No space left on device"



def _run(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(GPUTRACE + list(args), cwd=cwd, capture_output=True, text=True, timeout=180)


def _errors(stderr: str) -> list[str]:
    assert "Traceback" not in stderr, stderr
    return [line for line in stderr.splitlines() if "error" in line]


def _synthetic(path: Path, ops: int = 3000) -> Path:
    """A capture whose Perfetto trace and report page are far larger than 64 KiB."""
    b = Builder().proc(TRAINER, "python").device(TRAINER)
    for i in range(ops):
        b.op(TRAINER, TRAINER, i * 3, i * 3, i * 3 + 1, f"kernel_{i}")
    return b.write(path)


def test_capture_whose_perfetto_trace_finds_no_room(tmp_path: Path) -> None:
    """The capture fits; the disk is full (no inode left) when its .pftrace is made."""
    with small_tmpfs(tmp_path / "tiny", size="64m", inodes=2) as tiny:
        r = _run("capture", "-o", "tiny/run.gputrace", "--", sys.executable, "-c", "print('ok')", cwd=tmp_path)
        left = sorted(p.name for p in tiny.iterdir())
    assert r.returncode == 0, r.stderr  # -- CMD: the command's exit code, as for a capture cut off
    assert _errors(r.stderr) == [
        f"gputrace: error: writing tiny/run.pftrace: {NOSPACE}; nothing was written under that name (the capture "
        "tiny/run.gputrace is whole: `gputrace export tiny/run.gputrace --perfetto tiny/run.pftrace` writes the "
        "trace where there is room)"]
    assert left == ["run.gputrace"]


def test_capture_cut_off_by_a_full_disk(tmp_path: Path) -> None:
    """A process making system calls without end, every one recorded: the capture fills the disk and ends."""
    busy = subprocess.Popen([sys.executable, "-c", "import os\nwhile True: os.stat('/')"])
    try:
        with small_tmpfs(tmp_path / "tiny", size="64k") as tiny:
            r = _run("capture", "-p", str(busy.pid), "--syscall-threshold-us", "0", "-o", "tiny/run.gputrace",
                     "--no-perfetto", cwd=tmp_path)
            left = sorted(p.name for p in tiny.iterdir())
    finally:
        busy.kill()
        busy.wait()
    assert r.returncode == 2, r.stderr
    errors = _errors(r.stderr)
    assert len(errors) == 1 and errors[0].startswith(
        f"gputrace: error: writing tiny/run.gputrace: {NOSPACE}; the capture is cut off there: "), errors
    assert left == ["run.gputrace"]


def test_export_perfetto_to_a_full_disk(tmp_path: Path) -> None:
    cap = _synthetic(tmp_path / "run.gputrace")
    with small_tmpfs(tmp_path / "tiny", size="64k") as tiny:
        r = _run("export", str(cap), "--perfetto", "tiny/out.pftrace", cwd=tmp_path)
        left = list(tiny.iterdir())
    assert r.returncode == 2
    assert _errors(r.stderr) == [f"gputrace: error: writing tiny/out.pftrace: {NOSPACE}; nothing was written under "
                                 "that name"]
    assert left == []


def test_report_html_to_a_full_disk(tmp_path: Path) -> None:
    cap = _synthetic(tmp_path / "run.gputrace")
    with small_tmpfs(tmp_path / "tiny", size="64k") as tiny:
        r = _run("report", str(cap), "--html", "tiny/r.html", cwd=tmp_path)
        left = list(tiny.iterdir())
    assert r.returncode == 2
    assert _errors(r.stderr) == [f"gputrace: error: writing tiny/r.html: {NOSPACE}"]
    assert left == []
