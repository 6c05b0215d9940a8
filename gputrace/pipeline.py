"""Analyse, then export: the one path from a capture to its Perfetto trace.

The end of ``gputrace capture``, ``gputrace export --perfetto`` and ``gputrace view`` of a capture all come through
here, so they agree on what a failed analysis means (the trace is still written, without its stalls track, and the
caller hears why) and on what a failed write means (a UserError naming the output file). Exporters receive a report;
they never compute one.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from contextlib import AbstractContextManager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from gputrace.capture import CaptureReader, check_output_path, open_capture
from gputrace.documents import Report
from gputrace.errors import UserError

if TYPE_CHECKING:
    from gputrace.exporters import ExportResult

DEFAULT_MIN_GAP_NS = 1_000_000  # the CLI's --min-gap-ms default

# A stage wrapper: given the reader and what is being done ("analysing", "writing X"), a context around that stage
# (the CLI shows progress on a terminal there).
Stage = Callable[[CaptureReader, str], AbstractContextManager[Any]]


def _quiet(reader: CaptureReader, what: str) -> AbstractContextManager[Any]:
    return contextlib.nullcontext()


def analyse(reader: CaptureReader, min_gap_ns: int = DEFAULT_MIN_GAP_NS, jobs: int = 1) -> Report:
    """The stall report of a capture (a long one's windows explained in ``jobs`` processes); raises UserError when
    the capture cannot be analysed."""
    from gputrace.analysis import analyze

    report: Report = analyze(reader, min_gap_ns=min_gap_ns, jobs=jobs)
    return report


def report_or_why(reader: CaptureReader, min_gap_ns: int = DEFAULT_MIN_GAP_NS, jobs: int = 1
                  ) -> tuple[Report | None, str]:
    """The stall report, or None and why (no analysis in this installation, or it failed on this capture)."""
    try:
        return analyse(reader, min_gap_ns, jobs), ""
    except ImportError as e:
        return None, f"stall analysis unavailable ({e})"
    except UserError as e:
        return None, f"stall analysis failed: {e}"


def write_perfetto(reader: CaptureReader, out: Path, report: Report | None, jobs: int = 1) -> ExportResult:
    """The Perfetto trace of ``reader`` into ``out`` (stalls drawn when ``report`` is given; a large capture's in
    two processes at once where ``jobs`` is above one). A failed write raises a UserError (OutputError) naming
    ``out``."""
    try:
        from gputrace.exporters.perfetto.export import PerfettoExporter
    except ImportError:
        raise UserError("the Perfetto exporter is not available in this installation") from None
    return PerfettoExporter(out, report=report, jobs=jobs).write(reader)


def export_perfetto(capture: str | os.PathLike[str], out_path: str | os.PathLike[str], *, force: bool = False,
                    analyse: bool = False, min_gap_ns: int = DEFAULT_MIN_GAP_NS,
                    report: Report | None = None,
                    stage: Stage = _quiet, warn: Callable[[str], None] = lambda _: None,
                    done: Callable[[CaptureReader], None] = lambda _: None, jobs: int = 1) -> ExportResult:
    """Write the Perfetto trace of ``capture`` to ``out_path``, refusing to overwrite a file unless ``force``;
    stalls are drawn from ``report``, or with ``analyse`` from an analysis made here first (one that fails costs
    only the stalls track: ``warn`` says why).
    ``done`` gets the reader once it has read the whole capture (its completeness and losses are known then).
    ``jobs``: processes the analysis and the trace may take at once (``analyse``, ``write_perfetto``)."""
    out = Path(out_path)
    check_output_path(out, force=force, source=capture)
    with open_capture(capture) as reader:
        if report is None and analyse:
            with stage(reader, "analysing"):
                report, why = report_or_why(reader, min_gap_ns, jobs)
            if why:
                warn(f"exporting without stalls: {why}")
        with stage(reader, f"writing {out}"):
            result = write_perfetto(reader, out, report, jobs)
        done(reader)
        return result
