"""Threads the agent starts inside the target."""

from __future__ import annotations

import _thread
import sys
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
        logging = sys.modules.get("logging")
        if logging is not None:
            logging.getLogger("gputrace.agent").debug("gputrace agent: thread ended: %s", e)
