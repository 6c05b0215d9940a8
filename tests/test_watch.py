"""gputraced --watch for real: a service on a private socket and state dir, real simulated GPU jobs found as they
start, flight recorders on disk, dumps by request and by trigger, the metrics textfile, floods and restarts."""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from otlp_receiver import grpc_metrics_receiver, http_metrics_receiver
from waiting import connectable, wait_for
from workloads.loopdev import LoopFs, write_file

from gputrace.agent import arming
from gputrace.capture import CaptureReader
from gputrace.daemon.finish import analyse
from gputrace.daemon.service.protocol import recv_frame, send_frame
from gputrace.daemon.watch.tally import GPU_OPS, GpuTally
from gputrace.records import TracingCost

pytestmark = pytest.mark.kernel  # gputraced watching real jobs: eBPF captures, loop devices, setpriv, as root

ROOT = Path(__file__).resolve().parents[1]
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]
BLKIO = Path("/sys/fs/cgroup/blkio")

# A training loop on the simulated GPU: KERNEL_MS of work, then SLEEP_MS of host time, for SECONDS. Given a file
# and a "go" path, once the go path exists it also reads 256 KiB of the file (from the device) every step.
JOB = """
import os, sys, time
from gputrace.sim import Device

secs, kernel_ms, sleep_ms = (float(a) for a in sys.argv[1:4])
slow, go = (sys.argv[4], sys.argv[5]) if len(sys.argv) > 5 else ("", "")
s = Device(0).stream()
print("up", flush=True)
t, fd, off = time.monotonic(), -1, 0
while time.monotonic() - t < secs:
    if slow and fd < 0 and os.path.exists(go):
        fd = os.open(slow, os.O_RDONLY)
        print("reading", flush=True)
    if fd >= 0:
        if not os.pread(fd, 256 << 10, off):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            off = 0
        off += 256 << 10
    s.launch("step", duration_ms=kernel_ms)
    s.synchronize()
    time.sleep(sleep_ms / 1000)
"""


class WatchSvc:
    def __init__(self, base: Path, *extra: str) -> None:
        self.base, self.sock, self.state = base, base / "run" / "gputraced.sock", base / "state"
        self.attach = base / "attach"
        self.metrics = base / "metrics" / "gputrace.prom"
        self.metrics.parent.mkdir(exist_ok=True)
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("GPUTRACE_")}
        self.env["GPUTRACE_ATTACH_DIR"] = str(self.attach)
        self.job_file = base / "job.py"
        self.job_file.write_text(JOB)
        os.chmod(self.job_file, 0o644)
        self.extra = extra
        self.start()

    def start(self) -> None:
        """The service, with the options it was first started with (a restart keeps them)."""
        self.sock.unlink(missing_ok=True)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gputrace", "daemon", "--socket", str(self.sock), "--state-dir", str(self.state),
             "--watch", "--watch-scan-s", "0.2", "--flight-seconds", "8", "--flight-segment-s", "1",
             "--metrics-textfile", str(self.metrics), *self.extra],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT, env=self.env)
        connectable(self.sock, 30, alive=lambda: self.proc.poll() is None)  # accepting, not merely made

    def stop(self) -> str:
        """SIGTERM, as systemd stops it; its log."""
        self.proc.send_signal(signal.SIGTERM)
        _, err = self.proc.communicate(timeout=90)
        return err

    def ask(self, req: dict[str, Any]) -> dict[str, Any]:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(30)
            s.connect(str(self.sock))
            send_frame(s, req)
            reply = recv_frame(s, 16 << 20)
            assert reply is not None
            return reply

    def watched(self, pid: int) -> dict[str, Any] | None:
        jobs = [j for j in self.ask({"op": "status"})["watch"]["jobs"] if j["pid"] == pid]
        return jobs[-1] if jobs else None

    def client(self, *args: str, user: list[str] | None = None) -> subprocess.CompletedProcess[str]:
        return subprocess.run([*(user or []), sys.executable, "-m", "gputrace", "daemon", *args, "--socket",
                               str(self.sock)], capture_output=True, text=True, timeout=120, cwd="/")

    def job(self, *args: str, user: list[str] | None = None) -> subprocess.Popen[str]:
        """A simulated GPU job, armed (it announces itself as a GPU process), once it runs."""
        env = {**self.env, **arming.environment(None, base=self.env)}
        p = subprocess.Popen([*(user or []), sys.executable, str(self.job_file), *args], env=env,
                             stdout=subprocess.PIPE, text=True, cwd="/")
        assert p.stdout is not None and p.stdout.readline().strip() == "up"
        return p


def wait_until(what: str, check: Callable[[], Any], timeout: float = 60.0) -> Any:
    """``check``'s first true value; fail saying ``what`` otherwise."""
    return wait_for(check, timeout, what)


@contextlib.contextmanager
def watch_service(*extra: str) -> Iterator[WatchSvc]:
    if os.geteuid() != 0:
        pytest.fail("watch-mode tests run as root (eBPF, a second user)")
    base = Path(tempfile.mkdtemp(prefix="gputraced-watch-"))
    os.chmod(base, 0o755)  # uid 65534 reaches the socket and the job script
    svc = WatchSvc(base, *extra)
    try:
        yield svc
    finally:
        if svc.proc.poll() is None:
            svc.stop()
        shutil.rmtree(base, ignore_errors=True)


def _metric(text: str, name: str, **labels: str) -> float | None:
    for line in text.splitlines():
        m = re.fullmatch(rf"{name}(?:\{{(.*)\}})? (\S+)", line)
        if m and all(f'{k}="{v}"' in (m[1] or "").split(",") for k, v in labels.items()):
            return float(m[2])
    return None


def _kill(*procs: subprocess.Popen[str]) -> None:
    for p in procs:
        p.kill()
        p.wait()


def test_watched_jobs_come_and_go_and_their_metrics_are_right() -> None:
    with watch_service() as svc:
        jobs = [svc.job("30", "10", "10") for _ in range(3)]
        try:
            for p in jobs:  # found, traced, and at least two segments with GPU records analysed
                wait_until(f"pid {p.pid} watched and measured",
                           lambda p=p: (j := svc.watched(p.pid)) and j["state"] == "watching" and
                           j["busy_ratio"] is not None and j["segments"] >= 3, timeout=90)

            def all_measured() -> str:  # every job with a second of GPU work or more in the file
                text = svc.metrics.read_text() if svc.metrics.exists() else ""
                ok = all(_metric(text, "gputrace_gpu_busy_ratio", pid=str(p.pid), device="0") is not None
                         and (_metric(text, "gputrace_gpu_busy_seconds_total", pid=str(p.pid), device="0") or 0) >= 1
                         for p in jobs)
                return text if ok else ""

            text = wait_until("every job in the metrics file", all_measured)
            for p in jobs:
                busy = _metric(text, "gputrace_gpu_busy_ratio", pid=str(p.pid), device="0")
                # 10 ms kernels, 10 ms sleeps: half busy (the sync and the loop's own time come on top of the sleep)
                assert busy is not None and 0.3 <= busy <= 0.6, (busy, text)
                # and the sleeps are the stalls: about as long as the kernels ran
                sleep = _metric(text, "gputrace_stall_seconds_total", pid=str(p.pid), cause="sleep")
                ran = _metric(text, "gputrace_gpu_busy_seconds_total", pid=str(p.pid), device="0")
                assert sleep is not None and ran, (p.pid, text)
                assert 0.5 * ran <= sleep <= 1.5 * ran, (p.pid, sleep, ran)
                pattern = rf'gputrace_stall_seconds_total{{pid="{p.pid}",comm="python",cause="([^"]+)"}} (\S+)'
                causes = re.findall(pattern, text)
                assert max(causes, key=lambda c: float(c[1]))[0] == "sleep", causes
                job = svc.watched(p.pid)
                assert job is not None and job["found_by"] == "armed" and job["top_cause"], job
            # one set of kernel programs for the three jobs (one owner): loaded once, every job's processes in it
            kernel = svc.ask({"op": "status"})["watch"]["kernel_programs"]
            assert kernel["loaded"] == 1 and len(kernel["sets"]) == 1, kernel
            # (GPU processes other tests on the host run may be watched too: root's, they share the set)
            assert kernel["sets"][0]["jobs"] >= 3 and kernel["sets"][0]["processes"] >= 3, kernel
            # its busiest programs: the scheduler's and the system calls' hooks run for every such event on the host
            busiest = kernel["sets"][0]["busiest"]
            assert busiest and all(b["runs_per_s"] > 0 and b["ns_per_run"] > 0 for b in busiest), busiest
            assert {b["program"] for b in busiest} & {"sys_enter", "sys_exit", "sched_switch", "sched_waking"}, busiest
            text = svc.client("status").stdout
            assert "watch kernel programs: 1 set(s) loaded now" in text and "busiest programs" in text, text
            assert (svc.metrics.stat().st_mode & 0o777) == 0o644
            assert not list(svc.metrics.parent.glob(".*")), "a temporary metrics file left behind"
        finally:
            _kill(*jobs)
        for p in jobs:
            wait_until(f"pid {p.pid} seen ended", lambda p=p: (svc.watched(p.pid) or {}).get("state") == "ended")
        flight = svc.state / ".flight"
        assert (flight.stat().st_mode & 0o777) == 0o700
        for p in jobs:
            [d] = flight.glob(f"{p.pid}-*")
            segs = sorted(d.glob("seg-*.gputrace"))
            assert segs and not list(d.glob(".*partial")), list(d.iterdir())
            with CaptureReader(segs[-1]) as reader:  # each segment is a whole capture on its own
                kinds = {type(r).__name__ for r in reader.records()}
                assert reader.complete, reader.problem
            assert {"GpuDevice", "ProcInfo"} <= kinds, kinds


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_metrics_arrive_at_a_real_otlp_receiver(protocol: str) -> None:
    receiving = grpc_metrics_receiver if protocol == "grpc" else http_metrics_receiver
    with receiving() as (receiver, port), watch_service("--otlp", f"127.0.0.1:{port}", "--otlp-protocol", protocol,
                                                        "--otlp-metrics-s", "1") as svc:
        job = svc.job("60", "10", "10")
        pid = str(job.pid)
        try:
            wait_until("the job measured", lambda: (j := svc.watched(job.pid)) and j["segments"] >= 4
                       and j["busy_ratio"] is not None, timeout=90)

            def measured(name: str, request: Any = None, **labels: str) -> list[float]:
                return [v for attrs, v in receiver.points(name, request) if attrs.get("pid") == pid
                        and all(attrs.get(k) == want for k, want in labels.items())]

            def arrived() -> bool:  # an export of the figures of a second of GPU work or more
                return sum(measured("gputrace_gpu_busy_seconds_total", device="0")) >= 1.0 and bool(
                    measured("gputrace_stall_seconds_total", cause="sleep"))

            with receiver.arrived:
                receiver.arrived.wait_for(lambda: len(receiver.requests) > 0 and arrived(), timeout=60)
            assert arrived(), receiver.requests[-1:] if receiver.requests else "no request arrived"
            with receiver.arrived:  # one export's figures, not several's as more arrive
                request = receiver.requests[-1]
            [busy] = measured("gputrace_gpu_busy_ratio", request, device="0")
            [sleep] = measured("gputrace_stall_seconds_total", request, cause="sleep")
            [ran] = measured("gputrace_gpu_busy_seconds_total", request, device="0")
            assert 0.3 <= busy <= 0.6, busy  # 10 ms kernels, 10 ms sleeps
            assert 0.5 * ran <= sleep <= 1.5 * ran, (sleep, ran)
            resource = {kv.key: kv.value.string_value for rm in request.resource_metrics
                        for kv in rm.resource.attributes}
            assert resource["service.name"] == "gputraced", resource
            kinds = {m.name: (m.WhichOneof("data"), m.unit) for rm in request.resource_metrics
                     for sm in rm.scope_metrics for m in sm.metrics}
            assert kinds["gputrace_stall_seconds_total"] == ("sum", "s"), kinds
            assert kinds["gputrace_gpu_busy_ratio"] == ("gauge", "1"), kinds
            otlp = svc.ask({"op": "status"})["watch"]["otlp"]
            assert otlp["exports"] >= 1 and otlp["failed"] == 0, otlp
        finally:
            _kill(job)
        svc.stop()
        text = svc.metrics.read_text()  # the textfile has the same figures, from the same tally
        last = _metric(text, "gputrace_stall_seconds_total", pid=pid, cause="sleep")
        assert last is not None and last >= sleep, (last, sleep)


def test_a_segments_gpu_tally_is_its_reports_busy_and_stall_time(tmp_path: Path) -> None:
    """What every segment gets without the full analysis equals what the full analysis says, for a real job's
    capture, with the GPU records fed in batches out of order (as several streams' batches arrive)."""
    (tmp_path / "job.py").write_text(JOB)
    cap = tmp_path / "job.gputrace"
    done = subprocess.run([sys.executable, "-m", "gputrace", "capture", "-f", "--no-perfetto", "--off", "sampler",
                           "-o", str(cap), "--", sys.executable, str(tmp_path / "job.py"), "3", "5", "3"],
                          capture_output=True, text=True, timeout=180, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    with CaptureReader(cap) as reader:
        ops = [r for r in reader.records() if type(r).__name__ in GPU_OPS]
    assert len(ops) > 100, len(ops)
    tally = GpuTally(1_000_000)
    for i in range(0, len(ops), 50):
        tally.add(list(reversed(ops[i:i + 50])))
    gpu = tally.take()
    summary = analyse(cap, 1.0)["summary"]
    assert (gpu.busy_ns, gpu.window_ns, gpu.stall_ns) == (summary["busy_ns"], summary["window_ns"],
                                                          summary["stall_ns"]), (gpu, summary)
    assert gpu.stalls == summary["stalls"] > 100 and gpu.late == 0


def test_dump_by_pid_is_for_the_jobs_owner() -> None:
    with watch_service() as svc:
        mine = svc.job("60", "5", "5", user=NOBODY)
        roots = svc.job("60", "5", "5")
        try:
            for p in (mine, roots):  # segments that hold GPU work (the agent's first records can come late)
                wait_until(f"pid {p.pid} recorded", lambda p=p: (j := svc.watched(p.pid) or {}).get("segments", 0) >= 2
                           and j.get("busy_ratio") is not None, timeout=90)
            r = svc.client("dump", str(mine.pid), user=NOBODY)
            assert r.returncode == 0, r.stdout + r.stderr
            path = Path(r.stdout.split("Wrote ")[1].split()[0])
            assert path.parent == svc.state / "65534" and path.name.endswith("-request.gputrace"), path
            st = path.stat()
            assert (st.st_uid, st.st_mode & 0o777) == (65534, 0o600)
            refused = svc.client("dump", str(roots.pid), user=NOBODY)
            assert refused.returncode != 0 and "not allowed" in refused.stderr, refused.stderr
            assert not list((svc.state / "65534").glob(f"flight-*-{roots.pid}-*")), "another user's job was dumped"
            r = svc.client("dump", str(mine.pid))  # root may dump anyone's: it goes to the job's owner
            assert r.returncode == 0 and "/65534/" in r.stdout, r.stdout + r.stderr
            # a capture of a watched job cannot have its agent (one session at a time): it says how to get the
            # job's GPU work from the service instead
            cap = subprocess.run([sys.executable, "-m", "gputrace", "capture", "-p", str(roots.pid), "-d", "0.5",
                                  "--no-perfetto", "-o", str(svc.base / "beside.gputrace")],
                                 capture_output=True, text=True, timeout=120, env=svc.env)
            assert cap.returncode == 0, cap.stderr
            assert f"is the gputrace service's (pid {svc.proc.pid}), which watches that process: `gputrace daemon " \
                   f"dump {roots.pid} --socket {svc.sock}`" in cap.stderr, cap.stderr
        finally:
            _kill(mine, roots)
        report = subprocess.run([sys.executable, "-m", "gputrace", "report", str(path), "--json"],
                                capture_output=True, text=True, timeout=120)
        assert report.returncode == 0, report.stderr
        data = json.loads(report.stdout)
        assert data["devices"] and data["devices"][0]["simulated"] and data["capture"]["complete"], data["capture"]
        assert mine.pid in data["capture"]["pids"] and data["summary"]["busy_ns"] > 0
        with CaptureReader(path) as reader:
            list(reader.records())
            assert reader.trailer is not None and reader.trailer["trigger"]["kind"] == "request"
            assert reader.header["flight"]["trigger"]["kind"] == "request"


def test_a_job_that_starts_reading_a_slow_file_is_dumped_naming_it(loopfs: LoopFs) -> None:
    slow = write_file(loopfs.mountpoint / "shard-slow.bin", 8 << 20)
    go = loopfs.mountpoint / "go"
    group = BLKIO / f"gputrace-watch-{os.getpid()}"
    group.mkdir()
    try:
        (group / "blkio.throttle.read_bps_device").write_text(f"{loopfs.majmin} {1 << 20}\n")
        with watch_service("--trigger-cooldown-s", "0.001") as svc:
            job = svc.job("90", "5", "5", str(slow), str(go))
            try:
                (group / "cgroup.procs").write_text(str(job.pid))
                wait_until("a baseline", lambda: (svc.watched(job.pid) or {}).get("top_cause") == "sleep", 90)
                go.touch()
                assert job.stdout is not None and job.stdout.readline().strip() == "reading"
                dump = wait_until("a dump for the cause change", lambda: [
                    d for d in (svc.watched(job.pid) or {}).get("dumps", [])
                    if d["trigger"]["kind"] == "cause_change" and d["trigger"]["detail"].endswith("-> storage")])
            finally:
                _kill(job)
            log = svc.stop()
            assert "dumped" in log and "cause_change" in log and "-> storage" in log, log[-2000:]
            report = subprocess.run([sys.executable, "-m", "gputrace", "report", dump[0]["path"], "--json"],
                                    capture_output=True, text=True, timeout=120)
            with CaptureReader(dump[0]["path"]) as reader:  # the cost meter's ticks in it, for a failure to show
                ticks = (sorted({(r.ts, r.source) for r in reader.records() if isinstance(r, TracingCost)})[:12],
                         reader.trailer)
    finally:
        with contextlib.suppress(OSError):
            group.rmdir()
    assert report.returncode == 0, report.stderr
    capture = json.loads(report.stdout)["capture"]
    # what tracing cost over the dump's window, from the cost meter's records in it: the service's part
    # for the job, its kernel programs' and its agent's
    assert "overhead" in capture, ticks
    overhead = capture["overhead"]
    assert overhead["cpu_share"] > 0 and {"session", "ebpf", "agent"} <= overhead["by_source"].keys(), overhead
    stalls = json.loads(report.stdout)["stalls"]
    storage = [s for s in stalls if s["cause"] == "storage"]
    assert storage and {s["culprit"]["object"] for s in storage} == {str(slow)}, stalls[-3:]


def test_a_flood_of_short_lived_gpu_processes_stays_bounded() -> None:
    with watch_service("--watch-max-jobs", "2") as svc:
        env = {**svc.env, **arming.environment(None, base=svc.env)}
        flood = [subprocess.Popen([sys.executable, "-c", "import time; time.sleep(2)"], env=env)
                 for _ in range(24)]
        most = 0
        while any(p.poll() is None for p in flood):
            status = svc.ask({"op": "status"})["watch"]
            most = max(most, status["watching"])
            time.sleep(0.1)
        status = svc.ask({"op": "status"})["watch"]
        assert most <= 2, most
        assert status["refused"] >= 1 and status["max_jobs"] == 2, status
        assert svc.proc.poll() is None

        def refusals_written() -> str:
            text = svc.metrics.read_text() if svc.metrics.exists() else ""
            return text if (_metric(text, "gputrace_watch_refused_total") or 0) >= 1 else ""

        text = wait_until("the refusals in the metrics", refusals_written)
        assert _metric(text, "gputrace_watched_jobs") is not None


def test_an_armed_process_that_shows_no_gpu_work_is_let_go_and_its_place_taken() -> None:
    # an armed service's every Python process is a job from its start: one that never uses a GPU is let go
    # after --watch-idle-s, judged again by the other evidence only, and a GPU job takes its place at the cap
    with watch_service("--watch-max-jobs", "1", "--watch-idle-s", "2") as svc:
        env = {**svc.env, **arming.environment(None, base=svc.env)}
        idle = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], env=env,
                                stdin=subprocess.PIPE, text=True)
        gpu: subprocess.Popen[str] | None = None
        try:
            job = wait_until("the idle process let go", lambda: (j := svc.watched(idle.pid) or {}).get("released")
                             and j["state"] == "ended" and j, timeout=90)
            assert job["released"].startswith("no GPU work in its first ") and job["busy_ratio"] is None, job
            gpu = svc.job("60", "5", "5")  # the one place is free again
            wait_until("the GPU job watched", lambda: (j := svc.watched(gpu.pid) or {}).get("busy_ratio") is not None
                       and j["state"] == "watching", timeout=90)
            status = svc.ask({"op": "status"})["watch"]
            assert status["released"] == 1 and status["refused"] == 0 and status["idle_s"] == 2, status
            assert [j["state"] for j in status["jobs"] if j["pid"] == idle.pid] == ["ended"], status["jobs"]
            out = svc.client("status")
            assert "1 let go (no GPU work in 2 s)" in out.stdout and "let go: no GPU work" in out.stdout, out.stdout
            wait_until("the count in the metrics", lambda: svc.metrics.exists()
                       and _metric(svc.metrics.read_text(), "gputrace_watch_released_total") == 1)
        finally:
            _kill(idle, *([gpu] if gpu is not None else []))
        log = svc.stop()
        assert any(line.startswith(f"gputraced: watch: pid {idle.pid} (") and "): no GPU work in its first " in line
                   for line in log.splitlines()), log


def test_sigterm_closes_every_segment_and_a_restart_resumes_watching() -> None:
    # A window far longer than a restart can take under load: the segments of the last run are still in it when
    # the restarted service closes its first one.
    with watch_service("--flight-seconds", "600") as svc:
        job = svc.job("600", "5", "5")  # killed at the end; outlives the slowest restart
        try:
            wait_until("segments", lambda: (svc.watched(job.pid) or {}).get("segments", 0) >= 2, 90)
            log = svc.stop()
            assert "gputraced stopped" in log, log[-2000:]
            [d] = (svc.state / ".flight").glob(f"{job.pid}-*")
            assert not list(d.glob(".*")), list(d.iterdir())  # nothing half-written
            before = sorted(d.glob("seg-*.gputrace"))
            for seg in before:
                with CaptureReader(seg) as reader:
                    list(reader.records())
                    assert reader.complete and reader.trailer is not None, (seg, reader.problem)
            svc.start()
            wait_until("the job watched again", lambda: (j := svc.watched(job.pid)) and j["state"] == "watching"
                       and j["segments"] > len(before), 90)
            assert all(s.exists() for s in before[-2:]), "the segments of the last run were kept"
            r = svc.client("dump", str(job.pid))
            assert r.returncode == 0, r.stderr
        finally:
            _kill(job)


@pytest.mark.kernel
def test_a_segments_state_holds_the_processes_the_kernel_programs_follow(tmp_path: Path) -> None:
    """A new segment's process state comes from the job's own processes as its kernel programs follow them (a
    child forked after tracing began included), not from a pass over every process on the host; it is the same
    state the pass over /proc finds."""
    from types import SimpleNamespace

    from workloads.ebpfcap import ebpf_capture

    from gputrace.daemon.watch.watcher import _tree_snapshot
    from gputrace.records import FdInfo, ProcInfo

    data = tmp_path / "shard.bin"
    data.write_bytes(b"x" * 4096)
    # both processes live until the test closes their stdin
    forks = ("import os, sys\nsys.stdin.readline()\nif os.fork() == 0:\n    f = open(sys.argv[1], 'rb')\n"
             "    print(os.getpid(), flush=True)\nsys.stdin.read()\n")
    parent = subprocess.Popen([sys.executable, "-c", forks, str(data)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)  # fmt: skip
    assert parent.stdin is not None and parent.stdout is not None
    try:
        with ebpf_capture(tmp_path / "t.gputrace", [parent.pid]) as src:
            parent.stdin.write("fork\n")
            parent.stdin.flush()
            child = int(parent.stdout.readline())
            wait_for(lambda: child in src.live_targets(), 10, "the child followed by the kernel programs")
            followed = _tree_snapshot(parent.pid, SimpleNamespace(ebpf=src))
        scanned = _tree_snapshot(parent.pid)
    finally:
        parent.stdin.close()
        parent.wait(10)
    assert [r.pid for r in followed if type(r) is ProcInfo] == [parent.pid, child]
    assert any(type(r) is FdInfo and r.pid == child and r.obj == str(data) for r in followed), followed

    def timeless(rows: list[Any]) -> list[str]:  # what each row says, whenever it was read
        return sorted(repr(r._replace(ts=0) if "ts" in r._fields else r) for r in rows)

    assert timeless(followed) == timeless(scanned)
