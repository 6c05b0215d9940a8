"""Arming: a process started with gputrace's environment behaves exactly as before, attaches when offered,
keeps its own sitecustomize and PYTHONPATH, and its forked workers speak for themselves."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
from agent_harness import PYTHON, Harness, clean_env, of
from waiting import LineLog, wait_for

from gputrace.agent import arming
from gputrace.capture import CaptureReader
from gputrace.daemon.session import MAX_LIVE_OFFERS
from gputrace.errors import UserError

WORKLOAD = """
import sys
from gputrace.sim import Device
s = Device(0).stream()
for i in range(3):
    s.launch(f"k{i}", duration_ms=2)
s.synchronize()
print("steps done", sys.argv[1:], sorted(k for k in __import__("os").environ if k.startswith("ZZ_")))
print("to stderr", file=sys.stderr)
"""


def _run(script: Path, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run([PYTHON, str(script), "a", "b"], env=env, capture_output=True, text=True, timeout=30)


def test_an_armed_process_without_a_session_runs_exactly_as_before(tmp_path: Path) -> None:
    script = tmp_path / "w.py"
    script.write_text(WORKLOAD)
    plain = _run(script, clean_env(ZZ_X="1"))
    armed_env = {**clean_env(ZZ_X="1"), **arming.environment(None, base={}),
                 "GPUTRACE_ATTACH_DIR": str(tmp_path / "attach")}
    armed = _run(script, armed_env)
    assert plain.returncode == armed.returncode == 0
    assert (armed.stdout, armed.stderr) == (plain.stdout, plain.stderr)
    # A capture's environment whose session is gone: still the same run.
    t0 = time.monotonic()
    gone = _run(script, {**clean_env(ZZ_X="1"), **arming.environment(str(tmp_path / "no.sock"), base={})})
    assert (gone.returncode, gone.stdout, gone.stderr) == (0, plain.stdout, plain.stderr)
    assert time.monotonic() - t0 < 1.0, "no lingering at exit for a session that is gone"


def test_without_the_variables_the_boot_hook_loads_nothing(tmp_path: Path) -> None:
    code = "import sys; print('gputrace' in sys.modules, 'sitecustomize' in sys.modules)"
    env = clean_env(PYTHONPATH=arming.boot_dir())
    out = subprocess.run([PYTHON, "-c", code], env=env, capture_output=True, text=True, timeout=30)
    assert out.stdout.split() == ["False", "True"] and out.stderr == ""


def test_a_dormant_process_attaches_when_offered_and_detaches_at_stop(tmp_path: Path) -> None:
    attach = tmp_path / "attach"
    h = Harness(tmp_path, attach_dir=str(attach))
    env = {**clean_env(), **arming.environment(None, base={}), "GPUTRACE_ATTACH_DIR": str(attach)}
    p = h.spawn("""
import sys, time
from gputrace.sim import Device
s = Device(0).stream()
print("ready", flush=True)
for line in sys.stdin if False else iter(lambda: time.sleep(0.01) or True, None):
    s.launch("step", duration_ms=2)
    s.synchronize()
""", env=env)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    assert h.server.stats["accepted"] == 0, "armed but not offered: it must not connect"
    h.server.offer(p.pid)
    assert (attach / f"{p.pid}.sock").is_socket()
    wait_for(lambda: h.server.stats["records"] > 10, timeout_s=5, what="the dormant agent attaching")
    h.server.stop()
    assert not (attach / f"{p.pid}.sock").exists(), "the offer is withdrawn when the session ends"
    assert p.poll() is None, "the target keeps running after the capture"
    recs = h.finish()
    assert h.server.stats["ended_early"] == 0
    assert of(recs, "GpuDevice")[0].pid == p.pid and of(recs, "GpuKernel")


def test_sitecustomize_chaining_keeps_the_targets_own(tmp_path: Path) -> None:
    own = tmp_path / "own"
    own.mkdir()
    (own / "sitecustomize.py").write_text("import os\nos.environ['ZZ_OWN_SITE'] = 'ran'\n")
    (own / "helper_mod.py").write_text("VALUE = 42\n")
    code = "import os, helper_mod; print(os.environ.get('ZZ_OWN_SITE'), helper_mod.VALUE)"
    base = {**clean_env(), "PYTHONPATH": str(own)}
    for env in (
        {**base, **arming.environment(None, base=base), "GPUTRACE_ATTACH_DIR": str(tmp_path / "a")},
        {**base, **arming.environment(str(tmp_path / "gone.sock"), base=base)},
        {**base, "PYTHONPATH": arming.boot_dir() + os.pathsep + str(own)},
    ):
        assert env["PYTHONPATH"].split(os.pathsep) == [arming.boot_dir(), str(own)]
        out = subprocess.run([PYTHON, "-c", code], env=env, capture_output=True, text=True, timeout=30)
        assert (out.stdout.strip(), out.stderr) == ("ran 42", ""), out


def test_an_offer_after_a_dead_session_is_taken_though_its_inode_is_reused(tmp_path: Path) -> None:
    """A session killed with SIGKILL leaves its socket file; the next session replaces it, and the file system
    (ext4) gives the new file the freed inode number. The dormant agent must still see a new offer."""
    attach = tmp_path / "attach"
    attach.mkdir()
    env = {**clean_env(), **arming.environment(None, base={}), "GPUTRACE_ATTACH_DIR": str(attach)}
    h = Harness(tmp_path, attach_dir=str(attach))
    p = h.spawn("""
import logging, sys, time
logging.basicConfig(level=logging.DEBUG, stream=sys.stdout, format="%(message)s")  # the agent says what it tried
from gputrace.sim import Device
s = Device(0).stream()
print("ready", flush=True)
while True:
    s.launch("step", duration_ms=2)
    s.synchronize()
    time.sleep(0.01)
""", env=env)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    out = LineLog(p.stdout)
    stale = attach / f"{p.pid}.sock"
    dead = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    dead.bind(str(stale))  # what a killed session leaves: a socket file nobody listens on
    dead.close()
    out.wait_line(f"cannot reach session at {stale}")  # the agent has seen it and failed to connect
    h.server.offer(p.pid)  # usually on the freed inode (ext4); the identity test below does not depend on it
    wait_for(lambda: h.server.stats["records"] > 10, timeout_s=5, what="the agent taking the new offer")
    p.kill()
    out.text()
    h.finish()


def test_an_offer_on_the_same_inode_reads_as_new(tmp_path: Path) -> None:
    """What the watcher compares: the same inode with a new change time is a new offer (a freed inode handed
    to the next session's socket); the same file unchanged is not."""
    offer = tmp_path / "42.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(offer))
    s.close()
    first = arming._trusted_offer(str(offer))
    assert first is not None and arming._trusted_offer(str(offer)) == first
    # same inode, new change time, as a socket bound anew on that inode has (the file system's clock ticks
    # coarser than nanoseconds: changed again until the time it stamps has moved on)
    wait_for(lambda: os.chmod(offer, 0o666) or os.stat(offer).st_ctime_ns != first[2], what="a new change time")
    again = arming._trusted_offer(str(offer))
    assert again is not None and again[:2] == first[:2] and again != first
    offer.unlink()
    assert arming._trusted_offer(str(offer)) is None


BURSTY = """
import os, sys, threading, time
from gputrace.agent import arming
from gputrace.records import GpuKernel
from gputrace.sim import Device
s = Device(0).stream()

def commands():
    for line in sys.stdin:  # "burst": overflow the agent's queue once (100 records into room for 10)
        agent = arming.current()
        limit, agent.queue.limit = agent.queue.limit, 10
        agent.submit([GpuKernel(os.getpid(), 0, 1, 1, i, i + 1, i, "k", (1, 1, 1), (1, 1, 1)) for i in range(100)])
        agent.queue.limit = limit
        print("burst", flush=True)

threading.Thread(target=commands, daemon=True).start()
print("ready", flush=True)
while True:
    s.launch("step", duration_ms=2)
    s.synchronize()
    time.sleep(0.01)
"""


def test_losses_of_one_session_are_not_reported_by_the_next(tmp_path: Path) -> None:
    attach = tmp_path / "attach"
    env = {**clean_env(), **arming.environment(None, base={}), "GPUTRACE_ATTACH_DIR": str(attach)}
    (tmp_path / "bursty.py").write_text(BURSTY)
    p = subprocess.Popen([PYTHON, str(tmp_path / "bursty.py")], env=env, stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, text=True)  # fmt: skip
    try:
        assert p.stdout is not None and p.stdin is not None and p.stdout.readline().strip() == "ready"
        losses = []
        for n, burst in ((1, True), (2, False)):
            (tmp_path / f"s{n}").mkdir()
            h = Harness(tmp_path / f"s{n}", attach_dir=str(attach))
            h.allowed.add(p.pid)
            h.server.offer(p.pid)
            wait_for(lambda h=h: h.server.stats["records"] > 5, timeout_s=5, what=f"session {n} attaching")
            if burst:
                p.stdin.write("burst\n")
                p.stdin.flush()
                assert p.stdout.readline().strip() == "burst"
                wait_for(lambda h=h: h.server.drops().get(f"pid{p.pid}.queue", 0), 10, "the agent reporting its losses")
            h.finish()
            losses.append(h.server.drops().get(f"pid{p.pid}.queue", 0))
        assert losses[0] >= 90 and losses[1] == 0, losses  # the burst, and other records it crowded out
    finally:
        p.kill()
        p.wait()


def test_empty_pythonpath_entries_keep_the_current_directory(tmp_path: Path) -> None:
    # PYTHONPATH=/x::/y puts the current directory on sys.path; armed, the job must still import from it.
    (tmp_path / "local_mod.py").write_text("VALUE = 7\n")
    base = {**clean_env(), "PYTHONPATH": f"/nonexistent-x{os.pathsep}{os.pathsep}/nonexistent-y"}
    env = {**base, **arming.environment(None, base=base), "GPUTRACE_ATTACH_DIR": str(tmp_path / "a")}
    assert env["PYTHONPATH"].split(os.pathsep) == [arming.boot_dir(), "/nonexistent-x", "", "/nonexistent-y"]
    out = subprocess.run([PYTHON, "-c", "import local_mod; print(local_mod.VALUE)"], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=30)  # fmt: skip
    assert (out.stdout.strip(), out.stderr) == ("7", ""), out
    assert arming.environment(None, base={**clean_env(), "PYTHONPATH": ""})["PYTHONPATH"] == arming.boot_dir()


def test_a_failing_own_sitecustomize_is_reported_as_python_would(tmp_path: Path) -> None:
    own = tmp_path / "own"
    own.mkdir()
    (own / "sitecustomize.py").write_text("raise RuntimeError('boom')\n")
    plain = subprocess.run([PYTHON, "-c", "print(1)"], env={**clean_env(), "PYTHONPATH": str(own)},
                           capture_output=True, text=True, timeout=30)
    env = {**clean_env(), "PYTHONPATH": arming.boot_dir() + os.pathsep + str(own)}
    chained = subprocess.run([PYTHON, "-c", "print(1)"], env=env, capture_output=True, text=True, timeout=30)
    assert (chained.stdout, chained.stderr) == (plain.stdout, plain.stderr)
    assert "RuntimeError: boom" in chained.stderr


def test_forked_workers_get_their_own_connection(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    p = h.spawn("""
import multiprocessing as mp, os
from gputrace.sim import Device

def work(n):
    s = Device(0).stream()
    s.launch(f"worker{n}", duration_ms=3)
    s.synchronize()
    return os.getpid()

if __name__ == "__main__":
    s = Device(0).stream()
    s.launch("parent", duration_ms=3)
    ctx = mp.get_context("fork")
    procs = [ctx.Process(target=work, args=(n,)) for n in range(2)]
    for q in procs: q.start()
    for q in procs: q.join()
    s.synchronize()
    print(sorted(q.pid for q in procs), flush=True)
""")
    h.allowed.update(range(p.pid, p.pid + 2000))  # its forks, as the session's fork tracking would
    out, err = p.communicate(timeout=30)
    assert p.returncode == 0, err
    recs = h.finish()
    workers = eval(out)  # noqa: S307 - our own child's printed list of ints
    by_name = {k.name: k.pid for k in of(recs, "GpuKernel")}
    assert by_name == {"parent": p.pid, "worker0": workers[0], "worker1": workers[1]}
    assert {d.pid for d in of(recs, "GpuDevice")} == {p.pid, *workers}
    assert h.server.stats["ended_early"] == 0, h.server.rejections



def test_a_forked_worker_does_not_claim_the_gpu_backend_that_ran_in_its_parent(tmp_path: Path) -> None:
    # CUPTI runs in a trainer; its DataLoader workers are forked from it, where CUDA cannot run. At the
    # trainer's exit multiprocessing terminates daemonic workers (SIGTERM: no bye). Such a worker never had
    # GPU work to lose, so the session must not say its records may be lost (seen on an H100).
    h = Harness(tmp_path)
    p = h.spawn("""
import multiprocessing as mp, sys, time
from gputrace.agent import arming

class Gpu:  # runs in this process and is not fork-safe, as CuptiBackend
    name = "fakegpu"
    def start(self, emit): pass
    def stop(self): pass
    def drops(self): return {}
    def info(self): return {"cuda_version": "13.0", "driver_version": "580.159.04"}

def work():
    time.sleep(60)

if __name__ == "__main__":
    arming.register_backend(Gpu())
    q = mp.get_context("fork").Process(target=work, daemon=True)
    q.start()
    print(q.pid, flush=True)
    sys.stdin.readline()  # once the session has heard its own agent say hello
    q.terminate()
    q.join()
""", stdin=True)
    h.allowed.update(range(p.pid, p.pid + 2000))
    assert p.stdout is not None and p.stdin is not None
    worker = int(p.stdout.readline())
    wait_for(lambda: worker in h.server.heard_from(), 10, "the worker's agent saying hello")
    p.stdin.write("go\n")
    p.stdin.flush()
    _, err = p.communicate(timeout=30)
    assert p.returncode == 0, err
    recs = h.finish()
    assert {(a.pid, a.source) for a in of(recs, "AgentInfo")} == {(p.pid, "fakegpu")}
    peers = {s["pid"]: s for s in h.reader.meta["agent"]["peers"]}  # type: ignore[union-attr]
    assert peers[worker]["backends"] == [] and "forked from a process" in peers[worker]["unavailable"]["fakegpu"]
    assert h.server.stats["ended_early"] == 0, h.server.rejections


# A target's own sitecustomize (run after gputrace's, so the agent's thread has started) whose import of
# logging takes a second: what torch, asyncio or concurrent.futures importing logging on the main thread
# looks like to the agent's thread, which finds a half-made module (no getLogger yet) in sys.modules.
SLOW_LOGGING_IMPORT = """
import importlib.abc, importlib.machinery, sys, time

class _Slow(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "logging":
            return None
        sys.meta_path.remove(self)
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        real = spec.loader

        class _Loader(importlib.abc.Loader):
            def create_module(self, spec):
                return None

            def exec_module(self, module):
                time.sleep(1.0)
                real.exec_module(module)

        spec.loader = _Loader()
        return spec

sys.meta_path.insert(0, _Slow())
import logging
"""


def test_the_agent_connects_while_the_target_is_still_importing_logging(tmp_path: Path) -> None:
    own = tmp_path / "own"
    own.mkdir()
    (own / "sitecustomize.py").write_text(SLOW_LOGGING_IMPORT)
    h = Harness(tmp_path)
    base = clean_env(PYTHONPATH=str(own))
    p = h.spawn(WORKLOAD, env={**base, **h.server.child_env(base)})
    out, err = p.communicate(timeout=30)
    assert p.returncode == 0 and out.startswith("steps done"), err
    assert err == "to stderr\n", "nothing of the agent's may reach the target's stderr"
    recs = h.finish()
    assert [k.name for k in of(recs, "GpuKernel")] == ["k0", "k1", "k2"], h.server.stats
    assert of(recs, "GpuDevice")[0].pid == p.pid


def test_gputrace_env_prints_arming_lines() -> None:
    out = subprocess.run([sys.executable, "-m", "gputrace", "env"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0
    assert "export GPUTRACE_AGENT=1" in out.stdout
    assert f'export PYTHONPATH={arming.boot_dir()}"${{PYTHONPATH:+:$PYTHONPATH}}"' in out.stdout
    unit = subprocess.run([sys.executable, "-m", "gputrace", "env", "--systemd", "--unit", "trainer.service"],
                          capture_output=True, text=True, timeout=30)
    assert "[Service]" in unit.stdout and 'Environment="GPUTRACE_AGENT=1"' in unit.stdout
    assert "/etc/systemd/system/trainer.service.d/gputrace.conf" in unit.stdout
    bad = subprocess.run([sys.executable, "-m", "gputrace", "env", "--unit", "a;b"],
                         capture_output=True, text=True, timeout=30)
    assert bad.returncode == 2 and bad.stderr.startswith("gputrace: error: ")


def test_an_interpreter_without_gputrace_or_msgpack_still_connects(tmp_path: Path) -> None:
    """The system Python here has neither: the agent loads from GPUTRACE_HOME and speaks its own msgpack."""
    system_python = "/usr/bin/python3"
    probe = subprocess.run(
        [system_python, "-c", "import importlib.util as u; print(u.find_spec('gputrace'), u.find_spec('msgpack'))"],
        capture_output=True, text=True, timeout=30, env=clean_env(), cwd=tmp_path)
    assert probe.stdout.split() == ["None", "None"], "this test needs an interpreter without gputrace and msgpack"
    h = Harness(tmp_path)
    env = {**clean_env(), **h.server.child_env(clean_env())}
    p = subprocess.Popen([system_python, "-c", "print('hello from', __import__('sys').version.split()[0])"],
                         env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=tmp_path)
    h.allowed.add(p.pid)
    out, err = p.communicate(timeout=30)
    assert out.startswith("hello from") and err == ""
    h.finish()
    assert h.reader is not None
    [peer] = h.reader.meta["agent"]["peers"]
    assert peer["pid"] == p.pid and peer["end"] == "bye" and "/usr/bin/python3" in peer["interpreter"]


FORKER = """
import subprocess, sys, time
print("ready", flush=True)
end = time.monotonic() + float(sys.argv[1])
while time.monotonic() < end:
    subprocess.run(["/bin/true"])  # armed children, each gone within milliseconds
"""


@pytest.mark.kernel
def test_a_job_forking_many_short_lived_children_holds_no_offer_for_the_dead(tmp_path: Path) -> None:
    """`capture -p` of an armed service that runs a subprocess again and again: each armed child is offered the
    session while it lives, and the offer goes with it (before, every child kept a socket: EMFILE in minutes)."""
    attach = tmp_path / "attach"
    env = {**clean_env(), **arming.environment(None, base={}), "GPUTRACE_ATTACH_DIR": str(attach)}
    (tmp_path / "forker.py").write_text(FORKER)
    # runs until killed: under load, the capture may take seconds to start
    job = subprocess.Popen([PYTHON, str(tmp_path / "forker.py"), "120"], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert job.stdout is not None and job.stdout.readline().strip() == "ready"
        cap = subprocess.Popen([sys.executable, "-m", "gputrace", "capture", "-p", str(job.pid), "-d", "4",
                                "--sample-hz", "0", "-o", "f.gputrace"], cwd=tmp_path,
                               env={**os.environ, "GPUTRACE_ATTACH_DIR": str(attach)},
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)  # fmt: skip
        peak_files = peak_fds = 0
        while cap.poll() is None:
            with contextlib.suppress(OSError):
                peak_files = max(peak_files, len(os.listdir(attach)))
                peak_fds = max(peak_fds, len(os.listdir(f"/proc/{cap.pid}/fd")))
            time.sleep(0.05)
        _, err = cap.communicate()
        assert cap.returncode == 0, err
    finally:
        job.kill()
        job.wait()
    with CaptureReader(tmp_path / "f.gputrace") as reader:
        forks = sum(1 for r in reader.records() if type(r).__name__ == "ProcFork" and not r.is_thread)
    assert forks > 100, f"only {forks} children forked: the test shows nothing"
    # Bounded by the children alive at once (here one or two), under load by the cap on offers held.
    assert peak_files <= MAX_LIVE_OFFERS and peak_fds < MAX_LIVE_OFFERS + 150, (peak_files, peak_fds, forks)
    assert "Too many open files" not in err and os.listdir(attach) == []


def test_a_second_session_does_not_take_a_live_offer_over(tmp_path: Path) -> None:
    """Two captures of one armed process: the second says the process is being captured already, instead of
    replacing the first one's socket and leaving both without the agent."""
    attach = tmp_path / "attach"
    (tmp_path / "one").mkdir()
    first = Harness(tmp_path / "one", attach_dir=str(attach))
    first.server.offer(4242)
    (tmp_path / "two").mkdir()
    second = Harness(tmp_path / "two", attach_dir=str(attach))
    with pytest.raises(UserError, match="being captured already"):
        second.server.offer(4242)
    assert (attach / "4242.sock").is_socket()
    second.finish()
    first.finish()
    assert not (attach / "4242.sock").exists()
