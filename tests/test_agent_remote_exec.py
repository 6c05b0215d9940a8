"""The agent injected into running, unarmed Python 3.14 processes with the real ``sys.remote_exec``: on the
host (as root's target and as another user's), and in a container (its own root, mount and pid namespaces)
that cannot see the session's socket, its files or gputrace. The interpreter is Debian's python3.14, which
``./setup.sh --test`` unpacks into build/python3.14."""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from agent_harness import Harness, clean_env, of
from waiting import wait_for

from gputrace.daemon.attach import inject, nsexec
from gputrace.errors import UserError
from gputrace.probes import procfs

pytestmark = pytest.mark.kernel  # root and the host's kernel (see tests/conftest.py)

ROOT = Path(__file__).resolve().parents[1]
PY314_ROOT = ROOT / "build" / "python3.14"
PY314 = PY314_ROOT / "usr" / "bin" / "python3.14"
NOBODY = 65534

# Runs Python bytecode all the time (sys.remote_exec runs the script at the next bytecode boundary), and
# on a line from stdin imports gputrace.sim (its own, or the one the agent brought), launches, syncs.
WORKLOAD = """
import sys, threading, time
print("up", flush=True)
def tick():
    while True:
        sum(range(100)); time.sleep(0.005)
threading.Thread(target=tick, daemon=True).start()
for line in sys.stdin:
    from gputrace.agent import arming
    deadline = time.monotonic() + 10
    while not arming.current().connected and time.monotonic() < deadline:
        time.sleep(0.01)
    from gputrace.sim import Device
    s = Device(0).stream()
    s.launch(line.strip(), duration_ms=20)
    s.synchronize()
    print("done", flush=True)
"""


@pytest.fixture(scope="module")
def py314() -> Path:
    assert PY314.is_file(), f"{PY314} is missing: run ./setup.sh --test (it unpacks Debian's python3.14 there)"
    return PY314


def _spawn(argv: list[str], *, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    p = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=env if env is not None else clean_env())
    assert p.stdout is not None and p.stdout.readline().strip() == "up", p.stderr.read() if p.stderr else ""
    return p


def _go(p: subprocess.Popen[str], kernel: str) -> None:
    assert p.stdin is not None and p.stdout is not None
    p.stdin.write(kernel + "\n")
    p.stdin.flush()
    assert p.stdout.readline().strip() == "done"


def _stop(p: subprocess.Popen[str]) -> str:
    p.kill()
    _, err = p.communicate(timeout=10)
    return err


def test_capture_pid_injects_a_running_python_3_14(tmp_path: Path, py314: Path) -> None:
    """What a user types: gputrace capture --pid of an unarmed 3.14 process using the (simulated) GPU."""
    work = tmp_path / "loop.py"
    work.write_text("""
import time
from gputrace.sim import Device
s = Device(0).stream()
print("up", flush=True)
i = 0
while True:
    s.launch(f"step{i % 3}", duration_ms=5)
    s.synchronize()
    time.sleep(0.01)
    i += 1
""")
    p = _spawn([str(py314), str(work)], env=clean_env(PYTHONPATH=str(ROOT)))
    try:
        out = tmp_path / "cap.gputrace"
        done = subprocess.run([sys.executable, "-m", "gputrace", "capture", "--pid", str(p.pid), "-o", str(out),
                               "--duration", "3", "--no-perfetto"], capture_output=True, text=True, timeout=120,
                              cwd=ROOT)
        assert done.returncode == 0, done.stderr
        assert f"GPU agent of pid {p.pid}: injected" in done.stderr and "never connected" not in done.stderr
        from gputrace.capture import CaptureReader

        with CaptureReader(out) as reader:
            recs = list(reader.records())
        kernels = of(recs, "GpuKernel")
        assert len(kernels) > 20 and {k.pid for k in kernels} == {p.pid}
        assert {k.name for k in kernels} == {"step0", "step1", "step2"}
        assert all(4e6 <= k.end_ns - k.start_ns <= 6e6 for k in kernels)  # 5 ms each, within 20 %
        assert [d.pid for d in of(recs, "GpuDevice")] == [p.pid]
    finally:
        assert "Traceback" not in _stop(p)


def test_a_target_without_gputrace_runs_the_agent_it_was_sent(py314: Path, request: pytest.FixtureRequest) -> None:
    """Another user's process that cannot import gputrace: the script brings the agent's modules, and the
    helper runs as that user, with no capabilities (checked on the helper itself, through nsexec)."""
    shared = Path(tempfile.mkdtemp(prefix="gputrace-test-"))  # as the session's: the target must reach it
    os.chmod(shared, 0o711)
    request.addfinalizer(lambda: shutil.rmtree(shared))
    h = Harness(shared)
    p = _spawn(["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", str(py314), "-c", WORKLOAD])
    h.allowed.add(p.pid)
    try:
        assert h.server.attach(p.pid) == "injected"
        script = shared / f"inject-{p.pid}.py"
        assert oct(script.stat().st_mode)[-3:] == "644"
        _go(p, "after_attach")
        status = subprocess.run(nsexec.argv_for(p.pid, ["/bin/cat", "/proc/self/status"]), capture_output=True,
                                text=True, timeout=30)
        assert status.returncode == 0, status.stderr
        fields = dict(line.split(":", 1) for line in status.stdout.splitlines())
        assert fields["Uid"].split() == [str(NOBODY)] * 4 and fields["Groups"].strip() == ""
        assert int(fields["CapEff"], 16) == 0 and int(fields["CapPrm"], 16) == 0
        assert fields["NoNewPrivs"].strip() == "1"
        # Under Yama, a root-owned interpreter gets CAP_SYS_PTRACE and nothing else, kept across exec.
        ptrace = subprocess.run(nsexec.argv_for(p.pid, ["/bin/cat", "/proc/self/status"], ptrace=True),
                                capture_output=True, text=True, timeout=30)
        assert ptrace.returncode == 0, ptrace.stderr
        fields = dict(line.split(":", 1) for line in ptrace.stdout.splitlines())
        assert fields["Uid"].split() == [str(NOBODY)] * 4
        assert {k: int(fields[k], 16) for k in ("CapEff", "CapPrm", "CapAmb")} == dict.fromkeys(
            ("CapEff", "CapPrm", "CapAmb"), 1 << nsexec.CAP_SYS_PTRACE)
        wait_for(lambda: h.server.stats["records"] >= 3, what="the agent's records")
    finally:
        err = _stop(p)
    recs = h.finish()
    assert "Traceback" not in err and not h.server.rejections
    assert [(k.name, k.pid) for k in of(recs, "GpuKernel")] == [("after_attach", p.pid)]
    assert [(a.pid, a.source) for a in of(recs, "AgentInfo")] == [(p.pid, "sim")]


CONTAINER = r"""
set -e
root=$1; py=$2; work=$3
mount --make-rprivate /
mount -t tmpfs container "$root"
for d in usr etc; do mkdir "$root/$d"; mount --rbind "/$d" "$root/$d"; mount -o remount,bind,ro "$root/$d"; done
for d in bin sbin lib lib64; do [ -L "/$d" ] && ln -s "$(readlink "/$d")" "$root/$d" || true; done
mkdir -p "$root$py" "$root/proc" "$root/tmp" "$root/app"
mount --bind "$py" "$root$py"
mount -t proc proc "$root/proc"
cp "$work" "$root/app/work.py"
exec chroot "$root" "$py/usr/bin/python3.14" /app/work.py
"""


@pytest.fixture(params=["rootful", "rootless"])
def container(request: pytest.FixtureRequest, py314: Path) -> Iterator[tuple[subprocess.Popen[str], int, Path]]:
    """WORKLOAD as pid 1 of its own pid and mount namespaces, chrooted into a tmpfs holding only /usr, /etc,
    the interpreter and itself: the unshare process, the workload's host pid, the root it sees. Rootless:
    started by nobody, in a user namespace of its own where it is root (as podman or apptainer do)."""
    base = Path(tempfile.mkdtemp(prefix="gputrace-container-"))
    os.chmod(base, 0o755)  # nobody makes its root here
    request.addfinalizer(lambda: shutil.rmtree(base))
    work = base / "work.py"
    work.write_text(WORKLOAD)
    root = base / "root"
    root.mkdir()
    user = []
    if request.param == "rootless":
        user = ["setpriv", f"--reuid={NOBODY}", f"--regid={NOBODY}", "--clear-groups", "unshare", "--user",
                "--map-root-user"]
    p = subprocess.Popen([*user, "unshare", "--mount", "--pid", "--fork", "bash", "-c", CONTAINER, "container",
                          str(root), str(PY314_ROOT), str(work)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=clean_env())
    assert p.stdout is not None and p.stdout.readline().strip() == "up", p.stderr.read() if p.stderr else ""
    host_pid = wait_for(lambda: next((d for d in procfs.descendants(p.pid) if procfs.comm(d) == "python3.14"), 0),
                        what="the workload (below unshare, or the unshare a user namespace's unshare ran)")
    try:
        yield p, host_pid, Path(f"/proc/{host_pid}/root")
    finally:
        os.kill(host_pid, signal.SIGKILL)  # pid 1 of the namespace: everything in it goes along
        p.communicate(timeout=10)


def test_a_process_in_a_container_gets_socket_script_and_agent_inside(
        tmp_path: Path, container: tuple[subprocess.Popen[str], int, Path]) -> None:  # fmt: skip
    p, host_pid, root = container
    attach = tmp_path / "attach"
    h = Harness(tmp_path, attach_dir=str(attach))
    h.allowed.add(host_pid)
    assert not (root / "app" / "gputrace").exists() and not (root / str(ROOT / "gputrace").lstrip("/")).exists()
    assert h.server.attach(host_pid) == "injected"
    inside = root / str(attach).lstrip("/")
    assert sorted(os.listdir(inside)) == ["1.sock", "inject-1.py"]  # named by its own pid, 1
    assert not attach.exists()  # nothing was made on the host side
    # The helper ran in there too: pid 1 is the workload, and / is the container's.
    ls = subprocess.run(nsexec.argv_for(host_pid, ["/bin/sh", "-c", "ls /; cat /proc/1/cmdline"]),
                        capture_output=True, text=True, timeout=30)
    assert ls.returncode == 0, ls.stderr
    top = {"app", "bin", "etc", "lib", "lib64", "proc", "sbin", "tmp", "usr", PY314_ROOT.parts[1], attach.parts[1]}
    assert set(ls.stdout.split()[:-1]) == top
    assert "/app/work.py" in ls.stdout.split()[-1]
    _go(p, "in_container")
    wait_for(lambda: h.server.stats["records"] >= 3, what="the agent's records")
    h.server.stop()
    assert os.listdir(inside) == []  # socket and script removed at the end
    recs = h.finish()
    assert not h.server.rejections
    kernels = of(recs, "GpuKernel")
    assert [(k.name, k.pid) for k in kernels] == [("in_container", host_pid)]  # the host's pid, not 1
    launch = next(a for a in of(recs, "CudaApi") if a.correlation_id == kernels[0].correlation_id)
    assert launch.pid == host_pid and launch.tid == host_pid


def test_a_helper_that_hangs_is_killed_with_everything_it_started(tmp_path: Path, py314: Path,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    work = tmp_path / "work.py"
    work.write_text(WORKLOAD)
    p = _spawn([str(py314), str(work)])
    marker = f"gputrace-hang-{os.getpid()}"
    monkeypatch.setattr(inject, "HELPER_TIMEOUT_S", 1.0)
    hang = f"(exec -a {marker} sleep 60) & exec -a {marker} sleep 60"  # the helper, and one it started
    monkeypatch.setattr(nsexec, "argv_for", lambda pid, argv, **kw: ["bash", "-c", hang])
    try:
        t0 = time.monotonic()
        with pytest.raises(UserError, match=r"did not return within 1 s"):
            inject.inject(p.pid, str(tmp_path / "agent.sock"))
        assert time.monotonic() - t0 < 5
        time.sleep(0.2)
        left = subprocess.run(["pgrep", "-f", marker], capture_output=True, text=True).stdout.split()
        assert left == []
    finally:
        _stop(p)


def test_only_an_interpreter_only_root_can_change_is_trusted(tmp_path: Path,
                                                              request: pytest.FixtureRequest) -> None:
    assert nsexec.trusted_binary(os.path.realpath("/usr/bin/python3"))
    d = Path(tempfile.mkdtemp(dir="/run"))  # root's all the way up
    request.addfinalizer(lambda: shutil.rmtree(d))
    exe = d / "python3.14"
    exe.write_bytes(b"")
    assert nsexec.trusted_binary(str(exe))
    os.chmod(d, 0o775)
    assert not nsexec.trusted_binary(str(exe))  # a group may swap it
    os.chmod(d, 0o755)
    os.chown(exe, NOBODY, NOBODY)
    assert not nsexec.trusted_binary(str(exe))
    mine = tmp_path / "python3.14"
    mine.write_bytes(b"")
    assert not nsexec.trusted_binary(str(mine)) or not os.stat("/tmp").st_mode & 0o002  # below a sticky /tmp
    assert not nsexec.trusted_binary("relative/python3.14") and not nsexec.trusted_binary("/nonexistent/python")
    creds = nsexec.Credentials.parse(Path("/proc/self/status").read_text())
    assert creds.uids == (0, 0, 0) and creds.permitted >> nsexec.CAP_SYS_PTRACE & 1
    theirs = nsexec.Credentials((5, 5, 5), (6, 6, 6), (7,), 0, 1 << 40 | 1, 3, (1 << 41) - 1)
    less = theirs.limited_to(nsexec.Credentials((0, 0, 0), (0, 0, 0), (), 0, 1, 1, 1))
    assert (less.permitted, less.effective, less.bounding) == (1, 1, 1) and less.uids == (5, 5, 5)
    assert re.fullmatch(r"\d+", str(less.groups[0]))


def test_a_failed_injection_leaves_nothing_in_the_container(
        tmp_path: Path, container: tuple[subprocess.Popen[str], int, Path],
        monkeypatch: pytest.MonkeyPatch) -> None:  # fmt: skip
    _, host_pid, root = container
    attach = tmp_path / "attach"
    h = Harness(tmp_path, attach_dir=str(attach))

    def refused(exe: str, pid: int, script: Path) -> None:
        assert (root / str(script).lstrip("/")).is_file()  # written, then the helper fails
        raise UserError(f"pid {pid}: sys.remote_exec failed: refused for the test")

    monkeypatch.setattr(inject, "run_helper", refused)
    with pytest.raises(UserError, match="refused for the test"):
        h.server.attach(host_pid)
    assert os.listdir(root / str(attach).lstrip("/")) == []
    h.finish()


def test_an_injected_agent_that_never_runs_is_reported(tmp_path: Path, py314: Path) -> None:
    """A main thread asleep in C for the whole capture never runs the script: the capture says so. When it
    wakes, after the capture, it runs the script, which must still be there: nothing in the job's stderr."""
    code = ("import sys, time\nprint('up', flush=True)\nsys.stdin.readline()\n"  # asleep in C until told
            "for _ in range(100):\n    time.sleep(0.01)\nprint('woke', flush=True)\n")
    p = _spawn([str(py314), "-c", code])
    try:
        done = subprocess.run([sys.executable, "-m", "gputrace", "capture", "--pid", str(p.pid), "-o",
                               str(tmp_path / "cap.gputrace"), "--duration", "2", "--no-perfetto"],
                              capture_output=True, text=True, timeout=120, cwd=ROOT)  # fmt: skip
        assert done.returncode == 0, done.stderr
        assert f"GPU agent of pid {p.pid}: injected" in done.stderr
        assert f"pid {p.pid}: the GPU agent was injected but never connected: sys.remote_exec" in done.stderr
        assert "its script stays at" in done.stderr
        out, err = p.communicate("go\n", timeout=30)  # wakes, runs the pending script, finds no session
        assert p.returncode == 0 and out.strip() == "woke" and err == "", err
    finally:
        if p.poll() is None:
            _stop(p)


def test_without_cap_sys_admin_a_container_is_refused_with_the_way_out(
        container: tuple[subprocess.Popen[str], int, Path]) -> None:  # fmt: skip
    """As under gputraced, which does not keep CAP_SYS_ADMIN: entering a container is impossible, said so."""
    _, host_pid, _ = container
    code = ("from gputrace.daemon.attach import inject\nfrom gputrace.errors import UserError\n"
            f"try:\n    inject.inject({host_pid}, '/run/none/agent.sock')\nexcept UserError as e:\n    print(e)\n")
    r = subprocess.run(["setpriv", "--bounding-set=-sys_admin", sys.executable, "-c", code], capture_output=True,
                       text=True, timeout=60, cwd=ROOT)
    assert r.stdout.strip() == (f"pid {host_pid} runs in a container, and entering it needs CAP_SYS_ADMIN, which this "
                                "process does not hold (gputraced does not keep it): run `sudo gputrace capture -p "
                                f"{host_pid}`, or start it armed"), r.stderr
