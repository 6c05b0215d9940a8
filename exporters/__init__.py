"""Exporters: each turns a capture (through its CaptureReader) into one output. One small interface."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from gputrace.capture import CaptureReader


@dataclass
class ExportResult:
    """What an export produced: where it went, how much, and what it could not deliver."""

    target: str
    items: int = 0
    dropped: int = 0
    notes: list[str] = field(default_factory=list)


class Exporter(Protocol):
    def write(self, reader: CaptureReader) -> ExportResult: ...
