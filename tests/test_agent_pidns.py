"""Agents in a container's pid namespace: they name themselves and their threads by their own ids, the
capture by the host's. Real namespaces (unshare), real agents, real captures."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from agent_harness import PYTHON, Harness, of
from waiting import wait_for

from gputrace.daemon.agents.pidns import PeerIds
from gputrace.probes import procfs
from gputrace.probes.procfs import ns_chain
from gputrace.testing.schemas import validate

pytestmark = pytest.mark.kernel  # root and the host's kernel (see tests/conftest.py)

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_sim.py"

# Launches from the main thread, from a thread that lives on, and from one that is gone before the agent's
# next batch; says its ids (as it sees them) and waits.
THREADS = """
import os, sys, threading
from gputrace.sim import Device
dev = Device(0)
done = threading.Event()
def work(name, stay=False):
    s = dev.stream()
    s.launch(name, duration_ms=2)
    s.synchronize()
    if stay:
        done.wait()
short = threading.Thread(target=work, args=("from_short_thread",))
short.start(); short.join()
t = threading.Thread(target=work, args=("from_thread", True))
t.start()
work("from_main")
print(os.getpid(), threading.get_native_id(), t.native_id, flush=True)
sys.stdin.readline()
done.set()
"""

# Speaks the wire protocol by hand from inside the namespace: its own thread's tid, and one that is not.
RAW = """
import os, socket, struct, sys, threading, msgpack
def send(s, msg):
    body = msgpack.packb(msg, use_bin_type=True)
    s.sendall(struct.pack(">I", len(body)) + body)
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(sys.argv[1])
me, tid = os.getpid(), threading.get_native_id()
send(s, {"type": "hello", "pid": me, "tid": tid, "interpreter": "raw", "cuda_version": "", "driver_version": "",
         "backends": [], "unavailable": {}})
row = lambda t, c: [me, t, "cudaLaunchKernel", 10, 20, c, "runtime", 0]
send(s, {"type": "batch", "records": [["CudaApi", [row(tid, 1), row(4000000, 2)]]]})
send(s, {"type": "bye"})
print(me, tid, flush=True)
s.recv(100)
"""


def _in_pid_namespace(args: list[str], env: dict[str, str] | None = None) -> tuple[subprocess.Popen[str], int]:
    """`args` run as pid 1 of a new pid namespace; the unshare process and the host pid of `args`."""
    p = subprocess.Popen(["unshare", "--pid", "--fork", *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True, env=env)
    child = wait_for(lambda: _child_of(p.pid), what="the namespaced child")
    return p, child


def _end(p: subprocess.Popen[str], host_pid: int) -> None:
    """Kill the namespace's pid 1 (which takes everything in it along), then reap unshare."""
    os.kill(host_pid, signal.SIGKILL)
    p.wait(10)


def _child_of(pid: int) -> int:
    for name in os.listdir("/proc"):
        if name.isdigit() and procfs.ppid_of(int(name)) == pid:
            return int(name)
    return 0


def test_peer_ids_map_the_namespace_s_ids_to_the_host_s(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT.parent)}
    p, host_pid = _in_pid_namespace([PYTHON, "-c", "import os, threading, sys\n"
                                     "t = threading.Thread(target=sys.stdin.readline); t.start()\n"
                                     "print(os.getpid(), t.native_id, flush=True); t.join()"], env)
    assert p.stdout is not None
    own_pid, own_thread = map(int, p.stdout.readline().split())
    ids = PeerIds(host_pid)
    host_thread = next(int(t) for t in os.listdir(f"/proc/{host_pid}/task") if int(t) != host_pid)
    assert ids.nested and own_pid == 1 and ids.own_pid == 1 and ids.host_pid == host_pid
    assert ids.tid(own_pid) == host_pid and ids.tid(own_thread) == host_thread
    assert ids.tid(4_000_000) == 0 and ids.unmapped == 1  # not one of its threads
    assert ns_chain(Path(f"/proc/{host_pid}/status")) == [host_pid, 1]
    info, own = procfs.proc_info(host_pid), procfs.proc_info(os.getpid())
    assert info is not None and info.nspid == 1 and own is not None and own.nspid == 0
    p.communicate("\n", timeout=10)
    mine = PeerIds(os.getpid())
    assert not mine.nested and mine.own_pid == os.getpid() and mine.tid(12345) == 12345
    assert ns_chain(tmp_path / "missing") == []


def test_an_agent_in_a_pid_namespace_is_served_under_host_ids(tmp_path: Path) -> None:
    unshares: set[int] = set()
    h = Harness(tmp_path, authorize=lambda pid: procfs.ppid_of(pid) in unshares)
    script = tmp_path / "threads.py"
    script.write_text(THREADS)
    p, host_pid = _in_pid_namespace([PYTHON, str(script)], h.env())
    unshares.add(p.pid)
    assert p.stdout is not None
    own_pid, own_main, own_thread = map(int, p.stdout.readline().split())
    host_tids = {int(t) for t in os.listdir(f"/proc/{host_pid}/task")}
    host_thread = next(t for t in host_tids if ns_chain(Path(f"/proc/{host_pid}/task/{t}/status"))[-1] == own_thread)
    assert own_pid == 1 and own_main == 1 and host_thread != own_thread
    wait_for(lambda: h.server.stats["records"] >= 9, what="the agent's records")
    h.server.stop()
    p.communicate("\n", timeout=10)
    recs = h.finish()
    assert not h.server.rejections
    kernels = {k.name: k for k in of(recs, "GpuKernel")}
    assert set(kernels) == {"from_short_thread", "from_thread", "from_main"}
    assert {k.pid for k in kernels.values()} == {host_pid}
    launches = {a.correlation_id: a for a in of(recs, "CudaApi") if a.name == "cudaLaunchKernel"}
    by_kernel = {name: launches[k.correlation_id].tid for name, k in kernels.items()}
    assert by_kernel["from_main"] == host_pid
    assert by_kernel["from_thread"] == host_thread  # the thread's host tid, not its own
    # A thread gone before the session saw it cannot be mapped: no thread (0), counted; never a wrong one.
    unmapped = h.server.drops().get(f"pid{host_pid}.tid_unmapped", 0)
    short = by_kernel["from_short_thread"]
    assert short not in (host_pid, host_thread) and (short == 0) == (unmapped > 0)
    assert {a.pid for a in of(recs, "CudaApi")} == {host_pid}
    assert {(i.pid, i.tid) for i in of(recs, "AgentInfo")} == {(host_pid, host_pid)}
    assert h.reader is not None
    [peer] = h.reader.meta["agent"]["peers"]
    assert peer["pid"] == host_pid and peer["pid_in_namespace"] == 1


def test_a_namespaced_peer_cannot_name_threads_that_are_not_its_own(tmp_path: Path) -> None:
    unshares: set[int] = set()
    h = Harness(tmp_path, authorize=lambda pid: procfs.ppid_of(pid) in unshares)
    script = tmp_path / "raw.py"
    script.write_text(RAW)
    p, host_pid = _in_pid_namespace([PYTHON, str(script), str(h.server.sock_path)])
    unshares.add(p.pid)
    assert p.stdout is not None
    assert p.stdout.readline().split() == ["1", "1"]
    wait_for(lambda: h.server.stats["records"] >= 2, what="the raw peer's batch")
    p.communicate("", timeout=10)
    recs = h.finish()
    tids = {a.correlation_id: (a.pid, a.tid) for a in of(recs, "CudaApi")}
    assert tids == {1: (host_pid, host_pid), 2: (host_pid, 0)}
    assert h.server.drops()[f"pid{host_pid}.tid_unmapped"] == 1


def test_the_example_in_a_pid_namespace_names_its_slow_worker(tmp_path: Path) -> None:
    """`gputrace capture -- unshare --pid --fork python train_sim.py`: GPU records arrive (before, every
    agent was cut off for naming its own pid) and the stall names the slow worker by its host pid."""
    out = tmp_path / "ns.gputrace"
    run = subprocess.run([sys.executable, "-m", "gputrace", "capture", "--no-perfetto", "-o", str(out), "--",
                          "unshare", "--pid", "--fork", sys.executable, str(EXAMPLE), "--steps", "20",
                          "--slow-worker", "1", "--data", str(tmp_path / "data")],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)  # fmt: skip
    assert run.returncode == 0, run.stderr
    assert "cut off" not in run.stderr and "pid 1," in run.stdout  # the trainer is pid 1 in there
    import json

    report = json.loads(subprocess.run([sys.executable, "-m", "gputrace", "report", str(out), "--json"],
                                       capture_output=True, text=True, timeout=60, cwd=ROOT).stdout)
    validate(report)
    [dev] = report["devices"]
    assert dev["simulated"] and dev["busy_ns"] > 0
    stalls = report["stalls"]
    assert len(stalls) >= 10
    by_culprit: dict[tuple[int, int | None], int] = {}
    for s in stalls:
        if s["cause"] == "cpu":
            key = (s["culprit"]["pid"], s["culprit"].get("pid_in_namespace"))
            by_culprit[key] = by_culprit.get(key, 0) + s["duration_ns"]
    # The slow worker, for nearly all of it (on a busy host the trainer may also wait for a CPU itself).
    (host, inside), most = max(by_culprit.items(), key=lambda kv: kv[1])
    assert most >= 0.8 * sum(by_culprit.values()), by_culprit
    assert host > 1 and inside is not None and 1 < inside < host  # its host pid, and its pid in there
    workers = run.stdout.split("loader workers (pids ")[1].split(")")[0]  # as the job saw them
    assert str(inside) in workers.split(", ")
    assert f"pid {host} (python; pid {inside} in its namespace)" in run.stdout + run.stderr


# An armed service in a container: dormant until a session offers itself in its attach dir.
ARMED = """
import sys
from gputrace.sim import Device
s = Device(0).stream()
print("ready", flush=True)
while True:
    s.launch("step", duration_ms=5)
    s.synchronize()
"""
ATTACH = "/run/gputrace-test/attach"


def _container(tmp_path: Path, setup: str) -> tuple[subprocess.Popen[str], int]:
    """An armed workload in new pid and mount namespaces with a /run of its own (tmpfs), after `setup`."""
    from gputrace.agent import arming

    script = tmp_path / "armed.py"
    script.write_text(ARMED)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUTRACE_")}
    env = {**env, **arming.environment(None, env), "GPUTRACE_ATTACH_DIR": ATTACH}
    shell = f"mount -t tmpfs tmpfs /run && {setup} exec {PYTHON} {script}"
    return _in_pid_namespace(["--mount", "sh", "-c", shell], env)



def test_an_armed_agent_in_a_container_is_offered_inside_its_own_root(tmp_path: Path) -> None:
    assert not Path("/run/gputrace-test").exists()
    unshares: set[int] = set()
    h = Harness(tmp_path, authorize=lambda pid: procfs.ppid_of(pid) in unshares, attach_dir=ATTACH)
    p, host_pid = _container(tmp_path, "")
    unshares.add(p.pid)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    h.server.offer(host_pid)
    inside = Path(f"/proc/{host_pid}/root{ATTACH}/1.sock")  # named by its pid in there
    assert inside.is_socket() and oct(inside.stat().st_mode & 0o777) == "0o666"
    assert not Path("/run/gputrace-test").exists(), "made on the host instead of in the container"
    wait_for(lambda: h.server.stats["records"] > 5, what="records from the armed agent")
    h.server.stop()
    assert not inside.exists(), "the offer is withdrawn when the capture ends"
    _end(p, host_pid)
    recs = h.finish()
    assert {k.pid for k in of(recs, "GpuKernel")} == {host_pid} and not h.server.rejections


def test_an_armed_agent_in_a_rootless_container_trusts_the_offer_made_for_it(
        request: pytest.FixtureRequest) -> None:  # fmt: skip
    """Started by nobody in a user namespace of its own: our root has no name in there, so the offer (and the
    directories made for it) belong to the process's own user, the one owner besides root it trusts."""
    from gputrace.agent import arming

    base = Path(tempfile.mkdtemp(prefix="gputrace-rootless-"))
    os.chmod(base, 0o755)  # nobody reads its script here
    request.addfinalizer(lambda: shutil.rmtree(base))
    script = base / "armed.py"
    script.write_text(ARMED)
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUTRACE_")}
    env = {**env, **arming.environment(None, env), "GPUTRACE_ATTACH_DIR": ATTACH}
    p = subprocess.Popen(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "unshare", "--user",
                          "--map-root-user", "--mount", "--pid", "--fork", "sh", "-c",
                          f"mount -t tmpfs tmpfs /run && exec {PYTHON} {script}"],
                         stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)  # fmt: skip
    host_pid = wait_for(lambda: _child_of(p.pid), what="the namespaced child")
    h = Harness(base, authorize=lambda pid: procfs.ppid_of(pid) == p.pid, attach_dir=ATTACH)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        h.server.offer(host_pid)
        inside = Path(f"/proc/{host_pid}/root{ATTACH}")
        assert (inside / "1.sock").lstat().st_uid == 65534 and inside.stat().st_uid == 65534
        assert inside.parent.stat().st_uid == 65534  # made for it too; /run itself is the container's
        wait_for(lambda: h.server.stats["records"] > 5, what="records from the armed agent")
        h.server.stop()
    finally:
        _end(p, host_pid)
    recs = h.finish()
    assert {k.pid for k in of(recs, "GpuKernel")} == {host_pid} and not h.server.rejections


def test_a_symlink_planted_in_the_container_is_not_followed(tmp_path: Path) -> None:
    """/run/gputrace-test in the container points at an absolute path that also exists on the host: root
    must not create the attach dir or the socket there."""
    from gputrace.errors import UserError

    evil = tmp_path / "evil"
    evil.mkdir()
    h = Harness(tmp_path, authorize=lambda pid: False, attach_dir=ATTACH)
    p, host_pid = _container(tmp_path, f"ln -s {evil} /run/gputrace-test &&")
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    try:
        h.server.offer(host_pid)
    except UserError as e:
        assert "symlink" in str(e) and f"root of pid {host_pid}" in str(e)
    else:
        raise AssertionError("the offer followed a symlink")
    finally:
        _end(p, host_pid)
        h.finish()
    assert list(evil.iterdir()) == []
