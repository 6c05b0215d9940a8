"""What a capture session is pointed at, checked before it starts: privileges, the target pids, the output names."""

from __future__ import annotations

from pathlib import Path

from gputrace.caps import missing_tracing_caps
from gputrace.errors import PermissionDenied, UserError


def require_privileges() -> None:
    missing = missing_tracing_caps()
    if missing:
        raise PermissionDenied(f"tracing needs {' and '.join(missing)} (run as root, e.g. with sudo)")


def comm_of(pid: int) -> str:
    if pid <= 0:
        raise UserError(f"invalid pid {pid}")
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        raise UserError(f"no process with pid {pid}") from None
    except PermissionError:
        raise PermissionDenied(f"cannot read /proc/{pid} (needs CAP_SYS_PTRACE or root)") from None
    comm, state = stat[stat.index("(") + 1 : stat.rindex(")")], stat[stat.rindex(")") + 2]
    if state in "ZX":
        raise UserError(f"process {pid} ({comm}) has exited")
    return comm


def default_output(comm: str, pid: int) -> Path:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in comm) or "proc"
    return Path(f"gputrace-{safe}.{pid}.gputrace")


def perfetto_path_for(capture: Path) -> Path:
    return capture.with_suffix(".pftrace")
