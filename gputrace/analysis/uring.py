"""What a wait in io_uring_enter waited for: the ring's requests that completed while it waited.

A thread that reads through io_uring (liburing, fio-style engines, a Rust or C++ reader in an extension)
waits in ``io_uring_enter(..., min_complete, IORING_ENTER_GETEVENTS)``; the reads themselves run in the
kernel (inline, from an interrupt's completion, or in io-wq worker threads of the process). The eBPF source
records each request (``IoUringRequest``) with its file, as its fd named it at submission. The requests of
the waiting process, on the ring the call waited on, whose completion fell inside the call are what it waited
for; the last one to complete is the one that let it go. A completion is posted at or before the call
returns (by the worker before it wakes the waiter, or by the waiter itself running the completion's task
work once woken), so the call's end bounds it.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right

from gputrace.analysis.objects import object_kind
from gputrace.documents import UringFields
from gputrace.probes.ebpf import uring
from gputrace.records import IoUringRequest, Syscall

ENTER = "io_uring_enter"
OP_PREFIX = "io_uring "  # a request's op in a culprit: "io_uring read"
WORKER_COMMS = ("iou-wrk-", "iou-sqp-")  # the kernel threads of a process's rings (io-wq workers, SQPOLL)


class Completions:
    """One process's io_uring requests, sorted by completion, with a bisect index."""

    def __init__(self, requests: list[IoUringRequest]) -> None:
        requests.sort(key=lambda r: r.end_ns)
        self.requests = requests
        self.ends = [r.end_ns for r in requests]

    def completed_in(self, a: int, b: int) -> list[IoUringRequest]:
        """Requests whose completion lies in [a, b], earliest first."""
        return self.requests[bisect_left(self.ends, a) : bisect_right(self.ends, b)]


def waited_for(index: Completions | None, sc: Syscall) -> list[IoUringRequest]:
    """The requests an io_uring_enter call ``sc`` waited for: its process's, completed inside the call, on the
    ring it entered (a request submitted by the ring's SQPOLL thread names no ring: it counts for any)."""
    if index is None or sc.name != ENTER:
        return []
    return [r for r in index.completed_in(sc.start_ns, sc.end_ns)
            if r.ring_fd in (sc.fd, -1) and r.pid == sc.pid and not r.flags & uring.UNFINISHED]  # fmt: skip


def in_flight(index: Completions | None, tid: int) -> list[IoUringRequest]:
    """The requests a thread caught waiting in io_uring_enter at stop was waiting for: its process's requests
    (``index``) still in flight then, that it submitted (or the ring's SQPOLL thread did), oldest first."""
    if index is None:
        return []
    return sorted((r for r in index.requests if r.flags & uring.UNFINISHED
                   and (r.tid == tid or r.flags & uring.SQPOLL)), key=lambda r: r.start_ns)  # fmt: skip


def kind_of(req: IoUringRequest) -> str:
    """storage (a file), network (a peer), or "" when the request names nothing a wait could be blamed on (no
    file known: a registered file, a timeout, a pipe or eventfd another task fills)."""
    kind = object_kind(req.obj)
    if kind == "file":
        return "storage"
    if kind == "peer":
        return "network"
    return ""


def as_call(req: IoUringRequest) -> Syscall:
    """A request in the shape of a storage or network call: its op (``io_uring read``), window, file and bytes;
    ``arg`` carries the opcode."""
    return Syscall(req.pid, req.tid, OP_PREFIX + req.op.lower(), req.start_ns, req.end_ns, req.res, req.fd, req.obj,
                   req.nbytes, req.opcode)  # fmt: skip


def is_request(sc: Syscall) -> bool:
    return sc.name.startswith(OP_PREFIX)


def writes(sc: Syscall) -> bool:
    """Whether a request (from ``as_call``) writes: its block requests are writes."""
    return sc.name[len(OP_PREFIX) :].upper() in uring.WRITES


def is_ring_worker(comm: str) -> bool:
    return comm.startswith(WORKER_COMMS)


def culprit_fields(requests: list[IoUringRequest]) -> UringFields:
    """Extra culprit keys: how many of the ring's requests completed during the wait, and the named one's ring."""
    last = requests[-1]
    return {"io_uring_requests": len(requests), "ring_fd": last.ring_fd}
