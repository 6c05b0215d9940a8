"""Explain a window of one thread's time: where did [a, b) go on thread T?

The answer is a list of parts that together cover the window: on CPU, in the run queue, blocked in a syscall
on a file / socket / sleep / GPU sync, or waiting for another task — in which case the wakeup edge is
followed to the waker and its time before the wakeup is explained the same way, to a bounded depth.
"""

from __future__ import annotations

import re
from bisect import bisect_left, bisect_right
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from itertools import compress
from operator import attrgetter
from typing import TypedDict

from gputrace.analysis import uring
from gputrace.analysis.blocks import BlockTies, Tie
from gputrace.analysis.load import DIRTY_OP, FAULT_OP, Capture
from gputrace.analysis.objects import POLLS, SLEEP, MountTable, classify, filesystem_of, is_kernel_task, is_remote_fs
from gputrace.analysis.throttle import Throttles, runnable_wait
from gputrace.analysis.timefmt import size_text
from gputrace.analysis.timeline import HostWait
from gputrace.documents import BlockFields, Culprit, DirtyFields, Evidence, Frame, LateRank, SampledFields
from gputrace.records import BlockIO, DirtyPause, IoUringRequest, OffCpu, Syscall

MAX_DEPTH = 8  # hops a wait chain may take to other threads (a round trip back to a thread takes none)
TOO_DEEP_WHY = f"the wait chain went on past {MAX_DEPTH} hops: not followed further"
# A wait in a recorded call with no off-CPU record in it: off CPU for less than the threshold, or its switch
# was not recorded (the probes lose one now and then, counting no drop: docs/probes.md)
NO_OFFCPU_WHY = "no off-CPU record of this wait: who ended it is not known"
LOCK_HOLDER_WHY = "the GPU had finished: the sync then waited for a lock whose holder is not known"
UNSEEN_SYNC_WHY = "the GPU had finished: no off-CPU record shows what the sync's thread waited for then"
MAX_EVIDENCE = 12
MAX_FRAMES = 5  # hottest leaf frames named in a cpu culprit
GIL_RUNNING = 0.8  # share of a timed-out wait another thread must have run (or been runnable) for to hold the lock
MAX_DIRTY_EVIDENCE = 4  # pauses for dirty pages named in a storage stall's evidence
PAUSE_SLEEP_NS = 1_000_000  # a pause is slept right after its tracepoint: the off-CPU span that starts this soon
# What an agent's thread does in the target, by the role it reported (gputrace/agent, probes/cupti.py)
AGENT_WORK = {"io": "gputrace agent: record flush", "cupti-flush": "gputrace agent: CUPTI flush",
              "cupti-convert": "gputrace agent: CUPTI conversion"}
# Threads that native libraries start and name (CUDA's event handler and workers, PyTorch's autograd device
# threads): they never run Python, so they never hold the GIL
NATIVE_THREADS = ("cuda-EvtHandlr", "cuda0", "pt_autograd_")
NATIVE_SAMPLES = 10  # samples outside the interpreter, and none in it, that show a thread never runs Python
INTERPRETER_MODULES = re.compile(r"\((lib)?(python|pypy)[0-9.]*(\.so[0-9.]*)?\)$")  # a frame in the interpreter


class PartExtra(TypedDict, total=False):
    """What a part adds to its stall when it is the largest."""

    why: str
    remote_fs: bool
    late_rank: LateRank
    late_rank_cause: LateRank


@dataclass
class Part:
    cause: str
    ns: int
    culprit: Culprit
    via: list[str] = field(default_factory=list)
    path: list[int] = field(default_factory=list)  # the tid each hop of ``via`` went to
    evidence: list[Evidence] = field(default_factory=list)
    extra: PartExtra = field(default_factory=lambda: PartExtra())
    held: Counter[tuple[int, int, str]] = field(default_factory=Counter)  # a run-queue wait's: who had the CPU

    def key(self) -> tuple[str, int, str]:
        return (self.cause, self.culprit["pid"], self.culprit["object"])


def empty_culprit() -> Culprit:
    return {"pid": 0, "tid": 0, "comm": "", "op": "", "object": "", "bytes": 0, "duration_ns": 0}


def evidence_syscall(sc: Syscall) -> Evidence:
    if sc.name == FAULT_OP:  # not a syscall: the thread waited off CPU inside a page fault
        return {"pid": sc.pid, "tid": sc.tid, "kind": "offcpu", "what": f"page fault on {sc.obj} at offset {sc.arg}",
                "start_ns": sc.start_ns, "end_ns": sc.end_ns}
    what = f"{sc.name}({sc.obj})" if sc.obj else sc.name
    if sc.nbytes:
        what += f" {sc.nbytes} B"
    return {"pid": sc.pid, "tid": sc.tid, "kind": "syscall", "what": what, "start_ns": sc.start_ns,
            "end_ns": sc.end_ns}


def hottest_frames(cap: Capture, tid: int, a: int, b: int) -> SampledFields:
    """Where thread ``tid`` was sampled on CPU in [a, b): its most frequent leaf frames; {} without samples."""
    index = cap.samples.get(tid)
    stacks = index.between(a, b) if index else []
    if not stacks:
        return {}
    pid, counts = cap.pid_of(tid), Counter(stacks)
    leaves: Counter[str] = Counter()
    for stack, n in counts.items():
        frames = cap.stacks.get((pid, stack))
        leaves[frames[0] if frames else "[unknown]"] += n
    total = len(stacks)
    top: list[Frame] = [{"frame": f, "samples": n, "pct": round(100.0 * n / total, 1)}
                        for f, n in leaves.most_common(MAX_FRAMES)]
    return {"frames": top, "samples": total}


def evidence_block(b: BlockIO) -> Evidence:
    return {"pid": b.pid, "tid": b.tid, "kind": "block", "what": f"{b.rwbs} {b.nbytes} B on {b.dev}",
            "start_ns": b.issue_ns, "end_ns": b.complete_ns}


def evidence_dirty(p: DirtyPause, end_ns: int) -> Evidence:
    what = (f"paused {(end_ns - p.ts) / 1e6:.1f} ms for dirty pages on {p.dev}: {size_text(p.wb_dirty)} dirty or "
            f"in writeback, setpoint {size_text(p.wb_setpoint)}")
    return {"pid": p.pid, "tid": p.tid, "kind": "dirty", "what": what, "start_ns": p.ts, "end_ns": end_ns}


def evidence_offcpu(o: OffCpu, kind: str = "offcpu") -> Evidence:
    what = f"off CPU ({o.state})"
    ev: Evidence = {"pid": o.pid, "tid": o.tid, "kind": kind, "what": what, "start_ns": o.start_ns, "end_ns": o.end_ns}
    if kind == "wakeup":
        ev["what"] = f"woken by pid {o.waker_pid} tid {o.waker_tid} ({o.waker_comm})"
        ev["waker_pid"], ev["waker_tid"], ev["wake_ns"] = o.waker_pid, o.waker_tid, o.wake_ns
    return ev


ETIMEDOUT = 110
_API_TIMES, _TID = attrgetter("start_ns", "end_ns"), attrgetter("tid")
FUTEXES = ("futex", "futex_waitv")
TIMER_WAKER = "[timer]"  # the eBPF source's waker for wakeups from a timer interrupt (hrtimer expiry)
# How late a sleep's timer may fire: the task's timer slack (50 us unless set otherwise) and the interrupt's own
# delay (a completed time.sleep here: its timer's wakeup 60-80 us past the deadline)
TIMER_LATE_NS = 200_000
# A sync's time past its device's last end that no off-CPU record covers, left to the sync (a spinning wait's
# last polls, the device's clock placed on the host's)
UNSEEN_SYNC_NS = 1_000_000


def _timed_out(sc: Syscall) -> bool:
    """A futex wait that returned ETIMEDOUT, or a poll/select/epoll that returned no ready fd."""
    if sc.name in FUTEXES:
        return sc.ret == -ETIMEDOUT
    return sc.name in POLLS and sc.ret == 0


def _expired(sc: Syscall, o: OffCpu) -> bool:
    """A wait that ended by its timeout: it says so (``_timed_out``), or a futex wait whose off-CPU span ``o``
    was ended by a timer, which for a futex is its timeout firing (a wake that raced it can still make the
    call return 0)."""
    return _timed_out(sc) or (sc.name in FUTEXES and o.waker_comm == TIMER_WAKER)


def _timer_woken(sc: Syscall, o: OffCpu) -> OffCpu:
    """``o`` with its waker filled in where the capture has none but the call says who it was: a sleep inside a
    wait that timed out (``_timed_out``) was ended by its timer. The wakeup was not recorded (a probe run the
    kernel skipped, or one it never made while a task it hides held the CPU), so its time is unknown: taken as
    the span's end, when the thread had the CPU again at the latest."""
    if o.wake_ns or o.state != "S" or not _timed_out(sc):
        return o
    return o._replace(wake_ns=o.end_ns, waker_pid=0, waker_tid=0, waker_comm=TIMER_WAKER)


def _sleep_deadline(sc: Syscall) -> int | None:
    """When a completed sleep call's timer was due, from the time it asked for (``arg``: the eBPF source reads
    the call's timespec): a duration from its start (nanosleep; clock_nanosleep without TIMER_ABSTIME, as
    glibc's nanosleep and usleep call it), or a CLOCK_MONOTONIC deadline, the records' own clock
    (clock_nanosleep with TIMER_ABSTIME, as Python's time.sleep calls it). The record does not keep the call's
    flags: the two are told apart by its times, as a completed sleep runs from its start past its deadline.
    None where neither reading fits them or both do (a sleep longer than the clock's age), or where the call
    did not complete (a signal cut it short)."""
    arg = sc.arg
    if sc.name not in SLEEP or sc.ret != 0 or type(arg) is not int or arg <= 0:
        return None
    relative = sc.start_ns + arg <= sc.end_ns
    absolute = sc.name == "clock_nanosleep" and sc.start_ns <= arg <= sc.end_ns
    if relative == absolute:
        return None
    return sc.start_ns + arg if relative else arg


_POLL_TIMEOUT = frozenset({"poll", "epoll_wait", "epoll_pwait"})  # their ``arg``: the timeout, in ms


def _poll_due(sc: Syscall) -> int | None:
    """When a poll or epoll wait that timed out (returned 0) was due to wake: its start, its timeout (``arg``,
    in ms) and the timer's slack (the kernel's for a poll: 0.1 % of the timeout at nice 0, more for a niced task;
    0.5 % taken) or TIMER_LATE_NS, whichever is more. None for another call, or one that returned before that."""
    if sc.name not in _POLL_TIMEOUT or sc.ret != 0 or type(sc.arg) is not int or sc.arg <= 0:
        return None
    timeout = sc.arg * 1_000_000
    due = sc.start_ns + timeout + max(TIMER_LATE_NS, timeout // 200)
    return due if due < sc.end_ns else None


def _woken_when_due(o: OffCpu, due: int) -> OffCpu:
    """``o``, a sleep's off-CPU span, woken by its timer when ``due`` (its deadline and the timer's lateness) where
    no wakeup was recorded (a probe run the kernel skipped, or a switch back it did not report) and the span
    lasted past that: the rest of it was a wait for a CPU, not the sleep."""
    if o.wake_ns or o.state != "S" or not o.start_ns < due < o.end_ns:
        return o
    return o._replace(wake_ns=due, waker_pid=0, waker_tid=0, waker_comm=TIMER_WAKER)


def _unseen(offs: list[OffCpu], a: int, b: int) -> int:
    """The time in [a, b) that none of a thread's off-CPU spans ``offs`` covers (they never overlap)."""
    return max(b - a, 0) - sum(max(min(o.end_ns, b) - max(o.start_ns, a), 0) for o in offs)


def _on_pipe_or_socket(sc: Syscall) -> bool:
    """A wait on an fd that names a pipe or socket (poll/select/epoll on one, or a read, recv or accept)."""
    return sc.fd >= 0 and bool(sc.obj) and classify(sc) == "wait"


def _paused(pauses: list[DirtyPause], sleeps: list[OffCpu], end_ns: int) -> tuple[DirtyFields, list[Evidence]]:
    """Culprit fields and evidence of ``pauses`` for dirty pages: each lasts from its tracepoint to the end of
    the sleep among ``sleeps`` that began within PAUSE_SLEEP_NS of it (the kernel's own figure where none
    did), cut at ``end_ns``; the device and its dirty pages are the last pause's."""
    total, ev = 0, list[Evidence]()
    for p in pauses:
        o = next((o for o in sleeps if p.ts <= o.start_ns <= p.ts + PAUSE_SLEEP_NS), None)
        end = min(o.end_ns if o else p.ts + p.pause_ns, end_ns)
        total += end - p.ts
        ev.append(evidence_dirty(p, end))
    last = pauses[-1]
    return {"dirty_pauses": len(pauses), "dirty_paused_ns": total, "dirty_device": last.dev,
            "dirty_bytes": last.wb_dirty, "dirty_setpoint_bytes": last.wb_setpoint}, ev


def _frames_kind(frames: list[str]) -> str:
    """python: a stack with a frame in the interpreter; native: frames in named modules only; "" where no
    frame names its module (an unsymbolized stack says nothing)."""
    if any(INTERPRETER_MODULES.search(f) or "PyEval" in f for f in frames):
        return "python"
    return "native" if any(f.endswith(")") for f in frames) else ""


def _cpu_holders(waits: list[tuple[OffCpu, int, int]]) -> Counter[tuple[int, int, str]]:
    """Who had the CPU each off-CPU span waited for within its window [a, b) (a preemption, or the time from
    a wakeup on): (pid, tid, comm) with the time of that window."""
    out: Counter[tuple[int, int, str]] = Counter()
    for o, a, b in waits:
        ns = min(o.end_ns, b) - max(o.start_ns, a)
        if o.held_tid and ns > 0:
            out[(o.held_pid, o.held_tid, o.held_comm)] += ns
    return out


@dataclass
class CaptureFacts:
    """What the explainer otherwise gathers over the whole capture it is given: a windowed analysis
    (analysis/windowed.py) gathers it as the records go by and gives each window's explainer the whole
    capture's. Each is keyed by thread or futex word, never by record."""

    futex_words: dict[tuple[int, int], tuple[set[int], set[int]]]  # (pid, word) -> waited tids, timed-out tids
    interpreted: dict[int, bool | None]  # tid -> seen in the interpreter (``Explainer._in_interpreter``)
    lock_wakers: dict[tuple[int, int], set[int]] | None = None  # (pid, word) -> who woke a waiter; None: unknown


BEFORE_HOST_RECORDS = "before this capture's host-side records begin: what the thread did then is not in it"


def host_records_from(cap: Capture) -> int:
    """From when the capture holds every host-side (kernel) record of its traced threads: the trailer's
    ``host_from_ns`` (a flight segment's, daemon/watch/flight.py: the kernel events that ended earlier may be
    in the segments before it), else when tracing began (``tracing_ns``; 0 where the capture does not say).
    A record lands in a capture by when it was read, not by its times, and agents send GPU records later than
    the kernel's are read: a stall can lie before the host side's records begin. A thread without records
    then was not on CPU for all anyone knows: its records are elsewhere, or were never taken."""
    ns = cap.trailer.get("host_from_ns")
    return ns if type(ns) is int and ns > 0 else cap.tracing_ns


def interpreted(samples: Counter[int], frames_of: Callable[[int], list[str]]) -> bool | None:
    """Whether a thread sampled on ``samples`` (stack id -> samples; ``frames_of`` a stack id's frames) ran in
    the interpreter, as ``Explainer._in_interpreter`` says it."""
    kinds: Counter[str] = Counter()
    for stack, n in samples.items():
        kinds[_frames_kind(frames_of(stack))] += n
    return True if kinds["python"] else False if kinds["native"] >= NATIVE_SAMPLES else None


class Explainer:
    def __init__(self, cap: Capture, facts: CaptureFacts | None = None) -> None:
        self.cap = cap
        self.mounts = MountTable(cap.header.get("mounts") or [])
        self._fstypes: dict[str, str] = {}  # path -> its filesystem's type
        self.ties = BlockTies(cap, self.mounts)
        self.throttles = Throttles(cap)
        tracer = cap.header.get("tracer_pid")
        self.tracer_pid = tracer if type(tracer) is int and tracer > 0 else -1  # captures before it: none
        self.host_from = host_records_from(cap)
        self._done_index: dict[int, list[tuple[list[int], list[int]]]] | None = None
        self._threads: dict[int, list[int]] | None = None
        # (pid, futex word) -> the threads that waited on it, and those of them that timed out there
        self._futex_words: dict[tuple[int, int], tuple[set[int], set[int]]] | None = None
        self._api_index: dict[int, list[tuple[int, int]]] | None = None  # tid -> its CUDA API calls (start, end)
        self._lock_wakers: dict[tuple[int, int], set[int]] | None = None  # (pid, futex word) -> who woke a waiter
        self._interpreted: dict[int, bool | None] = {}  # tid -> seen in the interpreter (None: no telling)
        if facts is not None:
            self._futex_words, self._interpreted = facts.futex_words, dict(facts.interpreted)
            self._lock_wakers = facts.lock_wakers
        # Round trips: the thread (and depth) whose hand-off is being followed, and where a callee whose own
        # hand-off came from that thread gives the rest of the window back to it (``_explain_alive``)
        self._handing: list[tuple[int, int]] = []
        self._resume: int | None = None
        # Collective calls that waited for a later rank, by tid, and what such a wait is (set by the
        # Attributor, which knows the other captures of a job: analysis/attribute.py)
        self.host_waits: dict[int, list[HostWait]] = {}
        self.on_collective: Callable[[HostWait, int, int, int], Part] | None = None

    def traced(self, tid: int) -> bool:
        """Whether the kernel source watched this thread: without that, its time cannot be explained."""
        return self.cap.kernel_seen and self.cap.pid_of(tid) in self.cap.kernel_pids

    def culprit(self, tid: int, op: str = "", obj: str = "", nbytes: int = 0, dur: int = 0) -> Culprit:
        pid = self.cap.pid_of(tid)
        return {"pid": pid, "tid": tid, "comm": self.cap.comm(tid) or self.cap.comm(pid), "op": op,
                "object": obj, "bytes": nbytes, "duration_ns": dur}

    def cpu_culprit(self, tid: int, a: int, b: int) -> Culprit:
        """A thread on CPU over [a, b), with its hottest frames where it was sampled."""
        return {**self.culprit(tid, "cpu"), **hottest_frames(self.cap, tid, a, b)}

    def explain(self, tid: int, a: int, b: int, depth: int = 0) -> list[Part]:
        """Parts covering [a, b) of thread ``tid``'s time. A thread created inside the window did not exist
        before its creation: that time was its creator's (the thread that made it, doing the work that led
        to it: a worker's main thread reading the batch its queue's feeder thread then hands over), and is
        explained on the creator, up the chain of creators while each was created inside the window too.
        Creation times strictly decrease up that chain, so it ends. A creator in another process (a fork)
        adds ``fork:pid P`` to ``via``; a thread created by its own process's thread adds no hop.

        A window asked for (``depth`` 0) that begins before the capture's host-side records do
        (``host_records_from``) is ``unknown`` up to there: nothing is inferred from records that are absent
        because they were never in this capture. Every hop's window lies inside the one asked for."""
        if depth == 0 and a < self.host_from:
            cut = min(b, self.host_from)
            before = Part("unknown", cut - a, empty_culprit(), extra={"why": BEFORE_HOST_RECORDS})
            return [before, *self.explain(tid, cut, b)] if b > cut else [before]
        role = self.cap.agent_threads.get(tid)
        if role is not None:  # gputrace's own agent: what it did took the tracing's time
            return self._agent_thread(tid, role, a, b)
        parts: list[Part] = []
        hops: list[str] = []
        hop_tids: list[int] = []
        pid = self.cap.pid_of(tid)
        while b > a:
            made = self.cap.creation(tid, b)
            born = made[0] if made is not None and made[0] > a else a
            for p in self._explain_alive(tid, born, b, depth):
                if hops:
                    p.via, p.path = [*hops, *p.via], [*hop_tids, *p.path]
                parts.append(p)
            if born == a or made is None or self._resume is not None:  # a round trip gave the rest back
                break
            b, tid = made  # creation before b: the window shrinks every turn
            creator_pid = self.cap.pid_of(tid)
            if creator_pid and creator_pid != pid:
                hops.append(f"fork:pid {creator_pid}")
                hop_tids.append(tid)
                pid = creator_pid
        return parts

    def _explain_alive(self, tid: int, a: int, b: int, depth: int) -> list[Part]:
        """[a, b) of a thread that existed throughout it. Where it waited in a collective call for a later
        rank (``host_waits``), that time is the late rank's (``on_collective``: the same answer a collective
        stall on the device gets), whatever sockets and threads the backend waited on meanwhile; the rest is
        explained call by call. Latest first, as hand-offs are: a round trip that gives the window's earlier
        part back to the thread that asked (``_resume``) ends the walk there."""
        waits = self.host_waits.get(tid) if self.on_collective is not None else None
        inside = [w for w in waits if w.wait_start < b and w.wait_end > a] if waits else []
        parts: list[Part] = []
        end = b
        for w in reversed(inside):
            x, y = max(w.wait_start, a), min(w.wait_end, end)
            if y <= x:
                continue
            parts += self._alive(tid, y, end, depth)
            if self._resume is not None:
                return parts
            assert self.on_collective is not None
            parts.append(self.on_collective(w, x, y, depth))
            end = x
        return parts + self._alive(tid, a, end, depth)

    def _alive(self, tid: int, a: int, b: int, depth: int) -> list[Part]:
        """[a, b) of a thread that existed throughout it: up to its last hand-off (``_handoff``), the time
        of the task that handed it what it waited for; after it, its own."""
        if b <= a:
            return []
        if not self.traced(tid):
            return [Part("unknown", b - a, empty_culprit(), extra={"why": f"tid {tid} was not traced"})]
        parts: list[Part] = []
        while True:
            handoff = self._handoff(tid, a, b, depth)
            if handoff is None:
                return parts + self._explain_own(tid, a, b, depth)
            start, sc, o = handoff
            parts += self._explain_own(tid, o.wake_ns, b, depth)
            if self._handing and self._handing[-1] == (o.waker_tid, depth - 1):
                self._resume = o.wake_ns  # a round trip: the thread that asked goes on from its request
                return parts
            followed, resume = self._follow_handoff(sc, o, start, depth)
            parts += followed
            if resume is None:
                return parts + self._explain_own(tid, a, start, depth)
            b = resume

    def _follow_handoff(self, sc: Syscall, o: OffCpu, start: int, depth: int) -> tuple[list[Part], int | None]:
        """Follow the hand-off ``sc`` (woken by ``o``) over [start, its wakeup) on the waker's chain; where the
        waker's own last hand-off came from this thread (a round trip: a request, then its answer), the part
        of the window before that request is given back (``_resume``): returned with the parts, for this
        thread to go on from there.

        Round trips are walked as a loop here, not as hops: PyTorch hands a batch's tensors over through
        ``multiprocessing.resource_sharer``, several socket round trips per tensor (authentication, the key,
        the fd), each answered by a worker thread that must first win the worker's GIL. Followed as hops, a
        batch of a few tensors is dozens of them, past any fixed depth, and the work the batch waited for
        (the worker's own) is never reached. Each round trip ends strictly before the one it answered, so
        the loop ends at the window's start; the depth still bounds chains through distinct threads."""
        self._handing.append((sc.tid, depth))
        try:
            parts = self._follow(sc, o, start, o.wake_ns, depth)
            resume, self._resume = self._resume, None
        finally:
            self._handing.pop()
        return parts, (resume if resume is not None and start <= resume < o.wake_ns else None)

    def _handoff(self, tid: int, a: int, b: int, depth: int) -> tuple[int, Syscall, OffCpu] | None:
        """The last wait of ``tid`` in [a, b) on a pipe or socket that another traced task ended, as (from
        when its waker's chain explains the thread's time, the call, its off-CPU span woken by that task).

        The thread could not go on before that task handed it something: what it did before then did not
        decide when that came, the waker's chain did (the critical path). So the window up to that wakeup
        is explained on the waker's chain (``_follow``), back to ``a`` or to the end of the thread's last
        CUDA API call before it (a launch used what came before), not on what the thread did meanwhile.
        PyTorch's DataLoader: workers share one result queue, and a batch that arrives ahead of its turn
        (a fast worker's, while the trainer waits for a slow one's) is unpickled, its tensors' fds fetched
        from that worker (a wait of its own, long where that worker's main thread holds its GIL), and kept
        for later: the trainer's stall is the slow worker's, not the fast one's. Where the waker had first
        waited for this thread (asked only once it answered), the chain comes back to the thread and goes
        on from there. A futex wait is a hand-off only where it passed a delivery on (``_relayed``: a
        pin-memory thread's queue); a lock handed over, the GIL above all, delivers nothing. Nor is a wake by a
        kernel task, an untraced task or a timeout: those waits keep the rules below."""
        sys_index = self.cap.syscalls.get(tid)
        if sys_index is None or depth >= MAX_DEPTH:
            return None
        # a futex word other threads of the process wait on too (the GIL's) is a lock's, never a relay's
        calls = [sc for sc in sys_index.overlapping(a, b)
                 if _on_pipe_or_socket(sc) or sc.name in FUTEXES and len(self._futex_word(sc)[0]) == 1]
        for sc in reversed(calls):
            o = self._delivery(sc, a, b)
            if o is None or (sc.name in FUTEXES and not self._relayed(sc, o)):
                continue
            start = max(a, self._last_api_end(tid, a, o.start_ns))
            return (start, sc, o) if start < o.start_ns else None
        return None

    def _delivery(self, sc: Syscall, a: int, b: int) -> OffCpu | None:
        """The last off-CPU span of ``sc`` in [a, b) woken by another traced user task."""
        index = self.cap.offcpu.get(sc.tid)
        if index is None:
            return None
        woken = [o for o in index.overlapping(max(sc.start_ns, a), min(sc.end_ns, b))
                 if o.state != "R" and a < o.wake_ns <= b and o.waker_tid != sc.tid and self._by_task(o)]
        return woken[-1] if woken else None

    def _relayed(self, sc: Syscall, o: OffCpu) -> bool:
        """Whether the futex wait ``sc``, ended by ``o``'s wakeup, passed a delivery on: while this thread
        waited, its waker was handed something on a pipe or socket by a traced task, then woke it. That is a
        queue between threads (PyTorch's pin-memory thread takes each batch off the workers' queue and puts
        it on the trainer's ``queue.Queue``; a thread pool's future). A lock handed over is not: its holder
        took it before this thread waited. (A word other threads of the process wait on too, the GIL's, is
        not asked about: its holder may have been handed its data during the wait and taken the lock after.)"""
        index = self.cap.syscalls.get(o.waker_tid)
        return index is not None and any(
            _on_pipe_or_socket(c) and self._delivery(c, sc.start_ns, o.wake_ns) is not None
            for c in index.overlapping(sc.start_ns, o.wake_ns))

    def _futex_word(self, sc: Syscall) -> tuple[set[int], set[int]]:
        """The threads of ``sc``'s process that waited on its futex word in the capture, and those of them
        that timed out there."""
        if self._futex_words is None:
            self._futex_words = {}
            for index in self.cap.syscalls.values():
                for r in index.records:
                    if r.name in FUTEXES:
                        waited, timed_out = self._futex_words.setdefault((r.pid, r.arg), (set(), set()))
                        waited.add(r.tid)
                        if _timed_out(r):
                            timed_out.add(r.tid)
        return self._futex_words.get((sc.pid, sc.arg), (set(), set()))

    def _by_task(self, o: OffCpu) -> bool:
        """Whether ``o``'s wakeup came from a traced user task, whose time can be explained in turn."""
        return bool(o.waker_tid) and not is_kernel_task(o.waker_pid, o.waker_comm) and self.traced(o.waker_tid)

    def _last_api_end(self, tid: int, a: int, b: int) -> int:
        """The end of ``tid``'s last CUDA API call (a launch, a copy, a sync) that started in [a, b); 0 if none."""
        if self._api_index is None:
            self._api_index = {}
        calls = self._api_index.get(tid)
        if calls is None:  # a thread's calls gathered when first asked for: few threads are
            apis = self.cap.launches.values()
            calls = self._api_index[tid] = sorted(map(_API_TIMES, compress(apis, map(tid.__eq__, map(_TID, apis)))))
        i = bisect_left(calls, (b, -1)) - 1
        return calls[i][1] if i >= 0 and calls[i][0] >= a else 0

    def _explain_own(self, tid: int, a: int, b: int, depth: int) -> list[Part]:
        """[a, b) of a traced thread, call by call."""
        if b <= a:
            return []
        parts: list[Part] = []
        in_syscalls = 0
        sys_index = self.cap.syscalls.get(tid)
        for sc in sys_index.overlapping(a, b) if sys_index else ():
            x, y = max(sc.start_ns, a), min(sc.end_ns, b)
            in_syscalls += y - x
            parts.extend(self._syscall(sc, x, y, depth, b))
        outside = self._offcpu_outside_syscalls(tid, a, b, parts)
        on_cpu = (b - a) - in_syscalls - outside
        if on_cpu > 0 and "sched" in self.cap.off:  # no switches seen: running and waiting look alike
            parts.append(Part("unknown", on_cpu, empty_culprit(),
                              extra={"why": "the scheduler hooks were off (--off sched): time outside system calls "
                                            "cannot be told running from waiting"}))  # fmt: skip
        elif on_cpu > 0:
            parts.append(Part("cpu", on_cpu, self.cpu_culprit(tid, a, b)))
        return [p for p in parts if p.ns > 0]

    def _offcpu_outside_syscalls(self, tid: int, a: int, b: int, parts: list[Part]) -> int:
        index, sys_index = self.cap.offcpu.get(tid), self.cap.syscalls.get(tid)
        total = 0
        for o in index.overlapping(a, b) if index else ():
            x, y = max(o.start_ns, a), min(o.end_ns, b)
            inside = sys_index.overlapping(x, y) if sys_index else ()
            ns = (y - x) - sum(min(s.end_ns, y) - max(s.start_ns, x) for s in inside)
            if ns <= 0:
                continue
            total += ns
            if o.state == "R":
                parts += self._runqueue(tid, "preempted", [(o, x, y)], ns)
            else:  # blocked outside any recorded syscall (a page fault, a short call under the threshold)
                parts.append(self._dirty_sleep(o, ns) or Part("unknown", ns, empty_culprit(),
                                                               evidence=[evidence_offcpu(o)]))
        return total

    def _runqueue(self, tid: int, what: str, waits: list[tuple[OffCpu, int, int]], ns: int) -> list[Part]:
        """``ns`` of ``tid``'s waits for a CPU [(off-CPU span, a, b)]: what its cpu cgroup's quota held it off
        (``cpu.throttled``, analysis/throttle.py), and the rest ``cpu.runqueue``, with who had the CPU."""
        cut = self.throttles.split(tid, waits)
        throttled = min(cut.ns, ns)
        parts = []
        if throttled > 0:
            culprit: Culprit = {**self.culprit(tid, "throttled by its cgroup's CPU quota"), **cut.fields}
            culprit["throttled_ns"] = throttled
            parts.append(Part("cpu.throttled", throttled, culprit, evidence=cut.evidence[:MAX_EVIDENCE]))
        held = _cpu_holders(cut.rest)
        ours = min(ns - throttled, sum(n for (pid, _, _), n in held.items() if pid == self.tracer_pid))
        if ours > 0:  # the capturing process had the CPU: the tool's cost, not the job's
            culprit = {**self.culprit(tid, "cpu"), "pid": self.tracer_pid, "tid": 0, "comm": "gputrace",
                       "object": "gputrace session: held the CPU the job waited for"}  # fmt: skip
            parts.append(Part("tracing", ours, culprit, evidence=[evidence_offcpu(o) for o, _, _ in waits[:2]]))
            held = Counter({k: n for k, n in held.items() if k[0] != self.tracer_pid})
        if ns > throttled + ours:
            parts.append(Part("cpu.runqueue", ns - throttled - ours, self.culprit(tid, what),
                              evidence=[evidence_offcpu(o) for o, _, _ in waits[:MAX_EVIDENCE]], held=held))
        return parts

    def _dirty_sleep(self, o: OffCpu, ns: int) -> Part | None:
        """A sleep outside any recorded call that a pause for dirty pages began (a store to a shared file
        mapping dirtied the page in a fault): ``storage`` on the device, named by the pause."""
        index = self.cap.dirty.get(o.tid)
        pauses: list[DirtyPause] = index.starting_in(o.start_ns - PAUSE_SLEEP_NS, o.start_ns) if index else []
        if not pauses:
            return None
        p = pauses[-1]
        fields, paused = _paused([p], [o], o.end_ns)
        culprit: Culprit = {**self.culprit(o.tid, DIRTY_OP, p.dev, 0, o.end_ns - p.ts), **fields}
        return Part("storage", ns, culprit, evidence=[*paused, evidence_offcpu(o)])

    def _syscall(self, sc: Syscall, x: int, y: int, depth: int, end: int) -> list[Part]:
        kind = "sync" if self._in_gpu_sync(sc.tid, x, y) else classify(sc)
        requests: list[IoUringRequest] = []
        if kind == "uring":  # named by the ring's requests it waited for; none that names a file or peer: a wait
            requests = uring.waited_for(self.cap.uring.get(sc.pid), sc)
            kind = (uring.kind_of(requests[-1]) if requests else "") or "wait"
        offs = list(self.cap.offcpu[sc.tid].overlapping(x, y)) if sc.tid in self.cap.offcpu else []
        preempted = [o for o in offs if o.state == "R"]
        runq = sum(min(o.end_ns, y) - max(o.start_ns, x) for o in preempted)
        parts = self._runqueue(sc.tid, "preempted", [(o, x, y) for o in preempted], runq) if runq > 0 else []
        blocked = [o for o in offs if o.state != "R"]
        deadline = _sleep_deadline(sc) if kind == "sleep" else None
        due = deadline + TIMER_LATE_NS if deadline is not None else 0
        filled: set[int] = set()  # id() of the spans woken when due
        if deadline is not None:
            woken_due = [_woken_when_due(o, due) for o in blocked]
            filled = {id(o) for o, was in zip(woken_due, blocked, strict=True) if o is not was}
            blocked = woken_due
        ns = (y - x) - runq
        if kind == "wait":
            return parts + self._wait(sc, x, y, blocked, ns, depth, end)
        if kind == "sync":
            late_signal = self._late_completion(sc, x, y, blocked, depth)
            done = self._device_done(self.cap.pid_of(sc.tid), y)
            if done is not None and (unseen := _unseen(offs, max(done, x), y)) > UNSEEN_SYNC_NS:
                # the device was done, and no off-CPU record shows the thread (a switch the kernel did not
                # report): a sync past its device's end does not wait for the device
                late_signal.append(Part("unknown", unseen, empty_culprit(), evidence=[evidence_syscall(sc)],
                                        extra=self._no_sched_why() or {"why": UNSEEN_SYNC_WHY}))
            parts += late_signal
            ns -= sum(p.ns for p in late_signal)
        # woken (the disk answered, the sleep ended) but no CPU to run on yet: that part is the run queue's
        late = [(o, max(o.wake_ns, x), min(o.end_ns, y)) for o in blocked if o.wake_ns]
        woken = 0
        for inferred in (False, True):
            waits = [w for w in late if w[2] > w[1] and (id(w[0]) in filled) == inferred]
            if waits:
                n = sum(b - a for _, a, b in waits)
                woken += n
                more = self._runqueue(sc.tid, "woken, waiting for a CPU", waits, n)
                parts += self._past_deadline(sc, deadline, more) if inferred and deadline is not None else more
        if deadline is not None and (unseen := _unseen(offs, max(due, x), y)) > TIMER_LATE_NS:
            # past its deadline, no off-CPU record shows the thread (a switch the kernel did not report, a virtual
            # CPU the host held): a sleeping thread is off its CPU, and back from its sleep it only returns (less
            # than TIMER_LATE_NS, left to the sleep)
            woken += unseen
            parts += self._past_deadline(sc, deadline, [Part("cpu.runqueue", unseen,
                                                             self.culprit(sc.tid, "woken, waiting for a CPU"))])
        if requests:
            return parts + [self._request(kind, sc, requests, ns - woken, blocked)]
        return parts + [self._direct(kind, sc, ns - woken, blocked)]

    @staticmethod
    def _past_deadline(sc: Syscall, deadline: int, parts: list[Part]) -> list[Part]:
        """``parts``, the waits for a CPU past a sleep's deadline (or a poll's timeout) that no record showed as
        such, with the call as their first evidence and why they are not the sleep's (the wait's)."""
        why = (f"{sc.name} returned {(sc.end_ns - deadline) / 1e6:.1f} ms past its deadline, no wakeup recorded: "
               f"the time past it is taken as a wait for a CPU, not the {'sleep' if sc.name in SLEEP else 'wait'}")
        for p in parts:
            p.evidence.insert(0, evidence_syscall(sc))
            p.extra.setdefault("why", why)
        return parts

    def _late_completion(self, sc: Syscall, x: int, y: int, blocked: list[OffCpu], depth: int) -> list[Part]:
        """A GPU sync still blocked after the device finished everything it had started: the wait past
        that point is for the thread that delivers the completion. Where that thread is a traced user
        thread (a simulated device's stream thread, a runtime's helper), its time is followed as a wait's,
        and what its chain cannot explain is ``unknown`` (not the GPU's: it was done); so is a timed-out
        wait for a lock whose holder is not known. A wake from an interrupt or the driver stays ``sync``."""
        parts: list[Part] = []
        pid = self.cap.pid_of(sc.tid)
        for o in blocked:
            o = _timer_woken(sc, o)
            if not o.wake_ns or o.waker_tid == sc.tid:
                continue
            by_task = self._by_task(o)
            if not by_task and not _expired(sc, o):
                continue
            done = self._device_done(pid, o.wake_ns)
            if done is None:
                continue
            lx, ly = max(o.start_ns, x, done), min(o.wake_ns, o.end_ns, y)
            if ly <= lx:
                continue
            # the device was done: what the chain cannot explain is unknown, not the GPU's
            if by_task:
                parts.extend(self._follow(sc, o, lx, ly, depth))
            else:  # a timed-out wait for a lock once the device was done: the interpreter's, held by another thread
                parts.extend(self._held(sc, o, lx, ly, depth) or [
                    Part("unknown", ly - lx, empty_culprit(), evidence=[evidence_syscall(sc), evidence_offcpu(o)],
                         extra={"why": LOCK_HOLDER_WHY})])
        return parts

    def _device_done(self, pid: int, t: int) -> int | None:
        """When the devices ``pid`` uses had finished every operation started before ``t``; None where one
        was still running at ``t`` or none had started."""
        if self._done_index is None:
            self._done_index = {}
            for (owner, _dev), ops in self.cap.ops.items():
                starts, ends, top = [], [], 0
                for op in ops:  # sorted by start: the running maximum of the ends
                    top = max(top, op.end_ns)
                    starts.append(op.start_ns)
                    ends.append(top)
                self._done_index.setdefault(owner, []).append((starts, ends))
        done = None
        for starts, ends in self._done_index.get(pid, []) + self._done_index.get(-1, []):
            i = bisect_left(starts, t)
            if i == 0:
                continue
            if ends[i - 1] >= t:
                return None
            done = max(done or 0, ends[i - 1])
        return done

    def _in_gpu_sync(self, tid: int, x: int, y: int) -> bool:
        index = self.cap.syncs.get(tid)
        return index is not None and bool(index.overlapping(x, y))

    def _direct(self, kind: str, sc: Syscall, ns: int, blocked: list[OffCpu]) -> Part:
        ev = [evidence_syscall(sc)]
        dur = sc.end_ns - sc.start_ns
        if kind == "storage":
            return self._storage(sc, ns, blocked)
        if kind == "network":
            return Part("network", ns, self.culprit(sc.tid, sc.name, sc.obj, sc.nbytes, dur), evidence=ev)
        if kind == "sleep":
            return Part("sleep", ns, self.culprit(sc.tid, sc.name, "", 0, dur), evidence=ev)
        if kind in ("sync", "gpu"):
            return Part("sync", ns, self.culprit(sc.tid, sc.name, "", 0, dur), evidence=ev)
        if blocked or "sched" in self.cap.off:  # blocked (or maybe) in a call we cannot interpret: say so
            return Part("unknown", ns, empty_culprit(), evidence=ev, extra=self._no_sched_why())
        return Part("cpu", ns, self.cpu_culprit(sc.tid, sc.start_ns, sc.end_ns), evidence=ev)

    def _request(self, kind: str, sc: Syscall, requests: list[IoUringRequest], ns: int,
                 blocked: list[OffCpu]) -> Part:
        """A wait in io_uring_enter ``sc``, named by the last of the ring's ``requests`` to complete in it: its
        file (``storage``, with the block requests under it) or peer (``network``)."""
        req = uring.as_call(requests[-1])
        if kind == "storage":
            part = self._storage(req, ns, blocked)
        else:
            part = Part("network", ns, self.culprit(req.tid, req.name, req.obj, req.nbytes, req.end_ns - req.start_ns),
                        evidence=[evidence_syscall(req)])
        part.culprit = {**part.culprit, **uring.culprit_fields(requests)}
        part.evidence = [evidence_syscall(sc), *part.evidence][: MAX_EVIDENCE + 1]
        return part

    def _storage(self, sc: Syscall, ns: int, blocked: list[OffCpu]) -> Part:
        tie = self.ties.for_request(sc) if uring.is_request(sc) else self.ties.for_syscall(sc)
        culprit = self.culprit(sc.tid, sc.name, sc.obj, sc.nbytes, sc.end_ns - sc.start_ns)
        ev = [evidence_syscall(sc)]
        dirty, paused = self._dirty_pauses(sc, blocked)
        if dirty:
            culprit = {**culprit, **dirty}
            ev += paused[:MAX_DIRTY_EVIDENCE]
        if tie is not None:
            ev += [evidence_block(b) for b in tie.blocks[:MAX_EVIDENCE]]
            culprit = {**culprit, **self._block_fields(tie, sc.tid)}
        if sc.name == FAULT_OP:  # what the fault brought in is what its requests read
            culprit["offset"] = sc.arg
            culprit["bytes"] = sum(b.nbytes for b in tie.blocks) if tie else 0
        blocks = tie.blocks if tie else []
        extra: PartExtra = {}
        fstype = self._filesystem(sc.obj) if sc.obj else ""
        servers = [o for o in blocked if o.waker_pid and o.waker_pid != sc.pid
                   and not is_kernel_task(o.waker_pid, o.waker_comm)]
        if servers and not blocks:
            # a user-space process answered the read: a FUSE daemon (or a network filesystem's helper)
            s = servers[-1]
            culprit["served_by"] = {"pid": s.waker_pid, "tid": s.waker_tid, "comm": s.waker_comm}
            ev.append(evidence_offcpu(s, "wakeup"))
            fstype = fstype if is_remote_fs(fstype) else "fuse"
        if fstype:
            culprit["filesystem"] = fstype
            extra["remote_fs"] = is_remote_fs(fstype)
        return Part("storage", ns, culprit, evidence=ev, extra=extra)

    def _dirty_pauses(self, sc: Syscall, blocked: list[OffCpu]) -> tuple[DirtyFields, list[Evidence]]:
        """The pauses the kernel put ``sc``'s thread in for dirtying page cache faster than its device writes it
        back (balance_dirty_pages), inside the call: culprit fields and evidence. Each pause's time is the
        off-CPU span it began (the kernel's own figure where none was recorded), up to the call's end; the
        device and its dirty pages are the last pause's."""
        index = self.cap.dirty.get(sc.tid)
        pauses: list[DirtyPause] = index.starting_in(sc.start_ns, sc.end_ns) if index else []
        return _paused(pauses, blocked, sc.end_ns) if pauses else ({}, [])

    def _filesystem(self, path: str) -> str:
        """``filesystem_of`` the capture's mounts, once a path."""
        fstype = self._fstypes.get(path)
        if fstype is None:
            fstype = self._fstypes[path] = filesystem_of(path, self.mounts)
        return fstype

    def _block_fields(self, tie: Tie, tid: int) -> BlockFields:
        blocks = tie.blocks
        out: BlockFields = {"block_requests": len(blocks), "block_bytes": sum(b.nbytes for b in blocks),
                               "block_device": blocks[0].dev,
                               "block_latency_ns": max(b.complete_ns - b.issue_ns for b in blocks),
                               "block_attribution": tie.how}
        if tie.how == "dispatched":
            out["dispatched_by"] = ", ".join(sorted({b.comm for b in blocks if b.tid != tid}))
            out["block_shared"] = bool(tie.shared_with)
            if tie.shared_with:
                out["block_shared_with"] = sorted({self.cap.pid_of(t) or t for t in tie.shared_with})
        return out

    def _wait(self, sc: Syscall, x: int, y: int, blocked: list[OffCpu], ns: int, depth: int,
              end: int) -> list[Part]:
        """Blocked on a futex / pipe / poll: the time belongs to whoever the thread waited for."""
        parts: list[Part] = []
        used = 0
        due = _poll_due(sc)  # a poll that timed out: asleep past its timeout with no wakeup recorded, woken then
        for seen in blocked:
            o = _timer_woken(sc, _woken_when_due(seen, due) if due is not None else seen)
            ox, oy = max(o.start_ns, x), min(o.end_ns, y)
            woke = min(max(o.wake_ns, ox), oy) if o.wake_ns else oy  # woken before the window: from its start
            wait_ns = max(woke - ox, 0)
            if wait_ns > 0 and _expired(sc, o) and o.wake_ns and is_kernel_task(o.waker_pid, o.waker_comm):
                parts.extend(self._timed_wait(sc, o, ox, woke, depth, end))
            elif wait_ns > 0:
                parts.extend(self._follow(sc, o, ox, woke, depth))
            if oy > woke:  # woken but not yet running
                waits = self._runqueue(sc.tid, "woken, waiting for a CPU", [(o, woke, oy)], oy - woke)
                if due is not None and o.wake_ns == due and not seen.wake_ns:  # that wakeup inferred
                    waits = self._past_deadline(sc, sc.start_ns + sc.arg * 1_000_000, waits)
                parts += waits
            used += oy - ox
        rest = ns - used
        if rest > 0:
            if blocked:  # on CPU inside the call around the recorded blocking
                parts.append(Part("cpu", rest, self.cpu_culprit(sc.tid, x, y), evidence=[evidence_syscall(sc)]))
            else:  # no off-CPU record tells who ended this wait
                parts.append(Part("unknown", rest, empty_culprit(), evidence=[evidence_syscall(sc)],
                                  extra=self._no_sched_why() or {"why": NO_OFFCPU_WHY}))
        return parts

    def _timed_wait(self, sc: Syscall, o: OffCpu, x: int, y: int, depth: int, end: int) -> list[Part]:
        """A wait that ended by its own timeout (queue.get(timeout=...), a lock's or the GIL's timed wait,
        an event loop's timer). When the thread waits again before ``end`` and that wait is ended by a
        task, the thread was polling for that task: the timed-out time is followed to it as well. When
        nothing ends a later wait, the timeout itself ended the wait: a ``sleep``."""
        later = self._next_woken_wait(sc, end)
        if later is not None and not self._shared_lock(sc):
            return self._follow(*later, x, y, depth)
        ev = [evidence_syscall(sc), evidence_offcpu(o, "wakeup")]
        held = self._held(sc, o, x, y, depth)
        if held:
            return held
        if later is not None:
            return self._follow(*later, x, y, depth)
        if depth == 0 and sc.name in POLLS:  # an event loop's timer (asyncio.sleep) on the launching thread
            dur = sc.end_ns - sc.start_ns
            return [Part("sleep", y - x, self.culprit(sc.tid, sc.name, "", 0, dur), evidence=ev,
                         extra={"why": f"{sc.name} timed out"})]
        # A futex timeout alone says nothing: a timed sleep, or a lock's or the GIL's timed wait whose
        # holder let go while this thread was on its way back
        return [Part("unknown", y - x, empty_culprit(), evidence=ev, extra=self._no_sched_why())]

    def _no_sched_why(self) -> PartExtra:
        """Why a wait's end is not known, where the capture ran without the scheduler hooks (their wakeups
        name who ended a wait); nothing otherwise."""
        if "sched" not in self.cap.off:
            return {}
        return {"why": "the scheduler hooks were off (--off sched): who ended the wait is not known"}

    def _shared_lock(self, sc: Syscall) -> bool:
        """Whether ``sc`` is a futex wait on a word that several threads of its process waited on and timed
        out: a lock all of them take, as the GIL is (a queue's timed wait uses a lock of its own each time).
        Its holder then comes before the thread's next woken wait, which may be another thread's hand-over
        of that lock rather than what ended the wait."""
        return sc.name == "futex" and len(self._futex_word(sc)[1]) > 1

    def _held(self, sc: Syscall, o: OffCpu, x: int, y: int, depth: int) -> list[Part]:
        """[x, y) of a futex wait that timed out, explained on the thread that held the interpreter's lock
        (``_gil_holder``); [] where none is known."""
        holder = self._gil_holder(sc, x, y) if sc.name == "futex" and depth < MAX_DEPTH else None
        if holder is None:
            return []
        ev = [evidence_syscall(sc), evidence_offcpu(o, "wakeup")]
        inner = self.explain(holder, x, y, depth + 1)
        for p in inner:
            p.via, p.path = [f"gil:tid {holder}", *p.via], [holder, *p.path]
            p.evidence = (ev + p.evidence)[: MAX_EVIDENCE * 2]
        return inner

    def _gil_holder(self, sc: Syscall, x: int, y: int) -> int | None:
        """The thread that kept the interpreter's global lock over a timed-out wait: Python's GIL wait is a
        futex with a timeout (the switch interval, 5 ms), and the holder lets go when asked without any wait
        long enough to record. In a process running such an interpreter, the one other thread of the process
        that ran or was runnable through ``GIL_RUNNING`` of [x, y) is taken as the holder; none, or several,
        name nobody. Of several, one that waited through ``GIL_RUNNING`` of [x, y) for the CPU another of them
        had (preempted, or woken and kept off its CPU, ``held_tid`` that one) is set aside: the lock's holder is
        the thread that ran, or the one that ran runs without the lock."""
        pid = sc.pid
        if pid not in self.cap.gil_pids:
            return None
        if self._threads is None:
            self._threads = {}
            for tid, owner in self.cap.tgid.items():
                self._threads.setdefault(owner, []).append(tid)
        running = [t for t in self._threads.get(pid, ()) if t != sc.tid and self.traced(t)
                   and self._may_hold_gil(t, sc) and self._unblocked_ns(t, x, y) >= GIL_RUNNING * (y - x)]
        if len(running) > 1:
            running = [t for t in running if self._behind_ns(t, set(running) - {t}, x, y) < GIL_RUNNING * (y - x)]
        return running[0] if len(running) == 1 else None

    def _behind_ns(self, tid: int, others: set[int], x: int, y: int) -> int:
        """How long in [x, y) ``tid`` waited for a CPU that one of ``others`` had: its preempted spans, and the
        time from its wakeups on, whose ``held_tid`` is one of them."""
        index = self.cap.offcpu.get(tid)
        total = 0
        for o in index.overlapping(x, y) if index is not None else ():
            if o.held_tid in others and runnable_wait(o):
                a = o.start_ns if o.state == "R" else o.wake_ns
                total += max(min(o.end_ns, y) - max(a, x), 0)
        return total

    def _may_hold_gil(self, tid: int, waiter: Syscall) -> bool:
        """Whether ``tid`` can be the holder of the lock ``waiter`` timed out on. Only a thread that runs Python
        takes the GIL: an agent's thread does (its time is then the tracing's); a thread that waited on a
        word ``waiter``'s thread timed out on, or woke a waiter there (it let go of that lock), is one of the
        lock's takers; so is one sampled in the interpreter. A thread a native library named (CUDA's), or
        one sampled only outside the interpreter, never runs Python. A thread nothing tells about (too fast
        to record a wait, never sampled) is not ruled out: the one thread that ran through the wait held it."""
        if tid in self.cap.agent_threads or tid in self._lock_takers(waiter):
            return True
        if self.cap.comm(tid).startswith(NATIVE_THREADS):
            return False
        return self._in_interpreter(tid) is not False

    def _lock_takers(self, waiter: Syscall) -> set[int]:
        """The threads that waited on, or woke a waiter of, a futex word that ``waiter``'s thread timed out on
        in the capture (the GIL's condition alternates between two words, both taken by the same threads)."""
        self._futex_word(waiter)  # builds the index
        assert self._futex_words is not None
        takers: set[int] = set()
        for (pid, word), (waited, timed_out) in self._futex_words.items():
            if pid == waiter.pid and waiter.tid in timed_out:
                takers |= waited | self._wakers_of(pid, word)
        return takers

    def _wakers_of(self, pid: int, word: int) -> set[int]:
        """Threads of ``pid`` that woke a thread out of a futex wait on ``word``."""
        if self._lock_wakers is None:
            self._lock_wakers = {}
            for index in self.cap.syscalls.values():
                for r in index.records:
                    if r.name in FUTEXES and r.tid in self.cap.offcpu:
                        woken = self._lock_wakers.setdefault((r.pid, r.arg), set())
                        woken.update(o.waker_tid for o in self.cap.offcpu[r.tid].overlapping(r.start_ns, r.end_ns)
                                     if o.wake_ns and o.waker_pid == r.pid and o.waker_tid != r.tid)
        return self._lock_wakers.get((pid, word), set())

    def _in_interpreter(self, tid: int) -> bool | None:
        """Whether ``tid``'s CPU samples show it in the interpreter (a frame in python/libpython); False where
        at least NATIVE_SAMPLES of them name modules and none the interpreter; None where that says nothing."""
        if tid not in self._interpreted:
            index, pid = self.cap.samples.get(tid), self.cap.pid_of(tid)
            kinds = Counter(_frames_kind(self.cap.stacks.get((pid, stack), [])) for stack in index.stacks) \
                if index else Counter()
            self._interpreted[tid] = True if kinds["python"] else False if kinds["native"] >= NATIVE_SAMPLES else None
        return self._interpreted[tid]

    def _agent_thread(self, tid: int, role: str, a: int, b: int) -> list[Part]:
        """[a, b) of an agent's thread: the tracing's, but for what its cgroup's CPU quota held it off (the
        job's own threads there would have been held as well: the quota is the cause, not the agent)."""
        if b <= a:
            return []
        index = self.cap.offcpu.get(tid)
        waits = [(o, max(o.start_ns, a), min(o.end_ns, b)) for o in (index.overlapping(a, b) if index else ())
                 if runnable_wait(o)]
        cut = self.throttles.split(tid, waits) if waits else None
        if cut is None or cut.ns <= 0:
            return [self._tracing(tid, role, b - a)]
        culprit: Culprit = {**self.culprit(tid, "throttled by its cgroup's CPU quota"), **cut.fields,
                            "throttled_ns": cut.ns}
        parts = [Part("cpu.throttled", cut.ns, culprit, evidence=cut.evidence[:MAX_EVIDENCE])]
        return parts + ([self._tracing(tid, role, b - a - cut.ns)] if b - a > cut.ns else [])

    def _tracing(self, tid: int, role: str, ns: int) -> Part:
        """Time an agent's thread took in the target: gputrace's own, named by what the agent does there."""
        what = AGENT_WORK.get(role, f"gputrace agent: {role}")
        return Part("tracing", ns, self.culprit(tid, "agent", what))

    def _unblocked_ns(self, tid: int, x: int, y: int) -> int:
        """How long ``tid`` is known to have run or been runnable (preempted: a holder still holds) in
        [x, y): between the end of one of its off-CPU records (switched in) and the start of the next
        (switched out), and in its run-queue records. Before its first record and after its last, nothing is
        known: not counted. A window's capture holds only the records that reach it: where the thread has
        records before or after those (``offcpu_span``), they bound its time in the window as they would
        in the whole capture's (each ends before, or starts after, every time the window is asked about)."""
        index = self.cap.offcpu.get(tid)
        span = self.cap.offcpu_span.get(tid)

        def within(a: int, b: int) -> int:
            return max(min(b, y) - max(a, x), 0)

        recs = index.records if index is not None else []
        i = bisect_right(index.starts, x) - 1 if index is not None else -1
        if i < 0:
            if span is None or span[0] > x:
                return 0
            if not recs:  # switched out before the window and again after it, never within
                return within(x, y) if span[1] > x else 0
            i, total = 0, within(x, recs[0].start_ns)
            if recs[0].state == "R":
                total += within(recs[0].start_ns, recs[0].end_ns)
        else:
            total = within(recs[i].start_ns, recs[i].end_ns) if recs[i].state == "R" else 0
        while i < len(recs) - 1 and recs[i].end_ns < y:
            nxt = recs[i + 1]
            total += within(recs[i].end_ns, nxt.start_ns)
            if nxt.state == "R":
                total += within(nxt.start_ns, nxt.end_ns)
            i += 1
        if span is not None and i == len(recs) - 1 and recs[i].end_ns < y and span[1] > recs[i].start_ns:
            total += within(recs[i].end_ns, y)  # its next record starts after the window
        return total

    def _next_woken_wait(self, first: Syscall, end: int) -> tuple[Syscall, OffCpu] | None:
        """The first wait of the same call as ``first`` by its thread, starting in [its end, end), not
        ended by a timeout, with the off-CPU record whose wakeup by another task ended it; None when the
        next such wait was ended otherwise, or there is none."""
        tid = first.tid
        sys_index, off_index = self.cap.syscalls.get(tid), self.cap.offcpu.get(tid)
        if sys_index is None or off_index is None:
            return None
        for sc in sys_index.starting_in(first.end_ns, end):
            if sc.name != first.name or _timed_out(sc):
                continue
            woken = [o for o in off_index.overlapping(sc.start_ns, sc.end_ns) if o.state != "R" and o.wake_ns]
            o = woken[-1] if woken else None
            if o is None or not o.waker_tid or o.waker_tid == tid or is_kernel_task(o.waker_pid, o.waker_comm):
                return None
            return sc, o
        return None

    def _follow(self, sc: Syscall, o: OffCpu, x: int, y: int, depth: int) -> list[Part]:
        # Past the first hop the walk is inside a process a hop already named: a wake by another thread of
        # that same process names the thread (a worker's queue feeder woken by the worker's main thread)
        inside = depth > 0 and o.waker_pid and o.waker_pid == self.cap.pid_of(sc.tid)
        hop = f"wait:tid {o.waker_tid}" if inside else f"wait:pid {o.waker_pid}" if o.waker_pid else "wait"
        ev = [evidence_syscall(sc), evidence_offcpu(o, "wakeup")]
        waker = o.waker_tid
        if not waker or waker == sc.tid or depth >= MAX_DEPTH or is_kernel_task(o.waker_pid, o.waker_comm):
            extra: PartExtra = {"why": TOO_DEEP_WHY} if depth >= MAX_DEPTH else {}
            return [Part("unknown", y - x, empty_culprit(), via=[hop], path=[waker], evidence=ev, extra=extra)]
        inner = self.explain(waker, x, y, depth + 1)
        for p in inner:
            p.via, p.path = [hop, *p.via], [waker, *p.path]
            if sc.tid in p.path:  # the chain came back to this thread (the waker waited for it first): from there on
                k = len(p.path) - p.path[::-1].index(sc.tid)
                p.via, p.path = p.via[k:], p.path[k:]
                if depth == 0 and p.via and p.via[0].startswith("wait:tid "):  # the first hop names the process
                    p.via[0] = f"wait:pid {self.cap.pid_of(p.path[0])}"
            p.evidence = (ev + p.evidence)[: MAX_EVIDENCE * 2]
        return inner
