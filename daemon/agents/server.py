"""The session side of the agent channel: a unix socket that in-process GPU agents connect to.

One selector thread serves every peer without ever blocking on one: reads are non-blocking, the only
writes are tiny control messages (a peer that cannot take them is cut off), and records go through a
bounded queue to a forwarder thread that feeds the sink, so a slow sink costs counted drops, not a
stuck socket. Every peer is identified by SO_PEERCRED and must be a traced process (``authorize``),
asked while a pidfd of the peer (SO_PEERPIDFD, where the kernel has it) shows it has not exited, so the
answer is about the peer and not about a process that took its pid since. Everything it sends is checked
(gputrace.daemon.agents.validate) and a peer that breaks the protocol is cut off with the reason logged and counted.

What any traced process can cost the session is bounded (AgentLimits): connections per pid and in all, bytes
of unfinished frames per connection and in all, items per decoded frame, and records and bytes per agent per
second; beyond a budget its batches are dropped and counted (``pidN.over_budget``), which marks the capture
incomplete. Running out of descriptors sheds the connection being accepted, counted, and keeps the listener.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import selectors
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gputrace import clock
from gputrace.agent import arming, wire
from gputrace.daemon.agents import validate
from gputrace.daemon.agents.listen import (
    Forwarder,
    Listener,
    foreign_root,
    listen_at,
    listen_in_root,
    owner_for,
    unlink_if_ours,
)
from gputrace.daemon.agents.peer import Peer
from gputrace.daemon.agents.pidns import PeerIds
from gputrace.pidfds import peer_credentials, peer_pidfd
from gputrace.records import AgentInfo, AgentThread, SourceStatus
from gputrace.source import Sink
from gputrace.threads import Thread

if TYPE_CHECKING:
    from gputrace.daemon.attach.inject import Injection

log = logging.getLogger("gputrace.agents")

QUEUE_MAX_RECORDS = 262144
AUTHORIZE_GRACE_S = 1.0  # a child may connect before the session has seen its fork
STOP_TIMEOUT_S = 2.0
IDLE_WAIT_S = 5.0  # the socket thread's longest sleep with nothing to do
RECV_BYTES = 256 << 10
LOGGED_PER_KIND = 5
_KINDS = {"refused": "refused", "ended_early": "ended without saying bye"}  # what each kind says of its peers
# accept() failing for want of a descriptor or of kernel memory: the connection is shed, the listener kept
_EXHAUSTED = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}


@dataclass(frozen=True)
class AgentLimits:
    """What traced processes may cost the session (docs/ops.md, security model). Worst case held at once:
    ``pending_bytes`` of unfinished frames, one decoded frame of ``frame_items`` items, and the forwarder's
    ``queue_bytes``, whatever the peers send."""

    peers_per_pid: int = 4  # an agent needs one; a few more for a fork's or a restart's overlap
    peers: int = 256  # connections at once, all pids (descriptors as much as memory)
    hello_bytes: int = 64 << 10  # a peer's first frame, before it said who it is
    pending_bytes: int = 32 << 20  # unfinished frames of all peers together (each up to wire.MAX_FRAME_BYTES)
    frame_items: int = 1 << 18  # array and map items in one decoded frame (an agent's batch holds ~10k)
    records_per_s: int = 200_000  # per agent, with a second's worth as a burst
    bytes_per_s: int = 32 << 20  # per agent: batch frames' bytes, with a second's worth as a burst
    queue_bytes: int = 128 << 20  # batches waiting for the capture's writer, by their frames' size


class Budget:
    """A token bucket: ``rate`` per second, up to a second's worth saved."""

    def __init__(self, rate: int) -> None:
        self.rate, self.level, self.at = rate, float(rate), time.monotonic()

    def take(self, n: int, other: Budget | None = None, m: int = 0) -> bool:
        """Take ``n`` from this bucket and ``m`` from ``other`` if both have them, else neither."""
        now = time.monotonic()
        for b in (self, other) if other is not None else (self,):
            b.level, b.at = min(float(b.rate), b.level + (now - b.at) * b.rate), now
        if n > self.level or (other is not None and m > other.level):
            return False
        self.level -= n
        if other is not None:
            other.level -= m
        return True


class AgentServer:
    """A gputrace.source.Source (name "agent") fed by the agents of traced processes."""

    name = "agent"

    def __init__(self, sock_path: str | os.PathLike[str], *, authorize: Callable[[int], bool],
                 attach_dir: str | None = None, queue_records: int = QUEUE_MAX_RECORDS,
                 authorize_grace_s: float = AUTHORIZE_GRACE_S, stop_timeout_s: float = STOP_TIMEOUT_S,
                 flush_ms: int = 100, limits: AgentLimits | None = None) -> None:
        self.sock_path = Path(sock_path)
        self.authorize = authorize
        self.attach_dir = Path(attach_dir or arming.attach_dir())
        self.queue_records = queue_records
        self.limits = limits or AgentLimits()
        self._pending = 0  # bytes of unfinished frames held for all peers
        self.shed: dict[str, int] = {}  # connections refused or cut off by a limit, by which (see drops())
        self._reserve_fd: int | None = None  # given up to accept a connection when descriptors run out
        self.grace_s, self.stop_timeout_s, self.flush_ms = authorize_grace_s, stop_timeout_s, flush_ms
        self.stats = {"accepted": 0, "refused": 0, "cut_off": 0, "ended_early": 0, "records": 0, "accept_failed": 0}
        self.rejections: list[str] = []  # "pid N: reason", for the log and the tests
        self.rejected_records = 0
        self._logged: dict[str, int] = {}  # lines for the user, by kind (see _log)
        self._peers: dict[socket.socket, Peer] = {}
        self._gone: list[Peer] = []
        self._offers: list[Listener] = []
        self._withdrawn: list[Listener] = []  # closed by the server thread, which owns the selector
        self._stopped_offers = False  # all offers withdrawn: the session is ending, none is made any more
        self.injected: dict[int, Path] = {}  # pid -> the script its interpreter was told to run
        self.injections: dict[int, Injection] = {}  # pid -> how (and, for ptrace, the target's pause)
        self.kept_scripts: dict[int, Path] = {}  # scripts left in place at the end (see keep_unrun_scripts)
        self._listener_ino = 0
        self._new_listeners: list[socket.socket] = []
        self._sel = selectors.DefaultSelector()
        self._listener: socket.socket | None = None
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._fwd: Forwarder | None = None
        self._sink: Sink | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()
        self._closed = threading.Event()
        self._lock = threading.Lock()

    # ---------------------------------------------------------------------------------- Source ---
    def child_env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """What ``capture -- CMD`` adds to the child's environment so its agent connects at startup."""
        return arming.environment(str(self.sock_path), base)

    def start(self, sink: Sink) -> None:
        self._sink = sink
        self._listener, self._listener_ino = listen_at(self.sock_path)
        self._fwd = Forwarder(sink, self.queue_records, self.limits.queue_bytes)
        self._reserve_fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        self._sel.register(self._listener, selectors.EVENT_READ, "listen")
        self._sel.register(self._wake_r, selectors.EVENT_READ, "wake")
        self._thread = Thread(target=self._serve, name="gputrace-agents", daemon=True)
        self._thread.start()

    def offer(self, pid: int) -> None:
        """Let an armed, dormant process ``pid`` find this session at <attach dir>/<pid>.sock.

        A listening socket of its own there rather than a link to ours: a service with a private /tmp
        could not follow a link into the session's directory. For a process in a container the file is
        named by its pid there and made in the attach dir as it sees it (inside its root).
        """
        self._add_offer(self._make_offer(pid))

    def _make_offer(self, pid: int) -> Listener:
        name = f"{PeerIds(int(pid)).own_pid}.sock"
        if foreign_root(pid):
            offer = listen_in_root(pid, self.attach_dir, name)
        else:
            self.attach_dir.mkdir(mode=0o755, parents=True, exist_ok=True)
            listener, ino = listen_at(self.attach_dir / name)
            offer = Listener(listener, self.attach_dir / name, ino)
        offer.pid = int(pid)
        return offer

    def live_offers(self) -> int:
        """Offer sockets held: live ones and withdrawn ones the server thread has yet to close."""
        with self._lock:
            return len(self._offers) + len(self._withdrawn)

    def withdraw(self, pid: int) -> None:
        """``pid`` exited: its offer goes (the file and the listening socket; a connection it made lives on).
        A job forking thousands of short-lived children must not hold a socket for each."""
        with self._lock:
            gone = [o for o in self._offers if o.pid == pid]
            if not gone:
                return
            self._offers = [o for o in self._offers if o.pid != pid]
            self._withdrawn += gone
        for offer in gone:
            offer.unlink()  # the file goes now; its socket when the server thread next runs
        self._wake()

    def _add_offer(self, offer: Listener) -> None:
        with self._lock:
            late = self._stopping.is_set() or self._stopped_offers
            if not late:
                self._offers.append(offer)
                self._new_listeners.append(offer.sock)
        if late:  # a child forked while the session was ending (the eBPF source stops after us): no offer
            offer.close()
            return
        self._wake()

    def attach(self, pid: int, method: str | None = None) -> str:
        """Reach ``pid``'s agent however it can be done: "offered" to an armed process, else "injected"
        (``sys.remote_exec`` on Python >= 3.14, ptrace on 3.9 to 3.13, or ``method`` when given; the way
        taken, and the pause of a ptrace attach, are in ``injections[pid]``). Raises UserError with the reason
        when neither works."""
        if method is None and arming.is_armed(pid):
            self.offer(pid)
            return "offered"
        self.inject(pid, method)
        return "injected"

    def inject(self, pid: int, method: str | None = None) -> Injection:
        """Load the agent into a running, unarmed Python >= 3.9 (UserError saying why when impossible).

        A process that sees another filesystem than ours cannot see our socket or files: a container's, or
        a host process seen from gputraced (its /tmp, where the session's socket is, is private). It gets a
        socket of its own in its attach dir as it sees it, made through /proc/PID/root as offers are (so in
        the host's /run/gputrace/attach, though the service sees / read-only), and the script beside it (both
        removed when the session ends). Whether its namespaces are entered is another question, the helper's
        (gputrace.daemon.attach.nsexec: a container's are, the host's are not; the ptrace helper enters none)."""
        from gputrace.daemon.attach.inject import inject, script_name

        if not foreign_root(pid):
            done = inject(pid, str(self.sock_path), method=method)
        else:
            offer = self._make_offer(pid)
            offer.files.append(script_name(PeerIds(int(pid)).own_pid))
            try:
                done = inject(pid, str(offer.path_inside), offer.dir_fd, owner_for(pid), method=method)
            except BaseException:
                offer.close()
                raise
            self._add_offer(offer)
        self.injected[pid] = done.script
        self.injections[pid] = done
        return done

    def keep_unrun_scripts(self) -> None:
        """An injected agent that never said hello: its interpreter still holds the sys.remote_exec request,
        which nothing can withdraw, and will open the script when its main thread next runs Python code.
        Removed, that would print "Can't open debugger script" and a traceback into the job's own stderr;
        kept, it runs, finds no session, and does nothing. So such scripts stay (the session says where)."""
        heard = self.heard_from()
        with self._lock:
            for pid, script in self.injected.items():
                if pid in heard:
                    continue
                self.kept_scripts[pid] = script
                for offer in self._offers:
                    if offer.pid == pid and script.name in offer.files:
                        offer.files.remove(script.name)

    def stop(self) -> None:
        """Ask every agent to flush and say bye (bounded wait), then close and hand over what came."""
        self.keep_unrun_scripts()
        if self._thread is None:
            self._withdraw_offers()  # offered, but never started (or already stopped)
            return
        self._stopping.set()
        self._wake()
        deadline = time.monotonic() + self.stop_timeout_s
        while time.monotonic() < deadline and self._live_peers():
            time.sleep(0.01)
        self._closed.set()
        self._wake()
        self._thread.join()
        self._thread = None
        self._withdraw_offers()
        assert self._fwd is not None and self._sink is not None
        self._fwd.close()
        self._sink.emit_meta("agent", {"peers": [p.summary() for p in self._gone]})
        self._log_counts()

    def drops(self) -> dict[str, int]:
        out = {"queue": self._fwd.dropped if self._fwd else 0, "rejected": self.rejected_records, **self.shed}
        with self._lock:
            peers = list(self._peers.values()) + self._gone
        for p in peers:
            counts = {**p.drops, "over_budget": p.over_budget}
            if p.ids is not None:  # records whose thread was none of the peer's (see pidns.py)
                counts["tid_unmapped"] = p.ids.unmapped
            for what, n in counts.items():
                if n:  # zeros from every worker would bury the losses that matter
                    out[f"pid{p.pid}.{what}"] = n
        return out

    # ------------------------------------------------------------------------------ event loop ---
    def cpu_ns(self) -> dict[int, int]:
        """Each agent's own CPU time in its process this session, as it said (agents that said nothing: absent)."""
        with self._lock:
            peers = list(self._peers.values()) + self._gone
        out: dict[int, int] = {}
        for p in peers:
            if p.cpu_ns:
                out[p.pid] = out.get(p.pid, 0) + p.cpu_ns
        return out

    def heard_from(self) -> set[int]:
        """The pids whose agents said hello, at any time in this session."""
        with self._lock:
            peers = list(self._peers.values()) + self._gone
        return {p.pid for p in peers if p.hello is not None}

    def _live_peers(self) -> int:
        """Agents still owing a bye (a connection that never said hello owes nothing)."""
        with self._lock:
            return sum(p.hello is not None for p in self._peers.values())

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            self._wake_w.send(b"x")

    def _serve(self) -> None:
        try:
            while not self._closed.is_set():
                pending = any(not p.authorized for p in self._peers.values())
                # Offers, withdrawals and stop wake the selector (_wake): idle, it waits for a peer's message
                # (or a few seconds, as a safety net); peers not yet authorised are asked again every 50 ms.
                for key, _ in self._sel.select(0.05 if pending else IDLE_WAIT_S):
                    self._ready(key)
                self._recheck_pending()
                self._register_offers()
                self._close_withdrawn()
                if self._stopping.is_set():
                    self._send_stops()
        finally:
            for peer in list(self._peers.values()):
                self._drop(peer, f"did not answer stop within {self.stop_timeout_s:g} s", cut=False)
            self._sel.close()
            if self._listener is not None:
                unlink_if_ours(self.sock_path, self._listener_ino)
                self._listener.close()
            self._wake_r.close()
            self._wake_w.close()
            if self._reserve_fd is not None:
                os.close(self._reserve_fd)
                self._reserve_fd = None

    def _ready(self, key: selectors.SelectorKey) -> None:
        if key.data == "listen":
            self._accept(key.fileobj)  # type: ignore[arg-type]
        elif key.data == "wake":
            with contextlib.suppress(OSError):
                self._wake_r.recv(4096)
        else:
            try:
                self._read(key.data)
            except Exception as e:  # noqa: BLE001 - one peer's trouble must not end the others' service
                self._cut_off(key.data, f"internal error {type(e).__name__}: {e}", f"internal error {type(e).__name__}")

    def _register_offers(self) -> None:
        with self._lock:
            new, self._new_listeners = self._new_listeners, []
        for listener in new:
            self._sel.register(listener, selectors.EVENT_READ, "listen")

    def _close_withdrawn(self) -> None:
        with self._lock:
            gone, self._withdrawn = self._withdrawn, []
        for offer in gone:
            with contextlib.suppress(KeyError, ValueError):
                self._sel.unregister(offer.sock)
            offer.close()

    def _accept(self, listener: socket.socket) -> None:
        try:
            conn, _ = listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            self.stats["accept_failed"] += 1
            if e.errno in _EXHAUSTED:
                self._shed_one(listener, e)
            return  # ECONNABORTED and the like: that connection is gone, the listener is not
        try:
            conn.setblocking(False)
            pid, uid, _gid = peer_credentials(conn)
        except OSError:
            conn.close()
            return
        refused = self._over_limit(pid)
        if refused:
            self._count("connections_refused")
            self.stats["refused"] += 1
            self.rejections.append(f"pid {pid}: {refused}; refused")
            self._log("refused", f"pid {pid}: {refused}; refused")
            conn.close()
            return
        peer = Peer(conn, pid, uid, hello_bytes=self.limits.hello_bytes)
        try:
            peer.pidfd = peer_pidfd(conn)
        except ProcessLookupError:
            peer.vanished = True
        except OSError as e:
            log.debug("agent pid %d: no pidfd: %s", pid, e)
        with self._lock:
            self._peers[conn] = peer
        self._authorize(peer)

    def _over_limit(self, pid: int) -> str:
        """Why a new connection from ``pid`` would be one too many ("" when it is not)."""
        with self._lock:
            total, same = len(self._peers), sum(p.pid == pid for p in self._peers.values())
        if same >= self.limits.peers_per_pid:
            return f"already {same} connections (the limit per process)"
        if total >= self.limits.peers:
            return f"already {total} agent connections in all (the session's limit)"
        return ""

    def _shed_one(self, listener: socket.socket, e: OSError) -> None:
        """Out of descriptors: the waiting connection is accepted with the one held in reserve and closed at
        once (its agent sees the session gone), so the listener is not left readable to spin on, and stays."""
        self._count("connections_shed")
        if self.shed["connections_shed"] == 1:
            log.warning("gputrace: agent connections shed: %s (raise the open-file limit, ulimit -n)", e.strerror)
        if self._reserve_fd is None:
            return
        os.close(self._reserve_fd)
        self._reserve_fd = None
        try:
            conn, _ = listener.accept()
            conn.close()
        except OSError:
            pass
        finally:
            with contextlib.suppress(OSError):
                self._reserve_fd = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)

    def _count(self, what: str, n: int = 1) -> None:
        self.shed[what] = self.shed.get(what, 0) + n

    def _authorize(self, peer: Peer) -> None:
        if peer.exited():
            self.stats["refused"] += 1
            self._reject(peer, "exited before it was authorised; refused")
            self._drop(peer, "refused", cut=False, quiet=True)
            return
        try:
            ok = bool(self.authorize(peer.pid)) and not peer.exited()  # the answer was about this very process
        except Exception:  # noqa: BLE001 - a failing check refuses, it does not crash the session
            ok = False
        if ok:
            peer.authorized = True
            self.stats["accepted"] += 1
            self._sel.register(peer.sock, selectors.EVENT_READ, peer)
        elif time.monotonic() - peer.since >= self.grace_s:
            self.stats["refused"] += 1
            self._reject(peer, "not a traced process; refused")
            self._drop(peer, "refused", cut=False, quiet=True)

    def _recheck_pending(self) -> None:
        for peer in [p for p in self._peers.values() if not p.authorized]:
            self._authorize(peer)

    def _read(self, peer: Peer) -> None:
        try:
            data = peer.sock.recv(RECV_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as e:
            data, peer.end = b"", f"connection error: {e.strerror}"
        if not data:
            self._drop(peer, peer.end or "connection closed", cut=False)
            return
        before = peer.frames.pending
        try:
            bodies = peer.frames.feed(data)
        except wire.FrameError as e:
            self._pending += peer.frames.pending - before  # what it holds now, let go of by _drop
            self._cut_off(peer, str(e))
            return
        self._pending += peer.frames.pending - before
        if self._pending > self.limits.pending_bytes:  # this peer's read took it over: this peer goes
            self._count("cut_off_unfinished")
            self._cut_off(peer, f"unfinished frames of all agents over the session's limit of "
                                f"{self.limits.pending_bytes >> 20} MiB")
            return
        try:
            for body in bodies:
                self._message(peer, wire.decode_body(body, self.limits.frame_items), len(body))
                if peer.said_bye:
                    self._drop(peer, "bye", cut=False, quiet=True)
                    return
        except wire.FrameError as e:
            self._cut_off(peer, str(e))

    def _message(self, peer: Peer, msg: dict[str, Any], nbytes: int = 0) -> None:
        kind = msg["type"]
        if peer.hello is None and kind != "hello":
            raise wire.FrameError(f"first message is {kind[:20]!r}, not hello")
        if kind == "hello":
            if peer.hello is not None:
                raise wire.FrameError("second hello")
            peer.ids = PeerIds(peer.pid)
            self._hello(peer, validate.hello_fields(msg, peer.ids))
            peer.records_budget, peer.bytes_budget = Budget(self.limits.records_per_s), Budget(self.limits.bytes_per_s)
        elif kind == "batch":
            self._batch(peer, msg, nbytes)
        elif kind == "drops":
            peer.drops = validate.drop_counts(msg)
        elif kind == "cost":
            peer.cpu_ns = validate.cpu_ns(msg)
        elif kind == "bye":
            peer.said_bye = True
        else:
            raise wire.FrameError(f"unknown message type {kind[:20]!r}")

    def _hello(self, peer: Peer, hello: dict[str, Any]) -> None:
        peer.hello = hello
        now = clock.monotonic_ns()
        self._forward([AgentInfo(now, peer.pid, hello["tid"], hello["interpreter"], hello["cuda_version"],
                                 hello["driver_version"], b) for b in hello["backends"]])
        for name, why in hello["unavailable"].items():
            log.debug("agent pid %d: %s unavailable: %s", peer.pid, name, why)
        if self._stopping.is_set():  # came too late: flush what you have and go
            peer.sent_stop = True
            self._send(peer, {"type": "stop"})
        else:
            self._send(peer, {"type": "start", "flush_ms": self.flush_ms})

    def _batch(self, peer: Peer, msg: dict[str, Any], nbytes: int) -> None:
        n = _countable(msg.get("records"))
        assert peer.records_budget is not None and peer.bytes_budget is not None  # made at hello
        if not peer.records_budget.take(n, peer.bytes_budget, nbytes):
            # Dropped unchecked: checking costs what the budget is there to bound.
            if not peer.over_budget:
                self._status("degraded", f"pid {peer.pid}: over its budget of {self.limits.records_per_s:,} records "
                             f"and {self.limits.bytes_per_s >> 20} MiB a second; batches beyond it dropped (counted)")
            peer.over_budget += n
            return
        try:
            assert peer.ids is not None  # set at hello, which came first
            records = validate.batch_records(msg, peer.ids)
        except wire.FrameError:
            self.rejected_records += _countable(msg.get("records"))
            raise
        peer.records += len(records)
        peer.gpu_records += sum(type(r) is not AgentThread for r in records)
        self.stats["records"] += len(records)
        assert peer.hello is not None
        for r in records:
            if type(r) is AgentInfo and r.source not in peer.hello["backends"] and len(peer.hello["backends"]) < 16:
                peer.hello["backends"].append(r.source)  # a backend that started after hello
        self._forward(records, nbytes)

    def _forward(self, records: Sequence[tuple[Any, ...]], nbytes: int = 0) -> None:
        if records and self._fwd is not None:
            self._fwd.put(records, nbytes)

    def _send(self, peer: Peer, msg: dict[str, Any]) -> None:
        """A control message, never waited on. A peer that already hung up is left to the read side,
        which sees its bye or its EOF; only one that will not take a few bytes is cut off."""
        frame = wire.encode(msg)
        try:
            sent = peer.sock.send(frame)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError:
            return
        if sent != len(frame):
            raise wire.FrameError("peer does not read its socket")

    def _send_stops(self) -> None:
        for peer in list(self._peers.values()):
            if peer.hello is not None and not peer.sent_stop:
                peer.sent_stop = True
                try:
                    self._send(peer, {"type": "stop"})
                except wire.FrameError as e:
                    self._cut_off(peer, str(e))

    # ------------------------------------------------------------------------------- peer ends ---
    def _reject(self, peer: Peer, reason: str) -> None:
        text = f"pid {peer.pid}: {reason}"
        self.rejections.append(text)
        self._log("refused", text)

    def _log(self, kind: str, text: str) -> None:
        """A line about one peer for the user: the first few of each kind, then a count at the end (a job
        forking hundreds of short-lived workers would bury everything else). The capture keeps every one."""
        n = self._logged[kind] = self._logged.get(kind, 0) + 1
        if n <= LOGGED_PER_KIND:
            log.warning("gputrace: agent %s", text)
        elif n == LOGGED_PER_KIND + 1:
            log.warning("gputrace: agent: more peers %s; not shown one by one, counted at the end",
                        _KINDS.get(kind, kind))

    def _log_counts(self) -> None:
        for kind, n in self._logged.items():
            if n > LOGGED_PER_KIND:
                log.warning("gputrace: agent: %d peers %s in all", n, _KINDS.get(kind, kind))

    def _cut_off(self, peer: Peer, reason: str, brief: str | None = None) -> None:
        """End a peer that broke the protocol: counted, logged with ``reason``, its end told as ``brief``."""
        self.stats["cut_off"] += 1
        self._reject(peer, f"cut off: {reason}")
        self._drop(peer, f"cut off: {brief or reason}", cut=True)

    def _drop(self, peer: Peer, reason: str, *, cut: bool, quiet: bool = False) -> None:
        with self._lock:
            if self._peers.pop(peer.sock, None) is None:
                return
            self._gone.append(peer)
        self._pending -= peer.frames.pending
        peer.frames.release()
        peer.end = reason
        if peer.pidfd is not None:
            with contextlib.suppress(OSError):
                os.close(peer.pidfd)
            peer.pidfd = None
        if peer.authorized:
            with contextlib.suppress(KeyError, ValueError):
                self._sel.unregister(peer.sock)
        with contextlib.suppress(OSError):
            peer.sock.close()
        if cut:  # already logged by _reject
            self._status("degraded", f"pid {peer.pid}: {reason}", log_it=False)
        elif not quiet and not peer.said_bye and peer.active:
            self.stats["ended_early"] += 1
            self._status("ended_early", f"pid {peer.pid}: {reason} without saying bye; its last records may be lost")

    def _status(self, status: str, detail: str, *, log_it: bool = True) -> None:
        if log_it:
            self._log(status, detail)
        self._forward([SourceStatus(clock.monotonic_ns(), self.name, status, detail)])

    def _withdraw_offers(self) -> None:
        with self._lock:
            offers = self._offers + self._withdrawn
            self._offers, self._withdrawn = [], []
            self._stopped_offers = True
        for offer in offers:
            offer.close()


def _countable(groups: Any) -> int:
    """Records in a refused batch, as far as its shape lets them be counted."""
    if not isinstance(groups, list):
        return 0
    return sum(len(g[1]) for g in groups if isinstance(g, list) and len(g) == 2 and isinstance(g[1], list))
