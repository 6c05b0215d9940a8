"""Leaving out what a non-root capture's owner may not see: a traced process that gained privileges the owner
lacks (setuid, setgid, setcap, not dumpable; the rule is gt_task_foreign in bpf/gputrace.h).

The kernel takes such a process out of the target set at its exec. What user space adds to the set or reads
from /proc on the kernel's word is checked here: a process already privileged when found, or one that exec'd
between the kernel's event and the read.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from gputrace import clock
from gputrace.probes import procfs
from gputrace.probes.ebpf_hooks import foreign
from gputrace.records import FdInfo, FileMap, ProcFork, ProcInfo, ProcLeftOut, SyscallAgg, ThreadInfo

# Records user space reads from /proc on the kernel's word: checked against the owner (see owned_records).
_FROM_PROC = (ProcInfo, ThreadInfo, FileMap, FdInfo)
LEFT_OUT_WHY = "they gained privileges you lack (setuid/setgid/setcap)"


class OwnerFilter:
    """For ``owner_uid`` (None: root, nothing left out): the pids left out, and the checks on what user space
    adds and reads. ``is_traced`` and ``untrace`` reach the eBPF source's target set."""

    def __init__(self, owner_uid: int | None, is_traced: Callable[[int], bool], untrace: Callable[[int], None]):
        self.owner_uid = owner_uid
        self.left_out: set[int] = set()  # pids left out (until a new traced process takes the pid)
        self.found_privileged = 0  # left out by user space: already privileged when found
        self.seen = 0  # left out by the kernel at their exec: its ProcLeftOut records read
        self._is_traced, self._untrace = is_traced, untrace

    def may_add(self, pid: int) -> bool:
        """Not a process of the owner's that gained privileges before it was found (the kernel's exec check
        sees only execs after it is in the set). Checked again once in the set (privileged_found): an exec in
        between is caught by one check or the other."""
        return self.owner_uid is None or not foreign(pid, self.owner_uid)

    def privileged_found(self, pids: list[int], added: list[int]) -> list[Any]:
        """Of ``pids``, those left out: found privileged (not ``added``), or privileged once added (out of the
        set again). One the kernel has already taken out of the set was left out at its exec and is counted
        there."""
        if self.owner_uid is None:
            return []
        out: list[Any] = []
        for p in pids:
            if (p in added and not self._is_traced(p)) or not Path(f"/proc/{p}").is_dir():
                continue  # left out at its exec and counted there, or gone
            if foreign(p, self.owner_uid):
                self._untrace(p)
                self.left_out.add(p)
                self.found_privileged += 1
                out.append(ProcLeftOut(clock.monotonic_ns(), p, p, procfs.comm(p), ""))
        return out

    def owned_records(self, records: list[Any]) -> list[Any]:
        """What user space read from /proc is kept only when its process is not left out and still the owner's
        once read: an exec may have come between the kernel's event and the read."""
        if self.owner_uid is None:
            return records
        owner, bad = self.owner_uid, set(self.left_out)
        for pid in {r.pid for r in records if isinstance(r, _FROM_PROC)} - bad:
            if foreign(pid, owner):
                bad.add(pid)
        return [r for r in records if not (isinstance(r, _FROM_PROC) and r.pid in bad)]

    def owned_aggregates(self, aggs: list[SyscallAgg]) -> list[SyscallAgg]:
        """A process left out is left out whole: even its short calls from before the exec."""
        return [a for a in aggs if a.pid not in self.left_out]

    def note(self, rec: Any) -> None:
        """Follow the kernel's process events: a pid left out, or taken by a new traced process."""
        if isinstance(rec, ProcLeftOut):
            self.left_out.add(rec.pid)
            self.seen += 1
        elif isinstance(rec, ProcFork) and not rec.is_thread:
            self.left_out.discard(rec.child_pid)
