"""Watch mode's discovery (daemon/watch/discover.py) on real processes: an armed Python interpreter is a GPU
process; the other programs an armed service starts inherit its environment (a shell, ``sleep``) and are not,
as the arming does nothing in them; an interpreter that is not armed is not either, nor one a capture session
traces already, nor gputrace's own command line."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from waiting import wait_for

from gputrace.agent import arming
from gputrace.daemon.watch.discover import Scanner, gpu_evidence


@contextmanager
def _running(argv: list[str], env: dict[str, str]) -> Iterator[subprocess.Popen[bytes]]:
    """``argv`` started with ``env``, once it runs its own program (exec done: its command line is ``argv``, not
    the forking test's), killed afterwards."""
    p = subprocess.Popen(argv, env=env, stdin=subprocess.PIPE)
    want = b"\0".join(a.encode() for a in argv) + b"\0"

    def cmdline() -> bytes:
        with open(f"/proc/{p.pid}/cmdline", "rb") as f:
            return f.read()

    try:
        wait_for(lambda: cmdline() == want, 30, f"{argv[0]} to run")
        yield p
    finally:
        p.kill()
        p.wait()


def test_arming_is_evidence_only_in_a_python_interpreter() -> None:
    armed = {**os.environ, **arming.environment(None)}
    python = [sys.executable, "-c", "import sys; sys.stdin.read()"]
    with (_running(python, armed) as interpreter, _running(["sleep", "600"], armed) as sleeper,
          _running(["sh", "-c", "read x"], armed) as shell, _running(python, dict(os.environ)) as plain):
        assert gpu_evidence(interpreter.pid) == "armed"
        assert [gpu_evidence(p.pid) for p in (sleeper, shell, plain)] == ["", "", ""]
        found = {f.pid: f.how for f in Scanner().scan()}
        assert found.get(interpreter.pid) == "armed"
        assert not {sleeper.pid, shell.pid, plain.pid} & set(found), found


def test_a_process_its_capture_session_traces_is_not_a_job_until_that_session_ends(tmp_path: Path) -> None:
    # `gputrace capture -- CMD` gives CMD its session's socket to connect its agent to: while the session
    # listens there, CMD is traced already (watching it too would trace it twice); once it has ended, CMD is
    # judged as any other process
    path = tmp_path / "session.sock"
    session = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    session.bind(str(path))
    session.listen(8)
    env = {**os.environ, **arming.environment(str(path))}
    with _running([sys.executable, "-c", "import sys; sys.stdin.read()"], env) as job:
        try:
            assert gpu_evidence(job.pid) == ""
            assert job.pid not in {f.pid for f in Scanner().scan()}
        finally:
            session.close()
            path.unlink()
        assert gpu_evidence(job.pid) == "armed"


def test_gputraces_own_command_line_is_not_a_job_though_armed(tmp_path: Path) -> None:
    # run from an armed shell, `gputrace capture -- CMD` inherits the arming: as a job it would take in CMD,
    # which its capture traces
    armed = {**os.environ, **arming.environment(None)}
    script = tmp_path / "gputrace"  # what the console script is called
    script.write_text("import sys; sys.stdin.read()\n")
    module = tmp_path / "gputrace_like"
    module.mkdir()
    (module / "__main__.py").write_text("import sys; sys.stdin.read()\n")
    path = {**armed, "PYTHONPATH": f"{tmp_path}:{armed['PYTHONPATH']}"}
    with (_running([sys.executable, str(script)], armed) as cli,
          _running([sys.executable, "-m", "gputrace_like"], path) as other):
        assert gpu_evidence(cli.pid) == ""
        assert gpu_evidence(other.pid) == "armed"  # another module of a like name is a job as any
