"""How the eBPF source's program is built: its cflags, from the source's settings and the host's features,
and the compile, whose failure becomes a user error."""

from __future__ import annotations

import platform
import warnings
from typing import Any

from gputrace.errors import UserError
from gputrace.probes.ebpf import hooks
from gputrace.probes.ebpf.host import (
    BPF_DIR,
    compile_bpf,
    dirty_throttle_layout,
    file_faults_supported,
    format_has,
    tracepoint_exists,
    uring_supported,
)
from gputrace.probes.ebpf.owner import owner_cflags


def cflags(threshold_ns: int, ring_pages: int, hook: str, sched: str, owner_uid: int | None = None,
           off: frozenset[str] = frozenset()) -> list[str]:
    """The -D/-I flags for probes/bpf/gputrace.bpf.c: feature probes, never kernel version checks.
    ``owner_uid``: a non-root owner, whose capture leaves out processes that gain privileges it lacks.
    ``off``: source families turned off (gputrace.families): their programs are not compiled in."""
    flags = [
        f"-I{BPF_DIR}",
        f"-DTHRESHOLD_NS={threshold_ns}ULL",
        f"-DEVENT_PAGES={ring_pages}",
        *hooks.cflags(hook, sched),
        *owner_cflags(owner_uid),
    ]
    if "block" in off:
        flags.append("-DGT_NO_BLOCK")
    elif tracepoint_exists("block", "block_io_start"):
        flags.append("-DHAVE_BLOCK_IO_START")
    if format_has("sched", "sched_process_exit", "group_dead"):
        flags.append("-DHAVE_GROUP_DEAD")
    if "faults" not in off and file_faults_supported():
        flags.append("-DHAVE_FILEMAP_FAULT")
    if "uring" not in off and uring_supported():
        flags.append("-DHAVE_IO_URING")
    dirty = dirty_throttle_layout() if "dirty" not in off else ""
    if dirty:
        flags += ["-DHAVE_DIRTY_THROTTLE", f"-DGT_DIRTY_WB={int(dirty == 'wb')}"]
    if platform.machine() != "x86_64":  # only x86_64 packs struct epoll_event
        flags.append("-DGT_EPOLL_DATA_OFF=8")
    return flags


def compile_program(bcc: Any, flags: list[str]) -> Any:
    try:
        with warnings.catch_warnings():  # bcc 0.26 warns on str paths but cannot join bytes ones
            warnings.simplefilter("ignore", DeprecationWarning)
            return compile_bpf(bcc.BPF, src_file=str(BPF_DIR / "gputrace.bpf.c"), cflags=flags)
    except Exception as e:  # bcc raises bare Exception on compile/load failures
        raise UserError(f"loading the eBPF program failed: {hooks.first_line(e)} (check: gputrace doctor)") from None
