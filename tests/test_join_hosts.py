"""One job of 8 ranks on 4 hosts, 2 ranks a host, each host a capture (synthetic): the joined report names each
late step's late rank for every other rank's wait, wherever it ran; a host's own capture, which holds 2 of the
8 ranks, still sees its ranks wait for a rank it did not capture (and never takes its own last rank for the late
one); and each host's OTLP export, made alone, puts its ranks' spans in the trace of each collective instance.

The hosts' monotonic clocks differ by tens of ms and their headers' realtime offsets carry a few ms of NTP
error, which the collectives correct. bench/multihost_scale.py runs the same job for real (namespaces, eBPF).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from opentelemetry.sdk.trace import ReadableSpan, SpanProcessor

from gputrace.analysis import analyze
from gputrace.analysis.join import analyze_many
from gputrace.capture import open_capture
from gputrace.exporters.otlp import collective_trace_id, record_spans
from gputrace.records import CollectiveCall
from gputrace.testing.schemas import validate
from gputrace.testing.synth import Builder, ns

HOSTS = ("host-a", "host-b", "host-c", "host-d")
PIDS = (100, 101)  # the same two pids on every host: each host has its own pid space
WORLD = 8
STEPS = 16
STEP_MS = 100.0
REALTIME = 1_700_000_000_000_000_000
MS = 1_000_000
SKEW_MS = (0.0, 37.0, -21.0, 55.0)  # each host's monotonic clock, ahead of host A's
NTP_ERROR_MS = (0.0, 3.0, -2.0, 4.0)  # what each header's realtime offset gets wrong
# every other step one rank is late, in turn every rank, by a read of its shard or a sleep
LATE = {k: ((5, 2, 7, 1, 4, 6, 3, 0)[k // 2 % 8], "storage" if k % 4 == 1 else "sleep") for k in range(1, STEPS, 2)}


def shard(k: int) -> str:
    return f"/data/shard-{k}.bin"


def write_job(tmp: Path) -> list[Path]:
    """Per step, every rank runs a 10 ms kernel, then its all-reduce, which completes 5 ms after the last rank
    started it; the step's late rank (LATE) first reads its shard or sleeps for 30 ms."""
    builders = []
    for h in range(len(HOSTS)):
        b = Builder()
        for pid in PIDS:
            b.proc(pid, f"rank{2 * h + pid - PIDS[0]}").device(pid)
        builders.append(b)
    for k in range(STEPS):
        late, cause = LATE.get(k, (-1, ""))
        t = k * STEP_MS
        last = t + (40.0 if late >= 0 else 10.0 + 0.05 * (WORLD - 1))
        for rank in range(WORLD):
            h, pid = divmod(rank, 2)
            b, pid, off = builders[h], PIDS[pid], SKEW_MS[h]
            b.op(pid, pid, t + off, t + off, t + off + 10, "fwd")
            arrive = 40.0 if rank == late else 10.0 + 0.05 * rank  # on-time ranks a few dozen us apart
            if rank == late:
                what = ("pread64", shard(k), 1 << 20) if cause == "storage" else ("clock_nanosleep", "", 0)
                b.syscall(pid, pid, what[0], t + off + 10.5, t + off + 39.5, what[1], what[2])
            c = b.op(pid, pid, t + off + arrive, t + off + arrive, last + off + 5, "ncclDevKernel_AllReduce_Sum_f32")
            b.collective(pid, c, "all_reduce", k + 1, rank, WORLD, comm="c0ffee")
    return [b.write(tmp / f"{host}.gputrace", header={
        "host": host, "mono_to_realtime_ns": REALTIME - int((SKEW_MS[h] - NTP_ERROR_MS[h]) * MS)})
        for h, (host, b) in enumerate(zip(HOSTS, builders, strict=True))]


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    return write_job(tmp_path_factory.mktemp("join_hosts"))


def report(paths: list[Path]) -> dict[str, Any]:
    readers = [open_capture(p) for p in paths]
    try:
        rep: dict[str, Any] = analyze_many(readers, [p.name for p in paths]) if len(paths) > 1 else \
            analyze(readers[0])
    finally:
        for r in readers:
            r.close()
    validate(rep)
    return rep


def where(rank: int) -> tuple[str, int]:
    return HOSTS[rank // 2], PIDS[rank % 2]


def waits_of(rep: dict[str, Any], seq: int) -> dict[tuple[str, int], dict[str, Any]]:
    """The collective stalls of instance ``seq``, by the (host, pid) that waited."""
    out = {}
    for s in rep["stalls"]:
        if s["cause"] == "collective" and s["culprit"]["object"] == f"all_reduce #{seq}":
            assert (s["host"], s["device_pid"]) not in out
            out[s["host"], s["device_pid"]] = s
    return out


def check_step(rep: dict[str, Any], k: int, hosts: tuple[str, ...]) -> None:
    """Step ``k`` of a report of ``hosts``' captures: each captured on-time rank waited 30 ms; for the late rank
    where it was captured (named, with its host, rank and own cause), else for a rank not captured (no pid)."""
    late, cause = LATE[k]
    late_host, late_pid = where(late)
    waits = waits_of(rep, k + 1)
    early = {where(r) for r in range(WORLD) if r != late and where(r)[0] in hosts}
    assert set(waits) == early, (k, sorted(waits))
    for (host, pid), s in waits.items():
        rank = 2 * HOSTS.index(host) + PIDS.index(pid)
        assert abs(s["duration_ns"] - (30 - 0.05 * rank) * MS) < 1000, (k, s)  # from its arrival to the late one's
        c = s["culprit"]
        if late_host in hosts:
            assert (c["host"], c["pid"], c["rank"]) == (late_host, late_pid, late), (k, s)
            assert s["late_rank"]["cause"] == cause and s["late_rank"]["culprit"]["host"] == late_host
            assert s["late_rank"]["culprit"]["object"] == (shard(k) if cause == "storage" else "")
        else:
            assert c["pid"] == 0 and "rank" not in c and "late_rank" not in s, (k, s)
            assert s["why"] == "ran past its shortest run; late rank not captured"
    rows = [r for r in rep["collectives"] if r["seq"] == k + 1]
    assert len(rows) == 2 * len(hosts) and {r["ranks_captured"] for r in rows} == {2 * len(hosts)}
    marked = [(r["host"], r["pid"]) for r in rows if r.get("late")]
    assert marked == ([(late_host, late_pid)] if late_host in hosts else []), (k, marked)


def test_four_joined_captures_name_every_late_rank_on_its_host_with_its_cause(job: list[Path]) -> None:
    rep = report(job)
    assert rep["join"]["jobs"] == [[0, 1, 2, 3]]
    assert sum("disagree by" in n for n in rep["join"]["notes"]) == 3  # B, C and D's NTP errors, said
    for h, c in enumerate(rep["captures"]):
        assert c["joined"] and c["anchors"] == (STEPS if h else 0)
        assert abs(c["shift_ns"] + SKEW_MS[h] * MS) < 10 and abs(c["correction_ns"] + NTP_ERROR_MS[h] * MS) < 10
    assert rep["join"]["uncertainty_ns"] is not None and rep["join"]["uncertainty_ns"] < 10
    for k in LATE:
        check_step(rep, k, HOSTS)
    on_time = [s for s in rep["stalls"] if s["cause"] == "collective"
               and int(s["culprit"]["object"].split("#")[1]) - 1 not in LATE]
    assert on_time == []  # the on-time ranks arrive within the minimum gap of each other


@pytest.mark.parametrize("hosts", [(0,), (1,), (0, 1), (1, 2, 3)], ids=["A", "B", "A+B", "B+C+D"])
def test_captures_of_some_hosts_see_their_ranks_wait_for_a_rank_not_captured(job: list[Path],
                                                                              hosts: tuple[int, ...]) -> None:
    rep = report([job[h] for h in hosts])
    for k in LATE:
        check_step(rep, k, tuple(HOSTS[h] for h in hosts))


class Collect(SpanProcessor):
    """A span processor that keeps every ended span."""

    def __init__(self) -> None:
        self.spans: list[ReadableSpan] = []

    def on_end(self, span: ReadableSpan) -> None:
        self.spans.append(span)


def test_each_hosts_own_export_adds_its_ranks_to_one_trace_per_instance(job: list[Path]) -> None:
    by_trace: dict[int, list[tuple[str, Any]]] = {}
    stall_traces = 0
    for h, path in enumerate(job):
        with open_capture(path) as reader:
            rep = analyze(reader)
            collect = Collect()
            record_spans(rep, reader.header, collect)
        for span in collect.spans:
            by_trace.setdefault(span.context.trace_id, []).append((HOSTS[h], span))
        stall_traces += 1
        # the host's own stalls trace holds its ranks' waits for late ranks elsewhere too
        waits = [s for s in collect.spans if s.name == "gpu.stall collective"]
        assert len(waits) == sum(2 if LATE[k][0] // 2 != h else 1 for k in LATE)
    assert len(by_trace) == STEPS + stall_traces
    for seq in range(1, STEPS + 1):
        spans = by_trace[collective_trace_id("c0ffee", seq)]
        assert sorted((h, s.attributes["gputrace.collective.rank"]) for h, s in spans) == \
            [(HOSTS[r // 2], r) for r in range(WORLD)]
        late = [s.attributes["gputrace.collective.rank"] for _, s in spans
                if s.attributes.get("gputrace.collective.late")]
        assert late == ([LATE[seq - 1][0]] if seq - 1 in LATE else []), (seq, late)


def test_a_late_completion_does_not_hide_the_captured_late_rank(tmp_path: Path) -> None:
    """Every rank's all-reduce of a late step completes 3 ms later than its transfer takes: of hosts A and B
    alone, the last captured rank, 30 ms late, is still the one named, not a rank that was not captured."""
    b = Builder()
    for pid in PIDS:
        b.proc(pid, f"rank{pid}").device(pid)
    for k in range(8):
        t, late = k * STEP_MS, k % 2 == 1
        for rank, pid in enumerate(PIDS):
            arrive = 40.0 if late and rank == 1 else 10.0
            done = 48.0 if late else 15.0
            c = b.op(pid, pid, t + arrive, t + arrive, t + done, "ncclDevKernel_AllReduce_Sum_f32")
            b.collective(pid, c, "all_reduce", k + 1, rank, WORLD, comm="c0ffee")
    rep = report([b.write(tmp_path / "a.gputrace", header={"host": "host-a"})])
    waits = [s for s in rep["stalls"] if s["cause"] == "collective"]
    assert len(waits) == 4 and all(s["culprit"]["pid"] == PIDS[1] and s["duration_ns"] == 30 * MS for s in waits)
    assert [r["seq"] for r in rep["collectives"] if r.get("late")] == [2, 4, 6, 8]


def test_host_calls_of_a_host_do_not_take_its_last_rank_for_the_late_one(tmp_path: Path) -> None:
    """gloo's blocking calls, 2 ranks of 8 on this host, which call 2 ms apart: on the steps where a rank not
    captured calls 30 ms after them, no call here is the late one, nor waited for the other (the time is
    explained as a rank alone's); on the others, this host's rank 1 is the last (2 ms late, or 30 ms)."""
    b = Builder()
    for pid in PIDS:
        b.proc(pid, f"rank{pid}")
    for k in range(8):
        t = k * STEP_MS
        for rank, pid in enumerate(PIDS):
            arrive, done = {0: (10.0 + 2 * rank, 15.0), 1: (10.0 + 2 * rank, 45.0)}[k % 2]
            if k % 4 == 3 and rank == 1:  # this host's own late rank
                arrive = 40.0
            b.records.append(CollectiveCall(pid, pid, "all_reduce", "c0ffee", k + 1, rank, WORLD, 4096, "gloo",
                                            ns(t + arrive), ns(t + done), True))
    rep = report([b.write(tmp_path / "a.gputrace", header={"host": "host-a"})])
    rows = rep["collectives"]
    assert len(rows) == 16 and all(r["backend"] == "gloo" for r in rows)
    late = {r["seq"]: r["rank"] for r in rows if r.get("late")}
    assert late == {1: 1, 3: 1, 4: 1, 5: 1, 7: 1, 8: 1}, late  # not 2 nor 6: a rank not captured came last
    waited = {(r["seq"], r["rank"]): r["waited_ns"] for r in rows if r["waited_ns"]}
    assert waited == {(1, 0): 2 * MS, (3, 0): 2 * MS, (4, 0): 30 * MS, (5, 0): 2 * MS, (7, 0): 2 * MS,
                      (8, 0): 30 * MS}, waited
