"""Finding GPU jobs as they start: a scan of /proc on a timer, and NVML's running processes where there is NVML.

A process is a GPU process when it is a Python interpreter armed for gputrace (its environment says so: what a
``gputrace env`` service and a ``gputrace.sim`` workload under test do, announcing themselves), maps libcuda, or
holds an /dev/nvidia* device open, and is not traced already by the capture session that started it (nor
gputrace's own command line). Each scan lists /proc once; a process seen for the first time is read at once
(its environment, its maps, its fds), one already judged not a GPU process is read again after RECHECK_S, then
after twice as long each time up to MAX_RECHECK_S (a trainer loads libcuda seconds after it starts), kernel
threads never. The scan's own CPU time is kept in ``cpu_ns``.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from gputrace.agent import wire
from gputrace.agent.arming import armed_by, environ_of
from gputrace.probes import procfs

RECHECK_S = 5.0  # a process judged not a GPU process is judged again after this ...
MAX_RECHECK_S = 30.0  # ... doubled each time up to this (libcuda is loaded early in a job's life)
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
    ino: int  # /proc/PID's inode as the listing gave it: a new process under a reused pid has another
    due: float  # when to judge it again (inf: never)
    gpu: bool
    wait_s: float = RECHECK_S  # the next pause between judgements


@dataclass
class Scanner:
    """``scan()`` returns the GPU processes first seen (or first found to be GPU processes) since the last.

    A scan lists /proc once (its entries' inodes come with the listing) and reads nothing of a process it
    has judged already unless its judgement is due or its /proc entry changed: the cost of a scan is the
    listing plus the new processes."""

    exclude: Callable[[int], bool] = lambda pid: False
    uids: frozenset[int] | None = None  # only these users' processes (None: everyone's)
    recheck_s: float = RECHECK_S
    max_recheck_s: float = MAX_RECHECK_S
    scans: int = 0
    cpu_ns: int = 0
    processes: int = 0  # seen in the last scan
    judged: int = 0  # processes read (stat, environment, maps, fds), all scans together
    nvml: str = ""  # why NVML's process list is not used, or "" when it is
    _seen: dict[int, _Seen] = field(default_factory=dict)
    _unarmed: set[tuple[int, int]] = field(default_factory=set)  # (pid, start): its arming is no evidence
    _nvml_handles: list[object] | None = None

    def scan(self) -> list[Found]:
        t0 = time.thread_time_ns()
        now = time.monotonic()
        out: list[Found] = []
        nvml = self._nvml_pids()
        live: set[int] = set()
        with os.scandir("/proc") as listing:
            for entry in listing:
                if not entry.name.isdigit():
                    continue
                pid, ino = int(entry.name), entry.inode()
                live.add(pid)
                seen = self._seen.get(pid)
                if seen is not None and seen.ino == ino and (seen.gpu or now < seen.due) and pid not in nvml:
                    continue
                found = self._check(pid, ino, now, pid in nvml)
                if found is not None:
                    out.append(found)
        self.processes = len(live)
        if len(self._seen) > len(live):
            for pid in [p for p in self._seen if p not in live]:
                del self._seen[pid]
        if self._unarmed:
            self._unarmed = {k for k in self._unarmed if k[0] in live}
        if len(self._seen) > MAX_TRACKED:
            self._seen.clear()
        self.scans += 1
        self.cpu_ns += time.thread_time_ns() - t0
        return sorted(out, key=lambda f: f.start)  # parents before the children they started

    def _check(self, pid: int, ino: int, now: float, by_nvml: bool) -> Found | None:
        stat = _stat(pid)
        if stat is None:
            return None
        self.judged += 1
        start, ppid, comm = stat
        seen = self._seen.get(pid)
        same = seen is not None and seen.start == start
        if same and seen is not None:
            seen.ino = ino
            if seen.gpu or (now < seen.due and not by_nvml):
                return None
        try:
            uid = os.stat(f"/proc/{pid}").st_uid
        except OSError:
            return None
        if ppid == 2 or pid == 2 or (self.uids is not None and uid not in self.uids) or self.exclude(pid):
            self._seen[pid] = _Seen(start, ino, float("inf"), False)  # kernel threads, others', the service's
            return None
        how = "nvml" if by_nvml else gpu_evidence(pid, armed=(pid, start) not in self._unarmed)
        wait_s = min(seen.wait_s * 2, self.max_recheck_s) if same and seen is not None else self.recheck_s
        self._seen[pid] = _Seen(start, ino, now + wait_s, bool(how), wait_s)
        return Found(pid, start, ppid, uid, comm, how) if how else None

    def without_arming(self, pid: int, start: int) -> None:
        """Process (``pid``, ``start``) is judged again after ``recheck_s``, its arming no longer evidence (a
        watched job let go for showing no GPU work)."""
        if len(self._unarmed) < MAX_TRACKED:
            self._unarmed.add((pid, start))
        seen = self._seen.get(pid)
        if seen is not None and seen.start == start:
            seen.gpu, seen.due, seen.wait_s = False, time.monotonic() + self.recheck_s, self.recheck_s

    def retry_later(self, pid: int) -> None:
        """Judge ``pid`` again after ``recheck_s`` (a GPU process that could not be watched now)."""
        seen = self._seen.get(pid)
        if seen is not None:
            seen.gpu, seen.due, seen.wait_s = False, time.monotonic() + self.recheck_s, self.recheck_s

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


def gpu_evidence(pid: int, *, armed: bool = True) -> str:
    """Why ``pid`` is a GPU process ("armed", "libcuda", "/dev/nvidia"), or "" when nothing says it is;
    ``armed=False``: its arming is not asked.

    Arming is evidence only in a Python interpreter, where it loads the agent: every process an armed service
    starts inherits its environment (a shell, ``git``, ``sleep``), and in any other program it does nothing. A
    process that ``gputrace capture -- CMD`` started (its environment names the session's socket) is left to
    that capture while the session listens there: watching it too would trace it twice, and its agent sends
    its GPU records to its own session, not to an offer; once the capture has ended it is judged as any other."""
    try:
        with open(f"/proc/{pid}/maps", "rb") as f:
            maps = f.read()
    except OSError:
        return ""
    env = environ_of(pid)
    session = env.get(wire.ENV_SOCKET.encode())
    if session and procfs.unix_listener(session, pid):
        return ""  # `gputrace capture -- CMD` traces it: its agent is connected to that session, which still runs
    if armed and armed_by(env) and (b"libpython" in maps or _runs_python(pid)) and not _runs_gputrace(pid):
        return "armed"
    if b"libcuda.so" in maps:
        return "libcuda"
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


def _runs_python(pid: int) -> bool:
    """Whether ``pid``'s executable is a Python interpreter (python, python3, python3.12, ...; one linked
    without libpython shows only its name)."""
    try:
        name = os.path.basename(os.readlink(f"/proc/{pid}/exe"))
    except OSError:
        return False
    return re.fullmatch(r"python[0-9.]*(-dbg)?( \(deleted\))?", name) is not None


def _runs_gputrace(pid: int) -> bool:
    """Whether ``pid`` is gputrace's own command line (``gputrace ...``, ``gputraced``, ``python -m gputrace``):
    run from an armed shell it inherits the arming too, and a job of its own would take in what it runs (a
    ``capture -- CMD``'s command, traced by that capture)."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read(4096).split(b"\0")
    except OSError:
        return False
    if len(argv) > 2 and argv[1] == b"-m":
        return argv[2].split(b".")[0] == b"gputrace"
    return len(argv) > 1 and os.path.basename(argv[1]) in (b"gputrace", b"gputraced")


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
