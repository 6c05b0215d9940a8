"""What a capture session is pointed at, checked before it starts: privileges, the target pids, the output names."""

from __future__ import annotations

from pathlib import Path

from gputrace.caps import missing_tracing_caps
from gputrace.errors import PermissionDenied, UserError
from gputrace.probes import procfs


def require_privileges() -> None:
    missing = missing_tracing_caps()
    if missing:
        raise PermissionDenied(f"tracing needs {' and '.join(missing)} (run as root, e.g. with sudo)")


def comm_of(pid: int) -> str:
    if pid <= 0:
        raise UserError(f"invalid pid {pid}")
    try:
        stat = Path(f"/proc/{pid}/stat").read_text(errors="backslashreplace")  # comm: any bytes
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


class ProcTargets:
    """Which processes a capture follows when eBPF cannot run (no bcc, no kernel headers, a sandbox without
    bpf()): the targets and their descendants, read from /proc when asked. It answers what the session asks
    of the eBPF source: whom to serve an agent (a process whose ancestry reaches a target) and whether any
    target lives. A target is known by its pid and start time, so a reused pid does not count."""

    MAX_DEPTH = 64

    def __init__(self, pids: list[int]) -> None:
        self.roots: dict[int, str] = {}
        for pid in pids:
            started = _start_time(pid)
            if not started:
                raise UserError(f"no process with pid {pid}")
            self.roots[pid] = started

    def _alive(self, pid: int) -> bool:
        return _start_time(pid) == self.roots[pid]

    def is_traced(self, pid: int) -> bool:
        for _ in range(self.MAX_DEPTH):
            if pid in self.roots:
                return self._alive(pid)
            if pid <= 1:
                return False
            pid = procfs.ppid_of(pid)
        return False

    def any_live(self) -> bool:
        """Whether a target lives (its descendants outlive it only reparented, out of reach anyway)."""
        return any(self._alive(pid) for pid in self.roots)

    def live_targets(self) -> set[int]:
        live = {pid for pid in self.roots if self._alive(pid)}
        return live.union(*(procfs.descendants(pid) for pid in live))


def _start_time(pid: int) -> str:
    """Field 22 of /proc/PID/stat (clock ticks after boot); "" for a process that is gone or a zombie."""
    try:
        stat = Path(f"/proc/{int(pid)}/stat").read_text(errors="replace")
    except OSError:
        return ""
    fields = stat[stat.rindex(")") + 2:].split()
    return "" if fields[0] in "ZX" else fields[19]
