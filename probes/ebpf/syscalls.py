"""Which syscalls the eBPF source traces, and how the kernel program reads each one's arguments.

Pure Python (no bcc): ``gputrace doctor`` and the tests read it on any machine.
"""

from __future__ import annotations

import functools
import os
import platform
import re
from pathlib import Path
from typing import NamedTuple

from gputrace.probes.ebpf.events import (
    F_DUPFD,
    F_EPOLLCTL,
    F_EPOLLDATA,
    F_FD,
    F_FDTABLE,
    F_MSGHDR,
    F_PATH,
    F_PATH0,
    F_PIPE,
    F_POLLFD,
    F_SELECTFD,
    F_SOCKADDR,
    F_SOCKADDR_PLEN,
    F_TIMESPEC,
    F_URING,
    F_XFER,
)


class SyscallSpec(NamedTuple):
    name: str
    flags: int
    arg_idx: int  # which argument the record's ``arg`` carries
    purpose: str


_READ = "storage/network reads"
_OPEN = "file opens and lookups (slow or remote filesystems)"
_WRITE = "writes and checkpoints"
_WAIT = "waits on other threads and processes"
_POLL = "event loops and readiness waits"
_NET = "network transfers"
_CONN = "socket setup (peer addresses)"
_SLEEP = "sleeps"
_FDS = "fd table changes (resolves fds to files and peers)"
_CWD = "working directory changes (resolves relative paths)"
_URING = "io_uring waits (the ring's requests name what was waited for)"

SPECS: tuple[SyscallSpec, ...] = (
    SyscallSpec("read", F_FD | F_XFER, 2, _READ),
    SyscallSpec("pread64", F_FD | F_XFER, 2, _READ),
    SyscallSpec("readv", F_FD | F_XFER, 2, _READ),
    SyscallSpec("preadv", F_FD | F_XFER, 2, _READ),
    SyscallSpec("preadv2", F_FD | F_XFER, 2, _READ),
    SyscallSpec("openat", F_PATH | F_FDTABLE, 2, _OPEN),
    SyscallSpec("openat2", F_PATH | F_FDTABLE, 2, _OPEN),
    SyscallSpec("newfstatat", F_PATH, 3, _OPEN),
    SyscallSpec("statx", F_PATH, 2, _OPEN),
    SyscallSpec("getdents64", F_FD, 2, _OPEN),
    SyscallSpec("write", F_FD | F_XFER, 2, _WRITE),
    SyscallSpec("pwrite64", F_FD | F_XFER, 2, _WRITE),
    SyscallSpec("writev", F_FD | F_XFER, 2, _WRITE),
    SyscallSpec("fsync", F_FD, 0, _WRITE),
    SyscallSpec("fdatasync", F_FD, 0, _WRITE),
    SyscallSpec("futex", 0, 0, _WAIT),
    SyscallSpec("futex_waitv", 0, 0, _WAIT),
    # The fd a poll names: the one polled (a socket read with a timeout), else the first that was ready
    SyscallSpec("poll", F_FD | F_POLLFD, 2, _POLL),
    SyscallSpec("ppoll", F_FD | F_POLLFD, 1, _POLL),
    SyscallSpec("select", F_FD | F_SELECTFD, 0, _POLL),  # the same rule over its fd sets
    SyscallSpec("pselect6", F_FD | F_SELECTFD, 0, _POLL),
    # An epoll wait reports the first ready event's data word, which the reader maps to the fd registered
    # with it (epoll_ctl, always emitted, and the /proc fdinfo snapshot)
    SyscallSpec("epoll_wait", F_FD | F_EPOLLDATA, 3, _POLL),
    SyscallSpec("epoll_pwait", F_FD | F_EPOLLDATA, 3, _POLL),
    SyscallSpec("epoll_pwait2", F_FD | F_EPOLLDATA, 3, _POLL),
    SyscallSpec("epoll_ctl", F_FD | F_EPOLLCTL, 1, _POLL),
    SyscallSpec("epoll_create", F_FDTABLE, 0, _POLL),
    SyscallSpec("epoll_create1", F_FDTABLE, 0, _POLL),
    SyscallSpec("recvfrom", F_FD | F_XFER, 2, _NET),
    SyscallSpec("recvmsg", F_FD | F_XFER | F_MSGHDR, 2, _NET),
    SyscallSpec("recvmmsg", F_FD, 2, _NET),
    SyscallSpec("sendto", F_FD | F_XFER, 2, _NET),
    SyscallSpec("sendmsg", F_FD | F_XFER, 2, _NET),
    SyscallSpec("sendmmsg", F_FD, 2, _NET),
    SyscallSpec("accept", F_FD | F_SOCKADDR_PLEN | F_FDTABLE, 0, _CONN),
    SyscallSpec("accept4", F_FD | F_SOCKADDR_PLEN | F_FDTABLE, 3, _CONN),
    SyscallSpec("connect", F_FD | F_SOCKADDR | F_FDTABLE, 2, _CONN),
    SyscallSpec("nanosleep", F_TIMESPEC, 0, _SLEEP),
    SyscallSpec("clock_nanosleep", F_TIMESPEC, 2, _SLEEP),
    SyscallSpec("ioctl", F_FD, 1, "device calls (a GPU driver's ioctls)"),
    SyscallSpec("io_uring_enter", F_FD | F_URING, 2, _URING),  # arg: min_complete
    SyscallSpec("io_uring_setup", F_FDTABLE, 0, _URING),  # its fd is the ring's
    SyscallSpec("pipe", F_PIPE | F_FDTABLE, 0, _FDS),
    SyscallSpec("pipe2", F_PIPE | F_FDTABLE, 1, _FDS),
    SyscallSpec("socket", F_FDTABLE, 0, _FDS),
    SyscallSpec("dup", F_FD | F_FDTABLE, 0, _FDS),
    SyscallSpec("dup2", F_FD | F_FDTABLE, 1, _FDS),
    SyscallSpec("dup3", F_FD | F_FDTABLE, 1, _FDS),
    SyscallSpec("close", F_FD | F_FDTABLE, 0, _FDS),
    # Always emitted only for F_DUPFD / F_DUPFD_CLOEXEC (os.dup); other commands when long (F_SETLKW waits).
    SyscallSpec("fcntl", F_FD | F_DUPFD, 1, "fd duplicates and file-lock waits"),
    SyscallSpec("chdir", F_PATH | F_PATH0 | F_FDTABLE, 0, _CWD),
    SyscallSpec("fchdir", F_FD | F_FDTABLE, 0, _CWD),
)

BY_NAME: dict[str, SyscallSpec] = {s.name: s for s in SPECS}

# io_uring requests of traced processes: their file (fd) and timing. The fields each program reads.
URING_FIELDS: dict[str, tuple[str, ...]] = {
    "io_uring_submit_req": ("ctx", "req", "user_data", "opcode", "flags", "sq_thread"),
    "io_uring_file_get": ("ctx", "req", "user_data", "fd"),
    "io_uring_complete": ("ctx", "req", "user_data", "res", "cflags"),
}
URING_TRACEPOINTS: tuple[tuple[str, str, str], ...] = (
    ("io_uring", "io_uring_submit_req", "io_uring requests: submission (Linux 5.19+ layout)"),
    ("io_uring", "io_uring_file_get", "io_uring requests: the file each reads or writes"),
    ("io_uring", "io_uring_complete", "io_uring requests: completion, in any context (a worker, an interrupt)"),
)

# (category, name, purpose). The scheduler and interrupt group can hang on raw or classic tracepoints
# (gputrace.probes.ebpf.hooks); each is served by the program gt_<name>.
OTHER_TRACEPOINTS: tuple[tuple[str, str, str], ...] = (
    ("task", "task_newtask", "follow forked children and threads"),
    ("sched", "sched_process_exec", "process exec"),
    ("sched", "sched_process_exit", "process and thread exit"),
    ("block", "block_io_start", "block requests, in the submitter's context (else block_rq_issue)"),
    ("block", "block_rq_complete", "block request completion"),
    ("filemap", "mm_filemap_fault", "waits in page faults on file mappings (mmap'd datasets; Linux 6.11+)"),
    ("writeback", "balance_dirty_pages", "writers paused for dirtying pages faster than their device writes back"),
    *URING_TRACEPOINTS,
)
SCHED_TRACEPOINTS: tuple[tuple[str, str, str], ...] = (
    ("sched", "sched_switch", "off-CPU intervals"),
    ("sched", "sched_waking", "who woke a waiting thread"),
    ("irq", "irq_handler_entry", "wakeups from hard interrupts (no task to blame)"),
    ("irq", "irq_handler_exit", "wakeups from hard interrupts (no task to blame)"),
    ("irq", "softirq_entry", "wakeups from softirqs (network receive, block completion)"),
    ("irq", "softirq_exit", "wakeups from softirqs (network receive, block completion)"),
    ("timer", "hrtimer_expire_entry", "wakeups by timers (sleeps, timeouts)"),
    ("timer", "hrtimer_expire_exit", "wakeups by timers (sleeps, timeouts)"),
)
# Raw only: a wakeup that came before its task was off its CPU (see gputrace.bpf.c, early_wake).
RAW_SCHED_ONLY: tuple[tuple[str, str, str], ...] = (
    ("sched", "sched_wakeup", "who woke a thread still switching out when its wakeup began"),
)


RAW_PURPOSE = "every traced syscall, one raw tracepoint program pair (reads, opens, writes, waits, network)"


KALLSYMS = Path("/proc/kallsyms")
# What the kernel calls to find a raw tracepoint by name (4.17+; renamed in 5.x): one of them is there when
# BPF_RAW_TRACEPOINT_OPEN is.
_RAW_TP_SYMBOLS = re.compile(rb"^\S+ \S (?:bpf_find_raw_tracepoint|bpf_get_raw_tracepoint)\s", re.M)


@functools.cache
def raw_syscalls_supported() -> bool:
    """Whether the syscall programs can use the raw tracepoints sys_enter / sys_exit here: they read the
    arguments from x86_64's pt_regs, and the kernel must support BPF raw tracepoints. Asked of kallsyms by
    name: the names are listed to any reader, the addresses only with CAP_SYSLOG, which gputraced drops
    (bcc's own check looks for an address, and so failed there). Asked once a process."""
    if platform.machine() != "x86_64":
        return False
    return kernel_has_raw_tracepoints()


def kernel_has_raw_tracepoints(kallsyms: Path = KALLSYMS) -> bool:
    try:
        return _RAW_TP_SYMBOLS.search(kallsyms.read_bytes()) is not None
    except OSError:
        return False


_NR_RE = re.compile(r"^#define __NR_(\w+)\s+(\d+)\s*$", re.M)


def _unistd_headers() -> list[Path]:
    arch = platform.machine()
    rel = os.uname().release
    if arch == "x86_64":
        names = ["/usr/include/x86_64-linux-gnu/asm/unistd_64.h", "/usr/include/asm/unistd_64.h",
                 f"/lib/modules/{rel}/build/arch/x86/include/generated/uapi/asm/unistd_64.h"]  # fmt: skip
    else:
        names = ["/usr/include/asm-generic/unistd.h"]
    return [Path(n) for n in names]


def syscall_numbers() -> dict[str, int]:
    """name → number on this machine: the C library's unistd headers, else bcc's (older) table."""
    out: dict[str, int] = {}
    try:
        from bcc import syscall

        out = {name.decode(): nr for nr, name in syscall.syscalls.items()}
    except Exception:  # noqa: BLE001 - bcc missing or its table unavailable: headers alone
        pass
    for header in _unistd_headers():
        try:
            text = header.read_text()
        except OSError:
            continue
        out.update((name, int(nr)) for name, nr in _NR_RE.findall(text))
        break
    return out
