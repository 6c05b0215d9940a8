"""gputraced for real: a subprocess service on a temporary socket, real clients (root and uid 65534), real captures."""

from __future__ import annotations

import collections
import contextlib
import json
import os
import re
import select
import shutil
import signal
import socket
import stat
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from waiting import LineLog, connectable, wait_for

from gputrace.capture import CaptureReader
from gputrace.daemon.service.auth import authorize
from gputrace.daemon.service.jobs import JobTable, Limits, prepare_state_dir
from gputrace.daemon.service.protocol import ProtocolError, recv_frame, send_frame
from gputrace.errors import UserError
from gputrace.pidfds import close_pidfds
from gputrace.probes.ebpf.syscalls import syscall_numbers
from gputrace.records import SourceStatus

pytestmark = pytest.mark.kernel  # root and the host's kernel (see tests/conftest.py)

ROOT = Path(__file__).resolve().parents[1]
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


class Svc:
    def __init__(self, base: Path, *extra: str) -> None:
        self.base = base
        self.sock = base / "run" / "gputraced.sock"
        self.state = base / "state"
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gputrace", "daemon", "--socket", str(self.sock), "--state-dir", str(self.state),
             *extra], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, cwd=ROOT)
        assert self.proc.stderr is not None
        self.log = LineLog(self.proc.stderr)  # read as it comes: the test waits for lines, the pipe never fills
        connectable(self.sock, 30, alive=lambda: self.proc.poll() is None)

    def stop(self, timeout_s: float = 60, *, kill: bool = False) -> str:
        """End the service (SIGTERM, or SIGKILL) and wait for it; everything it wrote to stderr."""
        if self.proc.poll() is None:
            self.proc.kill() if kill else self.proc.terminate()
        self.proc.wait(timeout=timeout_s)
        return self.log.text()

    def tracing(self, job_id: int) -> None:
        """Until job ``job_id``'s capture has every source attached (what it says in the service's log)."""
        self.log.wait_line(f"job {job_id}: gputrace: tracing ", 60)

    def raw(self, payload: bytes) -> dict[str, Any]:
        """Send raw bytes; the reply (a refusal is a reply too)."""
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(10)
            s.connect(str(self.sock))
            try:
                s.sendall(payload)
                s.shutdown(socket.SHUT_WR)
            except (BrokenPipeError, ConnectionResetError):
                pass  # refused before reading (busy, oversized): the reply is already waiting
            reply = recv_frame(s, 1 << 20)
            assert reply is not None, "the service closed without a reply"
            return reply

    def ask(self, req: dict[str, Any]) -> dict[str, Any]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(30)
            s.connect(str(self.sock))
            send_frame(s, req)
            reply = recv_frame(s, 1 << 20)
            assert reply is not None
            return reply

    def client(self, *args: str, user: list[str] | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*(user or []), sys.executable, "-m", "gputrace", "daemon", *args,
                               "--socket", str(self.sock)], capture_output=True, text=True, timeout=120, cwd="/")


@contextlib.contextmanager
def running_service(prefix: str, *extra: str) -> Iterator[Svc]:
    """A gputraced in a fresh directory that uid 65534 can reach, stopped and removed afterwards."""
    base = Path(tempfile.mkdtemp(prefix=prefix))
    os.chmod(base, 0o755)  # uid 65534 must reach the socket
    service = Svc(base, *extra)
    try:
        yield service
    finally:
        service.stop(90)
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="module")
def svc() -> Iterator[Svc]:
    with running_service("gputraced-test-") as service:
        yield service


def _child(user: list[str] | None = None) -> subprocess.Popen[bytes]:
    """A real target that does some I/O until killed."""
    code = "import os,time\nwhile True:\n    os.stat('/'); time.sleep(0.01)"
    return subprocess.Popen([*(user or []), sys.executable, "-c", code])


def _select_timeout(pid: int, nrs: set[int]) -> str | None:
    """The timeout argument (a pointer, 0x0 for none) of the select the main thread of ``pid`` sleeps in, from
    /proc/PID/task/PID/syscall; None while it is in no select."""
    parts = Path(f"/proc/{pid}/task/{pid}/syscall").read_text().split()
    return parts[5] if len(parts) > 5 and parts[0].isdigit() and int(parts[0]) in nrs else None


def test_an_idle_service_sleeps_until_a_request_or_a_signal(svc: Svc) -> None:
    # its accept loop waits for a connection or a signal (the interpreter's wakeup fd) with no timeout, not
    # looking every 0.2 s: its main thread does not run at all while nothing comes
    nrs = {nr for name, nr in syscall_numbers().items() if name in ("select", "pselect6")}
    assert svc.client("status").returncode == 0  # its startup's connections (the tests' probes) served
    timeout = wait_for(lambda: _select_timeout(svc.proc.pid, nrs), 30, "the accept loop asleep in select")
    assert timeout == "0x0", timeout
    assert svc.client("status").returncode == 0  # and a request is still answered at once


def test_root_captures_a_child_through_the_client(svc: Svc) -> None:
    child = _child()
    try:
        r = svc.client("capture", "-p", str(child.pid), "-d", "1", "--name", "root-run", "--json")
    finally:
        child.kill()
    assert r.returncode == 0, r.stdout + r.stderr
    job = json.loads(r.stdout)["job"]
    assert job["state"] == "done" and job["pids"] == [child.pid] and job["complete"] is True
    cap = svc.state / "0" / "root-run.gputrace"
    assert job["files"] == [str(cap), str(svc.state / "0" / "root-run.pftrace")]
    st = cap.stat()
    assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (0, 0o600)
    with CaptureReader(cap) as reader:
        records = list(reader.records())
        assert reader.complete and child.pid in reader.header["targets"]
    assert "ProcInfo" in {type(rec).__name__ for rec in records}
    assert not list((svc.state / ".staging").iterdir()), "staging left behind"
    # the service runs without CAP_SYSLOG (kallsyms shows it no addresses) and still takes the raw tracepoints
    started = [r.detail for r in records
               if isinstance(r, SourceStatus) and r.source == "ebpf" and r.status == "started"]
    raw = "syscalls via raw tracepoints sys_enter/sys_exit; scheduler via raw"
    assert started and started[0].startswith(raw), started


def test_a_service_capture_turns_source_families_off(svc: Svc) -> None:
    child = _child()
    try:
        r = svc.client("capture", "-p", str(child.pid), "-d", "1", "--name", "lean", "--off", "sampler,block",
                       "--json")  # fmt: skip
    finally:
        child.kill()
    assert r.returncode == 0, r.stdout + r.stderr
    with CaptureReader(svc.state / "0" / "lean.gputrace") as reader:
        kinds = {type(rec).__name__ for rec in reader.records()}
        assert reader.header["off"] == ["block", "sampler"]
        overhead = reader.trailer["overhead"]
    assert "StackSample" not in kinds and "BlockIO" not in kinds and "OffCpu" in kinds
    # The service has no CAP_SYS_ADMIN, which the kernel's BPF statistics need: the probes' cost is missing,
    # said why, and what could be measured is there
    assert "CAP_SYS_ADMIN" in overhead["missing"]["probes"] and overhead["by_source"]["session"] > 0, overhead
    bad = svc.client("capture", "-p", str(os.getpid()), "-d", "1", "--off", "gpu")
    assert bad.returncode == 2 and "unknown source family gpu" in bad.stderr


def test_user_captures_own_process_into_own_directory(svc: Svc) -> None:
    child = _child(NOBODY)
    try:
        r = svc.client("capture", "-p", str(child.pid), "-d", "1", "--name", "mine", user=NOBODY)
    finally:
        child.kill()
    assert r.returncode == 0, r.stdout + r.stderr
    d = svc.state / "65534"
    st = d.stat()
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (65534, 65534, 0o700)
    for name in ("mine.gputrace", "mine.pftrace"):
        fst = (d / name).stat()
        assert (fst.st_uid, stat.S_IMODE(fst.st_mode)) == (65534, 0o600)
    assert f"Wrote {d / 'mine.gputrace'}" in r.stdout
    listed = svc.client("list", "--json", user=NOBODY)
    doc = json.loads(listed.stdout)
    assert {j["uid"] for j in doc["jobs"]} == {65534}, "a user sees only their own jobs"
    assert [f["name"] for f in doc["files"]] == ["mine.gputrace", "mine.pftrace"]


def test_unprivileged_client_refused_for_root_target(svc: Svc) -> None:
    child = _child()
    try:
        r = svc.client("capture", "-p", str(child.pid), "-d", "1", user=NOBODY)
    finally:
        child.kill()
    assert r.returncode == 2
    assert f"gputraced refused: not allowed: pid {child.pid} is not yours (uid 0)" in r.stderr
    assert not (svc.state / "65534" / f"gputrace-{child.pid}").exists()


def test_missing_pid_and_existing_name_are_refused(svc: Svc) -> None:
    assert svc.ask({"op": "capture", "pids": [4_000_000], "duration_s": 1})["error"] == "no process with pid 4000000"
    (svc.state / "65534").mkdir(mode=0o700, exist_ok=True)
    planted = svc.state / "65534" / "planted.gputrace"
    planted.unlink(missing_ok=True)
    planted.symlink_to("/etc/passwd")
    child = _child(NOBODY)
    try:
        r = svc.client("capture", "-p", str(child.pid), "-d", "1", "--name", "planted", user=NOBODY)
    finally:
        child.kill()
    assert r.returncode == 2 and "planted.gputrace already exists" in r.stderr
    assert planted.is_symlink() and Path("/etc/passwd").read_text().startswith("root:")


@pytest.mark.parametrize("name", ["../escape", "/etc/cron.d/x", "a/b", "..", ".hidden", "x" * 200, "név", ""])
def test_path_traversal_names_are_refused(svc: Svc, name: str) -> None:
    reply = svc.ask({"op": "capture", "pids": [os.getpid()], "duration_s": 1, "name": name})
    assert reply["ok"] is False and "name" in reply["error"]


def _kernel_at_least(major: int, minor: int) -> bool:
    return tuple(int(x) for x in re.findall(r"\d+", os.uname().release)[:2]) >= (major, minor)


def _own_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def _wait_job(svc: Svc, job_id: int, timeout_s: float = 60) -> dict[str, Any]:
    """The job once it is no longer running (failing after ``timeout_s``)."""
    deadline = time.monotonic() + timeout_s
    while (job := next(j for j in svc.ask({"op": "list"})["jobs"] if j["id"] == job_id))["state"] == "running":
        assert time.monotonic() < deadline, job
        time.sleep(0.05)
    return job


def _nobodys_child() -> subprocess.Popen[bytes]:
    """A target that runs as uid 65534 by the time this returns (it says so once setpriv has exec'd it)."""
    code = "import time\nprint('ready', flush=True)\ntime.sleep(60)"
    child = subprocess.Popen([*NOBODY, sys.executable, "-c", code], stdout=subprocess.PIPE)
    assert child.stdout is not None and child.stdout.readline() == b"ready\n"
    child.stdout.close()
    return child


def test_callers_and_targets_are_pinned_with_pidfds(svc: Svc) -> None:
    status = svc.ask({"op": "status"})
    assert status["pidfd"] == {"callers": _kernel_at_least(6, 5), "targets": _kernel_at_least(5, 3)}


def test_a_target_that_exits_while_being_authorised_is_refused() -> None:
    """Killed and reaped after its /proc check passed: only the pidfd can tell the check is now void."""
    child = _nobodys_child()
    before = _own_fds()

    def kill_it(pid: int) -> None:
        assert pid == child.pid
        child.kill()
        child.wait()  # reaped: from here its pid may go to any new process

    with pytest.raises(ProtocolError) as refused:
        authorize(65534, [child.pid], on_checked=kill_it)
    assert str(refused.value) == f"process {child.pid} exited while being authorised"
    assert _own_fds() == before, "the pidfd was not closed"
    live = _nobodys_child()
    try:
        pinned = authorize(65534, [live.pid], on_checked=lambda pid: None)
    finally:
        live.kill()
        live.wait()
    assert list(pinned) == [live.pid]
    os.close(pinned[live.pid])


def test_a_thread_id_is_refused_as_a_target(svc: Svc) -> None:
    code = "import threading,time\nt=threading.Thread(target=time.sleep,args=(60,));t.start()\ntime.sleep(60)"
    proc = subprocess.Popen([sys.executable, "-c", code])
    try:
        tasks = f"/proc/{proc.pid}/task"
        wait_for(lambda: len(os.listdir(tasks)) >= 2, 10, "the second thread")
        tid = max(int(t) for t in os.listdir(tasks))
        reply = svc.ask({"op": "capture", "pids": [tid], "duration_s": 1})
    finally:
        proc.kill()
        proc.wait()
    assert reply == {"ok": False, "error": f"pid {tid} is a thread, not a process; give its process id"}


CONNECT_AND_HAND_OVER = """
import socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(sys.argv[1])
s.sendall(bytes.fromhex(sys.argv[2]))
socket.send_fds(socket.socket(fileno=int(sys.argv[3])), [b"x"], [s.fileno()])
"""


def test_a_caller_gone_before_its_request_is_served_starts_nothing(svc: Svc) -> None:
    """The caller connects, sends all but the last byte, hands its connection over and exits; the request
    completes after it was reaped. Its job must not start."""
    target = _child()
    frame = _frame(json.dumps({"op": "capture", "pids": [target.pid], "duration_s": 1, "name": "orphan",
                               "wait": True}).encode())
    here, there = socket.socketpair()
    try:
        caller = subprocess.Popen([sys.executable, "-c", CONNECT_AND_HAND_OVER, str(svc.sock), frame[:-1].hex(),
                                   str(there.fileno())], pass_fds=[there.fileno()])
        _, fds, _, _ = socket.recv_fds(here, 1, 1)
        assert caller.wait(10) == 0
        with socket.socket(fileno=fds[0]) as conn:
            conn.settimeout(10)
            conn.sendall(frame[-1:])
            reply = recv_frame(conn, 1 << 20)
    finally:
        target.kill()
        here.close()
        there.close()
    assert reply == {"ok": False, "error": f"caller pid {caller.pid} has exited; request dropped"}
    assert all(j["name"] != "orphan.gputrace" for j in svc.ask({"op": "list"})["jobs"])
    assert svc.proc.poll() is None


CONNECT_THEN_SETUID = """
import os, socket, sys
from gputrace.daemon.service.protocol import recv_frame, send_frame
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect(sys.argv[1])
os.setresgid(65534, 65534, 65534); os.setresuid(65534, 65534, 65534)
send_frame(s, {"op": "capture", "pids": [int(sys.argv[2])], "duration_s": 1})
print(recv_frame(s, 1 << 20)["error"])
"""


def test_a_caller_that_changed_uid_after_connecting_is_refused(svc: Svc) -> None:
    target = _child()
    try:
        r = subprocess.run([sys.executable, "-c", CONNECT_THEN_SETUID, str(svc.sock), str(target.pid)],
                           capture_output=True, text=True, timeout=30, cwd=ROOT)
    finally:
        target.kill()
    assert r.returncode == 0, r.stderr
    assert re.fullmatch(r"caller pid \d+ now runs as uid 65534, not uid 0 as when it connected; reconnect\n",
                        r.stdout), r.stdout


def test_a_target_gone_when_tracing_starts_is_not_published(tmp_path: Path) -> None:
    """The probes follow a pid, whoever holds it. A job whose target has exited by the time its probes are
    attached must publish nothing: here the target is killed and reaped the moment the session says it is
    tracing (the job's log line comes just before the check)."""
    target = _child()
    killed: list[str] = []

    def log(line: str) -> None:
        if "gputrace: tracing" in line and not killed:
            target.kill()
            target.wait()
            killed.append(line)

    state = tmp_path / "state"
    prepare_state_dir(state)
    jobs = JobTable(state, Limits(), log)
    pinned = authorize(0, [target.pid])
    job = jobs.start(0, 0, {"pids": [target.pid], "duration_s": 30.0, "min_gap_ms": 1.0, "name": "gone.gputrace"},
                     pinned)
    assert job.done.wait(60) and killed
    assert (job.state, job.error) == ("failed", f"process {target.pid} exited before tracing started; capture "
                                                "discarded (its pid may be reused)")
    assert job.ended is not None and job.ended - job.started < 25, "stopped early, not after 30 s"
    assert not (state / "0").exists() and not list((state / ".staging").iterdir())
    for fd in pinned.values():
        with pytest.raises(OSError):
            os.fstat(fd)  # the job closed its pidfds


def test_no_job_starts_once_the_service_is_stopping(tmp_path: Path) -> None:
    """SIGTERM stops the jobs it finds; a request authorised meanwhile must not start one after them, which
    nothing would stop or wait for (the service would exit under it, its capture half-written)."""
    target = _child()
    state = tmp_path / "state"
    prepare_state_dir(state)
    jobs = JobTable(state, Limits(), lambda line: None)
    jobs.stop_all()
    try:
        with pytest.raises(UserError) as refused:
            jobs.start(0, 0, {"pids": [target.pid], "duration_s": 30.0, "min_gap_ms": 1.0, "name": "late.gputrace"})
    finally:
        target.kill()
    assert str(refused.value) == "the service is shutting down; no new captures"
    assert not jobs.visible_to(0) and not list((state / ".staging").iterdir())


def _frame(body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + body


BAD_FRAMES = {
    "oversized": struct.pack(">I", 0xFFFFFFFF) + b"{}",
    "not json": _frame(b"\xff\xfe garbage"),
    "array": _frame(b"[1, 2, 3]"),
    "deep": _frame(b"[" * 60000 + b"]" * 60000),
    "nan": _frame(b'{"op": "capture", "pids": [1], "duration_s": NaN}'),
    "unknown op": _frame(b'{"op": "exec", "cmd": "sh"}'),
    "extra field": _frame(b'{"op": "capture", "pids": [1], "duration_s": 1, "output": "/etc/x"}'),
    "bool pid": _frame(b'{"op": "capture", "pids": [true], "duration_s": 1}'),
    "negative pid": _frame(b'{"op": "capture", "pids": [-1], "duration_s": 1}'),
    "too many pids": _frame(json.dumps({"op": "capture", "pids": list(range(1, 100)), "duration_s": 1}).encode()),
    "huge duration": _frame(b'{"op": "capture", "pids": [1], "duration_s": 1e30}'),
    "cut off": struct.pack(">I", 100) + b'{"op":',
    "unknown family": _frame(b'{"op": "capture", "pids": [1], "duration_s": 1, "off": ["sched", "gpu"]}'),
    "family not a list": _frame(b'{"op": "capture", "pids": [1], "duration_s": 1, "off": "sched"}'),
}


@pytest.mark.parametrize("what", list(BAD_FRAMES))
def test_malformed_frames_are_rejected_and_the_service_lives(svc: Svc, what: str) -> None:
    reply = svc.raw(BAD_FRAMES[what])
    assert reply["ok"] is False and reply["error"], what
    assert svc.ask({"op": "status"})["ok"] is True
    assert svc.proc.poll() is None


def test_stop_ends_a_capture_early(svc: Svc) -> None:
    child = _child()
    try:
        started = svc.ask({"op": "capture", "pids": [child.pid], "duration_s": 60, "name": "stopped"})
        job_id = started["job"]["id"]
        svc.tracing(job_id)
        t0 = time.monotonic()
        r = svc.client("stop", str(job_id))
        assert r.returncode == 0, r.stderr
        job = _wait_job(svc, job_id, 30 - (time.monotonic() - t0))
    finally:
        child.kill()
    assert job["state"] == "done" and job["stop_reason"] == "stopped"
    assert (svc.state / "0" / "stopped.gputrace").exists()
    assert "no job" in svc.ask({"op": "stop", "job": 99999})["error"]


def test_ctrl_c_on_a_waiting_client_stops_the_job_and_reports_it(svc: Svc) -> None:
    child = _child()
    try:
        client = subprocess.Popen([sys.executable, "-m", "gputrace", "daemon", "capture", "-p", str(child.pid),
                                   "-d", "60", "--name", "interrupted", "--socket", str(svc.sock)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/",
                                  preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # fmt: skip
        assert client.stderr is not None
        assert "capturing pids" in client.stderr.readline()
        [job] = [j for j in svc.ask({"op": "list"})["jobs"] if j["name"].startswith("interrupted")]
        svc.tracing(job["id"])
        client.send_signal(signal.SIGINT)
        out, err = client.communicate(timeout=60)
    finally:
        child.kill()
    assert client.returncode == 0 and "Traceback" not in err, err
    assert "gputraced: stopping the capture, it is still written" in err
    assert "done" in out and "Wrote" in out and (svc.state / "0" / "interrupted.gputrace").exists()


def test_two_captures_starting_at_once_both_finish(tmp_path: Path) -> None:
    """Two jobs load their eBPF programs at the same time, each on its own thread: bcc's compiler is not
    thread-safe (two compiles at once crash the process in libbcc), so the service must take them in turn."""
    service = Svc(tmp_path)
    children = [_child(), _child()]
    try:
        ids = [service.ask({"op": "capture", "pids": [c.pid], "duration_s": 1, "name": f"twin{i}"})["job"]["id"]
               for i, c in enumerate(children)]
        jobs = [_wait_job(service, job_id, 90) for job_id in ids]
        assert service.proc.poll() is None, service.log.text()[-2000:]
    finally:
        for c in children:
            c.kill()
        service.stop(90)
    assert [j["state"] for j in jobs] == ["done", "done"], jobs
    assert all((service.state / "0" / f"twin{i}.gputrace").exists() for i in range(2))


def test_two_jobs_never_share_a_file_name(svc: Svc) -> None:
    """A name a running job of the same user will publish is refused up front, not found taken when the
    second capture is done (and thrown away); two unnamed captures of one pid in the same second get
    different names."""
    child = _child()
    try:
        first = svc.ask({"op": "capture", "pids": [child.pid], "duration_s": 2, "name": "same"})
        again = svc.ask({"op": "capture", "pids": [child.pid], "duration_s": 2, "name": "same"})
        assert again == {"ok": False, "error": f"same.gputrace is the name of your running job {first['job']['id']}; "
                                               "choose another name"}
        _wait_job(svc, first["job"]["id"], 90)
        unnamed = [svc.ask({"op": "capture", "pids": [child.pid], "duration_s": 1}) for _ in range(2)]
        jobs = [_wait_job(svc, r["job"]["id"], 90) for r in unnamed]
    finally:
        child.kill()
    assert [j["state"] for j in jobs] == ["done", "done"], jobs
    names = [j["name"] for j in jobs]
    assert len(set(names)) == 2 and all((svc.state / "0" / n).exists() for n in names), names


def test_the_client_shows_why_a_capture_ended_and_what_it_said(tmp_path: Path) -> None:
    """A waiting client prints what the capture said (here: how the unarmed Python target got its GPU agent)
    and how it ended (early, by a stop request); `list` names why a job failed, not just that it did."""
    service = Svc(tmp_path)
    child = _child()
    try:
        client = subprocess.Popen([sys.executable, "-m", "gputrace", "daemon", "capture", "-p", str(child.pid),
                                   "-d", "60", "--name", "early", "--socket", str(service.sock)],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/")
        wait_for(lambda: any(j["state"] == "running" for j in service.ask({"op": "list"})["jobs"]), 30, "the job")
        assert service.client("stop", "1").returncode == 0
        out, err = client.communicate(timeout=90)
        os.chown(service.state / "0", 65534, 65534)  # no longer root's: publishing the next capture must fail
        r = service.client("capture", "-p", str(child.pid), "-d", "1", "--name", "unpublished")
        listed = service.client("list")
    finally:
        child.kill()
        service.stop(90)
    assert client.returncode == 0, err
    assert f"GPU agent of pid {child.pid}: injected (ptrace" in err and "tracing cost: " in err, err
    assert "job 1: done" in out and "ended by Ctrl-C, SIGTERM or a stop request" in out, out
    why = f"{service.state / '0'} belongs to uid 65534, not 0"
    assert r.returncode == 1 and f"job 2: failed, uid 0, pids [{child.pid}], unpublished.gputrace: {why}" in r.stdout
    assert f"unpublished.gputrace: {why}" in listed.stdout, listed.stdout


def test_listens_on_unix_sockets_only(svc: Svc) -> None:
    fd_dir = Path(f"/proc/{svc.proc.pid}/fd")
    sockets = []
    for fd in os.listdir(fd_dir):
        try:
            link = os.readlink(fd_dir / fd)
        except FileNotFoundError:
            continue  # a client connection closing meanwhile
        if link.startswith("socket:["):
            sockets.append(link[8:-1])
    unix = {line.split()[6] for line in Path("/proc/net/unix").read_text().splitlines()[1:]}
    inet = set()
    for table in ("tcp", "tcp6", "udp", "udp6", "raw", "raw6"):
        inet |= {line.split()[9] for line in Path(f"/proc/net/{table}").read_text().splitlines()[1:]}
    assert sockets and not inet & set(sockets), "an IP socket is open"
    assert unix & set(sockets), "the listening unix socket"
    status = svc.ask({"op": "status"})
    caps = int(status["capabilities"], 16)
    assert not caps >> 21 & 1, "CAP_SYS_ADMIN must be dropped after startup"
    assert caps >> 39 & 1 and caps >> 38 & 1, "CAP_BPF and CAP_PERFMON kept"


def test_sigterm_stops_cleanly(tmp_path: Path) -> None:
    service = Svc(tmp_path)
    err = service.stop(60)
    assert service.proc.returncode == 0, err
    assert "gputraced stopped" in err and not service.sock.exists()


def test_second_service_on_same_socket_is_refused(svc: Svc) -> None:
    r = subprocess.run([sys.executable, "-m", "gputrace", "daemon", "--socket", str(svc.sock),
                        "--state-dir", str(svc.state)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and "another gputraced is listening" in r.stderr


def test_unit_file_verifies() -> None:
    systemd_analyze = shutil.which("systemd-analyze")
    assert systemd_analyze, "apt-get install systemd (for systemd-analyze)"
    unit = (ROOT / "systemd" / "gputraced.service").read_text()
    assert "/usr/local/bin/gputraced" in unit
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "gputraced.service"
        path.write_text(unit.replace("/usr/local/bin/gputraced", str(Path(sys.executable).parent / "gputraced")))
        r = subprocess.run([systemd_analyze, "verify", str(path)], capture_output=True, text=True, timeout=60)
        assert r.returncode == 0 and not r.stderr.strip(), r.stderr
        sec = subprocess.run([systemd_analyze, "security", "--offline=yes", str(path)],
                             capture_output=True, text=True, timeout=60)
    level = float(sec.stdout.strip().splitlines()[-1].split("level for gputraced.service:")[1].split()[0])
    assert level <= 3.0, sec.stdout[-2000:]
    for must in ("ProtectSystem=strict", "NoNewPrivileges=yes", "PrivateTmp=yes", "RestrictAddressFamilies=AF_UNIX"):
        assert must in unit
    assert "CAP_SYS_ADMIN" not in unit.split("CapabilityBoundingSet=")[1].splitlines()[0]


def test_silent_and_excess_connections_are_cut_off(tmp_path: Path) -> None:
    service = Svc(tmp_path, "--request-timeout-s", "1")
    idle = []
    try:
        for _ in range(32):
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.connect(str(service.sock))
            idle.append(s)
        # every slot taken once the service has accepted the 32 (a status asked before then is answered)
        busy = wait_for(lambda: service.raw(_frame(b'{"op": "status"}')).get("error", ""), 10, "the service busy")
        assert busy.startswith("busy"), busy
        idle[0].settimeout(5)
        assert (recv_frame(idle[0], 1 << 20) or {}).get("error") == "request not received in time"
        for s in idle:
            s.close()
        deadline = time.monotonic() + 10
        while not service.raw(_frame(b'{"op": "status"}')).get("ok"):
            assert time.monotonic() < deadline, "slots were not freed"
            time.sleep(0.1)
    finally:
        service.stop(60)


HOLD_CONNECTIONS = """
import socket, sys
held = []
for _ in range(int(sys.argv[2])):
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.connect(sys.argv[1])
    held.append(s)
print("ready", flush=True)
sys.stdin.read()
"""


def test_one_user_cannot_take_every_connection() -> None:
    """Connections are counted per user: one holding 32 idle ones (reconnecting as each is cut off) would
    otherwise leave every other user, root included, nothing but "busy"."""
    with running_service("gputraced-hog-", "--request-timeout-s", "30") as service:
        hog = subprocess.Popen([*NOBODY, sys.executable, "-c", HOLD_CONNECTIONS, str(service.sock), "32"],
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert hog.stdout is not None and hog.stdout.readline() == "ready\n"
            wait_for(lambda: service.raw(_frame(b'{"op": "status"}')).get("ok"), 10, "a slot for root")
            theirs = service.client("status", user=NOBODY)
        finally:
            hog.kill()
            hog.wait()
    assert theirs.returncode == 2, theirs.stdout
    assert "busy: you have 8 connections open to gputraced (the limit per user); close one" in theirs.stderr


def test_a_request_dripped_slowly_is_cut_off_at_the_deadline(tmp_path: Path) -> None:
    """The whole frame must arrive within the request timeout, not each byte: a client sending one byte at a
    time just under it would otherwise hold a connection slot for hours (32 such clients lock everyone out)."""
    service = Svc(tmp_path, "--request-timeout-s", "1")
    frame = _frame(b'{"op": "status"}')
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(str(service.sock))
            t0 = time.monotonic()
            with contextlib.suppress(BrokenPipeError, ConnectionResetError):
                for byte in frame:
                    s.sendall(bytes([byte]))
                    time.sleep(0.25)
                    if select.select([s], [], [], 0)[0]:
                        break  # the service answered (and closed) before the frame was complete
            s.settimeout(10)
            reply = recv_frame(s, 1 << 20)
            waited = time.monotonic() - t0
    finally:
        service.stop(60)
    assert reply == {"ok": False, "error": "request not received in time"}, reply
    assert waited < 3, f"cut off after {waited:.1f} s, not at the 1 s deadline"


def test_service_sends_each_capture_to_an_otlp_collector(tmp_path: Path) -> None:
    from concurrent import futures

    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    received: list[str] = []

    class Receiver(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request: Any, context: Any) -> Any:  # noqa: N802
            received.extend(s.name for rs in request.resource_spans for ss in rs.scope_spans for s in ss.spans)
            return trace_service_pb2.ExportTraceServiceResponse()

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Receiver(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    service = Svc(tmp_path, "--otlp", f"127.0.0.1:{port}")
    child = _child()
    try:
        reply = service.ask({"op": "capture", "pids": [child.pid], "duration_s": 1, "wait": True})
        assert reply["event"] == "started"
        job = _wait_job(service, reply["job"]["id"])
    finally:
        child.kill()
        service.stop(60)
        server.stop(None)
    assert job["state"] == "done", job
    assert job["otlp"] == {"sent": len(received), "dropped": 0} and "gputrace capture" in received


def test_a_user_s_running_python_3_14_gets_the_agent_through_the_service(svc: Svc) -> None:
    """The service keeps no CAP_SYS_ADMIN, but attaching to its caller's own process on the host needs
    none: the helper runs as that user (CAP_SETUID, CAP_SETGID)."""
    py314 = ROOT / "build" / "python3.14" / "usr" / "bin" / "python3.14"
    assert py314.is_file(), f"{py314} is missing: run ./setup.sh --test"
    code = ("import time\nfrom gputrace.sim import Device\ns = Device(0).stream()\nprint('ready', flush=True)\n"
            "while True:\n    s.launch('step', duration_ms=5); s.synchronize(); time.sleep(0.005)\n")
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUTRACE_")}
    child = subprocess.Popen([*NOBODY, str(py314), "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                             env={**env, "PYTHONPATH": str(ROOT)})
    try:
        assert child.stdout is not None and child.stdout.readline() == b"ready\n"
        r = svc.client("capture", "-p", str(child.pid), "-d", "3", "--name", "attached", user=NOBODY)
    finally:
        child.kill()
        _, err = child.communicate(timeout=10)
    assert r.returncode == 0, r.stdout + r.stderr
    assert b"Traceback" not in err
    with CaptureReader(svc.state / "65534" / "attached.gputrace") as reader:
        kernels = [rec for rec in reader.records() if type(rec).__name__ == "GpuKernel"]
    assert len(kernels) > 20 and {k.pid for k in kernels} == {child.pid}


def _rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def _ended_job(svc: Svc, job_id: int, timeout_s: float = 60) -> dict[str, Any]:
    """The job once the service has ended it: its end time is set after its memory was given back."""
    deadline = time.monotonic() + timeout_s
    while (job := next(j for j in svc.ask({"op": "list"})["jobs"] if j["id"] == job_id))["ended"] is None:
        assert time.monotonic() < deadline, job
        time.sleep(0.05)
    return job


# A Python 3.14 target the service arms with the agent, launching simulated kernels: each launch is two records
# its agent sends (the call and the kernel), up to ~10,000 a second, within the agent's budget (200,000): what
# a busy training process sends, and few enough that the service's report on two cores takes seconds.
_LAUNCHER = ("import time\nfrom gputrace.sim import Device\ns = Device(0).stream()\nprint('ready', flush=True)\n"
             "while True:\n    for _ in range(100):\n        s.launch('k', duration_ms=0)\n"
             "    s.synchronize()\n    time.sleep(0.02)\n")


def test_the_service_s_memory_returns_to_its_warm_level_after_large_jobs() -> None:
    """Idle is the service's level after its first job: libbcc, LLVM and clang (~90 MiB of text mapped at
    the first compile) and the modules a capture imports stay for the life of the process. From there, a
    job's records, report and BPF objects are given back when it ends: after a large job (a target making
    system calls as fast as it can, and an armed Python target whose agent sends thousands of records a
    second) the service is within 64 MiB of that level, and a second such job does not take it beyond."""
    py314 = ROOT / "build" / "python3.14" / "usr" / "bin" / "python3.14"
    assert py314.is_file(), f"{py314} is missing: run ./setup.sh --test"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("GPUTRACE_")}, "PYTHONPATH": str(ROOT)}
    stats = "import os\nwhile True: os.stat('/')"

    def job(duration_s: float, armed: bool) -> dict[str, Any]:
        children = [subprocess.Popen([*NOBODY, sys.executable, "-c", stats])]
        try:
            if armed:
                children.append(subprocess.Popen([*NOBODY, str(py314), "-c", _LAUNCHER], stdout=subprocess.PIPE,
                                                 env=env))
                assert children[-1].stdout is not None and children[-1].stdout.readline() == b"ready\n"
            reply = service.ask({"op": "capture", "pids": [c.pid for c in children], "duration_s": duration_s})
            assert reply["ok"], reply
            ended = _ended_job(service, reply["job"]["id"])
        finally:
            for c in children:
                c.kill()
                c.wait(timeout=10)
        assert ended["state"] == "done", ended
        return ended

    with running_service("gputraced-memory-") as service:
        idle = _rss_mib(service.proc.pid)
        job(1, armed=False)
        warm = _rss_mib(service.proc.pid)
        big = job(3, armed=True)
        after_one = _rss_mib(service.proc.pid)
        with CaptureReader(big["files"][0]) as reader:
            kinds = collections.Counter(type(r).__name__ for r in reader.records())
        job(3, armed=True)
        after_two = _rss_mib(service.proc.pid)
    print(f"gputraced RSS: idle {idle:.0f} MiB, warm {warm:.0f} MiB, after a large job {after_one:.0f} MiB, "
          f"after a second {after_two:.0f} MiB; the large job's records: {dict(kinds)}")
    assert kinds["GpuKernel"] > 2_000 and kinds["Syscall"] + kinds["SyscallAgg"] > 0, kinds
    assert after_one <= warm + 64, f"{after_one:.0f} MiB after a large job, warm level {warm:.0f} MiB"
    assert after_two <= warm + 64, f"{after_two:.0f} MiB after a second large job, warm level {warm:.0f} MiB"


def test_a_capture_cut_off_by_a_killed_service_is_handed_over_at_its_next_start() -> None:
    """The service killed mid-capture (a crash, SIGKILL, the machine's OOM killer) leaves the capture in its
    root-only staging: the next start hands it to the user who asked, cut off but readable, and clears
    staging; nothing of it is left where no one sees it."""
    base = Path(tempfile.mkdtemp(prefix="gputraced-crash-"))
    base.chmod(0o755)  # uid 65534 must reach the socket
    service = Svc(base, "--request-timeout-s", "30")
    child = _child(NOBODY)
    try:
        r = service.client("capture", "-p", str(child.pid), "-d", "60", "--name", "crash", "--no-wait", user=NOBODY)
        assert r.returncode == 0, r.stderr
        staging = service.state / ".staging"
        wait_for(lambda: any(f.stat().st_size > 4096 for d in staging.iterdir() for f in d.iterdir()), 30,
                 "the capture to write its first records")
        service.stop(30, kill=True)
        [left] = [f for d in staging.iterdir() for f in d.iterdir()]
        assert left.name.endswith(".partial"), left
        service.sock.unlink()  # left by the killed service: wait for the new one's
        service = Svc(base, "--request-timeout-s", "30")  # the same state directory
    finally:
        child.kill()
        err = service.stop(90)
    try:
        cap = service.state / "65534" / "crash.cut-off.gputrace"
        st = cap.stat()
        assert (st.st_uid, stat.S_IMODE(st.st_mode)) == (65534, 0o600)
        assert "crash.cut-off.gputrace of uid 65534 was cut off when the service last stopped" in err, err
        assert not list((service.state / ".staging").iterdir()), "staging left behind"
        with CaptureReader(cap) as reader:
            recs = list(reader.records())
            assert not reader.complete and child.pid in reader.header["targets"]
        assert any(type(rec).__name__ == "ProcInfo" and rec.pid == child.pid for rec in recs)
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_staging_a_capture_of_no_user_is_removed_and_said_so(tmp_path: Path) -> None:
    """What staging holds that names no user (a header cut short, not a capture of this service, a link) is
    removed at start and logged, never handed to anyone."""
    from gputrace.daemon.service.jobs import prepare_state_dir, salvage_staging

    prepare_state_dir(tmp_path)
    stage = tmp_path / ".staging" / "3-x"
    stage.mkdir()
    (stage / ".cut.gputrace.77.partial").write_bytes(b"\x92\xa1H")  # the header's first bytes only
    (stage / "other.gputrace").write_bytes(b"not a capture")
    (tmp_path / ".staging" / "4-link").symlink_to("/etc")
    said: list[str] = []
    assert salvage_staging(tmp_path, said.append) == 0
    assert not list((tmp_path / ".staging").iterdir()) and os.path.exists("/etc/passwd")
    assert sorted(m.split(" ")[0] for m in said) == [".cut.gputrace.77.partial", "other.gputrace"], said
    assert not [p for p in tmp_path.iterdir() if p.name != ".staging"], "nothing handed over"


def test_four_users_at_their_limit_leave_root_a_slot() -> None:
    """Root has a pool of its own: four users holding 8 idle connections each (all the others') still
    leave root's status served."""
    with running_service("gputraced-hogs-", "--request-timeout-s", "30") as service:
        hogs = [subprocess.Popen(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", sys.executable,
                                  "-c", HOLD_CONNECTIONS, str(service.sock), "8"],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                for uid in (65534, 65533, 65532, 65531)]
        try:
            for hog in hogs:
                assert hog.stdout is not None and hog.stdout.readline() == "ready\n"
            theirs = service.client("status", user=["setpriv", "--reuid=65530", "--regid=65530", "--clear-groups"])
            for _ in range(3):
                assert service.raw(_frame(b'{"op": "status"}')).get("ok"), "root refused"
        finally:
            for hog in hogs:
                hog.kill()
                hog.wait()
    assert theirs.returncode == 2 and "busy: too many connections" in theirs.stderr


def test_a_non_dumpable_process_of_the_caller_is_refused() -> None:
    """As ptrace_may_access refuses it: a process that made itself non-dumpable is not the caller's to trace,
    though every uid of it is the caller's."""
    code = ("import ctypes, sys, time\nif sys.argv[1] == '0':\n    ctypes.CDLL(None).prctl(4, 0, 0, 0, 0)\n"
            "print('ready', flush=True)\ntime.sleep(60)")
    children = [subprocess.Popen([*NOBODY, sys.executable, "-c", code, flag], stdout=subprocess.PIPE)
                for flag in ("0", "1")]
    try:
        for c in children:
            assert c.stdout is not None and c.stdout.readline() == b"ready\n"
        with pytest.raises(ProtocolError, match="is not dumpable"):
            authorize(65534, [children[0].pid])
        close_pidfds(authorize(65534, [children[1].pid]))
        close_pidfds(authorize(0, [children[0].pid]))  # root may
    finally:
        for c in children:
            c.kill()
            c.wait()
            assert c.stdout is not None
            c.stdout.close()


def test_user_quota_cuts_off_a_capture_and_refuses_the_next() -> None:
    """A 1 MiB quota: a capture that grows past it is cut off and kept (readable to the cut), the user is then
    refused up front."""
    # every sleep is a system call over the service's 100 us threshold: the capture grows by ~100 KiB/s
    code = "import time\nwhile True: time.sleep(0.0002)"
    with running_service("gputraced-quota-", "--user-quota-mib", "1") as service:
        child = subprocess.Popen([*NOBODY, sys.executable, "-c", code])
        try:
            r = service.client("capture", "-p", str(child.pid), "-d", "120", "--name", "big", "--json", user=NOBODY)
            refused = service.client("capture", "-p", str(child.pid), "-d", "1", user=NOBODY)
        finally:
            child.kill()
        assert r.returncode == 1, r.stdout + r.stderr  # ended, but not as asked: the client says so
        job = json.loads(r.stdout)["job"]
        assert job["state"] == "cut_off", job
        assert job["error"].startswith("writing big.gputrace: over your quota of 1 MiB here (gputraced "
                                       "--user-quota-mib); the capture is cut off there: "), job["error"]
        cap = service.state / "65534" / "big.gputrace"
        assert job["files"] == [str(cap)] and cap.stat().st_size <= 1 << 20
        assert time.time() - job["started"] < 100, "cut off at the quota, not at the end of its duration"
        with CaptureReader(cap) as reader:
            assert not reader.complete and any(True for _ in reader.records())
        assert refused.returncode == 2
        assert refused.stderr.strip().splitlines()[-1].startswith(
            "gputrace: error: gputraced refused: over your quota: your captures here take 1.0 MiB of the 1 MiB each "
            "user may keep, less than 1 MiB left (gputraced --user-quota-mib); remove some from "
            f"{service.state / '65534'} and try again"), refused.stderr
        assert not list((service.state / ".staging").iterdir()), "staging left behind"


def test_user_quota_option_is_checked() -> None:
    r = subprocess.run([sys.executable, "-m", "gputrace", "daemon", "--user-quota-mib", "nan", "--socket",
                        "/nonexistent/s", "--state-dir", "/nonexistent/st"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and r.stderr == "gputrace: error: --user-quota-mib must be a number of MiB >= 0 (0: no " \
        "quota)\n", r.stderr
