#!/usr/bin/env python3
"""Cost of CPU stack sampling to the sampled process: a C loop of integer work (built here with gcc), timed
in ns per iteration untraced and then sampled by StackSampler at the default rate, in one run.

    sudo .venv/bin/python bench/sampler_overhead.py [--iters 500000000] [--hz 499] [--rounds 5]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from _common import CountSink, TimedLoop, build_loop

from gputrace.probes.sampler import DEFAULT_HZ, StackSampler
from gputrace.records import StackSample

WORK = r"""
void setup(char **args) { (void)args; }
__attribute__((noinline)) void work(long n) {
    volatile unsigned long acc = 0;
    for (long i = 0; i < n; i++) acc += (unsigned long)i * 2654435761u;
}
"""


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--iters", type=int, default=500_000_000)
    p.add_argument("--hz", type=int, default=DEFAULT_HZ)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    exe = build_loop(Path(tempfile.mkdtemp(prefix="gputrace-sampler-bench-")), WORK, "-O1", "-fno-omit-frame-pointer")
    loop = TimedLoop(exe, args.iters)
    loop.timed()  # warm up caches and the CPU's clock
    sink = CountSink(StackSample)
    base, traced = [], []
    for _ in range(args.rounds):  # alternate, so drift in the machine's speed hits both sides alike
        base.append(loop.timed())
        src = StackSampler([loop.pid], hz=args.hz)
        src.start(sink)
        traced.append(loop.timed())
        src.stop()
    loop.close()
    b, t = min(base), min(traced)
    print(f"{args.iters:,} iterations × {args.rounds}: untraced {b:.4f} ns/iter, sampled at {args.hz} Hz "
          f"{t:.4f} ns/iter, ratio {t / b:.4f}; {sink.count:,} samples, drops {src.drops()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
