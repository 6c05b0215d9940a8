"""The agent inside a traced process: one connection to a session, a bounded record queue, one I/O thread.

Backends (CUPTI, the simulated device) hand records to ``Agent.submit`` from any thread; it never blocks
and counts what does not fit. The I/O thread sends hello, starts the backends when the session says
``start``, ships batches every ``flush_s`` and says bye on ``stop`` or at exit. Nothing here may change
what the target does: no output, no exceptions into its threads, no waits longer than the exit budget.
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from gputrace.agent import wire
from gputrace.agent.backend import GpuBackend
from gputrace.agent.threads import CPU, start_thread
from gputrace.agent.threads import debug as _debug

QUEUE_MAX_RECORDS = 65536
FLUSH_S = 0.1
FLUSH_RECORDS = 4096  # or sooner, when this many are waiting
ROWS_PER_FRAME = 512
SEND_TIMEOUT_S = 5.0
EXIT_BUDGET_S = 2.0
FORKED_AFTER_START = ("forked from a process where it was running: CUDA cannot run in a child forked after it "
                      "started (start workers with the spawn method to trace their GPU work)")


class RecordQueue:
    """Bounded, lock-protected list of records; overflow is counted, never waited on."""

    def __init__(self, limit: int = QUEUE_MAX_RECORDS) -> None:
        self.limit = limit
        self.dropped = 0
        self._items: list[tuple[Any, ...]] = []
        self._lock = threading.Lock()

    def put(self, records: Sequence[tuple[Any, ...]]) -> int:
        """Queue what fits; returns how many records are now waiting."""
        with self._lock:
            room = self.limit - len(self._items)
            if room >= len(records):
                self._items.extend(records)
            else:
                self._items.extend(records[: max(room, 0)])
                self.dropped += len(records) - max(room, 0)
            return len(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def take(self) -> list[tuple[Any, ...]]:
        with self._lock:
            items, self._items = self._items, []
        return items

    def reset_after_fork(self) -> None:
        """The parent's pending records are the parent's to send."""
        self._lock = threading.Lock()
        self._items = []


def group_rows(records: Sequence[tuple[Any, ...]]) -> list[list[Any]]:
    """[[kind, rows], ...] in the order kinds first appear."""
    by_kind: dict[str, list[tuple[Any, ...]]] = {}
    for r in records:
        by_kind.setdefault(type(r).__name__, []).append(r)
    return [[k, rows] for k, rows in by_kind.items()]


class Agent:
    """One process's agent, talking to the session listening at ``sock_path``."""

    def __init__(self, sock_path: str, *, eager: bool = False, flush_s: float = FLUSH_S) -> None:
        self.sock_path = sock_path
        # Eager: the session launched us and wants everything from the first launch on, so backends
        # record into the queue before the session's start arrives. Otherwise they wait for start.
        self.eager = eager
        self.flush_s = flush_s
        self.discover: Callable[[Agent], None] | None = None  # finds backends off the target's threads
        self.queue = RecordQueue()
        self.backends: list[GpuBackend] = []
        self.unavailable: dict[str, str] = {}
        self.started = eager
        self._running: set[int] = set()
        self._hello_sent = False
        self._woken = False
        self._sent_drops: dict[str, int] = {}
        self.lost = 0  # records that could not be sent (session gone mid-batch, oversized rows)
        self._drops_base: dict[str, int] = {}  # the totals when the last session ended
        self._cpu_base = CPU.ns  # likewise the agent's CPU time (gputrace.agent.threads.CpuMeter)
        self._sent_cpu_ns = 0
        self._sock: socket.socket | None = None
        self._closing = threading.Event()
        self._done = threading.Event()
        self.answered = threading.Event()  # the session took this agent (start) or sent it away (stop)
        self._lock = threading.Lock()
        self._io: int | None = None  # ident of the thread serving a session
        self._pending = False  # connect() called, its thread maybe not running yet
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        # Load the codec and the record kinds now, on the creating thread: were the I/O thread importing them
        # when the target forks, the child would inherit a held import lock and its own agent could never encode.
        wire.codec()
        from gputrace.records import AgentThread

        self._own_thread = AgentThread

    # ------------------------------------------------------------------------------ backends ---
    def submit(self, records: Sequence[tuple[Any, ...]]) -> None:
        """The emit callback given to backends: any thread, never blocks."""
        if records and self.queue.put(records) >= FLUSH_RECORDS and not self._woken:
            self._woken = True
            self._wake()

    def add_backend(self, backend: GpuBackend) -> None:
        """Add a backend; started at once when a session already said start."""
        with self._lock:
            if any(b is backend for b in self.backends):
                return
            self.backends.append(backend)
            if self.started:
                # A backend that arrives after hello is announced in-band; before, hello names it.
                self._start_backend(backend, announce=self._hello_sent)

    def _start_backend(self, backend: GpuBackend, *, announce: bool) -> None:
        if id(backend) in self._running:
            return
        self._running.add(id(backend))
        try:
            backend.start(self.submit)
        except Exception as e:  # noqa: BLE001 - a broken backend must not break the target
            self.unavailable[backend.name] = f"start failed: {e}"
            _debug("backend %s failed to start: %s", backend.name, e)
            return
        if announce:
            self.submit([agent_info(backend.name, backend_info(backend))])

    def _start_backends(self) -> None:
        with self._lock:
            self.started = True
            for b in self.backends:
                self._start_backend(b, announce=False)

    def _stop_backends(self) -> None:
        with self._lock:
            self.started = False
            backends = [b for b in self.backends if id(b) in self._running]
            self._running.clear()
        for b in backends:
            try:
                b.stop()  # forced flush into the queue
            except Exception as e:  # noqa: BLE001
                _debug("stopping %s: %s", b.name, e)

    def _total_drops(self) -> dict[str, int]:
        """Everything lost since this process started (or forked), by kind."""
        counts = {"queue": self.queue.dropped, "send": self.lost}
        for b in self.backends:
            with contextlib.suppress(Exception):
                counts.update({str(k): int(v) for k, v in b.drops().items()})
        return counts

    def drop_counts(self) -> dict[str, int]:
        """What this session lost: the totals less what they were when the last session ended (an earlier
        session's losses, a killed one's included, are not this one's)."""
        base = self._drops_base
        return {k: max(0, v - base.get(k, 0)) for k, v in self._total_drops().items()}

    def cpu_ns(self) -> int:
        """The agent's CPU time in this process since this session began."""
        return max(0, CPU.ns - self._cpu_base)

    # ---------------------------------------------------------------------------- connection ---
    def connect(self, retry_s: float = 5.0) -> None:
        """Start the I/O thread; it connects (retrying while the session's socket appears)."""
        self._done.clear()
        self._pending = True
        start_thread(self.serve, retry_s)

    def close(self, budget_s: float = EXIT_BUDGET_S) -> None:
        """Flush, say bye and disconnect, waiting at most ``budget_s`` (called at exit)."""
        self._closing.set()
        self._wake()
        if (self._pending or self._io is not None) and self._io != threading.get_ident():
            self._done.wait(budget_s)

    @property
    def connected(self) -> bool:
        return self._sock is not None

    def _wake(self) -> None:
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    def serve(self, retry_s: float = 5.0) -> None:
        """One session, start to bye, on the calling thread."""
        self._io = threading.get_ident()
        self._done.clear()
        try:
            if self.discover is not None:
                discover, self.discover = self.discover, None
                try:
                    discover(self)
                except Exception as e:  # noqa: BLE001 - no CUPTI must not mean no session (the sim still reports)
                    _debug("backend discovery failed: %s", e)
            sock = self._dial(retry_s)
            if sock is None:
                return
            self._sock = sock
            with self._lock:
                greeting, self._hello_sent = hello(self), True
            self._send(greeting)
            # this thread's time (encoding, sending, the GIL it holds meanwhile) is the tracing's, not the job's;
            # sent past the queue, whose room is the target's records'
            self._send_rows([self._own_thread(time.clock_gettime_ns(time.CLOCK_MONOTONIC), os.getpid(),
                                              threading.get_native_id(), "io")])
            self._loop(sock)
        except Exception as e:  # noqa: BLE001 - the session went away or broke the protocol
            _debug("session connection ended: %s", e)
        finally:
            self._hang_up()

    def _dial(self, retry_s: float) -> socket.socket | None:
        # One attempt is made even while closing (an exit right after startup still delivers what it
        # recorded), but no retries: a process must not linger at exit for a session that is gone.
        deadline = time.monotonic() + retry_s
        while True:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
            try:
                s.connect(self.sock_path)
                s.settimeout(SEND_TIMEOUT_S)
                return s
            except OSError as e:
                s.close()
                if time.monotonic() >= deadline or self._closing.is_set():
                    _debug("cannot reach session at %s: %s", self.sock_path, e)
                    return None
                self._closing.wait(0.05)

    def _loop(self, sock: socket.socket) -> None:
        frames = wire.FrameBuffer()
        next_flush = time.monotonic() + self.flush_s
        cpu = time.thread_time_ns()  # this thread is the agent's: all of its CPU time is tracing's
        while not self._closing.is_set():
            cpu = CPU.since(cpu)
            timeout = max(0.0, next_flush - time.monotonic())
            watched: list[Any] = [sock, self._wake_r]
            readable, _, _ = select.select(watched, [], [], timeout)
            if self._wake_r in readable:
                with contextlib.suppress(OSError):
                    os.read(self._wake_r, 4096)
                self._woken = False
            if sock in readable:
                data = sock.recv(65536)
                if not data:
                    raise ConnectionError("session closed the connection")
                for body in frames.feed(data):
                    if self._handle(wire.decode_body(body)):
                        return
            if time.monotonic() >= next_flush or len(self.queue) >= FLUSH_RECORDS:
                self._flush()
                next_flush = time.monotonic() + self.flush_s
        self._finish()

    def _handle(self, msg: dict[str, Any]) -> bool:
        """React to a session message; True when this session is over."""
        self.answered.set()
        if msg["type"] == "start":
            flush_ms = msg.get("flush_ms")
            if isinstance(flush_ms, int) and 10 <= flush_ms <= 10_000:
                self.flush_s = flush_ms / 1000
            self._start_backends()
        elif msg["type"] == "stop":
            self._finish()
            return True
        return False

    def _finish(self) -> None:
        self._stop_backends()
        self._flush()
        self._send({"type": "cost", "cpu_ns": self.cpu_ns()})
        self._send({"type": "drops", "counts": self.drop_counts()})
        self._send({"type": "bye"})

    def _flush(self) -> None:
        records = self.queue.take()
        for i in range(0, len(records), ROWS_PER_FRAME):
            self._send_rows(records[i : i + ROWS_PER_FRAME])
        counts = self.drop_counts()
        if counts != self._sent_drops and any(counts.values()):
            # Sent as they change, not only at bye: a killed process's losses are still on record.
            self._send({"type": "drops", "counts": counts})
            self._sent_drops = counts
        if self.cpu_ns() != self._sent_cpu_ns:
            self._sent_cpu_ns = self.cpu_ns()
            self._send({"type": "cost", "cpu_ns": self._sent_cpu_ns})

    def _send_rows(self, records: Sequence[tuple[Any, ...]]) -> None:
        try:
            frame = wire.encode({"type": "batch", "records": group_rows(records)})
        except wire.FrameError:
            if len(records) == 1:
                self.lost += 1
                return
            half = len(records) // 2
            self._send_rows(records[:half])
            self._send_rows(records[half:])
            return
        self._send_frame(frame, len(records))

    def _send(self, msg: dict[str, Any]) -> None:
        self._send_frame(wire.encode(msg), 0)

    def _send_frame(self, frame: bytes, nrecords: int) -> None:
        if self._sock is None:
            self.lost += nrecords
            return
        try:
            self._sock.sendall(frame)
        except OSError:
            self.lost += nrecords
            raise

    def _hang_up(self) -> None:
        if self.started:
            self._stop_backends()
        self.lost += len(self.queue.take())
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()
            self._sock = None
        self._hello_sent = False
        self._sent_drops = {}
        self._drops_base = self._total_drops()  # what the next session reports starts from here
        self._cpu_base, self._sent_cpu_ns = CPU.ns, 0
        self._done.set()

    # ------------------------------------------------------------------------------------ fork ---
    def reset_after_fork(self) -> None:
        """In a forked child: the connection and threads are the parent's; keep only the backends."""
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.close()  # only this process's reference: the parent's connection lives on
            self._sock = None
        self._lock = threading.Lock()
        self.queue.reset_after_fork()
        self.queue.dropped = 0
        self._sent_drops = {}
        self.lost = 0
        self._drops_base = {}
        self._cpu_base, self._sent_cpu_ns = CPU.ns, 0
        self._io = None
        self._pending = False
        self._closing = threading.Event()
        self._done = threading.Event()
        self.answered = threading.Event()  # the session took this agent (start) or sent it away (stop)
        self.started = self.eager
        self._hello_sent = False
        # A backend that ran in the parent stays with the parent unless it declares itself fork-safe: CUDA
        # cannot run in a child forked after it started (a DataLoader worker), and this child's hello must
        # not claim GPU tracing it does not do. One never started here may still start in the child.
        for b in [b for b in self.backends if id(b) in self._running and not getattr(b, "fork_safe", False)]:
            self.backends.remove(b)
            self.unavailable[b.name] = FORKED_AFTER_START
        self._running = set()
        if self.eager:
            # Only backends that declare it may run again in a forked child (CUDA itself may not).
            for b in self.backends:
                if getattr(b, "fork_safe", False):
                    self._start_backend(b, announce=False)
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)


# ------------------------------------------------------------------------------------- messages ---
def backend_info(backend: GpuBackend) -> dict[str, str]:
    try:
        return {str(k): str(v) for k, v in backend.info().items()}
    except Exception:  # noqa: BLE001
        return {}


def interpreter() -> str:
    return f"{sys.implementation.name} {sys.version.split()[0]} {sys.executable}"


def hello(agent: Agent) -> dict[str, Any]:
    infos = [backend_info(b) for b in agent.backends]

    def first(key: str) -> str:
        return next((i[key] for i in infos if i.get(key)), "")

    return {
        "type": "hello",
        "protocol": wire.PROTOCOL,
        "pid": os.getpid(),
        "tid": threading.main_thread().native_id or threading.get_native_id(),
        "interpreter": interpreter(),
        "cuda_version": first("cuda_version"),
        "driver_version": first("driver_version"),
        "backends": [b.name for b in agent.backends],
        "unavailable": dict(agent.unavailable),
    }


def agent_info(source: str, info: dict[str, str]) -> tuple[Any, ...]:
    """Called on the registering thread (never the I/O thread), so importing here is fork-safe."""
    from gputrace.records import AgentInfo

    return AgentInfo(
        time.clock_gettime_ns(time.CLOCK_MONOTONIC), os.getpid(), threading.get_native_id(), interpreter(),
        info.get("cuda_version", ""), info.get("driver_version", ""), source,
    )
