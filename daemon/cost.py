"""What a capture costs the host, measured while it runs: the tool's own bill, kept in the capture.

Three kinds of CPU time are tracing's, and only tracing's:
- the kernel programs' run time (each source's ``program_runs()``, timed by the kernel's BPF statistics,
  turned on for the capture through probes/ebpf/bpfstats.py and off again after it), paid by whichever task
  hit the hook, traced or not;
- the capturing process's own CPU time (its threads drain the ring buffers, write the file, sample NVML); in
  watch mode the service's process serves every job, and its CPU time is split evenly between the jobs
  present while it accrues (``CpuSplit``), as the shared kernel programs' run time is;
- each agent's CPU time inside its traced process (its I/O thread, CUPTI flushes and conversions), as the
  agent reports it.
Every second a ``TracingCost`` record per source goes into the capture (a counter track in Perfetto); at the
end ``summary()`` gives the totals for the trailer, with the share of the host's CPU time over the window.
A figure that cannot be measured is left out, and ``missing`` says why.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Callable, Iterable
from typing import Any

from gputrace import clock
from gputrace.probes.ebpf.bpfstats import RunStats
from gputrace.records import TracingCost
from gputrace.source import Sink

INTERVAL_NS = 1_000_000_000
Runs = dict[str, tuple[int, int]]


class CpuSplit:
    """This process's CPU time, split evenly between the parties present while it accrues: watch mode runs
    every job's session in the one service process, whose threads (drains, writers, agent servers, the scan,
    the analysis) serve them all. Each party's part starts at 0 when it joins; the parts add up to what the
    process used while any party was present."""

    def __init__(self, clock_ns: Callable[[], int] = time.process_time_ns) -> None:
        self.clock_ns = clock_ns
        self.lock = threading.Lock()
        self.seen = clock_ns()
        self.parts: dict[object, int] = {}

    def join(self, party: object) -> Callable[[], int]:
        """Add ``party``; returns what reads its part so far."""
        with self.lock:
            self._split()
            self.parts[party] = 0
        return lambda: self.part(party)

    def leave(self, party: object) -> None:
        with self.lock:
            self._split()
            self.parts.pop(party, None)

    def part(self, party: object) -> int:
        with self.lock:
            self._split()
            return self.parts.get(party, 0)

    def _split(self) -> None:
        now = self.clock_ns()
        spent, self.seen = max(0, now - self.seen), now
        if self.parts:
            share = spent // len(self.parts)
            for party in self.parts:
                self.parts[party] += share


class CostMeter:
    """Started once the sources are; ``tick()`` from the session's wait loop, ``final()`` after the sources
    stopped (they keep their programs' last figures), ``summary()`` for the trailer. ``session_cpu``: what
    reads the session's own CPU time (default: this process's; watch mode: the job's part, CpuSplit)."""

    def __init__(self, sink: Sink, sources: Callable[[], Iterable[Any]], agents: Any,
                 session_cpu: Callable[[], int] | None = None) -> None:
        self.sink, self.sources, self.agents = sink, sources, agents
        self.session_cpu = session_cpu or time.process_time_ns
        self.stats = RunStats()
        self.start_ns = self.next_ns = 0
        self.cpu0 = 0
        self.base: dict[str, Runs] = {}  # each source's program figures when the meter started
        self.last: list[TracingCost] = []
        self.programs: dict[str, Runs] = {}
        self.stats_on = False  # whether the kernel timed the programs up to the end

    def start(self) -> None:
        self.stats.open()
        self.start_ns = clock.monotonic_ns()
        self.next_ns = self.start_ns + INTERVAL_NS
        self.cpu0 = self.session_cpu()
        self.base = {s.name: s.program_runs() for s in self._kernel_sources()}
        # Each counter's zero, as the first row: a window of the capture that holds the start and one tick (a
        # flight recorder's dump of a job's first seconds) has its cost from there.
        self._record(self.start_ns)

    def tick(self) -> None:
        now = clock.monotonic_ns()
        if self.start_ns and now >= self.next_ns:
            self.next_ns = now + INTERVAL_NS
            self._record(now)

    def final(self) -> None:
        """The last figures, once every source has stopped; statistics go back off."""
        if self.start_ns:
            self._record(clock.monotonic_ns())
        self.stats_on = self.stats.on
        self.stats.close()

    def _kernel_sources(self) -> list[Any]:
        return [s for s in self.sources() if callable(getattr(s, "program_runs", None))]

    def _programs(self) -> dict[str, Runs]:
        """Each kernel source's programs' (runs, ns) since the meter started."""
        out: dict[str, Runs] = {}
        for s in self._kernel_sources():
            base = self.base.get(s.name, {})
            runs = {}
            for prog, (n, ns) in s.program_runs().items():
                n0, ns0 = base.get(prog, (0, 0))
                runs[prog] = (max(0, n - n0), max(0, ns - ns0))
            out[s.name] = runs
        return out

    def _record(self, now: int) -> None:
        rows = [TracingCost(now, "session", self.session_cpu() - self.cpu0)]
        self.programs = self._programs() if self.stats.on else {}
        for source, runs in self.programs.items():
            rows.append(TracingCost(now, source, sum(ns for _, ns in runs.values()), sum(n for n, _ in runs.values())))
        agents = self.agents.cpu_ns() if self.agents is not None else {}
        rows += [TracingCost(now, "agent", ns, 0, pid) for pid, ns in sorted(agents.items())]
        self.last = rows
        self.sink.emit(rows)

    def summary(self, events: dict[str, int], wakeups: dict[str, int]) -> dict[str, Any]:
        """The trailer's ``overhead``: totals by source, the share of the host's CPU, per-program figures."""
        end = self.last[0].ts if self.last else clock.monotonic_ns()
        window = max(1, end - self.start_ns)
        cpus = os.cpu_count() or 1
        by_source: dict[str, int] = {}
        for r in self.last:
            by_source[r.source] = by_source.get(r.source, 0) + r.cpu_ns
        out: dict[str, Any] = {
            "cpu_share": round(sum(by_source.values()) / (window * cpus), 6),
            "window_ns": window,
            "host_cpus": cpus,
            "by_source": by_source,
            "events": events,
            "events_per_s": {k: round(v * 1e9 / window, 1) for k, v in events.items()},
            "wakeups": wakeups,
        }
        if self.programs:
            out["programs"] = {f"{src}.{prog}": {"runs": n, "ns": ns} for src, runs in self.programs.items()
                               for prog, (n, ns) in sorted(runs.items())}  # fmt: skip
        missing = {}
        if not self.stats_on and self._kernel_sources():
            missing["probes"] = self.stats.why or "BPF statistics are off"
        if self.agents is not None and self.agents.heard_from() and not any(r.source == "agent" for r in self.last):
            missing["agent"] = "the agents reported no CPU time (an older gputrace agent?)"
        if missing:
            out["missing"] = missing
        return out
