"""Flags shared by several commands, defined once."""

from __future__ import annotations

import argparse
import math

from gputrace.errors import UserError


def add_pid(p: argparse.ArgumentParser) -> None:
    p.add_argument("-p", "--pid", type=int, action="append", default=[], metavar="PID",
                   help="trace this process and its descendants (repeatable)")


def add_duration(p: argparse.ArgumentParser) -> None:
    p.add_argument("-d", "--duration", type=float, metavar="SEC", help="stop after SEC seconds (default: Ctrl-C)")


def add_output(p: argparse.ArgumentParser, what: str = "capture file") -> None:
    p.add_argument("-o", "--output", metavar="NAME.gputrace", help=f"the {what} to write")


def add_force(p: argparse.ArgumentParser) -> None:
    p.add_argument("-f", "--force", action="store_true", help="overwrite an existing output")


def add_min_gap(p: argparse.ArgumentParser) -> None:
    p.add_argument("--min-gap-ms", type=float, default=1.0, metavar="X",
                   help="the shortest GPU idle gap that counts as a stall (default: 1 ms)")


def positive_float(text: str) -> float:
    value = float(text)
    if not (value > 0 and math.isfinite(value)):
        raise argparse.ArgumentTypeError("must be a number > 0")
    return value


def require_positive(flag: str, value: float, unit: str = "") -> None:
    """A flag's value must be a finite number > 0 (argparse's float() also accepts 'nan' and 'inf')."""
    if not (value > 0 and math.isfinite(value)):
        raise UserError(f"{flag} must be a number > 0{' ' + unit if unit else ''}, not {value:g}")


def port(text: str) -> int:
    value = int(text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError("must be 0 to 65535 (0: any free port)")
    return value
