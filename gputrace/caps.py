"""Which Linux capabilities this process has, for clear "missing capability" errors."""

from __future__ import annotations

from pathlib import Path

CAP_DAC_READ_SEARCH = 2
CAP_SYS_PTRACE = 19
CAP_SYS_ADMIN = 21
CAP_PERFMON = 38
CAP_BPF = 39


def effective_caps(pid: int | str = "self") -> int:
    for line in Path(f"/proc/{pid}/status").read_text(errors="replace").splitlines():
        if line.startswith("CapEff:"):
            return int(line.split()[1], 16)
    return 0


def has_cap(cap: int, caps: int | None = None) -> bool:
    return bool((effective_caps() if caps is None else caps) >> cap & 1)


def missing_tracing_caps() -> list[str]:
    """Capabilities eBPF tracing needs that this process lacks (CAP_SYS_ADMIN covers both)."""
    caps = effective_caps()
    if has_cap(CAP_SYS_ADMIN, caps):
        return []
    return [name for cap, name in ((CAP_BPF, "CAP_BPF"), (CAP_PERFMON, "CAP_PERFMON")) if not has_cap(cap, caps)]
