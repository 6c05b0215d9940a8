"""Can this host run the eBPF source? Each check fails with one line saying how to fix it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

from gputrace.errors import PermissionDenied, UserError

TRACEFS = Path("/sys/kernel/tracing")
_CAP_SYS_ADMIN, _CAP_PERFMON, _CAP_BPF = 21, 38, 39


def _effective_caps() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    return 0


def check_privileges() -> None:
    caps = _effective_caps()
    if caps >> _CAP_SYS_ADMIN & 1 or (caps >> _CAP_BPF & 1 and caps >> _CAP_PERFMON & 1):
        return
    missing = [n for n, bit in (("CAP_BPF", _CAP_BPF), ("CAP_PERFMON", _CAP_PERFMON)) if not caps >> bit & 1]
    raise PermissionDenied(f"eBPF tracing needs root or {' + '.join(missing)} (missing); run with sudo")


def check_tracefs() -> None:
    if (TRACEFS / "events").is_dir():
        return
    if os.geteuid() == 0:
        r = subprocess.run(["mount", "-t", "tracefs", "tracefs", str(TRACEFS)], capture_output=True, text=True)
        if r.returncode == 0 and (TRACEFS / "events").is_dir():
            return
    raise UserError(f"tracefs is not mounted at {TRACEFS}; run: sudo mount -t tracefs tracefs {TRACEFS}")


def check_headers() -> None:
    mod = Path("/lib/modules") / os.uname().release
    if any((mod / d / "include/linux/kconfig.h").exists() for d in ("build", "source")):
        return
    raise UserError(f"kernel headers for {os.uname().release} are missing (bcc needs them); run ./setup.sh")


def import_bcc() -> Any:
    try:
        import bcc
    except ImportError:
        raise UserError("bcc is not importable (python3-bpfcc, system site packages); run ./setup.sh") from None
    return bcc


def check_host() -> Any:
    """Everything the source needs before compiling; returns the bcc module."""
    check_privileges()
    bcc = import_bcc()
    check_tracefs()
    check_headers()
    return bcc
