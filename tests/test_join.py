"""Joining captures of several hosts (gputrace.analysis.join) on synthetic captures: clocks that disagree,
captures of unrelated jobs, hostile collective records."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

from gputrace.analysis.join import analyze_many
from gputrace.capture import CaptureWriter, host_header, open_capture
from gputrace.testing.schemas import validate
from gputrace.testing.synth import Builder, ns

PID = 100  # the same pid on both hosts: hosts have their own pid spaces
STEPS = 4
REALTIME = 1_700_000_000_000_000_000
MS = 1_000_000


def job(tmp: Path, *, skew_ms: float = 0.0, header_ms: float = 0.0, comm_b: str = "c0ffee",
        jitter_ms: float = 0.0) -> list[Path]:
    """Rank 0 on host-a waits in every all-reduce for rank 1 on host-b, which reads a file first. Host B's
    clock runs ``skew_ms`` behind; its header says it is ``header_ms`` ahead of host A's realtime."""
    a = Builder().proc(PID, "rank0").device(PID)
    b = Builder().proc(PID, "rank1").device(PID)
    for k in range(STEPS):
        t = k * 100.0
        b_t = t - skew_ms + (jitter_ms if k % 2 else -jitter_ms)
        a.op(PID, PID, t, t, t + 10, "fwd")
        b.op(PID, PID, b_t, b_t, b_t + 10, "fwd")
        ca = a.op(PID, PID, t + 9, t + 10, t + 45, "ncclDevKernel_AllReduce_Sum_f32")
        b.syscall(PID, PID, "pread64", b_t + 10.5, b_t + 39.5, "/data/rank1.bin", 1 << 20)
        cb = b.op(PID, PID, b_t + 39.9, b_t + 40, b_t + 45, "ncclDevKernel_AllReduce_Sum_f32")
        a.collective(PID, ca, "all_reduce", k + 1, 0, 2, comm="c0ffee")
        b.collective(PID, cb, "all_reduce", k + 1, 1, 2, comm=comm_b)
    return [a.write(tmp / "a.gputrace", header={"host": "host-a", "mono_to_realtime_ns": REALTIME}),
            b.write(tmp / "b.gputrace",
                    header={"host": "host-b", "mono_to_realtime_ns": REALTIME + int(header_ms * MS)})]


def joined(paths: list[Path]) -> dict[str, Any]:
    readers = [open_capture(p) for p in paths]
    try:
        return analyze_many(readers, [p.name for p in paths])
    finally:
        for r in readers:
            r.close()


def waits_on_a(rep: dict[str, Any]) -> list[dict[str, Any]]:
    return [s for s in rep["stalls"] if s["host"] == "host-a" and s["cause"] == "collective"]


def test_late_rank_on_another_host_is_named_with_its_own_cause(tmp_path: Path) -> None:
    rep = joined(job(tmp_path))
    waits = waits_on_a(rep)
    assert len(waits) == STEPS
    for s in waits:
        assert s["duration_ns"] == 30 * MS
        assert (s["culprit"]["host"], s["culprit"]["pid"], s["culprit"]["rank"]) == ("host-b", PID, 1)
        assert s["culprit"]["object"].startswith("all_reduce #")
        assert s["late_rank"]["cause"] == "storage" and s["late_rank"]["culprit"]["object"] == "/data/rank1.bin"
        assert s["late_rank"]["culprit"]["host"] == "host-b"
    late = [r for r in rep["collectives"] if r.get("late")]
    assert {(r["host"], r["rank"]) for r in late} == {("host-b", 1)} and len(late) == STEPS
    assert all(r["arrival"]["cause"] == "storage" for r in late)


def test_clocks_that_disagree_are_said_and_aligned_by_the_collectives(tmp_path: Path) -> None:
    # host B's realtime is 2 s off (its header says so), while both monotonic clocks read alike
    rep = joined(job(tmp_path, header_ms=2000.0))
    b = rep["captures"][1]
    assert b["header_shift_ns"] == 2000 * MS and b["correction_ns"] == -2000 * MS and b["uncertainty_ns"] == 0
    assert any("disagree by 2000.0 ms" in n for n in rep["join"]["notes"])
    assert len(waits_on_a(rep)) == STEPS and all(s["culprit"]["host"] == "host-b" for s in waits_on_a(rep))


def test_completions_too_scattered_to_order_ranks_leave_the_captures_unjoined(tmp_path: Path) -> None:
    rep = joined(job(tmp_path, jitter_ms=20.0))
    assert rep["captures"][1]["joined"] is False
    assert any("too uncertain" in n for n in rep["join"]["notes"])
    assert not any(s["culprit"].get("host") == "host-b" for s in waits_on_a(rep))  # unknown, never a guess


def test_captures_of_unrelated_jobs_are_said_and_analysed_apart(tmp_path: Path) -> None:
    rep = joined(job(tmp_path, comm_b="other"))
    assert rep["join"]["jobs"] == [[0], [1]]
    assert any("share no communicator" in n for n in rep["join"]["notes"])
    assert not any(s["culprit"].get("host") == "host-b" for s in rep["stalls"] if s["host"] == "host-a")


def test_hostile_collective_records_are_counted_and_skipped(tmp_path: Path) -> None:
    paths = job(tmp_path)
    w = CaptureWriter(tmp_path / "bad.gputrace", {**host_header(["t"]), "host": "host-b"}, force=True)
    with open_capture(paths[1]) as reader:
        w.write([r for r in reader.records() if type(r).__name__ != "Collective"])
    row: list[Any] = [PID, 0, 999, "all_reduce", 1, 1, 2, 8, "c0ffee"]
    w.write_rows("Collective", [
        [*row[:4], (1 << 64) - 1, *row[5:]],  # a sequence number past what a trace attribute holds
        [*row[:4], -5, *row[5:]],  # a negative one
        [*row[:3], "x" * 10_000, *row[4:]],  # an overlong name
        [*row[:8], ["c0ffee"]],  # a communicator that is not a string
    ])  # fmt: skip
    bad = w.close({"end_ns": ns(500), "drops": {}})
    rep = joined([paths[0], bad])
    assert rep["captures"][1]["capture"]["malformed_records"] == 4
    assert rep["join"]["jobs"] == [[0], [1]]  # nothing left names the communicator host A's ranks use


def test_report_cli_joins_and_a_single_capture_is_unchanged(tmp_path: Path) -> None:
    paths = job(tmp_path)

    def report(*args: str) -> dict[str, Any]:
        r = subprocess.run([sys.executable, "-m", "gputrace", "report", "--json", *args], capture_output=True,
                           text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        doc: dict[str, Any] = json.loads(r.stdout)
        validate(doc)
        return doc

    both = report(*map(str, paths))
    assert len(both["captures"]) == 2 and both["capture"]["host"] == "host-a, host-b"
    alone = report(str(paths[0]))
    assert "join" not in alone and "captures" not in alone
    assert all(s["culprit"]["pid"] == 0 for s in alone["stalls"] if s["cause"] == "collective")
    terminal = subprocess.run([sys.executable, "-m", "gputrace", "report", *map(str, paths)], capture_output=True,
                              text=True, timeout=120, env={**os.environ, "COLUMNS": "200"})
    assert terminal.returncode == 0 and "rank 1 pid 100 (rank1) on host-b" in terminal.stdout, terminal.stdout
