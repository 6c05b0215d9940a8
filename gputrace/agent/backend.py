"""The interface every GPU-side record producer implements inside the traced process.

The agent runtime owns the channel to the session; a backend only turns GPU activity into
typed records (gputrace.records) and hands them to ``emit``. Implementations: the CUPTI
backend (gputrace.probes.cupti.CuptiBackend) and the simulated device (gputrace.sim).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol, runtime_checkable

Emit = Callable[[Sequence[tuple[Any, ...]]], None]


@runtime_checkable
class GpuBackend(Protocol):
    name: str  # "cupti", "sim"

    def start(self, emit: Callable[[Sequence[tuple[Any, ...]]], None]) -> None:
        """Begin producing records; ``emit`` may be called from any thread."""
        ...

    def stop(self) -> None:
        """Forced flush: everything still pending goes to ``emit`` before this returns."""
        ...

    def drops(self) -> dict[str, int]:
        """Cumulative losses by where they happened (e.g. {"cupti": n})."""
        ...

    def info(self) -> dict[str, str]:
        """Versions and facts for the hello message: cuda_version, driver_version, ..."""
        ...
