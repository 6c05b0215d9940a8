#!/usr/bin/env python3
"""What watch mode costs the host: one or more simulated GPU jobs untraced, then watched by
`gputrace daemon --watch`, side by side in one run.

    sudo .venv/bin/python bench/watch_cost.py --seconds 60 --jobs 1
    sudo .venv/bin/python bench/watch_cost.py --seconds 60 --baseline-src /tmp/gputrace-main   # old code beside
    sudo .venv/bin/python bench/watch_cost.py --seconds 30 --profile                            # where it goes
    sudo .venv/bin/python bench/watch_cost.py --jobs 3 --rounds 3 --baseline-src DIR             # medians

Each state starts fresh jobs (10 ms kernels, 10 ms sleeps on the simulated device, as uid 64123, the only
user the service watches: other GPU processes on the host are left alone), waits until they are watched
and past a warm-up, then measures over ``--seconds``:
- the service process's CPU time (/proc/PID/stat: every thread: draining, writing segments, the scan, the
  analysis), as a share of the host's CPU;
- the jobs' tracing cost as the capture's own cost meter measures it (kernel programs and agents;
  ``tracing_cpu_s`` in `gputrace daemon status`), as a share of the host's CPU;
- the jobs' own CPU time (their processes' utime + stime), against the untraced run;
- the service's resident size at the end;
- the service's CPU by thread, from /proc/PID/task (the service names its threads: ``gt-writer``, ...).
``--baseline-src DIR`` runs the watched state a second time with DIR (another checkout's tree, e.g.
`git archive main | tar -x -C DIR`) first on PYTHONPATH, so old and new code run under the same load.
``--profile`` runs the service under an on-CPU sampler (each thread's CPU clock read every 5 ms; the stack of
a thread that ran is charged with what it used) and prints where the service's time went.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import re
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
UID = 64_123  # the jobs' user: the service watches only it (--watch-user), not other GPU processes on the host
TICK = os.sysconf("SC_CLK_TCK")
CPUS = os.cpu_count() or 1
JOB = """
import sys, time
from gputrace.sim import Device
secs, kernel_ms, sleep_ms = (float(a) for a in sys.argv[1:4])
s = Device(0).stream()
print("up", flush=True)
t = time.monotonic()
while time.monotonic() - t < secs:
    s.launch("step", duration_ms=kernel_ms)
    s.synchronize()
    time.sleep(sleep_ms / 1000)
"""


def cpu_s(pid: int) -> float:
    """utime + stime of ``pid`` (all its threads), in seconds."""
    return _stat_cpu_s(f"/proc/{pid}/stat")


def _stat_cpu_s(path: str) -> float:
    """utime + stime, in seconds, of the process or thread whose stat file is ``path``."""
    fields = Path(path).read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / TICK


def thread_cpu_s(pid: int) -> dict[str, float]:
    """CPU seconds of each of ``pid``'s threads by OS name (gputrace names them: ``gt-writer``, ``gt-ebpf``, ...),
    a job's pid in a name made ``N`` so that the jobs' like threads add up."""
    out: dict[str, float] = {}
    with contextlib.suppress(OSError):
        for tid in os.listdir(f"/proc/{pid}/task"):
            with contextlib.suppress(OSError):
                comm = Path(f"/proc/{pid}/task/{tid}/comm").read_text().strip()
                name = re.sub(r"\d+", "N", comm)
                out[name] = out.get(name, 0.0) + _stat_cpu_s(f"/proc/{pid}/task/{tid}/stat")
    return out


def rss_mb(pid: int) -> dict[str, float]:
    """Resident MB: all, anonymous (the heap), file-backed (shared libraries: bcc's LLVM, mostly)."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "RssAnon", "RssFile"):
            out[key] = int(value.split()[0]) / 1024
    return out


class Service:
    def __init__(self, base: Path, env: dict[str, str], extra: list[str], profile: Path | None) -> None:
        self.sock, self.state = base / "gputraced.sock", base / "state"
        self.metrics = base / "gputrace.prom"
        args = ["--socket", str(self.sock), "--state-dir", str(self.state), "--watch",
                "--metrics-textfile", str(self.metrics), *extra]
        cmd = [sys.executable, "-m", "gputrace", "daemon", *args]
        if profile is not None:
            cmd = [sys.executable, __file__, "_profiled", str(profile), *args]
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env,
                                     cwd="/")
        deadline = time.monotonic() + 60
        while not self.sock.exists():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"watch_cost: the service did not start:\n{self.proc.communicate()[1][-3000:]}")
            time.sleep(0.05)

    def status(self) -> dict[str, Any]:
        from gputrace.daemon.service.protocol import recv_frame, send_frame

        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.settimeout(30)
            s.connect(str(self.sock))
            send_frame(s, {"op": "status"})
            reply = recv_frame(s, 16 << 20)
        assert reply is not None and reply.get("ok"), reply
        watch: dict[str, Any] = reply["watch"]
        return watch

    def jobs(self, pids: list[int]) -> list[dict[str, Any]]:
        by_pid = {j["pid"]: j for j in self.status()["jobs"] if j["state"] == "watching"}
        return [by_pid[p] for p in pids if p in by_pid]

    def wait_watched(self, pids: list[int], what: str, timeout_s: float = 120.0) -> None:
        """Until every one of ``pids`` is watched; exits saying ``what`` was not, after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while len(self.jobs(pids)) < len(pids):
            if time.monotonic() > deadline:
                raise SystemExit(f"{what}: the jobs were not all watched: {self.status()}")
            time.sleep(0.2)

    def stop(self) -> str:
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.communicate(timeout=120)[1]


def bench_env() -> dict[str, str]:
    """The environment the service and the jobs start with: this one without gputrace's own settings."""
    return {k: v for k, v in os.environ.items() if not k.startswith("GPUTRACE_")}


@contextlib.contextmanager
def job_workdir(prefix: str) -> Iterator[Path]:
    """A temporary directory the jobs' user can reach, holding the simulated job's script (``job.py``)."""
    with tempfile.TemporaryDirectory(prefix=prefix) as d:
        work = Path(d)
        os.chmod(work, 0o755)
        (work / "job.py").write_text(JOB)
        yield work


def start_jobs(n: int, seconds: float, script: Path, env: dict[str, str]) -> list[subprocess.Popen[str]]:
    from gputrace.agent import arming

    armed = {**env, **arming.environment(None, base=env)}
    jobs = []
    user = ["setpriv", f"--reuid={UID}", f"--regid={UID}", "--clear-groups"]
    for _ in range(n):
        p = subprocess.Popen([*user, sys.executable, str(script), str(seconds), "10", "10"], env=armed,
                             stdout=subprocess.PIPE, text=True, cwd="/")
        assert p.stdout is not None and p.stdout.readline().strip() == "up"
        jobs.append(p)
    return jobs


def stop_jobs(jobs: list[subprocess.Popen[str]]) -> None:
    for p in jobs:
        p.kill()
        p.wait()


def run_state(label: str, args: argparse.Namespace, work: Path, env: dict[str, str]) -> dict[str, Any]:
    """One state: 'untraced', or watched by the service from this tree or from --baseline-src."""
    script = work / "job.py"
    total_s = args.warmup_s + args.seconds + 120
    if label == "untraced":
        jobs = start_jobs(args.jobs, total_s, script, env)
        try:
            time.sleep(args.warmup_s)
            j0, t0 = sum(cpu_s(p.pid) for p in jobs), time.monotonic()
            time.sleep(args.seconds)
            j1, t1 = sum(cpu_s(p.pid) for p in jobs), time.monotonic()
        finally:
            stop_jobs(jobs)
        return {"state": label, "job_cpu": (j1 - j0) / ((t1 - t0) * CPUS)}
    base = Path(tempfile.mkdtemp(prefix="watch-cost-", dir=work))
    svc_env = dict(env)
    if label == "baseline":
        svc_env["PYTHONPATH"] = str(args.baseline_src)
    profile = work / "profile.txt" if args.profile and label == "watched" else None
    svc = Service(base, svc_env, ["--watch-max-jobs", str(args.jobs), "--watch-user", str(UID),
                                  *args.service_args], profile)
    jobs = []
    try:
        jobs = start_jobs(args.jobs, total_s, script, env)
        pids = [p.pid for p in jobs]
        svc.wait_watched(pids, f"watch_cost: {label}")
        time.sleep(args.warmup_s)
        if profile is not None:
            svc.proc.send_signal(signal.SIGUSR2)
        s0, j0, c0, t0 = cpu_s(svc.proc.pid), sum(cpu_s(p) for p in pids), _traced(svc, pids), time.monotonic()
        th0 = thread_cpu_s(svc.proc.pid)
        p0 = _probes(svc, pids)
        time.sleep(args.seconds)
        s1, j1, c1, t1 = cpu_s(svc.proc.pid), sum(cpu_s(p) for p in pids), _traced(svc, pids), time.monotonic()
        th1 = thread_cpu_s(svc.proc.pid)
        p1 = _probes(svc, pids)
        status = svc.status()
        rss = rss_mb(svc.proc.pid)
    finally:
        stop_jobs(jobs)
        log = svc.stop()
        shutil.rmtree(base, ignore_errors=True)
    host = (t1 - t0) * CPUS
    out = {"state": label, "service_cpu": (s1 - s0) / host, "tracing_cpu": (c1 - c0) / host if c0 is not None
           and c1 is not None else None, "job_cpu": (j1 - j0) / host, "rss_mb": rss, "cost": status["cost"],
           "probes_per_job": {k: (p1[k] - p0[k]) / len(pids) / (t1 - t0) for k in p0 if k in p1},
           "threads": {name: (th1[name] - th0.get(name, 0.0)) / host for name in th1}}
    if profile is not None and profile.exists():
        out["profile"] = profile.read_text()
    if "Traceback" in log:
        out["log"] = log[-3000:]
    return out


def _traced(svc: Service, pids: list[int]) -> float | None:
    """The jobs' tracing CPU seconds so far (kernel programs and agents), from their cost meters."""
    jobs = svc.jobs(pids)
    if any(j.get("tracing_cpu_s") is None for j in jobs):
        return None
    return float(sum(j["tracing_cpu_s"] for j in jobs))


def _rss(rss: dict[str, float] | None) -> str:
    return f"{rss['VmRSS']:.0f} ({rss['RssAnon']:.0f})" if rss else "-"


def _probes(svc: Service, pids: list[int]) -> dict[str, float]:
    """The jobs' kernel programs so far, all jobs together: runs and run time (ns)."""
    jobs = svc.jobs(pids)
    if not jobs or any("probe_runs" not in j for j in jobs):
        return {}
    return {"runs": sum(j["probe_runs"] for j in jobs), "ns": sum(j["probe_ns"] for j in jobs)}


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{x:.2%}"


def print_table(rows: list[dict[str, Any]], args: argparse.Namespace) -> None:
    print(f"# {args.jobs} simulated job(s) (10 ms kernels, 10 ms sleeps), {args.seconds:g} s each after "
          f"{args.warmup_s:g} s warm-up, {CPUS} CPUs; shares of the host's CPU")
    print(f"{'state':10} {'service':>9} {'tracing':>9} {'total':>9} {'job CPU':>9} {'RSS MB (anon)':>14}  "
          "scan/analysis")
    for r in rows:
        r = r | {"state": f"{r['state']}" + (f" #{r['round']}" if args.rounds > 1 else "")}
        total = r.get("service_cpu", 0.0) + (r.get("tracing_cpu") or 0.0) if "service_cpu" in r else None
        cost = r.get("cost", {})
        parts = (f"scan {cost.get('scan_cpu_s', 0):.2f} s / {cost.get('scans', 0)}, analysis "
                 f"{cost.get('analysis_cpu_s', 0):.2f} s / {cost.get('segments_analysed', 0)}") if cost else ""
        print(f"{r['state']:10} {_pct(r.get('service_cpu')):>9} {_pct(r.get('tracing_cpu')):>9} {_pct(total):>9} "
              f"{_pct(r['job_cpu']):>9} {_rss(r.get('rss_mb')):>14}  {parts}")
    for r in rows:
        probes = r.get("probes_per_job")
        if probes:
            print(f"# {r['state']}: each job's kernel programs: {probes['runs']:.0f} runs/s, "
                  f"{probes['ns'] / 1e6:.2f} ms/s ({probes['ns'] / max(1, probes['runs']):.0f} ns a run)")
    for r in rows:
        threads = sorted(((v, k) for k, v in r.get("threads", {}).items() if v > 0), reverse=True)
        if threads:
            print(f"# {r['state']}: the service's threads (by OS name; N: each job's): "
                  + ", ".join(f"{k} {v:.2%}" for v, k in threads))
    for r in rows:
        if "log" in r:
            print(f"\n# {r['state']}: the service's log ends\n{r['log']}")
        if "profile" in r:
            print(f"\n# {r['state']}: where the service's CPU went\n{r['profile']}")


def print_medians(rows: list[dict[str, Any]], states: list[str]) -> None:
    """Each state's median over the rounds, and the watched state's against the baseline's."""
    keys = ("service_cpu", "tracing_cpu", "job_cpu")
    med: dict[str, dict[str, float]] = {}
    for state in states:
        mine = [r for r in rows if r["state"] == state]
        med[state] = {}
        for k in keys:
            values = [r[k] for r in mine if r.get(k) is not None]
            if values:
                med[state][k] = statistics.median(values)
        if "service_cpu" in med[state] and "tracing_cpu" in med[state]:
            med[state]["total"] = statistics.median(r["service_cpu"] + (r.get("tracing_cpu") or 0.0) for r in mine)
    n = len([r for r in rows if r["state"] == states[0]])
    print(f"\n# medians over {n} rounds")
    print(f"{'state':10} {'service':>9} {'tracing':>9} {'total':>9} {'job CPU':>9}")
    for state in states:
        m = med[state]
        print(f"{state:10} {_pct(m.get('service_cpu')):>9} {_pct(m.get('tracing_cpu')):>9} {_pct(m.get('total')):>9} "
              f"{_pct(m.get('job_cpu')):>9}")
    if "baseline" in med and med["baseline"].get("total") and med["watched"].get("total") is not None:
        print(f"# watched / baseline, in all: {med['watched']['total'] / med['baseline']['total']:.2f}")


# ---------------------------------------------------------------------------------------- profiling ---


class OnCpuSampler:
    """Every ``interval_s``, each thread whose CPU clock moved is charged that much at its current stack."""

    def __init__(self, interval_s: float = 0.005) -> None:
        self.interval_s = interval_s
        self.by_thread: collections.Counter[str] = collections.Counter()
        self.by_stack: collections.Counter[str] = collections.Counter()
        self.by_leaf: collections.Counter[str] = collections.Counter()
        self._last: dict[int, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="profiler", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def reset(self) -> None:
        """From now on: the steady state, without the start-up."""
        for counter in (self.by_thread, self.by_stack, self.by_leaf):
            counter.clear()

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.wait(self.interval_s):
            frames = sys._current_frames()
            names = {t.ident: t.name for t in threading.enumerate()}
            for ident, frame in frames.items():
                if ident == me:
                    continue
                try:
                    now = time.clock_gettime_ns(time.pthread_getcpuclockid(ident))
                except (OSError, OverflowError):
                    continue
                used = now - self._last.get(ident, now)
                self._last[ident] = now
                if used <= 0:
                    continue
                name = "".join(c for c in names.get(ident, "?") if not c.isdigit())
                stack: list[str] = []
                f: Any = frame
                while f is not None and len(stack) < 40:
                    code = f.f_code
                    stack.append(f"{Path(code.co_filename).name}:{code.co_name}")
                    f = f.f_back
                self.by_thread[name] += used
                self.by_leaf[stack[0]] += used
                self.by_stack[name + ";" + ";".join(reversed(stack[:12]))] += used

    def report(self) -> str:
        self._stop.set()
        self._thread.join()
        total = sum(self.by_thread.values()) or 1
        lines = [f"{ns / 1e9:8.2f} s {ns / total:6.1%}  thread {name}" for name, ns in self.by_thread.most_common()]
        lines += ["", "leaf functions:"]
        lines += [f"{ns / 1e9:8.2f} s {ns / total:6.1%}  {leaf}" for leaf, ns in self.by_leaf.most_common(25)]
        lines += ["", "stacks (outermost first, 12 innermost frames):"]
        lines += [f"{ns / 1e9:8.2f} s {ns / total:6.1%}  {stack}" for stack, ns in self.by_stack.most_common(25)]
        return "\n".join(lines) + "\n"


def profiled_service(out: Path, argv: list[str]) -> int:
    from gputrace.cli import main

    sampler = OnCpuSampler()
    sampler.start()
    signal.signal(signal.SIGUSR2, lambda *_: sampler.reset())
    try:
        return main(["daemon", *argv])
    finally:
        out.write_text(sampler.report())


def main() -> int:
    if len(sys.argv) > 2 and sys.argv[1] == "_profiled":
        return profiled_service(Path(sys.argv[2]), sys.argv[3:])
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--seconds", type=float, default=60.0, help="measured per state (default 60)")
    p.add_argument("--warmup-s", type=float, default=20.0, help="after the jobs are watched (default 20)")
    p.add_argument("--jobs", type=int, default=1)
    p.add_argument("--baseline-src", type=Path, help="also run the service from this source tree")
    p.add_argument("--profile", action="store_true", help="profile the service (this tree's)")
    p.add_argument("--skip-untraced", action="store_true")
    p.add_argument("--rounds", type=int, default=1, help="run the states this many times, alternating; medians")
    p.add_argument("--json", type=Path, help="also write the figures here")
    p.add_argument("service_args", nargs="*", help="more arguments for the service (after --)")
    args = p.parse_args()
    if os.geteuid() != 0:
        raise SystemExit("watch_cost: run as root (eBPF)")
    env = bench_env()
    rows = []
    with job_workdir("watch-cost-") as work:
        states = ([] if args.skip_untraced else ["untraced"]) + ["watched"] + (["baseline"] if args.baseline_src
                                                                               else [])
        for n in range(args.rounds):  # the states alternate: a change in the host's load hits each alike
            for state in states:
                rows.append(run_state(state, args, work, env) | {"round": n + 1})
                print(f"watch_cost: round {n + 1}: {state} done", file=sys.stderr, flush=True)
    print_table(rows, args)
    if args.rounds > 1:
        print_medians(rows, states)
    if args.json:
        with contextlib.suppress(OSError):
            args.json.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
