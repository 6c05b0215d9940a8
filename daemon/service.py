"""gputraced: runs captures on request for local users, over a unix socket (never TCP).

Every byte from a client is hostile: one length-prefixed JSON frame per request (at most MAX_REQUEST bytes,
read within REQUEST_TIMEOUT_S), schema-checked before anything happens. Each request is authorised with the
peer's SO_PEERCRED credentials: a caller may capture only processes that exist and that it owns (real,
effective and saved uid all equal to the caller's), root may capture any. Captures are written into a
root-only staging directory, then handed to the caller: chowned through an O_NOFOLLOW descriptor and
hard-linked (never overwriting) into <state dir>/<uid>/, a 0700 directory the caller owns. A client-supplied
name is a plain file name, never a path.

Wire format (both directions): 4-byte big-endian length, then a UTF-8 JSON object.
    {"op": "capture", "pids": [4242], "duration_s": 10, "name": "run1.gputrace", "min_gap_ms": 1, "wait": true}
    {"op": "list"}    {"op": "status"}    {"op": "stop", "job": 3}
Replies carry "ok": true/false and "error" when false; a waited capture gets a second frame when it ends.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import select
import signal
import socket
import stat
import struct
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gputrace import __version__
from gputrace.errors import UserError

from .service_caps import close_pidfds, open_pidfd, peer_pidfd, pidfd_exited, pidfd_support
from .service_jobs import Job, JobTable, Limits, prepare_state_dir

DEFAULT_SOCKET = Path("/run/gputrace/gputraced.sock")
DEFAULT_STATE_DIR = Path("/var/lib/gputrace")
MAX_REQUEST = 64 << 10
MAX_REPLY = 16 << 20
REQUEST_TIMEOUT_S = 5.0
MAX_CONNECTIONS = 32
MAX_PIDS = 64
PID_MAX = 1 << 22
NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,100}")
OPS = {"capture": {"pids", "duration_s", "name", "min_gap_ms", "wait"}, "list": set(), "status": set(),
       "stop": {"job"}}


class ProtocolError(Exception):
    """A request that breaks the protocol or the schema; the message goes back to the client."""


# -------------------------------------------------------------------------------------------- frames ---


def send_frame(sock: socket.socket, obj: dict[str, Any]) -> None:
    data = json.dumps(obj, separators=(",", ":")).encode()
    sock.sendall(struct.pack(">I", len(data)) + data)


def recv_frame(sock: socket.socket, limit: int) -> dict[str, Any] | None:
    """One frame, or None when the peer closed cleanly before sending one."""
    head = _recv_exact(sock, 4, allow_eof=True)
    if head is None:
        return None
    (size,) = struct.unpack(">I", head)
    if size > limit:
        raise ProtocolError(f"frame of {size} bytes exceeds the limit of {limit}")
    body = _recv_exact(sock, size, allow_eof=False)
    assert body is not None
    try:
        obj = json.loads(body.decode("utf-8"), parse_constant=_reject_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as e:
        raise ProtocolError(f"not a JSON frame: {type(e).__name__}") from None
    if not isinstance(obj, dict):
        raise ProtocolError("a frame must be a JSON object")
    return obj


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not allowed")


def _recv_exact(sock: socket.socket, n: int, *, allow_eof: bool) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        try:
            chunk = sock.recv(n - len(buf))
        except TimeoutError:
            raise ProtocolError("request not received in time") from None
        if not chunk:
            if allow_eof and not buf:
                return None
            raise ProtocolError("connection closed mid-frame")
        buf += chunk
    return bytes(buf)


# ------------------------------------------------------------------------------------------- schema ---


def validate(req: dict[str, Any]) -> dict[str, Any]:
    """The request, checked against the schema: known op, known keys, types and ranges."""
    op = req.get("op")
    if not isinstance(op, str) or op not in OPS:
        raise ProtocolError(f"unknown op; expected one of {', '.join(sorted(OPS))}")
    extra = set(req) - OPS[op] - {"op"}
    if extra:
        raise ProtocolError(f"unexpected field(s) for {op}: {', '.join(sorted(map(str, extra)))[:200]}")
    if op == "stop":
        _int(req.get("job"), "job", 1, 1 << 31)
    if op == "capture":
        pids = req.get("pids")
        if not isinstance(pids, list) or not 1 <= len(pids) <= MAX_PIDS:
            raise ProtocolError(f"pids must be a list of 1 to {MAX_PIDS} pids")
        req["pids"] = sorted({_int(p, "pid", 1, PID_MAX) for p in pids})
        req["duration_s"] = _number(req.get("duration_s"), "duration_s", 0.001, 7 * 86400)
        req["min_gap_ms"] = _number(req.get("min_gap_ms", 1.0), "min_gap_ms", 0.001, 60_000)
        req["name"] = check_name(req["name"]) if req.get("name") is not None else None
        if not isinstance(req.get("wait", False), bool):
            raise ProtocolError("wait must be true or false")
    return req


def _int(value: Any, what: str, lo: int, hi: int) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
        raise ProtocolError(f"{what} must be an integer in [{lo}, {hi}]")
    return value


def _number(value: Any, what: str, lo: float, hi: float) -> float:
    if not isinstance(value, (int, float)) or isinstance(value, bool) or not lo <= value <= hi:
        raise ProtocolError(f"{what} must be a number in [{lo:g}, {hi:g}]")
    return float(value)


def check_name(name: Any) -> str:
    """A plain file name for the capture (".gputrace" added when missing); never a path."""
    if not isinstance(name, str):
        raise ProtocolError("name must be a string")
    if "/" in name or "\0" in name or name in (".", "..") or name.startswith("."):
        raise ProtocolError("name must be a plain file name, not a path")
    if not name.endswith(".gputrace"):
        name += ".gputrace"
    if not NAME_RE.fullmatch(name) or ".." in name:
        raise ProtocolError("name may use letters, digits, '.', '_' and '-' (at most 100 characters)")
    return name


# ------------------------------------------------------------------------------------ authorisation ---


def peer_credentials(conn: socket.socket) -> tuple[int, int, int]:
    """(pid, uid, gid) of the connected peer, from the kernel (SO_PEERCRED), not from anything it sent."""
    data = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, gid = struct.unpack("3i", data)
    return pid, uid, gid


def process_uids(pid: int) -> tuple[int, int, int]:
    """(real, effective, saved) uid of a live process."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        raise ProtocolError(f"no process with pid {pid}") from None
    fields = dict(line.split(":", 1) for line in text.splitlines() if ":" in line)
    if fields.get("State", "").strip()[:1] in ("Z", "X"):
        raise ProtocolError(f"process {pid} has exited")
    real, eff, saved = (int(x) for x in fields["Uid"].split()[:3])
    return real, eff, saved


@dataclass(frozen=True)
class Caller:
    """Who asked: the peer's SO_PEERCRED pid, uid and gid, and a pidfd pinning that process (None without
    SO_PEERPIDFD)."""

    pid: int
    uid: int
    gid: int
    pidfd: int | None


def caller_of(conn: socket.socket) -> Caller:
    pid, uid, gid = peer_credentials(conn)
    try:
        return Caller(pid, uid, gid, peer_pidfd(conn))
    except ProcessLookupError:
        raise ProtocolError(f"caller pid {pid} has exited; request dropped") from None


def confirm_caller(caller: Caller) -> None:
    """The process that connected is still there and still has the uid it connected with. Checked through
    its pidfd, so never about a process that took its pid since; without SO_PEERPIDFD there is nothing to
    check and SO_PEERCRED's uid alone decides."""
    if caller.pidfd is None:
        return
    try:
        euid = process_uids(caller.pid)[1] if caller.pid > 0 else caller.uid  # 0: from another pid namespace
    except ProtocolError:
        euid = None
    if euid is None or pidfd_exited(caller.pidfd):
        raise ProtocolError(f"caller pid {caller.pid} has exited; request dropped")
    if euid != caller.uid:
        raise ProtocolError(f"caller pid {caller.pid} now runs as uid {euid}, not uid {caller.uid} as when it "
                            "connected; reconnect")


def authorize(uid: int, pids: list[int], *, on_checked: Callable[[int], None] | None = None) -> dict[int, int]:
    """Root may capture anything; anyone else only processes that are entirely theirs.

    Each pid is pinned (pidfd_open) before /proc is read, and its pidfd is confirmed not to have exited
    after: the check was about the process the pidfd refers to, not a successor that took its pid. Returns
    {pid: pidfd} (empty where the kernel has no pidfd_open); the caller owns them. ``on_checked(pid)`` runs
    between the /proc check and that confirmation (a seam for tests).
    """
    pinned: dict[int, int] = {}
    try:
        for pid in pids:
            pidfd = _pin(pid)
            if pidfd is not None:
                pinned[pid] = pidfd
            uids = process_uids(pid)
            if on_checked is not None:
                on_checked(pid)
            if pidfd is not None and pidfd_exited(pidfd):
                raise ProtocolError(f"process {pid} exited while being authorised")
            if uid != 0 and any(u != uid for u in uids):
                raise ProtocolError(f"not allowed: pid {pid} is not yours (uid {uids[1]}); "
                                    "only root may capture other users' processes")
    except BaseException:
        close_pidfds(pinned)
        raise
    return pinned


def _pin(pid: int) -> int | None:
    try:
        return open_pidfd(pid)
    except ProcessLookupError:
        if Path(f"/proc/{pid}").is_dir():
            raise ProtocolError(f"pid {pid} is a thread, not a process; give its process id") from None
        raise ProtocolError(f"no process with pid {pid}") from None


# ------------------------------------------------------------------------------------------ service ---


class Service:
    def __init__(self, socket_path: Path, state_dir: Path, limits: Limits, *, otlp: str | None = None,
                 otlp_protocol: str = "grpc", log: Any = None, request_timeout_s: float = REQUEST_TIMEOUT_S) -> None:
        self.socket_path = socket_path
        self.request_timeout_s = request_timeout_s
        self.state_dir = state_dir
        self.log = log or _log
        self.jobs = JobTable(state_dir, limits, self.log, otlp=otlp, otlp_protocol=otlp_protocol)
        self.started = time.time()
        self.stopping = threading.Event()
        self._slots = threading.BoundedSemaphore(MAX_CONNECTIONS)
        self.pin_callers, self.pin_targets = pidfd_support()
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
        try:
            while not self.stopping.is_set():
                ready, _, _ = select.select([self.listener], [], [], 0.2)
                if ready:
                    self._accept()
        finally:
            self.listener.close()
            self.socket_path.unlink(missing_ok=True)
            self.jobs.stop_all()
            self.log("gputraced stopped")

    def _accept(self) -> None:
        try:
            conn, _ = self.listener.accept()
        except OSError:
            return
        if not self._slots.acquire(blocking=False):
            _reply_and_close(conn, {"ok": False, "error": "busy: too many connections, try again"})
            return
        threading.Thread(target=self._handle, args=(conn,), name="gputraced-conn", daemon=True).start()

    def _pidfd_line(self) -> str:
        callers = ("callers pinned with SO_PEERPIDFD" if self.pin_callers else
                   "no SO_PEERPIDFD on this kernel: callers known by SO_PEERCRED alone, a reused pid goes unseen")
        targets = ("target pids pinned with pidfd_open" if self.pin_targets else
                   "no pidfd_open: target pids checked unpinned, a reused pid goes unseen")
        return f"{callers}; {targets}"

    def _handle(self, conn: socket.socket) -> None:
        caller: Caller | None = None
        try:
            conn.settimeout(self.request_timeout_s)
            peer_pid, uid, _ = peer_credentials(conn)
            try:
                caller = caller_of(conn)
                req = recv_frame(conn, MAX_REQUEST)
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
            self._slots.release()

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
        else:
            self._capture(conn, req, caller)

    def _capture(self, conn: socket.socket, req: dict[str, Any], caller: Caller) -> None:
        if self.stopping.is_set():
            raise ProtocolError("the service is shutting down")
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
            send_frame(conn, {"ok": job.state == "done", "event": "done", "job": job.as_dict(),
                              **({"error": job.error} if job.error else {})})

    def status(self, uid: int) -> dict[str, Any]:
        running = [j for j in self.jobs.visible_to(uid) if j.state == "running"]
        uptime = round(time.time() - self.started, 1)
        return {"ok": True, "version": __version__, "pid": os.getpid(), "uptime_s": uptime,
                "socket": str(self.socket_path), "state_dir": str(self.state_dir), "running": len(running),
                "caller_uid": uid, "capabilities": _effective_caps_hex(),
                "pidfd": {"callers": self.pin_callers, "targets": self.pin_targets}}


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


def _effective_caps_hex() -> str:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return line.split()[1]
    return ""


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
    p.add_argument("--otlp", metavar="ENDPOINT", help="also send each capture's stalls to this OTLP collector")
    p.add_argument("--otlp-protocol", choices=("grpc", "http"), default="grpc")
    p.add_argument("--keep-caps", action="store_true", help="do not drop unneeded capabilities at startup")
    p.add_argument("--request-timeout-s", type=float, default=REQUEST_TIMEOUT_S, help=argparse.SUPPRESS)


def serve_from_args(args: argparse.Namespace) -> int:
    from .service_caps import drop_privileges

    limits = Limits(args.max_duration_s, args.max_jobs, args.max_jobs_per_user)
    prepare_state_dir(args.state_dir)
    service = Service(args.socket, args.state_dir, limits, otlp=args.otlp, otlp_protocol=args.otlp_protocol,
                      request_timeout_s=args.request_timeout_s)
    if not args.keep_caps:
        _log(drop_privileges())
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: service.stopping.set())
    service.serve()
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="gputraced", description=__doc__.split("\n\n")[0])
    add_service_args(parser)
    args = parser.parse_args(argv)
    try:
        return serve_from_args(args)
    except UserError as e:
        print(f"gputraced: error: {e}", file=sys.stderr)
        return e.exit_code
