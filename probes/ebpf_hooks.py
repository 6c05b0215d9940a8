"""Which kind of tracepoint each group of the eBPF source's programs hangs on, and attaching them.

Two groups choose between raw and classic tracepoints (docs/probes.md "Hooks"):
- syscalls: raw `sys_enter`/`sys_exit` (one program pair, arguments read from x86_64's pt_regs), or the
  classic per-syscall tracepoints;
- the scheduler and interrupt hooks (`sched_switch`, `sched_waking`, irq/softirq/hrtimer entry and exit):
  raw where BTF gives `task_struct.pid`'s offset, else classic. Classic programs share one per-CPU guard,
  so the kernel skips one that fires while another runs on the CPU; a raw program is only skipped when it
  nests in itself.
The other programs (process tree, file faults, block I/O) stay classic.
"""

from __future__ import annotations

import functools
import os
from pathlib import Path
from typing import Any

from gputrace.errors import UserError
from gputrace.probes.btf import VMLINUX, Btf, kernel_btf, struct_member, struct_offset
from gputrace.probes.ebpf_host import tracepoint_exists
from gputrace.probes.syscalls import (
    OTHER_TRACEPOINTS,
    RAW_PURPOSE,
    RAW_SCHED_ONLY,
    SCHED_TRACEPOINTS,
    SPECS,
    raw_syscalls_supported,
)

HOOKS = ("auto", "raw", "classic")


class RawAttachFailed(Exception):
    """The kernel refused a group's raw tracepoints: load again with the classic ones."""

    def __init__(self, group: str, why: str) -> None:
        super().__init__(why)
        self.group = group


def check_hook(group: str, want: str) -> None:
    if want not in HOOKS:
        raise UserError(f"unknown {group} hook {want!r} (one of: {', '.join(HOOKS)})")


def choose(group: str, want: str) -> tuple[str, str]:
    """(hook, why it is not raw) for `group` ("syscall" or "sched") given what was asked."""
    if want == "classic":
        return "classic", ""
    why = _raw_unsupported(group)
    if not why:
        return "raw", ""
    if want == "raw":
        raise UserError(f"raw {group} tracepoints are unsupported here ({why}): use classic")
    return "classic", why


def _raw_unsupported(group: str) -> str:
    if not raw_syscalls_supported():
        return "needs x86_64 and BPF raw tracepoints"
    if group == "sched" and (task_pid_offset() is None or task_tgid_offset() is None):
        return f"task_struct.pid/tgid not found in {VMLINUX}"
    return ""


@functools.cache
def _task_offsets() -> tuple[int | None, int | None]:
    """task_struct.pid's and .tgid's offsets in the running kernel: its BTF is parsed once and let go."""
    btf = kernel_btf()
    if btf is None:
        return None, None
    return struct_offset("task_struct", "pid", btf), struct_offset("task_struct", "tgid", btf)


def task_pid_offset() -> int | None:
    return _task_offsets()[0]


def task_tgid_offset() -> int | None:
    return _task_offsets()[1]


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
        text = Path(f"/proc/{pid}/status").read_text()
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


def cflags(syscall_hook: str, sched_hook: str) -> list[str]:
    flags = [f"-DGT_RAW_SYSCALLS={int(syscall_hook == 'raw')}", f"-DGT_RAW_SCHED={int(sched_hook == 'raw')}"]
    if sched_hook == "raw":
        flags += [f"-DGT_TASK_PID_OFF={task_pid_offset()}", f"-DGT_TASK_TGID_OFF={task_tgid_offset()}"]
    return flags


def wanted_tracepoints(syscall_hook: str | None = None, sched_hook: str | None = None) -> list[tuple[str, str, str]]:
    """(category, name, purpose) of every tracepoint the eBPF source attaches with these hooks ("raw" or
    "classic"; None: what this machine would use)."""
    if syscall_hook is None:
        syscall_hook = "raw" if not _raw_unsupported("syscall") else "classic"
    if sched_hook is None:
        sched_hook = "raw" if not _raw_unsupported("sched") else "classic"
    out = list(OTHER_TRACEPOINTS) + list(SCHED_TRACEPOINTS)
    if sched_hook == "raw":
        out += RAW_SCHED_ONLY
    if syscall_hook == "raw":
        out += [("raw_syscalls", "sys_enter", RAW_PURPOSE), ("raw_syscalls", "sys_exit", RAW_PURPOSE)]
        return out
    for s in SPECS:
        out.append(("syscalls", f"sys_enter_{s.name}", s.purpose))
        out.append(("syscalls", f"sys_exit_{s.name}", s.purpose))
    return out


def first_line(e: Exception) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def attach_syscalls(bpf: Any, hook: str, want: str, names: list[str]) -> tuple[list[str], list[str]]:
    """Attach the syscall programs for `names`; (attached, missing tracepoints)."""
    if hook == "raw":
        _attach_raw(bpf, "syscall", want, [("sys_enter", "gt_sys_enter"), ("sys_exit", "gt_sys_exit")])
        return list(names), []
    attached, missing = [], []
    for name in names:
        enter, exit_ = f"sys_enter_{name}", f"sys_exit_{name}"
        if not (tracepoint_exists("syscalls", enter) and tracepoint_exists("syscalls", exit_)):
            missing.append(f"syscalls:{enter}")
            continue
        bpf.attach_tracepoint(tp=f"syscalls:{enter}".encode(), fn_name=b"gt_sys_enter")
        bpf.attach_tracepoint(tp=f"syscalls:{exit_}".encode(), fn_name=b"gt_sys_exit")
        attached.append(name)
    return attached, missing


def attach_sched(bpf: Any, hook: str, want: str) -> list[str]:
    """Attach the scheduler and interrupt programs; the tracepoints this kernel lacks."""
    wanted = [(c, n) for c, n, _ in SCHED_TRACEPOINTS + (RAW_SCHED_ONLY if hook == "raw" else ())]
    present = [(c, n) for c, n in wanted if tracepoint_exists(c, n)]
    if hook == "raw":
        _attach_raw(bpf, "sched", want, [(n, f"gt_{n}") for _, n in present])
    else:
        for category, name in present:
            bpf.attach_tracepoint(tp=f"{category}:{name}".encode(), fn_name=f"gt_{name}".encode())
    return [f"{c}:{n}" for c, n in wanted if (c, n) not in present]


def _attach_raw(bpf: Any, group: str, want: str, pairs: list[tuple[str, str]]) -> None:
    try:
        for tp, fn in pairs:
            bpf.attach_raw_tracepoint(tp=tp.encode(), fn_name=fn.encode())
    except Exception as e:  # bcc raises bare Exception when the kernel refuses
        if want == "raw":
            raise UserError(f"attaching the raw {group} tracepoints failed: {first_line(e)}") from None
        raise RawAttachFailed(group, first_line(e)) from None
