"""A process's fd table as the kernel decoder replays it, remembering what each fd held before it changed.

An io_uring request is recorded when it completes, but names the file its fd held when it was submitted: a
program may close the fd (or reuse its number) while the request is in flight, as the kernel holds the file.
"""

from __future__ import annotations

HISTORY = 4  # earlier holders kept per fd (older ones become one unknown holder)


class FdTable(dict[int, str]):
    """fd -> object (path, peer, "pipe"), plus, per fd, the objects it held before and until when (the ns of
    the event that changed it). ``now`` is the time of the event being replayed; set it before changing the
    table."""

    __slots__ = ("gone", "now")

    def __init__(self, *args: dict[int, str]) -> None:
        super().__init__(*args)
        self.gone: dict[int, list[tuple[int, str]]] = {}
        self.now = 0

    def __setitem__(self, fd: int, obj: str) -> None:
        self._retire(fd, obj)
        super().__setitem__(fd, obj)

    def drop(self, fd: int) -> str:
        """Forget ``fd`` (closed, replaced by an unknown file); what it held, or ""."""
        self._retire(fd, "")
        return super().pop(fd, "")

    def at(self, fd: int, t: int) -> str:
        """What ``fd`` held at ``t``: the first earlier holder it still had then, else what it holds now."""
        for until, obj in self.gone.get(fd, ()):
            if t < until:
                return obj
        return self.get(fd, "")

    def _retire(self, fd: int, new: str) -> None:
        old = self.get(fd)
        if old and old != new:
            history = self.gone.setdefault(fd, [])
            history.append((self.now, old))
            if len(history) > HISTORY + 1:  # before the holders kept: unknown, never an older one's name
                cut = len(history) - HISTORY
                history[:] = [(history[cut - 1][0], ""), *history[cut:]]
