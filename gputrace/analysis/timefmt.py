"""Durations and sizes as the reports print them."""

from __future__ import annotations


def fmt_ms(ns: int) -> str:
    return f"{ns / 1e6:.1f} ms"


def size_text(n: int) -> str:
    """4096 -> "4 KiB": whole MiB or KiB, else bytes, so names stay short and exact."""
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"
