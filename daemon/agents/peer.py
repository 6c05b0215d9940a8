"""One agent connected to the session's agent socket: the state the AgentServer keeps per peer."""

from __future__ import annotations

import socket
import time
from typing import TYPE_CHECKING, Any

from gputrace.agent import wire
from gputrace.daemon.agents.pidns import PeerIds
from gputrace.pidfds import pidfd_exited

if TYPE_CHECKING:
    from gputrace.daemon.agents.server import Budget


class Peer:
    """One connected agent: its socket, its identity and pidfd, and what it said and sent."""

    def __init__(self, sock: socket.socket, pid: int, uid: int, *, hello_bytes: int = wire.MAX_FRAME_BYTES) -> None:
        self.sock, self.pid, self.uid = sock, pid, uid
        self.pidfd: int | None = None
        self.vanished = False  # gone before it could be pinned (kernels before 6.16)
        self.frames = wire.FrameBuffer(first_max=hello_bytes)  # a stranger's first frame stays small
        self.hello: dict[str, Any] | None = None
        self.since = time.monotonic()
        self.authorized = False
        self.said_bye = False
        self.sent_stop = False
        self.records = 0
        self.gpu_records = 0  # records of GPU work: an agent's naming of its own threads is not any
        self.drops: dict[str, int] = {}
        self.cpu_ns = 0  # the agent's own CPU time this session, as it last said
        self.over_budget = 0  # records in batches dropped for going over its budget (see AgentLimits)
        self.records_budget: Budget | None = None  # made at hello
        self.bytes_budget: Budget | None = None
        self.end = ""
        self.ids: PeerIds | None = None  # its ids as it sees them, read at hello

    @property
    def active(self) -> bool:
        """Had GPU work to report: only then does losing it mid-capture matter."""
        return self.gpu_records > 0 or bool(self.hello and self.hello["backends"])

    def exited(self) -> bool:
        return self.vanished or (self.pidfd is not None and pidfd_exited(self.pidfd))

    def summary(self) -> dict[str, Any]:
        h = self.hello or {}
        ns = {"pid_in_namespace": self.ids.own_pid} if self.ids and self.ids.nested else {}
        return {"pid": self.pid, **ns, "uid": self.uid, "interpreter": h.get("interpreter", ""),
                "backends": h.get("backends", []), "unavailable": h.get("unavailable", {}),
                "records": self.records, "end": self.end}
