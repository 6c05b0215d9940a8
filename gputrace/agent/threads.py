"""Threads the agent starts inside the target."""

from __future__ import annotations

import _thread
import contextlib
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
