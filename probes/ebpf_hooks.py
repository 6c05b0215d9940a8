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
from typing import Any

from gputrace.errors import UserError
from gputrace.probes.btf import VMLINUX, kernel_btf, struct_offset
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
