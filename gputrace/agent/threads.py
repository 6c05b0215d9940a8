"""Threads the agent starts inside the target."""

from __future__ import annotations

import _thread
import contextlib
import sys
import time
from collections.abc import Callable
from typing import Any


def start_thread(fn: Callable[..., Any], *args: Any) -> None:
    """A daemon thread, without threading.Thread.start()'s wait for it to run: under CPU contention
    that wait would be paid by the target's own startup."""
    _thread.start_new_thread(_quietly, (fn, args))


def _quietly(fn: Callable[..., Any], args: tuple[Any, ...]) -> None:
    """Nothing of ours may print into the target's stderr, not even a dying thread's traceback."""
    try:
        fn(*args)
    except BaseException as e:  # noqa: BLE001
        debug("thread ended: %s", e)


def debug(msg: str, *args: Any) -> None:
    """Debug logging only, and only if the target uses logging: importing it just to discard is not free.
    Never raises: the target's main thread may be importing logging right now (torch, asyncio and
    concurrent.futures do at startup), and a module still being initialized may lack getLogger."""
    logging = sys.modules.get("logging")
    if logging is None or getattr(getattr(logging, "__spec__", None), "_initializing", False):
        return
    with contextlib.suppress(Exception):  # a half-made or replaced logging module is not ours to fix
        logging.getLogger("gputrace.agent").debug("gputrace agent: " + msg, *args)


class CpuMeter:
    """CPU time the agent's own work took in this process, summed over the threads it ran on, so that the
    session can say what tracing cost the target. Threads of the agent's own count whole; work done on
    another thread (CUPTI's, the target's) is timed around the work."""

    def __init__(self) -> None:
        self._lock = _thread.allocate_lock()
        self._ns = 0

    def add(self, ns: int) -> None:
        if ns > 0:
            with self._lock:
                self._ns += ns

    def since(self, start_ns: int) -> int:
        """Adds this thread's CPU time since ``start_ns`` (a time.thread_time_ns()); returns the time now."""
        now = time.thread_time_ns()
        self.add(now - start_ns)
        return now

    @property
    def ns(self) -> int:
        return self._ns


CPU = CpuMeter()
