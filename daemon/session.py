"""A capture session: starts the sources, writes the capture file, ends cleanly, then exports.

Collection never analyses: sources hand records to a QueueSink whose writer thread appends them to the
capture file. Once the file is closed, the analysis and the Perfetto export read it back like any other
capture.
"""

from __future__ import annotations

import contextlib
import os
import shlex
import signal
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gputrace import clock
from gputrace.agent.arming import is_armed
from gputrace.capture import CaptureWriter, WriteBudget, check_output_path, cut_off_captures, host_header
from gputrace.daemon.agents.sockdir import make_socket_dir, remove_stale_socket_dirs
from gputrace.daemon.cost import CostMeter
from gputrace.daemon.launch import HeldChild
from gputrace.daemon.targets import ProcTargets, comm_of, default_output, perfetto_path_for, require_privileges
from gputrace.daemon.ticker import Ticker
from gputrace.daemon.writer import QueueSink, SharedWriter
from gputrace.documents import Report
from gputrace.errors import CaptureCutOff, PermissionDenied, UserError
from gputrace.records import SourceStatus
from gputrace.signals import held, on_signals

Log = Callable[[str], None]


def _stderr(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


SESSION_NICE = 5  # the session's threads yield the CPU to the traced job's (nice 0) when both want it (to a third)
MAX_LIVE_OFFERS = 512  # offer sockets held at once (one fd each): far more armed processes than a job runs


@dataclass(frozen=True)
class Pacing:
    """How often the session's threads wake when nothing asks them to. A capture's defaults give a live view
    within tens of milliseconds; watch mode (WATCH_PACING) trades that for fewer wakeups: the kernel rings
    and queues hold far longer than these periods, and a ring filling up is drained at once."""

    wait_s: float = 0.05  # the session's loop: stop asked, targets gone, the cost meter's tick
    ring_poll_ms: int = 50  # the eBPF ring's drain (process events wake it sooner)
    uprobe_poll_ms: int = 100  # the libcuda uprobes' ring when idle (their calls wake it)
    uprobe_rescan_s: float = 0.5  # processes without libcuda yet: their maps read again
    cgroup_tick_s: float = 0.02  # the cpu cgroups' counters (a throttle's end is placed within this)
    agent_flush_ms: int = 100  # agents send their records this often
    nvml_period_s: float = 0.1  # NVML's counters read (its utilization samples are the driver's own, timestamped)


WATCH_PACING = Pacing(wait_s=1.0, ring_poll_ms=250, uprobe_poll_ms=1000, uprobe_rescan_s=5.0, cgroup_tick_s=0.1,
                      agent_flush_ms=1000, nvml_period_s=1.0)


@dataclass
class CaptureOptions:
    output: Path | None = None
    pids: list[int] = field(default_factory=list)
    command: list[str] | None = None
    duration_s: float | None = None
    force: bool = False
    min_gap_ms: float = 1.0
    threshold_us: float = 100.0
    perfetto: bool = True
    progress: bool = True
    sample_hz: int = 499  # CPU stack samples per second of the traced processes (0: no sampling)
    argv: list[str] = field(default_factory=lambda: list(sys.argv))
    on_tracing: Callable[[], None] | None = None  # called once every source is attached, before any wait
    # The service's caller when not root: a descendant that gains privileges it lacks (a setuid or setcap
    # program) is dropped from the trace, as the kernel would refuse this user ptrace or perf on it.
    owner_uid: int | None = None
    off: frozenset[str] = frozenset()  # source families turned off (gputrace.families)
    budget: WriteBudget | None = None  # bytes the capture file may take (gputraced's per-user quota)
    # What writes the capture (called as CaptureWriter is: path, header, force=, budget=); gputraced's watch mode
    # passes its flight recorder, which writes a rolling set of segment captures instead of one file.
    make_writer: Callable[..., Any] | None = None
    on_session: Callable[[Any], None] | None = None  # given the running session once its sources started
    # What follows the targets in the kernel (called as EbpfSource is); watch mode passes its shared program
    # set's views (probes/ebpf/shared.py): one set of kernel programs for all its jobs.
    make_ebpf: Callable[..., Any] | None = None
    # What samples NVML for the session (called with no arguments; default: an NvmlSource of its own): watch mode
    # passes a view of its one sampler for every job (probes/nvml.py, SharedNvml).
    make_nvml: Callable[[], Any] | None = None
    analyse: bool = True  # analyse the capture at the end (and export it, with ``perfetto``)
    pacing: Pacing = field(default_factory=Pacing)
    # What reads the session's own CPU time for its cost meter (default: this process's); watch mode passes
    # the job's part of the service's CPU time (daemon/cost.py, CpuSplit).
    session_cpu: Callable[[], int] | None = None
    # What runs the session's periodic checks (stop conditions, the cost meter's tick) instead of the session's
    # own thread waking for them: watch mode's one Ticker for all its jobs (daemon/ticker.py). Not with a
    # duration or a launched command.
    ticker: Ticker | None = None
    # The thread that writes the capture (default: one of the session's own): watch mode's one for all its jobs
    writer_thread: SharedWriter | None = None


@dataclass
class CaptureResult:
    capture_path: Path
    perfetto_path: Path | None
    exit_code: int | None
    complete: bool
    drops: dict[str, int]
    report: Report | None
    stop_reason: str = ""
    notes: list[str] = field(default_factory=list)
    cut_off: str = ""  # why writing the capture failed part way (a full disk); the file holds what came before
    export_error: str = ""  # why the Perfetto trace could not be written (the capture itself is whole)


def run_capture(opts: CaptureOptions, stop: threading.Event | None = None, log: Log = _stderr) -> CaptureResult:
    """Capture the target processes until ``stop`` is set, the duration ends, or the targets exit."""
    if bool(opts.pids) == bool(opts.command):
        raise UserError("give either -p/--pid PID... or -- CMD ARGS... (one of them)")
    require_privileges()
    comms = {pid: comm_of(pid) for pid in opts.pids}
    return _Session(opts, stop or threading.Event(), log, comms).run()


class _Session:
    def __init__(self, opts: CaptureOptions, stop: threading.Event, log: Log, comms: dict[int, str]) -> None:
        self.opts, self.stop, self.log, self.comms = opts, stop, log, comms
        self.child: HeldChild | None = None
        self.writer: CaptureWriter | None = None
        self.sink: QueueSink | None = None
        self.sources: list[Any] = []
        self.stopped: list[Any] = []
        self.notes: list[str] = []  # said once tracing has started
        self.attached: dict[int, str] = {}  # explicit targets whose agent was reached: pid -> how
        self.offers_failed = 0  # armed children the session could not be offered to
        self.ebpf: Any = None
        self.sampler: Any = None
        self.cgroups: Any = None  # the cpu cgroup sampler: CPU quota throttling of the traced processes
        self.agents: Any = None
        self.sock_dir: Path | None = None
        self.statuses: list[SourceStatus] = []
        self.started_ns = 0  # when tracing began: the capture's start (the header's start_ns is earlier)
        self.cut_off = ""  # why the capture file was cut off, when writing it failed part way
        self.cost: CostMeter | None = None
        self._nice: int | None = None  # the calling thread's nice value before the session lowered it
        self._uncatch: Callable[[], None] = _nothing  # puts back the signal handlers the session replaced

    # ---------------------------------------------------------------------------------- lifecycle ---
    def run(self) -> CaptureResult:
        try:
            self._start()
            reason = self._wait()
            path = self._finish(reason)
        except BaseException:
            self._restore_signals()
            self._abort()
            raise
        finally:
            self._cleanup_socket_dir()
            self._restore_priority()
        return self._after(path, reason)

    def _yield_to_the_job(self) -> None:
        """From here on this thread, and every thread it starts (the sources'), runs at SESSION_NICE: when
        the job and the session want the same CPU, the job gets it, and the session's work (draining rings,
        naming stacks) waits a little (the rings hold seconds of events). Called after the command was forked,
        which keeps its own priority."""
        tid = threading.get_native_id()
        with contextlib.suppress(OSError):
            self._nice = os.getpriority(os.PRIO_PROCESS, tid)
            os.setpriority(os.PRIO_PROCESS, tid, max(self._nice, SESSION_NICE))

    def _restore_priority(self) -> None:
        """The calling thread's priority as it was (a caller that runs captures in-process, a test, goes on);
        without CAP_SYS_NICE it stays low, which harms no one."""
        if self._nice is not None:
            with contextlib.suppress(OSError):
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), self._nice)
            self._nice = None

    def _start(self) -> None:
        if self.opts.command:  # the agent server first, so that the child's environment can name it
            agent_env = self._new_agents().child_env() if "agent" not in self.opts.off else {}
            self.child = HeldChild(self.opts.command, {**os.environ, **agent_env})
            self.comms = {self.child.pid: Path(self.opts.command[0]).name[:15]}
        pids = list(self.comms)
        out = self.opts.output or default_output(self.comms[pids[0]], pids[0])
        self.output = Path(out)
        if self.output.suffix != ".gputrace":
            raise UserError(f"{self.output}: the capture file's name must end in .gputrace")
        check_output_path(self.output, force=self.opts.force)
        for left in cut_off_captures(self.output):
            self.log(f"gputrace: note: {left} is what a capture to this name wrote before it was cut off "
                     f"(`gputrace report {shlex.quote(str(left))}` reads it); remove it when done")
        if self.opts.perfetto:
            check_output_path(perfetto_path_for(self.output), force=self.opts.force)
        header = host_header(self.opts.argv) | {
            "targets": pids,
            "command": self.opts.command or [],
            "threshold_ns": int(self.opts.threshold_us * 1000),
            "off": sorted(self.opts.off),
        }
        self._yield_to_the_job()
        make_writer = self.opts.make_writer or CaptureWriter
        with held():  # a stop signal lands once self.writer names the partial file, so the abort removes it
            self.writer = make_writer(self.output, header, force=self.opts.force, budget=self.opts.budget)
        self.sink = QueueSink(self.writer, shared=self.opts.writer_thread)
        self._start_sources(pids)
        self.cost = CostMeter(self.sink, lambda: self.sources + self.stopped, self.agents, self.opts.session_cpu)
        self.cost.start()
        # Before the command runs and tracing is announced: from then on, Ctrl-C or SIGTERM must end the
        # capture and write it, not unwind and throw away the capture of a command already running.
        self._uncatch = _catch_signals(self.stop, self._pass_on)
        if self.child:
            self.started_ns = clock.monotonic_ns()  # the command runs from here on; nothing of it came before
            self.child.release()
        self.sink.emit_meta("session", {"tracing_ns": self.started_ns})  # a capture cut off keeps it too
        what = f"pid {self.child.pid}: {' '.join(self.opts.command or [])}" if self.child else ", ".join(
            f"{p} ({c})" for p, c in self.comms.items()
        )
        self.log(f"gputrace: tracing {what} and descendants; Ctrl-C to stop")
        for note in self.notes:
            self.log(note)
        if self.opts.on_session is not None:
            self.opts.on_session(self)
        if self.opts.on_tracing is not None:
            self.opts.on_tracing()

    def _new_agents(self) -> Any:
        """The agent server, its socket in a directory of its own that any traced process may pass through."""
        from gputrace.daemon.agents.server import AgentServer

        # A session killed with SIGKILL leaves its directory behind: the first that starts after it tidies up.
        if stale := remove_stale_socket_dirs():
            self.log(f"gputrace: removed the agent-socket directories of {len(stale)} killed session(s): "
                     f"{', '.join(stale)}")
        self.sock_dir = make_socket_dir()
        self.agents = AgentServer(self.sock_dir / "agent.sock", authorize=self._is_traced,
                                  flush_ms=self.opts.pacing.agent_flush_ms)
        return self.agents

    def _pass_on(self, sig: int) -> None:
        """SIGTERM or SIGHUP sent to gputrace (by a supervisor, a closed ssh session) is meant for the job: the
        command gets it too, as under `timeout` or a container runtime, and the capture ends with it. Ctrl-C
        is not passed on: the terminal already sent it to the command's process group."""
        if sig in (signal.SIGTERM, signal.SIGHUP) and self.child is not None and self.child.released:
            with contextlib.suppress(OSError):
                os.kill(self.child.pid, sig)

    def _is_traced(self, pid: int) -> bool:
        return self.ebpf is not None and bool(self.ebpf.is_traced(pid))

    def _start_sources(self, pids: list[int]) -> None:
        from gputrace.probes.ebpf.source import EbpfSource

        assert self.sink is not None
        off = self.opts.off
        if off:
            self.notes.append(f"gputrace: turned off: {', '.join(sorted(off))} (what each costs and what the "
                              "analysis loses without it: gputrace capture --help)")
        make = self.opts.make_ebpf or EbpfSource
        self.ebpf = make(pids, threshold_ns=int(self.opts.threshold_us * 1000), on_proc=self._on_proc,
                         owner_uid=self.opts.owner_uid, off=off, poll_ms=self.opts.pacing.ring_poll_ms)
        try:
            self.ebpf.start(self.sink)
            self.sources.append(self.ebpf)
        except PermissionDenied:
            raise  # a user without the privileges to trace: said in one line, nothing written
        except UserError as e:
            # No eBPF on this host (no bcc, no headers, a sandbox without bpf()): the GPU side still works.
            self.ebpf = ProcTargets(pids)
            self._status("ebpf", "missing", str(e))
            self.notes.append(f"gputrace: eBPF unavailable: {e}; capturing GPU activity (agents, NVML) only: no "
                              "syscalls, block I/O, scheduling or CPU samples, so no stall gets a host-side cause")
        self.started_ns = clock.monotonic_ns()  # attached, the targets in its set: their events are recorded
        if "agent" not in off:
            if self.agents is None:  # attaching to running pids: no child environment needed it yet
                self._new_agents()
            self._try_start(self.agents)
            for pid in pids if not self.opts.command else []:
                self._attach(pid)
        if "nvml" not in off:
            if self.opts.make_nvml is not None:
                self._try_start(self.opts.make_nvml())
            else:
                self._try_start(self._optional_source("gputrace.probes.nvml", "NvmlSource",
                                                      period_s=self.opts.pacing.nvml_period_s))
        if "sampler" not in off:
            self._start_sampler()
        if "cgroups" not in off:
            self._start_cgroups()
        if not self.opts.command and "uprobes" not in off:
            pacing = self.opts.pacing
            self._try_start(self._optional_source("gputrace.probes.uprobes", "UprobeSource", pids,
                                                  owner_uid=self.opts.owner_uid, poll_ms=pacing.uprobe_poll_ms,
                                                  rescan_s=pacing.uprobe_rescan_s))

    def _start_sampler(self) -> None:
        """CPU stack samples of every process traced so far; children forked later come through _on_proc."""
        if self.opts.sample_hz <= 0:
            return
        pids = sorted(self.ebpf.live_targets())
        sampler = self._optional_source("gputrace.probes.sampler", "StackSampler", pids, hz=self.opts.sample_hz,
                                        owner_uid=self.opts.owner_uid)
        self._try_start(sampler)
        if sampler is not None and sampler in self.sources:
            self.sampler = sampler

    def _start_cgroups(self) -> None:
        """The traced processes' cpu cgroups and their throttling counters; children forked later come through
        _on_proc."""
        cgroups = self._optional_source("gputrace.probes.cgroups", "CgroupSampler", sorted(self.ebpf.live_targets()),
                                        tick_s=self.opts.pacing.cgroup_tick_s)
        self._try_start(cgroups)
        if cgroups is not None and cgroups in self.sources:
            self.cgroups = cgroups

    def _optional_source(self, module: str, name: str, *args: Any, **kwargs: Any) -> Any:
        try:
            mod = __import__(module, fromlist=[name])
            return getattr(mod, name)(*args, **kwargs)
        except (ImportError, AttributeError) as e:
            self._status(name.lower(), "missing", f"not available: {e}")
            return None

    def _try_start(self, source: Any) -> None:
        """A secondary source that cannot start degrades the capture; it does not end it."""
        if source is None:
            return
        assert self.sink is not None
        try:
            source.start(self.sink)
            self.sources.append(source)
        except UserError as e:
            self._status(source.name, "missing", str(e))
            self.log(f"gputrace: {source.name}: {e} (continuing without it)")

    def _status(self, source: str, status: str, detail: str) -> None:
        rec = SourceStatus(clock.monotonic_ns(), source, status, detail)
        self.statuses.append(rec)
        if self.sink is not None:
            self.sink.emit([rec])

    def _on_proc(self, record: Any) -> None:
        """Called from the eBPF source's thread for process events: offer new armed processes the session and
        have them sampled; withdraw a process's offer when it exits."""
        kind = type(record).__name__
        gone = (kind == "ProcExit" and record.tid == record.pid) or kind == "ProcLeftOut"  # no exit event after
        if gone and self.agents is not None:
            self.agents.withdraw(record.pid)
            return
        if kind != "ProcFork" or record.is_thread:
            return
        if self.sampler is not None:
            self.sampler.add_target(record.child_pid)
        if self.cgroups is not None:
            self.cgroups.add_target(record.child_pid)
        if not self.opts.command and is_armed(record.child_pid):
            self._offer(record.child_pid)

    def _attach(self, pid: int) -> None:
        """An explicit target: offer the session to its armed agent, or inject one (Python >= 3.14)."""
        try:
            how = self.agents.attach(pid)
            self.attached[pid] = how
            done = self.agents.injections.get(pid) if how == "injected" else None
            self.notes.append(f"gputrace: GPU agent of pid {pid}: {done.describe() if done else how}")
        except UserError as e:
            self._status("agent", "degraded", f"pid {pid}: {e}")
            self.notes.append(f"gputrace: pid {pid}: no GPU agent ({e}); its GPU work is not traced")

    def _offer(self, pid: int) -> None:
        if self.agents is None:
            return
        if self.agents.live_offers() >= MAX_LIVE_OFFERS:
            self._offer_trouble(f"more than {MAX_LIVE_OFFERS} armed processes alive at once")
            return
        try:
            self.agents.offer(pid)
        except (OSError, UserError) as e:
            self._offer_trouble(str(e))

    def _offer_trouble(self, why: str) -> None:
        """An armed child that could not be offered the session: said once, counted always."""
        self.offers_failed += 1
        if self.offers_failed == 1:
            self.log(f"gputrace: cannot offer the session to an armed child ({why}); later ones are counted")
            self._status("agent", "degraded", f"armed children not offered the session: {why}")

    # ------------------------------------------------------------------------------------ waiting ---
    def _wait(self) -> str:
        deadline = None
        if self.opts.duration_s is not None:
            # -d counts from when tracing began (the eBPF source attached), not from when the slower sources
            # (agents, NVML, the sampler's compilation) were ready: the capture holds that many seconds.
            setup_s = (clock.monotonic_ns() - self.started_ns) / 1e9 if self.started_ns else 0.0
            deadline = time.monotonic() + max(0.0, self.opts.duration_s - setup_s)
            if setup_s > self.opts.duration_s:
                self.log(f"gputrace: starting every source took {setup_s:.1f} s, longer than -d "
                         f"{self.opts.duration_s:g}: the capture ends now")
        if self.opts.ticker is not None and deadline is None and self.child is None:
            try:
                return self._wait_ticked(self.opts.ticker)
            finally:
                self._restore_signals()
        progress = _Progress(self.log if self.opts.progress and sys.stderr.isatty() else None)
        try:
            while True:
                reason = self._should_stop(deadline)
                if reason:
                    return reason
                progress.tick(self)
                if self.cost is not None:
                    self.cost.tick()
                self.stop.wait(self.opts.pacing.wait_s)
        finally:
            progress.done()
            self._restore_signals()

    def _wait_ticked(self, ticker: Ticker) -> str:
        """``_wait`` with the checks run by ``ticker``'s thread: this thread sleeps until they find a reason to
        stop (then set ``stop``) or someone else sets it. A check that raises wakes this thread to raise it."""
        reason = self._should_stop(None)  # as the loop asks first: the targets may be gone already
        if reason:
            return reason
        found: list[str | Exception] = []

        def check() -> bool:
            try:
                reason = self._should_stop(None)
                if not reason:
                    if self.cost is not None:
                        self.cost.tick()
                    return True
                found.append(reason)
            except Exception as e:  # noqa: BLE001 - raised in the session's thread, below
                found.append(e)
            self.stop.set()
            return False

        ticker.add(check)
        try:
            self.stop.wait()
        finally:
            ticker.remove(check)  # not run again, nor running
        if found and isinstance(found[0], Exception):
            raise found[0]
        return found[0] if found and isinstance(found[0], str) else "stopped"

    def _restore_signals(self) -> None:
        self._uncatch()
        self._uncatch = _nothing

    def _should_stop(self, deadline: float | None) -> str:
        if self.stop.is_set():
            return "stopped"
        if deadline is not None and time.monotonic() >= deadline:
            return "duration"
        if self.child is not None and self.child.poll() is not None:
            return "command exited"
        if self.child is None and not self.ebpf.any_live():  # asked every 50 ms
            return "targets exited"
        if self.sink is not None and self.sink.error is not None:
            return "write error"
        return ""

    # ---------------------------------------------------------------------------------- finishing ---
    def _finish(self, reason: str) -> Path:
        assert self.sink is not None and self.writer is not None
        self._stop_sources()
        if self.cost is not None:
            self.cost.final()
        self._agents_never_heard()
        if self.offers_failed:
            self._status("agent", "degraded", f"{self.offers_failed} armed child process(es) were not offered the "
                         "session: their GPU work is not traced")
        try:
            self.sink.close()
        except CaptureCutOff as e:
            return self._cut_off(e)
        drops = self._drops()
        trailer = {
            "end_ns": clock.monotonic_ns(),
            "tracing_ns": self.started_ns,
            "stop_reason": reason,
            "drops": drops,
            "complete": not any(drops.values()),
            "sources": {s.source: [s.status, s.detail] for s in self.statuses},
            "skipped": self._skipped(),
        }
        if self.attached and self.agents is not None:
            trailer["attached"] = self._attached_summary()
        if self.cost is not None:
            trailer["overhead"] = self.cost.summary(self._source_counts("events"), self._source_counts("wakeups"))
        self.drops = drops
        try:
            return self.writer.close(trailer)
        except CaptureCutOff as e:
            return self._cut_off(e)

    def _cut_off(self, e: CaptureCutOff) -> Path:
        """Writing failed part way: the file keeps what was written; the command is left to finish."""
        self.cut_off = str(e)
        self.drops = self._drops()
        return Path(str(e.path))

    def _attached_summary(self) -> list[dict[str, Any]]:
        """Each explicit target's agent: how it was reached, the way an injection went and the target's pause."""
        out: list[dict[str, Any]] = []
        for pid, how in sorted(self.attached.items()):
            row: dict[str, Any] = {"pid": pid, "how": how}
            done = self.agents.injections.get(pid)
            if how == "injected" and done is not None:
                row["method"] = done.method
                if done.pause_ms is not None:
                    row["pause_ms"] = round(done.pause_ms, 3)
            out.append(row)
        return out

    def _agents_never_heard(self) -> None:
        """Say so when an agent we injected or offered never connected: no GPU records is then no news."""
        heard = self.agents.heard_from() if self.attached else set()
        for pid, how in self.attached.items():
            if pid in heard:
                continue
            if how == "injected":
                done = self.agents.injections.get(pid)
                way = "the pending call" if done is not None and done.method == "ptrace" else "sys.remote_exec"
                why = (f"{way} runs the agent when the process's main thread next runs Python code, "
                       "and it ran none during the capture (blocked in a call that does not return to Python?)")
                kept = self.agents.kept_scripts.get(pid)
                if kept is not None:
                    why += (f"; its script stays at {kept} (as the process sees it) for when that happens: it "
                            "then finds no session and does nothing")
            else:
                why = f"its armed agent looks for offers once a second in {self.agents.attach_dir}: can it see that?"
            self._status("agent", "degraded", f"pid {pid}: the agent never connected")
            self.log(f"gputrace: pid {pid}: the GPU agent was {how} but never connected: {why}")

    def drops_so_far(self) -> dict[str, int]:
        """Every record lost so far, by source (cumulative; what the trailer's ``drops`` will say)."""
        return self._drops()

    def _drops(self) -> dict[str, int]:
        assert self.sink is not None
        drops = {f"session.{k}": v for k, v in self.sink.drops().items()}
        for source in self.sources + self.stopped:
            drops.update({f"{source.name}.{k}": int(v) for k, v in source.drops().items()})
        return drops

    def _source_counts(self, attr: str) -> dict[str, int]:
        """An integer attribute (events, wakeups) of every source that keeps one, by source."""
        out: dict[str, int] = {}
        for source in self.sources + self.stopped:
            n = getattr(source, attr, None)
            if type(n) is int:
                out[source.name] = n
        return out

    def _skipped(self) -> dict[str, int]:
        """Kernel programs the kernel did not run (nested in another tracing program): their events may be
        missing, for any task. Kept apart from drops, which are this capture's own records lost."""
        out: dict[str, int] = {}
        for source in self.sources + self.stopped:
            counts = getattr(source, "skipped", None)
            if counts is not None:
                out.update({f"{source.name}.{k}": int(v) for k, v in counts().items() if v})
        return out

    def _stop_sources(self) -> None:
        """Stop in reverse start order; each source is stopped once, its drops kept for the trailer."""
        while self.sources:
            source = self.sources.pop()
            self.stopped.append(source)
            try:
                source.stop()
            except Exception as e:  # noqa: BLE001 - one source's failure must not cost the others' records
                name = getattr(source, "name", type(source).__name__)
                self._status(name, "ended_early", f"stopping failed: {type(e).__name__}: {e}")
                self.log(f"gputrace: {name}: stopping failed: {e}")

    def _abort(self) -> None:
        if self.cost is not None:
            self.cost.stats.close()
        try:
            self._stop_sources()
        except Exception as e:  # noqa: BLE001 - already failing; report and go on
            self.log(f"gputrace: stopping sources: {e}")
        if self.sink is not None:
            with contextlib.suppress(BaseException):  # the original error matters more
                self.sink.close()
        if self.writer is not None:
            self.writer.abort()
        if self.child is not None and not self.child.released:
            self.child.kill()

    def _cleanup_socket_dir(self) -> None:
        """Everything the session made there, but a script an injected process has yet to run (agents.py,
        keep_unrun_scripts): the directory then stays with it (tiny, root's, not writable by others)."""
        if self.sock_dir is None:
            return
        kept = set(self.agents.kept_scripts.values()) if self.agents is not None else set()
        for p in self.sock_dir.iterdir():
            if p not in kept:
                p.unlink(missing_ok=True)
        if not any(self.sock_dir.iterdir()):
            self.sock_dir.rmdir()

    def _after(self, path: Path, reason: str) -> CaptureResult:
        from gputrace.daemon.finish import analyse_and_export

        result = CaptureResult(path, None, None, not any(self.drops.values()), self.drops, None, reason)
        if self.cut_off:
            result.complete, result.cut_off = False, self.cut_off
            self.log(f"gputrace: error: {self.cut_off}")
            self.log(f"Next:\n  gputrace report {shlex.quote(str(path))}")
        elif self.opts.analyse:
            analyse_and_export(result, self.opts, self.log)
        if self.child is not None:
            if self.child.poll() is None:
                self.log(f"gputrace: waiting for pid {self.child.pid} ({self.opts.command[0]}) to exit")  # type: ignore[index]
            result.exit_code = self.child.exit_code
        return result


def _nothing() -> None:
    pass


def _catch_signals(stop: threading.Event, pass_on: Callable[[int], None] = lambda sig: None) -> Callable[[], None]:
    """Ctrl-C, SIGTERM and SIGHUP (the terminal or ssh session went away) end the capture cleanly; a SIGHUP
    ignored (nohup) stays ignored. ``pass_on`` gets each signal too. Only possible from the main thread."""

    def handler(sig: int, frame: object) -> None:
        stop.set()
        pass_on(sig)

    return on_signals((signal.SIGINT, signal.SIGTERM, signal.SIGHUP), handler)


class _Progress:
    """One status line, refreshed about once a second, on a terminal only."""

    def __init__(self, log: Log | None) -> None:
        self.log, self.next = log, time.monotonic() + 1.0
        self.shown = False

    def tick(self, session: _Session) -> None:
        if self.log is None or time.monotonic() < self.next:
            return
        self.next += 1.0
        w = session.writer
        events = sum(w.counts.values()) if w else 0
        drops = sum(session._drops().values())
        secs = (clock.monotonic_ns() - session.started_ns) / 1e9
        sys.stderr.write(f"\r  {secs:7.1f} s  {events:>12,} records  {drops:,} dropped ")
        sys.stderr.flush()
        self.shown = True

    def done(self) -> None:
        if self.shown:
            sys.stderr.write("\n")
