"""Captures recorded on a real GPU host (tests/data/captures/README.md), analysed as a user would: each
NAME.gputrace.gz through `gputrace report --json`, scored against NAME.truth.json.

The truth names the process whose work the job waited for (``culprit_pid``) and its cause; the score is its
share of the stall time of the steady steps (stalls that begin after the end of NVTX range ``step`` number
``from_step``: before that the job is starting up, and its own start-up is the honest answer there). What
the tool itself took from the job is ``tracing``, never the job's: it may hold the rest, as may the trainer's
own CPU time between steps, but no other process may come out ahead of the culprit."""

from __future__ import annotations

import gzip
import json
import shutil
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest

from gputrace.capture import CaptureReader
from gputrace.records import NvtxRange
from gputrace.testing.schemas import validate

DATA = Path(__file__).parent / "data" / "captures"
CAPTURES = sorted(p.name.removesuffix(".gputrace.gz") for p in DATA.glob("*.gputrace.gz"))


def unpacked(name: str, tmp: Path) -> Path:
    out = tmp / f"{name}.gputrace"
    with gzip.open(DATA / f"{name}.gputrace.gz", "rb") as src, out.open("wb") as dst:
        shutil.copyfileobj(src, dst)
    return out


def steady_from(cap: Path, step: int) -> int:
    """When NVTX range ``step`` (1-based, in time order) ended."""
    with CaptureReader(cap) as reader:
        ends = sorted(r.end_ns for r in reader.records() if type(r) is NvtxRange and r.name == "step")
    assert len(ends) > step, f"{cap.name}: {len(ends)} NVTX step ranges"
    return ends[step - 1]


def shares(report: dict[str, Any], since: int) -> tuple[int, Counter[tuple[str, int]]]:
    """Total stall time of the stalls that began at ``since`` or later, and its parts by (cause, culprit pid)."""
    stalls = [s for s in report["stalls"] if s["start_ns"] >= since]
    by: Counter[tuple[str, int]] = Counter()
    for s in stalls:
        by[(s["cause"], int(s["culprit"].get("pid", 0)))] += s["duration_ns"]
    return sum(s["duration_ns"] for s in stalls), by


def test_every_recording_has_its_truth() -> None:
    assert CAPTURES, f"no recorded captures in {DATA}"
    for name in CAPTURES:
        truth = json.loads((DATA / f"{name}.truth.json").read_text())
        assert {"culprit_pid", "cause", "from_step", "min_share"} <= truth.keys(), name


@pytest.mark.parametrize("name", CAPTURES)
def test_a_recorded_capture_names_its_true_culprit(name: str, tmp_path: Path) -> None:
    truth = json.loads((DATA / f"{name}.truth.json").read_text())
    cap = unpacked(name, tmp_path)
    out = subprocess.run([sys.executable, "-m", "gputrace", "report", "--json", str(cap)], capture_output=True,
                         text=True, timeout=300, cwd=tmp_path)  # fmt: skip
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    validate(report)
    assert report["schema"] == "gputrace.report/1" and report["capture"]["complete"], report["capture"]
    total, by = shares(report, steady_from(cap, truth["from_step"]))
    assert total > 0, f"{name}: no stalls in the steady steps"
    right = by[(truth["cause"], truth["culprit_pid"])] / total
    assert right >= truth["min_share"], (name, right, by.most_common(6))
    job = Counter({pid: ns for (cause, pid), ns in by.items() if cause != "tracing"})
    others = [(pid, ns) for pid, ns in job.items() if pid != truth["culprit_pid"]]
    culprit_ns = sum(ns for pid, ns in job.items() if pid == truth["culprit_pid"])
    assert all(ns < culprit_ns for _, ns in others), (name, job.most_common(4))
    assert "overhead" in report["capture"], "a capture since the cost meter says what tracing cost"
