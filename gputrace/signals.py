"""Stop signals, handled the one way the CLI and the capture session both need."""

from __future__ import annotations

import signal
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

# Stop signals this process was started with ignored (a job started in the background by a script, nohup),
# read when this module is first imported, before any handler of ours: a command we launch gets them back.
INHERITED_IGNORED = frozenset(sig for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
                              if signal.getsignal(sig) is signal.SIG_IGN)  # fmt: skip


def on_signals(sigs: Sequence[int], handler: Callable[[int, Any], None]) -> Callable[[], None]:
    """Install ``handler`` for ``sigs``; returns what restores the previous handlers. A SIGHUP the caller
    ignores (as under nohup) stays ignored. Only the main thread can install handlers: elsewhere, nothing."""
    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    previous = {sig: signal.getsignal(sig) for sig in sigs
                if sig != signal.SIGHUP or signal.getsignal(sig) is not signal.SIG_IGN}  # fmt: skip
    for sig in previous:
        signal.signal(sig, handler)

    def restore() -> None:
        for sig, old in previous.items():
            signal.signal(sig, old)

    return restore


@contextmanager
def held(sigs: Sequence[int] = STOP_SIGNALS) -> Iterator[None]:
    """Stop signals held inside the block and delivered as it ends: for a step that must not be cut between
    making a file and recording where the cleanup will find it (a handler that raises would leave it behind)."""
    old = signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
