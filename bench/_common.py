"""What the overhead benchmarks share: a C harness that times a workload on request, a sink that counts, and
one source capturing into a real file as the session would.

Each benchmark writes only its work.c: ``void setup(char **args)`` (the arguments after n) and
``void work(long n)``. timer.c runs work(n) once per line it reads and prints the time per iteration, so
rounds untraced and traced run in one process and compare like with like.
"""

from __future__ import annotations

import subprocess
from collections.abc import Iterable
from pathlib import Path
from typing import Any

TIMER_C = r"""
#include <stdio.h>
#include <stdlib.h>
#include <time.h>
void setup(char **args);
void work(long n);
int main(int argc, char **argv) {
    long n = atol(argv[1]);
    char line[8];
    setup(argv + 2);
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


def build_loop(d: Path, work_c: str, *flags: str) -> Path:
    """timer.c linked with the benchmark's work.c by gcc (``flags`` after the sources, so -l works too)."""
    (d / "timer.c").write_text(TIMER_C)
    (d / "work.c").write_text(work_c)
    subprocess.run(["gcc", "-o", str(d / "loop"), str(d / "timer.c"), str(d / "work.c"), *flags], check=True)
    return d / "loop"


class TimedLoop:
    """The built loop, running after its ready line: each ``timed()`` is one round of work(n)."""

    def __init__(self, exe: Path, n: int, *args: str) -> None:
        self.proc = subprocess.Popen([str(exe), str(n), *args], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     text=True)  # fmt: skip
        assert self._readline() == "ready"

    @property
    def pid(self) -> int:
        return self.proc.pid

    def timed(self) -> float:
        """ns per iteration of one round."""
        assert self.proc.stdin is not None
        self.proc.stdin.write("go\n")
        self.proc.stdin.flush()
        return float(self._readline())

    def close(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.close()
        self.proc.wait()

    def _readline(self) -> str:
        assert self.proc.stdout is not None
        return self.proc.stdout.readline().strip()


class CountSink:
    """A source's sink that only counts the records of one type: the cost measured is the tracing's alone."""

    def __init__(self, kind: type) -> None:
        self.kind, self.count = kind, 0

    def emit(self, records: Iterable[Any]) -> None:
        self.count += sum(type(r) is self.kind for r in records)

    def emit_kernel(self, blob: bytes, n: int) -> None:
        pass

    def emit_meta(self, source: str, meta: dict[str, Any]) -> None:
        pass
