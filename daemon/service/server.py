"""gputraced: runs captures on request for local users, over a unix socket (never TCP).

Each connection carries one request (protocol.py: a length-prefixed JSON frame, read within
REQUEST_TIMEOUT_S and schema-checked), authorised by the peer's kernel credentials (auth.py: a caller
captures only processes it owns, root any). Captures are written into a root-only staging directory, then
handed to the caller (jobs.py: chowned through an O_NOFOLLOW descriptor and hard-linked, never
overwriting, into <state dir>/<uid>/, a 0700 directory the caller owns). This module is the server itself:
the listening socket, one thread per connection, dispatch by op, and the command line.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import select
import signal
import socket
import stat
import sys
import threading
import time
from pathlib import Path
from typing import Any

from gputrace import __version__
from gputrace.caps import effective_caps
from gputrace.daemon.service.auth import Caller, authorize, caller_of, confirm_caller
from gputrace.daemon.service.jobs import (
    DEFAULT_USER_QUOTA_MIB,
    MIB,
    Job,
    JobTable,
    Limits,
    hand_over,
    prepare_state_dir,
    salvage_staging,
)
from gputrace.daemon.service.protocol import (
    MAX_REPLY as MAX_REPLY,  # re-exported: `gputrace daemon` imports it from here
)
from gputrace.daemon.service.protocol import MAX_REQUEST, ProtocolError, recv_frame, send_frame, validate
from gputrace.daemon.watch.discover import start_time
from gputrace.daemon.watch.flight import FlightLimits
from gputrace.daemon.watch.watcher import WATCH_OFF, WatchConfig, Watcher
from gputrace.errors import UserError
from gputrace.pidfds import close_pidfds, peer_credentials, pidfd_support
from gputrace.threads import Thread

DEFAULT_SOCKET = Path("/run/gputrace/gputraced.sock")
DEFAULT_STATE_DIR = Path("/var/lib/gputrace")
REQUEST_TIMEOUT_S = 5.0
WAKE_S = 0.2  # the accept loop's look at `stopping` where no signal wakes it (a Service made without ``wake``)
MAX_CONNECTIONS = 32  # all users but root together
MAX_CONNECTIONS_PER_USER = 8  # no one user can take every slot and leave the others "busy"
MAX_CONNECTIONS_ROOT = 8  # root's own, beside the others': four users at their limit cannot lock root out


# ------------------------------------------------------------------------------------------ service ---


class Service:
    def __init__(self, socket_path: Path, state_dir: Path, limits: Limits, *, otlp: str | None = None,
                 otlp_protocol: str = "grpc", log: Any = None, request_timeout_s: float = REQUEST_TIMEOUT_S,
                 stopping: threading.Event | None = None, watch: WatchConfig | None = None,
                 wake: socket.socket | None = None) -> None:
        """``wake``: readable when ``stopping`` may have been set (the read end of the signals' wakeup fd,
        ``serve_from_args``); without it the accept loop looks at ``stopping`` every WAKE_S."""
        self.socket_path = socket_path
        self.request_timeout_s = request_timeout_s
        self.state_dir = state_dir
        self.log = log or _log
        self.jobs = JobTable(state_dir, limits, self.log, otlp=otlp, otlp_protocol=otlp_protocol)
        self.started = time.time()
        self.stopping = stopping or threading.Event()
        self.wake = wake
        self._open: dict[int, int] = {}  # uid -> connections being served
        self._open_lock = threading.Lock()
        self.pin_callers, self.pin_targets = pidfd_support()
        self.watcher = Watcher(state_dir, watch, self.log, self._hand_over_dump,
                               room_for=self.jobs.room_for) if watch is not None else None
        self.listener = self._listen()

    def _listen(self) -> socket.socket:
        path = self.socket_path
        path.parent.mkdir(mode=0o755, parents=True, exist_ok=True)
        _remove_stale_socket(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.bind(str(path))
        except OSError as e:
            sock.close()
            raise UserError(f"cannot listen on {path}: {e.strerror}") from None
        os.chmod(path, 0o666)  # anyone may connect; every request is authorised by SO_PEERCRED
        sock.listen(64)
        return sock

    def serve(self) -> None:
        self.log(f"gputraced {__version__} listening on {self.socket_path}, captures in {self.state_dir}")
        self.log(self._pidfd_line())
        if self.watcher is not None:
            self.watcher.start()
        try:
            watched = [self.listener] if self.wake is None else [self.listener, self.wake]
            timeout = WAKE_S if self.wake is None else None  # a signal wakes the select: no polling
            while not self.stopping.is_set():
                ready, _, _ = select.select(watched, [], [], timeout)
                if self.wake is not None and self.wake in ready:
                    with contextlib.suppress(OSError):
                        self.wake.recv(4096)
                if self.listener in ready:
                    self._accept()
        finally:
            self.listener.close()
            self.socket_path.unlink(missing_ok=True)
            if self.watcher is not None:
                self.watcher.ask_to_stop()  # its sessions end beside the captures'
            self.jobs.stop_all()
            if self.watcher is not None:
                self.watcher.stop()
            self.log("gputraced stopped")

    def _accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
            uid = peer_credentials(conn)[1]
        except OSError:
            return
        busy = self._take_slot(uid)
        if busy:
            _reply_and_close(conn, {"ok": False, "error": f"busy: {busy}"})
            return
        Thread(target=self._handle, args=(conn, uid), name="gputraced-conn", daemon=True).start()

    def _take_slot(self, uid: int) -> str:
        """A connection slot for ``uid``, or why there is none."""
        with self._open_lock:
            mine = self._open.get(uid, 0)
            if uid == 0:  # a pool of its own: the administrator and the service's health checks always get in
                if mine >= MAX_CONNECTIONS_ROOT:
                    return f"root has {MAX_CONNECTIONS_ROOT} connections open to gputraced already; try again"
            elif mine >= MAX_CONNECTIONS_PER_USER:  # per user first: one user's hoard is told as theirs
                return (f"you have {MAX_CONNECTIONS_PER_USER} connections open to gputraced (the limit per user); "
                        "close one and try again")
            elif sum(n for u, n in self._open.items() if u != 0) >= MAX_CONNECTIONS:
                return "too many connections, try again"
            self._open[uid] = self._open.get(uid, 0) + 1
            return ""

    def _release_slot(self, uid: int) -> None:
        with self._open_lock:
            self._open[uid] -= 1
            if not self._open[uid]:
                del self._open[uid]

    def _pidfd_line(self) -> str:
        callers = ("callers pinned with SO_PEERPIDFD" if self.pin_callers else
                   "no SO_PEERPIDFD on this kernel: callers known by SO_PEERCRED alone, a reused pid goes unseen")
        targets = ("target pids pinned with pidfd_open" if self.pin_targets else
                   "no pidfd_open: target pids checked unpinned, a reused pid goes unseen")
        return f"{callers}; {targets}"

    def _handle(self, conn: socket.socket, slot_uid: int) -> None:
        caller: Caller | None = None
        try:
            conn.settimeout(self.request_timeout_s)
            creds = peer_credentials(conn)
            peer_pid, uid, _ = creds
            try:
                caller = caller_of(conn, creds)
                req = recv_frame(conn, MAX_REQUEST, within_s=self.request_timeout_s)
                if req is None:
                    return
                self._dispatch(conn, validate(req), caller)
            except (ProtocolError, UserError) as e:
                self.log(f"request from uid {uid} pid {peer_pid} refused: {e}")
                _try_send(conn, {"ok": False, "error": str(e)})
        except OSError:
            pass  # the client went away; nothing to tell it
        finally:
            if caller is not None and caller.pidfd is not None:
                os.close(caller.pidfd)
            conn.close()
            self._release_slot(slot_uid)

    def _dispatch(self, conn: socket.socket, req: dict[str, Any], caller: Caller) -> None:
        confirm_caller(caller)
        op, uid = req["op"], caller.uid
        if op == "status":
            send_frame(conn, self.status(uid))
        elif op == "list":
            send_frame(conn, {"ok": True, "jobs": [j.as_dict() for j in self.jobs.visible_to(uid)],
                              "directory": str(self.state_dir / str(uid)), "files": self.jobs.files_of(uid)})
        elif op == "stop":
            job = self.jobs.stop(req["job"], uid)
            send_frame(conn, {"ok": True, "job": job.as_dict()})
        elif op == "dump":
            self._dump(conn, req["pid"], caller)
        else:
            self._capture(conn, req, caller)

    def _capture(self, conn: socket.socket, req: dict[str, Any], caller: Caller) -> None:
        if self.stopping.is_set():
            raise ProtocolError("the service is shutting down; no new captures")
        pinned = authorize(caller.uid, req["pids"])
        try:
            confirm_caller(caller)  # again: authorising may have taken a while, and no job for a dead caller
            job: Job = self.jobs.start(caller.uid, caller.gid, req, pinned)
        except BaseException:
            close_pidfds(pinned)
            raise
        self.log(f"job {job.id}: uid {caller.uid} (pid {caller.pid}) captures pids {job.pids} for "
                 f"{job.duration_s:g} s" + (", pinned by pidfd" if pinned else ""))
        send_frame(conn, {"ok": True, "event": "started", "job": job.as_dict()})
        if req.get("wait"):
            conn.settimeout(None)
            job.done.wait()
            conn.settimeout(self.request_timeout_s)
            send_frame(conn, {"ok": job.state == "done", "event": "done", "job": job.as_dict(), "log": list(job.log),
                              **({"error": job.error} if job.error else {})})

    def _dump(self, conn: socket.socket, pid: int, caller: Caller) -> None:
        """The flight window of the watched job ``pid`` belongs to, into the caller's directory. Authorised as a
        capture is: the job's process must be the caller's (root: anyone's); a job that has ended, by the
        owner it had."""
        if self.watcher is None:
            raise UserError("this gputraced does not watch GPU jobs (start it with --watch)")
        job = self.watcher.find(pid)
        if job is None:
            raise UserError(f"pid {pid} is not in a job this service watches (gputrace daemon status lists them)")
        if start_time(job.pid) == job.found.start:
            close_pidfds(authorize(caller.uid, [job.pid]))
        elif caller.uid not in (0, job.found.uid):
            raise ProtocolError(f"not allowed: the job of pid {job.pid} was uid {job.found.uid}'s; only root may "
                                "dump other users' jobs")
        path = self.watcher.dump(job, {"kind": "request", "detail": f"gputrace daemon dump by uid {caller.uid}"})
        send_frame(conn, {"ok": True, "path": str(path), "pid": job.pid})

    def _hand_over_dump(self, stage: Path, name: str, uid: int, gid: int) -> Path:
        user_dir = self.state_dir / str(uid)
        hand_over(stage, [name], user_dir, uid, gid)
        return user_dir / name

    def status(self, uid: int) -> dict[str, Any]:
        running = [j for j in self.jobs.visible_to(uid) if j.state == "running"]
        uptime = round(time.time() - self.started, 1)
        return {"ok": True, "version": __version__, "pid": os.getpid(), "uptime_s": uptime,
                "socket": str(self.socket_path), "state_dir": str(self.state_dir), "running": len(running),
                "caller_uid": uid, "capabilities": f"{effective_caps():016x}",
                "pidfd": {"callers": self.pin_callers, "targets": self.pin_targets},
                **({"watch": self.watcher.status(uid)} if self.watcher is not None else {})}


def _remove_stale_socket(path: Path) -> None:
    try:
        st = path.lstat()
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise UserError(f"{path} exists and is not a socket; remove it or choose another --socket")
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        try:
            probe.connect(str(path))
        except OSError:
            path.unlink()  # nobody listens: left over by a service that died
            return
    raise UserError(f"another gputraced is listening on {path}")


def _reply_and_close(conn: socket.socket, obj: dict[str, Any]) -> None:
    _try_send(conn, obj)
    conn.close()


def _try_send(conn: socket.socket, obj: dict[str, Any]) -> None:
    with contextlib.suppress(OSError):
        send_frame(conn, obj)


def _log(msg: str) -> None:
    print(f"gputraced: {msg}", file=sys.stderr, flush=True)


# ----------------------------------------------------------------------------------------- entry ----


def add_service_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--socket", type=Path, default=DEFAULT_SOCKET, help=f"unix socket (default {DEFAULT_SOCKET})")
    p.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR,
                   help=f"where captures go, one 0700 directory per user (default {DEFAULT_STATE_DIR})")
    p.add_argument("--max-duration-s", type=float, default=3600.0, help="longest capture a client may ask for")
    p.add_argument("--max-jobs", type=int, default=4, help="captures running at once, all users (default 4)")
    p.add_argument("--max-jobs-per-user", type=int, default=2, help="captures running at once per user")
    p.add_argument("--user-quota-mib", type=float, default=DEFAULT_USER_QUOTA_MIB, metavar="MIB",
                   help="bytes each user's kept and running captures may take in the state directory together: a "
                        "request over it is refused, a capture that reaches it is cut off and kept "
                        f"(default {DEFAULT_USER_QUOTA_MIB}; 0: no quota)")
    p.add_argument("--otlp", metavar="ENDPOINT", help="also send each capture's stalls to this OTLP collector "
                                                     "(with --watch: the metrics too)")
    p.add_argument("--otlp-protocol", choices=("grpc", "http"), default="grpc")
    w = p.add_argument_group("watch mode (the flight recorder)")
    w.add_argument("--watch", action="store_true",
                   help="also watch every GPU job on the host (armed processes, processes that map libcuda or open "
                        "/dev/nvidia*, NVML's running processes): each traced into a flight recorder")
    w.add_argument("--flight-seconds", type=float, default=60.0, metavar="SEC",
                   help="seconds of full detail kept per job (default 60)")
    w.add_argument("--flight-mib", type=float, default=256.0, metavar="MIB",
                   help="disk each job's flight recorder may take, oldest detail dropped first (default 256)")
    w.add_argument("--watch-max-jobs", type=int, default=16, metavar="N",
                   help="jobs watched at once; more GPU processes are refused and counted (default 16)")
    w.add_argument("--watch-user", action="append", type=int, default=[], metavar="UID",
                   help="watch only this user's GPU processes (repeatable; default: everyone's)")
    w.add_argument("--watch-off", action="append", default=[], metavar="FAMILY[,FAMILY]",
                   help="source families off in watch mode (default: sampler; 'none' for every family)")
    w.add_argument("--metrics-textfile", type=Path, metavar="PATH",
                   help="write per-job metrics here for node_exporter's textfile collector (replaced atomically)")
    w.add_argument("--trigger-busy-below", type=float, default=0.5, metavar="RATIO",
                   help="dump a job whose GPU busy share stays below this ... (default 0.5)")
    w.add_argument("--trigger-busy-low-s", type=float, default=30.0, metavar="SEC",
                   help="... for this many seconds (default 30)")
    w.add_argument("--trigger-cooldown-s", type=float, default=300.0, metavar="SEC",
                   help="automatic dumps of one job at most this often (default 300)")
    w.add_argument("--watch-analysis-cpu", type=float, default=0.002, metavar="RATIO",
                   help="share of the host's CPU the full analysis of flight segments may take on average (default "
                        "0.002); the other segments' stall time is split by cause as the last analysed one's "
                        "(1: analyse every segment)")
    w.add_argument("--watch-idle-s", type=float, default=300.0, metavar="SEC",
                   help="a job found by its arming alone (an armed service's Python processes) that shows no GPU "
                        "work for this long is let go, and judged again by libcuda, /dev/nvidia or NVML only "
                        "(default 300)")
    w.add_argument("--otlp-metrics-s", type=float, default=60.0, metavar="SEC",
                   help="with --otlp: how often the metrics are sent (default 60)")
    w.add_argument("--flight-segment-s", type=float, default=None, help=argparse.SUPPRESS)
    w.add_argument("--watch-scan-s", type=float, default=1.0, help=argparse.SUPPRESS)
    p.add_argument("--keep-caps", action="store_true", help="do not drop unneeded capabilities at startup")
    p.add_argument("--request-timeout-s", type=float, default=REQUEST_TIMEOUT_S, help=argparse.SUPPRESS)


def serve_from_args(args: argparse.Namespace) -> int:
    from gputrace.daemon.service.privileges import drop_privileges

    if not 0 <= args.user_quota_mib < float("inf"):
        raise UserError("--user-quota-mib must be a number of MiB >= 0 (0: no quota)")
    limits = Limits(args.max_duration_s, args.max_jobs, args.max_jobs_per_user, int(args.user_quota_mib * MIB))
    prepare_state_dir(args.state_dir)
    salvage_staging(args.state_dir, _log)
    stopping = threading.Event()  # before the socket exists: a stop sent once it appears is never lost
    # a signal's number is written to ``wake_w`` as it arrives (the interpreter's wakeup fd): the service's
    # accept loop sleeps until a connection or a signal, never polling
    wake_r, wake_w = socket.socketpair()
    wake_r.setblocking(False)
    wake_w.setblocking(False)
    signal.set_wakeup_fd(wake_w.fileno(), warn_on_full_buffer=False)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stopping.set())
    watch = watch_config(args) if args.watch else None
    service = Service(args.socket, args.state_dir, limits, otlp=args.otlp, otlp_protocol=args.otlp_protocol,
                      request_timeout_s=args.request_timeout_s, stopping=stopping, watch=watch, wake=wake_r)
    if watch is not None:  # the watched jobs' cost meters time their programs: needs CAP_SYS_ADMIN, dropped next
        from gputrace.probes.ebpf.bpfstats import hold_for_process

        _log(f"watch: {hold_for_process()}")
    if not args.keep_caps:
        _log(drop_privileges())
    service.serve()
    return 0


def watch_config(args: argparse.Namespace) -> WatchConfig:
    """The watch mode's settings from the command line, checked."""
    from gputrace.families import parse_off

    for flag, value in (("--flight-seconds", args.flight_seconds), ("--flight-mib", args.flight_mib),
                        ("--watch-max-jobs", args.watch_max_jobs), ("--watch-scan-s", args.watch_scan_s),
                        ("--otlp-metrics-s", args.otlp_metrics_s), ("--watch-idle-s", args.watch_idle_s)):
        if not 0 < value < float("inf"):
            raise UserError(f"{flag} must be a number > 0")
    if args.otlp:
        from gputrace.exporters.otlp import parse_endpoint

        parse_endpoint(args.otlp, args.otlp_protocol)  # a bad one said at start, not at the first export
    if not 0 <= args.watch_analysis_cpu <= 1:
        raise UserError("--watch-analysis-cpu must be a ratio between 0 and 1")
    if not 0 <= args.trigger_busy_below <= 1:
        raise UserError("--trigger-busy-below must be a ratio between 0 and 1")
    off = WATCH_OFF if not args.watch_off else frozenset() if args.watch_off == ["none"] else parse_off(args.watch_off)
    segment_s = args.flight_segment_s or min(10.0, max(1.0, args.flight_seconds / 6))
    flight = FlightLimits(args.flight_seconds, int(args.flight_mib * MIB), segment_s)
    textfile = args.metrics_textfile
    if textfile is not None and not textfile.parent.is_dir():
        raise UserError(f"--metrics-textfile: {textfile.parent} is not a directory")
    return WatchConfig(flight=flight, max_jobs=args.watch_max_jobs, scan_s=args.watch_scan_s,
                       off=off, busy_below=args.trigger_busy_below,
                       busy_low_s=args.trigger_busy_low_s, cooldown_s=args.trigger_cooldown_s,
                       metrics_textfile=textfile, analysis_share=args.watch_analysis_cpu,
                       uids=frozenset(args.watch_user) if args.watch_user else None, otlp=args.otlp,
                       otlp_protocol=args.otlp_protocol, otlp_interval_s=args.otlp_metrics_s,
                       idle_s=args.watch_idle_s)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gputraced", description=__doc__.split("\n\n")[0])
    add_service_args(parser)
    args = parser.parse_args(argv)
    try:
        return serve_from_args(args)
    except UserError as e:
        print(f"gputraced: error: {e}", file=sys.stderr)
        return e.exit_code
