"""What tracing costs, measured in the capture itself (daemon/cost.py), and source families turned off
(gputrace capture --off): real captures of the bundled example, real eBPF, real BPF statistics."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from gputrace.capture import CaptureReader
from gputrace.daemon.cost import CostMeter, CpuSplit
from gputrace.probes.ebpf.bpfstats import SYSCTL, RunStats, fdinfo_fields
from gputrace.records import TracingCost

pytestmark = pytest.mark.kernel  # root and the host's kernel (see tests/conftest.py)

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_sim.py"


def gputrace(*args: str, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gputrace", *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)  # fmt: skip


def capture(tmp: Path, *flags: str, steps: int = 12) -> tuple[Path, subprocess.CompletedProcess[str]]:
    out = tmp / "cost.gputrace"
    run = gputrace("capture", "-f", "--no-perfetto", "-o", str(out), *flags, "--", sys.executable, str(EXAMPLE),
                   "--steps", str(steps), "--slow-worker", "1", "--data", str(tmp / "data"))  # fmt: skip
    assert run.returncode == 0, run.stderr
    return out, run


def report(path: Path) -> dict[str, Any]:
    run = gputrace("report", "--json", str(path))
    assert run.returncode == 0, run.stderr
    return dict(json.loads(run.stdout))


def costs(path: Path) -> list[TracingCost]:
    with CaptureReader(path) as reader:
        return [r for r in reader.records() if type(r) is TracingCost]


def test_a_capture_measures_and_shows_what_it_cost(tmp_path: Path) -> None:
    before = SYSCTL.read_text()
    path, run = capture(tmp_path)
    assert SYSCTL.read_text() == before  # statistics were on for the capture only; the host's setting stands
    line = [ln for ln in run.stderr.splitlines() if ln.startswith("tracing cost: ")]
    assert len(line) == 1 and "% of host CPU (probes " in line[0] and "session " in line[0], run.stderr
    ov = report(path)["capture"]["overhead"]
    assert 0 < ov["cpu_share"] < 1 and ov["host_cpus"] >= 1 and ov["window_ns"] > 0, ov
    assert {"ebpf", "session", "agent"} <= ov["by_source"].keys() and "missing" not in ov, ov
    programs = ov["programs"]
    for prog in ("ebpf.sys_enter", "ebpf.sys_exit", "ebpf.sched_switch"):
        assert programs[prog]["runs"] > 0 and programs[prog]["ns"] > 0, programs.get(prog)
    assert ov["by_source"]["ebpf"] == sum(p["ns"] for k, p in programs.items() if k.startswith("ebpf."))
    assert ov["events"]["ebpf"] > 0 and ov["wakeups"]["ebpf"] > 0, ov
    # Cumulative readings per source (each second, and one at the end): they never go down, the last is the total.
    session = [r.cpu_ns for r in costs(path) if r.source == "session"]
    assert session and session == sorted(session) and session[-1] == ov["by_source"]["session"]


def test_statistics_already_on_for_the_host_are_left_on(tmp_path: Path) -> None:
    before = SYSCTL.read_text()
    SYSCTL.write_text("1")
    try:
        path, _ = capture(tmp_path, steps=6)
        assert SYSCTL.read_text().strip() == "1"
    finally:
        SYSCTL.write_text(before)
    assert report(path)["capture"]["overhead"]["programs"]["ebpf.sys_enter"]["runs"] > 0


def test_run_statistics_through_the_descriptor_time_a_program(tmp_path: Path) -> None:
    """bpf(BPF_ENABLE_STATS) turns the kernel's timing on while its descriptor is open, whatever the sysctl."""
    from bcc import BPF

    before = SYSCTL.read_text()
    SYSCTL.write_text("0")
    bpf = BPF(text=b"RAW_TRACEPOINT_PROBE(sys_enter) { return 0; }")
    try:
        fd = bpf.funcs[b"raw_tracepoint__sys_enter"].fd
        stats = RunStats()
        assert stats.open() and stats.on, stats.why
        try:
            for _ in range(200):
                Path("/proc/self/stat").read_text()
            on = fdinfo_fields(Path(f"/proc/self/fdinfo/{fd}").read_text())
        finally:
            stats.close()
        assert on["run_cnt"] > 0 and on["run_time_ns"] > 0, on
        assert not stats.on and SYSCTL.read_text().strip() == "0"
    finally:
        bpf.cleanup()
        SYSCTL.write_text(before)


def test_families_turned_off_are_not_traced_and_the_capture_says_so(tmp_path: Path) -> None:
    path, run = capture(tmp_path, "--off", "block,faults", "--off", "sampler,nvml,cgroups")
    assert "turned off: block, cgroups, faults, nvml, sampler" in run.stderr, run.stderr
    r = report(path)
    cap = r["capture"]
    assert cap["off"] == ["block", "cgroups", "faults", "nvml", "sampler"]
    programs = cap["overhead"]["programs"]
    assert not [p for p in programs if p.startswith(("ebpf.block_", "ebpf.mm_filemap_fault", "sampler."))], programs
    assert programs["ebpf.sys_enter"]["runs"] > 0  # the rest traced as ever
    assert "sampler" not in cap["overhead"]["by_source"]
    assert r["summary"]["stall_ns"] > 0 and r["summary"]["by_cause"].get("cpu", 0) > 0  # the slow worker still
    with CaptureReader(path) as reader:
        kinds = {type(rec).__name__ for rec in reader.records()}
    assert not kinds & {"StackSample", "NvmlSample", "CpuCgroup", "BlockIO", "PageFault"}, kinds


def test_without_the_scheduler_hooks_running_cannot_be_told_from_waiting(tmp_path: Path) -> None:
    path, _ = capture(tmp_path, "--off", "sched")
    r = report(path)
    assert r["summary"]["stall_ns"] > 0
    assert set(r["summary"]["by_cause"]) <= {"unknown", "sync", "sleep", "storage", "network"}, r["summary"]
    whys = [s.get("why", "") for s in r["stalls"] if s["cause"] == "unknown"]
    assert whys and any("--off sched" in w for w in whys), whys[:3]


def test_an_unknown_family_is_one_line_naming_them_all(tmp_path: Path) -> None:
    run = gputrace("capture", "--off", "sched,gpu", "--", "true")
    assert run.returncode == 2 and run.stderr.count("\n") == 1, run.stderr
    assert "unknown source family gpu for --off (one of: syscalls, sched, block" in run.stderr


def test_the_services_cpu_time_is_split_between_the_jobs_present_while_it_accrues() -> None:
    """Watch mode's jobs share one service process: each job's cost meter counts its part of the process's CPU
    time, split evenly between the jobs present at each moment, and the parts add up to the whole."""
    now = [1_000]
    split = CpuSplit(lambda: now[0])
    now[0] += 500  # no job yet: nobody's
    a = split.join("a")
    now[0] += 300  # a alone
    b = split.join("b")
    now[0] += 400  # a and b
    assert (a(), b()) == (500, 200)
    split.leave("a")
    now[0] += 100  # b alone
    assert b() == 300 and split.part("a") == 0
    c = split.join("c")
    now[0] += 1  # an odd nanosecond is left out, never counted twice
    assert (b(), c()) == (300, 0)
    assert sum(split.parts.values()) <= now[0] - 1_000 - 500


def test_a_cost_meter_counts_its_session_cpu_from_where_it_started() -> None:
    part = [7_000]
    rows: list[Any] = []

    class Sink:
        def emit(self, recs: Any) -> None:
            rows.extend(recs)

        def emit_kernel(self, blob: bytes, nevents: int) -> None:
            raise AssertionError("the meter emits records only")

        def emit_meta(self, source: str, meta: dict[str, Any]) -> None:
            raise AssertionError("the meter emits records only")

    meter = CostMeter(Sink(), lambda: [], None, session_cpu=lambda: part[0])
    meter.start()
    part[0] += 2_500
    meter.final()
    # its zero at the start, then what it used since
    assert [(r.source, r.cpu_ns) for r in rows] == [("session", 0), ("session", 2_500)]
    assert rows[0].ts == meter.start_ns < rows[1].ts
