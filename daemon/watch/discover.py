"""Finding GPU jobs as they start: a scan of /proc on a timer, and NVML's running processes where there is NVML.

A process is a GPU process when it is armed for gputrace (its environment says so: what a ``gputrace env``
service and a ``gputrace.sim`` workload under test do, announcing themselves), maps libcuda, or holds an
/dev/nvidia* device open. Each scan lists /proc once; a process seen for the first time is read at once (its
environment, its maps, its fds), one already judged not a GPU process is read again every RECHECK_S (a trainer
loads libcuda seconds after it starts), kernel threads never. The scan's own CPU time is kept in ``cpu_ns``.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from gputrace.agent.arming import is_armed

RECHECK_S = 5.0
MAX_TRACKED = 65_536  # processes remembered between scans; a host with more is rescanned from scratch


@dataclass(frozen=True)
class Found:
    pid: int
    start: int  # start time in clock ticks since boot (/proc/PID/stat field 22): (pid, start) names a process
    ppid: int
    uid: int
    comm: str
    how: str  # armed, libcuda, /dev/nvidia, nvml


@dataclass
class _Seen:
    start: int
    checked: float
    gpu: bool


@dataclass
class Scanner:
    """``scan()`` returns the GPU processes first seen (or first found to be GPU processes) since the last."""

    exclude: Callable[[int], bool] = lambda pid: False
    recheck_s: float = RECHECK_S
    scans: int = 0
    cpu_ns: int = 0
    processes: int = 0  # seen in the last scan
    nvml: str = ""  # why NVML's process list is not used, or "" when it is
    _seen: dict[int, _Seen] = field(default_factory=dict)
    _nvml_handles: list[object] | None = None

    def scan(self) -> list[Found]:
        t0 = time.thread_time_ns()
        now = time.monotonic()
        out: list[Found] = []
        pids = [int(n) for n in os.listdir("/proc") if n.isdigit()]
        self.processes = len(pids)
        live = set(pids)
        nvml = self._nvml_pids()
        for pid in pids:
            found = self._check(pid, now, pid in nvml)
            if found is not None:
                out.append(found)
        for pid in [p for p in self._seen if p not in live]:
            del self._seen[pid]
        if len(self._seen) > MAX_TRACKED:
            self._seen.clear()
        self.scans += 1
        self.cpu_ns += time.thread_time_ns() - t0
        return sorted(out, key=lambda f: f.start)  # parents before the children they started

    def _check(self, pid: int, now: float, by_nvml: bool) -> Found | None:
        stat = _stat(pid)
        if stat is None:
            return None
        start, ppid, comm = stat
        seen = self._seen.get(pid)
        fresh = seen is not None and now - seen.checked < self.recheck_s and not by_nvml
        if seen is not None and seen.start == start and (seen.gpu or fresh):
            return None
        if ppid == 2 or pid == 2 or self.exclude(pid):  # kernel threads, and the service's own
            self._seen[pid] = _Seen(start, float("inf"), False)
            return None
        how = "nvml" if by_nvml else gpu_evidence(pid)
        self._seen[pid] = _Seen(start, now, bool(how))
        if not how:
            return None
        try:
            uid = os.stat(f"/proc/{pid}").st_uid
        except OSError:
            return None
        return Found(pid, start, ppid, uid, comm, how)

    def retry_later(self, pid: int) -> None:
        """Judge ``pid`` again after RECHECK_S (a GPU process that could not be watched now)."""
        seen = self._seen.get(pid)
        if seen is not None:
            seen.gpu, seen.checked = False, time.monotonic()

    def _nvml_pids(self) -> set[int]:
        """Pids NVML lists as running compute or graphics work; empty where there is no NVML."""
        if self._nvml_handles is None:
            self._nvml_handles = self._nvml_open()
        pids: set[int] = set()
        try:
            import pynvml

            for h in self._nvml_handles:
                for fn in (pynvml.nvmlDeviceGetComputeRunningProcesses, pynvml.nvmlDeviceGetGraphicsRunningProcesses):
                    pids.update(int(p.pid) for p in fn(h))
        except Exception as e:  # noqa: BLE001 - NVML errors of any kind: the /proc scan still works
            self.nvml = f"{type(e).__name__}: {e}"
            self._nvml_handles = []
        return pids

    def _nvml_open(self) -> list[object]:
        try:
            import pynvml

            pynvml.nvmlInit()
            return [pynvml.nvmlDeviceGetHandleByIndex(i) for i in range(pynvml.nvmlDeviceGetCount())]
        except Exception as e:  # noqa: BLE001 - no pynvml, no driver, no device: not used
            self.nvml = f"{type(e).__name__}: {e}"
            return []


def _stat(pid: int) -> tuple[int, int, str] | None:
    """(start time, ppid, comm) from /proc/PID/stat; None when it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read(1024)
    except OSError:
        return None
    head, _, rest = data.rpartition(b")")
    fields = rest.split()
    if len(fields) < 20:
        return None
    return int(fields[19]), int(fields[1]), head.partition(b"(")[2].decode(errors="replace")


def start_time(pid: int) -> int | None:
    stat = _stat(pid)
    return None if stat is None else stat[0]


def gpu_evidence(pid: int) -> str:
    """Why ``pid`` is a GPU process ("armed", "libcuda", "/dev/nvidia"), or "" when nothing says it is."""
    if is_armed(pid):
        return "armed"
    try:
        with open(f"/proc/{pid}/maps", "rb") as f:
            if b"libcuda.so" in f.read():
                return "libcuda"
    except OSError:
        return ""
    fd_dir = f"/proc/{pid}/fd"
    try:
        for fd in os.listdir(fd_dir):
            try:
                if os.readlink(f"{fd_dir}/{fd}").startswith("/dev/nvidia"):
                    return "/dev/nvidia"
            except OSError:
                continue
    except OSError:
        return ""
    return ""


def ancestors(pid: int, depth: int = 32) -> list[int]:
    """``pid``'s parent, grandparent, ... up to init."""
    out = []
    while depth > 0:
        stat = _stat(pid)
        if stat is None or stat[1] <= 1:
            break
        pid = stat[1]
        out.append(pid)
        depth -= 1
    return out
