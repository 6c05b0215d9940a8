"""The eBPF source: bcc tracepoint programs (probes/bpf/gputrace.bpf.c) following a process tree.

The hot path stores raw kernel events: the ring-buffer callback only copies bytes, a batch becomes one
blob for ``sink.emit_kernel``, and probes/ebpf/events.py decodes it when the capture is read. Process events
come through a small ring of their own and are decoded live (the session needs forks and exits as they
happen, and new processes' /proc metadata must be read while they exist).
"""

from __future__ import annotations

import ctypes
import os
import threading
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

from gputrace import clock
from gputrace.errors import UserError
from gputrace.families import EBPF_FAMILIES
from gputrace.probes import procfs
from gputrace.probes.ebpf import build, events, final, hooks, uring
from gputrace.probes.ebpf.filemaps import Key, MappedFiles, ReceivedFds
from gputrace.probes.ebpf.hooks import wanted_tracepoints
from gputrace.probes.ebpf.host import (
    BPF_DIR,
    check_host,
    dirty_throttle_layout,
    file_faults_supported,
    final_status,
    program_runs,
    program_skips,
    program_text,
    tracepoint_exists,
    unload,
    unload_in_background,
    uring_supported,
)
from gputrace.probes.ebpf.owner import LEFT_OUT_WHY, OwnerFilter
from gputrace.probes.ebpf.syscalls import BY_NAME, SPECS, syscall_numbers
from gputrace.records import (
    Drops,
    ProcExit,
    ProcFork,
    ProcLeftOut,
    SourceStatus,
)
from gputrace.source import Sink
from gputrace.threads import Thread

__all__ = ["EbpfSource", "wanted_tracepoints", "check_host", "program_text", "BPF_DIR"]

_BATCH_EVENTS = 4096
_POLL_MS = 50
_TARGET_MASK = (1 << 16) - 1  # TARGET_BITS in gputrace.bpf.c
_SLOT_SHARED = 0xFFFFFFFF
_NR_MAX = 512  # GT_NR_MAX in gputrace.h
_F_TRACED = 0x100  # GT_F_TRACED in gputrace.h: kernel-side only, never in the capture's sysflags
_FAULT_SIZE = events.FAULT.size
_FDRECV_SIZE = events.FDRECV.size
_FDRECV_ANNOUNCED = (events.FDRECV.size, events.FDRECV_NAMED.size)  # the process-event ring's copy, either kind

ProcCallback = Callable[[Any], None]


# ------------------------------------------------------------------------------------ source ---


def _quiet(bpf: Any) -> None:
    """Empty the target set: the fast slots of its tgids, then the set, twice (a fork in between adds one).
    Not every slot: zeroing the whole array one element at a time took half a second at every stop. A slot
    left "shared" is harmless: it sends the programs to the emptied set."""
    targets, tslot = bpf[b"targets"], bpf[b"tslot"]
    for _ in range(2):
        for key in list(targets.keys()):
            tslot[tslot.Key(key.value & _TARGET_MASK)] = tslot.Leaf(0)
        targets.clear()


class EbpfSource:
    """Follows ``pids`` and their descendants; see the module docstring."""

    name = "ebpf"

    def __init__(
        self,
        pids: Sequence[int],
        *,
        threshold_ns: int = 100_000,
        on_proc: ProcCallback | None = None,
        syscalls: Sequence[str] | None = None,
        ring_mib: int = 16,
        syscall_hook: str = "auto",
        sched_hook: str = "auto",
        owner_uid: int | None = None,
        off: Iterable[str] = (),
        poll_ms: int = _POLL_MS,
    ) -> None:
        """``owner_uid``: the capture is for this non-root user, so a process that gains privileges it lacks
        is left out (bpf/gputrace.h gt_task_foreign); None (root) leaves nothing out and compiles no check.
        ``off``: source families turned off (gputrace.families); their programs are neither built nor attached
        (the process-tree programs always are). ``poll_ms``: how often the event ring is drained (sooner after
        a drain that found it an eighth full)."""
        if threshold_ns < 0:
            raise UserError("the eBPF threshold must be ≥ 0 ns")
        if ring_mib < 1 or ring_mib & (ring_mib - 1):
            raise UserError("the ring buffer size must be a power of two MiB")
        hooks.check_hook("syscall", syscall_hook)
        hooks.check_hook("sched", sched_hook)
        self.pids = list(pids)
        self.off = frozenset(off) & frozenset(EBPF_FAMILIES)
        self.threshold_ns = threshold_ns
        self.on_proc = on_proc
        self.syscalls = list(syscalls) if syscalls is not None else [s.name for s in SPECS]
        self.ring_pages = ring_mib * 1024 * 1024 // os.sysconf("SC_PAGE_SIZE")
        self.poll_ms = max(1, min(poll_ms, 1000))
        self._busy_bytes = ring_mib * 1024 * 1024 // 8  # a drain this large: the next one comes at _POLL_MS
        self._drained = 0  # bytes taken from the ring since the last poll
        self.attached: list[str] = []
        self.missing: list[str] = []
        self.syscall_hook = syscall_hook
        self.sched_hook = sched_hook
        # What is in use once started (probes/ebpf/hooks.py): "raw" or "classic" tracepoints for the
        # syscalls (`hook`) and for the scheduler and interrupt hooks (`sched`); the notes say why raw was
        # not taken when it was wanted; the io_uring programs' (`uring`, "" where the kernel has none) go
        # with the scheduler's.
        self.hook = self.sched = self.uring = ""
        self.hook_note = self.sched_note = self.uring_note = ""
        self.events = 0
        self._bpf: Any = None
        self._sink: Sink | None = None
        self._batch: list[bytes] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._callback_errors = 0
        self._nr_names: dict[int, str] = {}
        self._final_drops: dict[str, int] | None = None
        self._final_skips: dict[str, int] | None = None
        self._final_runs: dict[str, tuple[int, int]] | None = None
        self.wakeups = 0  # ring-buffer polls that found events
        self._on_proc_errors = 0
        self._poll_error = ""
        self._files = MappedFiles(self._emit_in_order, self._forget_file)
        self._received = ReceivedFds(self._emit_in_order)
        self._since: dict[int, int] = {}  # pid -> when it was added to the target set
        self.owner_uid = owner_uid
        self.owner = OwnerFilter(owner_uid, self.is_traced, self._remove_from_target_set)
        self._final_left_out: int | None = None
        self._uring_unsure = 0  # in flight at stop or done without a completion: see final.unfinished_requests

    # ------------------------------------------------------------------------------ lifecycle ---

    def start(self, sink: Sink) -> None:
        for pid in self.pids:
            if procfs.proc_info(pid) is None:
                raise UserError(f"no process with pid {pid}")
        bcc = check_host()
        self._sink = sink
        self.hook, self.hook_note = hooks.choose("syscall", self.syscall_hook)
        self.sched, self.sched_note = hooks.choose("sched", self.sched_hook)
        for _ in range(3):  # each group falls back to classic at most once
            try:
                self._load(bcc, sink)
                break
            except hooks.RawAttachFailed as e:
                note = f"raw tracepoints failed to attach: {e}"
                if e.group == "syscall":
                    self.hook, self.hook_note = "classic", note
                else:
                    self.sched, self.sched_note = "classic", note
        sink.emit([SourceStatus(clock.monotonic_ns(), self.name, *self._start_status())])
        self._thread = Thread(target=self._poll, name="gputrace-ebpf", daemon=True)
        self._thread.start()

    def _load(self, bcc: Any, sink: Sink) -> None:
        flags = build.cflags(self.threshold_ns, self.ring_pages, self.hook, self.sched, self.owner_uid, self.off)
        self._bpf = build.compile_program(bcc, flags)
        try:
            self._setup(sink)
        except BaseException as e:
            bpf, self._bpf = self._bpf, None
            unload(bpf)
            if isinstance(e, Exception) and not isinstance(e, (UserError, hooks.RawAttachFailed)):
                raise UserError(f"setting up the eBPF programs failed: {e}") from None
            raise

    def named_mapping(self, pid: int, dev: str, ino: int) -> bool:
        """Whether the file (``dev`` "MAJ:MIN", ``ino``) that ``pid`` faulted on has been named (its FileMap
        record written): the name is read from /proc/PID/maps while the file is still mapped."""
        return self._files.named((pid, dev, ino))

    def _start_status(self) -> tuple[str, str]:
        how = "raw tracepoints sys_enter/sys_exit" if self.hook == "raw" else "classic syscall tracepoints"
        detail = f"syscalls via {how}" + (f" ({self.hook_note})" if self.hook_note else "")
        detail += f"; scheduler via {self.sched} tracepoints" + (f" ({self.sched_note})" if self.sched_note else "")
        if self.uring:
            detail += f"; io_uring via {self.uring} tracepoints" + (f" ({self.uring_note})" if self.uring_note else "")
        if self.off:
            detail += f"; turned off: {', '.join(sorted(self.off))}"
        if self.missing:
            return "degraded", f"missing tracepoints: {', '.join(self.missing)}; {detail}"
        return "started", detail

    def _setup(self, sink: Sink) -> None:
        sysinfo = self._fill_sysinfo()
        self._attach(sysinfo)
        sink.emit_meta(self.name, self._meta(sysinfo))
        self._bpf[b"events"].open_ring_buffer(self._on_event)
        self._bpf[b"procev"].open_ring_buffer(self._on_proc_event)
        for pid in self.pids:
            self.add_target(pid)

    def stop(self) -> None:
        if self._bpf is None or self._sink is None:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        self._bpf.ring_buffer_consume()
        self._flush()
        now = clock.monotonic_ns()
        slots = [v for _, v in self._bpf[b"inflight"].items_lookup_batch()]
        offcpu = {k.value: v for k, v in self._bpf[b"offcpu"].items()}
        live = self.live_targets()
        waiting = final.unfinished(slots, offcpu, live, self._since, now, self.threshold_ns)
        requests, self._uring_unsure = final.unfinished_requests(self._uring_entries(), live, now, self.threshold_ns)
        waiting += requests
        if waiting:
            self._sink.emit_kernel(b"".join(waiting), len(waiting))
        aggs = final.aggregates(self._bpf[b"agg"].items(), slots, {**uring.agg_names(), **self._nr_names})
        records: list[Any] = self.owner.owned_aggregates(aggs)
        self._final_left_out = self.left_out()
        self._final_drops = self.drops()
        self._final_skips = self.skipped()
        self._final_runs = program_runs(self._bpf)
        records += [Drops(now, self.name, what, n) for what, n in self._final_drops.items()]
        records.append(self._final_status(now))
        self._sink.emit(records)
        bpf, self._bpf = self._bpf, None
        _quiet(bpf)  # the programs go quiet at once; unhooking them takes a while
        unload_in_background(bpf)

    def _uring_entries(self) -> list[Any]:
        """The io_uring requests the kernel side holds as in flight (none where it has no io_uring programs)."""
        try:
            table = self._bpf[b"uring"]
        except KeyError:
            return []
        return [v for _, v in table.items()]

    def _final_status(self, now: int) -> SourceStatus:
        detail = f"{self.events} kernel events"
        if self._uring_unsure:
            detail += (f"; {self._uring_unsure} io_uring requests submitted with IOSQE_CQE_SKIP_SUCCESS had posted no "
                       "completion at stop: done or still in flight, the kernel does not say, so they are left out")
        if self._final_left_out:
            detail += f"; {self._final_left_out} processes left out: {LEFT_OUT_WHY}"
        if self._on_proc_errors:
            detail += f"; the on_proc callback failed {self._on_proc_errors} times"
        return final_status(self.name, now, detail, self._poll_error)

    def skipped(self) -> dict[str, int]:
        """How often the kernel skipped each of this source's programs (see host.program_skips), and the
        switches back to a traced thread it did not report (events.UNREPORTED_SWITCHES), and the received fds
        that could not be named (events.FDS_UNNAMED)."""
        if self._final_skips is not None or self._bpf is None:
            return program_skips(self._bpf, final=self._final_skips)
        out = program_skips(self._bpf)
        table = self._bpf[b"drops"]
        for i, name in enumerate(events.UNREPORTED_SWITCHES, len(events.DROP_REASONS)):
            out[name] = int(table.sum(table.Key(i)).value)
        if self._received.unnamed:
            out[events.FDS_UNNAMED] = self._received.unnamed
        return out

    def received_fds(self) -> tuple[int, int, int]:
        """(named, of those checked against the inode the kernel saw, unnamed): the fds traced processes received
        over unix sockets, so far (see ReceivedFds)."""
        return self._received.named, self._received.checked, self._received.unnamed

    def program_runs(self) -> dict[str, tuple[int, int]]:
        """(run count, run time ns) of each of this source's kernel programs (see host.program_runs)."""
        return program_runs(self._bpf, final=self._final_runs)

    def left_out(self) -> int:
        """Processes left out because they gained privileges the owner lacks, as the capture holds them: the
        kernel's ProcLeftOut records read (one lost with a full ring is counted with the drops) plus those user
        space found already privileged. Not the kernel's own count, which goes on after the last read."""
        if self._final_left_out is not None:
            return self._final_left_out
        return self.owner.found_privileged + self.owner.seen

    def drops(self) -> dict[str, int]:
        if self._final_drops is not None:
            return dict(self._final_drops)
        out = dict.fromkeys(events.DROP_REASONS, 0)
        if self._bpf is not None:
            table = self._bpf[b"drops"]
            for i, what in enumerate(events.DROP_REASONS):
                out[what] = int(table.sum(table.Key(i)).value)
        out["callback"] = self._callback_errors
        return out

    # -------------------------------------------------------------------------------- targets ---

    def add_target(self, pid: int, *, descendants: bool = True) -> None:
        """Trace ``pid`` (and its living descendants) from now on; snapshot their /proc state."""
        info = procfs.proc_info(pid)
        if info is None:
            raise UserError(f"no process with pid {pid}")
        if self._bpf is None:
            self.pids.append(pid)  # not started yet: start() adds it
            return
        pids = [pid] + (procfs.descendants(pid) if descendants else [])
        now = clock.monotonic_ns()
        records: list[Any] = []
        added = []
        for p in pids:
            if self.owner.may_add(p):
                self._add_to_target_set(p)
                self._since.setdefault(p, now)
                added.append(p)
                records += procfs.snapshot(p)
        records = self.owner.owned_records(records) + self.owner.privileged_found(pids, added)
        if self._sink is not None:
            self._sink.emit(records)

    def _add_to_target_set(self, pid: int) -> None:
        """As add_target() in gputrace.bpf.c: the set, then the fast slot."""
        targets, tslot = self._bpf[b"targets"], self._bpf[b"tslot"]
        targets[targets.Key(pid)] = targets.Leaf(1)
        key = tslot.Key(pid & _TARGET_MASK)
        cur = tslot[key].value
        tslot[key] = tslot.Leaf(pid if cur in (0, pid) else _SLOT_SHARED)

    def _remove_from_target_set(self, pid: int) -> None:
        """As remove_target() in gputrace.bpf.c."""
        targets, tslot = self._bpf[b"targets"], self._bpf[b"tslot"]
        targets.pop(targets.Key(pid), None)
        key = tslot.Key(pid & _TARGET_MASK)
        if tslot[key].value == pid:
            tslot[key] = tslot.Leaf(0)

    def is_traced(self, pid: int) -> bool:
        if self._bpf is None:
            return False
        targets = self._bpf[b"targets"]
        try:
            targets[targets.Key(pid)]
        except KeyError:
            return False
        return True

    def io_waiting(self) -> int:
        """Traced tasks off CPU in uninterruptible sleep now, as the kernel counts them (block requests
        are recorded from any submitter while this is above 0)."""
        if self._bpf is None:
            return 0
        table = self._bpf[b"iowait"]
        return int(table[table.Key(0)].value)

    def live_targets(self) -> set[int]:
        """Traced tgids whose process still exists."""
        if self._bpf is None:
            return set()
        return {k.value for k in self._bpf[b"targets"] if Path(f"/proc/{k.value}").is_dir()}

    def any_live(self) -> bool:
        """Whether a traced process still runs: one that exited and waits, a zombie, to be reaped does not."""
        if self._bpf is None:
            return False
        return any(procfs.running(k.value) for k in self._bpf[b"targets"])

    def program_text(self) -> str:
        return program_text()

    # ------------------------------------------------------------------------------------ setup ---

    def _fill_sysinfo(self) -> dict[int, tuple[str, int]]:
        numbers = syscall_numbers()
        table = self._bpf[b"sysinfo"]
        out: dict[int, tuple[str, int]] = {}
        self.missing, self.attached = [], []  # a fallback after a failed raw attach starts over
        for name in self.syscalls:
            spec, nr = BY_NAME.get(name), numbers.get(name)
            if spec is None or nr is None or nr >= _NR_MAX:
                self.missing.append(f"syscalls:sys_enter_{name}")
                continue
            table[table.Key(nr)] = table.Leaf(spec.flags | _F_TRACED, spec.arg_idx)
            out[nr] = (name, spec.flags)
        self._nr_names = {nr: name for nr, (name, _) in out.items()}
        return out

    def _attach(self, sysinfo: dict[int, tuple[str, int]]) -> None:
        names = [name for _, (name, _) in sorted(sysinfo.items())]
        if "syscalls" not in self.off:
            self.attached, missing = hooks.attach_syscalls(self._bpf, self.hook, self.syscall_hook, names)
            self.missing += missing
        if "sched" not in self.off:
            self.missing += hooks.attach_sched(self._bpf, self.sched, self.sched_hook)
        on = uring_supported() and "uring" not in self.off
        self.uring, self.uring_note = hooks.uring_hook(self.sched) if on else ("", "")
        if self.uring:
            hooks.attach_uring(self._bpf, self.uring, self.sched_hook)
        if "block" not in self.off and not tracepoint_exists("block", "block_io_start"):
            self.missing.append("block:block_io_start (using block_rq_issue: not the submitter's context)")
        if "faults" not in self.off and not file_faults_supported():
            self.missing.append("filemap:mm_filemap_fault (needs Linux 6.11+, x86_64 and BTF: waits in page "
                                "faults on file mappings are not named)")
        if "uring" not in self.off and not self.uring:
            self.missing.append("io_uring:io_uring_submit_req/file_get/complete (needs Linux 5.19+: waits in "
                                "io_uring_enter are not named by their requests)")
        if "dirty" not in self.off and not dirty_throttle_layout():
            self.missing.append("writeback:balance_dirty_pages (pauses of writers for dirty pages are not named)")

    def _meta(self, sysinfo: dict[int, tuple[str, int]]) -> dict[str, Any]:
        return {
            "layout": events.LAYOUT,
            "threshold_ns": self.threshold_ns,
            "page_size": os.sysconf("SC_PAGE_SIZE"),
            "clock": "CLOCK_MONOTONIC",
            "syscalls": {nr: name for nr, (name, _) in sysinfo.items()},
            "sysflags": {nr: flags for nr, (_, flags) in sysinfo.items()},
            "devices": procfs.block_devices(),
            "attached": self.attached,
            "syscall_hook": self.hook,
            "syscall_hook_note": self.hook_note,
            "sched_hook": self.sched,
            "sched_hook_note": self.sched_note,
            "uring_hook": self.uring,
            "missing": self.missing,
            "drop_reasons": list(events.DROP_REASONS),
            "fork_markers": True,
            "off": sorted(self.off),
        }

    # ---------------------------------------------------------------------------------- drain ---

    def _poll(self) -> None:
        try:
            timeout = self.poll_ms
            while not self._stop.is_set():
                self._bpf.ring_buffer_poll(timeout)  # woken by process events; `events` never wakes it
                self._bpf.ring_buffer_consume()
                self.wakeups += 1
                self._flush()
                self.drain_done()
                busy, self._drained = self._drained >= self._busy_bytes, 0
                timeout = min(_POLL_MS, self.poll_ms) if busy else self.poll_ms
        except Exception as e:  # noqa: BLE001 - reported as the source ending early; the kernel counts the rest
            self._poll_error = f"{type(e).__name__}: {e}"

    def _on_event(self, _ctx: Any, data: Any, size: int) -> int:
        raw = ctypes.string_at(data, size)
        self._drained += size
        if size == _FAULT_SIZE:  # no other event has this size
            try:
                self._files.fault(raw)
            except Exception:  # noqa: BLE001 - runs under bcc's poll: counted, never raised
                self._callback_errors += 1
        batch = self._batch
        batch.append(raw)
        if size == _FDRECV_SIZE:  # nor this one: the names follow it in the capture
            try:
                self._received.in_order(raw)
            except Exception:  # noqa: BLE001
                self._callback_errors += 1
        if len(batch) >= _BATCH_EVENTS:
            self._flush()
        return 0

    def drain_done(self) -> None:
        """Called by the drain thread after each drain of the rings (probes/ebpf/shared.py routes there)."""

    def _flush(self) -> None:
        if self._batch and self._sink is not None:
            batch, self._batch = self._batch, []
            self.events += len(batch)
            self._sink.emit_kernel(b"".join(batch), len(batch))

    def _emit_in_order(self, records: list[Any]) -> None:
        """Records that must follow what the kernel saw before them (and precede what it saw after)."""
        self._flush()
        assert self._sink is not None
        self._sink.emit(self.owner.owned_records(records))

    def _forget_file(self, key: Key) -> None:
        if self._bpf is not None:
            table = self._bpf[b"mapfiles"]
            pid, dev, ino = key
            major, minor = map(int, dev.split(":"))
            table.pop(table.Key(pid, major << 20 | minor, ino), None)

    def _on_proc_event(self, _ctx: Any, data: Any, size: int) -> int:
        # Runs under bcc's poll: it must never raise, so every failure is counted instead.
        try:
            raw = ctypes.string_at(data, size)
            if size == events.MAPFILE.size:
                self._files.announced(raw)
                return 0
            if size in _FDRECV_ANNOUNCED:
                self._received.announced(raw)
                return 0
            rec = events.proc_record(raw)
        except Exception:  # noqa: BLE001
            self._callback_errors += 1  # a process event lost: counted with the drops
            return 0
        try:
            self.owner.note(rec)
            self._emit_in_order([rec, *procfs.new_task_metadata(rec)])
            if isinstance(rec, (ProcExit, ProcLeftOut)) and rec.tid == rec.pid:
                self._files.process_gone(rec.pid)
            elif isinstance(rec, ProcFork) and not rec.is_thread:
                self._files.process_started(rec.child_pid)
        except Exception:  # noqa: BLE001
            self._callback_errors += 1
        if self.on_proc is not None:
            try:
                self.on_proc(rec)
            except Exception:  # noqa: BLE001 - the caller's bug; reported in the final status
                self._on_proc_errors += 1
        return 0
