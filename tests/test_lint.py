"""The codebase stays clean: ruff's lint and mypy's checks, as configured in pyproject.toml."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
# daemon, probes, exporters and viewer through gputrace's links to them; the benchmarks, which call them as users do
PACKAGES = ["gputrace", "bench"]
# Caches outside the tree, one per user: the suite also runs unprivileged on a tree it cannot write.
CACHE = Path(tempfile.gettempdir()) / f"gputrace-lint-{os.getuid()}"


def test_ruff() -> None:
    r = subprocess.run([sys.executable, "-m", "ruff", "check", "--cache-dir", str(CACHE / "ruff"), "."], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr


def test_mypy() -> None:
    r = subprocess.run([sys.executable, "-m", "mypy", "--cache-dir", str(CACHE / "mypy"), *PACKAGES], cwd=ROOT,
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr


# A call across packages with a wrong type, and a report read by a key it does not have: mypy must see both
# (the packages are resolved, not Any; the report is a TypedDict). Each line marked "# error" must be reported,
# and only those.
CROSS_PACKAGE = '''
from pathlib import Path

from gputrace.analysis import analyze
from gputrace.capture import open_capture
from gputrace.daemon.session import CaptureOptions, run_capture
from gputrace.exporters.perfetto.export import PerfettoExporter
from gputrace.viewer.terminal import throttled_text

run_capture(CaptureOptions(pids=[42], duration_s=1.0))
run_capture(["-p", "42"])  # error
CaptureOptions(pids="42")  # error
PerfettoExporter(Path("out.pftrace"))
PerfettoExporter(42)  # error
with open_capture("run.gputrace") as reader:
    report = analyze(reader)
    stall = report["stalls"][0]
    print(stall["culprit"]["object"], report["capture"]["host"])
    print(stall["culprit"]["path"])  # error
    print(report["summary"]["stall_ms"])  # error
    duration: str = stall["duration_ns"]  # error
    throttled_text(stall)  # error
'''


def test_mypy_sees_a_wrong_typed_call_across_packages(tmp_path: Path) -> None:
    snippet = tmp_path / "cross_package.py"
    snippet.write_text(CROSS_PACKAGE)
    r = subprocess.run([sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"),
                        "--cache-dir", str(tmp_path / "cache"), str(snippet)],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    flagged = {int(line.split(":")[1]) for line in r.stdout.splitlines() if ": error:" in line}
    marked = {n for n, line in enumerate(CROSS_PACKAGE.splitlines(), 1) if line.endswith("# error")}
    assert flagged == marked, r.stdout + r.stderr
