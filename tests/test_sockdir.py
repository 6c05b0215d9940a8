"""Agent-socket directories of killed sessions: removed by the next session, and only those."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from gputrace.daemon.agents.sockdir import MODE, make_socket_dir, remove_stale_socket_dirs

pytestmark = pytest.mark.kernel  # root and the host's kernel (see tests/conftest.py)

GPUTRACE = [sys.executable, "-m", "gputrace"]
TMP = Path(tempfile.gettempdir())


def _ns() -> int:
    return os.stat("/proc/self/ns/pid").st_ino


def _start(pid: int) -> int:
    text = Path(f"/proc/{pid}/stat").read_text()
    return int(text[text.rfind(")") + 2:].split()[19])


def _dead_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()  # reaped: the pid names no process now
    return p.pid


def _session_dir(base: Path, pid: int, start: int, *, ns: int | None = None, mode: int = MODE,
                 sock: bool = True, tag: str = "abcdefgh") -> Path:
    d = base / f"gputrace-agent.{ns if ns is not None else _ns()}.{pid}.{start}.{tag}"
    d.mkdir()
    os.chmod(d, mode)
    if sock:
        s = socket.socket(socket.AF_UNIX)
        s.bind(str(d / "agent.sock"))
        s.close()  # the file stays, as a killed session leaves it
    return d


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A private directory with a path short enough for a socket below two more levels (108 bytes)."""
    d = Path(tempfile.mkdtemp(prefix="gt-"))
    yield d
    shutil.rmtree(d)


def test_only_dead_sessions_own_dirs_are_removed(short_tmp: Path) -> None:
    tmp_path = short_tmp
    base = tmp_path / "tmp"
    base.mkdir()
    dead = _dead_pid()
    gone = _session_dir(base, dead, 12345, tag="gone0000")
    reused = _session_dir(base, os.getppid(), 1, tag="reused00")  # a live pid, but a later process than the name's
    live = _session_dir(base, os.getppid(), _start(os.getppid()), tag="live0000")
    other_ns = _session_dir(base, dead, 12345, ns=_ns() + 1, tag="otherns0")
    wrong_mode = _session_dir(base, dead, 12345, mode=0o755, tag="mode0000")
    foreign = _session_dir(base, dead, 12345, tag="foreign0")
    os.chown(foreign, 65534, 65534)
    extra = _session_dir(base, dead, 12345, tag="extra000")
    (extra / "notes.txt").write_text("not a session's")
    pending = _session_dir(base, dead, 12345, tag="pending0")
    (pending / f"inject-{os.getppid()}.py").write_text("")  # its process lives: the script may still be run
    done = _session_dir(base, dead, 12345, tag="scriptdn")
    (done / f"inject-{dead}.py").write_text("")
    target = _session_dir(base, dead, 12345, tag="target00")
    target.rename(tmp_path / "elsewhere")
    link = base / f"gputrace-agent.{_ns()}.{dead}.12345.linkxxxx"
    link.symlink_to(tmp_path / "elsewhere")
    lookalike = base / f"gputrace-{dead}-abcdefgh"
    lookalike.mkdir(mode=MODE)

    removed = remove_stale_socket_dirs(str(base))

    assert sorted(removed) == sorted([gone.name, reused.name, done.name])
    assert not gone.exists() and not reused.exists() and not done.exists()
    for kept in (live, other_ns, wrong_mode, foreign, extra, pending, lookalike):
        assert kept.is_dir(), kept.name
    assert (extra / "agent.sock").exists(), "a directory kept is kept whole"
    assert link.is_symlink() and (tmp_path / "elsewhere" / "agent.sock").exists(), "a link is never followed"


def test_own_dir_is_named_after_this_process(tmp_path: Path) -> None:
    d = make_socket_dir(str(tmp_path))
    m = re.fullmatch(r"gputrace-agent\.(\d+)\.(\d+)\.(\d+)\.[a-z0-9_]{8}", d.name)
    assert m and (int(m[1]), int(m[2]), int(m[3])) == (_ns(), os.getpid(), _start(os.getpid()))
    assert d.stat().st_mode & 0o7777 == MODE
    assert remove_stale_socket_dirs(str(tmp_path)) == [] and d.is_dir(), "this process's own directory stays"


def _start_capture(tmp_path: Path, name: str) -> tuple[subprocess.Popen[str], int, Path]:
    """`gputrace capture -- sleep 600` up to its "tracing" line: (capture, command pid, socket directory)."""
    cap = subprocess.Popen(GPUTRACE + ["capture", "-o", f"{name}.gputrace", "--", "sleep", "600"], cwd=tmp_path,
                           stderr=subprocess.PIPE, text=True)
    assert cap.stderr is not None
    while not (line := cap.stderr.readline()).startswith("gputrace: tracing pid"):
        assert line, f"capture {name} ended before tracing"
    child = int(line.split()[3].rstrip(":"))
    dirs = list(TMP.glob(f"gputrace-agent.{_ns()}.{cap.pid}.*"))
    assert len(dirs) == 1, dirs
    return cap, child, dirs[0]


def test_killed_capture_dir_removed_by_the_next(tmp_path: Path) -> None:
    killed, killed_child, killed_dir = _start_capture(tmp_path, "killed")
    live, live_child, live_dir = _start_capture(tmp_path, "live")
    try:
        killed.kill()
        killed.wait()
        os.kill(killed_child, signal.SIGKILL)  # the capture's command outlives it; nothing else is about it
        assert (killed_dir / "agent.sock").exists(), "SIGKILL leaves the directory (what this test is about)"

        r = subprocess.run(GPUTRACE + ["capture", "-o", "next.gputrace", "--", "true"], cwd=tmp_path,
                           capture_output=True, text=True, timeout=180)
        assert r.returncode == 0, r.stderr
        assert "killed session(s): " in r.stderr and killed_dir.name in r.stderr, r.stderr
        assert not killed_dir.exists()
        assert (live_dir / "agent.sock").exists(), "a live session's directory stays"
    finally:
        for pid in (killed_child, live_child):  # the live capture ends with its command
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        killed.kill()
        live.communicate(timeout=120)
    assert not live_dir.exists(), "the live session removed its own directory when it ended"
