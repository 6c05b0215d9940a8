#!/usr/bin/env python3
"""Cost of the libcuda uprobes per traced call: a C loop calling an empty cuLaunchKernel in a library named
libcuda.so.1 (built here with gcc), timed without and with UprobeSource attached to it.

    sudo .venv/bin/python bench/uprobe_overhead.py [--calls 200000]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

from _common import CountSink, TimedLoop, build_loop

from gputrace.probes.uprobes import UprobeSource
from gputrace.records import CudaApi

LIB = "int cuLaunchKernel(void) { return 0; }\n"
WORK = r"""
#include <dlfcn.h>
static int (*launch)(void);
void setup(char **args) { launch = (int (*)(void))dlsym(dlopen(args[0], RTLD_NOW), "cuLaunchKernel"); }
void work(long n) { for (long i = 0; i < n; i++) launch(); }
"""


def build(d: Path) -> tuple[Path, Path]:
    subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-o", str(d / "libcuda.so.1"), "-x", "c", "-"], input=LIB,
                   text=True, check=True)  # fmt: skip
    return d / "libcuda.so.1", build_loop(d, WORK, "-O2", "-ldl")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=200_000)
    args = p.parse_args()
    lib, exe = build(Path(tempfile.mkdtemp(prefix="gputrace-uprobe-bench-")))
    loop = TimedLoop(exe, args.calls, str(lib))
    base = min(loop.timed() for _ in range(3))
    sink, src = CountSink(CudaApi), UprobeSource([loop.pid])
    src.start(sink)
    traced = min(loop.timed() for _ in range(3))
    src.stop()
    loop.close()
    print(f"{args.calls:,} calls × 3: untraced {base:.1f} ns/call, traced {traced:.1f} ns/call "
          f"(+{(traced - base) / 1000:.2f} µs per call); {sink.count:,} CudaApi records, drops {src.drops()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
