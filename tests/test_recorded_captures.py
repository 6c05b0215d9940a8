"""Captures recorded on a real GPU host (tests/data/captures/README.md), analysed as a user would: each
NAME.gputrace.gz through `gputrace report --json`, scored against NAME.truth.json.

The truth names the process whose work the job waited for (``culprit_pid``) and its cause; the score is its
share of the stall time of the steady steps (stalls that begin after the end of NVTX range ``step`` number
``from_step``: before that the job is starting up, and its own start-up is the honest answer there; a job
found already running has no NVTX ranges, and ``from_workers`` names its loader's workers instead: its
steady steps begin when the first of them started, as their agents' hello says). What
the tool itself took from the job is ``tracing``, never the job's: it may hold the rest, as may the trainer's
own CPU time between steps, but no other process may come out ahead of the culprit.

Where the truth names the loader's processes (``batches``: the trainer, the workers in worker order, batches per
epoch), each stall is also scored against the step it held up: the step's batch was made by worker
(k % per_epoch) % workers, so a stall before a step of the culprit's batches is the culprit's, and one before
a step of another worker's batch (long ready) is the trainer's own hand-off or that worker's."""

from __future__ import annotations

import bisect
import json
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from recorded import CAPTURES, DATA, unpacked

from gputrace.capture import CaptureReader
from gputrace.records import GpuKernel, GpuMemcpy, NvtxRange
from gputrace.testing.schemas import validate


def step_ranges(cap: Path) -> list[tuple[int, int]]:
    """The (start, end) of every NVTX range ``step``, in time order."""
    with CaptureReader(cap) as reader:
        return sorted((r.start_ns, r.end_ns) for r in reader.records() if type(r) is NvtxRange and r.name == "step")


def steady_from(name: str, ranges: list[tuple[int, int]], step: int) -> int:
    """When NVTX range ``step`` (1-based, in time order) ended; 0 for step 0 (every stall counts)."""
    if step == 0:
        return 0
    ends = sorted(end for _, end in ranges)
    assert len(ends) > step, f"{name}: {len(ends)} NVTX step ranges"
    return ends[step - 1]


def per_step_share(report: dict[str, Any], name: str, ranges: list[tuple[int, int]], truth: dict[str, Any],
                   since: int) -> float:
    """The share of the stall time after ``since`` whose culprit is that of the step it held up (the first step
    that began after the stall did; see the module's doc). The tool's own time (``tracing``) is never right."""
    batches = truth["batches"]
    workers, culprit = batches["workers"], truth["culprit_pid"]
    others = {batches["trainer"], *(w for w in workers if w != culprit)}
    starts = [start for start, _ in ranges]
    total = right = 0
    for s in report["stalls"]:
        if s["start_ns"] < since:
            continue
        k = bisect.bisect_left(starts, s["start_ns"])
        assert k < len(starts), f"{name}: a stall after the last step began: {s}"
        pid = int(s["culprit"].get("pid", 0))
        if workers[k % batches["per_epoch"] % len(workers)] == culprit:
            ok = (s["cause"], pid) == (truth["cause"], culprit)
        else:
            ok = s["cause"] in ("cpu", "cpu.runqueue") and pid in others
        total += s["duration_ns"]
        right += s["duration_ns"] * ok
    assert total > 0, f"{name}: no stalls in the steady steps"
    return right / total


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
        # every recording is scored at 90 % or more: on the whole steady stall time, or step by step
        assert truth["min_share"] >= 0.9 or "batches" in truth, name


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
    ranges = step_ranges(cap)
    since = steady_from(name, ranges, truth["from_step"])
    if "from_workers" in truth:  # no NVTX steps (a job found running): steady once its loader's workers started
        began = {d["pid"]: d["ns"] for d in report["capture"]["device_timing_from"]}
        since = min(began[pid] for pid in truth["from_workers"])
    total, by = shares(report, since)
    assert total > 0, f"{name}: no stalls in the steady steps"
    right = by[(truth["cause"], truth["culprit_pid"])] / total
    assert right >= truth["min_share"], (name, right, by.most_common(6))
    job = Counter({pid: ns for (cause, pid), ns in by.items() if cause != "tracing"})
    others = [(pid, ns) for pid, ns in job.items() if pid != truth["culprit_pid"]]
    culprit_ns = sum(ns for pid, ns in job.items() if pid == truth["culprit_pid"])
    assert all(ns < culprit_ns for _, ns in others), (name, job.most_common(4))
    assert "overhead" in report["capture"], "a capture since the cost meter says what tracing cost"
    if "batches" in truth:
        step_right = per_step_share(report, name, ranges, truth, since)
        assert step_right >= 0.9, (name, step_right)


ATTACHED = [name for name in CAPTURES if "attached_pid" in json.loads((DATA / f"{name}.truth.json").read_text())]


@pytest.mark.parametrize("name", ATTACHED)
def test_a_job_attached_to_mid_run_has_device_timing_from_the_attach(name: str, tmp_path: Path) -> None:
    """`capture -p` on a plainly started PyTorch job: the agent was injected, the pause was short, and the
    device work and stalls in the capture all come after device timing began (none is made up before it)."""
    pid = json.loads((DATA / f"{name}.truth.json").read_text())["attached_pid"]
    cap = unpacked(name, tmp_path)
    out = subprocess.run([sys.executable, "-m", "gputrace", "report", "--json", str(cap)], capture_output=True,
                         text=True, timeout=300, cwd=tmp_path)  # fmt: skip
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    [attached] = report["capture"]["attached"]
    assert attached["pid"] == pid and attached["how"] == "injected", attached
    assert 0 < attached["pause_ms"] <= 50, attached
    began = report["capture"]["device_timing_from_ns"]
    kinds: Counter[str] = Counter()
    with CaptureReader(cap) as reader:
        for rec in reader.records():
            if type(rec) in (GpuKernel, GpuMemcpy):
                assert rec.start_ns >= began, rec
                kinds[rec.kind if type(rec) is GpuMemcpy else "kernel"] += 1
    assert kinds["kernel"] > 1000 and kinds["h2d"] > 100 and kinds["d2h"] > 100, kinds
    assert report["stalls"] and min(s["start_ns"] for s in report["stalls"]) >= began
