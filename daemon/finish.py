"""After a capture: analyse it, write the Perfetto trace, and tell the user what to run next."""

from __future__ import annotations

import shlex
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from gputrace import pipeline
from gputrace.capture import CaptureReader
from gputrace.documents import Report
from gputrace.errors import UserError

if TYPE_CHECKING:
    from gputrace.daemon.session import CaptureOptions, CaptureResult


def analyse(path: Any, min_gap_ms: float) -> Report:
    with CaptureReader(path) as reader:
        return pipeline.analyse(reader, int(min_gap_ms * 1e6))


def analyse_and_export(result: CaptureResult, opts: CaptureOptions, log: Callable[[str], None]) -> None:
    from gputrace.analysis import summary_lines
    from gputrace.daemon.targets import perfetto_path_for

    result.report = analyse(result.capture_path, opts.min_gap_ms)
    for line in summary_lines(result.report):
        log(line)
    if not result.complete:
        lost = ", ".join(f"{k} {v:,}" for k, v in result.drops.items() if v)
        log(f"gputrace: WARNING: INCOMPLETE capture: records were lost ({lost})")
    log(f"Wrote {result.capture_path}")
    if opts.perfetto:
        out = perfetto_path_for(result.capture_path)
        try:
            with CaptureReader(result.capture_path) as reader:
                pipeline.write_perfetto(reader, out, result.report)
            result.perfetto_path = out
            log(f"Wrote {out}")
        except UserError as e:
            # The capture is written and whole: a failed trace (a full disk) costs only the trace, and the
            # command's exit code still comes back; the run fails so that a script notices.
            cap = shlex.quote(str(result.capture_path))
            result.export_error = (f"{e} (the capture {result.capture_path} is whole: `gputrace export {cap} "
                                   f"--perfetto {shlex.quote(str(out))}` writes the trace where there is room)")
            log(f"gputrace: error: {result.export_error}")
    log("Next:")
    log(f"  gputrace report {shlex.quote(str(result.capture_path))}")
    if result.perfetto_path:
        log(f"  gputrace view {shlex.quote(str(result.perfetto_path))}")
