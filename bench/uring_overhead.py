"""What tracing costs a process reading through io_uring: 4 KiB reads from the page cache, one request
submitted and waited for per io_uring_enter (tests/workloads/uring_read.c, a C loop; no liburing).

    sudo .venv/bin/python bench/uring_overhead.py [--ops N] [--rounds R]

Modes, each round running every one back to back in the same process (the ratio is the median over rounds
against the same round's untraced run; ns/op is the best round): untraced; traced by gputrace's eBPF
source with its default threshold (100 us: these requests are summed in the kernel, the io_uring_enter calls
too); traced with threshold 0 (every request and every call is an event written to the capture); untraced
while the source traces another process (what the io_uring programs cost everyone else: a target check at
submission, a hash lookup at completion). The traced and tracing-another modes run twice: with the io_uring
programs on raw tracepoints (the default where BTF describes them) and on the classic ones (which
``sched_hook="classic"`` brings: the scheduler's hooks go classic too), side by side.
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any

from _common import TimedLoop, build_loop

from gputrace.daemon.writer import source_capture
from gputrace.probes.ebpf.source import EbpfSource

ROOT = Path(__file__).resolve().parent.parent
WORK = r"""
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
int gt_uring_open(unsigned entries);
long gt_uring_pread(int fd, void *buf, unsigned len, unsigned long long off);
static int fd;
static char buf[4096];
void setup(char **args) {
    fd = open(args[0], O_RDONLY);
    if (fd < 0 || gt_uring_open(8) < 0 || gt_uring_pread(fd, buf, sizeof buf, 0) != sizeof buf) {
        perror("setup");
        exit(1);
    }
}
void work(long n) { for (long i = 0; i < n; i++) gt_uring_pread(fd, buf, sizeof buf, 0); }
"""


@contextmanager
def traced(pid: int, out: Path, threshold_ns: int | None = None, hook: str = "auto") -> Iterator[None]:
    path = out / f"bench-{pid}.gputrace"
    opts: dict[str, Any] = {"sched_hook": hook}
    if threshold_ns is not None:
        opts["threshold_ns"] = threshold_ns
    with source_capture(path, EbpfSource([pid], **opts), ["bench"]):
        yield
    path.unlink()


@contextmanager
def tracing_another(out: Path, hook: str = "auto") -> Iterator[None]:
    import subprocess

    other = subprocess.Popen(["sleep", "3600"])
    try:
        with traced(other.pid, out, hook=hook):
            yield
    finally:
        other.kill()
        other.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", type=int, default=200_000, help="reads per timed run")
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        data = out / "page.bin"
        data.write_bytes(bytes(range(256)) * 16)
        exe = build_loop(out, WORK, str(ROOT / "tests" / "workloads" / "uring_read.c"), "-O2")
        loop = TimedLoop(exe, args.ops, str(data))
        try:
            runs = measure(loop, out, args.rounds)
        finally:
            loop.close()
    report(runs)


def measure(loop: TimedLoop, out: Path, rounds: int) -> dict[str, list[float]]:
    modes: list[tuple[str, Callable[[], AbstractContextManager[Any]]]] = [
        ("untraced", nullcontext),
        ("traced (default threshold: summed)", lambda: traced(loop.pid, out)),
        ("traced, threshold 0 (every request)", lambda: traced(loop.pid, out, 0)),
        ("untraced, gputrace tracing another", lambda: tracing_another(out)),
        ("traced, classic io_uring tracepoints", lambda: traced(loop.pid, out, hook="classic")),
        ("traced, classic, threshold 0", lambda: traced(loop.pid, out, 0, hook="classic")),
        ("untraced, tracing another, classic", lambda: tracing_another(out, "classic")),
    ]
    runs: dict[str, list[float]] = {}
    for _ in range(rounds):
        for mode, ctx in modes:
            with ctx():
                runs.setdefault(mode, []).append(loop.timed())
    return runs


def report(runs: dict[str, list[float]]) -> None:
    base = runs["untraced"]
    print(f"{'mode':40} {'best ns/op':>10} {'ratio':>8}")
    for mode, ns in runs.items():
        ratio = statistics.median(n / b for n, b in zip(ns, base, strict=False))
        print(f"{mode:40} {min(ns):10.0f} {ratio:7.2f}x")


if __name__ == "__main__":
    main()
