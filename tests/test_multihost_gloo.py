"""A torch.distributed gloo job on two "hosts", each captured by its own `gputrace capture`: rank 1 is late by
its own cold read (test_multihost's job, with gloo's collectives on the CPU for the simulated ProcessGroup).

The hosts are test_multihost's: a network and a UTS namespace each, joined by a veth pair. The ranks meet at a
TCPStore on host A's address and gloo talks over the veth pair. Each rank has a simulated device, idle while
its thread blocks in an all-reduce; host B's rank reads a file dropped from the page cache, on a loop device
its blkio cgroup throttles, before every all-reduce.

`gputrace report A B` must name host B's rank, its pid and its file for host A's collective stalls, with the
captures' clocks aligned by the all-reduce calls themselves (no collective kernel is there); the separate OTLP
exports of A and B must land in one trace per all-reduce, with both hosts' spans in it; the joined Perfetto
trace draws each call and arrows from host B's call and read into host A's waits.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from otlp_receiver import grpc_receiver
from test_multihost import GPUTRACE, READ_BPS, blkio_group, capture_in, report_of, two_hosts, veths
from workloads.loopdev import loop_filesystem, write_file

from gputrace.exporters.otlp import collective_trace_id

pytestmark = pytest.mark.kernel  # network namespaces, a loop device and eBPF captures, as root

HERE = Path(__file__).resolve().parent
RANK = HERE / "workloads" / "gloo_rank.py"
STEPS = 5
FILE_BYTES = 128 << 10  # at 1 MiB/s a cold file takes about 125 ms: the late rank's lateness, every step
PORT = 29519


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    if os.geteuid() != 0:
        pytest.fail("these tests run as root (network namespaces, loop devices, eBPF)")
    tmp = tmp_path_factory.mktemp("multihost_gloo")
    with contextlib.ExitStack() as stack:
        fs = stack.enter_context(loop_filesystem(tmp, size_mib=32))
        files = [str(write_file(fs.mountpoint / f"shard-{k}.bin", FILE_BYTES)) for k in range(STEPS)]
        cgroup = stack.enter_context(blkio_group(fs.majmin, READ_BPS))
        ns_a, ns_b, addr_a = stack.enter_context(two_hosts())
        cfg = {"world": 2, "late_rank": 1, "address": f"{addr_a}:{PORT}", "ifaces": list(veths()), "steps": STEPS,
               "files": files, "cgroup": cgroup, "out": str(tmp), "timeout_s": 240}
        (tmp / "cfg.json").write_text(json.dumps(cfg))
        caps = {"A": tmp / "A.gputrace", "B": tmp / "B.gputrace"}
        procs = [capture_in(ns_a, "host-a", caps["A"], sys.executable, str(RANK), str(tmp / "cfg.json"), "0"),
                 capture_in(ns_b, "host-b", caps["B"], sys.executable, str(RANK), str(tmp / "cfg.json"), "1")]
        outs = [p.communicate(timeout=400)[0] for p in procs]
        for p, out in zip(procs, outs, strict=True):
            assert p.returncode == 0, out
        late_pid, comm = (tmp / "1.done").read_text().split()
        assert (tmp / "0.done").read_text().split()[1] == comm  # one communicator id on both hosts
        yield {"tmp": tmp, "caps": caps, "files": files, "late_pid": int(late_pid), "comm": comm,
               "report": report_of(caps["A"], caps["B"])}


def all_reduces(rep: dict[str, Any]) -> list[int]:
    return sorted({r["seq"] for r in rep["collectives"] if r["op"] == "all_reduce"})


def test_report_of_two_gloo_hosts_names_the_late_rank_and_its_file(job: dict[str, Any]) -> None:
    rep = job["report"]
    assert [c["host"] for c in rep["captures"]] == ["host-a", "host-b"]
    assert rep["join"]["jobs"] == [[0, 1]] and rep["join"]["uncertainty_ns"] is not None
    # no collective kernel anywhere: the clocks are aligned by the calls, each instance's two returns
    b = rep["captures"][1]
    assert b["joined"] and b["anchors"] >= STEPS + 1 and b["uncertainty_ns"] < 10 * rep["min_gap_ns"], b
    waits = [s for s in rep["stalls"] if s["host"] == "host-a" and s["cause"] == "collective"]
    total = sum(s["duration_ns"] for s in waits)
    assert total >= STEPS * 50_000_000, waits  # each cold read holds rank 0 back by about 125 ms
    late_rank = ("host-b", job["late_pid"], 1)
    right = sum(s["duration_ns"] for s in waits
                if (s["culprit"]["host"], s["culprit"]["pid"], s["culprit"].get("rank")) == late_rank
                and s["culprit"]["object"].startswith("all_reduce #")
                and s.get("late_rank", {}).get("cause") == "storage"
                and s["late_rank"]["culprit"]["object"] in job["files"]
                and s["late_rank"]["culprit"]["host"] == "host-b")
    assert right >= 0.95 * total, json.dumps(waits, indent=1)[:4000]
    # every rank's call of every all-reduce, on one communicator; the late one is rank 1, for its own read
    rows = [r for r in rep["collectives"] if r["op"] == "all_reduce"]
    assert len(all_reduces(rep)) == STEPS and all(r["backend"] == "gloo" for r in rows)
    assert {(r["host"], r["rank"], r["comm"]) for r in rows} == {("host-a", 0, job["comm"]),
                                                                 ("host-b", 1, job["comm"])}
    late = [r for r in rows if r.get("late")]
    assert len(late) >= STEPS - 1 and all(r["host"] == "host-b" and r["pid"] == job["late_pid"] for r in late)
    assert sum(1 for r in late if r.get("arrival", {}).get("cause") == "storage"
               and r["arrival"]["culprit"]["object"] in job["files"]) >= STEPS - 1, late
    assert all(r["waited_ns"] >= 50_000_000 for r in rows if r["host"] == "host-a"), rows


def test_separate_otlp_exports_make_one_trace_per_all_reduce(job: dict[str, Any]) -> None:
    with grpc_receiver() as (receiver, port):
        for name in ("A", "B"):
            r = subprocess.run([*GPUTRACE, "export", str(job["caps"][name]), "--otlp", f"127.0.0.1:{port}"],
                               capture_output=True, text=True, timeout=300)
            assert r.returncode == 0, r.stderr
    by_trace: dict[bytes, list[tuple[str, Any]]] = {}
    for req in receiver.requests:
        for rs in req.resource_spans:
            host = next(a.value.string_value for a in rs.resource.attributes if a.key == "host.name")
            for ss in rs.scope_spans:
                for span in ss.spans:
                    by_trace.setdefault(span.trace_id, []).append((host, span))
    seqs = all_reduces(job["report"])
    assert len(seqs) == STEPS
    for seq in seqs:
        spans = by_trace.get(collective_trace_id(job["comm"], seq).to_bytes(16, "big"), [])
        ranks = [(h, s) for h, s in spans if s.name == f"collective all_reduce #{seq}"]
        assert sorted(h for h, _ in ranks) == ["host-a", "host-b"], (seq, [(h, s.name) for h, s in spans])
        attrs = {h: {a.key: a.value for a in s.attributes} for h, s in ranks}
        assert attrs["host-b"]["gputrace.arrival.cause"].string_value == "storage"
        assert attrs["host-b"]["gputrace.arrival.culprit.object"].string_value in job["files"]
        assert attrs["host-b"]["process.pid"].int_value == job["late_pid"]
        assert {attrs[h]["gputrace.collective.comm"].string_value for h in attrs} == {job["comm"]}
        assert {attrs[h]["gputrace.collective.backend"].string_value for h in attrs} == {"gloo"}
        assert attrs["host-b"]["thread.id"].int_value == job["late_pid"]  # its main thread called it
        # each span runs from its rank's arrival (the call) to the completion: rank 0's holds the wait
        took = {h: s.end_time_unix_nano - s.start_time_unix_nano for h, s in ranks}
        assert took["host-a"] >= 50_000_000 and took["host-b"] < took["host-a"] / 2, took


def test_perfetto_export_of_two_gloo_hosts_draws_the_calls_and_arrows(job: dict[str, Any]) -> None:
    from gputrace.exporters.perfetto.tracks import ID_SPAN
    from gputrace.testing.perfetto_check import check_trace

    out = job["tmp"] / "job.pftrace"
    r = subprocess.run([*GPUTRACE, "export", str(job["caps"]["A"]), str(job["caps"]["B"]), "--perfetto", str(out),
                        "-f"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and "CollectiveCall" not in r.stderr, r.stderr
    check = check_trace(out)
    assert check.problems == [], check.problems
    late_thread = check.thread(job["late_pid"] + ID_SPAN)
    calls_b = [t for t in check.children(late_thread) if t.name == "collectives"]
    assert len(calls_b) == 1
    names = [s.name for s in check.slices_on(calls_b[0])]
    assert [f"all_reduce #{seq}" for seq in all_reduces(job["report"])] == [n for n in names if "all_reduce" in n]
    stalls_a = [t for t in check.tracks.values()
                if t.name == "stalls" and (check.parent_name(t) or "").startswith("host-a: ")]
    into = [(src, dst) for t in stalls_a for src, dst in check.flows_into(t)]
    arrivals = [(src, dst) for src, dst in into if src.track == calls_b[0].uuid]
    assert len({dst.ts for _, dst in arrivals}) >= STEPS - 1, [(check.track_of(s).name, s.name) for s, _ in into]
    assert all(src.ts <= dst.ts and src.name.startswith("all_reduce #") for src, dst in arrivals)
    reads = [dst.ts for src, dst in into if src.args.get("obj") in job["files"]
             and check.track_of(src).tid == job["late_pid"] + ID_SPAN]
    assert len(set(reads)) >= STEPS - 1
