"""What tracing costs a process doing 4 KiB preads from the page cache.

    sudo .venv/bin/python bench/pread_overhead.py [--ops N] [--rounds R]

Prints, from one run, ns per pread for: untraced; traced by gputrace's eBPF source (syscalls through the
raw tracepoints sys_enter/sys_exit, the default here); the same with its fallback, the classic
per-syscall tracepoints; untraced while the source traces another process; empty programs on
raw_syscalls, as classic tracepoint programs and as raw tracepoint programs (the floor of the source's
design); the textbook tgid-hash + start-time-hash filter there; ``strace -f -c`` and ``perf trace -s``
(when installed). Each round runs every mode once, back to back; the ratio is the median over rounds of
each mode against the untraced run of the same round (the machine's other load changes between rounds,
much less within one), and ns/op is the best round.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any, Literal

from gputrace.daemon.writer import source_capture
from gputrace.probes.ebpf.source import EbpfSource

LOOP = """
import os, sys, time
fd = os.open(sys.argv[1], os.O_RDONLY)
n = int(sys.argv[2])
os.pread(fd, 4096, 0)
print("ready", flush=True)
sys.stdin.readline()
t0 = time.perf_counter_ns()
for _ in range(n):
    os.pread(fd, 4096, 0)
print((time.perf_counter_ns() - t0) / n, flush=True)
"""

RAW_EMPTY = r"""
TRACEPOINT_PROBE(raw_syscalls, sys_enter) { return 0; }
TRACEPOINT_PROBE(raw_syscalls, sys_exit) { return 0; }
"""

# BPF_PROG_TYPE_RAW_TRACEPOINT (what the source uses): no perf trace buffer is filled per call.
RAW_TP_EMPTY = r"""
RAW_TRACEPOINT_PROBE(sys_enter) { return 0; }
RAW_TRACEPOINT_PROBE(sys_exit) { return 0; }
"""

RAW_FILTER = r"""
BPF_HASH(targets, u32, u8, 4096);
BPF_HASH(start, u32, u64, 16384);
TRACEPOINT_PROBE(raw_syscalls, sys_enter) {
    u64 id = bpf_get_current_pid_tgid();
    u32 tgid = id >> 32, tid = id;
    if (!targets.lookup(&tgid)) return 0;
    u64 ts = bpf_ktime_get_ns();
    start.update(&tid, &ts);
    return 0;
}
TRACEPOINT_PROBE(raw_syscalls, sys_exit) {
    u32 tid = bpf_get_current_pid_tgid();
    u64 *ts = start.lookup(&tid);
    if (ts) start.delete(&tid);
    return 0;
}
"""


def run_loop(data: Path, ops: int, wrap: list[str], trace: Callable[[int], Any] | None) -> float:
    """ns per pread of one loop run; ``trace(pid)`` is entered around the timed part."""
    p = subprocess.Popen([*wrap, sys.executable, "-c", LOOP, str(data), str(ops)], stdin=subprocess.PIPE,
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)  # fmt: skip
    assert p.stdin is not None and p.stdout is not None
    while p.stdout.readline().strip() != "ready":
        pass
    with trace(p.pid) if trace else nullcontext():
        p.stdin.write("go\n")
        p.stdin.flush()
        ns = float(p.stdout.readline())
    p.wait()
    return ns


@contextmanager
def gputrace_source(pid: int, out: Path, hook: str = "auto") -> Iterator[None]:
    path = out / f"bench-{pid}.gputrace"
    with source_capture(path, EbpfSource([pid], syscall_hook=hook), ["bench"]):
        yield
    path.unlink()


@contextmanager
def bcc_program(text: str, pid: int) -> Iterator[None]:
    """A comparison program, with ``pid`` in its ``targets`` map when it has one."""
    from bcc import BPF

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        b = BPF(text=text)
    if "targets" in text:
        t = b[b"targets"]
        t[t.Key(pid)] = t.Leaf(1)
    try:
        yield
    finally:
        b.cleanup()


@contextmanager
def tracing_another(out: Path) -> Iterator[Callable[[int], Any]]:
    other = subprocess.Popen(["sleep", "3600"])
    with gputrace_source(other.pid, out):
        yield lambda pid: nullcontext()
    other.kill()
    other.wait()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ops", type=int, default=300_000, help="preads per timed run")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--slow-ops", type=int, default=20_000, help="preads per strace / perf run")
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp)
        data = out / "page.bin"
        data.write_bytes(os.urandom(4096))
        best = measure(data, out, args)
    report(best)


def measure(data: Path, out: Path, args: argparse.Namespace) -> dict[str, list[float]]:
    """ns/op of every round, by mode (untraced first)."""
    runs: dict[str, list[float]] = {}
    modes: list[tuple[str, Callable[[int], Any] | Literal["another"] | None]] = [
        ("untraced", None),
        ("traced (gputrace eBPF)", lambda pid: gputrace_source(pid, out)),
        ("traced, classic syscall tracepoints", lambda pid: gputrace_source(pid, out, "classic")),
        ("untraced, gputrace tracing another", "another"),
        ("raw_syscalls, empty programs", lambda pid: bcc_program(RAW_EMPTY, pid)),
        ("raw tracepoints, empty programs", lambda pid: bcc_program(RAW_TP_EMPTY, pid)),
        ("raw_syscalls, tgid + start-time hashes", lambda pid: bcc_program(RAW_FILTER, pid)),
    ]
    for _ in range(args.rounds):
        for mode, trace in modes:
            if trace == "another":
                with tracing_another(out) as noop:
                    ns = run_loop(data, args.ops, [], noop)
            else:
                ns = run_loop(data, args.ops, [], trace)
            runs.setdefault(mode, []).append(ns)
    for name, wrap in (("strace -f -c", ["strace", "-f", "-c", "-o", "/dev/null"]),
                       ("perf trace -s", ["perf", "trace", "-s", "-o", "/dev/null"])):  # fmt: skip
        if shutil.which(wrap[0]) is not None:
            base = run_loop(data, args.slow_ops, [], None)
            runs[name] = [run_loop(data, args.slow_ops, wrap, None)]
            runs[f"{name} (its untraced)"] = [base]
        else:
            runs[name] = []
    return runs


def report(runs: dict[str, list[float]]) -> None:
    base = runs["untraced"]
    print(f"{'mode':40} {'best ns/op':>10} {'ratio':>8}")
    for mode, ns in runs.items():
        if mode.endswith("(its untraced)"):
            continue
        if not ns:
            print(f"{mode:40} {'not installed':>19}")
            continue
        ref = runs.get(f"{mode} (its untraced)", base)
        ratio = statistics.median(n / b for n, b in zip(ns, ref, strict=False))
        print(f"{mode:40} {min(ns):10.0f} {ratio:7.2f}x")


if __name__ == "__main__":
    main()
