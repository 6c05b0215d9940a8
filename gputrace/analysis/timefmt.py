"""Durations and sizes as the reports print them."""

from __future__ import annotations


def fmt_ms(ns: int) -> str:
    return f"{ns / 1e6:.1f} ms"


def fmt_bytes(n: int) -> str:
    """'512 B', '256 KiB', '1.5 MiB'."""
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            x = n / scale
            return f"{x:.0f} {unit}" if x >= 100 or x == int(x) else f"{x:.1f} {unit}"
    return f"{n} B"
