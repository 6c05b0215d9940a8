"""Which kind of tracepoint each group of the eBPF source's programs hangs on, and attaching them.

Two groups choose between raw and classic tracepoints (docs/probes.md "Hooks"):
- syscalls: raw `sys_enter`/`sys_exit` (one program pair, arguments read from x86_64's pt_regs), or the
  classic per-syscall tracepoints;
- the scheduler and interrupt hooks (`sched_switch`, `sched_waking`, irq/softirq/hrtimer entry and exit):
  raw where BTF gives `task_struct.pid`'s offset, else classic. Classic programs share one per-CPU guard,
  so the kernel skips one that fires while another runs on the CPU; a raw program is only skipped when it
  nests in itself.
- io_uring's request hooks (`io_uring_submit_req`, `io_uring_file_get`, `io_uring_complete`) go with the
  scheduler's: raw where BTF gives those tracepoints' prototypes as the program reads them and the
  `io_kiocb` / `io_ring_ctx` members it needs. A classic one fills its whole record for every request on
  the host before the program looks at it; a raw program checks the process first.
The other programs (process tree, file faults, block I/O) stay classic.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

from gputrace.errors import UserError
from gputrace.probes.ebpf.btf import VMLINUX, Btf, kernel_btf, struct_member, struct_offset
from gputrace.probes.ebpf.host import tracepoint_exists
from gputrace.probes.ebpf.syscalls import (
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


class _BtfFacts(NamedTuple):
    """What the raw programs need from the running kernel's BTF: task_struct members' offsets (None where
    absent) and the io_uring programs' layout (uring_layout)."""

    task_pid: int | None
    task_tgid: int | None
    uring: tuple[tuple[str, ...], str]
    task_on_cpu: int | None
    task_state: int | None  # `__state` (`state` before 5.14)
    file_table: tuple[str, ...]  # -D flags for fd_inode(), () where BTF lacks a member


@functools.cache
def _from_btf() -> _BtfFacts:
    """Parsed once and let go."""
    btf = kernel_btf()
    if btf is None:
        return _BtfFacts(None, None, uring_layout(None), None, None, ())
    state = struct_member("task_struct", "__state", btf) or struct_member("task_struct", "state", btf)
    return _BtfFacts(struct_offset("task_struct", "pid", btf), struct_offset("task_struct", "tgid", btf),
                     uring_layout(btf), struct_offset("task_struct", "on_cpu", btf),
                     state[0] if state is not None and state[1] in (4, 8) else None,
                     file_table_flags(btf))  # fmt: skip


# What fd_inode() reads, each (macro, struct, member, size): task->files->fdt->fd[N]->f_inode->i_ino.
_FILE_TABLE = (
    ("GT_TASK_FILES_OFF", "task_struct", "files", 8),
    ("GT_FILES_FDT_OFF", "files_struct", "fdt", 8),
    ("GT_FDT_MAX_FDS_OFF", "fdtable", "max_fds", 4),
    ("GT_FDT_FD_OFF", "fdtable", "fd", 8),
    ("GT_FILE_INODE_OFF", "file", "f_inode", 8),
    ("GT_INODE_INO_OFF", "inode", "i_ino", 8),
)


def file_table_flags(btf: Btf) -> tuple[str, ...]:
    """-D flags for the programs' fd_inode() (the inode of a received fd), or () where a member is missing or
    of another size: received fds are then named without that check."""
    flags = []
    for macro, struct_name, member, size in _FILE_TABLE:
        found = struct_member(struct_name, member, btf)
        if found is None or found[1] != size:
            return ()
        flags.append(f"-D{macro}={found[0]}")
    return ("-DGT_FILE_TABLE=1", *flags)


# The raw io_uring programs' view of the kernel: each tracepoint's arguments, and (macro, struct, member,
# sizes it may have). io_kiocb.flags is an unsigned int before 6.10, a u64 (io_req_flags_t) since.
URING_ARGS = {
    "io_uring_submit_req": ["struct io_kiocb *"],
    "io_uring_file_get": ["struct io_kiocb *", "int"],
    "io_uring_complete": ["struct io_ring_ctx *", "void *", "struct io_uring_cqe *"],
}
_URING_FIELDS = (
    ("GT_REQ_OPCODE_OFF", "io_kiocb", "opcode", (1,)),
    ("GT_REQ_FLAGS_OFF", "io_kiocb", "flags", (4, 8)),
    ("GT_REQ_CQE_OFF", "io_kiocb", "cqe", None),
    ("GT_CQE_USER_DATA_OFF", "io_cqe", "user_data", (8,)),
    ("GT_REQ_CTX_OFF", "io_kiocb", "ctx", (8,)),
    ("GT_CTX_FLAGS_OFF", "io_ring_ctx", "flags", (4,)),
    ("GT_UCQE_USER_DATA_OFF", "io_uring_cqe", "user_data", (8,)),
    ("GT_UCQE_RES_OFF", "io_uring_cqe", "res", (4,)),
    ("GT_UCQE_FLAGS_OFF", "io_uring_cqe", "flags", (4,)),
)


def _uring_layout() -> tuple[tuple[str, ...], str]:
    return _from_btf().uring


def uring_layout(btf: Btf | None) -> tuple[tuple[str, ...], str]:
    """(-D flags for the raw io_uring programs, "") or ((), why they cannot be built) from `btf`."""
    if btf is None:
        return (), f"no readable BTF at {VMLINUX}"
    for tp, want in URING_ARGS.items():
        got = btf.tracepoint_args(tp)
        if got != want:
            return (), f"{tp} passes {got or 'nothing BTF describes'}, not {want}"
    flags = []
    for macro, struct_name, member, sizes in _URING_FIELDS:
        found = struct_member(struct_name, member, btf)
        if found is None or (sizes is not None and found[1] not in sizes):
            return (), f"{struct_name}.{member} {'not found' if found is None else f'is {found[1]} bytes'} in BTF"
        flags.append(f"-D{macro}={found[0]}")
        if macro == "GT_REQ_FLAGS_OFF":
            flags.append(f"-DGT_REQ_FLAGS_SIZE={found[1]}")
    return tuple(flags), ""


def uring_hook(sched_hook: str) -> tuple[str, str]:
    """("raw" or "classic", why not raw) for the io_uring programs, which follow the scheduler's hook."""
    if sched_hook != "raw":
        return "classic", ""
    flags, why = _uring_layout()
    return ("raw", "") if flags else ("classic", why)


def task_pid_offset() -> int | None:
    return _from_btf().task_pid


def task_tgid_offset() -> int | None:
    return _from_btf().task_tgid


def task_on_cpu_offset() -> int | None:
    return _from_btf().task_on_cpu


def task_state_offset() -> int | None:
    return _from_btf().task_state


def cflags(syscall_hook: str, sched_hook: str) -> list[str]:
    flags = [f"-DGT_RAW_SYSCALLS={int(syscall_hook == 'raw')}", f"-DGT_RAW_SCHED={int(sched_hook == 'raw')}"]
    if sched_hook == "raw":
        flags += [f"-DGT_TASK_PID_OFF={task_pid_offset()}", f"-DGT_TASK_TGID_OFF={task_tgid_offset()}"]
        on_cpu = task_on_cpu_offset()
        if on_cpu is not None:  # without it, a switch away the kernel did not report goes unnoticed
            flags.append(f"-DGT_TASK_ON_CPU_OFF={on_cpu}")
        state = task_state_offset()
        if state is not None:  # without it, such a sleep is taken as interruptible (S)
            flags.append(f"-DGT_TASK_STATE_OFF={state}")
    flags += _from_btf().file_table
    raw_uring = uring_hook(sched_hook)[0] == "raw"
    flags.append(f"-DGT_RAW_URING={int(raw_uring)}")
    if raw_uring:
        flags += _uring_layout()[0]
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


def attach_uring(bpf: Any, hook: str, want: str) -> None:
    """The raw io_uring programs (classic ones attach themselves when the program loads). A refusal falls
    back as the scheduler's group does: the program is loaded again with both classic."""
    if hook == "raw":
        _attach_raw(bpf, "sched", want, [(tp, f"gt_{tp}") for tp in URING_ARGS])


def _attach_raw(bpf: Any, group: str, want: str, pairs: list[tuple[str, str]]) -> None:
    try:
        for tp, fn in pairs:
            bpf.attach_raw_tracepoint(tp=tp.encode(), fn_name=fn.encode())
    except Exception as e:  # bcc raises bare Exception when the kernel refuses
        if want == "raw":
            raise UserError(f"attaching the raw {group} tracepoints failed: {first_line(e)}") from None
        raise RawAttachFailed(group, first_line(e)) from None
