"""Analysis in bounded memory (analysis/windowed.py): window by window, the same report as the whole capture's."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from recorded import CAPTURES, unpacked
from waiting import wait_for

from gputrace.analysis import analyze
from gputrace.analysis.frames import Spool
from gputrace.analysis.load import load
from gputrace.analysis.report import assemble
from gputrace.analysis.windowed import WindowedAnalysis
from gputrace.capture import open_capture
from gputrace.errors import JobEnded
from gputrace.testing.scale import generate


def whole(path: Path) -> dict[str, Any]:
    with open_capture(path) as reader:
        return dict(assemble(load(reader), 1_000_000))


def windowed(path: Path, bucket_ns: int, window_buckets: int, jobs: int = 1) -> tuple[dict[str, Any], WindowedAnalysis]:
    with open_capture(path) as reader:
        an = WindowedAnalysis(dict(reader.header), bucket_ns=bucket_ns, window_buckets=window_buckets, small_records=0,
                              jobs=jobs)
        for r in reader.records():
            an.add(r)
        return dict(an.report(reader)), an


@pytest.mark.parametrize("relay", [False, True])
def test_small_windows_give_the_whole_captures_stalls_causes_and_culprits(tmp_path: Path, relay: bool) -> None:
    """A 30 s DataLoader-like capture, 1500 stalls: windows of 30 ms (most stalls cross one) and of 4 s give
    the report the whole capture's analysis gives, every stall's cause, culprit and evidence included."""
    path = tmp_path / "long.gputrace"
    generate(path, 60_000, relay)
    want = whole(path)
    assert len(want["stalls"]) >= 1000 and want["summary"]["by_cause"].get("storage", 0) > 0
    explained = {}
    for bucket_ns, buckets in ((30_000_000, 1), (1_000_000_000, 4)):
        got, an = windowed(path, bucket_ns, buckets)
        assert an.held is None and an.windows > 1  # it did go window by window
        assert got == want
        explained[bucket_ns] = an.windows
    # its windows explained in three processes forked for them: the same report, every window explained once
    got, an = windowed(path, 30_000_000, 1, jobs=3)
    assert an.forked == 3 and an.windows == explained[30_000_000]
    assert got == want


def test_a_launch_long_before_its_op_and_every_rule_of_the_golden_capture(tmp_path: Path) -> None:
    """The golden capture's ten rules (a collective's late rank, a GPU sync, an op launched 15 ms before the stall
    it ends...) with 2 ms buckets: the same report."""
    from tests.test_analysis_golden import mixed_capture

    path = mixed_capture(tmp_path / "mixed.gputrace")
    want = whole(path)
    for bucket_ns, buckets, jobs in ((2_000_000, 1, 1), (5_000_000, 2, 1), (2_000_000, 1, 2)):
        got, an = windowed(path, bucket_ns, buckets, jobs)
        assert an.windows > 1 and an.forked == (jobs if jobs > 1 else 0)
        assert got == want


@pytest.mark.parametrize("name", CAPTURES)
def test_recorded_h100_captures_give_the_same_report_in_50ms_windows(tmp_path: Path, name: str) -> None:
    path = unpacked(name, tmp_path)
    want = whole(path)
    got, an = windowed(path, 50_000_000, 1)
    assert an.windows > 1
    assert got == want
    got, an = windowed(path, 50_000_000, 1, jobs=2)  # its windows explained in two processes
    assert an.forked == 2
    assert got == want


def test_report_of_a_long_capture_is_the_same_whatever_its_job_count(tmp_path: Path,
                                                                   capsys: pytest.CaptureFixture[str]) -> None:
    """``gputrace report --jobs N`` of a capture analysed window by window (over 200k records): one process or
    three, the same JSON."""
    from gputrace.cli import main

    path = tmp_path / "long.gputrace"
    generate(path, 250_000, True, stall_every=10)
    out = []
    for jobs in ("1", "3"):
        assert main(["report", str(path), "--json", "--jobs", jobs]) == 0
        out.append(capsys.readouterr().out)
    report = json.loads(out[0])
    assert len(report["stalls"]) > 1000 and report["summary"]["by_cause"].get("storage", 0) > 0
    assert out[1] == out[0]


def _children() -> set[int]:
    """This process's child processes (of any of its threads)."""
    return {int(pid) for task in Path("/proc/self/task").iterdir()
            for pid in (task / "children").read_text().split()}


@pytest.mark.parametrize("how", ["raises", "is killed"])
def test_a_process_explaining_windows_that_fails_fails_the_analysis(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                    how: str) -> None:
    """A window whose explanation fails in a process explaining windows (an error, or the process killed, as
    the kernel's OOM killer does): the analysis raises (no report short of that window's stalls), and no such
    process is left behind."""
    from gputrace.analysis import windowed as module

    path = tmp_path / "long.gputrace"
    generate(path, 20_000, False)
    explain = module.WindowedAnalysis._explain
    parent = os.getpid()

    def failing(self: WindowedAnalysis, spool: Spool, window: Any) -> Any:
        if os.getpid() != parent and window.b * self.bucket_ns >= 2_000_000_000:
            if how == "is killed":
                os.kill(os.getpid(), signal.SIGKILL)
            raise RuntimeError(f"window at bucket {window.b} failed")
        return explain(self, spool, window)

    monkeypatch.setattr(module.WindowedAnalysis, "_explain", failing)
    before = _children()
    message = "failed" if how == "raises" else r"ended without its results: killed by SIGKILL \(out of memory\?\)"
    with pytest.raises(RuntimeError if how == "raises" else JobEnded, match=message):
        windowed(path, 100_000_000, 1, jobs=2)
    assert _children() == before


def test_processes_explaining_windows_end_when_the_analysis_is_killed(tmp_path: Path) -> None:
    """The analysing process killed (SIGKILL: nothing of it runs) while the processes it forked explain windows:
    they end too, rather than explain on for nothing."""
    path = tmp_path / "long.gputrace"
    generate(path, 20_000, False)
    fifo = tmp_path / "never-written"
    os.mkfifo(fifo)
    script = f"""
import os
from gputrace.analysis import windowed as module
parent, explain = os.getpid(), module.WindowedAnalysis._explain
def held(self, spool, window):
    if os.getpid() != parent:
        open({str(fifo)!r}).read()  # held here: nothing writes it
    return explain(self, spool, window)
module.WindowedAnalysis._explain = held
from gputrace.capture import open_capture
with open_capture({str(path)!r}) as reader:
    an = module.WindowedAnalysis(dict(reader.header), bucket_ns=100_000_000, window_buckets=1, small_records=0,
                                 jobs=2)
    for r in reader.records():
        an.add(r)
    an.report(reader)
"""
    proc = subprocess.Popen([sys.executable, "-c", script])
    try:
        def blocked_jobs() -> list[int]:
            kids = [int(k) for k in Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()]
            return kids if len(kids) == 2 and all(
                Path(f"/proc/{k}/wchan").read_text() in ("fifo_open", "pipe_read", "wait_for_partner")
                for k in kids) else []

        kids = wait_for(blocked_jobs, 60, "two processes explaining windows, held at the fifo")
    finally:
        proc.kill()
        proc.wait()
    wait_for(lambda: not any(Path(f"/proc/{k}").exists() for k in kids), what="the jobs to end with their parent")


def test_the_records_held_at_once_do_not_grow_with_the_capture(tmp_path: Path) -> None:
    """Twice the capture, the same window: the most records loaded at once stays the same (one window with its
    margins), while the whole-capture analysis would hold twice as many."""
    peaks = []
    for n in (40_000, 80_000):
        path = tmp_path / f"c{n}.gputrace"
        generate(path, n, False)
        _, an = windowed(path, 200_000_000, 2)
        peaks.append(an.peak_window_records)
        assert an.peak_window_records < n / 10
    assert peaks[1] <= peaks[0] * 1.1


def test_a_small_capture_is_analysed_whole_and_a_large_one_by_windows(tmp_path: Path) -> None:
    path = tmp_path / "c.gputrace"
    generate(path, 20_000, False)
    with open_capture(path) as reader:
        assert analyze(reader) == whole(path)
    with open_capture(path) as reader:
        an = WindowedAnalysis(dict(reader.header), small_records=5_000)
        for r in reader.records():
            an.add(r)
        assert an.held is None  # past the threshold: spooled
        assert an.report(reader) == whole(path)


def test_the_spool_is_private_and_removed() -> None:
    spool = Spool(1_000_000_000)
    where = Path(spool._dir.name)
    assert os.stat(where).st_mode & 0o077 == 0
    spool.close()
    assert not where.exists()
