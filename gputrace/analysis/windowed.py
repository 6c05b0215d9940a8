"""Stall attribution in bounded memory: one pass over the records, then the capture explained window by window.

Records arrive in any order (each source flushes its own batches). Long-lived ones (processes, threads, forks
and execs, devices, agents, cgroups, collectives, stack frames, drops) are kept whole, as a whole-capture
analysis keeps them. Time-local ones (syscalls, off-CPU spans, block requests, page faults, io_uring requests,
dirty pauses, GPU ops, API calls and syncs, CPU samples) go to a spool by time bucket (``bucket_ns``,
analysis/frames.py): a record belongs to the bucket it starts in and to each later one it overlaps, so
loading buckets [b0, b1] gives every record that overlaps them, each once, in the order one file per bucket
would. Read from a capture file (``analyze_capture``), a frame of plain rows is not copied: what the whole
capture learns from it (its threads, processes, span, futex words, samples) is taken column by column
(``_Loader.note_columns``), and the windows that reach it read it again from the file; only decoded kernel
events and rows checked one by one are written to the spool's private file. A window's per-thread indexes are
made as its explanation asks for them (``load.Lazy``).

The device timelines are then swept in time order, ``window_buckets`` buckets at a time, carrying each
device's busy interval across windows: a gap is found whole however long it is. The sweep reads a window's
GPU ops alone. The gaps that end in a window are explained a group at a time (``_clusters``: gaps whose bucket
ranges overlap or touch), each group on the records of the buckets from one before its first gap's start (its
launch and the calls it waited in began before it) to one after its last gap's end (calls it waited in end
after it), with the code a whole-capture analysis uses (analysis/attribute.py, analysis/explain.py). After a
window whose groups reached most of its buckets, the next window is loaded whole at once (ops and host
records), and its gaps explained on that where they start in it. What attribution reads across the whole
capture — which threads wait on each futex word and who wakes them (a lock's takers, the GIL's holder),
whether a thread runs the interpreter, the collectives and their waits — is gathered per thread, word or
collective instance, never per record.

Memory: the long-lived records, those per-object facts, and the records of one window with its margins (or
of one gap, where a gap is longer than a window); the report's own stalls. Flat in the capture's length.

With ``jobs`` above one (``gputrace report --jobs``), the device timelines are swept first, the ops alone, and
the windows with stalls then explained in that many processes forked from this one, at a lower CPU priority,
each given shares of consecutive windows in turn (``SHARES_PER_JOB`` a process, cut to about equal stall
counts) and sending back their stalls' documents on a pipe, which are taken in time order: the same report
(``_Jobs``). A window is explained as it would be here, on the records it loads itself (the spool's file and
the capture are read with pread: the processes share their offsets). Each holds one window's records at a time.

A capture whose time-local records number at most ``small_records`` is analysed whole instead (report.py's
``assemble``), as it always was: the same document either way, down to the ties.
"""

from __future__ import annotations

import contextlib
import gc
import os
import pickle
import selectors
import signal
from bisect import bisect_left
from collections import Counter
from collections.abc import Iterable, Iterator, Sequence
from copy import copy
from dataclasses import dataclass
from itertools import compress
from operator import itemgetter
from typing import Any

from gputrace.analysis.attribute import Attributor
from gputrace.analysis.devices import DeviceKey
from gputrace.analysis.explain import ETIMEDOUT, FUTEXES, CaptureFacts, _timed_out, interpreted
from gputrace.analysis.frames import EXTENT, FIELDS, Spool
from gputrace.analysis.load import (
    COLUMN_KINDS,
    Capture,
    GpuOp,
    Source,
    _Loader,
    finish_load,
    link_device_calls,
    shaped,
)
from gputrace.analysis.report import assemble, call_rows, collective_rows, host_of, report_of, stall_doc
from gputrace.analysis.timeline import (
    _COLLECTIVE_WORDS,
    HostWait,
    Stall,
    Sweep,
    Waits,
    collective_waits,
    host_waits,
    loss_windows,
    untimed_losses,
)
from gputrace.capture import Batch, CaptureReader, RowsAt, exact_columns, records_of
from gputrace.documents import Report
from gputrace.documents import Stall as StallDoc
from gputrace.errors import JobEnded
from gputrace.forked import ended_how, quiet_child, send
from gputrace.records import GpuKernel

BUCKET_NS = 1_000_000_000  # a spool bucket's span, and the margin a window is loaded with on each side
WINDOW_BUCKETS = 8  # buckets a window's stalls end in
SMALL_RECORDS = 200_000  # time-local records up to which a capture is analysed whole
LAUNCH_LOOKBACK_NS = 30_000_000_000  # how long before its op a launch is looked for, past a window's margin
SWITCHED_ONE_BY_ONE = 24  # threads of a frame of off-CPU records up to which each is picked out in a C loop
COLLECT_WINDOWS = 64  # windows explained between two collections of cyclic garbage while the collector is paused
WINDOW_WEIGHT = 20  # what loading a window costs, in stalls explained, where windows are shared among processes
SHARES_PER_JOB = 4  # shares of the windows per process explaining them: one slowed by other work holds back less
_FUTEX_NAMES = frozenset(FUTEXES)
# What a capture that may still be analysed whole holds: records, or where a frame of rows of one kind is in the
# file (read again if need be), with its rows' start and end times where it is time-local
Held = tuple[list[Any], str | None, int, int, Sequence[int], Sequence[int]]

# What a window's Capture shares with the whole capture's: long-lived records and what they say
_SHARED = ("collectives", "calls", "in_progress", "cpu_cgroups", "cpu_throttles", "stacks", "comms", "nspids", "tgid",
           "created", "pids", "gil_pids", "agent_threads", "agent_from", "kernel_pids", "kernel_seen", "off", "nvml",
           "drops", "block_names", "complete", "problem", "trailer", "first_ns", "last_ns", "tracing_ns", "offcpu_span")


class WindowedAnalysis:
    """Feed it a capture's records in the order they come (``add``, or a frame at a time: ``add_batch``);
    ``report`` then gives the capture's gputrace.report/1 document. Usable over any record iterator
    (``analyze_records``); over a capture's frames (``analyze_capture``), the frames of plain rows are not copied
    but read again by the windows that reach them (``rows_at``: ``CaptureReader.rows_at``)."""

    def __init__(self, header: dict[str, Any], *, min_gap_ns: int = 1_000_000, bucket_ns: int = BUCKET_NS,
                 window_buckets: int = WINDOW_BUCKETS, small_records: int = SMALL_RECORDS,
                 rows_at: RowsAt | None = None, jobs: int = 1) -> None:
        if min_gap_ns <= 0:
            raise ValueError("min_gap_ns must be > 0")
        if bucket_ns <= 0 or window_buckets <= 0:
            raise ValueError("bucket_ns and window_buckets must be > 0")
        self.header = header
        self.min_gap_ns = min_gap_ns
        self.bucket_ns, self.window_buckets, self.small_records = bucket_ns, window_buckets, small_records
        self.rows_at = rows_at
        self.jobs = jobs  # processes explaining windows at once (``_explained``)
        self.ld = _Loader(header)
        self.held: list[Held] | None = []  # every record while the capture may still be analysed whole
        self.nheld = 0  # the time-local ones among them
        self.spool: Spool | None = None
        self.futex_words: dict[tuple[int, int], tuple[set[int], set[int]]] = {}
        self.sampled: dict[int, Counter[int]] = {}  # tid -> its samples' stack ids
        self.named_collectives = False  # a kernel named like a collective was seen
        self.cap = Capture(header=header)  # the whole capture's long-lived part, once every record was added
        self.nvml_meta: Any = None
        self.colops: dict[tuple[int, int, int, int], GpuOp] = {}  # collective kernels by identity and times
        self.windows = 0  # windows explained (for the bench)
        self.unsought: set[int] = set()  # id() of ops ending a stall, their launch not found in LAUNCH_LOOKBACK_NS
        self.peak_window_records = 0
        self.forked = 0  # processes forked to explain windows (``_explained``)
        self.offcpu_span: dict[int, tuple[int, int]] = {}  # see _switched
        self._explaining: _Explaining | None = None  # what every window's explanation reads, while they are

    def add(self, r: Any) -> None:
        """One record."""
        if self.held is not None:
            self.held.append(([r], None, 0, 0, (), ()))
        self._add(r)
        self._spool_past_small()

    def add_batch(self, batch: Batch) -> None:
        """The records of one frame (``CaptureReader.batches``). A frame of plain rows of a time-local kind is
        taken column by column (``_Loader.note_columns``) and noted where it is, no record made of it."""
        kind, columns = batch.kind, batch.columns
        if columns is None or kind not in COLUMN_KINDS:
            recs = batch.records if columns is None else records_of(kind, batch.records)
            if self.held is not None:
                self.held.append((recs, None, 0, 0, (), ()))
            for r in recs:
                self._add(r)
        else:
            if self.rows_at is None:
                raise ValueError("a frame of rows is read again where it is needed: WindowedAnalysis needs rows_at")
            self.ld.note_columns(kind, columns)
            local = kind in EXTENT
            start, end = FIELDS[kind] if local else (0, 0)
            if local:
                self._note_columns(kind, columns)
            if self.held is not None:
                times = (columns[start], columns[end]) if local else ((), ())
                self.held.append(([], kind, batch.offset, batch.length, *times))
                self.nheld += len(batch.records) if local else 0
            elif local:
                assert self.spool is not None
                self.spool.add_frame(kind, batch.records, batch.offset, batch.length, columns[start], columns[end])
        self._spool_past_small()

    def _add(self, r: Any) -> None:
        kind = type(r).__name__
        if kind not in EXTENT:
            self.ld.add(r)
            return
        if not self.ld.tell(r):  # (the windows index it: the whole capture's loader learns what it tells)
            return
        if kind == "Syscall" and r.name in FUTEXES:
            waited, timed_out = self.futex_words.setdefault((r.pid, r.arg), (set(), set()))
            waited.add(r.tid)
            if _timed_out(r):
                timed_out.add(r.tid)
        elif kind == "StackSample":
            self.sampled.setdefault(r.tid, Counter())[r.stack] += 1
        elif kind == "OffCpu":
            self._span(r.tid, r.start_ns, r.start_ns)
        elif kind == "GpuKernel" and not self.named_collectives:
            low = r.name.lower()
            self.named_collectives = any(w in low for w in _COLLECTIVE_WORDS)
        if self.held is not None:
            self.nheld += 1
            return
        assert self.spool is not None
        self.spool.add(kind, r)

    def _note_columns(self, kind: str, columns: list[tuple[Any, ...]]) -> None:
        """What ``_add`` gathers over the whole capture (futex words, sampled stacks, a collective's name), of
        a frame's rows column by column."""
        if kind == "Syscall":
            pick = list(compress(range(len(columns[2])), map(_FUTEX_NAMES.__contains__, columns[2])))
            if not pick:
                return
            take = itemgetter(*pick) if len(pick) > 1 else lambda col: (col[pick[0]],)
            pids, tids, rets, args = (take(columns[i]) for i in (0, 1, 5, 9))
            waits = zip(pids, args, tids, map((-ETIMEDOUT).__eq__, rets), strict=True)
            futex_words = self.futex_words
            for pid, arg, tid, timed_out in dict.fromkeys(waits):  # distinct waits, in the order they came
                words = futex_words.get((pid, arg))
                if words is None:
                    words = futex_words[(pid, arg)] = (set(), set())
                words[0].add(tid)
                if timed_out:
                    words[1].add(tid)
        elif kind == "StackSample":
            for (tid, stack), n in Counter(zip(columns[2], columns[3], strict=True)).items():
                self.sampled.setdefault(tid, Counter())[stack] += n
        elif kind == "OffCpu":
            self._switched(columns[1], columns[2])
        elif kind == "GpuKernel" and not self.named_collectives:
            low = "\0".join(columns[7]).lower()  # no word spans two names
            self.named_collectives = any(w in low for w in _COLLECTIVE_WORDS)

    def _switched(self, tids: Sequence[int], starts: Sequence[int]) -> None:
        """The first and last start of each thread's off-CPU records (``Capture.offcpu_span``): a window asked
        about a thread that ran through it learns from them that it was switched out before and after. A frame's
        few threads are taken one at a time (a C loop each over its rows)."""
        distinct = set(tids)
        if len(distinct) > SWITCHED_ONE_BY_ONE:
            for tid, start in zip(tids, starts, strict=True):
                self._span(tid, start, start)
            return
        for tid in distinct:
            mine = list(compress(starts, map(tid.__eq__, tids)))
            self._span(tid, min(mine), max(mine))

    def _span(self, tid: int, lo: int, hi: int) -> None:
        """``offcpu_span[tid]`` widened to [lo, hi]."""
        known = self.offcpu_span.get(tid)
        if known is None:
            self.offcpu_span[tid] = (lo, hi)
        elif lo < known[0] or hi > known[1]:
            self.offcpu_span[tid] = (min(lo, known[0]), max(hi, known[1]))

    def _spool_past_small(self) -> None:
        """Past ``small_records`` time-local records the capture is analysed window by window: those held go to
        the spool, and from then on every one as it comes."""
        if self.held is None or self.nheld <= self.small_records:
            return
        spool = self.spool = Spool(self.bucket_ns, self.rows_at)
        for recs, kind, offset, length, starts, ends in self.held:
            if kind in EXTENT:
                spool.add_frame(kind, None, offset, length, starts, ends)
                continue
            for r in recs if kind is None else ():
                k = type(r).__name__
                if k in EXTENT and shaped(k, r):
                    spool.add(k, r)
        self.held = None
        self._drop_local()

    def _drop_local(self) -> None:
        """The whole-capture loader keeps only what is long-lived: its time-local indexes are emptied."""
        ld = self.ld
        ld.raw = {k: {} for k in ld.raw}
        ld.by_dev, ld.faults, ld.samples, ld.uring = {}, {}, {}, {}
        ld.cap.ops, ld.cap.launches = {}, {}

    def report(self, source: Source) -> Report:
        """The report, once every record was added; ``source`` says the rest (header, metadata, trailer)."""
        if self.held is not None:
            return assemble(finish_load(self.whole(), source), self.min_gap_ns)
        assert self.spool is not None
        try:
            return self._windowed(source, self.spool)
        finally:
            self.spool.close()

    # ------------------------------------------------------------------------------------------------

    def whole(self) -> _Loader:
        """The capture analysed whole: every record held indexed, in the order it came (``_Loader.add``, or for
        a frame of plain rows ``note_columns`` and ``add_local``, which make the same)."""
        assert self.held is not None
        ld = _Loader(self.header)
        held, self.held = self.held[::-1], []
        while held:  # each let go once indexed
            recs, kind, offset, length, _, _ = held.pop()
            if kind is None:
                for r in recs:
                    ld.add(r)
                continue
            assert self.rows_at is not None
            rows = self.rows_at(offset, length)  # read again, as the reader gave them
            columns = exact_columns(kind, rows)
            assert columns is not None  # (the reader took them so)
            ld.note_columns(kind, columns)
            if kind in EXTENT:
                ld.add_local(kind, records_of(kind, rows))
        return ld

    def _windowed(self, source: Source, spool: Spool) -> Report:
        spool.flush()
        self._drop_local()
        self.nvml_meta = source.meta.get("nvml")
        cap = self.cap = finish_load(self.ld, source, link=False)
        cap.offcpu_span = self.offcpu_span
        waits, colcap = self._collectives(cap, spool)
        self.colops = {(op.pid, op.correlation_id, op.start_ns, op.end_ns): op
                       for ops in colcap.ops.values() for op in ops} if colcap is not None else {}
        colop_ids = {id(op) for op in self.colops.values()}
        host = host_of(cap)
        calls_waited = host_waits(cap, self.min_gap_ns)
        facts = CaptureFacts(self.futex_words, {tid: _interpreted(cap, tid, n) for tid, n in self.sampled.items()})
        if cap.gil_pids and any(t for _, t in self.futex_words.values()):  # a lock's holder may be asked for
            facts.lock_wakers = self._lock_wakers(spool)
        losses, lost_anywhere = loss_windows(cap), untimed_losses(cap) or bool(cap.problem)
        sweeps: dict[DeviceKey, Sweep] = {}
        self._explaining = _Explaining(host, facts, calls_waited, losses, lost_anywhere)
        stalls: list[StallDoc] = []
        arrivals: dict[int, StallDoc] = {}
        for found, docs in self._explained(spool, sweeps, waits):
            for st, doc in zip(found, docs, strict=True):
                stalls.append(doc)
                if st.collective is None and st.op is not None and id(st.op) in colop_ids:
                    arrivals[id(st.op)] = doc
        self._explaining = None
        ordered = sorted(spool.buckets)
        wb = self.window_buckets
        if cap.in_progress and ordered:  # what the threads caught waiting at stop waited for: the last records'
            cap.uring = self._load(spool, ordered[-1] - wb, ordered[-1]).uring
        wait_ns: dict[DeviceKey, int] = {}
        for w in waits.values():
            k = cap.device_map.key(w.op.pid, w.op.device)
            wait_ns[k] = wait_ns.get(k, 0) + w.wait_end - w.wait_start
        timelines = [sweeps[k].timeline(wait_ns.get(k, 0)) for k in sorted(sweeps) if sweeps[k].cur_start is not None]
        counted = {tl.key: (sweeps[tl.key].stalls, sweeps[tl.key].stall_ns) for tl in timelines}
        report = report_of(cap, timelines, stalls, self.min_gap_ns, counted)
        rows = collective_rows(colcap, waits, arrivals, host, {}, self.min_gap_ns) if colcap is not None else []
        rows += call_rows(cap, calls_waited, host, {}, self.min_gap_ns, {(r["comm"], r["seq"]) for r in rows}, None)
        rows.sort(key=lambda r: (r["started_ns"], r["rank"]))
        if rows:
            report["collectives"] = rows
        return report

    def _explained(self, spool: Spool, sweeps: dict[DeviceKey, Sweep], waits: Waits
                   ) -> Iterator[tuple[list[Stall], list[StallDoc]]]:
        """The stalls of each window that has any, with their documents, in time order. With ``jobs`` above one
        and more than one such window, the device timelines are swept first (the ops alone), then the windows
        explained in ``jobs`` processes forked from this one (``_Jobs``), shares of consecutive windows each,
        their documents sent back and taken in order; else each window is explained as it is swept."""
        if self.jobs <= 1:
            for window in self._swept(spool, sweeps, waits, host=True):
                yield window.found, self._explain(spool, window)
            return
        windows = list(self._swept(spool, sweeps, waits, host=False))  # (ops alone: no window keeps its records)
        if len(windows) < 2:
            for window in windows:
                yield window.found, self._explain(spool, window)
            return
        shares = _shares([len(w.found) + WINDOW_WEIGHT for w in windows], SHARES_PER_JOB * self.jobs)
        self.forked = min(self.jobs, len(shares))
        with _Jobs(self, spool, windows, shares, self.forked) as jobs:
            for share, (docs, explained, peak) in zip(shares, jobs.results(), strict=True):
                self.windows += explained
                self.peak_window_records = max(self.peak_window_records, peak)
                for n, window_docs in zip(share, docs, strict=True):
                    yield windows[n].found, window_docs

    def _swept(self, spool: Spool, sweeps: dict[DeviceKey, Sweep], waits: Waits, *, host: bool
               ) -> Iterator[_Window]:
        """The windows whose stalls end in them, in time order: the device timelines swept a window at a time
        (``sweeps``: each device's, carried across windows). Where the last window's stalls needed most of its
        records, this one's likely do too: it is loaded whole at once (its ops and, if ``host``, its host
        records), and its records given for its stalls' explanation (``_explain``)."""
        bn, wb = self.bucket_ns, self.window_buckets
        ordered = sorted(spool.buckets)
        i, full = 0, False
        while i < len(ordered):
            b = ordered[i]
            a, z = b * bn, (b + wb) * bn
            gpu = self._load(spool, b - 1, b + wb, host=full and host, api=full and host)
            found: list[Stall] = []
            for key, ops in sorted(gpu.ops.items()):
                sw = sweeps.setdefault(key, Sweep(key))
                found += sw.window(ops, a, z, waits, self.min_gap_ns)
            i = bisect_left(ordered, b + wb, i)
            if not found:
                del gpu
                full = False
                continue
            groups = _clusters(found, bn)
            window = _Window(b, found, groups, full, gpu if full and host else None)
            del gpu
            yield window
            del window
            full = sum(hi - lo + 1 for lo, hi, _ in groups) >= wb

    def _explain(self, spool: Spool, window: _Window) -> list[StallDoc]:
        """The documents of a window's stalls, in the order they were found: a group of them at a time, each on
        the records of its buckets; all on the window's records where they were loaded whole (``full``) and hold
        every group's buckets."""
        ex = self._explaining
        assert ex is not None
        b, found, groups = window.b, window.found, window.groups
        wb = self.window_buckets
        self.windows += 1
        docs: dict[int, StallDoc] = {}
        if window.full and groups[0][0] >= b - 1:  # the window's records, loaded whole, are enough for every stall
            groups = [(b - 1, b + wb, list(range(len(found))))]
        for lo, hi, group in groups:
            win = window.records if window.full and (lo, hi) == (b - 1, b + wb) else None
            if win is None:
                win = self._load(spool, lo, hi)
            else:
                window.records = None  # (freed once explained)
            self._find_launches(spool, win, [found[n] for n in group], lo)
            att = Attributor(win, ex.host, ex.facts)
            att.host_waits(ex.calls_waited)
            for n in group:
                st = found[n]
                s = docs[n] = stall_doc(att, st, ex.host, ex.losses, ex.lost_anywhere)
                if id(st.op) in self.unsought and s.get("why", "").startswith("no launch record"):
                    s["why"] += f" in the {LAUNCH_LOOKBACK_NS // 10**9} s before it"
            att.explainer.on_collective = None  # (a cycle through the Attributor: the records are freed now)
            del win, att
            self.unsought.clear()
        if self.windows % COLLECT_WINDOWS == 0 and not gc.isenabled():
            gc.collect()  # what cycles explaining makes, while the collector is paused (paused_gc)
        return [docs[n] for n in range(len(found))]

    def _load(self, spool: Spool, b0: int, b1: int, *, host: bool = True, api: bool = True) -> Capture:
        """The Capture of buckets [b0, b1]: their records (device ones only unless ``host``; without the CUDA
        API calls unless ``api``), and the whole capture's long-lived ones."""
        ld = _Loader(self.header, lazy=True)
        whole = self.cap
        for name in _SHARED:
            setattr(ld.cap, name, getattr(whole, name))
        ld.gpu_devices = self.ld.gpu_devices
        n = 0
        for kind, recs in spool.runs(b0, b1, host=host, api=api):
            ld.add_local(kind, recs)
            n += len(recs)
        self.peak_window_records = max(self.peak_window_records, n)
        cap = ld.finish(self.nvml_meta)
        if self.colops:  # the collective kernels are the whole capture's objects: their waits are keyed by them
            get = self.colops.get
            for key, ops in cap.ops.items():
                cap.ops[key] = [get((op.pid, op.correlation_id, op.start_ns, op.end_ns), op)
                                if type(op) is GpuKernel else op for op in ops]
        return cap

    def _find_launches(self, spool: Spool, win: Capture, found: list[Stall], lo: int) -> None:
        """The launches of the ops that ended ``found`` that came before the window's records (from bucket
        ``lo`` on): a deep queue launches long before its op starts. Looked for up to ``LAUNCH_LOOKBACK_NS``
        before each op; one launched earlier than that is said in the stall's ``why``."""
        missing = {(st.op.pid, st.op.correlation_id): st for st in found
                   if st.op is not None and (st.op.pid, st.op.correlation_id) not in win.launches}
        if not missing or not self.cap.counts.get("CudaApi"):
            return
        back = min(st.start_ns for st in missing.values()) - LAUNCH_LOOKBACK_NS
        before = lo * self.bucket_ns
        for r in spool.read(max(back // self.bucket_ns, min(spool.buckets)), lo - 1, host=False):
            if type(r).__name__ == "CudaApi" and (r.pid, r.correlation_id) in missing and r.start_ns < before:
                win.launches[(r.pid, r.correlation_id)] = r
        if back // self.bucket_ns > min(spool.buckets):  # the search stopped short of the capture's start
            self.unsought |= {id(st.op) for k, st in missing.items() if k not in win.launches}

    def _collectives(self, cap: Capture, spool: Spool) -> tuple[Waits, Capture | None]:
        """The collective kernels and their launches (two passes over the GPU records, only where the capture
        has collectives), the device side of host-called ones, and the ranks' waits: the capture's
        collectives as a Capture of their own (its ops those kernels alone)."""
        if not (cap.collectives or cap.calls or self.named_collectives):
            return {}, None
        keys = set(cap.collectives)
        kernels: dict[DeviceKey, list[GpuOp]] = {}
        found: set[tuple[int, int]] = set()
        ordered = sorted(spool.buckets)
        for b in ordered:
            for r in spool.read(b, b, host=False):
                if type(r) is GpuKernel and r.start_ns // spool.bucket_ns == b \
                        and r.end_ns >= r.start_ns and type(r.name) is str \
                        and ((r.pid, r.correlation_id) in keys or any(w in r.name.lower() for w in _COLLECTIVE_WORDS)):
                    kernels.setdefault(cap.device_map.key(r.pid, r.device), []).append(r)
                    found.add((r.pid, r.correlation_id))
        launches = {}
        for b in ordered:
            for r in spool.read(b, b, host=False):
                if type(r).__name__ == "CudaApi" and (r.pid, r.correlation_id) in found:
                    launches[(r.pid, r.correlation_id)] = r
        for ops in kernels.values():
            ops.sort(key=lambda o: (o.start_ns, o.end_ns))
        colcap = copy(cap)
        colcap.ops, colcap.launches = kernels, launches
        link_device_calls(colcap)  # adds to the shared collectives: every window sees them
        return collective_waits(colcap, self.min_gap_ns), colcap

    def _lock_wakers(self, spool: Spool) -> dict[tuple[int, int], set[int]]:
        """(pid, futex word) -> the threads that woke a waiter there, over the whole capture, a window at a
        time (``Explainer._wakers_of``)."""
        out: dict[tuple[int, int], set[int]] = {}
        ordered = sorted(spool.buckets)
        bn, wb = self.bucket_ns, self.window_buckets
        i = 0
        while i < len(ordered):
            b = ordered[i]
            win = self._load(spool, b, b + wb)
            for index in win.syscalls.values():
                for r in index.records:
                    if r.name in FUTEXES and r.tid in win.offcpu and b * bn <= r.start_ns < (b + wb) * bn:
                        woken = out.setdefault((r.pid, r.arg), set())
                        woken.update(o.waker_tid for o in win.offcpu[r.tid].overlapping(r.start_ns, r.end_ns)
                                     if o.wake_ns and o.waker_pid == r.pid and o.waker_tid != r.tid)
            i = bisect_left(ordered, b + wb, i)
        return out


@dataclass
class _Explaining:
    """What explaining any window's stalls reads, beside the window's records."""

    host: str
    facts: CaptureFacts
    calls_waited: dict[int, list[HostWait]]
    losses: list[tuple[int, int]]
    lost_anywhere: bool


@dataclass
class _Window:
    """A window whose stalls end in it: its first bucket, the stalls in the order the sweep found them, their
    groups (``_clusters``), whether it is to be loaded whole (``full``), and its records where they were."""

    b: int
    found: list[Stall]
    groups: list[tuple[int, int, list[int]]]
    full: bool
    records: Capture | None


class _Jobs:
    """Processes forked to explain windows (``WindowedAnalysis._explained``): the ``k``-th of ``n`` explains
    shares k, k + n, k + 2n... in turn (each a list of windows by index), at a lower CPU priority, and sends
    back, on a pipe of its own, each share's stall documents with how many windows it explained and the most
    records it held. ``results()`` gives them in the order of the shares, reading every pipe as data comes (a
    process is never held up by a full pipe). One that ends without its results, or fails, fails the analysis;
    leaving (done, failed or interrupted), every process still running is ended and waited for."""

    def __init__(self, an: WindowedAnalysis, spool: Spool, windows: list[_Window], shares: list[list[int]],
                 n: int) -> None:
        self.an, self.spool, self.windows, self.shares, self.n = an, spool, windows, shares, n
        self.pids: list[int] = []
        self.pipes: list[int] = []  # read ends, by process
        self.parent = os.getpid()

    def __enter__(self) -> _Jobs:
        try:
            for k in range(self.n):
                r, w = os.pipe()
                pid = os.fork()
                if pid == 0:  # (the child: never returns)
                    os.close(r)
                    self._child(k, w)
                os.close(w)
                self.pids.append(pid)
                self.pipes.append(r)
        except BaseException as e:
            self.__exit__(type(e))
            raise
        return self

    def _child(self, k: int, w: int) -> None:
        code = 1
        try:
            for fd in self.pipes:  # (the read ends of the processes forked before)
                os.close(fd)
            quiet_child(self.parent)
            an, spool, windows = self.an, self.spool, self.windows
            for share in self.shares[k::self.n]:
                an.windows = an.peak_window_records = 0
                docs = [an._explain(spool, windows[i]) for i in share]
                send(w, (docs, an.windows, an.peak_window_records))
            code = 0
        except BaseException as e:
            with contextlib.suppress(BaseException):
                try:
                    send(w, e)
                except Exception:  # not picklable: said as text
                    send(w, RuntimeError(f"explaining windows: {type(e).__name__}: {e}"))
        finally:
            os._exit(code)

    def results(self) -> Iterator[tuple[list[list[StallDoc]], int, int]]:
        """Each share's results, in order."""
        got: dict[int, Any] = {}  # share index -> its results, once read
        buffers = {k: bytearray() for k in range(self.n)}
        sent = dict.fromkeys(range(self.n), 0)  # results read from each process
        with selectors.DefaultSelector() as sel:
            for k, fd in enumerate(self.pipes):
                sel.register(fd, selectors.EVENT_READ, k)
            for i in range(len(self.shares)):
                while i not in got:
                    if not sel.get_map():  # (every process ended, each with all it was to send: not reached)
                        raise JobEnded("the processes explaining windows ended without all their results")
                    for key, _ in sel.select():
                        k = key.data
                        chunk = os.read(key.fd, PIPE_READ)
                        buf = buffers[k]
                        buf += chunk
                        while len(buf) >= 8 and len(buf) >= 8 + int.from_bytes(buf[:8], "little"):
                            size = int.from_bytes(buf[:8], "little")
                            message = pickle.loads(buf[8 : 8 + size])
                            del buf[: 8 + size]
                            if isinstance(message, BaseException):
                                raise message
                            got[k + sent[k] * self.n] = message
                            sent[k] += 1
                        if not chunk:  # ended: all it sent was read
                            sel.unregister(key.fd)
                            if len(self.shares[k::self.n]) > sent[k]:
                                raise JobEnded(f"a process explaining windows (pid {self.pids[k]}) ended without "
                                               f"its results: {self._ended(k)}; --jobs 1 explains them in this "
                                               "process alone")
                yield got.pop(i)

    def _ended(self, k: int) -> str:
        """How the ``k``-th process ended, once it did (it is waited for here)."""
        pid, self.pids[k] = self.pids[k], 0
        try:
            _, status = os.waitpid(pid, 0)
        except ChildProcessError:
            return "its exit status is unknown"
        return ended_how(status)

    def __exit__(self, failed: type[BaseException] | None = None, *_: object) -> None:
        """Every process waited for; where the analysis failed or was interrupted, ended first."""
        for fd in self.pipes:
            os.close(fd)
        self.pipes = []
        for pid in filter(None, self.pids):  # (not yet waited for: its pid is still its own)
            if failed is not None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        self.pids = []


PIPE_READ = 1 << 20  # bytes read from a job's pipe at a time
def _shares(weights: list[int], n: int) -> list[list[int]]:
    """Indexes 0..len(weights)-1 cut into at most ``n`` runs of consecutive ones of about equal total weight."""
    total, acc = sum(weights), 0
    out: list[list[int]] = []
    run: list[int] = []
    for i, w in enumerate(weights):
        run.append(i)
        acc += w
        if acc * n >= total * (len(out) + 1) and len(out) < n - 1:
            out.append(run)
            run = []
    if run:
        out.append(run)
    return out


def _clusters(found: list[Stall], bucket_ns: int) -> list[tuple[int, int, list[int]]]:
    """The stalls of a window (by index in ``found``) in groups explained on the records of one bucket range
    each: a stall needs the buckets from one before it starts to one after it ends; stalls whose ranges overlap
    or touch share one. (first bucket, last bucket, the group's stalls in the order they were found) of each,
    by first bucket."""
    spans = sorted((st.start_ns // bucket_ns - 1, st.end_ns // bucket_ns + 1, k) for k, st in enumerate(found))
    out: list[tuple[int, int, list[int]]] = []
    first, last = spans[0][0], spans[0][1]
    group: list[int] = []
    for lo, hi, k in spans:
        if lo > last + 1:
            out.append((first, last, sorted(group)))
            first, last, group = lo, hi, []
        last = max(last, hi)
        group.append(k)
    out.append((first, last, sorted(group)))
    return out


def _interpreted(cap: Capture, tid: int, samples: Counter[int]) -> bool | None:
    pid = cap.pid_of(tid)
    return interpreted(samples, lambda stack: cap.stacks.get((pid, stack), []))


def analyze_records(source: Source, records: Iterable[Any], *, min_gap_ns: int = 1_000_000,
                    bucket_ns: int = BUCKET_NS, window_buckets: int = WINDOW_BUCKETS,
                    small_records: int = SMALL_RECORDS) -> Report:
    """The report of ``records`` (any iterator: a capture's, a flight-recorder segment's), in bounded memory;
    ``source`` gives the header, metadata and trailer, read once the records are (a CaptureReader is both)."""
    an = WindowedAnalysis(dict(source.header), min_gap_ns=min_gap_ns, bucket_ns=bucket_ns,
                          window_buckets=window_buckets, small_records=small_records)
    add = an.add
    with paused_gc():
        for r in records:
            add(r)
        return an.report(source)


def analyze_capture(reader: CaptureReader, *, min_gap_ns: int = 1_000_000, bucket_ns: int = BUCKET_NS,
                    window_buckets: int = WINDOW_BUCKETS, small_records: int = SMALL_RECORDS, jobs: int = 1) -> Report:
    """``analyze_records`` of a capture file, a frame at a time: the frames of plain rows of time-local records
    are taken column by column and read again only by the windows that reach them (``WindowedAnalysis``). The
    same report as ``analyze_records(reader, reader.records())``; with ``jobs`` above one, a capture analysed
    window by window has its windows explained in that many processes (``WindowedAnalysis._explained``), the
    same report still."""
    with paused_gc():
        an = read_capture(reader, min_gap_ns=min_gap_ns, bucket_ns=bucket_ns, window_buckets=window_buckets,
                          small_records=small_records, jobs=jobs)
        return an.report(reader)


def read_capture(reader: CaptureReader, **kwargs: Any) -> WindowedAnalysis:
    """The analysis of ``reader``'s capture, every frame added (``analyze_capture`` without the report; keyword
    arguments: ``WindowedAnalysis``'s)."""
    an = WindowedAnalysis(dict(reader.header), rows_at=reader.rows_at, **kwargs)
    add = an.add_batch
    for batch in reader.batches(exact=COLUMN_KINDS):
        add(batch)
    return an


@contextlib.contextmanager
def paused_gc() -> Iterator[None]:
    """The cyclic garbage collector paused, and resumed after: an analysis makes millions of records, and each
    automatic collection walks every container still alive (a window's records, the frames read), a third of the
    analysis's time. Records hold no cycles: reference counting frees each window once it is explained; the few
    cycles explaining makes are collected every COLLECT_WINDOWS windows."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()
