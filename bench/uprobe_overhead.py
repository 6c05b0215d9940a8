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

from gputrace.probes.uprobes import UprobeSource
from gputrace.records import CudaApi

LIB = "int cuLaunchKernel(void) { return 0; }\n"
LOOP = r"""
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
int main(int argc, char **argv) {
    void *h = dlopen(argv[1], RTLD_NOW);
    int (*launch)(void) = (int (*)(void))dlsym(h, "cuLaunchKernel");
    long n = atol(argv[2]);
    char line[8];
    printf("ready\n"); fflush(stdout);
    while (fgets(line, sizeof line, stdin)) {
        struct timespec a, b;
        clock_gettime(CLOCK_MONOTONIC, &a);
        for (long i = 0; i < n; i++) launch();
        clock_gettime(CLOCK_MONOTONIC, &b);
        printf("%.1f\n", ((b.tv_sec - a.tv_sec) * 1e9 + (b.tv_nsec - a.tv_nsec)) / n); fflush(stdout);
    }
    return 0;
}
"""


class CountSink:
    def __init__(self) -> None:
        self.calls = 0

    def emit(self, records: list) -> None:
        self.calls += sum(type(r) is CudaApi for r in records)

    def emit_kernel(self, blob: bytes, n: int) -> None:
        pass

    def emit_meta(self, source: str, meta: dict) -> None:
        pass


def build(d: Path) -> tuple[Path, Path]:
    (d / "lib.c").write_text(LIB)
    (d / "loop.c").write_text(LOOP)
    subprocess.run(["gcc", "-shared", "-fPIC", "-O2", "-o", str(d / "libcuda.so.1"), str(d / "lib.c")], check=True)
    subprocess.run(["gcc", "-O2", "-o", str(d / "loop"), str(d / "loop.c"), "-ldl"], check=True)
    return d / "libcuda.so.1", d / "loop"


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=200_000)
    args = p.parse_args()
    lib, loop = build(Path(tempfile.mkdtemp(prefix="gputrace-uprobe-bench-")))
    proc = subprocess.Popen([str(loop), str(lib), str(args.calls)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                            text=True)  # fmt: skip
    stdin, stdout = proc.stdin, proc.stdout
    assert stdin is not None and stdout is not None and stdout.readline().strip() == "ready"

    def timed() -> float:
        stdin.write("go\n")
        stdin.flush()
        return float(stdout.readline())

    base = min(timed() for _ in range(3))
    sink, src = CountSink(), UprobeSource([proc.pid])
    src.start(sink)
    traced = min(timed() for _ in range(3))
    src.stop()
    stdin.close()
    proc.wait()
    print(f"{args.calls:,} calls × 3: untraced {base:.1f} ns/call, traced {traced:.1f} ns/call "
          f"(+{(traced - base) / 1000:.2f} µs per call); {sink.calls:,} CudaApi records, drops {src.drops()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
