"""gputrace capture: trace a process tree (running, or a command) into NAME.gputrace and NAME.pftrace."""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import time
from pathlib import Path

from gputrace.cli import common
from gputrace.errors import UserError
from gputrace.families import FAMILIES, help_text, parse_off

ORDER = 10
HELP = "trace running processes or a command, write a capture and a Perfetto trace, print the stalls"
EXAMPLES = """\
  gputrace capture -- python train.py --epochs 1     trace a command (exits with its exit code)
  gputrace capture -p 4242 -d 30                      trace pid 4242 and its children for 30 s
  gputrace capture -p 4242 -p 4243 -o run1.gputrace   several processes, named output
  gputrace capture --min-gap-ms 5 -- ./train.sh       count only GPU gaps of 5 ms or more
  gputrace capture --off sampler,nvml -p 4242 -d 30   leave the CPU sampler and NVML out (cheaper)

-p takes process ids; a thread id stands for its process (said before tracing starts).
Ctrl-C ends the capture cleanly. Writes NAME.gputrace (the capture: re-analyse it any time) and
NAME.pftrace (open it with `gputrace view`). Needs root (or CAP_BPF + CAP_PERFMON and a readable
tracefs).
OVERHEAD: measured in every capture and printed at its end ("tracing cost: ... of host CPU"), with each
kernel program's run time in the report; see docs/capture.md. Source families (--off FAMILY):
""" + help_text() + "\n"


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
    p.add_argument("--off", action="append", default=[], metavar="FAMILY[,FAMILY]",
                   help="turn a source family off (repeatable): " + ", ".join(FAMILIES) + "; what each costs and "
                        "what is lost without it is listed below")  # fmt: skip
    p.add_argument("--no-perfetto", action="store_true", help="do not write NAME.pftrace")
    p.add_argument("--ebpf", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("command", nargs=argparse.REMAINDER, metavar="-- CMD ARGS", help="the command to run and trace")


def run(args: argparse.Namespace) -> int:
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    _check_numbers(args)
    if args.ebpf:
        from gputrace.probes.ebpf.source import EbpfSource

        print(EbpfSource([], threshold_ns=int(args.syscall_threshold_us * 1000)).program_text())
        return 0
    from gputrace.daemon.session import CaptureOptions, run_capture

    tracing: list[float] = []  # when tracing began, once it has
    opts = CaptureOptions(
        output=Path(args.output) if args.output else None,
        pids=process_ids(args.pid),
        command=command or None,
        duration_s=args.duration,
        force=args.force,
        min_gap_ms=args.min_gap_ms,
        threshold_us=args.syscall_threshold_us,
        perfetto=not args.no_perfetto,
        sample_hz=args.sample_hz,
        off=parse_off(args.off),
        on_tracing=lambda: tracing.append(time.time()),
    )
    if sys.stderr.isatty():  # compiling the probes is seconds of silence otherwise (the command is held meanwhile)
        print("gputrace: compiling and loading the eBPF probes (a few seconds)...", file=sys.stderr, flush=True)
    try:  # SIGTERM and SIGHUP unwind like Ctrl-C (cli.main); the session takes them over while it traces
        result = run_capture(opts)
    except KeyboardInterrupt as e:  # outside the traced window: the session cleaned up, say what is left
        _interrupted(opts.output, tracing)
        return 128 + e.signum if isinstance(e, common.Terminated) else 130
    if result.exit_code is not None:  # -- CMD: its exit code, even when writing the capture failed part way
        return result.exit_code
    return UserError.exit_code if result.cut_off or result.export_error else 0


def _check_numbers(args: argparse.Namespace) -> None:
    """Before anything starts: a bad number found after the capture would cost the whole run."""
    if args.duration is not None:
        common.require_positive("-d/--duration", args.duration, "seconds")
    common.require_positive("--min-gap-ms", args.min_gap_ms)
    if not args.syscall_threshold_us >= 0 or args.syscall_threshold_us == float("inf"):
        raise UserError("--syscall-threshold-us must be a number >= 0")
    if not 0 <= args.sample_hz <= 10_000:
        raise UserError("--sample-hz must be 0 (off) to 10000")
    parse_off(args.off)


def process_ids(ids: list[int]) -> list[int]:
    """-p takes processes; a thread id (as top or ps -L show them) stands for its process, said once."""
    out: list[int] = []
    for tid in ids:
        pid = _tgid(tid)
        if pid != tid:
            print(f"gputrace: {tid} is a thread of pid {pid}; tracing pid {pid}", file=sys.stderr)
        if pid == os.getpid():  # it would trace its own reading of its own events, without end
            raise UserError(f"pid {pid} is this gputrace process; give the pid of the job to trace")
        if pid not in out:
            out.append(pid)
    return out


def _tgid(tid: int) -> int:
    """The process a thread id belongs to; the id itself when /proc cannot say (the session reports why)."""
    try:
        status = Path(f"/proc/{tid}/status").read_text(errors="replace")  # Name: any bytes
    except (OSError, ValueError):
        return tid
    for line in status.splitlines():
        if line.startswith("Tgid:"):
            return int(line.split()[1])
    return tid


def _interrupted(output: Path | None, tracing: list[float]) -> None:
    """Ctrl-C outside the traced window (while the probes load, or during the analysis afterwards)."""
    if not tracing:
        print("gputrace: interrupted before tracing began; nothing was written", file=sys.stderr)
        return
    written = _written_capture(output, tracing[0])
    if written is None:
        print("gputrace: interrupted; the capture was not written", file=sys.stderr)
        return
    cap, trace = shlex.quote(str(written)), shlex.quote(str(written.with_suffix(".pftrace")))
    print(f"gputrace: interrupted after tracing ended; the capture {written} was written, but its summary "
          f"and Perfetto trace may be missing: gputrace report {cap}; gputrace export {cap} --perfetto {trace}",
          file=sys.stderr)


def _written_capture(output: Path | None, since: float) -> Path | None:
    """The capture this run wrote: the named output, or the newest default-named one written since tracing."""
    candidates = [output] if output is not None else list(Path(".").glob("gputrace-*.gputrace"))
    fresh = [p for p in candidates if p.is_file() and p.stat().st_mtime >= since - 1]  # not an earlier one (-f)
    return max(fresh, key=lambda p: p.stat().st_mtime) if fresh else None
