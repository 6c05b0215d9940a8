"""The cpu cgroups of the traced processes and their CFS bandwidth throttling (a container's CPU limit).

A process over its cgroup's CPU quota (cgroup v1 ``cpu.cfs_quota_us`` per ``cpu.cfs_period_us``, v2 ``cpu.max``;
Kubernetes ``limits.cpu``) is taken off its CPU while still runnable until the next period gives the group
more: to the scheduler tracepoints that looks like a preemption, so only the cgroup's own counters say why.
This source samples, every ``TICK_S``, which cpu cgroup each traced process is in (/proc/PID/cgroup) and the
``cpu.stat`` counters (``nr_periods``, ``nr_throttled``, throttled time) of those cgroups and of their
ancestors that have a quota (a pod's limit throttles its containers), and records them when they change:
``CpuCgroup`` and ``CpuThrottle`` records. A cgroup without a quota never changes them, so it costs one record;
while no followed cgroup has a quota (nor any ancestor of one) and no process is new, the sampler sleeps until
the next reading of quotas and memberships (every ``LIMITS_EVERY`` ticks) instead of waking every tick.
The kernel adds a throttle's time to the counters when the group is let run again, so two samples bound when
a throttle ended; analysis (gputrace/analysis/throttle.py) matches that to the off-CPU spans it ended.

Collection never analyses: the records go into the capture. A file that cannot be read is recorded with the
error, so the report can say why a wait stayed a run-queue wait.
"""

from __future__ import annotations

import errno
import os
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from gputrace import clock
from gputrace.errors import UserError
from gputrace.records import CpuCgroup, CpuThrottle, SourceStatus
from gputrace.source import Sink
from gputrace.threads import Thread

PROC = Path("/proc")
TICK_S = 0.02  # a fifth of the usual 100 ms period: a throttle's end is placed within 20 ms
NEW_TICKS = 50  # ticks (1 s) a newly followed process's cgroup is read at every tick
LIMITS_EVERY = 25  # ticks between reads of the quota and period (they change rarely: kubectl edits)
UNLIMITED = -1
DEFAULT_PERIOD_US = 100_000
_MAX_FILE = 64 << 10


@dataclass(frozen=True)
class Hierarchy:
    """Where the cpu controller is mounted: the v1 ``cpu`` hierarchy and/or the unified (v2) one ("" if not)."""

    v1: str = ""
    v2: str = ""


@dataclass(frozen=True)
class Limits:
    quota_us: int
    period_us: int


@dataclass(frozen=True)
class Stat:
    nr_periods: int
    nr_throttled: int
    throttled_ns: int


# ----------------------------------------------------------------------------------------- parsing ---


def parse_mountinfo(text: str) -> Hierarchy:
    """The cpu controller's mount points from /proc/self/mountinfo: a ``cgroup`` mount whose super options
    name ``cpu`` (not ``cpuset`` or ``cpuacct`` alone) and a ``cgroup2`` mount, each only where the mount shows
    its hierarchy's root (a bind mount of a sub-tree would misplace every path)."""
    v1 = v2 = ""
    for line in text.splitlines():
        head, sep, tail = line.partition(" - ")
        fields, rest = head.split(), tail.split()
        if not sep or len(fields) < 5 or len(rest) < 3 or fields[3] != "/":
            continue
        point = fields[4].replace("\\040", " ")
        if rest[0] == "cgroup" and "cpu" in rest[2].split(",") and not v1:
            v1 = point
        elif rest[0] == "cgroup2" and not v2:
            v2 = point
    return Hierarchy(v1, v2)


def parse_proc_cgroup(text: str, hierarchy: Hierarchy) -> tuple[str, int]:
    """(path, version) of the cpu cgroup in a /proc/PID/cgroup text (``ID:CONTROLLERS:PATH`` lines): the v1
    ``cpu`` hierarchy's where it is mounted, else the unified hierarchy's (``0::PATH``); ("", 0) if neither."""
    unified = ""
    for line in text.splitlines():
        hid, _, rest = line.partition(":")
        controllers, sep, path = rest.partition(":")
        if not sep:
            continue
        if hierarchy.v1 and "cpu" in controllers.split(","):
            return path, 1
        if hid == "0" and not controllers:
            unified = path
    return (unified, 2) if unified and hierarchy.v2 else ("", 0)


def parse_cpu_max(text: str) -> Limits:
    """v2 ``cpu.max``: "QUOTA PERIOD" in microseconds, QUOTA "max" for none."""
    parts = text.split()
    if not parts:
        raise ValueError("cpu.max is empty")
    quota = UNLIMITED if parts[0] == "max" else int(parts[0])
    return Limits(quota, int(parts[1]) if len(parts) > 1 else DEFAULT_PERIOD_US)


def parse_cpu_stat(text: str, version: int) -> Stat:
    """``cpu.stat``: v1 counts throttled time in ns (``throttled_time``), v2 in µs (``throttled_usec``). A v2
    cgroup without the cpu controller enabled has neither: nothing throttled it."""
    values: dict[str, int] = {}
    for line in text.splitlines():
        key, _, value = line.partition(" ")
        if value.strip().lstrip("-").isdigit():
            values[key] = int(value)
    throttled = values.get("throttled_time", 0) if version == 1 else values.get("throttled_usec", 0) * 1000
    return Stat(values.get("nr_periods", 0), values.get("nr_throttled", 0), throttled)


def ancestors(path: str) -> list[str]:
    """The cgroups above ``path``, nearest first, without the root (which has no quota)."""
    parts = [p for p in path.split("/") if p]
    return ["/" + "/".join(parts[:i]) for i in range(len(parts) - 1, 0, -1)]


# ----------------------------------------------------------------------------------------- reading ---


def _read(path: Path) -> str:
    with open(path, "rb") as f:
        return f.read(_MAX_FILE).decode("utf-8", "backslashreplace")


def _why(e: OSError) -> str:
    return f"{e.strerror or type(e).__name__} ({e.filename})" if e.filename else str(e)


class CgroupFiles:
    """Reads the cpu cgroup files under a hierarchy's mount points (``root`` stands for /, so tests can point
    it at a tree of recorded files)."""

    def __init__(self, hierarchy: Hierarchy, root: Path = Path("/"), proc: Path = PROC) -> None:
        self.hierarchy, self.root, self.proc = hierarchy, root, proc

    def directory(self, path: str, version: int) -> Path:
        mount = self.hierarchy.v1 if version == 1 else self.hierarchy.v2
        return self.root / mount.lstrip("/") / path.lstrip("/")

    def member_of(self, pid: int) -> tuple[str, int] | None:
        """(path, version) of ``pid``'s cpu cgroup; None when the process is gone. Raises OSError otherwise."""
        try:
            text = _read(self.proc / str(pid) / "cgroup")
        except OSError as e:
            if e.errno in (errno.ENOENT, errno.ESRCH):
                return None
            raise
        if self._exited(pid):  # a zombie reads as the root group (v1 moves it out at exit): not a move
            return None
        return parse_proc_cgroup(text, self.hierarchy)

    def _exited(self, pid: int) -> bool:
        try:
            stat = _read(self.proc / str(pid) / "stat")
        except OSError:
            return False
        after = stat[stat.rfind(")") + 1 :].split()  # comm may hold spaces and parens
        return bool(after) and after[0] in ("Z", "X")

    def limits(self, path: str, version: int) -> Limits:
        """The quota and period. Raises OSError or ValueError."""
        d = self.directory(path, version)
        if version == 1:
            return Limits(int(_read(d / "cpu.cfs_quota_us")), int(_read(d / "cpu.cfs_period_us")))
        try:
            return parse_cpu_max(_read(d / "cpu.max"))
        except FileNotFoundError:
            if not d.is_dir():
                raise
            return Limits(UNLIMITED, DEFAULT_PERIOD_US)  # the root, or the cpu controller not enabled there

    def stat(self, path: str, version: int) -> Stat:
        return parse_cpu_stat(_read(self.directory(path, version) / "cpu.stat"), version)


def find_hierarchy(proc: Path = PROC) -> Hierarchy:
    try:
        return parse_mountinfo(_read(proc / "self" / "mountinfo"))
    except OSError:
        return Hierarchy()


def quota_cpus(pid: int = 0, files: CgroupFiles | None = None) -> float | None:
    """The CPUs' worth of time the cpu cgroup of ``pid`` (0: this process) may use, its quota over its period:
    the least of its own and its ancestors' (a pod's limit bounds its containers); None where none has a quota,
    or they cannot be read (no quota known)."""
    files = files or CgroupFiles(find_hierarchy())
    try:
        member = files.member_of(pid or os.getpid())
    except OSError:
        return None
    if member is None or not member[1]:
        return None
    path, version = member
    least: float | None = None
    for group in [path, *ancestors(path)]:
        try:
            limits = files.limits(group, version)
        except (OSError, ValueError):
            continue
        if limits.quota_us > 0 and limits.period_us > 0:
            cpus = limits.quota_us / limits.period_us
            least = cpus if least is None else min(least, cpus)
    return least


# ------------------------------------------------------------------------------------------ source ---


@dataclass
class _Tracked:
    """A cgroup being sampled: its version, last limits and counters, and the last sample's time."""

    version: int
    limits: Limits | None = None
    stat: Stat | None = None
    error: str = ""
    sampled_ns: int = 0


class CgroupSampler:
    """The Source that records the traced processes' cpu cgroups and their throttling counters."""

    name = "cgroups"

    def __init__(self, pids: list[int], *, tick_s: float = TICK_S, files: CgroupFiles | None = None) -> None:
        self.tick_s = tick_s
        self.files = files
        self._pids: set[int] = set(pids)
        self._member: dict[int, tuple[str, int, str]] = {}  # pid -> (path, version, error) last recorded
        self._tracked: dict[str, _Tracked] = {}
        self._limited: dict[str, list[str]] = {}  # cgroup -> its ancestors with a quota, as last read
        self._ticks = 0
        self._first_tick: dict[int, int] = {}  # pid -> the tick it was first sampled at
        self._lock = threading.Lock()  # add_target() (the eBPF source's thread) against the sampling thread
        self._stop = threading.Event()
        self._wake = threading.Event()  # set by add_target() and stop(): the sampling thread's sleep ends
        self._thread: threading.Thread | None = None
        self._sink: Sink | None = None

    def start(self, sink: Sink) -> None:
        if self.files is None:
            hierarchy = find_hierarchy()
            if not hierarchy.v1 and not hierarchy.v2:
                raise UserError("no cgroup hierarchy is mounted: CPU quota throttling is not recorded")
            self.files = CgroupFiles(hierarchy)
        self._sink = sink
        h = self.files.hierarchy
        detail = f"cpu cgroups: v1 at {h.v1 or '-'}, v2 at {h.v2 or '-'}, every {self.tick_s * 1000:g} ms"
        sink.emit([SourceStatus(clock.monotonic_ns(), self.name, "started", detail)])
        self.sample()  # at start: the state the first stall is compared with
        self._thread = Thread(target=self._run, name="gputrace-cgroups", daemon=True)
        self._thread.start()

    def add_target(self, pid: int) -> None:
        """Also follow ``pid`` (a child forked after start); it is read at the next tick."""
        with self._lock:
            self._pids.add(pid)
        self._wake.set()  # an idle sampler sleeps until the next limits tick: this one is due sooner

    def stop(self) -> None:
        self._stop.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
            self.sample()  # at the end: throttles that ended since the last tick

    def drops(self) -> dict[str, int]:
        return {}

    def _run(self) -> None:
        while True:
            skip = self._idle_ticks()
            t0 = time.monotonic()
            woken = self._wake.wait(self.tick_s * skip)
            if self._stop.is_set():
                return
            slept = skip - 1  # the ticks slept through (sample() counts the last), never past a limits tick
            if woken:
                self._wake.clear()
                slept = min(slept, int((time.monotonic() - t0) / self.tick_s))
            self._ticks += slept
            self.sample()

    def _idle_ticks(self) -> int:
        """Ticks until the next one that can record anything: 1 while a followed cgroup has a quota (its
        counters may move), a read failed, or a process is new (launchers move processes as they start them);
        otherwise (no quota anywhere: nothing to throttle) the next limits tick, when quotas and memberships
        are read again. Most jobs run without a quota: their sampler wakes every LIMITS_EVERY ticks."""
        with self._lock:
            pids = list(self._pids)
        if any(t.limits is None or t.error or t.limits.quota_us != UNLIMITED for t in self._tracked.values()):
            return 1
        if any(self._limited.get(path) for path in self._tracked):
            return 1
        for pid in pids:
            first = self._first_tick.get(pid)
            if first is None or self._ticks - first < NEW_TICKS or pid not in self._member:
                return 1
        return LIMITS_EVERY - self._ticks % LIMITS_EVERY or 1

    def sample(self) -> None:
        """One tick: where each process is, then each cgroup's counters; records only what changed."""
        assert self._sink is not None
        with self._lock:
            pids = sorted(self._pids)
        records: list[CpuCgroup | CpuThrottle] = []
        paths: dict[str, int] = {}
        limits_tick = self._ticks % LIMITS_EVERY == 0
        for pid in pids:  # where each one is: every tick while it is new (launchers place processes as they
            # start them), later with the limits (a process seldom moves once it runs)
            known = self._member.get(pid)
            young = self._ticks - self._first_tick.setdefault(pid, self._ticks) < NEW_TICKS
            where = self._membership(pid, records) if limits_tick or young or known is None else known[:2]
            if where is not None and where[0]:
                paths[where[0]] = where[1]
        for path, version in list(paths.items()):
            if limits_tick or path not in self._limited:
                self._limited[path] = [up for up in ancestors(path) if self._has_quota(up, version)]
            paths.update((up, version) for up in self._limited[path])
        for path, t in self._tracked.items():  # a group its processes left (or exited from) can still let them go
            paths.setdefault(path, t.version)
        for path, version in paths.items():
            self._sample_cgroup(path, version, limits_tick, records)
        self._ticks += 1
        if records:
            self._sink.emit(records)

    def _membership(self, pid: int, out: list[CpuCgroup | CpuThrottle]) -> tuple[str, int] | None:
        assert self.files is not None
        try:
            where = self.files.member_of(pid)
            error = ""
        except OSError as e:
            where, error = ("", 0), _why(e)
        if where is None:  # exited: not followed any more
            with self._lock:
                self._pids.discard(pid)
            self._member.pop(pid, None)
            self._first_tick.pop(pid, None)
            return None
        key = (where[0], where[1], error)
        if self._member.get(pid) != key:
            self._member[pid] = key
            out.append(CpuCgroup(clock.monotonic_ns(), pid, where[0], where[1], error))
        return where

    def _has_quota(self, path: str, version: int) -> bool:
        """Whether the ancestor ``path`` has a quota of its own; one that cannot be read is left out (the
        process's own cgroup is the one whose errors are recorded)."""
        assert self.files is not None
        try:
            return self.files.limits(path, version).quota_us != UNLIMITED
        except (OSError, ValueError):
            return False

    def _sample_cgroup(self, path: str, version: int, limits_tick: bool, out: list[CpuCgroup | CpuThrottle]) -> None:
        t = self._tracked.get(path)
        if t is None or t.version != version:
            t = self._tracked[path] = _Tracked(version)
        prev_ns = t.sampled_ns
        read = self._read_cgroup(path, t, limits_tick)
        if read is None:  # removed once empty: nothing left to sample
            del self._tracked[path]
            return
        t.sampled_ns = now = clock.monotonic_ns()
        if read == (t.limits, t.stat, t.error):
            return
        t.limits, t.stat, t.error = limits, stat, error = read
        out.append(CpuThrottle(now, prev_ns, path, version, limits.quota_us, limits.period_us, stat.nr_periods,
                               stat.nr_throttled, stat.throttled_ns, error))

    def _read_cgroup(self, path: str, t: _Tracked, limits_tick: bool) -> tuple[Limits, Stat, str] | None:
        """(limits, counters, "") or, when a file cannot be read, (none, zeros, why); None for a cgroup gone."""
        assert self.files is not None
        try:
            limits = self.files.limits(path, t.version) if limits_tick or t.limits is None or t.error else t.limits
            if limits.quota_us == UNLIMITED and t.stat is not None and not limits_tick:
                return limits, t.stat, ""  # no quota, so no throttling to see between the limits' reads
            return limits, self.files.stat(path, t.version), ""
        except (OSError, ValueError) as e:
            if isinstance(e, FileNotFoundError) and not self.files.directory(path, t.version).is_dir():
                return None
            return Limits(UNLIMITED, 0), Stat(0, 0, 0), _why(e) if isinstance(e, OSError) else str(e)
