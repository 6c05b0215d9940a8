"""Leaving out what a non-root capture's owner may not see: a traced process that gained privileges the owner
lacks (setuid, setgid, setcap, not dumpable; the rule is gt_task_foreign in bpf/gputrace.h).

The kernel takes such a process out of the target set at its exec, with the credential layout owner_cflags
gives it from BTF. What user space adds to the set or reads from /proc on the kernel's word is checked here
(foreign, the same rule from /proc): a process already privileged when found, or one that exec'd between the
kernel's event and the read.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from gputrace import clock
from gputrace.errors import UserError
from gputrace.probes import procfs
from gputrace.probes.ebpf.btf import VMLINUX, Btf, kernel_btf, struct_member
from gputrace.records import EpollEntry, FdInfo, FileMap, ProcFork, ProcInfo, ProcLeftOut, SyscallAgg, ThreadInfo

# Records user space reads from /proc on the kernel's word: checked against the owner (see owned_records).
_FROM_PROC = (ProcInfo, ThreadInfo, FileMap, FdInfo, EpollEntry)
LEFT_OUT_WHY = "they gained privileges you lack (setuid/setgid/setcap)"


# What gt_task_foreign (bpf/gputrace.h) reads to tell a task that gained privileges its owner lacks:
# (macro, struct, member, size in bytes). kuid_t/kgid_t are a struct of one u32; kernel_cap_t is a u64 (6.3+)
# or two u32 (before): either way its 8 bytes are 0 for no capability. mm_struct.flags (an unsigned long, or
# a bitmap from 6.18) holds the dumpable bits in its lowest byte on the little-endian machines we run on.
_CRED_FIELDS = (
    ("GT_TASK_REAL_CRED_OFF", "task_struct", "real_cred", 8),
    ("GT_TASK_MM_OFF", "task_struct", "mm", 8),
    ("GT_MM_FLAGS_OFF", "mm_struct", "flags", 8),
    *((f"GT_CRED_{m.upper()}_OFF", "cred", m, 4) for m in ("uid", "gid", "suid", "sgid", "euid", "egid",
                                                            "fsuid", "fsgid")),
    ("GT_CRED_CAP_PERMITTED_OFF", "cred", "cap_permitted", 8),
    ("GT_CRED_CAP_EFFECTIVE_OFF", "cred", "cap_effective", 8),
)


@functools.cache
def _cred_offsets() -> tuple[dict[str, int], str]:
    return cred_offsets(kernel_btf())


def cred_offsets(btf: Btf | None) -> tuple[dict[str, int], str]:
    """({macro: offset}, "") for gt_task_foreign, or ({}, what is missing) when BTF does not give every
    field with the size the program reads."""
    if btf is None:
        return {}, f"no readable BTF at {VMLINUX}"
    out: dict[str, int] = {}
    for macro, struct_name, member, size in _CRED_FIELDS:
        found = struct_member(struct_name, member, btf)
        if found is None or found[1] != size:
            got = "not found" if found is None else f"{found[1]} bytes, not {size}"
            return {}, f"{struct_name}.{member} {got} in the kernel's BTF"
        out[macro] = found[0]
    return out, ""


def owner_cflags(owner_uid: int | None, btf: Btf | None = None) -> list[str]:
    """-D flags compiling the privilege check for a non-root owner (none for root: nothing filtered). Without
    the kernel's layout the check cannot be made, and tracing unfiltered would show the owner what the kernel
    hides from it: a UserError, never a capture."""
    if owner_uid is None:
        return []
    offsets, why = cred_offsets(btf) if btf is not None else _cred_offsets()
    if why:
        raise UserError(f"cannot trace for uid {owner_uid}: leaving out processes that gain privileges (setuid, "
                        f"setcap) needs the kernel's credential layout, and {why}")
    return [f"-DGT_OWNER_UID={int(owner_uid)}U", *(f"-D{k}={v}" for k, v in offsets.items())]


def foreign(pid: int, owner_uid: int) -> bool:
    """User space's gt_task_foreign (bpf/gputrace.h), from /proc: any uid not the owner's, an effective, saved
    or fs gid not the real one, any permitted or effective capability, or not dumpable (the kernel then gives
    /proc/PID to root). True when it cannot be read: a process gone may have been anything."""
    try:
        owner = os.stat(f"/proc/{pid}").st_uid
        text = Path(f"/proc/{pid}/status").read_text(errors="replace")  # Name: any bytes
    except OSError:
        return True
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    try:
        uids = [int(x) for x in fields["Uid"].split()]
        gids = [int(x) for x in fields["Gid"].split()]
        caps = int(fields["CapPrm"], 16) | int(fields["CapEff"], 16)
    except (KeyError, ValueError):
        return True
    return owner != owner_uid or any(u != owner_uid for u in uids) or any(g != gids[0] for g in gids) or caps != 0


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
