"""Durations as the reports print them."""

from __future__ import annotations


def fmt_ms(ns: int) -> str:
    return f"{ns / 1e6:.1f} ms"
