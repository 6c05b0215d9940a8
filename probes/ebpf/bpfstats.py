"""What the kernel programs cost: each program's run count and run time, from the kernel's BPF statistics.

The kernel times BPF programs only while statistics are on, either for everyone
(``kernel.bpf_stats_enabled``) or for as long as some process holds the file descriptor that
``bpf(BPF_ENABLE_STATS)`` returned. A capture takes the descriptor and closes it at the end, so the host's
setting is never changed and is back as it was even if the capture is killed. gputraced in watch mode drops
CAP_SYS_ADMIN, which taking it needs, so it takes one for its whole life before (``hold_for_process``), and its
sessions' meters count on that one. Timing costs each program run two clock reads (tens of ns), which the
figures include.
"""

from __future__ import annotations

import ctypes
import os
import platform
from pathlib import Path
from typing import Any

BPF_ENABLE_STATS = 32  # enum bpf_cmd
BPF_STATS_RUN_TIME = 0  # enum bpf_stats_type
_SYS_BPF = {"x86_64": 321, "aarch64": 280}
SYSCTL = Path("/proc/sys/kernel/bpf_stats_enabled")


_held: RunStats | None = None  # the process's own, for its lifetime (hold_for_process)


def hold_for_process() -> str:
    """Turn statistics on for as long as this process lives (closed by the kernel at its exit); a line for a log."""
    global _held
    if _held is None or not _held.on:
        _held = RunStats()
        _held.open()
    return "BPF run-time statistics on while this process runs" if _held.on else _held.why


def _held_on() -> bool:
    return _held is not None and _held.fd >= 0


class RunStats:
    """Holds the kernel's BPF run-time statistics on while open; ``why`` says why they are off."""

    def __init__(self) -> None:
        self.fd = -1
        self.why = ""

    def open(self) -> bool:
        """Turn statistics on for this process's lifetime of the descriptor; False (and ``why``) if not."""
        if _sysctl_on() or _held_on():
            return True
        nr = _SYS_BPF.get(platform.machine())
        if nr is None:
            self.why = f"BPF statistics: no bpf() syscall number known for {platform.machine()}"
            return False
        attr = ctypes.create_string_buffer(16)  # union bpf_attr: enable_stats.type, zero padded
        ctypes.c_uint32.from_buffer(attr).value = BPF_STATS_RUN_TIME
        libc = ctypes.CDLL(None, use_errno=True)
        fd = libc.syscall(nr, BPF_ENABLE_STATS, attr, len(attr))
        if fd < 0:
            err = ctypes.get_errno()
            self.why = f"BPF statistics could not be turned on: {os.strerror(err)} (needs Linux 5.8+ and CAP_SYS_ADMIN)"
            return False
        self.fd = fd
        return True

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    @property
    def on(self) -> bool:
        return self.fd >= 0 or _held_on() or _sysctl_on()


def _sysctl_on() -> bool:
    try:
        return SYSCTL.read_text().strip() == "1"
    except OSError:
        return False


def fdinfo_fields(text: str) -> dict[str, int]:
    """The integer fields of a BPF program's /proc/self/fdinfo text (run_cnt, run_time_ns, recursion_misses)."""
    out: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        value = value.strip()
        if value.isdigit():
            out[key.strip()] = int(value)
    return out


def _fdinfo(fd: int) -> str:
    """/proc/self/fdinfo/FD's text (a few hundred bytes for a program), in one read: a job's cost meter reads
    every program's each second (a quarter of what pathlib's read_text costs)."""
    f = os.open(f"/proc/self/fdinfo/{fd}", os.O_RDONLY | os.O_CLOEXEC)
    try:
        return os.read(f, 8192).decode("ascii", "replace")
    finally:
        os.close(f)


def program_runs(bpf: Any, short_name: Any) -> dict[str, tuple[int, int]]:
    """(run count, run time ns) of each program bcc loaded into ``bpf``, by ``short_name(name)``; a program
    whose fdinfo has no statistics (kernels before 5.1) is left out."""
    out: dict[str, tuple[int, int]] = {}
    if bpf is None:
        return out
    for name, fn in list(bpf.funcs.items()):
        try:
            fields = fdinfo_fields(_fdinfo(fn.fd))
        except OSError:
            continue
        if "run_time_ns" in fields:
            out[short_name(name)] = (fields.get("run_cnt", 0), fields["run_time_ns"])
    return out
