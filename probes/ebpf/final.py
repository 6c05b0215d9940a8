"""What the eBPF source's kernel maps still hold when a capture stops: short-call totals, the threads
caught waiting and the io_uring requests still in flight. Each function takes the maps' contents (bcc
leaves) and returns what goes into the capture."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from gputrace.probes import procfs
from gputrace.probes.ebpf import events, uring
from gputrace.records import SyscallAgg


def unfinished(slots: list[Any], offcpu: dict[int, Any], pids: Iterable[int], since: dict[int, int], now: int,
               threshold_ns: int) -> list[bytes]:
    """Threads caught waiting at stop, as EV_UNFINISHED events: the call each is in (its in-flight slot)
    and the off-CPU span it has not ended. A thread blocked since before tracing began has neither: /proc
    says what it is blocked in, dated from when its process was first traced (``since``). Waits shorter
    than the threshold are left out."""
    calls = {v.tid: v for v in slots if v.tid}
    out = []
    for pid in sorted(pids):
        for tid in procfs.thread_ids(pid):
            c, o = calls.get(tid), offcpu.get(tid)
            state = o.state & 0xFF if o is not None else -1  # 0: preempted (R); -1: on CPU
            if c is not None:
                nr, a0, start, before = c.nr, c.args[0], c.ts, 0
            else:
                letter = procfs.thread_state(pid, tid)
                if o is None and letter not in ("S", "D"):
                    continue
                call = procfs.blocked_syscall(pid, tid) if letter in ("S", "D") else None
                nr, a0 = call if call is not None else (events.NO_CALL, 0)
                start = o.ts if o is not None else since.get(pid, now)
                before = int(call is not None)
                if o is None:
                    state = events.state_bits(letter)
            if now - start >= threshold_ns:
                out.append(events.SYS.pack(events.EV_UNFINISHED, nr, pid, tid, start, now, state, a0, before, 0))
    return out


def aggregates(agg: Iterable[tuple[Any, Any]], slots: list[Any], names: dict[int, str]) -> list[SyscallAgg]:
    """Short calls: the folded totals (the ``agg`` map) plus what each in-flight slot still holds."""
    totals: dict[tuple[int, int, int], list[int]] = {}
    for k, v in agg:
        t = totals.setdefault((k.pid, k.tid, k.nr), [0, 0])
        t[0] += v.count
        t[1] += v.total_ns
    for v in slots:
        if v.agg_count:
            t = totals.setdefault((v.agg_pid, v.agg_tid, v.agg_nr), [0, 0])
            t[0] += v.agg_count
            t[1] += v.agg_ns
    return [SyscallAgg(pid, tid, names.get(nr, f"syscall_{nr}"), n, ns)
            for (pid, tid, nr), (n, ns) in sorted(totals.items())]  # fmt: skip


def unfinished_requests(entries: Iterable[Any], pids: set[int], now: int, threshold_ns: int) -> tuple[list[bytes], int]:
    """io_uring requests of live traced processes still in flight at stop (the ``uring`` map's leaves), as
    EV_URING events ending at ``now``, flagged UNFINISHED, with res 0; those in flight less than the threshold
    are left out, as their completion would have been. The second value counts the requests submitted with
    IOSQE_CQE_SKIP_SUCCESS that are left out too: a successful one posts no completion, so its entry stays
    whether it is done or not."""
    out, unsure = [], 0
    for v in sorted(entries, key=lambda v: v.ts):
        if v.pid not in pids or now - v.ts < threshold_ns or v.ts > now:
            continue
        if v.flags & uring.SKIP_CQE:
            unsure += 1
            continue
        out.append(events.URING.pack(events.EV_URING, v.opcode, v.pid, v.tid, v.ts, now, v.fd, 0, v.ring_fd,
                                     v.flags | uring.UNFINISHED, v.user_data, 0, 0))  # fmt: skip
    return out, unsure
