#!/usr/bin/env python3
"""Cost of CPU stack sampling to the sampled process: a C loop of integer work (built here with gcc), timed
in ns per iteration untraced and then sampled by StackSampler at the default rate, in one run.

    sudo .venv/bin/python bench/sampler_overhead.py [--iters 500000000] [--hz 499] [--rounds 5]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from gputrace.probes.sampler import DEFAULT_HZ, StackSampler
from gputrace.records import StackSample

LOOP = r"""
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
__attribute__((noinline)) unsigned long work(long n) {
    volatile unsigned long acc = 0;
    for (long i = 0; i < n; i++) acc += (unsigned long)i * 2654435761u;
    return acc;
}
int main(int argc, char **argv) {
    long n = atol(argv[1]);
    char line[8];
    printf("ready\n"); fflush(stdout);
    while (fgets(line, sizeof line, stdin)) {
        struct timespec a, b;
        clock_gettime(CLOCK_MONOTONIC, &a);
        work(n);
        clock_gettime(CLOCK_MONOTONIC, &b);
        printf("%.4f\n", ((b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec)) / n); fflush(stdout);
    }
    return 0;
}
"""


class CountSink:
    def __init__(self) -> None:
        self.samples = 0

    def emit(self, records: Any) -> None:
        self.samples += sum(type(r) is StackSample for r in records)

    def emit_kernel(self, blob: bytes, n: int) -> None:
        pass

    def emit_meta(self, source: str, meta: dict[str, Any]) -> None:
        pass


def build(d: Path) -> Path:
    (d / "loop.c").write_text(LOOP)
    subprocess.run(["gcc", "-O1", "-fno-omit-frame-pointer", "-o", str(d / "loop"), str(d / "loop.c")], check=True)
    return d / "loop"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=500_000_000)
    p.add_argument("--hz", type=int, default=DEFAULT_HZ)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    loop = build(Path(tempfile.mkdtemp(prefix="gputrace-sampler-bench-")))
    proc = subprocess.Popen([str(loop), str(args.iters)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    stdin, stdout = proc.stdin, proc.stdout
    assert stdin is not None and stdout is not None and stdout.readline().strip() == "ready"

    def timed() -> float:
        stdin.write("go\n")
        stdin.flush()
        return float(stdout.readline())

    timed()  # warm up caches and the CPU's clock
    sink = CountSink()
    base, traced = [], []
    for _ in range(args.rounds):  # alternate, so drift in the machine's speed hits both sides alike
        base.append(timed())
        src = StackSampler([proc.pid], hz=args.hz)
        src.start(sink)
        traced.append(timed())
        src.stop()
    stdin.close()
    proc.wait()
    b, t = min(base), min(traced)
    print(f"{args.iters:,} iterations × {args.rounds}: untraced {b:.4f} ns/iter, sampled at {args.hz} Hz "
          f"{t:.4f} ns/iter, ratio {t / b:.4f}; {sink.samples:,} samples, drops {src.drops()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
