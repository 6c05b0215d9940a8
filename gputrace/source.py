"""The interface every data source implements, and the sink it writes into.

A Source produces records while a capture runs; it never analyses. The session starts each source with a
Sink, stops it at the end, and reads its drop counts into the capture's trailer.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Protocol


class Sink(Protocol):
    """Where sources put what they collect. Thread-safe; never blocks for long."""

    def emit(self, records: Sequence[tuple[Any, ...]]) -> None:
        """Typed records (gputrace.records) of any kinds."""

    def emit_kernel(self, blob: bytes, nevents: int) -> None:
        """Raw kernel events, decoded on read by gputrace.probes.ebpf.events."""

    def emit_meta(self, source: str, meta: dict[str, Any]) -> None:
        """A source's metadata (written before the records that need it)."""


class Source(Protocol):
    name: str

    def start(self, sink: Sink) -> None:
        """Begin producing records into ``sink``. Raise UserError if the source cannot run at all."""

    def stop(self) -> None:
        """Stop and hand everything still pending to the sink."""

    def drops(self) -> dict[str, int]:
        """Cumulative records lost, by where they were lost (ringbuf, queue, cupti, ...)."""
