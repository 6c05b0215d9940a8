"""`gputrace export A B --perfetto OUT`: one trace of a job's captures from two hosts, checked with the official
protos (gputrace.testing.perfetto_check). The captures are test_join's synthetic job: rank 0 on host-a waits
in every all-reduce for rank 1 on host-b, which reads a file first; both ranks are pid 100 on their hosts."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from test_join import MS, PID, REALTIME, STEPS, job, joined

from gputrace.capture import open_capture
from gputrace.exporters.perfetto.tracks import ID_SPAN
from gputrace.records import CollectiveCall, Syscall
from gputrace.testing.perfetto_check import TraceCheck, check_trace
from gputrace.testing.synth import Builder, ns

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


GLOO_COMM = "9a1b2c3d4e5f6071"


def gloo_job(tmp: Path, *, skew_ms: float = 0.0) -> list[Path]:
    """test_join's job with torch.distributed gloo ranks: each all-reduce is a call on the host
    (CollectiveCall), no kernel. Rank 0 on host-a blocks in every call until rank 1 on host-b, which reads
    a file first, arrives; each rank's device idles meanwhile. Host B's clock runs ``skew_ms`` behind."""
    a = Builder().proc(PID, "rank0").device(PID)
    b = Builder().proc(PID, "rank1").device(PID)
    for k in range(STEPS):
        t = k * 42.0
        b_t = t - skew_ms
        a.op(PID, PID, t, t, t + 10, "fwd")
        b.op(PID, PID, b_t, b_t, b_t + 10, "fwd")
        a.syscall(PID, PID, "write", t + 0.2, t + 0.3, "/tmp/log", 10)
        b.syscall(PID, PID, "pread64", b_t + 1, b_t + 39.5, "/data/rank1.bin", 1 << 20)
        # both calls return together, once rank 1's data is in
        a.records.append(CollectiveCall(PID, PID, "all_reduce", GLOO_COMM, k + 2, 0, 2, 4096, "gloo", ns(t + 1),
                                        ns(t + 41), True))
        b.records.append(CollectiveCall(PID, PID, "all_reduce", GLOO_COMM, k + 2, 1, 2, 4096, "gloo",
                                        ns(b_t + 40), ns(b_t + 41), True))
    end = STEPS * 42.0
    a.op(PID, PID, end, end, end + 10, "last")  # the last wait's stall ends here
    b.op(PID, PID, end - skew_ms, end - skew_ms, end - skew_ms + 10, "last")
    return [a.write(tmp / "a.gputrace", header={"host": "host-a", "mono_to_realtime_ns": REALTIME}),
            b.write(tmp / "b.gputrace", header={"host": "host-b", "mono_to_realtime_ns": REALTIME})]


def test_gloo_calls_are_drawn_with_arrows_from_the_late_ranks_arrival(tmp_path: Path) -> None:
    """Host collective calls on each thread's "collectives" track, named as the report names them; the
    late rank's call on host-b (its arrival) and its read point into host-a's waits."""
    paths = gloo_job(tmp_path, skew_ms=SKEW_MS)
    rep = joined(paths)
    b = rep["captures"][1]
    assert b["anchors"] == STEPS and b["correction_ns"] == int(SKEW_MS * MS) and b["uncertainty_ns"] == 0
    waits = [s for s in rep["stalls"] if s["host"] == "host-a" and s["cause"] == "collective"]
    assert len(waits) == STEPS and all(s["late_rank"]["cause"] == "storage" for s in waits), rep["stalls"]
    out = tmp_path / "gloo.pftrace"
    r = export(*map(str, paths), "--perfetto", str(out))
    assert r.returncode == 0 and "CollectiveCall" not in r.stderr, r.stderr
    check = checked(out)

    (calls_a,) = [t for t in check.children(check.thread(PID)) if t.name == "collectives"]
    (calls_b,) = [t for t in check.children(check.thread(PID + ID_SPAN)) if t.name == "collectives"]
    assert [s.name for s in check.slices_on(calls_a)] == [f"all_reduce #{k + 2}" for k in range(STEPS)]
    late = check.slices_on(calls_b)
    assert all(s.args["comm"] == GLOO_COMM and s.args["rank"] == 1 and s.args["backend"] == "gloo" for s in late)
    # host-b's calls on host-a's clock: each arrives 39 ms into host-a's wait in the same instance
    for mine, theirs in zip(check.slices_on(calls_a), late, strict=True):
        assert theirs.ts - mine.ts == 39 * MS and theirs.end == mine.end

    stalls_a = check.track("stalls", parent="host-a: GPU 0: sim-gpu (simulated)")
    into = check.flows_into(stalls_a)
    arrivals = [(src, dst) for src, dst in into if src.track == calls_b.uuid]
    assert len(arrivals) == STEPS and all(src.ts <= dst.ts for src, dst in arrivals), [
        (check.track_of(s).name, s.name) for s, _ in into]
    resumes = sorted(dst.ts for _, dst in arrivals)
    assert resumes == [s["end_ns"] for s in waits]
    # the waiting rank's own call, and the late rank's read, point at the same resume
    assert sorted(dst.ts for src, dst in into if src.track == calls_a.uuid) == resumes
    assert sorted(dst.ts for src, dst in into if src.name == "pread64") == resumes


def test_gloo_calls_of_one_capture_are_drawn_too(tmp_path: Path) -> None:
    path = gloo_job(tmp_path)[0]
    out = tmp_path / "alone.pftrace"
    r = export(str(path), "--perfetto", str(out))
    assert r.returncode == 0 and "skipped" not in r.stderr, r.stderr
    check = checked(out)
    calls = check.slices_on(check.track("collectives", parent="rank0"))
    assert len(calls) == STEPS and all(s.args["waited"] is True and s.args["world"] == 2 for s in calls)
