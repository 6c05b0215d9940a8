"""Which block requests a storage syscall waited on.

Requests the calling thread submitted inside the call are its own: ``submitted``. A read whose bios were
held back by blk-throttle or io.max has none: a kernel worker dispatches them later (the eBPF source
records requests whoever submits them while a traced task waits in D). Then the candidates are the
requests on the path's block device, issued inside the call, in the call's direction, by submitters that
are not traced (kernel workers, other processes): ``dispatched``. A traced submitter's requests are its
own reads' and never move to another thread. When a candidate also falls inside another traced thread's
call on the same device, nothing says which of them it served: each keeps it, marked shared.

An io_uring request (``uring.as_call``) is tied the same way over its submission-to-completion window, on
its file's device: its own requests are those its submitting thread or the process's ring workers
(``iou-wrk-*``, ``iou-sqp-*``, which issue the reads a worker does) issued then.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field

from gputrace.analysis import uring
from gputrace.analysis.load import Capture
from gputrace.analysis.objects import MountTable, block_device_of, classify
from gputrace.records import BlockIO, Syscall

WRITE_OPS = frozenset({
    "write", "pwrite64", "writev", "pwritev", "pwritev2", "fsync", "fdatasync", "sync_file_range",
})  # fmt: skip


def _writes(sc: Syscall) -> bool:
    return uring.writes(sc) if uring.is_request(sc) else sc.name in WRITE_OPS


def _direction(b: BlockIO, write: bool) -> bool:
    """A request in a call's direction: a write or flush for a write, a read for a read."""
    return any(c in b.rwbs for c in (("W", "F") if write else ("R",)))


@dataclass
class Tie:
    blocks: list[BlockIO]
    how: str  # "submitted" or "dispatched"
    shared_with: list[int] = field(default_factory=list)  # tids of other traced calls a request overlaps


@dataclass
class _Calls:
    """Traced storage calls on one device, by start time."""

    calls: list[Syscall]
    starts: list[int]
    longest_ns: int


class BlockTies:
    def __init__(self, cap: Capture, mounts: MountTable) -> None:
        self.cap = cap
        self.mounts = mounts
        self._device: dict[str, str] = {}
        self._calls: dict[str, _Calls] | None = None

    def for_syscall(self, sc: Syscall) -> Tie | None:
        index = self.cap.blocks.get(sc.tid)
        own = index.starting_in(sc.start_ns, sc.end_ns) if index else []
        write = _writes(sc)
        if any(_direction(b, write) for b in own):
            return Tie(own, "submitted")
        dev = self.device(sc.obj)
        found = self._dispatched(sc, dev) if dev else []
        if not found:  # none in its direction: a read's own requests, or an fsync's metadata reads
            return Tie(own, "submitted") if own else None
        # an fsync that read some metadata itself while its writes sat in blk-throttle: both are its wait
        blocks = sorted(own + found, key=lambda b: b.issue_ns)
        return Tie(blocks, "dispatched", self._sharing(sc, dev, found))

    def for_request(self, req: Syscall) -> Tie | None:
        """The block requests under an io_uring request (as ``uring.as_call`` shapes it)."""
        dev = self.device(req.obj)
        if not dev:
            index = self.cap.blocks.get(req.tid)
            own = index.starting_in(req.start_ns, req.end_ns) if index else []
            return Tie(own, "submitted") if own else None
        on_dev = self.cap.blocks_by_dev[dev].starting_in(req.start_ns, req.end_ns)
        own = [b for b in on_dev if b.pid == req.pid and (b.tid == req.tid or uring.is_ring_worker(b.comm))]
        if own:
            return Tie(own, "submitted")
        found = self._dispatched(req, dev)
        return Tie(found, "dispatched", self._sharing(req, dev, found)) if found else None

    def device(self, path: str) -> str:
        """The name BlockIO records use for the device under ``path``; "" when none was seen."""
        if path not in self._device:
            names = block_device_of(path, self.mounts, self.cap.block_names) if path.startswith("/") else []
            self._device[path] = next((n for n in names if n in self.cap.blocks_by_dev), "")
        return self._device[path]

    def _dispatched(self, sc: Syscall, dev: str) -> list[BlockIO]:
        write = _writes(sc)
        traced = self.cap.kernel_pids
        return [b for b in self.cap.blocks_by_dev[dev].starting_in(sc.start_ns, sc.end_ns)
                if b.tid != sc.tid and b.pid not in traced and _direction(b, write)]  # fmt: skip

    def _sharing(self, sc: Syscall, dev: str, found: list[BlockIO]) -> list[int]:
        calls = self._calls_on(dev)
        if calls is None:
            return []
        others: set[int] = set()
        for b in found:
            i = bisect_right(calls.starts, b.issue_ns)
            while i > 0 and calls.starts[i - 1] >= b.issue_ns - calls.longest_ns:
                i -= 1
                c = calls.calls[i]
                if c.tid != sc.tid and c.end_ns >= b.issue_ns:
                    others.add(c.tid)
        return sorted(others)

    def _calls_on(self, dev: str) -> _Calls | None:
        if self._calls is None:
            self._calls = self._index_calls()
        return self._calls.get(dev)

    def _index_calls(self) -> dict[str, _Calls]:
        """Built once, and only when some read has dispatched requests: one pass over the syscalls."""
        by_dev: dict[str, list[Syscall]] = {}
        for index in self.cap.syscalls.values():
            for sc in index.records:
                if sc.obj.startswith("/") and classify(sc) == "storage" and (dev := self.device(sc.obj)):
                    by_dev.setdefault(dev, []).append(sc)
        for done in self.cap.uring.values():  # io_uring requests on files read (or write) too
            for r in done.requests:
                if r.obj.startswith("/") and (dev := self.device(r.obj)):
                    by_dev.setdefault(dev, []).append(uring.as_call(r))
        out: dict[str, _Calls] = {}
        for dev, calls in by_dev.items():
            calls.sort(key=lambda c: c.start_ns)
            longest = max(c.end_ns - c.start_ns for c in calls)
            out[dev] = _Calls(calls, [c.start_ns for c in calls], longest)
        return out
