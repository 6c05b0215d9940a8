"""CPU stack sampling of the traced processes, so a stall spent on CPU can name its hottest frames.

A CPU-clock perf event fires ``hz`` times a second on every CPU (bpf/sampler.bpf.c); samples of traced
tgids carry their user stack's addresses. The poll thread gives each distinct (pid, stack) an id and
symbolizes it once, while the process is alive, into a StackFrames record (leaf first); every sample becomes
a StackSample that refers to it. Symbol names come from the traced process's own files and are untrusted:
frame count and length are capped.
"""

from __future__ import annotations

import ctypes
import os
import struct
import threading
import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from gputrace import clock
from gputrace.errors import UserError
from gputrace.probes import elfsyms
from gputrace.probes.ebpf.host import (
    BPF_DIR,
    check_host,
    compile_bpf,
    final_status,
    format_has,
    program_runs,
    program_skips,
    unload,
)
from gputrace.probes.ebpf.owner import foreign, owner_cflags
from gputrace.records import Drops, SourceStatus, StackFrames, StackSample
from gputrace.source import Sink
from gputrace.threads import Thread

PROGRAM = BPF_DIR / "sampler.bpf.c"
HEADER = BPF_DIR / "sampler.h"
DEFAULT_HZ = 499  # not a divisor of common timer rates, so samples do not lock step with periodic work
MAX_HZ = 10_000
KERNEL_COUNTS = ("ringbuf", "no_user_stack", "targets", "left_out")  # SP_DROP_*, SP_LEFT_OUT in bpf/sampler.h
# Samples with no user stack to read (a task exiting after its memory is gone, a sample that landed where
# there are no user registers) are not records lost: they are said in the final status, not counted as drops;
# so are processes left out because they gained privileges the owner lacks (see StackSampler).
NOT_LOSSES = ("no_user_stack", "left_out")
MAX_FRAMES = 64  # SP_STACK_DEPTH in bpf/sampler.h
MAX_FRAME_CHARS = 200
_POLL_MS = 100
_SWEEP_S = 1.0  # how often what is kept of exited processes' mappings goes and grown drop counts are written


class SampleEvent(ctypes.Structure):
    """Mirrors struct sp_event in bpf/sampler.h."""

    _fields_ = [
        ("ts", ctypes.c_uint64),
        ("pid", ctypes.c_uint32),
        ("tid", ctypes.c_uint32),
        ("nr", ctypes.c_uint32),
        ("cpu", ctypes.c_uint32),
        ("ip", ctypes.c_uint64 * MAX_FRAMES),
    ]


_HEAD = struct.Struct("<QIIII")  # ts, pid, tid, nr, cpu of SampleEvent
_IP_AT = SampleEvent.ip.offset


def program_text() -> str:
    """The BPF program as compiled (header first), for a hidden --ebpf flag."""
    return HEADER.read_text() + "\n" + PROGRAM.read_text()


def clean_name(raw: bytes | str | None, limit: int = MAX_FRAME_CHARS) -> str:
    """A symbol or module name from a traced process, made printable and bounded."""
    if raw is None:
        return ""
    text = raw.decode("utf-8", "replace") if isinstance(raw, bytes) else raw
    text = "".join(c if c.isprintable() else "?" for c in text[: limit * 2])
    return text if len(text) <= limit else text[: limit - 1] + "…"


def frame_name(name: bytes | None, module: bytes | None) -> str:
    """``func (module)`` as the report shows it; ``[unknown] (module)`` when only the module is known."""
    mod = clean_name(os.path.basename(module)) if module else ""
    func = clean_name(name) or "[unknown]"
    return f"{func} ({mod})" if mod else func


class Symbolizer:
    """Frame names for the stacks of traced processes (probes/elfsyms.py); what is kept of a process goes
    when it is gone."""

    def __init__(self) -> None:
        self._elf = elfsyms.Symbolizer()

    def frames(self, pid: int, addrs: list[int]) -> list[str]:
        return [frame_name(name, module) for name, module in self._elf.resolve(pid, addrs)]

    def sweep(self, alive: Any = lambda pid: Path(f"/proc/{pid}").is_dir()) -> set[int]:
        """Forget the processes that are gone; returns their pids."""
        gone = {p for p in self._elf.pids() if not alive(p)}
        for pid in gone:
            self._elf.forget(pid)
        return gone

    def close(self) -> None:
        self._elf.close()


class StackSampler:
    """Source of StackSample and StackFrames records for ``pids`` and their children (gputrace.source.Source)."""

    name = "sampler"

    def __init__(self, pids: Iterable[int], *, hz: int = DEFAULT_HZ, ringbuf_pages: int = 512,
                 max_targets: int = 8192, owner_uid: int | None = None) -> None:  # fmt: skip
        """``owner_uid``: samples are for this non-root user, so none is taken of a task with privileges it
        lacks, and a process that gains them at exec leaves the targets (gt_task_foreign in bpf/gputrace.h);
        None (root): no check compiled in."""
        if not 1 <= hz <= MAX_HZ:
            raise UserError(f"the sampling rate must be 1 to {MAX_HZ} Hz (got {hz})")
        if ringbuf_pages < 1 or ringbuf_pages & (ringbuf_pages - 1):
            raise UserError("the sampler's ring buffer size must be a power of two pages")
        self.pids = list(dict.fromkeys(pids))
        self.hz = hz
        self.ringbuf_pages, self.max_targets = ringbuf_pages, max_targets
        self.owner_uid = owner_uid
        self._left_out = 0
        self.samples = 0
        self._bpf: Any = None
        self._sink: Sink | None = None
        self._batch: list[Any] = []
        self._stacks: dict[tuple[int, bytes], int] = {}  # (pid, the stack's addresses) -> stack id
        self._next_stack = 0
        self._symbols = Symbolizer()
        self._malformed = 0
        self._targets_full = 0
        self._final_drops: dict[str, int] | None = None
        self._final_skips: dict[str, int] | None = None
        self._final_runs: dict[str, tuple[int, int]] | None = None
        self.wakeups = 0  # ring-buffer drains
        self._no_user_stack = 0
        self._emitted: dict[str, int] = {}  # drop counts last written as Drops records
        self._lock = threading.Lock()  # add_target() (the session's thread) against stop()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._poll_error = ""

    # ------------------------------------------------------------------------------ lifecycle ---

    def start(self, sink: Sink) -> None:
        bcc = check_host()
        self._sink = sink
        self._bpf = self._load(bcc)
        try:
            self._attach(bcc)
        except BaseException as e:
            bpf, self._bpf = self._bpf, None
            unload(bpf)
            if isinstance(e, Exception) and not isinstance(e, UserError):
                raise UserError(f"setting up the sampler failed: {type(e).__name__}: {e}") from None
            raise
        sink.emit_meta(self.name, {"hz": self.hz, "stack": "user", "max_frames": MAX_FRAMES})
        detail = f"{self.hz} Hz CPU-clock samples of user stacks"
        sink.emit([SourceStatus(clock.monotonic_ns(), self.name, "started", detail)])
        self._thread = Thread(target=self._run, name="gputrace-sampler", daemon=True)
        self._thread.start()

    def add_target(self, pid: int) -> None:
        """Also sample ``pid`` (a process found after start, e.g. a new child); its threads come with it."""
        with self._lock:
            if pid not in self.pids:
                self.pids.append(pid)
            if self._bpf is None:
                return
            targets = self._bpf[b"targets"]
            try:
                targets[targets.Key(pid)] = targets.Leaf(1)
            except Exception:  # noqa: BLE001 - bcc raises a bare Exception when the map is full
                self._targets_full += 1

    def stop(self) -> None:
        if self._bpf is None or self._sink is None:
            return
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        with self._lock:
            bpf = self._bpf
            bpf[b"targets"].clear()  # quiet at once; closing the perf events takes a while
            bpf.ring_buffer_consume()
            self._flush()
            self._final_drops = self.drops()
            self._final_skips = program_skips(self._bpf)
            self._final_runs = program_runs(self._bpf)
            counts = self._kernel_counts()
            self._no_user_stack, self._left_out = counts["no_user_stack"], counts["left_out"]
            self._bpf = None
        now = clock.monotonic_ns()
        records: list[Any] = [Drops(now, self.name, what, n) for what, n in self._final_drops.items()]
        records.append(self._final_status(now))
        self._sink.emit(records)
        self._symbols.close()
        unload(bpf)

    def skipped(self) -> dict[str, int]:
        """How often the kernel skipped each of this source's programs (see ebpf.host.program_skips)."""
        return program_skips(self._bpf, final=self._final_skips)

    def program_runs(self) -> dict[str, tuple[int, int]]:
        """(run count, run time ns) of each of this source's kernel programs (see ebpf.host.program_runs)."""
        return program_runs(self._bpf, final=self._final_runs)

    def drops(self) -> dict[str, int]:
        if self._final_drops is not None:
            return dict(self._final_drops)
        counts = self._kernel_counts()
        out = {k: v for k, v in counts.items() if k not in NOT_LOSSES}
        out["targets"] += self._targets_full
        out["malformed"] = self._malformed
        return out

    def _kernel_counts(self) -> dict[str, int]:
        out = dict.fromkeys(KERNEL_COUNTS, 0)
        if self._bpf is not None:
            table = self._bpf[b"drops"]
            for i, what in enumerate(KERNEL_COUNTS):
                out[what] = int(table.sum(table.Key(i)).value)
        return out

    def program_text(self) -> str:
        return program_text()

    # ------------------------------------------------------------------------------ internals ---

    def _cflags(self) -> list[str]:
        flags = [f"-I{BPF_DIR}", f"-DRINGBUF_PAGES={self.ringbuf_pages}", f"-DMAX_TARGETS={self.max_targets}"]
        if format_has("sched", "sched_process_exit", "group_dead"):
            flags.append("-DHAVE_GROUP_DEAD")
        return flags + owner_cflags(self.owner_uid)

    def _load(self, bcc: Any) -> Any:
        flags = self._cflags()  # a UserError of its own when the owner's check cannot be built
        try:
            return compile_bpf(bcc.BPF, src_file=str(PROGRAM).encode(), cflags=flags)
        except Exception as e:  # noqa: BLE001 - bcc raises bare Exceptions for compile failures
            raise UserError(f"cannot load {PROGRAM.name}: {e}") from None

    def _attach(self, bcc: Any) -> None:
        for pid in self.pids:
            self.add_target(pid)
        self._bpf[b"samples"].open_ring_buffer(self._on_event)
        try:
            self._bpf.attach_perf_event(ev_type=bcc.PerfType.SOFTWARE, ev_config=bcc.PerfSWConfig.CPU_CLOCK,
                                        fn_name=b"on_sample", sample_freq=self.hz)  # fmt: skip
        except Exception as e:  # noqa: BLE001 - bcc raises a bare Exception when perf_event_open fails
            raise UserError(f"cannot open CPU-clock perf events for sampling: {e}") from None

    def _run(self) -> None:
        next_sweep = time.monotonic() + _SWEEP_S
        try:
            while not self._stop.is_set():
                self._bpf.ring_buffer_poll(_POLL_MS)  # woken by a process's first sample only (sampler.bpf.c)
                self._bpf.ring_buffer_consume()
                self.wakeups += 1
                self._flush()
                if time.monotonic() >= next_sweep:
                    self._forget(self._symbols.sweep())
                    self._emit_drops()
                    next_sweep = time.monotonic() + _SWEEP_S
        except Exception as e:  # noqa: BLE001 - reported in the source's final status
            self._poll_error = str(e)

    def _on_event(self, ctx: Any, data: Any, size: int) -> None:
        if size != ctypes.sizeof(SampleEvent):
            self._malformed += 1
            return
        raw = ctypes.string_at(data, size)
        ts, pid, tid, nr, cpu = _HEAD.unpack_from(raw)
        key = (pid, raw[_IP_AT : _IP_AT + 8 * min(nr, MAX_FRAMES)])
        stack = self._stacks.get(key)
        if stack is None:
            self._next_stack += 1
            stack = self._stacks[key] = self._next_stack
            addrs = list(struct.unpack(f"<{len(key[1]) // 8}Q", key[1]))
            self._batch.append(StackFrames(pid, stack, self._frames(pid, addrs)))
        self._batch.append(StackSample(ts, pid, tid, stack, cpu))
        self.samples += 1

    def _frames(self, pid: int, addrs: list[int]) -> list[str]:
        """Symbolized from the process's maps and files as they are now. For a non-root owner, checked after
        the read: a sample from before an exec that gave the process privileges is not named from the
        privileged program's files."""
        frames = self._symbols.frames(pid, addrs)
        if self.owner_uid is not None and foreign(pid, self.owner_uid):
            return [frame_name(None, None)] * len(addrs)
        return frames

    def _forget(self, pids: set[int]) -> None:
        """Stacks of exited processes: a new process reusing the pid has other code at those addresses."""
        if pids:
            self._stacks = {k: v for k, v in self._stacks.items() if k[0] not in pids}

    def _emit_drops(self) -> None:
        """Drops records when a count grew, so the analysis knows when samples were lost, not only that."""
        now, counts = clock.monotonic_ns(), self.drops()
        grown = [Drops(now, self.name, what, n) for what, n in counts.items() if n > self._emitted.get(what, 0)]
        if grown and self._sink is not None:
            self._emitted = counts
            self._sink.emit(grown)

    def _flush(self) -> None:
        if self._batch and self._sink is not None:
            batch, self._batch = self._batch, []
            self._sink.emit(batch)

    def _final_status(self, now: int) -> SourceStatus:
        detail = f"{self.samples} samples, {self._next_stack} stacks"
        if self._no_user_stack:
            detail += f"; {self._no_user_stack} samples had no user stack to read (an exiting task)"
        if self._left_out:
            detail += f"; {self._left_out} processes left out: they gained privileges you lack (setuid/setgid/setcap)"
        return final_status(self.name, now, detail, self._poll_error)
