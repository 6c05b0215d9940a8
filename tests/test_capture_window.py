"""The capture's window starts when tracing began, not when the file was opened before the probes were compiled
and loaded (seconds); Ctrl-C from the moment tracing is announced ends the capture cleanly."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from gputrace.analysis import analyze
from gputrace.capture import CaptureReader, CaptureWriter, host_header
from gputrace.cli import main
from gputrace.daemon.session import CaptureOptions, run_capture
from gputrace.records import ProcExec
from gputrace.testing.synth import BASE_NS, Builder, ns

pytestmark = pytest.mark.kernel  # root and the host's kernel (see tests/conftest.py)

GPUTRACE = [sys.executable, "-m", "gputrace"]
TRAINER = 100


def _report(path: Path, capsys: pytest.CaptureFixture[str]) -> dict[str, Any]:
    assert main(["report", str(path), "--json"]) == 0
    report: dict[str, Any] = json.loads(capsys.readouterr().out)
    return report


def _captured_ms(text: str) -> float:
    m = re.search(r"· ([\d,.]+) ms captured", text)
    assert m, text
    return float(m.group(1).replace(",", ""))


# ------------------------------------------------------------------------------------------ real capture ---
def test_captured_time_is_the_commands_not_the_probe_loading(tmp_path: Path) -> None:
    t0 = time.monotonic()
    r = subprocess.run(GPUTRACE + ["capture", "-o", "s.gputrace", "--no-perfetto", "--", "sleep", "0.3"],
                       cwd=tmp_path, capture_output=True, text=True, timeout=120)
    wall_ms = (time.monotonic() - t0) * 1000
    assert r.returncode == 0, r.stderr
    with CaptureReader(tmp_path / "s.gputrace") as reader:
        recs = list(reader.records())
        header, trailer, session = reader.header, reader.trailer, reader.meta.get("session")
    assert trailer is not None and session is not None
    tracing = trailer["tracing_ns"]
    assert session["tracing_ns"] == tracing  # a capture cut off before its trailer knows it too
    assert header["start_ns"] + 1_000_000_000 < tracing < trailer["end_ns"]  # the probes took seconds to load
    execs = [x for x in recs if isinstance(x, ProcExec) and x.filename.endswith("sleep")]
    assert execs and execs[0].ts >= tracing  # the command was held until tracing began

    report = subprocess.run(GPUTRACE + ["report", "s.gputrace", "--json"], cwd=tmp_path, capture_output=True,
                            text=True, timeout=60)
    cap = json.loads(report.stdout)["capture"]
    assert cap["start_ns"] == tracing and cap["end_ns"] == trailer["end_ns"]
    text = subprocess.run(GPUTRACE + ["report", "s.gputrace"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=60).stdout
    captured = _captured_ms(text)
    assert 300 <= captured < wall_ms - 1000, (captured, wall_ms)


def test_ctrl_c_as_tracing_is_announced_keeps_the_capture(tmp_path: Path) -> None:
    """The signal arrives the moment tracing is announced, before the session waits: it ends the capture,
    which is written, instead of throwing it away."""
    sent: list[int] = []

    def interrupt() -> None:
        os.kill(os.getpid(), signal.SIGINT)  # the handler runs before kill returns, on this (the main) thread
        sent.append(1)

    opts = CaptureOptions(output=tmp_path / "c.gputrace", command=["sleep", "0.5"], perfetto=False, progress=False,
                          sample_hz=0, argv=["test"], on_tracing=interrupt)
    previous = signal.getsignal(signal.SIGINT)
    result = run_capture(opts, log=lambda _: None)
    assert sent and signal.getsignal(signal.SIGINT) is previous  # the session's handlers are gone again
    assert result.stop_reason == "stopped" and result.exit_code == 0
    with CaptureReader(tmp_path / "c.gputrace") as reader:
        list(reader.records())
        assert reader.complete and reader.trailer is not None and reader.trailer["stop_reason"] == "stopped"


# ------------------------------------------------------------------------------------------ recorded files ---
def _stalled() -> Builder:
    b = Builder().proc(TRAINER, "python").device(TRAINER)
    b.op(TRAINER, TRAINER, 0, 100, 110, "fwd")
    b.op(TRAINER, TRAINER, 150, 150, 160, "bwd")
    return b


def test_start_is_the_trailers_tracing_time(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = _stalled().write(tmp_path / "t.gputrace", trailer={"tracing_ns": ns(90)})
    report = _report(path, capsys)
    assert report["capture"]["start_ns"] == ns(90)
    assert [s["start_ns"] for s in report["stalls"]] == [ns(110)]
    assert main(["report", str(path)]) == 0
    out = capsys.readouterr().out
    assert _captured_ms(out) == 70.0  # 90 -> 160 ms, not from the header's start_ns (0 ms)
    assert re.search(r"^│ 0\.020 s ", out, re.M), out  # the stall at 110 ms, 20 ms after tracing began


def test_capture_without_tracing_time_starts_at_its_header(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Captures written before the session recorded when tracing began read and report as they always did."""
    path = _stalled().write(tmp_path / "old.gputrace")
    with CaptureReader(path) as reader:
        list(reader.records())
        assert reader.trailer is not None and "tracing_ns" not in reader.trailer and not reader.meta
    report = _report(path, capsys)
    assert report["capture"]["start_ns"] == BASE_NS and report["capture"]["end_ns"] == ns(160)
    assert main(["report", str(path)]) == 0
    assert _captured_ms(capsys.readouterr().out) == 160.0


def test_cut_off_capture_starts_at_the_sessions_tracing_time(tmp_path: Path,
                                                             capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "cut.gputrace"
    w = CaptureWriter(path, {**host_header(["test"]), "start_ns": BASE_NS}, force=True)
    w.write(_stalled().records)
    w.write_meta("session", {"tracing_ns": ns(95)})
    cut = w.partial_path.stat().st_size
    w.close({"end_ns": ns(200)})
    with open(path, "r+b") as f:
        f.truncate(cut)  # as a crash leaves it: no trailer
    report = _report(path, capsys)
    assert not report["capture"]["complete"]
    assert report["capture"]["start_ns"] == ns(95)


def test_gpu_work_seen_before_tracing_began_moves_the_start_back(tmp_path: Path) -> None:
    """No stall may come before the capture's start (its offsets would be negative)."""
    path = _stalled().write(tmp_path / "early.gputrace", trailer={"tracing_ns": ns(120)})
    with CaptureReader(path) as reader:
        report = analyze(reader)
    assert report["capture"]["start_ns"] == ns(100)  # the first kernel, not 120 ms
    assert all(s["start_ns"] >= report["capture"]["start_ns"] for s in report["stalls"])


@pytest.mark.parametrize("bad", [-5, 0, "soon", 1.5, True])
def test_a_malformed_tracing_time_is_ignored(tmp_path: Path, capsys: pytest.CaptureFixture[str], bad: object) -> None:
    path = _stalled().write(tmp_path / "bad.gputrace", trailer={"tracing_ns": bad})
    assert _report(path, capsys)["capture"]["start_ns"] == BASE_NS
