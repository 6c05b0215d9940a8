"""gputrace capture: trace a process tree (running, or a command) into NAME.gputrace and NAME.pftrace."""

from __future__ import annotations

import argparse
from pathlib import Path

from gputrace.cli import common
from gputrace.errors import UserError

ORDER = 10
HELP = "trace running processes or a command, write a capture and a Perfetto trace, print the stalls"
EXAMPLES = """\
  gputrace capture -- python train.py --epochs 1     trace a command (exits with its exit code)
  gputrace capture -p 4242 -d 30                      trace pid 4242 and its children for 30 s
  gputrace capture -p 4242 -p 4243 -o run1.gputrace   several processes, named output
  gputrace capture --min-gap-ms 5 -- ./train.sh       count only GPU gaps of 5 ms or more

Ctrl-C ends the capture cleanly. Writes NAME.gputrace (the capture: re-analyse it any time) and
NAME.pftrace (open it with `gputrace view`). Needs root (or CAP_BPF + CAP_PERFMON).
OVERHEAD: a few hundred ns per traced syscall of the traced processes; see docs/probes.md.
"""


def prepare_parser(p: argparse.ArgumentParser) -> None:
    common.add_pid(p)
    common.add_duration(p)
    common.add_output(p)
    common.add_force(p)
    common.add_min_gap(p)
    p.add_argument("--syscall-threshold-us", type=float, default=100.0, metavar="US",
                   help="record syscalls and off-CPU intervals at least this long one by one; shorter ones are "
                        "counted per thread and syscall in the kernel (default: 100)")
    p.add_argument("--sample-hz", type=int, default=499, metavar="HZ",
                   help="sample the traced processes' user stacks this many times a second on CPU, to name the "
                        "hottest frames of CPU stalls; 0 turns sampling off (default: 499)")
    p.add_argument("--no-perfetto", action="store_true", help="do not write NAME.pftrace")
    p.add_argument("--ebpf", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="-- CMD ARGS", help="the command to run and trace")


def run(args: argparse.Namespace) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if args.ebpf:
        from gputrace.probes.ebpf import EbpfSource

        print(EbpfSource([], threshold_ns=int(args.syscall_threshold_us * 1000)).program_text())
        return 0
    if args.duration is not None and args.duration <= 0:
        raise UserError("-d/--duration must be > 0 seconds")
    if args.syscall_threshold_us < 0:
        raise UserError("--syscall-threshold-us must be >= 0")
    if not 0 <= args.sample_hz <= 10_000:
        raise UserError("--sample-hz must be 0 (off) to 10000")
    from gputrace.daemon.session import CaptureOptions, run_capture

    opts = CaptureOptions(
        output=Path(args.output) if args.output else None,
        pids=args.pid,
        command=command or None,
        duration_s=args.duration,
        force=args.force,
        min_gap_ms=args.min_gap_ms,
        threshold_us=args.syscall_threshold_us,
        perfetto=not args.no_perfetto,
        sample_hz=args.sample_hz,
    )
    result = run_capture(opts)
    return result.exit_code if result.exit_code is not None else 0
