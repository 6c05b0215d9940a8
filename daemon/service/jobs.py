"""gputraced's captures: one thread per job running the capture session, and the safe hand-over of its files.

A job writes into <state>/.staging/<job>/ (root-only, 0700), so nothing a user controls is ever in the path
while the session and the Perfetto exporter create files. When it ends, each file is chowned to the caller
through an O_NOFOLLOW descriptor and hard-linked into <state>/<uid>/ (linkat never replaces an existing name
and never follows a link), then unlinked from staging.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import itertools
import os
import pwd
import re
import shutil
import tempfile
import threading
import time
import traceback
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gputrace.errors import UserError
from gputrace.pidfds import close_pidfds, pidfd_exited
from gputrace.threads import Thread

STAGING = ".staging"
KEEP_FINISHED = 100
STOP_WAIT_S = 60.0
UNLOAD_WAIT_S = 10.0  # a job's end waits this long at most for its BPF programs to be unloaded


MIB = 1 << 20
DEFAULT_USER_QUOTA_MIB = 2048
QUOTA_MIN_ROOM = MIB  # a request needs this much of the quota left
DIR_BYTES_TTL_S = 1.0  # how long a user directory's size is taken as known while captures write


@dataclass
class Limits:
    max_duration_s: float = 3600.0
    max_jobs: int = 4
    max_jobs_per_user: int = 2
    user_quota_bytes: int = DEFAULT_USER_QUOTA_MIB * MIB  # a user's kept and running captures together; 0: none


@dataclass
class Job:
    id: int
    uid: int
    gid: int
    pids: list[int]
    duration_s: float
    min_gap_ms: float
    name: str
    stage: Path
    state: str = "running"
    started: float = field(default_factory=time.time)
    ended: float | None = None
    error: str = ""
    files: list[str] = field(default_factory=list)
    summary: dict[str, Any] = field(default_factory=dict)
    log: deque[str] = field(default_factory=lambda: deque(maxlen=200))
    stop: threading.Event = field(default_factory=threading.Event)
    off: frozenset[str] = frozenset()  # source families turned off (gputrace.families)
    done: threading.Event = field(default_factory=threading.Event)
    pidfds: dict[int, int] = field(default_factory=dict, repr=False)  # target pid -> pidfd, closed at the end
    confirmed: bool = False
    lost: str = ""
    written: int = 0  # bytes its capture took so far, counted against the user's quota while it runs
    over_quota: bool = False  # its capture was cut off at the quota

    def as_dict(self) -> dict[str, Any]:
        return {"id": self.id, "uid": self.uid, "pids": self.pids, "name": self.name, "state": self.state,
                "duration_s": self.duration_s, "started": round(self.started, 3),
                "ended": round(self.ended, 3) if self.ended else None, "error": self.error, "files": self.files,
                **self.summary}


def prepare_state_dir(state_dir: Path) -> None:
    """<state> 0755 (users reach their own 0700 directory), <state>/.staging 0700, both ours."""
    state_dir.mkdir(mode=0o755, parents=True, exist_ok=True)
    st = state_dir.lstat()
    if st.st_uid != os.geteuid() or not os.path.isdir(state_dir) or os.path.islink(state_dir):
        raise UserError(f"{state_dir} must be a directory owned by uid {os.geteuid()}")
    os.chmod(state_dir, 0o755)
    staging = state_dir / STAGING
    staging.mkdir(mode=0o700, exist_ok=True)
    if staging.is_symlink() or staging.lstat().st_uid != os.geteuid():
        raise UserError(f"{staging} must be a directory owned by uid {os.geteuid()}")
    os.chmod(staging, 0o700)


class JobTable:
    def __init__(self, state_dir: Path, limits: Limits, log: Callable[[str], None], *, otlp: str | None = None,
                 otlp_protocol: str = "grpc") -> None:
        self.state_dir, self.limits, self.log = state_dir, limits, log
        self.otlp, self.otlp_protocol = otlp, otlp_protocol
        self._jobs: dict[int, Job] = {}
        self._threads: dict[int, threading.Thread] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()
        self._closed = False  # stop_all was called: no job may start after the ones it stopped
        self._dir_bytes: dict[int, tuple[float, int]] = {}  # uid -> (when measured, bytes in <state>/<uid>)

    def start(self, uid: int, gid: int, req: dict[str, Any], pidfds: dict[int, int] | None = None) -> Job:
        """Start a capture; the job owns ``pidfds`` once this returns (on an error they stay the caller's)."""
        if req["duration_s"] > self.limits.max_duration_s:
            raise UserError(f"duration over this service's limit of {self.limits.max_duration_s:g} s")
        pids = list(req["pids"])
        with self._lock:
            if self._closed:
                raise UserError("the service is shutting down; no new captures")
            running = [j for j in self._jobs.values() if j.state == "running"]
            if len(running) >= self.limits.max_jobs:
                raise UserError(f"busy: {len(running)} captures running (limit {self.limits.max_jobs})")
            if sum(j.uid == uid for j in running) >= self.limits.max_jobs_per_user:
                raise UserError(f"you already run {self.limits.max_jobs_per_user} captures; wait or stop one")
            self._check_quota(uid)
            if req.get("name"):
                self._check_name(uid, req["name"], running)
            job_id = next(self._ids)
            # The job id keeps two unnamed captures of one pid started in the same second apart.
            name = req.get("name") or f"gputrace-{pids[0]}-{time.strftime('%Y%m%d-%H%M%S')}-{job_id}.gputrace"
            self._check_name(uid, name, running)
            stage = Path(tempfile.mkdtemp(prefix=f"{job_id}-", dir=self.state_dir / STAGING))
            job = Job(job_id, uid, gid, pids, req["duration_s"], req["min_gap_ms"], name, stage,
                      pidfds=dict(pidfds or {}), off=frozenset(req.get("off", ())))
            self._jobs[job_id] = job
            self._forget_old()
            thread = Thread(target=self._run, args=(job,), name=f"gputraced-job-{job_id}", daemon=True)
            self._threads[job_id] = thread  # under the lock: stop_all waits for every job it stopped
            thread.start()
        return job

    def _check_name(self, uid: int, name: str, running: list[Job]) -> None:
        """Refused up front: a name taken in the caller's directory, or one a running job of theirs will
        publish (found taken only once the capture is done, the second capture would be thrown away)."""
        for n in (name, _pftrace(name)):
            if os.path.lexists(self.state_dir / str(uid) / n):
                raise UserError(f"{n} already exists in your capture directory; choose another name")
        for job in running:
            if job.uid == uid and job.name == name:
                raise UserError(f"{name} is the name of your running job {job.id}; choose another name")

    # ------------------------------------------------------------------------------------- quota ---
    def user_bytes(self, uid: int, fresh: bool = False) -> int:
        """What ``uid`` holds here: its directory's files and what its running captures wrote so far.
        Called with the lock held."""
        now = time.monotonic()
        at, size = self._dir_bytes.get(uid, (0.0, 0))
        if fresh or now - at > DIR_BYTES_TTL_S:
            size = _dir_bytes(self.state_dir / str(uid))
            self._dir_bytes[uid] = (now, size)
        return size + sum(j.written for j in self._jobs.values() if j.uid == uid and j.state == "running")

    def room_for(self, uid: int) -> str:
        """Why ``uid`` may not have another capture written here now (its quota), or "" when it may."""
        try:
            with self._lock:
                self._check_quota(uid)
        except UserError as e:
            return str(e)
        return ""

    def _check_quota(self, uid: int) -> None:
        quota = self.limits.user_quota_bytes
        # Less room than a capture's header and first moments would be a capture cut off as it starts: refused.
        if quota and (used := self.user_bytes(uid, fresh=True)) > quota - QUOTA_MIN_ROOM:
            raise UserError(f"over your quota: your captures here take {used / MIB:,.1f} MiB of the "
                            f"{quota / MIB:,.0f} MiB each user may keep, less than {QUOTA_MIN_ROOM // MIB} MiB "
                            f"left (gputraced --user-quota-mib); remove some from {self.state_dir / str(uid)} and "
                            "try again")

    def _forget_old(self) -> None:
        finished = [j.id for j in self._jobs.values() if j.state != "running"]
        for job_id in finished[: max(0, len(finished) - KEEP_FINISHED)]:
            self._jobs.pop(job_id)
            self._threads.pop(job_id, None)

    def _run(self, job: Job) -> None:
        try:
            result = self._capture(job)
            if job.lost or (job.pidfds and not job.confirmed):
                raise UserError(job.lost or "tracing started unconfirmed; capture discarded")
            if result.cut_off and not job.over_quota:  # a full state dir: a capture cut off is not published
                raise UserError(result.cut_off.split("; the capture is cut off")[0] + "; capture discarded")
            job.summary = _summary(result)
            if result.cut_off:  # at the quota: kept, cut off at a frame, as `gputrace report` reads it
                job.error = result.cut_off.replace(f"{job.stage}/", "")
            else:
                self._charge_trace(job, result)
            if self.otlp and result.report is not None:
                self._export_otlp(job, result)
            job.files = [str(p) for p in publish(job, self.state_dir / str(job.uid))]
            job.state = "cut_off" if result.cut_off else "done"
        except UserError as e:
            job.state, job.error = "failed", str(e)
        except Exception as e:  # noqa: BLE001 - one job's bug must not take the service down
            job.state, job.error = "failed", f"internal error: {type(e).__name__}: {e}"
            self.log("".join(traceback.format_exception(e)).rstrip())
        finally:
            close_pidfds(job.pidfds)
            shutil.rmtree(job.stage, ignore_errors=True)
            with self._lock:
                self._dir_bytes.pop(job.uid, None)  # its files moved there: measured again when next asked
            _give_back_memory()
            job.ended = time.time()  # once its memory is given back: a client sees the service as the job left it
            self.log(f"job {job.id}: {job.state}" + (f": {job.error}" if job.error else f", {len(job.files)} files"))
            job.done.set()

    def _capture(self, job: Job) -> Any:
        from gputrace.daemon.session import CaptureOptions, run_capture

        def note(msg: str) -> None:
            if msg.startswith("gputrace: error: "):  # named as the caller knows the file: by its name alone
                msg = msg.replace(f"{job.stage}/", "")
            elif str(job.stage) in msg or msg.strip() == "Next:":
                return  # the session's hints name the staging path, which the caller never sees
            job.log.append(msg)
            self.log(f"job {job.id}: {msg}")

        # job.uid is the caller's SO_PEERCRED uid: a non-root caller's capture leaves out what it may not trace.
        opts = CaptureOptions(output=job.stage / job.name, pids=job.pids, duration_s=job.duration_s, force=False,
                              min_gap_ms=job.min_gap_ms, progress=False,
                              argv=["gputraced", f"job={job.id}", f"uid={job.uid}", *map(str, job.pids)],
                              on_tracing=lambda: _confirm_targets(job), owner_uid=job.uid or None, off=job.off,
                              budget=_QuotaBudget(self, job) if self.limits.user_quota_bytes else None)
        result = run_capture(opts, stop=job.stop, log=note)
        left_out = _left_out(result)
        if left_out:
            from gputrace.probes.ebpf.owner import LEFT_OUT_WHY

            note(f"gputrace: {left_out} processes left out: {LEFT_OUT_WHY}")
        return result

    def _charge_trace(self, job: Job, result: Any) -> None:
        """The Perfetto trace counts too: one that would take the user over the quota is not kept (the capture
        is, and the user can export it where there is room)."""
        quota = self.limits.user_quota_bytes
        if not quota or result.perfetto_path is None:
            return
        trace = Path(result.perfetto_path)
        size = trace.stat().st_size
        with self._lock:
            fits = self.user_bytes(job.uid, fresh=True) + size <= quota
            if fits:
                job.written += size
        if not fits:
            trace.unlink()
            job.log.append(f"gputrace: {trace.name} ({size / MIB:,.1f} MiB) would take you over your quota of "
                           f"{quota / MIB:,.0f} MiB: not kept (`gputrace export {job.name} --perfetto "
                           f"{trace.name}` writes it where you have room)")

    def _export_otlp(self, job: Job, result: Any) -> None:
        from gputrace.capture import CaptureReader
        from gputrace.exporters.otlp import OtlpExporter

        try:
            with CaptureReader(result.capture_path) as reader:
                out = OtlpExporter(self.otlp or "", self.otlp_protocol, report=result.report).write(reader)
            job.summary["otlp"] = {"sent": out.items, "dropped": out.dropped}
        except UserError as e:
            job.summary["otlp"] = {"error": str(e)}
            self.log(f"job {job.id}: OTLP export: {e}")

    def stop(self, job_id: int, uid: int) -> Job:
        job = self._jobs.get(job_id)
        if job is None or (uid != 0 and job.uid != uid):
            raise UserError(f"no job {job_id} of yours")
        job.stop.set()
        return job

    def visible_to(self, uid: int) -> list[Job]:
        with self._lock:
            return [j for j in self._jobs.values() if uid == 0 or j.uid == uid]

    def files_of(self, uid: int) -> list[dict[str, Any]]:
        d = self.state_dir / str(uid)
        try:
            entries = sorted(os.scandir(d), key=lambda e: e.name)
        except OSError:
            return []
        return [{"name": e.name, "bytes": e.stat(follow_symlinks=False).st_size} for e in entries
                if e.is_file(follow_symlinks=False)]

    def stop_all(self) -> None:
        """Ask every running capture to end, and wait (bounded) so each file is closed cleanly. No job
        starts from then on."""
        with self._lock:
            self._closed = True
        for job in self.visible_to(0):
            job.stop.set()
        deadline = time.monotonic() + STOP_WAIT_S
        for thread in list(self._threads.values()):
            thread.join(max(0.0, deadline - time.monotonic()))
        for job in self.visible_to(0):
            if not job.done.is_set():
                self.log(f"job {job.id}: still finishing after {STOP_WAIT_S:g} s; stopped without it, its capture "
                         f"is lost (what it wrote stays in {job.stage})")


class _QuotaBudget:
    """A job's capture takes its bytes from its user's quota (a gputrace.capture.WriteBudget): what the user's
    directory holds and what all their running captures wrote, together."""

    def __init__(self, table: JobTable, job: Job) -> None:
        self.table, self.job = table, job

    def take(self, n: int) -> bool:
        with self.table._lock:
            if self.table.user_bytes(self.job.uid) + n > self.table.limits.user_quota_bytes:
                self.job.over_quota = True
                return False
            self.job.written += n
            return True

    def refusal(self) -> str:
        return (f"over your quota of {self.table.limits.user_quota_bytes / MIB:,.0f} MiB here "
                "(gputraced --user-quota-mib)")


def _give_back_memory() -> None:
    """A job's records, report and export are garbage once it ends, but glibc keeps freed heap in its arenas
    (one per thread that allocated: each job and source thread): the service would stay at its largest job's
    size for good. Wait for the job's BPF programs to be unloaded (their modules are freed then), collect,
    then have glibc return free pages to the kernel."""
    from gputrace.probes.ebpf.host import wait_for_unloads

    wait_for_unloads(UNLOAD_WAIT_S)
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)


def _dir_bytes(d: Path) -> int:
    """Bytes of the files in a user's capture directory (not followed into links or subdirectories)."""
    try:
        with os.scandir(d) as entries:
            return sum(e.stat(follow_symlinks=False).st_size for e in entries if e.is_file(follow_symlinks=False))
    except OSError:
        return 0


def _confirm_targets(job: Job) -> None:
    """The probes follow pids. A target that exited before they were attached may have passed its pid to
    another process, which they would now be tracing: stop, and publish nothing."""
    job.confirmed = True
    gone = [pid for pid, fd in job.pidfds.items() if pidfd_exited(fd)]
    if gone:
        job.lost = f"process {gone[0]} exited before tracing started; capture discarded (its pid may be reused)"
        job.stop.set()


def _pftrace(name: str) -> str:
    return name[: -len(".gputrace")] + ".pftrace"


def _left_out(result: Any) -> int:
    """Processes the capture left out because they gained privileges the caller lacks (the report counts them)."""
    return int((result.report or {}).get("capture", {}).get("left_out", 0))


def _summary(result: Any) -> dict[str, Any]:
    report = result.report or {}
    stalls = report.get("stalls", [])
    return {"complete": bool(result.complete), "drops": {k: v for k, v in result.drops.items() if v},
            "left_out": _left_out(result),
            "stop_reason": result.stop_reason, "stalls": len(stalls),
            "stall_ns": int(report.get("summary", {}).get("stall_ns", 0)),
            "by_cause": report.get("summary", {}).get("by_cause", {})}


def user_dir_fd(path: Path, uid: int, gid: int) -> int:
    """An O_NOFOLLOW descriptor of <state>/<uid>, created 0700 and owned by the caller."""
    with contextlib.suppress(FileExistsError):
        os.mkdir(path, 0o700)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        raise UserError(f"{path} is not a usable directory ({e.strerror})") from None
    st = os.fstat(fd)
    if st.st_uid == os.geteuid() and st.st_uid != uid:  # ours (just made): close it, then hand it over
        os.fchmod(fd, 0o700)
        os.fchown(fd, uid, gid)
    elif st.st_uid != uid:
        os.close(fd)
        raise UserError(f"{path} belongs to uid {st.st_uid}, not {uid}")
    return fd


_PARTIAL = re.compile(r"^\.(.+)\.gputrace\.\d+\.partial$")


def salvage_staging(state_dir: Path, log: Callable[[str], None]) -> int:
    """Captures an earlier run of the service left in staging (it was killed or crashed mid-capture): each is
    handed to the user who asked for it as NAME.cut-off.gputrace (NAME.gputrace when it was finished but not
    yet handed over), readable up to the cut like any cut-off capture; then its stage goes. One whose owner
    cannot be read from its header is removed, and said so. Returns how many were handed over."""
    staging, handed = state_dir / STAGING, 0
    for stage in sorted(staging.iterdir()):
        if stage.is_symlink() or not stage.is_dir():
            stage.unlink()
            continue
        for f in sorted(stage.iterdir()):
            m = _PARTIAL.match(f.name)
            final = f"{m[1]}.cut-off.gputrace" if m else f.name
            if not final.endswith(".gputrace") or f.is_symlink() or not f.is_file():
                continue  # a .pftrace is made again from the capture by `gputrace export`
            try:
                uid = _requested_by(f)
                os.rename(f, stage / final)
                hand_over(stage, [final], state_dir / str(uid), uid, _primary_gid(uid))
                handed += 1
                log(f"{final} of uid {uid} was cut off when the service last stopped; handed over as is")
            except (UserError, OSError, ValueError) as e:
                log(f"{f.name} left in staging by the service's last run removed: {e}")
        shutil.rmtree(stage, ignore_errors=True)
    return handed


def _requested_by(path: Path) -> int:
    """The uid a capture of this service was made for: its header's argv (gputraced job=N uid=U PID...)."""
    from gputrace.capture import CaptureReader

    with CaptureReader(path) as reader:
        argv = reader.header.get("argv")
    if not (isinstance(argv, list) and len(argv) > 2 and argv[0] == "gputraced" and isinstance(argv[2], str)
            and argv[2].startswith("uid=") and argv[2][4:].isdigit()):
        raise ValueError("not a capture of this service (no uid in its header)")
    return int(argv[2][4:])


def _primary_gid(uid: int) -> int:
    try:
        return pwd.getpwuid(uid).pw_gid
    except KeyError:
        return uid  # a uid with no name: its files get the group of the same number, as useradd makes them


def publish(job: Job, user_dir: Path) -> list[Path]:
    """Hand the job's files to the caller; returns their final paths."""
    names = [n for n in (job.name, _pftrace(job.name)) if os.path.lexists(job.stage / n)]
    hand_over(job.stage, names, user_dir, job.uid, job.gid)
    return [user_dir / n for n in names]


def hand_over(stage: Path, names: list[str], user_dir: Path, uid: int, gid: int) -> None:
    """Move files ``names`` from ``stage`` into <state>/<uid>, owned by uid:gid (see _hand_over)."""
    dfd = user_dir_fd(user_dir, uid, gid)
    sfd = os.open(stage, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        for name in names:
            _hand_over(sfd, dfd, name, uid, gid)
    finally:
        os.close(sfd)
        os.close(dfd)


def _hand_over(sfd: int, dfd: int, name: str, uid: int, gid: int) -> None:
    """Link first, chown after: with fs.protected_hardlinks, linking a file owned by someone else needs
    CAP_FOWNER, which the service does not keep. Until the chown the file is root's and 0600."""
    fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=sfd)
    try:
        os.fchmod(fd, 0o600)
        try:
            os.link(name, name, src_dir_fd=sfd, dst_dir_fd=dfd, follow_symlinks=False)
        except FileExistsError:
            raise UserError(f"{name} appeared in your capture directory during the capture; not overwritten") from None
        if os.geteuid() == 0:
            os.fchown(fd, uid, gid)
    finally:
        os.close(fd)
    os.unlink(name, dir_fd=sfd)
