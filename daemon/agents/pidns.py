"""An agent's own pid and tids against the host's, for a process in another pid namespace (a container).

The agent reports ids as it sees them (getpid, gettid: CUPTI's SYSTEM thread ids, the simulated device's
native ids); the capture and the eBPF records use the session's. SO_PEERCRED gives the peer's pid in the
session's namespace; /proc/PID/status (`NSpid`: the id in each namespace, outermost first) gives the pid
the agent sees, and each thread's status maps its tids. Only the peer's own threads are ever mapped, so a
peer cannot make its records name another process's threads; a tid that maps to none of them becomes 0
(no thread) and is counted.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from gputrace.probes.procfs import ns_chain, ns_pid

PROC = Path("/proc")
_RESCAN_S = 0.02  # at most this often per peer: a peer sending unknown tids cannot keep /proc busy
_MAX_THREADS = 65536


class PeerIds:
    """Ids of one agent peer. ``nested`` when it lives in a pid namespace below the session's."""

    def __init__(self, host_pid: int, proc: Path = PROC) -> None:
        self.host_pid = host_pid
        self._task_dir = proc / str(host_pid) / "task"
        own = ns_pid(host_pid, proc / str(host_pid) / "status")
        self.nested = own != 0
        self.own_pid = own or host_pid
        self._tids: dict[int, int] = {}
        self._scanned = 0.0
        self.unmapped = 0

    def tid(self, own: int) -> int:
        """The session's tid for the peer's thread ``own`` (0: not one of the peer's threads)."""
        if not self.nested:
            return own
        host = self._tids.get(own)
        if host is None and self._rescan():
            host = self._tids.get(own)
        if host is None:
            self.unmapped += 1
            return 0
        return host

    def _rescan(self) -> bool:
        now = time.monotonic()
        if now - self._scanned < _RESCAN_S:
            return False
        self._scanned = now
        try:
            names = os.listdir(self._task_dir)[:_MAX_THREADS]
        except OSError:
            return False
        if len(self._tids) > _MAX_THREADS:
            self._tids.clear()
        for name in names:
            chain = ns_chain(self._task_dir / name / "status")
            if len(chain) > 1 and str(chain[0]) == name:
                self._tids[chain[-1]] = chain[0]
        return True
