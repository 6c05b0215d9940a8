"""Injection into a running, unarmed process: every reason it cannot work is one clear line."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from agent_harness import Harness, clean_env, of

from gputrace.agent import arming
from gputrace.daemon.attach import inject
from gputrace.errors import UserError

pytestmark = pytest.mark.kernel  # root and the host's kernel (see tests/conftest.py)


def _start(argv: list[str]) -> subprocess.Popen[bytes]:
    p = subprocess.Popen(argv, stdout=subprocess.PIPE)
    assert p.stdout is not None and p.stdout.readline()  # running, past interpreter start-up
    return p


def test_sys_remote_exec_is_refused_before_3_14_and_says_why(tmp_path: Path) -> None:
    p = _start([sys.executable, "-c", "import time; print('up', flush=True); time.sleep(60)"])
    try:
        with pytest.raises(UserError) as e:
            inject.inject(p.pid, str(tmp_path / "agent.sock"), method="sys.remote_exec")
        ver = f"{sys.version_info.major}.{sys.version_info.minor}"
        msg = str(e.value)
        assert f"pid {p.pid} runs Python {ver}" in msg and ">= 3.14" in msg and "sys.remote_exec" in msg
        assert "\n" not in msg
        assert not list(tmp_path.iterdir()), "nothing is written when refusing"
    finally:
        p.kill()
        p.wait()


def test_attach_offers_to_an_armed_process_and_injects_an_unarmed_one(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    clean = {k: v for k, v in os.environ.items() if not k.startswith("GPUTRACE_")}
    armed_env = {**clean, **arming.environment(None, base=clean), "GPUTRACE_ATTACH_DIR": str(tmp_path / "attach")}
    code = "import time; print('up', flush=True); time.sleep(60)"
    armed = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, env=armed_env)
    plain = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, env=clean)
    try:
        for p in (armed, plain):
            assert p.stdout is not None and p.stdout.readline()
        assert arming.is_armed(armed.pid) and not arming.is_armed(plain.pid)
        assert h.server.attach(armed.pid) == "offered"
        assert (tmp_path / "attach" / f"{armed.pid}.sock").is_socket()
        assert h.server.attach(plain.pid) == "injected"  # Python < 3.14: by ptrace (test_agent_pyattach.py)
        assert h.server.injections[plain.pid].method == "ptrace"
    finally:
        for p in (armed, plain):
            p.kill()
            p.wait()
        h.finish()


def test_refuses_a_process_that_is_not_python(tmp_path: Path) -> None:
    p = _start(["sh", "-c", "echo up; exec sleep 60"])
    try:
        with pytest.raises(UserError, match=f"pid {p.pid} is not a Python process"):
            inject.inject(p.pid, str(tmp_path / "agent.sock"))
    finally:
        p.kill()
        p.wait()


def test_refuses_a_pid_that_does_not_exist(tmp_path: Path) -> None:
    with pytest.raises(UserError, match="no process with pid 999999999"):
        inject.inject(999_999_999, str(tmp_path / "agent.sock"))


def test_version_is_read_from_the_interpreter_name_or_libpython() -> None:
    assert inject.python_version(1, "/usr/bin/python3.14") == (3, 14)
    assert inject.python_version(1, "/opt/py/bin/python3.13t") == (3, 13)


def test_the_injected_script_attaches_an_unarmed_process(tmp_path: Path) -> None:
    """What sys.remote_exec would run in the target, run here by the target itself on request."""
    h = Harness(tmp_path)
    env = clean_env()
    p = h.spawn("""
import sys
from gputrace.sim import Device
s = Device(0).stream()
s.launch("before_attach", duration_ms=1)
s.synchronize()
print("up", flush=True)
exec(compile(open(sys.stdin.readline().strip()).read(), "injected", "exec"))
import time
from gputrace.agent import arming
deadline = time.monotonic() + 10
while not arming.current().connected and time.monotonic() < deadline:
    time.sleep(0.01)
s.launch("after_attach", duration_ms=1)
s.synchronize()
arming.current().close(20)  # its records sent before it exits (at exit: 2 s at most, short beside a CPU hog)
print("done", flush=True)
""", env=env, stdin=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "up"
    script = inject.write_script(p.pid, str(h.server.sock_path))
    assert script.parent == tmp_path and oct(script.stat().st_mode)[-3:] == "644"
    out, err = p.communicate(input=f"{script}\n", timeout=20)
    assert out.strip() == "done", err
    recs = h.finish()
    assert [k.name for k in of(recs, "GpuKernel")] == ["after_attach"]
    assert [d.pid for d in of(recs, "GpuDevice")] == [p.pid]
