"""One eBPF program set for many captures: watch mode's jobs share it (daemon/watch/).

Each capture session of its own loads the programs of probes/bpf/gputrace.bpf.c, and every syscall and
scheduler event on the host runs every loaded set: with N watched jobs the kernel side costs N times one
set, and more (each set also runs for the other jobs' events). ``SharedEbpf`` loads one set per kind of
capture (owner, families turned off, threshold, pacing) and hands each job a ``SharedView``: the object the
session uses as its eBPF source. The set's target set holds every job's processes; its ring is drained once,
and each event goes to the job whose process it is about. Every event starts with the same header (type,
a second word, pid, tid: probes/bpf/gputrace.h), so routing reads the pid at a fixed offset without decoding.

- A process forked by a job's process belongs to that job (the fork record names both). The child's first
  events may come out of the ring before its fork record is read (two rings): an event of a process not yet
  known waits for the end of that drain, when every fork of it has been read.
- Block requests of processes that are no job's (the kernel records them while a traced task waits on the
  block layer: a kworker's writeback) go to every job, as each session of its own would have recorded them.
- An event no job owns at the end of a drain (one that came out of the ring after its job left) is counted
  (``unrouted`` in the set's status), never given to another job.
- A job that leaves gets what a source of its own would write at stop: its threads caught waiting, its
  short-call totals (taken out of the kernel's table), the drops and the final status; the set stays loaded
  for the others and is unloaded when the last one leaves.
- The kernel programs' run time is split evenly between the jobs present while it accrues (each view's
  ``program_runs``), so the jobs' cost meters add up to the set's cost once, not once per job. Drops and
  skipped runs of the shared ring are reported to every job present when they happen (they may be any
  job's): a job's capture is never said complete when records that may be its own were lost.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from gputrace import clock
from gputrace.errors import UserError
from gputrace.probes import procfs
from gputrace.probes.ebpf import events, final, uring
from gputrace.probes.ebpf.source import EbpfSource, ProcCallback
from gputrace.records import Drops, ProcExit, ProcFork, ProcLeftOut, SourceStatus
from gputrace.source import Sink

_PID = slice(8, 12)  # the pid in every kernel event's header (type, word, pid, tid)
_LEAVE_WAIT_S = 10.0
BUSIEST = 4  # programs of a set named in status, the busiest first
# The set's program figures are read at most this often for the jobs' cost meters, which each ask once a second
# (a file read per program): every job's meter then shares one read a second, its part at most this old.
_SPLIT_S = 1.0


@dataclass(frozen=True)
class SetKey:
    """What must be the same for jobs to share a program set: the programs compiled, and how they are read."""

    owner_uid: int | None
    off: frozenset[str]
    threshold_ns: int
    poll_ms: int


@dataclass
class _Leaving:
    view: SharedView
    done: threading.Event = field(default_factory=threading.Event)


class _RoutedSource(EbpfSource):
    """The shared program set: an EbpfSource whose drained events and records are routed to the views."""

    def __init__(self, owner: _ProgramSet, pids: Sequence[int], key: SetKey) -> None:
        super().__init__(pids, threshold_ns=key.threshold_ns, on_proc=owner.on_proc, owner_uid=key.owner_uid,
                         off=key.off, poll_ms=key.poll_ms)
        self.set = owner

    def _flush(self) -> None:
        if self._batch:
            batch, self._batch = self._batch, []
            self.events += len(batch)
            self.set.route_events(batch)

    def drain_done(self) -> None:
        self.set.end_of_drain()


class _ProgramSet:
    """One loaded program set and the views that share it; see the module docstring."""

    def __init__(self, key: SetKey) -> None:
        self.key = key
        # routes, views, pending events, split accounts; re-entered: adding a target routes its /proc records
        self.lock = threading.RLock()
        self.views: list[SharedView] = []
        self.routes: dict[int, SharedView] = {}  # tgid -> its job's view
        self.pending: list[bytes] = []  # events of processes not known yet in this drain
        self.gone: list[int] = []  # processes that exited in this drain: forgotten at its end
        self.leaving: list[_Leaving] = []
        self.meta: list[tuple[str, dict[str, Any]]] = []
        self.source: _RoutedSource | None = None
        self.unrouted = 0
        self._runs_seen: dict[str, tuple[int, int]] = {}  # the set's program figures when last split
        self._split_at = 0.0
        self.loaded_at = 0.0  # when its programs were loaded (time.monotonic)

    # ------------------------------------------------------------------------ joining, leaving ---
    def join(self, view: SharedView, sink: Sink) -> bool:
        """Start routing ``view``'s processes to ``sink``; the first view loads the programs (True)."""
        if self.source is None:
            for pid in view.pids:
                if procfs.proc_info(pid) is None:
                    raise UserError(f"no process with pid {pid}")
            with self.lock:
                self._add_view(view, sink)
            self.source = _RoutedSource(self, view.pids, self.key)
            self.loaded_at = time.monotonic()
            try:
                self.source.start(_Demux(self))
            except BaseException:
                with self.lock:
                    self.views.remove(view)
                    self._forget_routes(view)
                self.source = None
                raise
            return True
        for pid in view.pids:
            if procfs.proc_info(pid) is None:
                raise UserError(f"no process with pid {pid}")
        with self.lock:  # held while the processes enter the target set: their first events route after
            self._add_view(view, sink)
            for kind, meta in self.meta:
                sink.emit_meta(kind, meta)
            for pid in view.pids:
                self.source.add_target(pid)
        return False

    def _add_view(self, view: SharedView, sink: Sink) -> None:
        self._split_runs()
        view.sink = sink
        view.base_drops = self.source.drops() if self.source is not None else {}
        view.base_skips = self.source.skipped() if self.source is not None else {}
        view.base_wakeups = self.source.wakeups if self.source is not None else 0
        self.views.append(view)
        for pid in view.pids:
            self._route_tree(view, pid)

    def _route_tree(self, view: SharedView, pid: int) -> None:
        """(lock held) ``pid`` and its descendants are ``view``'s, before they enter the target set (adding them
        writes their /proc state, which must find its job)."""
        for p in [pid, *procfs.descendants(pid)]:
            self.routes[p] = view
            view.owned.add(p)
            view.ever.add(p)

    def add_target(self, view: SharedView, pid: int) -> None:
        assert self.source is not None
        with self.lock:
            self._route_tree(view, pid)
            self.source.add_target(pid)

    def leave(self, view: SharedView) -> None:
        """The view's last records, written by the drain thread after a drain (it alone reads the rings), then
        the view is gone; the last view to leave unloads the programs."""
        source = self.source
        if source is None:
            return
        ask = _Leaving(view)
        with self.lock:
            self.leaving.append(ask)
        thread = source._thread
        if thread is None or not thread.is_alive() or not ask.done.wait(_LEAVE_WAIT_S):
            with self.lock:  # the drain thread ended (a polling error) or hangs: finish here
                if ask in self.leaving:
                    self.leaving.remove(ask)
                    self._finish(view, final_drain=False)

    def stop_if_empty(self) -> bool:
        """Unload the programs when no view is left (called with the registry's lock held)."""
        with self.lock:
            if self.views or self.source is None:
                return False
            source, self.source = self.source, None
        source.stop()  # its last records reach no view: every job has had its own
        return True

    # -------------------------------------------------------------------------------- routing ---
    def route_events(self, batch: list[bytes]) -> None:
        """Drain thread: each raw event to its process's view (batched per view, in ring order)."""
        out: dict[int, list[bytes]] = {}
        with self.lock:
            routes, pending = self.routes, self.pending
            for raw in batch:
                view = routes.get(int.from_bytes(raw[_PID], "little"))
                if view is None:
                    pending.append(raw)
                else:
                    out.setdefault(id(view), []).append(raw)
            targets = {id(v): v for v in self.views}
        for vid, raws in out.items():
            targets[vid].emit_kernel(raws)

    def route_records(self, records: Sequence[Any]) -> None:
        """Typed records to the views of their processes; one without a process, to every view. A fork
        makes its child the parent's job's; an exit lets the process go at the end of the drain."""
        out: dict[int, list[Any]] = {}
        with self.lock:
            views = {id(v): v for v in self.views}
            for rec in records:
                if isinstance(rec, SourceStatus):
                    continue  # each view says its own
                pid = rec.parent_pid if isinstance(rec, ProcFork) else getattr(rec, "pid", None)
                view = self.routes.get(pid) if isinstance(pid, int) else None
                if view is None:
                    if isinstance(pid, int):
                        self.unrouted += 1
                        continue
                    for vid in views:
                        out.setdefault(vid, []).append(rec)
                    continue
                out.setdefault(id(view), []).append(rec)
                if isinstance(rec, ProcFork) and not rec.is_thread:
                    self.routes[rec.child_pid] = view
                    view.owned.add(rec.child_pid)
                    view.ever.add(rec.child_pid)
                elif isinstance(rec, (ProcExit, ProcLeftOut)) and rec.tid == rec.pid:
                    self.gone.append(rec.pid)
                if isinstance(rec, ProcLeftOut):
                    view.left_out += 1
        for vid, recs in out.items():
            views[vid].emit(recs)

    def on_proc(self, rec: Any) -> None:
        """Drain thread, after the record was routed: the view's session hears of its processes' events."""
        with self.lock:
            view = self.routes.get(rec.pid)
        if view is not None and view.on_proc is not None:
            view.on_proc(rec)

    def end_of_drain(self) -> None:
        """Drain thread, after each drain: every fork of this drain has been read, so the events that waited
        find their job; block requests of no job go to every job; processes that exited are forgotten; the
        views that asked to leave get their last records."""
        with self.lock:
            pending, self.pending = self.pending, []
            gone, self.gone = self.gone, []
            leaving, self.leaving = self.leaving, []
        if pending:
            self._route_pending(pending)
        with self.lock:
            for pid in gone:
                view = self.routes.pop(pid, None)
                if view is not None:
                    view.owned.discard(pid)
            for ask in leaving:
                self._finish(ask.view, final_drain=True)
                ask.done.set()

    def _route_pending(self, pending: list[bytes]) -> None:
        out: dict[int, list[bytes]] = {}
        with self.lock:
            views = {id(v): v for v in self.views}
            for raw in pending:
                view = self.routes.get(int.from_bytes(raw[_PID], "little"))
                if view is not None:
                    out.setdefault(id(view), []).append(raw)
                elif int.from_bytes(raw[:4], "little") == events.EV_BLOCK:
                    for vid in views:
                        out.setdefault(vid, []).append(raw)
                else:
                    self.unrouted += 1
        for vid, raws in out.items():
            views[vid].emit_kernel(raws)

    # ------------------------------------------------------------------------------- a view ends ---
    def _finish(self, view: SharedView, *, final_drain: bool) -> None:
        """(lock held) What the view's own source would write at stop; its processes leave the target set."""
        source = self.source
        assert source is not None and view.sink is not None
        self._split_runs()
        now = clock.monotonic_ns()
        bpf = source._bpf
        pids = set(view.owned)
        records: list[Any] = []
        if bpf is not None and final_drain:
            slots = [v for _, v in bpf[b"inflight"].items_lookup_batch()]
            offcpu = {k.value: v for k, v in bpf[b"offcpu"].items()}
            live = {p for p in pids if procfs.proc_info(p) is not None}
            waiting = final.unfinished(slots, offcpu, live, source._since, now, source.threshold_ns)
            requests, view.uring_unsure = final.unfinished_requests(source._uring_entries(), live, now,
                                                                    source.threshold_ns)
            waiting += requests
            if waiting:
                view.emit_kernel(waiting)
            records += self._take_aggregates(bpf, slots, view.ever)
        view.final_drops = view.drops()
        view.final_skips = view.skipped()
        records += [Drops(now, "ebpf", what, n) for what, n in view.final_drops.items()]
        detail = f"{view.events} kernel events (one program set shared with the other watched jobs)"
        if view.left_out:
            detail += f"; {view.left_out} processes left out"
        records.append(SourceStatus(now, "ebpf", "stopped", detail))
        view.emit(records)
        for pid in pids:
            if self.routes.get(pid) is view:
                del self.routes[pid]
                if bpf is not None:
                    source._remove_from_target_set(pid)
        view.owned.clear()
        self.views.remove(view)
        view.sink = None

    def _take_aggregates(self, bpf: Any, slots: list[Any], pids: set[int]) -> list[Any]:
        """The view's short-call totals, taken out of the kernel's table (a later job under a reused pid must
        not inherit them)."""
        table = bpf[b"agg"]
        mine, stale = [], []
        for k, v in table.items():
            if k.pid in pids:
                mine.append((k, v))
            elif k.pid not in self.routes:
                stale.append(k)  # folded after their job left (a call that ended after): no one's now
        for k in [k for k, _ in mine] + stale:
            table.pop(k, None)
        own_slots = [s for s in slots if s.agg_pid in pids]
        names = {**uring.agg_names(), **self.source._nr_names} if self.source is not None else {}
        return final.aggregates(mine, own_slots, names)

    # ------------------------------------------------------------------------------ the cost split ---
    def _split_runs(self, *, fresh: bool = True) -> None:
        """(lock held) The programs' runs and run time since the last split, shared evenly by the views
        present: each view's account then holds its part, and the parts add up to the whole. Not ``fresh``
        (a job's cost meter, every second): figures read less than _SPLIT_S ago do (reading them costs a
        file read per program, and every job's meter asks)."""
        if self.source is None:
            return
        t = time.monotonic()
        if not fresh and t - self._split_at < _SPLIT_S:
            return
        self._split_at = t
        now = self.source.program_runs()
        if self.views:
            share = len(self.views)
            for prog, (n, ns) in now.items():
                n0, ns0 = self._runs_seen.get(prog, (0, 0))
                dn, dns = max(0, n - n0), max(0, ns - ns0)
                for view in self.views:
                    a, b = view.runs.get(prog, (0, 0))
                    view.runs[prog] = (a + dn // share, b + dns // share)
        self._runs_seen = now

    def split_runs(self, *, fresh: bool = True) -> dict[str, tuple[int, int]]:
        """Split what accrued since the last split; the set's figures it was split at."""
        with self.lock:
            self._split_runs(fresh=fresh)
            return dict(self._runs_seen)

    def _forget_routes(self, view: SharedView) -> None:
        for pid in list(view.owned):
            if self.routes.get(pid) is view:
                del self.routes[pid]
        view.owned.clear()


class _Demux:
    """The sink the shared source writes into: its records and metadata go to the views."""

    def __init__(self, owner: _ProgramSet) -> None:
        self.set = owner

    def emit(self, records: Sequence[tuple[Any, ...]]) -> None:
        self.set.route_records(records)

    def emit_kernel(self, blob: bytes, nevents: int) -> None:
        # Only the source's own stop writes a blob here (its views have all left by then): nothing to route.
        self.set.unrouted += nevents

    def emit_meta(self, source: str, meta: dict[str, Any]) -> None:
        with self.set.lock:
            self.set.meta.append((source, meta))
            views = list(self.set.views)
        for view in views:
            if view.sink is not None:
                view.sink.emit_meta(source, meta)


class SharedView:
    """A capture's eBPF source in a shared program set: what the session asks of an EbpfSource, for its own
    processes only."""

    name = "ebpf"

    def __init__(self, registry: SharedEbpf, pids: Sequence[int], key: SetKey, on_proc: ProcCallback | None) -> None:
        self.registry, self.key, self.on_proc = registry, key, on_proc
        self.pids = list(pids)
        self.owned: set[int] = set()  # its processes now (routes of the set)
        self.ever: set[int] = set()  # and those that exited: their short-call totals are the job's
        self.sink: Sink | None = None
        self.set: _ProgramSet | None = None
        self.events = 0
        self.left_out = 0
        self.uring_unsure = 0
        self.runs: dict[str, tuple[int, int]] = {}
        self.base_drops: dict[str, int] = {}
        self.base_skips: dict[str, int] = {}
        self.base_wakeups = 0
        self.final_drops: dict[str, int] | None = None
        self.final_skips: dict[str, int] | None = None
        self.final_wakeups: int | None = None

    # ---------------------------------------------------------------------------- as a source ---
    def start(self, sink: Sink) -> None:
        self.set = self.registry.join(self, sink)
        assert self.set.source is not None
        src = self.set.source
        how = "raw tracepoints sys_enter/sys_exit" if src.hook == "raw" else "classic syscall tracepoints"
        detail = (f"syscalls via {how}; scheduler via {src.sched} tracepoints; one program set shared by "
                  f"{self.registry.sharing(self.set)} watched job(s)")
        status = "degraded" if src.missing else "started"
        if src.missing:
            detail = f"missing tracepoints: {', '.join(src.missing)}; {detail}"
        sink.emit([SourceStatus(clock.monotonic_ns(), self.name, status, detail)])

    def stop(self) -> None:
        if self.set is None or self.sink is None:
            return
        self.final_wakeups = self.wakeups
        self.set.leave(self)
        self.registry.release(self.set)

    def emit_kernel(self, raws: list[bytes]) -> None:
        if self.sink is not None and raws:
            self.events += len(raws)
            self.sink.emit_kernel(b"".join(raws), len(raws))

    def emit(self, records: list[Any]) -> None:
        if self.sink is not None and records:
            self.sink.emit(records)

    def drops(self) -> dict[str, int]:
        """The shared ring's losses since this job joined (they may be any job's records)."""
        if self.final_drops is not None:
            return dict(self.final_drops)
        src = self.set.source if self.set is not None else None
        if src is None:
            return {}
        now = src.drops()
        return {k: max(0, v - self.base_drops.get(k, 0)) for k, v in now.items()}

    def skipped(self) -> dict[str, int]:
        if self.final_skips is not None:
            return dict(self.final_skips)
        src = self.set.source if self.set is not None else None
        if src is None:
            return {}
        return {k: max(0, v - self.base_skips.get(k, 0)) for k, v in src.skipped().items()}

    def program_runs(self) -> dict[str, tuple[int, int]]:
        """This job's part of the set's programs' (runs, ns): see the module docstring."""
        if self.set is not None and self.sink is not None:
            self.set.split_runs(fresh=False)
        return dict(self.runs)

    @property
    def wakeups(self) -> int:
        if self.final_wakeups is not None:
            return self.final_wakeups
        src = self.set.source if self.set is not None else None
        return src.wakeups - self.base_wakeups if src is not None else 0

    # ------------------------------------------------------------------------ what the session asks ---
    def add_target(self, pid: int, *, descendants: bool = True) -> None:
        if procfs.proc_info(pid) is None:
            raise UserError(f"no process with pid {pid}")
        if self.set is None:
            self.pids.append(pid)
            return
        self.set.add_target(self, pid)

    def is_traced(self, pid: int) -> bool:
        return pid in self.owned

    def live_targets(self) -> set[int]:
        return {p for p in list(self.owned) if procfs.proc_info(p) is not None}

    def any_live(self) -> bool:
        return any(procfs.running(p) for p in list(self.owned))

    def io_waiting(self) -> int:
        src = self.set.source if self.set is not None else None
        return src.io_waiting() if src is not None else 0


class SharedEbpf:
    """The program sets of a service's watched jobs, by SetKey. ``view(...)`` takes EbpfSource's arguments
    (the session's ``make_ebpf``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()  # the sets: joining, and unloading the last view's
        self._sets: dict[SetKey, _ProgramSet] = {}
        self.loaded = 0  # program sets loaded so far

    def view(self, pids: Sequence[int], *, threshold_ns: int = 100_000, on_proc: ProcCallback | None = None,
             owner_uid: int | None = None, off: Iterable[str] = (), poll_ms: int = 50) -> SharedView:
        from gputrace.families import EBPF_FAMILIES

        key = SetKey(owner_uid, frozenset(off) & frozenset(EBPF_FAMILIES), threshold_ns, poll_ms)
        return SharedView(self, pids, key, on_proc)

    def join(self, view: SharedView, sink: Sink) -> _ProgramSet:
        with self._lock:  # one load at a time; a second job waits for the first's programs, not loads its own
            pset = self._sets.get(view.key)
            if pset is None:
                pset = self._sets[view.key] = _ProgramSet(view.key)
            try:
                self.loaded += pset.join(view, sink)
            except BaseException:
                if pset.source is None:
                    del self._sets[view.key]
                raise
            return pset

    def release(self, pset: _ProgramSet) -> None:
        with self._lock:
            if pset.stop_if_empty() and self._sets.get(pset.key) is pset:
                del self._sets[pset.key]

    def sharing(self, pset: _ProgramSet) -> int:
        with pset.lock:
            return len(pset.views)

    def status(self) -> list[dict[str, Any]]:
        """Each loaded set: whose, its jobs and processes, events routed nowhere, and its busiest programs since
        it was loaded (``busiest``: runs a second, ns a run, share of the host's CPU; what it costs is the
        host's event rate: every system call and scheduler event on the host runs the set once)."""
        with self._lock:
            sets = list(self._sets.values())
        out = []
        cpus = os.cpu_count() or 1
        for s in sets:
            runs = s.split_runs(fresh=False)
            with s.lock:
                age = max(1e-9, time.monotonic() - s.loaded_at) if s.loaded_at else 0.0
                busiest = sorted(runs.items(), key=lambda kv: -kv[1][1])[:BUSIEST]
                out.append({"owner_uid": s.key.owner_uid, "jobs": len(s.views), "processes": len(s.routes),
                            "unrouted": s.unrouted,
                            "busiest": [{"program": prog, "runs_per_s": round(n / age, 1) if age else 0.0,
                                         "ns_per_run": round(ns / n, 1) if n else 0.0,
                                         "host_share": round(ns / 1e9 / (age * cpus), 6) if age else 0.0}
                                        for prog, (n, ns) in busiest if n]})  # fmt: skip
        return out
