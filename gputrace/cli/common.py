"""Flags shared by several commands, defined once."""

from __future__ import annotations

import argparse
import contextlib
import errno
import math
import os
import signal
import sys
import threading
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

from gputrace.errors import UserError
from gputrace.signals import on_signals
from gputrace.threads import Thread

if TYPE_CHECKING:
    from gputrace.capture import CaptureReader


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


def write_stdout(text: str) -> None:
    """All of ``text`` to stdout, in as few write() calls as it takes. An unbuffered stdout (python -u,
    PYTHONUNBUFFERED=1) takes one large write in part where the disk fills up, and its text layer drops the
    rest without a word: here the rest is written again, until the disk says why it cannot."""
    out = getattr(sys.stdout, "buffer", None)
    if out is None:  # a text-only stream (a test's StringIO)
        sys.stdout.write(text)
        return
    sys.stdout.flush()
    data = memoryview(text.encode(sys.stdout.encoding or "utf-8", sys.stdout.errors or "strict"))
    while data:
        written = out.write(data)
        if not written:  # non-blocking and full: nothing to wait on here
            raise BlockingIOError(errno.EAGAIN, "stdout would block")
        data = data[written:]
    out.flush()


class Terminated(KeyboardInterrupt):
    """SIGTERM, or SIGHUP (the ssh session closed): unwinds like Ctrl-C, so every command removes its partial
    files and temporary directories on the way out. ``signum`` gives the exit status, 128 + signum."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


def _raise_terminated(signum: int, frame: object) -> None:
    raise Terminated(signum)


def catch_termination() -> Callable[[], None]:
    """SIGTERM and SIGHUP raise Terminated from here on (a SIGHUP ignored, as under nohup, stays ignored);
    returns what restores the previous handlers."""
    return on_signals((signal.SIGTERM, signal.SIGHUP), _raise_terminated)


@contextlib.contextmanager
def progress(reader: CaptureReader, what: str) -> Iterator[None]:
    """On a terminal, a line saying how far ``what`` has read into the capture, once a second after the
    first; erased when done. Nothing when stderr is not a terminal or the work takes under a second."""
    fd = reader.fileno()
    size = max(1, os.fstat(fd).st_size)

    def read() -> str:
        done = min(os.lseek(fd, 0, os.SEEK_CUR), size)  # the reader's buffer runs a little ahead
        return f"{100 * done // size}% of {size / 1e6:,.1f} MB"

    with _progress_line(what, read):
        yield


@contextlib.contextmanager
def progress_count(what: str, done: Callable[[], int], total: int, unit: str) -> Iterator[None]:
    """Like progress(), for work counted in items: "``what``: 1,024 of 60,047 ``unit``"."""
    with _progress_line(what, lambda: f"{done():,} of {total:,} {unit}"):
        yield


@contextlib.contextmanager
def _progress_line(what: str, state: Callable[[], str]) -> Iterator[None]:
    if not sys.stderr.isatty():
        yield
        return
    stop = threading.Event()

    def show() -> None:
        shown = False
        while not stop.wait(1.0):
            print(f"\rgputrace: {what}: {state()}", end="", file=sys.stderr, flush=True)
            shown = True
        if shown:
            print("\r\033[K", end="", file=sys.stderr, flush=True)

    thread = Thread(target=show, name="gputrace-progress", daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
