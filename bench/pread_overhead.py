"""What tracing costs a process doing 4 KiB preads from the page cache (the FACTS.md microbenchmark).

    sudo .venv/bin/python bench/pread_overhead.py [--ops N] [--rounds R]

Prints, from one run, ns per pread for: untraced; traced by gputrace's eBPF source; untraced while the
source traces another process; the same tgid filter on raw_syscalls instead of per-syscall tracepoints;
``strace -f -c`` and ``perf trace -s`` (when installed). Rounds are interleaved and the best round of each
mode is reported, since other work on the machine only ever adds time.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Any

from gputrace.daemon.writer import QueueSink
from gputrace.probes.ebpf import EbpfSource

from gputrace.capture import CaptureWriter, host_header

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
def gputrace_source(pid: int, out: Path) -> Iterator[None]:
    path = out / f"bench-{pid}.gputrace"
    writer = CaptureWriter(path, host_header(["bench"]))
    sink = QueueSink(writer)
    src = EbpfSource([pid])
    src.start(sink)
    try:
        yield
    finally:
        src.stop()
        sink.close()
        writer.close({"drops": src.drops(), "complete": True})
        path.unlink()


@contextmanager
def raw_syscalls_filter(pid: int) -> Iterator[None]:
    from bcc import BPF

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        b = BPF(text=RAW_FILTER)
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


def measure(data: Path, out: Path, args: argparse.Namespace) -> dict[str, float | None]:
    best: dict[str, float | None] = {}

    def keep(mode: str, ns: float | None) -> None:
        old = best.get(mode)
        best[mode] = ns if old is None or (ns is not None and ns < old) else old

    for _ in range(args.rounds):
        keep("untraced", run_loop(data, args.ops, [], None))
        keep("traced (gputrace eBPF)", run_loop(data, args.ops, [], lambda pid: gputrace_source(pid, out)))
        with tracing_another(out) as noop:
            keep("untraced, gputrace tracing another", run_loop(data, args.ops, [], noop))
        keep("raw_syscalls tgid filter + start hash", run_loop(data, args.ops, [], raw_syscalls_filter))
    for name, wrap in (("strace -f -c", ["strace", "-f", "-c", "-o", "/dev/null"]),
                       ("perf trace -s", ["perf", "trace", "-s", "-o", "/dev/null"])):  # fmt: skip
        if shutil.which(wrap[0]) is None:
            best[name] = None
        else:
            keep(name, run_loop(data, args.slow_ops, wrap, None))
    return best


def report(best: dict[str, float | None]) -> None:
    base = best["untraced"]
    assert base is not None
    print(f"{'mode':40} {'ns/op':>10} {'ratio':>8}")
    for mode, ns in best.items():
        if ns is None:
            print(f"{mode:40} {'not installed':>19}")
        else:
            print(f"{mode:40} {ns:10.0f} {ns / base:7.2f}x")


if __name__ == "__main__":
    main()
