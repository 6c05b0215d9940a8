"""`gputrace export A B --perfetto OUT`: one trace of a job's captures from two hosts, checked with the official
protos (gputrace.testing.perfetto_check). The captures are test_join's synthetic job: rank 0 on host-a waits
in every all-reduce for rank 1 on host-b, which reads a file first; both ranks are pid 100 on their hosts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from test_join import MS, PID, STEPS, job, joined

from gputrace.capture import open_capture
from gputrace.exporters.perfetto.tracks import ID_SPAN
from gputrace.records import Syscall
from gputrace.testing.perfetto_check import TraceCheck, check_trace

SKEW_MS = 7.0  # host-b's clock runs this far behind host-a's: the join shifts its records by +7 ms


def export(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gputrace", "export", *args], capture_output=True, text=True,
                          timeout=120)


def checked(path: Path) -> TraceCheck:
    r = subprocess.run([sys.executable, "-m", "gputrace.testing.perfetto_check", str(path)], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 0 and r.stdout.startswith("OK"), r.stdout + r.stderr
    check = check_trace(path)
    assert check.problems == []
    return check


def test_two_hosts_make_one_trace_on_one_clock(tmp_path: Path) -> None:
    paths = job(tmp_path, skew_ms=SKEW_MS)
    rep = joined(paths)
    shift = rep["captures"][1]["shift_ns"]
    assert shift == int(SKEW_MS * MS)
    out = tmp_path / "job.pftrace"
    r = export(*map(str, paths), "--perfetto", str(out))
    assert r.returncode == 0, r.stderr
    check = checked(out)

    # both hosts' processes, apart though their pids are equal, each named with its host
    procs = {t.name: t for t in check.tracks.values() if t.kind == "process"}
    assert procs["host-a: rank0"].pid == PID
    assert procs[f"host-b: rank1 (pid {PID})"].pid == PID + ID_SPAN
    devices = sorted(t.name for t in check.tracks.values() if t.name.endswith("(simulated)"))
    assert devices == ["host-a: GPU 0: sim-gpu (simulated)", "host-b: GPU 0: sim-gpu (simulated)"]

    # host-b's records are on host-a's clock: its reads where its capture has them, shifted by the join
    with open_capture(paths[1]) as reader:
        raw = sorted(rec.start_ns for rec in reader.records() if isinstance(rec, Syscall))
    reads = [s for s in check.slices_on(check.thread(PID + ID_SPAN)) if s.name == "pread64"]
    assert sorted(s.ts for s in reads) == [t + shift for t in raw] and len(reads) == STEPS

    # the joined report's stalls on each host's device
    stalls_a = check.track("stalls", parent="host-a: GPU 0: sim-gpu (simulated)")
    stalls_b = check.track("stalls", parent="host-b: GPU 0: sim-gpu (simulated)")
    waits = [s for s in check.slices_on(stalls_a) if s.name == "collective"]
    assert len(waits) == STEPS and all(s.args["culprit_pid"] == PID for s in waits)
    assert sum(1 for s in check.slices_on(stalls_b) if s.name == "storage") == STEPS
    assert [s.ts for s in waits] == [s["start_ns"] for s in rep["stalls"]
                                     if s["host"] == "host-a" and s["cause"] == "collective"]

    # arrows from the late rank's cause on host-b (its read) into host-a's waits, forward in time
    into_a = check.flows_into(stalls_a)
    from_reads = [(src, dst) for src, dst in into_a if src.name == "pread64"]
    assert len(from_reads) == STEPS, [(s.name, d.name) for s, d in into_a]
    for src, dst in from_reads:
        assert check.track_of(src).tid == PID + ID_SPAN  # host-b's thread, not host-a's pid 100
        assert dst.name == "resume" and src.ts <= dst.ts
        wait = next(w for w in waits if w.ts <= src.ts and dst.ts == w.end)  # the read began in the wait it caused
        assert src.end <= wait.end
    # and from the late rank's collective kernel on host-b, which ended each wait
    kernels_b = {t.uuid for t in check.children(check.track("host-b: GPU 0: sim-gpu (simulated)"))}
    assert sum(1 for src, _ in into_a if src.track in kernels_b) == STEPS


def test_unrelated_captures_are_refused_with_the_reports_note(tmp_path: Path) -> None:
    paths = job(tmp_path, comm_b="other")
    out = tmp_path / "no.pftrace"
    r = export(*map(str, paths), "--perfetto", str(out))
    assert r.returncode != 0 and "share no communicator" in r.stderr and "export each capture" in r.stderr, r.stderr
    assert not out.exists()


def test_a_single_capture_exports_as_before(tmp_path: Path) -> None:
    paths = job(tmp_path)
    alone, twice = tmp_path / "alone.pftrace", tmp_path / "twice.pftrace"
    assert export(str(paths[0]), "--perfetto", str(alone)).returncode == 0
    # the same file named twice is one capture
    assert export(str(paths[0]), str(paths[0]), "--perfetto", str(twice)).returncode == 0
    assert alone.read_bytes() == twice.read_bytes()
    check = checked(alone)
    assert [t.name for t in check.tracks.values() if t.kind == "process"] == ["rank0"]
    assert check.process(PID).name == "rank0"
