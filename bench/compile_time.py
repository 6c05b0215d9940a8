"""What compiling the kernel programs costs a capture's start, and what the headers they leave out would add.

    sudo .venv/bin/python bench/compile_time.py [--rounds R]

bcc compiles each program at every capture's start (it cannot load a cached object), and most of that time
is clang parsing kernel headers. Each round compiles, back to back in this process: the shipped
probes/bpf/gputrace.bpf.c; the same with ``linux/sched.h`` and ``linux/ptrace.h`` in place of
``asm/ptrace.h`` (what it included before; the instructions are the same); the shipped sampler.bpf.c; the same
with ``uapi/linux/bpf_perf_event.h`` in place of its opaque context declaration. Compiled only, never
attached. Prints the median time of each over the rounds and each variant's ratio to the shipped program.
"""

from __future__ import annotations

import argparse
import statistics
import time
import warnings
from pathlib import Path

from gputrace.probes.ebpf import build as ebpf_build
from gputrace.probes.ebpf import hooks as ebpf_hooks
from gputrace.probes.ebpf.host import BPF_DIR, check_host
from gputrace.probes.sampler import StackSampler

MAIN_SHIPPED = "#include <asm/ptrace.h>\n"
MAIN_HEAVY = "#include <linux/sched.h>\n#include <linux/ptrace.h>\n"
SAMPLER_SHIPPED = "struct bpf_perf_event_data;\n"
SAMPLER_HEAVY = "#include <uapi/linux/bpf_perf_event.h>\n"


def variant(path: Path, shipped: str, heavy: str) -> str:
    text = path.read_text()
    if shipped not in text:
        raise SystemExit(f"{path.name} no longer has {shipped.strip()!r}: update this benchmark")
    return text.replace(shipped, heavy, 1)


def compile_once(bcc: object, text: str, flags: list[str]) -> float:
    t = time.perf_counter()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        b = bcc.BPF(text=text, cflags=flags)  # type: ignore[attr-defined]
    took = time.perf_counter() - t
    b.cleanup()
    return took


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args()
    bcc = check_host()
    bcc.BPF._trace_autoload = lambda self: None  # compile only: nothing is attached
    hook, _ = ebpf_hooks.choose("syscall", "auto")
    sched, _ = ebpf_hooks.choose("sched", "auto")
    main_flags = ebpf_build.cflags(100_000, 4096, hook, sched, None)
    sampler_flags = StackSampler([])._cflags()  # the flags its start compiles with
    main_path, sampler_path = BPF_DIR / "gputrace.bpf.c", BPF_DIR / "sampler.bpf.c"
    programs = {
        "gputrace.bpf.c as shipped": (main_path.read_text(), main_flags),
        "  with linux/sched.h + linux/ptrace.h": (variant(main_path, MAIN_SHIPPED, MAIN_HEAVY), main_flags),
        "sampler.bpf.c as shipped": (sampler_path.read_text(), sampler_flags),
        "  with uapi/linux/bpf_perf_event.h": (variant(sampler_path, SAMPLER_SHIPPED, SAMPLER_HEAVY), sampler_flags),
    }
    times: dict[str, list[float]] = {name: [] for name in programs}
    for r in range(args.rounds):
        for name, (text, flags) in programs.items():
            times[name].append(compile_once(bcc, text, flags))
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{t[-1]:.2f}s" for t in times.values()), flush=True)
    print(f"\nmedian of {args.rounds} rounds (hook {hook}/{sched}):")
    base = 0.0  # the shipped program's median: its row comes before its variants'
    for name, t in times.items():
        med = statistics.median(t)
        base = med if not name.startswith(" ") else base
        ratio = "" if not name.startswith(" ") else f"  {med / base:.2f}x the shipped program"
        print(f"  {name:<42} {med:6.2f} s{ratio}")


if __name__ == "__main__":
    main()
