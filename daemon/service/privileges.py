"""Least privilege for gputraced: the capabilities it keeps (the pidfds that pin the processes it authorises are
gputrace.pidfds).

drop_privileges is called before any thread exists (capset changes only the calling thread; threads started
later inherit it). The same set is the systemd unit's CapabilityBoundingSet; each is justified there and here.
"""

from __future__ import annotations

import ctypes
from pathlib import Path

KEEP = {
    0: "CAP_CHOWN",             # hand finished captures to the caller (fchown)
    1: "CAP_DAC_OVERRIDE",      # link them into the caller's 0700 directory
    2: "CAP_DAC_READ_SEARCH",   # tracefs (root-only) and other users' files named by /proc links
    6: "CAP_SETGID",            # run the attach helper (sys.remote_exec) as the target's own user, never as
    7: "CAP_SETUID",            #   root: it executes the target's interpreter, a file its user chose
    19: "CAP_SYS_PTRACE",       # /proc/PID/fd, maps, exe of other users' processes; uprobes on their libcuda
    24: "CAP_SYS_RESOURCE",     # raise RLIMIT_MEMLOCK for BPF maps on kernels that still charge it
    38: "CAP_PERFMON",          # attach tracepoints and uprobes (perf_event_open), read kernel data in BPF
    39: "CAP_BPF",              # load BPF programs, create maps and ring buffers
}
_PR_CAPBSET_DROP = 24
_PR_SET_NO_NEW_PRIVS = 38
_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
_LINUX_CAPABILITY_VERSION_3 = 0x20080522


class _Header(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _Data(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _caps(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1], 16)
    return 0


def drop_privileges(keep: dict[int, str] | None = None) -> str:
    """Shrink the bounding, ambient, permitted and effective sets to ``keep``; set no_new_privs.

    Returns a line for the log naming what was kept.
    """
    keep = KEEP if keep is None else keep
    libc = ctypes.CDLL(None, use_errno=True)
    last = int(Path("/proc/sys/kernel/cap_last_cap").read_text())
    for cap in range(last + 1):
        if cap not in keep:
            libc.prctl(_PR_CAPBSET_DROP, cap, 0, 0, 0)  # fails without CAP_SETPCAP: capset below still applies
    libc.prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0)
    mask = sum(1 << c for c in keep) & _caps("CapPrm")
    header = _Header(_LINUX_CAPABILITY_VERSION_3, 0)
    data = (_Data * 2)(_Data(mask & 0xFFFFFFFF, mask & 0xFFFFFFFF, 0), _Data(mask >> 32, mask >> 32, 0))
    if libc.capset(ctypes.byref(header), data) != 0:
        err = ctypes.get_errno()
        return f"could not drop capabilities (errno {err}); running with {_caps('CapEff'):#x}"
    libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    kept = [name for cap, name in sorted(keep.items()) if mask >> cap & 1]
    return f"capabilities kept: {', '.join(kept) or 'none'}"
