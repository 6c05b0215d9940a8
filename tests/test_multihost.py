"""A job on two "hosts", each captured by its own `gputrace capture`: one rank is late by its own cold read.

A host here is a network and a UTS namespace of this machine: a hostname of its own, and a veth pair
between the two that the ranks talk over. `nsenter --net` joins a namespace without remounting /sys (as
`ip netns exec` does), so tracefs stays visible to each capture's eBPF programs. Host B's rank reads a
file dropped from the page cache, on a loop device its blkio cgroup throttles, before every all-reduce.

`gputrace report A B` must name host B's rank, its pid, and its file, for the collective stalls of host A;
the separate OTLP exports of A and B must land in one trace per collective instance, with both hosts'
spans in it.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from otlp_receiver import grpc_receiver
from workloads.loopdev import loop_filesystem, write_file

from gputrace.exporters.otlp import collective_trace_id
from gputrace.testing.schemas import validate

pytestmark = pytest.mark.kernel  # root and the host's kernel (see tests/conftest.py)

HERE = Path(__file__).resolve().parent
RANK = HERE / "workloads" / "sim_rank.py"
GPUTRACE = [sys.executable, "-m", "gputrace"]
STEPS = 5
FILE_BYTES = 128 << 10
READ_BPS = 1 << 20  # a cold file takes about 125 ms: the late rank's lateness, every step
SUBNET = "10.231.{}.{}"
BLKIO = Path("/sys/fs/cgroup/blkio")


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def veths() -> tuple[str, str]:
    """The ends of the veth pair two_hosts makes, in namespace A and in namespace B."""
    tag = f"{os.getpid() % 100000}"
    return f"va{tag}", f"vb{tag}"


@contextlib.contextmanager
def two_hosts() -> Iterator[tuple[str, str, str]]:
    """Two network namespaces joined by a veth pair (``veths``): (namespace A, namespace B, A's address)."""
    tag = f"{os.getpid() % 100000}"
    a, b = f"gt-a-{tag}", f"gt-b-{tag}"
    va, vb = veths()
    net = SUBNET.format(os.getpid() % 250, "{}")
    made: list[str] = []
    try:
        for ns in (a, b):
            _ip("netns", "add", ns)
            made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("link", "add", va, "netns", a, "type", "veth", "peer", "name", vb, "netns", b)
        for ns, dev, host in ((a, va, 1), (b, vb, 2)):
            _ip("-n", ns, "addr", "add", f"{net.format(host)}/24", "dev", dev)
            _ip("-n", ns, "link", "set", dev, "up")
        yield a, b, net.format(1)
    finally:
        for ns in made:  # the veth pair goes with its namespaces
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)


@contextlib.contextmanager
def blkio_group(majmin: str, bps: int) -> Iterator[str]:
    g = BLKIO / f"gputrace-multihost-{os.getpid()}"
    g.mkdir()
    try:
        (g / "blkio.throttle.read_bps_device").write_text(f"{majmin} {bps}\n")
        yield str(g)
    finally:
        for _ in range(200):  # its last member may still be exiting
            try:
                g.rmdir()
                break
            except OSError:
                time.sleep(0.02)


def capture_in(ns: str, hostname: str, out: Path, *cmd: str) -> subprocess.Popen[str]:
    """`gputrace capture -- CMD` run on "host" ``ns``: its network namespace and a UTS namespace named
    ``hostname`` (the capture's header takes the host name from there)."""
    inner = [*GPUTRACE, "capture", "-f", "--no-perfetto", "--min-gap-ms", "1", "-o", str(out), "--", *cmd]
    return subprocess.Popen(["nsenter", f"--net=/run/netns/{ns}", "unshare", "--uts", "--", "sh", "-c",
                             'hostname "$0" && exec "$@"', hostname, *inner],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)


@pytest.fixture(scope="module")
def job(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    if os.geteuid() != 0:
        pytest.fail("these tests run as root (network namespaces, loop devices, eBPF)")
    tmp = tmp_path_factory.mktemp("multihost")
    with contextlib.ExitStack() as stack:
        fs = stack.enter_context(loop_filesystem(tmp, size_mib=32))
        files = [str(write_file(fs.mountpoint / f"shard-{k}.bin", FILE_BYTES)) for k in range(STEPS)]
        cgroup = stack.enter_context(blkio_group(fs.majmin, READ_BPS))
        ns_a, ns_b, addr_a = stack.enter_context(two_hosts())
        cfg = {"world": 2, "late_rank": 1, "address": f"{addr_a}:29517", "steps": STEPS, "files": files,
               "cgroup": cgroup, "out": str(tmp), "timeout_s": 240}
        (tmp / "cfg.json").write_text(json.dumps(cfg))
        caps = {"A": tmp / "A.gputrace", "B": tmp / "B.gputrace"}
        procs = [capture_in(ns_a, "host-a", caps["A"], sys.executable, str(RANK), str(tmp / "cfg.json"), "0"),
                 capture_in(ns_b, "host-b", caps["B"], sys.executable, str(RANK), str(tmp / "cfg.json"), "1")]
        outs = [p.communicate(timeout=400)[0] for p in procs]
        for p, out in zip(procs, outs, strict=True):
            assert p.returncode == 0, out
        late_pid, comm = (tmp / "1.done").read_text().split()
        yield {"tmp": tmp, "caps": caps, "files": files, "late_pid": int(late_pid), "comm": comm}


def report_of(*paths: Path) -> dict[str, Any]:
    r = subprocess.run([*GPUTRACE, "report", "--json", *map(str, paths)], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    doc: dict[str, Any] = json.loads(r.stdout)
    validate(doc)
    return doc


def test_report_of_two_hosts_names_the_late_rank_and_its_file(job: dict[str, Any]) -> None:
    rep = report_of(job["caps"]["A"], job["caps"]["B"])
    assert [c["host"] for c in rep["captures"]] == ["host-a", "host-b"]
    assert rep["join"]["jobs"] == [[0, 1]] and rep["join"]["uncertainty_ns"] is not None
    waits = [s for s in rep["stalls"] if s["host"] == "host-a" and s["cause"] == "collective"]
    total = sum(s["duration_ns"] for s in waits)
    assert total >= STEPS * 50_000_000, waits  # each cold read holds rank 0 back by about 125 ms
    right = sum(s["duration_ns"] for s in waits
                if s["culprit"]["host"] == "host-b" and s["culprit"]["pid"] == job["late_pid"]
                and s["culprit"].get("rank") == 1
                and s.get("late_rank", {}).get("cause") == "storage"
                and s["late_rank"]["culprit"]["object"] in job["files"]
                and s["late_rank"]["culprit"]["host"] == "host-b")
    assert right >= 0.95 * total, json.dumps(waits, indent=1)[:4000]
    # every rank's part in every all-reduce, on one communicator; the late one is rank 1, for its own read
    rows = [r for r in rep["collectives"] if r["seq"] > 1]
    assert {(r["host"], r["rank"], r["comm"]) for r in rows} == {("host-a", 0, job["comm"]),
                                                                 ("host-b", 1, job["comm"])}
    late = [r for r in rows if r.get("late")]
    assert late and all(r["host"] == "host-b" and r["pid"] == job["late_pid"] for r in late)
    assert sum(1 for r in late if r.get("arrival", {}).get("cause") == "storage") >= STEPS - 1
    # one capture alone still works as before: rank 0 waits, the late peer is not in it
    alone = report_of(job["caps"]["A"])
    assert "join" not in alone and alone["capture"]["host"] == "host-a"


def test_separate_otlp_exports_make_one_trace_per_collective(job: dict[str, Any]) -> None:
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
    for seq in range(2, STEPS + 2):
        spans = by_trace.get(collective_trace_id(job["comm"], seq).to_bytes(16, "big"), [])
        ranks = [(h, s) for h, s in spans if s.name.startswith("collective ")]
        assert sorted(h for h, _ in ranks) == ["host-a", "host-b"], (seq, [(h, s.name) for h, s in spans])
        attrs = {h: {a.key: a.value for a in s.attributes} for h, s in ranks}
        assert attrs["host-b"]["gputrace.arrival.cause"].string_value == "storage"
        assert attrs["host-b"]["gputrace.arrival.culprit.object"].string_value in job["files"]
        # each span runs from its rank's arrival to the completion: rank 0's holds the wait for the cold read
        took = {h: s.end_time_unix_nano - s.start_time_unix_nano for h, s in ranks}
        assert took["host-a"] >= 50_000_000 and took["host-b"] < took["host-a"] / 2, took


def test_perfetto_export_of_two_hosts_draws_the_late_ranks_read_into_the_waits(job: dict[str, Any]) -> None:
    from gputrace.exporters.perfetto.tracks import ID_SPAN
    from gputrace.testing.perfetto_check import check_trace

    out = job["tmp"] / "job.pftrace"
    r = subprocess.run([*GPUTRACE, "export", str(job["caps"]["A"]), str(job["caps"]["B"]), "--perfetto", str(out),
                        "-f"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    check = check_trace(out)
    assert check.problems == [], check.problems
    procs = [t for t in check.tracks.values() if t.kind == "process"]
    late = [t for t in procs if t.pid == job["late_pid"] + ID_SPAN]
    assert len(late) == 1 and late[0].name.startswith("host-b: "), [(t.name, t.pid) for t in procs]
    assert any(t.name.startswith("host-a: ") and t.pid < ID_SPAN for t in procs)
    stalls_a = [t for t in check.tracks.values()
                if t.name == "stalls" and (check.parent_name(t) or "").startswith("host-a: ")]
    reads = [(src, dst) for t in stalls_a for src, dst in check.flows_into(t)
             if src.args.get("obj") in job["files"] and (check.track_of(src).pid or 0) >= ID_SPAN]
    assert len({dst.ts for _, dst in reads}) >= STEPS - 1, [(s.name, s.args) for s, _ in reads]
    assert all(src.ts <= dst.ts for src, dst in reads)
