"""One thread for the periodic checks of many sessions.

A capture's session wakes every ``Pacing.wait_s`` to ask whether it should stop (its targets gone, a write
error) and to tick its cost meter. Watch mode runs a session per job in one service process: N jobs were N
threads each waking once a second for a few hundred microseconds of work, most of it the wakeup itself on a
loaded or virtual host. A ``Ticker`` runs every session's check in one thread, once a period; each session's
own thread sleeps until its check (or whoever asked it to stop) sets its stop event (daemon/session.py).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

from gputrace.threads import Thread

Check = Callable[[], bool]  # run once a period; False: done, not run again


class Ticker:
    """Runs each added check once every ``period_s``, in one thread, started with the first check."""

    def __init__(self, period_s: float, name: str = "gputraced-tick") -> None:
        self.period_s = period_s
        self.name = name
        self._checks: list[Check] = []
        self._lock = threading.Lock()  # the list of checks
        self._running = threading.Lock()  # held while a round of checks runs
        self._closed = threading.Event()
        self._thread: Thread | None = None
        self.rounds = 0

    def add(self, check: Check) -> None:
        with self._lock:
            if self._closed.is_set():
                raise RuntimeError("the ticker is closed")
            self._checks.append(check)
            if self._thread is None:
                self._thread = Thread(target=self._run, name=self.name, daemon=True)
                self._thread.start()

    def remove(self, check: Check) -> None:
        """``check`` is not run again, nor running once this returns."""
        with self._lock:
            if check in self._checks:
                self._checks.remove(check)
        if self._thread is not threading.current_thread():
            with self._running:  # a round under way finishes first
                pass

    def __len__(self) -> int:
        with self._lock:
            return len(self._checks)

    def close(self) -> None:
        """Stop the thread; checks still added are not run again."""
        with self._lock:
            self._closed.set()
            thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join()

    def _run(self) -> None:
        while not self._closed.wait(self.period_s):
            with self._running:
                with self._lock:
                    checks = list(self._checks)
                done = [check for check in checks if not _keeps(check)]
                if done:
                    with self._lock:
                        self._checks = [c for c in self._checks if c not in done]
                self.rounds += 1


def _keeps(check: Check) -> bool:
    """Run ``check``: whether it is to run again. One that raises is dropped (its owner's check must say why
    to its owner: a session's does, daemon/session.py)."""
    try:
        return bool(check())
    except Exception:  # noqa: BLE001 - one session's failure must not end the others' checks
        return False
