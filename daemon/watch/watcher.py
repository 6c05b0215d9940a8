"""gputraced's watch mode: every GPU job on the host traced continuously into its flight recorder.

One thread scans for GPU processes (discover.py) every ``scan_s``; each new one whose ancestors are not
watched already becomes a job: a capture session of its process tree (the session follows forks) with the
watch source set, writing into a FlightRecorder in <state>/.flight/<pid>-<start>/ (root-only). Each closed
segment goes to one low-priority thread: its GPU busy share and stall time (counted as it was written:
tally.py) feed the metrics and the busy trigger; the full analysis (stall causes, culprits) runs on the
segments that need it, within a CPU budget (``analysis_share`` of the host, as a token bucket): a job's first
segment with GPU records, a segment whose busy share or stall lengths moved from the last analysed one's, and
others while the budget lasts. The rest have their stall time split as in the job's last analysed segment.
The automatic triggers (busy share below a threshold for T seconds; the top stall cause of an analysed segment
changing) dump the flight window into the job owner's directory as an ordinary capture, as
``gputrace daemon dump PID`` does.

Bounds: at most ``max_jobs`` jobs watched at once (more are refused and counted), each holding at most
``flight.max_bytes`` on disk; the analysis queue holds ANALYSIS_QUEUE segments (more are skipped, counted);
ended jobs' directories are kept for KEEP_ENDED jobs, for a dump after the job is gone.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import queue
import shutil
import tempfile
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gputrace.daemon.cost import CpuSplit
from gputrace.daemon.ticker import Ticker
from gputrace.daemon.watch.discover import Found, Scanner, ancestors, start_time
from gputrace.daemon.watch.flight import FlightLimits, FlightRecorder, Segment, dump_capture, dump_name, salvage
from gputrace.daemon.watch.metrics import JobMetrics, samples, write_textfile
from gputrace.daemon.watch.tally import SegmentGpu
from gputrace.daemon.writer import SharedWriter
from gputrace.documents import Report
from gputrace.errors import UserError
from gputrace.probes.ebpf.shared import SharedEbpf
from gputrace.probes.nvml import SharedNvml
from gputrace.threads import Thread

FLIGHT = ".flight"
WATCH_OFF = frozenset({"sampler"})  # stack samples: the costliest detail that no stall's cause depends on
ANALYSIS_QUEUE = 64
KEEP_ENDED = 16
ANALYSIS_NICE = 10
BUCKET_S = 60.0  # the analysis budget saved up while idle, and the debt a change may run up, in seconds of it
CHANGE_BUSY = 0.1  # a segment's busy share this far from the last analysed one's asks for its analysis ...
CHANGE_STALL = 2.0  # ... as does its mean stall length this many times longer or shorter


@dataclass(frozen=True)
class WatchConfig:
    flight: FlightLimits = field(default_factory=FlightLimits)
    max_jobs: int = 16
    scan_s: float = 1.0
    off: frozenset[str] = WATCH_OFF
    min_gap_ms: float = 1.0
    busy_below: float = 0.5  # automatic dump: the job's GPU busy share under this ...
    busy_low_s: float = 30.0  # ... for this long
    cause_min_share: float = 0.05  # a segment's top stall cause counts when its stalls take this share of it
    cooldown_s: float = 300.0  # automatic dumps of one job at most this often
    metrics_textfile: Path | None = None
    analysis_share: float = 0.002  # of the host's CPU, on average, for the full analysis of segments
    uids: frozenset[int] | None = None  # only these users' processes are watched (None: everyone's)
    otlp: str | None = None  # the metrics also go to this OTLP endpoint ...
    otlp_protocol: str = "grpc"
    otlp_interval_s: float = 60.0  # ... this often
    idle_s: float = 300.0  # a job found by its arming alone that shows no GPU work for this long is let go


@dataclass
class WatchJob:
    found: Found
    directory: Path
    gid: int
    stop: threading.Event = field(default_factory=threading.Event)
    state: str = "starting"  # starting, watching, ended, failed
    error: str = ""
    started: float = field(default_factory=time.time)
    ended: float | None = None
    recorder: FlightRecorder | None = None
    session: Any = None
    metrics: JobMetrics = field(default_factory=JobMetrics)
    low_since_ns: int | None = None
    low_fired: bool = False
    top_cause: str | None = None
    last_auto: float = 0.0
    baseline: bool = False  # a segment with GPU records was analysed: cause changes count from then on
    last_full: SegmentGpu | None = None  # the GPU tally of its last fully analysed segment
    suppressed: int = 0  # automatic triggers within the cooldown, not dumped
    dumps: list[dict[str, Any]] = field(default_factory=list)
    thread: threading.Thread | None = None
    gpu_seen: bool = False  # a segment of it held GPU work
    released: str = ""  # why it was let go while it ran (no GPU work), or ""

    @property
    def pid(self) -> int:
        return self.found.pid

    def as_dict(self) -> dict[str, Any]:
        rec = self.recorder
        segs = rec.segments() if rec is not None else []
        cost, cost_s = _job_cost(self)
        probes = _probe_cost(self)
        return {"pid": self.pid, "comm": self.found.comm, "uid": self.found.uid, "found_by": self.found.how,
                "state": self.state, "since": round(self.started, 3), **({"error": self.error} if self.error else {}),
                "segments": len(segs), "flight_bytes": rec.bytes_held() if rec is not None else 0,
                "flight_evicted": rec.evicted if rec is not None else 0,
                "busy_ratio": self.metrics.busy_ratio, "top_cause": self.top_cause,
                "segments_analysed": self.metrics.analysed, "segments_estimated": self.metrics.estimated,
                "tracing_cpu_share": cost, "tracing_cpu_s": cost_s, **probes, "drops": dict(self.metrics.drops),
                "dumps": self.dumps[-5:], "triggers_suppressed": self.suppressed,
                **({"released": self.released} if self.released else {})}


class Watcher:
    """The watch mode's threads and state. ``hand_over(stage, name, uid, gid)`` publishes a dump into the
    owner's directory (the service's own hand-over); ``log`` is the service's log."""

    def __init__(self, state_dir: Path, config: WatchConfig, log: Callable[[str], None],
                 hand_over: Callable[[Path, str, int, int], Path], *,
                 room_for: Callable[[int], str] = lambda uid: "") -> None:
        self.state_dir, self.config, self.log, self.hand_over = state_dir, config, log, hand_over
        self.room_for = room_for  # why ``uid`` has no room for another dump, or ""
        self.flight_dir = state_dir / FLIGHT
        self.jobs: dict[tuple[int, int], WatchJob] = {}
        self.refused = 0  # GPU processes not watched: the job cap was reached
        self.refused_keys: set[tuple[int, int]] = set()
        self.vanished = 0  # found, but gone before their session started
        self.released = 0  # let go while they ran: found by their arming alone, no GPU work in idle_s
        self.analysis_skipped = 0
        self.changed = True  # what the metrics file shows is out of date
        self.analysis_cpu_ns = 0
        self.analysed = 0  # segments given the full analysis
        self.estimated = 0  # segments with GPU records not given it (over the budget, nothing changed)
        self._rate = config.analysis_share * (os.cpu_count() or 1)  # CPU ns the analysis earns per ns
        self.tokens_ns = self._rate * BUCKET_S * 1e9
        self._refilled = time.monotonic_ns()
        self.stopping = threading.Event()
        self.began, self.cpu0 = time.monotonic(), time.process_time_ns()
        self.lock = threading.Lock()
        self.scanner = Scanner(exclude=self._is_ours, uids=config.uids)
        self._queue: queue.Queue[tuple[WatchJob, Segment] | None] = queue.Queue(ANALYSIS_QUEUE)
        self._threads: list[threading.Thread] = []
        self.otlp: Any = None  # OtlpMetrics, once started
        # One set of kernel programs for the jobs (of one owner): each syscall on the host runs it once,
        # whatever the number of jobs (probes/ebpf/shared.py).
        self.kernel = SharedEbpf()
        from gputrace.daemon.session import WATCH_PACING

        self.nvml = SharedNvml(period_s=WATCH_PACING.nvml_period_s)  # one NVML sampler for every job
        # One thread for every job's session checks (targets gone, the cost meter's tick), not one waking per job
        self.ticker = Ticker(WATCH_PACING.wait_s, name="gputraced-watch-tick")
        self.writer = SharedWriter()  # and one writer thread for every job's flight segments (daemon/writer.py)
        self.cpu_split = CpuSplit()  # the service's CPU time, each job's part of it (its cost meter's "session")
        self._prepare()

    # ---------------------------------------------------------------------------------- lifecycle ---
    def _prepare(self) -> None:
        """<state>/.flight, root-only; segments an earlier run left open made readable; directories of jobs
        that are gone kept for the KEEP_ENDED newest (dumpable), the rest removed."""
        self.flight_dir.mkdir(mode=0o700, exist_ok=True)
        if self.flight_dir.is_symlink() or self.flight_dir.lstat().st_uid != os.geteuid():
            raise UserError(f"{self.flight_dir} must be a directory owned by uid {os.geteuid()}")
        os.chmod(self.flight_dir, 0o700)
        gone = []
        for d in self.flight_dir.iterdir():
            if d.is_symlink() or not d.is_dir():
                d.unlink()
                continue
            if n := salvage(d):
                self.log(f"watch: {d.name}: {n} flight segment(s) cut off when the service last stopped, kept")
            pid, _, start = d.name.partition("-")
            if not (pid.isdigit() and start.isdigit() and start_time(int(pid)) == int(start)):
                gone.append(d)
        gone.sort(key=lambda d: d.stat().st_mtime)
        for d in gone[: max(0, len(gone) - KEEP_ENDED)]:
            shutil.rmtree(d, ignore_errors=True)

    def start(self) -> None:
        if self.config.otlp:
            from gputrace.daemon.watch.otlp_metrics import OtlpMetrics

            self.otlp = OtlpMetrics(self.config.otlp, self.config.otlp_protocol, lambda: samples(self._all(), self),
                                    interval_s=self.config.otlp_interval_s)
        loops = ((self._scan_loop, "scan"), (self._analysis_loop, "analysis"))
        for target, name in loops:
            t = Thread(target=target, name=f"gputraced-watch-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        self.log(f"watch: watching GPU jobs (at most {self.config.max_jobs}; flight recorder "
                 f"{self.config.flight.seconds:g} s, at most {self.config.flight.max_bytes >> 20} MiB each; "
                 f"sources off: {', '.join(sorted(self.config.off)) or 'none'})")

    def ask_to_stop(self) -> None:
        self.stopping.set()
        for job in self._all():
            job.stop.set()

    def stop(self, wait_s: float = 60.0) -> None:
        """Every job's session ends and closes its open segment; nothing is left half-written."""
        self.ask_to_stop()
        deadline = time.monotonic() + wait_s
        for job in self._all():
            if job.thread is not None:
                job.thread.join(max(0.0, deadline - time.monotonic()))
        self.ticker.close()  # after the jobs' sessions: each has taken its checks out
        if self._threads:
            self._queue.put(None)  # after every segment queued: the analysis thread ends there
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))
        self._write_metrics()
        if self.otlp is not None:
            self.otlp.shutdown()  # the last figures go out

    def _all(self) -> list[WatchJob]:
        with self.lock:
            return list(self.jobs.values())

    def _is_ours(self, pid: int) -> bool:
        return pid == os.getpid() or os.getpid() in ancestors(pid, depth=4)

    # ------------------------------------------------------------------------------------ finding ---
    def _scan_loop(self) -> None:
        while not self.stopping.wait(self.config.scan_s):
            try:
                for found in self.scanner.scan():
                    self._consider(found)
            except Exception as e:  # noqa: BLE001 - a scan's failure must not end watching
                self.log(f"watch: scan failed: {type(e).__name__}: {e}")
            self._forget_ended()
            if self.changed:  # jobs came, went or were refused: the metrics say so now, not at the next segment
                self.changed = False
                self._write_metrics()

    def _consider(self, found: Found) -> None:
        key = (found.pid, found.start)
        with self.lock:
            live = {k[0] for k, j in self.jobs.items() if j.state in ("starting", "watching")}
            if key in self.jobs and self.jobs[key].state in ("starting", "watching"):
                return
            if live & set(ancestors(found.pid)):
                return  # its job's session follows it already
            if len(live) >= self.config.max_jobs:
                if key not in self.refused_keys and len(self.refused_keys) < 65_536:
                    self.refused_keys.add(key)
                    self.refused += 1
                    self.changed = True
                    if self.refused == 1:
                        self.log(f"watch: {self.config.max_jobs} jobs watched already (--watch-max-jobs); "
                                 f"pid {found.pid} ({found.comm}) and later ones are refused and counted")
                self.scanner.retry_later(found.pid)
                return
            directory = self.flight_dir / f"{found.pid}-{found.start}"
            job = WatchJob(found, directory, _gid_of(found.pid))
            self.jobs[key] = job
            self.changed = True
        directory.mkdir(mode=0o700, exist_ok=True)
        (directory / "job.json").write_text(json.dumps({"pid": found.pid, "start": found.start, "uid": found.uid,
                                                        "gid": job.gid, "comm": found.comm}))
        t = Thread(target=self._run_job, args=(job,), name=f"gputraced-watch-{found.pid}", daemon=True)
        job.thread = t
        t.start()

    def _forget_ended(self) -> None:
        with self.lock:
            ended = [k for k, j in self.jobs.items() if j.state in ("ended", "failed")]
            for key in ended[: max(0, len(ended) - KEEP_ENDED)]:
                job = self.jobs.pop(key)
                shutil.rmtree(job.directory, ignore_errors=True)

    # ---------------------------------------------------------------------------------- a job's run ---
    def _run_job(self, job: WatchJob) -> None:
        from gputrace.daemon.session import WATCH_PACING, CaptureOptions, run_capture

        f = job.found
        self.log(f"watch: pid {f.pid} ({f.comm}, uid {f.uid}) found ({f.how}); watching its process tree")

        def make_writer(path: Path, header: dict[str, Any], **_: Any) -> FlightRecorder:
            job.recorder = FlightRecorder(job.directory, header, self.config.flight,
                                          on_closed=lambda seg: self._analyse_later(job, seg),
                                          snapshot=lambda: _tree_snapshot(f.pid, job.session),
                                          min_gap_ns=int(self.config.min_gap_ms * 1e6))
            return job.recorder

        def on_session(session: Any) -> None:
            job.session = session
            assert job.recorder is not None
            job.recorder.drops = session.drops_so_far
            job.state = "watching"
            _trim_heap()

        opts = CaptureOptions(output=job.directory / "live.gputrace", pids=[f.pid], perfetto=False, progress=False,
                              analyse=False, min_gap_ms=self.config.min_gap_ms, off=self.config.off,
                              sample_hz=0 if "sampler" in self.config.off else 499,
                              argv=["gputraced", "watch", f"uid={f.uid}", str(f.pid)],
                              owner_uid=f.uid or None, make_writer=make_writer, on_session=on_session,
                              pacing=WATCH_PACING, make_ebpf=self.kernel.view, make_nvml=self.nvml.view,
                              session_cpu=self.cpu_split.join(id(job)), ticker=self.ticker,
                              writer_thread=self.writer)
        try:
            result = run_capture(opts, stop=job.stop, log=lambda msg: self._job_log(job, msg))
            job.state = "ended"
            self.log(f"watch: pid {f.pid}: ended ({result.stop_reason})")
        except UserError as e:
            job.state, job.error = "failed", str(e)
            if job.session is None:
                self.vanished += 1
            self.log(f"watch: pid {f.pid}: not watched: {e}")
        except Exception as e:  # noqa: BLE001 - one job's bug must not take the service down
            job.state, job.error = "failed", f"internal error: {type(e).__name__}: {e}"
            self.log("".join(traceback.format_exception(e)).rstrip())
        finally:
            self.cpu_split.leave(id(job))
            job.ended = time.time()
            self.changed = True

    def _job_log(self, job: WatchJob, msg: str) -> None:
        if msg.startswith("gputrace: error") or "unavailable" in msg or "degraded" in msg:
            self.log(f"watch: pid {job.pid}: {msg}")

    # ----------------------------------------------------------------------------------- analysis ---
    def _analyse_later(self, job: WatchJob, seg: Segment) -> None:
        try:
            self._queue.put_nowait((job, seg))
        except queue.Full:
            self.analysis_skipped += 1

    def _analysis_loop(self) -> None:
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), ANALYSIS_NICE)
        while (item := self._queue.get()) is not None:
            job, seg = item
            t0 = time.thread_time_ns()
            try:
                self._analyse(job, seg)
            except Exception as e:  # noqa: BLE001 - a segment that cannot be read is told, not fatal
                self.log(f"watch: pid {job.pid}: analysing {seg.path.name}: {type(e).__name__}: {e}")
            used = time.thread_time_ns() - t0
            self.analysis_cpu_ns += used
            self.tokens_ns -= used
            self._write_metrics()

    def _analyse(self, job: WatchJob, seg: Segment) -> None:
        from gputrace.daemon.finish import analyse

        if not seg.path.exists():
            return  # evicted before its turn
        gpu = seg.gpu if seg.gpu is not None else SegmentGpu()
        if gpu.devices:
            job.gpu_seen = True
        elif job.found.how == "armed" and not job.gpu_seen and not job.released:
            idle = time.time() - job.started
            if idle >= self.config.idle_s:
                self._release(job, idle)
        report: Report | None = None
        if self._wants_analysis(job, gpu):
            report = analyse(seg.path, self.config.min_gap_ms)
            job.metrics.add(report, seg.drops)
            job.last_full = gpu
            self.analysed += 1
        else:
            job.metrics.add_tally(gpu, seg.drops)
            self.estimated += bool(gpu.devices)
        job.metrics.cpu_share = _job_cost(job)[0]
        if self.stopping.is_set():
            return
        self._busy_trigger(job, bool(gpu.devices), seg)
        if report is not None:
            self._cause_trigger(job, report)

    def _release(self, job: WatchJob, idle_s: float) -> None:
        """Stop watching ``job``, found by its arming alone (an armed service's every Python process is), that
        has shown no GPU work since: it would hold a place under ``max_jobs`` that a GPU job may need. The scan
        judges it again later by the other evidence only (libcuda, /dev/nvidia, NVML)."""
        f = job.found
        job.released = f"no GPU work in its first {idle_s:.0f} s (found by its arming alone)"
        with self.lock:
            self.released += 1
            self.changed = True
        self.scanner.without_arming(f.pid, f.start)
        self.log(f"watch: pid {f.pid} ({f.comm}): {job.released}: no longer watched; judged again for libcuda, "
                 "/dev/nvidia or NVML")
        job.stop.set()

    def _wants_analysis(self, job: WatchJob, gpu: SegmentGpu) -> bool:
        """Whether ``gpu``'s segment gets the full analysis: one without GPU records never (it has no stalls);
        a job's first, or one that moved from the last analysed (a new cause is likely), while the debt stays
        within BUCKET_S of the budget; any other while there is budget left."""
        if not gpu.devices:
            return False
        now = time.monotonic_ns()
        cap = self._rate * BUCKET_S * 1e9
        self.tokens_ns = min(cap, self.tokens_ns + (now - self._refilled) * self._rate)
        self._refilled = now
        if job.last_full is None or _moved(job.last_full, gpu):
            return self.tokens_ns > -cap
        return self.tokens_ns > 0

    def _busy_trigger(self, job: WatchJob, has_gpu: bool, seg: Segment) -> None:
        ratio = job.metrics.busy_ratio
        if ratio is None or not has_gpu:
            return
        if ratio >= self.config.busy_below:
            job.low_since_ns, job.low_fired = None, False
            return
        if job.low_since_ns is None:
            job.low_since_ns = seg.start_ns
        low_s = (seg.end_ns - job.low_since_ns) / 1e9
        if low_s >= self.config.busy_low_s and not job.low_fired:
            job.low_fired = True
            self._auto_dump(job, {"kind": "busy_low", "detail": f"GPU busy {ratio:.0%} < "
                                  f"{self.config.busy_below:.0%} for {low_s:.1f} s"})

    def _cause_trigger(self, job: WatchJob, report: Report) -> None:
        """A dump when the top stall cause of a segment differs from the last segment's (a job that stalls
        where it did not, or on something else). Segments without GPU records (before the agent connected)
        are no baseline."""
        if not report.get("devices"):
            return
        summary = report.get("summary", {})
        by_cause: dict[str, int] = summary.get("by_cause", {})
        window = int(summary.get("window_ns", 0)) or 1
        top = max(by_cause, key=lambda c: by_cause[c]) if by_cause else None
        if top is not None and by_cause[top] / window < self.config.cause_min_share:
            top = None
        before, job.top_cause = job.top_cause, top
        if job.baseline and top is not None and top != before:
            self._auto_dump(job, {"kind": "cause_change", "detail": f"top stall cause {before or 'none'} -> {top}"})
        job.baseline = True

    def _auto_dump(self, job: WatchJob, trigger: dict[str, Any]) -> None:
        now = time.monotonic()
        if job.last_auto and now - job.last_auto < self.config.cooldown_s:
            job.suppressed += 1  # told once per cooldown, counted in status
            if job.suppressed == 1:
                self.log(f"watch: pid {job.pid}: {trigger['detail']}: no dump (one was written "
                         f"{now - job.last_auto:.0f} s ago; at most one per {self.config.cooldown_s:g} s)")
            return
        job.last_auto, job.suppressed = now, 0
        try:
            self.dump(job, trigger)
        except UserError as e:
            self.log(f"watch: pid {job.pid}: {trigger['detail']}: no dump: {e}")

    # -------------------------------------------------------------------------------------- dumps ---
    def find(self, pid: int) -> WatchJob | None:
        """The job ``pid`` belongs to: the newest job of that pid, or the live job of one of its ancestors."""
        jobs = self._all()
        own = [j for j in jobs if j.pid == pid]
        if own:
            return max(own, key=lambda j: j.started)
        up = set(ancestors(pid))
        for job in jobs:
            if job.pid in up and job.state == "watching":
                return job
        return None

    def dump(self, job: WatchJob, trigger: dict[str, Any]) -> Path:
        """The job's flight window as one capture in its owner's directory; returns its path there."""
        uid, rec = job.found.uid, job.recorder
        if rec is None:
            raise UserError(f"pid {job.pid}: its flight recorder has not started yet; try again in a moment")
        if why := self.room_for(uid):
            raise UserError(why)
        session = job.session
        if job.state == "watching" and session is not None and session.sink is not None:
            rec.request_rotation(session.sink.emit_meta)
        stage = Path(tempfile.mkdtemp(prefix="dump-", dir=self.flight_dir))
        try:
            linked = []
            with rec.lock:  # linked, not copied, under the lock: the writer thread may delete a segment next
                for seg in rec.closed:
                    with contextlib.suppress(FileNotFoundError):
                        os.link(seg.path, stage / seg.path.name)
                        linked.append(stage / seg.path.name)
            if not linked:
                raise UserError(f"pid {job.pid}: no flight segment closed yet; try again in a moment")
            name = dump_name(job.found.comm, job.pid, trigger["kind"], len(job.dumps) + 1)
            header = {**rec.header, "argv": ["gputraced", "dump", f"uid={uid}", str(job.pid)]}
            dump_capture(linked, stage / name, header, trigger)
            for p in linked:
                p.unlink()
            path = self.hand_over(stage, name, uid, job.gid)
        finally:
            shutil.rmtree(stage, ignore_errors=True)
        job.dumps.append({"path": str(path), "trigger": trigger, "at": round(time.time(), 3)})
        job.metrics.dumps[trigger["kind"]] = job.metrics.dumps.get(trigger["kind"], 0) + 1
        self.log(f"watch: pid {job.pid}: dumped {len(linked)} segment(s) to {path} (trigger: {trigger['kind']}: "
                 f"{trigger['detail']})")
        return path

    # -------------------------------------------------------------------------------- status, metrics ---
    def status(self, uid: int) -> dict[str, Any]:
        jobs = [j.as_dict() for j in self._all() if uid == 0 or j.found.uid == uid]
        watching = sum(j.state in ("starting", "watching") for j in self._all())
        jobs_cpu = sum(j.metrics.cpu_share or 0.0 for j in self._all() if j.state == "watching")
        elapsed = max(1e-9, time.monotonic() - self.began)
        service_cpu = (time.process_time_ns() - self.cpu0) / 1e9 / (elapsed * (os.cpu_count() or 1))
        return {"jobs": jobs, "watching": watching, "max_jobs": self.config.max_jobs, "refused": self.refused,
                "vanished": self.vanished, "released": self.released, "idle_s": self.config.idle_s,
                "flight_seconds": self.config.flight.seconds,
                "flight_mib": self.config.flight.max_bytes / (1 << 20), "off": sorted(self.config.off),
                "cost": {"scan_cpu_s": round(self.scanner.cpu_ns / 1e9, 3), "scans": self.scanner.scans,
                         "processes": self.scanner.processes, "processes_read": self.scanner.judged,
                         "analysis_cpu_s": round(self.analysis_cpu_ns / 1e9, 3),
                         "segments_analysed": self.analysed, "segments_estimated": self.estimated,
                         "analysis_budget_share": self.config.analysis_share,
                         "analysis_skipped": self.analysis_skipped,
                         "jobs_cpu_share": round(jobs_cpu, 6), "service_cpu_share": round(service_cpu, 6),
                         "host_cpu_share": round(jobs_cpu + service_cpu, 6)},
                "kernel_programs": {"loaded": self.kernel.loaded, "sets": self.kernel.status()},
                **({"nvml": self.scanner.nvml} if self.scanner.nvml else {}),
                **({"otlp": self.otlp.status()} if self.otlp is not None else {})}

    def _write_metrics(self) -> None:
        path = self.config.metrics_textfile
        if path is None:
            return
        try:
            write_textfile(path, self._all(), self)
        except OSError as e:
            self.log(f"watch: cannot write {path}: {e.strerror}")


def _moved(before: SegmentGpu, now: SegmentGpu) -> bool:
    """Whether ``now``'s busy share or mean stall length moved far from ``before``'s (CHANGE_BUSY, CHANGE_STALL),
    or stalls came or went."""
    a, b = before.busy_ratio(), now.busy_ratio()
    if a is None or b is None or abs(a - b) >= CHANGE_BUSY:
        return True
    if bool(before.stalls) != bool(now.stalls):
        return True
    if not now.stalls:
        return False
    mean_a, mean_b = before.stall_ns / before.stalls, now.stall_ns / now.stalls
    return max(mean_a, mean_b) >= CHANGE_STALL * max(1.0, min(mean_a, mean_b))


def _job_cost(job: WatchJob) -> tuple[float | None, float | None]:
    """(share of the host's CPU, CPU seconds) the job's kernel programs and agents took so far, from its
    session's cost meter (the service's own threads are counted once, for the whole service: Watcher.status)."""
    cost = getattr(job.session, "cost", None)
    rows = list(getattr(cost, "last", []))
    if cost is None or not rows or not cost.start_ns:
        return None, None
    window = rows[0].ts - cost.start_ns
    ns = sum(r.cpu_ns for r in rows if r.source != "session")
    share = round(ns / (window * (os.cpu_count() or 1)), 6) if window > 0 else None
    return share, round(ns / 1e9, 6)


def _trim_heap() -> None:
    """Hand back to the kernel the heap the BPF compiler (clang, inside bcc) used to start the session: tens of
    MB the service would otherwise keep for as long as it runs (glibc's malloc_trim; elsewhere nothing)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None).malloc_trim(0)


def _probe_cost(job: WatchJob) -> dict[str, int]:
    """The job's kernel programs so far, from its cost meter: how many times they ran, and their run time."""
    rows = [r for r in getattr(getattr(job.session, "cost", None), "last", []) if r.source not in ("session", "agent")]
    if not rows:
        return {}
    return {"probe_runs": sum(r.runs for r in rows), "probe_ns": sum(r.cpu_ns for r in rows)}


def _tree_snapshot(pid: int, session: Any = None) -> list[tuple[Any, ...]]:
    """Processes, threads and open files of ``pid`` and its descendants, read now (a new segment's state). Once
    the job's session traces it, its processes are the ones its kernel programs follow (forks and exits as they
    happened): no pass over every process on the host for each segment of each job."""
    from gputrace.probes import procfs

    ebpf = getattr(session, "ebpf", None)
    pids = [pid, *sorted(ebpf.live_targets() - {pid})] if ebpf is not None else [pid, *procfs.descendants(pid)]
    rows: list[tuple[Any, ...]] = []
    for p in pids:
        with contextlib.suppress(OSError):
            rows.extend(procfs.snapshot(p))
    return rows


def _gid_of(pid: int) -> int:
    try:
        return os.stat(f"/proc/{pid}").st_gid
    except OSError:
        return 0
