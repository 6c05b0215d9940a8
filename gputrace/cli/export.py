"""`gputrace export CAPTURE (--perfetto OUT.pftrace | --otlp ENDPOINT)`: a capture to a trace or to spans."""

from __future__ import annotations

import argparse
import contextlib
import shlex
import sys
from pathlib import Path

from gputrace import pipeline
from gputrace.capture import CaptureReader, check_output_path, open_capture
from gputrace.cli import common
from gputrace.cli.report import default_jobs
from gputrace.errors import UserError
from gputrace.exporters import ExportResult

ORDER = 30
HELP = "export a capture as a Perfetto trace or as OpenTelemetry (OTLP) spans"
EXAMPLES = """\
  gputrace export run.gputrace --perfetto run.pftrace          a Perfetto trace, stalls included
  gputrace export run.gputrace --perfetto run.pftrace -f       overwrite an existing trace
  gputrace export run.gputrace --perfetto run.pftrace --jobs 1 analysed and drawn in this process alone
  gputrace export run.gputrace --otlp localhost:4317           stall spans to an OTLP collector (gRPC)
  gputrace export run.gputrace --otlp http://tempo:4318 --protocol http
  gputrace export hostA.gputrace hostB.gputrace --perfetto job.pftrace
                                                              one trace of the job, on one clock: each host's
                                                              processes and GPUs named by the host, arrows
                                                              from a late rank's cause to the waits it caused
  gputrace export hostA.gputrace hostB.gputrace --otlp tempo:4317
                                                              each capture's spans; a collective instance's
                                                              spans share one trace id on every host

The Perfetto trace shows every traced thread (syscalls, off-CPU time and who woke it), block I/O per device,
GPU streams, CUDA API calls with arrows to the work they launched, NVML counters, and per device a
"stalls" track whose slices name what each GPU idle gap waited on, with arrows from the evidence.
A cut-off capture is exported up to the cut, with a warning. --otlp exits 1 when some spans were not
delivered and 2 when none were (the counts are printed either way).
"""


def prepare_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("captures", metavar="CAPTURE", nargs="+",
                   help="a .gputrace capture file (several: one job's captures from several hosts; --perfetto "
                        "writes one trace of them joined, --otlp exports each, as on its own host)")
    dest = p.add_mutually_exclusive_group(required=True)
    dest.add_argument("--perfetto", metavar="OUT.pftrace", help="write a Perfetto trace")
    dest.add_argument("--otlp", metavar="ENDPOINT", help="send stall spans to an OTLP endpoint (host:port or URL)")
    p.add_argument("--protocol", choices=("grpc", "http"), default="grpc",
                   help="OTLP transport (default grpc; http is HTTP/protobuf)")
    common.add_force(p)
    common.add_min_gap(p)
    jobs = default_jobs()
    p.add_argument("--jobs", type=int, metavar="N", default=jobs,
                   help="processes at once: a long capture's analysis explains its windows in up to N (as "
                        "`gputrace report --jobs`), and a capture of 8 MiB or more is drawn into the Perfetto trace "
                        f"by two when N is above 1 (the kernel probes' records by the second); default {jobs} here, "
                        "as for report; 1: this process alone")


def run(args: argparse.Namespace) -> int:
    common.require_positive("--min-gap-ms", args.min_gap_ms)
    if args.jobs < 1:
        raise UserError(f"--jobs must be 1 or more, not {args.jobs}")
    min_gap_ns = max(1, int(args.min_gap_ms * 1e6))
    if args.otlp is not None:
        if not args.otlp.strip():
            raise UserError("--otlp needs an endpoint: host:port (gRPC) or a URL such as http://tempo:4318")
        return _run_otlp(args, min_gap_ns)
    if not args.perfetto:
        raise UserError("--perfetto needs an output file name, such as run.pftrace")
    paths = list(dict.fromkeys(args.captures))  # the same file twice is one capture, not two hosts
    if len(paths) > 1:
        return _run_perfetto_joined(args, paths, min_gap_ns)
    out = Path(args.perfetto)
    result = pipeline.export_perfetto(paths[0], out, force=args.force, analyse=True, min_gap_ns=min_gap_ns,
                                      stage=common.progress, warn=_warn, jobs=args.jobs,
                                      done=lambda r: _warn_losses(r, "the trace has what was readable"))
    _print_notes(result)
    print(f"Wrote {out} ({result.items:,} packets)")
    print("Next:")
    print(f"  gputrace view {shlex.quote(str(out))}")
    return 0


def _run_perfetto_joined(args: argparse.Namespace, paths: list[str], min_gap_ns: int) -> int:
    """One trace of one job's captures from several hosts, on the joined report's clock."""
    from gputrace.analysis.join import join
    from gputrace.exporters.perfetto.export import PerfettoExporter

    out = Path(args.perfetto)
    for path in paths:
        check_output_path(out, force=args.force, source=path)
    with contextlib.ExitStack() as stack:
        readers = [stack.enter_context(open_capture(p)) for p in paths]
        joined = join(readers, paths, min_gap_ns=min_gap_ns)
        notes = joined.report["join"]["notes"]
        if len(joined.report["join"]["jobs"]) > 1:  # the report's own words: these are not one job
            raise UserError(f"{notes[0]}; one Perfetto trace is of one job: export each capture on its own")
        for note in notes:
            print(f"note: {note}", file=sys.stderr)
        result = PerfettoExporter(out).write_joined(readers, paths, joined)
        _print_notes(result)
        for path, reader in zip(paths, readers, strict=True):
            _warn_losses(reader, f"the trace has what was readable of {path}")
    print(f"Wrote {out} ({result.items:,} packets, {len(paths)} captures on the clock of {paths[0]})")
    print("Next:")
    print(f"  gputrace view {shlex.quote(str(out))}")
    return 0


def _run_otlp(args: argparse.Namespace, min_gap_ns: int) -> int:
    """Each capture on its own, as its host would send it: their collective spans meet by trace id."""
    worst = 0
    for path in dict.fromkeys(args.captures):
        worst = max(worst, _otlp_one(args, path, min_gap_ns))
    return worst


def _otlp_one(args: argparse.Namespace, path: str, min_gap_ns: int) -> int:
    from gputrace.exporters.otlp import OtlpExporter, count_spans

    exporter = OtlpExporter(args.otlp, args.protocol, min_gap_ns=min_gap_ns)
    with open_capture(path) as reader:
        with common.progress(reader, "analysing"):
            report, why = pipeline.report_or_why(reader, min_gap_ns, args.jobs)
        if report is None:
            raise UserError(f"cannot build OTLP spans: {why}")
        exporter.report = report
        total = count_spans(report)
        try:
            with common.progress_count("sending", exporter.handled, total, "spans"):
                result = exporter.write(reader)
        except KeyboardInterrupt:  # the collector holds part of the trace: say how much
            sent = exporter.result.items if exporter.result else 0
            _warn(f"interrupted after {sent:,} of {total:,} spans were delivered to {args.otlp}: "
                  "the trace there is partial")
            raise
    _print_notes(result)
    _warn_losses(reader, "exported what was readable")
    dropped = f" ({result.dropped:,} dropped)" if result.dropped else ""
    print(f"Sent {result.items:,} spans to {result.target}{dropped}")
    if result.dropped:  # some batches failed: a script must not take this for a full export
        _warn(f"{result.dropped:,} of {result.items + result.dropped:,} spans were not delivered")
        return 1
    return 0


def _warn_losses(reader: CaptureReader, what_we_have: str) -> None:
    """A cut-off capture, and records its sources lost: an export must not look whole when it is not."""
    from gputrace.analysis.notes import lost_records

    if not reader.complete:
        _warn(f"the capture is incomplete: {reader.problem or 'records were lost'}; {what_we_have}")
    lost = lost_records(reader.drops)
    if lost:
        _warn(f"the capture lost {lost} while recording: they are missing here too, and stalls near them may "
              "be unexplained (gputrace report marks them)")


def _print_notes(result: ExportResult) -> None:
    for note in result.notes:
        if not note.startswith("capture incomplete"):
            print(f"note: {note}", file=sys.stderr)


def _warn(msg: str) -> None:
    print(f"gputrace: warning: {msg}", file=sys.stderr)
