"""io_uring opcodes as the eBPF source records them: names, which ones move bytes, and the names short
requests are summed under. Pure Python: every reader of a capture uses it."""

from __future__ import annotations

# IORING_OP_* (include/uapi/linux/io_uring.h; the enum only grows), named as the kernel's tracepoints print them.
OPS = (
    "NOP", "READV", "WRITEV", "FSYNC", "READ_FIXED", "WRITE_FIXED", "POLL_ADD", "POLL_REMOVE", "SYNC_FILE_RANGE",
    "SENDMSG", "RECVMSG", "TIMEOUT", "TIMEOUT_REMOVE", "ACCEPT", "ASYNC_CANCEL", "LINK_TIMEOUT", "CONNECT",
    "FALLOCATE", "OPENAT", "CLOSE", "FILES_UPDATE", "STATX", "READ", "WRITE", "FADVISE", "MADVISE", "SEND", "RECV",
    "OPENAT2", "EPOLL_CTL", "SPLICE", "PROVIDE_BUFFERS", "REMOVE_BUFFERS", "TEE", "SHUTDOWN", "RENAMEAT",
    "UNLINKAT", "MKDIRAT", "SYMLINKAT", "LINKAT", "MSG_RING", "FSETXATTR", "SETXATTR", "FGETXATTR", "GETXATTR",
    "SOCKET", "URING_CMD", "SEND_ZC", "SENDMSG_ZC", "READ_MULTISHOT", "WAITID", "FUTEX_WAIT", "FUTEX_WAKE",
    "FUTEX_WAITV", "FIXED_FD_INSTALL", "FTRUNCATE", "BIND", "LISTEN", "RECV_ZC", "EPOLL_WAIT", "READV_FIXED",
    "WRITEV_FIXED", "PIPE",
)  # fmt: skip
# Ops whose positive result is a byte count.
XFER = frozenset({
    "READV", "WRITEV", "READ_FIXED", "WRITE_FIXED", "SENDMSG", "RECVMSG", "READ", "WRITE", "SEND", "RECV",
    "SPLICE", "TEE", "SEND_ZC", "SENDMSG_ZC", "READ_MULTISHOT", "RECV_ZC", "READV_FIXED", "WRITEV_FIXED",
})  # fmt: skip
WRITES = frozenset({"WRITEV", "WRITE_FIXED", "WRITE", "WRITEV_FIXED", "FSYNC", "SYNC_FILE_RANGE", "FALLOCATE"})
AGG_NR = 0x10000  # the `agg` map's "syscall number" of short requests: this | opcode (GT_URING_AGG_NR)

# gt_uring_event.flags (GT_URING_*)
FIXED, ASYNC, SQPOLL, MORE, UNFINISHED, SKIP_CQE = 0x1, 0x2, 0x4, 0x8, 0x10, 0x20


def uring_op(opcode: int) -> str:
    return OPS[opcode] if 0 <= opcode < len(OPS) else f"OP_{opcode}"


def agg_names() -> dict[int, str]:
    """SyscallAgg names of short requests (``io_uring:READ``), by the number the kernel sums them under."""
    return {AGG_NR | op: f"io_uring:{uring_op(op)}" for op in range(256)}
