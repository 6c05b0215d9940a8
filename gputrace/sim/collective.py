"""A simulated process group: ranks in separate processes meet over a socket for each collective.

Rank 0 listens at ``address`` (``host:port`` for TCP, anything else is a unix socket path); the other
ranks connect to it. Rank 0 makes the group's communicator id (or takes ``comm_id``) and hands it to every
rank as it joins, as NCCL's unique id is made on one rank and sent to the others: all ranks of one group, on
whatever hosts, share it, and two groups do not. For collective number ``seq`` each rank's stream reports its
arrival when the collective kernel reaches the head of the stream; rank 0 answers every rank once all have
arrived. So a rank that arrives late holds everyone else's collective kernel on the device, as NCCL's would.
Line protocol: ``H <rank>`` (hello), ``C <comm id>`` (the answer to hello), ``A <seq>`` (arrived), ``G <seq>``
(go).
"""

from __future__ import annotations

import contextlib
import os
import re
import socket
import threading
import time

CONNECT_TIMEOUT_S = 60.0
MAX_LINE = 64
COMM_ID = re.compile(r"^[0-9a-zA-Z_.-]{1,40}$")  # what a communicator id may be: it names a trace


def _now() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def _open(address: str) -> tuple[socket.AddressFamily, str | tuple[str, int]]:
    host, sep, port = address.rpartition(":")
    if sep and port.isdigit() and "/" not in address:
        return socket.AF_INET, (host or "127.0.0.1", int(port))
    return socket.AF_UNIX, address.removeprefix("unix:")


class _LineReader:
    """Complete lines from a peer; overlong or odd lines are skipped."""

    def __init__(self, conn: socket.socket) -> None:
        self.conn = conn
        self._pending = b""

    def lines(self) -> list[str] | None:
        """What has arrived, as lines; None on EOF."""
        try:
            data = self.conn.recv(4096)
        except TimeoutError:
            raise
        except OSError:
            return None
        if not data:
            return None
        *lines, rest = (self._pending + data).split(b"\n")
        self._pending = rest if len(rest) <= MAX_LINE else b""
        return [ln.decode("ascii", "replace") for ln in lines if len(ln) <= MAX_LINE]


def _parse(line: str, tag: str) -> int | None:
    parts = line.split()
    if len(parts) == 2 and parts[0] == tag and parts[1].isdigit():
        return int(parts[1])
    return None


class ProcessGroup:
    """``ProcessGroup(rank, world, address)``; blocks until all ranks joined (or ``timeout_s``)."""

    def __init__(self, rank: int, world: int, address: str, *, timeout_s: float = CONNECT_TIMEOUT_S,
                 comm_id: str | None = None) -> None:
        if not (isinstance(world, int) and world >= 1 and isinstance(rank, int) and 0 <= rank < world):
            raise ValueError(f"need 0 <= rank < world, got rank={rank!r} world={world!r}")
        if comm_id is not None and not COMM_ID.match(comm_id):
            raise ValueError(f"a communicator id is 1-40 letters, digits, '_', '.' or '-', not {comm_id!r}")
        self.rank, self.world, self.address = rank, world, address
        # rank 0's is the group's; the others learn it when they join
        self.comm_id = (comm_id or os.urandom(8).hex()) if rank == 0 else ""
        self.broken = ""
        self._seq = 0
        self._cond = threading.Condition()
        self._arrived: dict[int, set[int]] = {}
        self._go: dict[int, int] = {}
        self._peers: list[socket.socket] = []
        self._send_lock = threading.Lock()
        family, addr = _open(address)
        if rank == 0:
            self._serve(family, addr, timeout_s)
        else:
            self._join(family, addr, timeout_s)

    def next_seq(self) -> int:
        self._seq += 1
        return self._seq

    # ------------------------------------------------------------------------------- setting up ---
    def _serve(self, family: socket.AddressFamily, addr: str | tuple[str, int], timeout_s: float) -> None:
        with socket.socket(family, socket.SOCK_STREAM) as ls:
            if family == socket.AF_INET:
                ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            ls.bind(addr)
            ls.listen(self.world)
            ls.settimeout(timeout_s)
            try:
                for _ in range(self.world - 1):
                    conn, _ = ls.accept()
                    conn.settimeout(None)
                    conn.sendall(f"C {self.comm_id}\n".encode())
                    self._peers.append(conn)
            except TimeoutError:
                raise TimeoutError(f"rank 0: only {len(self._peers) + 1} of {self.world} ranks joined") from None
            finally:
                if family == socket.AF_UNIX:
                    with contextlib.suppress(OSError):
                        os.unlink(str(addr))
        for conn in self._peers:
            threading.Thread(target=self._read_peer, args=(conn,), name="sim-pg-peer", daemon=True).start()

    def _join(self, family: socket.AddressFamily, addr: str | tuple[str, int], timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            s = socket.socket(family, socket.SOCK_STREAM)
            try:
                s.connect(addr)
                break
            except OSError:
                s.close()
                if time.monotonic() >= deadline:
                    raise TimeoutError(f"rank {self.rank}: rank 0 not reachable at {self.address}") from None
                time.sleep(0.02)
        s.sendall(f"H {self.rank}\n".encode())
        self._peers.append(s)
        reader = _LineReader(s)
        self.comm_id = self._communicator(reader, deadline)
        threading.Thread(target=self._read_root, args=(reader,), name="sim-pg-root", daemon=True).start()

    def _communicator(self, reader: _LineReader, deadline: float) -> str:
        """The group's id, rank 0's first line to a joining rank (nothing else comes before it: rank 0 sends
        ``G`` only once this rank has said ``A``)."""
        reader.conn.settimeout(max(deadline - time.monotonic(), 0.1))
        try:
            while (lines := reader.lines()) is not None:
                for line in lines:
                    parts = line.split()
                    if len(parts) == 2 and parts[0] == "C" and COMM_ID.match(parts[1]):
                        reader.conn.settimeout(None)
                        return parts[1]
        except TimeoutError:
            pass
        raise TimeoutError(f"rank {self.rank}: rank 0 at {self.address} sent no communicator id")

    # -------------------------------------------------------------------------------- messaging ---
    def _read_peer(self, conn: socket.socket) -> None:
        rank, reader = -1, _LineReader(conn)
        while (lines := reader.lines()) is not None:
            for line in lines:
                r = _parse(line, "H")
                if r is not None and 0 < r < self.world:
                    rank = r
                seq = _parse(line, "A")
                if seq is not None and rank > 0:
                    self._arrive(seq, rank)
        self._break(f"rank {rank} left")

    def _read_root(self, reader: _LineReader) -> None:
        while (lines := reader.lines()) is not None:
            for line in lines:
                seq = _parse(line, "G")
                if seq is not None:
                    with self._cond:
                        self._go[seq] = _now()
                        self._cond.notify_all()
        self._break("rank 0 left")

    def _arrive(self, seq: int, rank: int) -> None:
        with self._cond:
            ranks = self._arrived.setdefault(seq, set())
            ranks.add(rank)
            if len(ranks) < self.world:
                return
            del self._arrived[seq]
            self._go[seq] = _now()
            self._cond.notify_all()
        with self._send_lock:
            for conn in self._peers:
                with contextlib.suppress(OSError):
                    conn.sendall(f"G {seq}\n".encode())

    def _break(self, why: str) -> None:
        with self._cond:
            self.broken = self.broken or why
            self._cond.notify_all()

    def rendezvous(self, seq: int, start_ns: int) -> int:
        """Called by the stream when collective ``seq`` starts; returns when every rank has arrived."""
        if self.rank == 0:
            self._arrive(seq, 0)
        else:
            with self._send_lock, contextlib.suppress(OSError):
                self._peers[0].sendall(f"A {seq}\n".encode())
        with self._cond:
            while seq not in self._go and not self.broken:
                self._cond.wait()
            # A broken group ends the collective now rather than hanging the stream forever.
            return self._go.pop(seq, _now())

    def close(self) -> None:
        for conn in self._peers:
            with contextlib.suppress(OSError):
                conn.close()

    def __enter__(self) -> ProcessGroup:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
