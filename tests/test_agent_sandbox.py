"""Injecting the agent from a sandbox like gputraced's unit (systemd/gputraced.service): a mount, network and
UTS namespace of its own, / read-only but for the directory it may write, a private tmpfs on /tmp, and no
CAP_SYS_ADMIN. A host process shares none of those namespaces with it, yet is no container: the helper must
not try to enter the host's namespaces (it cannot), it runs in the sandbox's. A process in a real container
(its own mount and pid namespaces) is still entered, and refused where CAP_SYS_ADMIN is missing.

All real: namespaces made with unshare, Debian's python3.14 (``./setup.sh --test``), the real
``sys.remote_exec``, real captures. The host is one of the test's own: a pid namespace whose pid 1 (a root
``sleep``) lives in the namespaces the targets are started in. That is what the code compares with (pid 1's
namespaces are the host's); the VMs these tests run on hide their real pid 1's namespaces even from root,
where the code keeps treating every namespace unlike its own as a container's."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from agent_harness import clean_env, of
from test_agent_remote_exec import CONTAINER  # its own root, pid and mount namespaces; no gputrace inside
from waiting import wait_for

from gputrace.capture import CaptureReader
from gputrace.probes import procfs

pytestmark = pytest.mark.kernel  # root and the host's kernel (see tests/conftest.py)

ROOT = Path(__file__).resolve().parents[1]
PY314_ROOT = ROOT / "build" / "python3.14"
PY314 = PY314_ROOT / "usr" / "bin" / "python3.14"
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]

# The unit's sandbox, as far as it matters here: PrivateMounts (a mount namespace), PrivateNetwork, ProtectHostname
# (a UTS namespace), ProtectSystem=strict with ReadWritePaths=$rw, PrivateTmp. The repository (gputrace and the
# test's python3.14) stays where it is when it lives below /tmp, as an installed gputrace would be.
SANDBOX = r"""
set -e
rw=$1; repo=$2; shift 2
mount --make-rprivate /
mount --bind "$rw" "$rw"
exec 8<"$repo"
mount -o remount,bind,ro /
mount -t tmpfs -o mode=1777 private-tmp /tmp
case "$repo" in /tmp/*) mkdir -p "$repo"; mount -c --bind /proc/self/fd/8 "$repo";; esac
exec 8<&-
exec "$@"
"""
SANDBOXED = ["unshare", "--mount", "--net", "--uts", "bash", "-c", SANDBOX, "sandbox"]
NO_SYS_ADMIN = ["setpriv", "--bounding-set=-sys_admin"]

# Launches simulated kernels all the time; says its pid (as it sees it) first.
WORKLOAD = """
import os, time
from gputrace.sim import Device
s = Device(0).stream()
print(os.getpid(), flush=True)
while True:
    s.launch("step", duration_ms=5); s.synchronize(); time.sleep(0.005)
"""

# In a container that has no gputrace: waits for the one the agent brings, then launches all the time.
CONTAINED = """
import importlib.util, os, time
print(os.getpid(), flush=True)
while importlib.util.find_spec("gputrace") is None:
    time.sleep(0.005)
from gputrace.sim import Device
s = Device(0).stream()
while True:
    s.launch("step", duration_ms=5); s.synchronize(); time.sleep(0.005)
"""


class Host:
    """A pid namespace (with a mount namespace for its /proc) whose pid 1 is root's: commands run in it see
    it as the host, with a pid 1 whose namespaces can be read. ``base``: a directory below /run (not /tmp,
    which the sandbox hides) with ``rw`` (writable in the sandbox) and ``attach`` (the agents' attach dir,
    read-only in the sandbox: files get there through the target's /proc/PID/root, never through ours)."""

    def __init__(self) -> None:
        self.base = Path(tempfile.mkdtemp(prefix="gputrace-sandbox-", dir="/run"))
        os.chmod(self.base, 0o755)
        self.rw, self.attach = self.base / "rw", self.base / "attach"
        self.rw.mkdir(mode=0o755)
        self.attach.mkdir(mode=0o755)
        self.env = clean_env(GPUTRACE_ATTACH_DIR=str(self.attach))
        self.holder = subprocess.Popen(["unshare", "--pid", "--fork", "--mount-proc", "sleep", "infinity"],
                                       env=self.env)
        self.init = wait_for(lambda: next(iter(procfs.descendants(self.holder.pid)), 0), what="the host's pid 1")
        self.procs: list[subprocess.Popen[str]] = []

    def argv(self, *argv: str) -> list[str]:
        return ["nsenter", "-t", str(self.init), "-p", "-m", "--", *argv]

    def run(self, *argv: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        return subprocess.run(self.argv(*argv), capture_output=True, text=True, timeout=timeout, cwd="/",
                              env=self.env)

    def start(self, *argv: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen[str], str]:
        """A process in the host; its first line of output."""
        p = subprocess.Popen(self.argv(*argv), stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             text=True, env=env or self.env, cwd="/")
        self.procs.append(p)
        assert p.stdout is not None
        line = p.stdout.readline().strip()
        assert line, p.stderr.read() if p.stderr else ""
        return p, line

    def workload(self, user: list[str] | None = None) -> int:
        """An unarmed python3.14 of the host, launching simulated kernels: its pid there."""
        _, pid = self.start(*(user or []), str(PY314), "-c", WORKLOAD, env={**self.env, "PYTHONPATH": str(ROOT)})
        return int(pid)

    def namespaces(self, pid: int) -> dict[str, str]:
        r = self.run("sh", "-c", f"for n in mnt net uts pid; do readlink /proc/{pid}/ns/$n; done")
        assert r.returncode == 0, r.stderr
        return dict(x.split(":", 1) for x in r.stdout.split())

    def close(self) -> None:
        os.kill(self.init, signal.SIGKILL)  # pid 1: everything in the namespace goes along
        self.holder.wait(timeout=30)
        for p in self.procs:
            p.communicate(timeout=30)
        shutil.rmtree(self.base, ignore_errors=True)


@pytest.fixture
def host() -> Iterator[Host]:
    assert PY314.is_file(), f"{PY314} is missing: run ./setup.sh --test (it unpacks Debian's python3.14 there)"
    h = Host()
    try:
        yield h
    finally:
        h.close()


def _kernels(path: Path) -> list[Any]:
    with CaptureReader(path) as reader:
        return of(list(reader.records()), "GpuKernel")


def _sandboxed_capture(host: Host, pid: int, out: Path) -> subprocess.CompletedProcess[str]:
    """``gputrace capture -p`` by root in the sandbox, without CAP_SYS_ADMIN."""
    return host.run(*SANDBOXED, str(host.rw), str(ROOT), *NO_SYS_ADMIN, sys.executable, "-m", "gputrace",
                    "capture", "-p", str(pid), "-d", "3", "-o", str(out), "--no-perfetto")


def test_sandbox_is_what_it_claims(host: Host) -> None:
    """The emulation holds: other mount, network and UTS namespaces than the host's, no CAP_SYS_ADMIN, / and
    the attach dir read-only, its own /tmp, and the helper's files (gputrace, python3.14) still there."""
    with tempfile.NamedTemporaryFile(prefix="gputrace-host-tmp-") as marker:  # in the host's /tmp
        probe = (f"grep CapBnd /proc/self/status; readlink /proc/self/ns/mnt /proc/self/ns/net /proc/self/ns/uts; "
                 f"touch /etc/gputrace-sandbox-test {host.attach}/x 2>&1 || true; touch {host.rw}/ok; "
                 f"test -e {marker.name} || echo private; "
                 f"test -x {PY314} && test -f {ROOT}/gputrace/__init__.py && echo visible")
        r = host.run(*SANDBOXED, str(host.rw), str(ROOT), *NO_SYS_ADMIN, "sh", "-c", probe)
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert not int(lines[0].split()[1], 16) >> 21 & 1  # CAP_SYS_ADMIN
    ours = [x.split(":", 1)[1] for x in lines[1:4]]
    hosts = host.namespaces(1)
    assert all(a != hosts[k] for a, k in zip(ours, ("mnt", "net", "uts"), strict=True))
    assert lines[4].endswith("Read-only file system") and lines[5].endswith("Read-only file system")
    assert (host.rw / "ok").exists() and not (host.attach / "x").exists()
    assert lines[6:] == ["private", "visible"]


def test_sandboxed_capture_injects_a_host_process(host: Host) -> None:
    """Without CAP_SYS_ADMIN and in namespaces of its own, root's capture -p injects a host process: it is
    in the host's namespaces, not a container's, and the helper needs none of them."""
    pid = host.workload()
    assert host.namespaces(pid) == host.namespaces(1)
    out = host.rw / "cap.gputrace"
    r = _sandboxed_capture(host, pid, out)
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"GPU agent of pid {pid}: injected" in r.stderr, r.stderr
    assert "container" not in r.stderr and "never connected" not in r.stderr
    kernels = _kernels(out)
    assert len(kernels) > 20 and {k.name for k in kernels} == {"step"}
    assert os.listdir(host.attach) == []  # its socket and script went there, and are gone


def test_an_interpreter_hidden_by_the_sandbox_is_refused_clearly(host: Host) -> None:
    """A host process whose interpreter lives in the host's /tmp: the helper would run it in the sandbox,
    where that path is not there (or is another file). Refused with the reason, before anything is tried."""
    hidden = Path(tempfile.mkdtemp(prefix="gputrace-hidden-py-", dir="/tmp"))
    try:
        copy = hidden / "python3.14"
        if subprocess.run(["cp", "-al", str(PY314_ROOT), str(copy)], capture_output=True).returncode != 0:
            shutil.copytree(PY314_ROOT, copy, symlinks=True)
        exe = copy / "usr" / "bin" / "python3.14"
        _, line = host.start(str(exe), "-c", WORKLOAD, env={**host.env, "PYTHONPATH": str(ROOT)})
        pid = int(line)
        out = host.rw / "hidden.gputrace"
        r = _sandboxed_capture(host, pid, out)
        assert r.returncode == 0, r.stdout + r.stderr
        assert (f"pid {pid}: no GPU agent (pid {pid}: its interpreter {exe} is not that file in this process's "
                "view of the file system") in r.stderr, r.stderr
        assert _kernels(out) == [] and os.listdir(host.attach) == []
    finally:
        shutil.rmtree(hidden)


def test_sandboxed_service_injects_a_users_host_process(host: Host) -> None:
    """gputraced in the sandbox (it drops CAP_SYS_ADMIN itself), asked by uid 65534 for its own process."""
    sock, state = host.rw / "gputraced.sock", host.rw / "state"
    host.start(*SANDBOXED, str(host.rw), str(ROOT), "sh", "-c", 'echo started; exec "$@"', "sh", sys.executable,
               "-m", "gputrace", "daemon", "--socket", str(sock), "--state-dir", str(state))
    wait_for(sock.exists, timeout_s=30, what="gputraced's socket")
    pid = host.workload(NOBODY)
    r = host.run(*NOBODY, sys.executable, "-m", "gputrace", "daemon", "capture", "-p", str(pid), "-d", "3",
                 "--name", "sandboxed", "--json", "--socket", str(sock))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "container" not in r.stdout + r.stderr and json.loads(r.stdout)["job"]["state"] == "done"
    kernels = _kernels(state / "65534" / "sandboxed.gputrace")
    assert len(kernels) > 20 and {k.name for k in kernels} == {"step"}


@pytest.fixture
def container(host: Host) -> int:
    """CONTAINED as pid 1 of a container in the host: its pid in the host's pid namespace."""
    d = host.base / "container"
    (d / "root").mkdir(parents=True)
    (d / "work.py").write_text(CONTAINED)
    p, inside = host.start("unshare", "--mount", "--pid", "--fork", "bash", "-c", CONTAINER, "container",
                           str(d / "root"), str(PY314_ROOT), str(d / "work.py"))
    assert inside == "1"
    real = next(x for x in procfs.descendants(p.pid) if procfs.comm(x) == "python3.14")
    status = Path(f"/proc/{real}/status").read_text()
    _, pid, own = next(line for line in status.splitlines() if line.startswith("NSpid:")).split()[1:]
    ns, hosts = host.namespaces(int(pid)), host.namespaces(1)
    assert own == "1" and ns["mnt"] != hosts["mnt"] and ns["pid"] != hosts["pid"]
    return int(pid)


def test_a_container_is_still_refused_without_cap_sys_admin(host: Host, container: int) -> None:
    out = host.rw / "refused.gputrace"
    r = _sandboxed_capture(host, container, out)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (f"pid {container}: no GPU agent (pid {container} runs in a container, and entering it needs "
            "CAP_SYS_ADMIN, which this process does not hold") in r.stderr, r.stderr
    assert _kernels(out) == [] and os.listdir(host.attach) == []


def test_a_container_is_still_injected_by_root(host: Host, container: int) -> None:
    out = host.rw / "root.gputrace"
    r = host.run(sys.executable, "-m", "gputrace", "capture", "-p", str(container), "-d", "3", "-o", str(out),
                 "--no-perfetto")
    assert r.returncode == 0, r.stdout + r.stderr
    assert f"GPU agent of pid {container}: injected" in r.stderr, r.stderr
    kernels = _kernels(out)
    assert len(kernels) > 20 and {k.pid for k in kernels} == {container}


def test_what_counts_as_a_container_seen_from_the_sandbox(host: Host, container: int) -> None:
    """The decision itself, made in the sandbox (where every host process differs from us in mnt, net and
    uts): the host process is in no container and has no root of its own, and so is chrooted into nothing
    and trusted under Yama like any host process; the container's mount and pid namespaces and its root are
    its own. foreign_root (where its files are made) is true of both: our /tmp is not theirs."""
    pid = host.workload()
    code = ("import json, sys\nfrom gputrace.daemon.agents import listen\nfrom gputrace.daemon.attach import nsexec\n"
            "kinds = (*nsexec.NAMESPACES, 'user')\n"
            "print(json.dumps({p: [[n for n in kinds if listen.in_container(p, n)], listen.container_root(p), "
            "listen.foreign_root(p), [n for n in kinds if not listen.own_namespace(p, n)]] "
            "for p in map(int, sys.argv[1:])}))\n")
    r = host.run(*SANDBOXED, str(host.rw), str(ROOT), *NO_SYS_ADMIN, sys.executable, "-c", code, str(pid),
                 str(container))
    assert r.returncode == 0, r.stderr
    seen = json.loads(r.stdout)
    assert seen[str(pid)] == [[], False, True, ["uts", "net", "mnt"]]
    assert seen[str(container)] == [["pid", "mnt"], True, True, ["uts", "net", "pid", "mnt"]]
