"""The simulated device's side of the agent: a GpuBackend whose records are produced by gputrace.sim.

With no session (or before the session says start) ``emit`` is a no-op and no record is even built:
the simulated device then costs what its sleeps cost and nothing more.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Sequence
from typing import Any

Emit = Callable[[Sequence[tuple[Any, ...]]], None]


class SimBackend:
    name = "sim"
    fork_safe = True  # a forked child may start it again for itself

    def __init__(self) -> None:
        self._emit: Emit | None = None
        self._devices: dict[int, Callable[[], tuple[Any, ...]]] = {}
        self._registered_in = 0  # pid whose agent knows this backend
        self._described: set[tuple[int, int]] = set()  # (pid, device) sent since the last start
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        return self._emit is not None

    def emit(self, records: Sequence[tuple[Any, ...]]) -> None:
        out = self._emit
        if out is not None:
            out(records)

    def start(self, emit: Emit) -> None:
        with self._lock:
            self._emit = emit
            devices = [make() for make in self._devices.values()]
            self._described = {(os.getpid(), d) for d in self._devices}
        emit(devices)

    def stop(self) -> None:
        self._emit = None  # records are handed over as they happen: nothing is pending here

    def drops(self) -> dict[str, int]:
        return {}

    def info(self) -> dict[str, str]:
        return {"device": "gputrace simulated device", "cuda_version": "", "driver_version": ""}

    def add_device(self, dev_id: int, make_record: Callable[[], tuple[Any, ...]]) -> None:
        """Known devices are described to every session this backend starts in."""
        with self._lock:
            self._devices[dev_id] = make_record
        self._register()  # when a session runs, starting us describes every known device
        key = (os.getpid(), dev_id)
        with self._lock:
            fresh = self.enabled and key not in self._described
            self._described.add(key)
        if fresh:
            self.emit([make_record()])

    def _register(self) -> None:
        if self._registered_in != os.getpid():
            from gputrace.agent import arming

            self._registered_in = os.getpid()
            arming.register_backend(self)


BACKEND = SimBackend()
