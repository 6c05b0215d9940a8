#!/usr/bin/env python3
"""Multi-host scale, measured: one job of 8 ranks on 4 "hosts", each host captured by its own `gputrace capture`.

    sudo .venv/bin/python bench/multihost_scale.py [--steps 48] [--exports 3] [--keep DIR]

A host is a network and a UTS namespace of this machine (a hostname of its own, a veth into a bridge that the
four share); each runs two ranks of one job of the simulated ProcessGroup (gputrace.sim, over TCP, star on rank
0) under its own capture, started by `nsenter --net` (not `ip netns exec`, which remounts /sys and hides tracefs
from the capture). Every step each rank runs a 5 ms kernel, then all-reduces, then waits for it (a training loop
reading its loss). Every other step one rank, in turn, is late by its own cause: a cold read of a file on a loop
device its blkio cgroup throttles (``storage``) or a sleep (``sleep``).

Then, in the same run:
- `gputrace report A B C D --json`: every early rank's collective stall of a late step must name the late rank,
  its host and its own cause (the read's file);
- `gputrace export A B C D --otlp` to a real OTLP gRPC receiver: each collective instance must be one trace
  holding all 8 ranks' spans from the 4 hosts; its requests are measured (spans and bytes per collective,
  protobuf and gzip), and the export's CPU per span (each capture exported again in a fresh process, analysis
  and export timed apart, medians);
- the extrapolation to 1,000 hosts x 8 ranks at the measured collective rate and at 100 collectives/s per rank.

Exits 1 when a check fails. Needs root (namespaces, a loop device, a blkio cgroup, eBPF). The namespaces, the
loop device and the cgroup go away on the way out, Ctrl-C and failures included.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

GPUTRACE = [sys.executable, "-m", "gputrace"]
HOSTS = ("host-a", "host-b", "host-c", "host-d")
RANKS_PER_HOST = 2
WORLD = len(HOSTS) * RANKS_PER_HOST
KERNEL_MS = 5.0
LATE_MS = 60.0  # a sleeping rank's lateness; a cold read's is about the same (FILE_BYTES at READ_BPS)
FILE_BYTES = 160 << 10  # blk-throttle lets a fresh slice pass ~100 ms of its rate at once: the rest waits
READ_BPS = 1 << 20
PORT = 29531
# who is late on the late steps, in turn: every rank once, on every host, each cause on each host
LATE_TURNS = ((5, "storage"), (2, "sleep"), (7, "storage"), (1, "sleep"), (4, "sleep"), (6, "storage"),
              (3, "storage"), (0, "sleep"))
TARGET_HOSTS, TARGET_RANKS_PER_HOST, TARGET_RATE = 1000, 8, 100.0
BLKIO = Path("/sys/fs/cgroup/blkio")


def host_of(rank: int) -> int:
    return rank // RANKS_PER_HOST


def plan(steps: int) -> dict[int, tuple[int, str]]:
    """step -> (late rank, its cause): every other step, the next of LATE_TURNS."""
    return {k: LATE_TURNS[(k // 2) % len(LATE_TURNS)] for k in range(steps) if k % 2 == 1}


# ------------------------------------------------------------------------------------- the job itself ---
def rank_main(cfg_path: str, rank: int) -> None:
    """One rank: line up, then per step a kernel, (when its turn) its own cause of lateness, the all-reduce, and
    a wait for it. Writes RANK.done (its pid and the communicator id) last."""
    from gputrace.sim import Device, ProcessGroup

    cfg = json.loads(Path(cfg_path).read_text())
    late = {int(k): (int(r), str(c)) for k, (r, c) in cfg["plan"].items()}
    Path(cfg["cgroup"], "cgroup.procs").write_text(str(os.getpid()))
    group = ProcessGroup(rank, WORLD, cfg["address"], timeout_s=cfg["timeout_s"])
    s = Device(0).stream()
    s.all_reduce(group, 8, duration_ms=1.0)  # the ranks started at different times: line them up first
    s.synchronize()
    for k in range(cfg["steps"]):
        s.launch(f"fwd_bwd_{k}", KERNEL_MS)
        who, cause = late.get(k, (-1, ""))
        if who == rank and cause == "storage":
            read_cold(cfg["files"][str(k)], LATE_MS / 1e3)
        elif who == rank:
            time.sleep(LATE_MS / 1e3)
        s.all_reduce(group, 1 << 20, duration_ms=1.0)
        s.synchronize()
    group.close()
    Path(cfg["out"], f"{rank}.done").write_text(f"{os.getpid()} {group.comm_id}")


def read_cold(paths: list[str], at_least_s: float) -> None:
    """Cold reads of ``paths`` in turn until ``at_least_s`` went by: the kernel's blk-throttle now and then lets
    a whole file through at once (a slice's allowance), and then the next file is read."""
    t0 = time.monotonic()
    for path in paths:
        read_uncached(path)
        if time.monotonic() - t0 >= at_least_s:
            return


def read_uncached(path: str) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        n = 0
        while chunk := os.read(fd, 1 << 20):
            n += len(chunk)
        return n
    finally:
        os.close(fd)


def host_main(cfg_path: str, host: int) -> int:
    """A host's ranks, as its launcher would start them: the capture's command, so both are traced."""
    procs = [subprocess.Popen([sys.executable, __file__, "--rank", cfg_path, str(r)])
             for r in range(host * RANKS_PER_HOST, (host + 1) * RANKS_PER_HOST)]
    return max(p.wait() for p in procs)


# ------------------------------------------------------------------------------------------ the hosts ---
def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@contextlib.contextmanager
def four_hosts() -> Iterator[tuple[list[str], list[str]]]:
    """Four network namespaces on one bridge (in a fifth, the switch): (namespaces, their addresses)."""
    tag = os.getpid() % 100000
    switch = f"gt-sw-{tag}"
    names = [f"gt-{h[-1]}-{tag}" for h in HOSTS]
    addrs = [f"10.232.{tag % 250}.{i + 1}" for i in range(len(HOSTS))]
    made: list[str] = []
    try:
        for ns in (switch, *names):
            _ip("netns", "add", ns)
            made.append(ns)
            _ip("-n", ns, "link", "set", "lo", "up")
        _ip("-n", switch, "link", "add", "br0", "type", "bridge")
        _ip("-n", switch, "link", "set", "br0", "up")
        for i, (ns, addr) in enumerate(zip(names, addrs, strict=True)):
            _ip("link", "add", f"gth{i}-{tag}", "netns", ns, "type", "veth", "peer", "name", f"gts{i}-{tag}",
                "netns", switch)
            _ip("-n", switch, "link", "set", f"gts{i}-{tag}", "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{addr}/24", "dev", f"gth{i}-{tag}")
            _ip("-n", ns, "link", "set", f"gth{i}-{tag}", "up")
        yield names, addrs
    finally:
        for ns in reversed(made):  # each veth pair goes with its namespaces
            subprocess.run(["ip", "netns", "del", ns], check=False, capture_output=True)


@contextlib.contextmanager
def blkio_group(majmin: str, bps: int) -> Iterator[str]:
    g = BLKIO / f"gputrace-multihost-scale-{os.getpid()}"
    g.mkdir()
    try:
        (g / "blkio.throttle.read_bps_device").write_text(f"{majmin} {bps}\n")
        yield str(g)
    finally:
        for pid in (g / "cgroup.procs").read_text().split():  # ranks left behind by a failed run: ours
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)
        for _ in range(500):  # its last member may still be exiting
            try:
                g.rmdir()
                break
            except OSError:
                time.sleep(0.02)


def capture_in(ns: str, hostname: str, out: Path, log: Path, *cmd: str) -> subprocess.Popen[bytes]:
    """`gputrace capture -- CMD` on "host" ``ns`` (nsenter and unshare exec: the process is the capture's)."""
    inner = [*GPUTRACE, "capture", "-f", "--no-perfetto", "--min-gap-ms", "1", "-o", str(out), "--", *cmd]
    with open(log, "wb") as f:
        return subprocess.Popen(["nsenter", f"--net=/run/netns/{ns}", "unshare", "--uts", "--", "sh", "-c",
                                 'hostname "$0" && exec "$@"', hostname, *inner], stdout=f, stderr=subprocess.STDOUT)


def stop_all(procs: list[subprocess.Popen[bytes]]) -> None:
    """Captures still running (the run failed or was interrupted): asked to stop, then killed."""
    for p in procs:
        if p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGINT)
    for p in procs:
        try:
            p.wait(timeout=30)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def run_job(tmp: Path, steps: int, stack: contextlib.ExitStack) -> dict[str, Any]:
    """The 4 hosts' captures of one job: {caps, files, pids, comm, wall_s}."""
    from workloads.loopdev import loop_filesystem, write_file

    fs = stack.enter_context(loop_filesystem(tmp, size_mib=32))
    late = plan(steps)
    files = {str(k): [str(write_file(fs.mountpoint / f"shard-{k}-{n}.bin", FILE_BYTES)) for n in range(3)]
             for k, (_, cause) in late.items() if cause == "storage"}
    cgroup = stack.enter_context(blkio_group(fs.majmin, READ_BPS))
    names, addrs = stack.enter_context(four_hosts())
    cfg = {"address": f"{addrs[0]}:{PORT}", "steps": steps, "plan": {str(k): v for k, v in late.items()},
           "files": files, "cgroup": cgroup, "out": str(tmp), "timeout_s": 240}
    (tmp / "cfg.json").write_text(json.dumps(cfg))
    caps = [tmp / f"{h}.gputrace" for h in HOSTS]
    procs: list[subprocess.Popen[bytes]] = []
    t0 = time.monotonic()
    try:
        for i, (ns, h) in enumerate(zip(names, HOSTS, strict=True)):
            procs.append(capture_in(ns, h, caps[i], tmp / f"{h}.log", sys.executable, __file__, "--host",
                                    str(tmp / "cfg.json"), str(i)))
        for p, h in zip(procs, HOSTS, strict=True):
            if p.wait(timeout=600) != 0:
                raise SystemExit(f"{h}'s capture failed:\n{(tmp / f'{h}.log').read_text()[-3000:]}")
    finally:
        stop_all(procs)
    done = [(tmp / f"{r}.done").read_text().split() for r in range(WORLD)]
    comms = {c for _, c in done}
    if len(comms) != 1:
        raise SystemExit(f"the ranks do not share one communicator: {comms}")
    return {"caps": caps, "files": files, "pids": [int(p) for p, _ in done], "comm": comms.pop(),
            "plan": late, "wall_s": time.monotonic() - t0}


# ------------------------------------------------------------------------------------------ measuring ---
def children_cpu() -> float:
    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def timed(cmd: list[str], timeout: float = 600) -> tuple[subprocess.CompletedProcess[str], float, float]:
    """(result, wall s, CPU s of the child)."""
    c0, t0 = children_cpu(), time.monotonic()
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    return r, time.monotonic() - t0, children_cpu() - c0


@dataclass
class Checks:
    lines: list[str] = field(default_factory=list)
    failed: int = 0

    def check(self, ok: bool, what: str) -> None:
        self.lines.append(f"  [{'ok' if ok else 'FAILED'}] {what}")
        self.failed += not ok


def check_report(rep: dict[str, Any], job: dict[str, Any], checks: Checks) -> None:
    """Every early rank's collective stall of a late step names the late rank, its host and its own cause."""
    pids = job["pids"]
    checks.check([c["host"] for c in rep["captures"]] == list(HOSTS), f"captures' hosts {list(HOSTS)}")
    checks.check(rep["join"]["jobs"] == [[0, 1, 2, 3]] and all(c["joined"] for c in rep["captures"]),
                 f"one job of 4 joined captures (notes: {rep['join']['notes']})")
    unc = rep["join"]["uncertainty_ns"]
    checks.check(unc is not None and unc < 10 * rep["min_gap_ns"],
                 f"clocks aligned by the collectives: uncertainty {unc} ns, anchors "
                 f"{[c['anchors'] for c in rep['captures'][1:]]}")
    rows = [r for r in rep.get("collectives", []) if r["comm"] == job["comm"]]
    seqs = sorted({r["seq"] for r in rows})
    per = {s: sorted((r["host"], r["rank"]) for r in rows if r["seq"] == s) for s in seqs}
    want = sorted((HOSTS[host_of(r)], r) for r in range(WORLD))
    checks.check(len(seqs) == job["steps"] + 1 and all(v == want for v in per.values()),
                 f"{len(seqs)} collective instances ({job['steps']} steps + the line-up), each with all 8 ranks "
                 "on their hosts")
    named = total = late_ok = 0
    wrong: list[str] = []
    for k, (late, cause) in sorted(job["plan"].items()):
        seq = k + 2
        host = HOSTS[host_of(late)]
        late_rows = [r for r in rows if r["seq"] == seq and r.get("late")]
        late_ok += (len(late_rows) == 1 and late_rows[0]["rank"] == late and late_rows[0]["host"] == host
                    and late_rows[0].get("arrival", {}).get("cause") == cause)
        for r in (r for r in rows if r["seq"] == seq and r["rank"] != late):
            stalls = [s for s in rep["stalls"] if s["cause"] == "collective" and s["host"] == r["host"]
                      and s.get("device_pid") == r["pid"] and s["start_ns"] < r["completed_ns"]
                      and s["end_ns"] > r["started_ns"]]
            total += 1
            ok = bool(stalls) and all(_names_late(s, host, pids[late], late, cause, job["files"].get(str(k), []))
                                     for s in stalls)
            named += ok
            if not ok:
                wrong.append(f"step {k} rank {r['rank']}: {[_brief(s) for s in stalls]}")
    checks.check(named == total, f"{named} of {total} early ranks' collective stalls (7 per late step) name the "
                 "late rank, its host and its own cause" + (f"; first wrong: {wrong[:3]}" if wrong else ""))
    checks.check(late_ok == len(job["plan"]), f"{late_ok} of {len(job['plan'])} late steps: the late rank's row "
                 "is the only one marked late, with its arrival's cause")


def _names_late(s: dict[str, Any], host: str, pid: int, rank: int, cause: str, files: list[str]) -> bool:
    """The stall's culprit is the late rank, and why that rank was late is its own cause (the step's file)."""
    c, lr = s["culprit"], s.get("late_rank") or {}
    if (c.get("host"), c.get("pid"), c.get("rank")) != (host, pid, rank) or lr.get("cause") != cause:
        return False
    culprit = lr.get("culprit") or {}
    if culprit.get("host") != host:
        return False
    return cause != "storage" or culprit.get("object") in files


def _brief(s: dict[str, Any]) -> dict[str, Any]:
    return {"culprit": s["culprit"], "late_rank": s.get("late_rank"), "ms": s["duration_ns"] / 1e6}


@dataclass
class Spans:
    """What the receiver got, by host and kind."""

    by_trace: dict[bytes, list[tuple[str, Any]]] = field(default_factory=dict)
    req_bytes: dict[str, int] = field(default_factory=dict)  # host -> serialized request bytes
    req_gzip: dict[str, int] = field(default_factory=dict)
    count: dict[tuple[str, str], int] = field(default_factory=dict)  # (host, kind) -> spans
    span_bytes: dict[tuple[str, str], int] = field(default_factory=dict)  # (host, kind) -> Span message bytes
    collective_only: dict[str, tuple[int, int]] = field(default_factory=dict)  # host -> (bytes, gzip bytes)
    arrival: dict[bool, list[int]] = field(default_factory=dict)  # collective spans' sizes, by "has an arrival"


def kind_of(name: str) -> str:
    if name.startswith("collective "):
        return "collective"
    if name.startswith("gpu.stall "):
        return "stall"
    return "capture" if name == "gputrace capture" else "evidence"


def read_requests(requests: list[Any]) -> Spans:
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest

    out = Spans()
    only: dict[str, Any] = {}
    for req in requests:
        data = req.SerializeToString()
        for rs in req.resource_spans:
            host = next(a.value.string_value for a in rs.resource.attributes if a.key == "host.name")
            out.req_bytes[host] = out.req_bytes.get(host, 0) + len(data)
            out.req_gzip[host] = out.req_gzip.get(host, 0) + len(gzip.compress(data))
            mine = only.setdefault(host, ExportTraceServiceRequest())
            keep = mine.resource_spans.add()
            keep.resource.CopyFrom(rs.resource)
            for ss in rs.scope_spans:
                scope = keep.scope_spans.add()
                scope.scope.CopyFrom(ss.scope)
                for span in ss.spans:
                    kind = kind_of(span.name)
                    out.by_trace.setdefault(span.trace_id, []).append((host, span))
                    out.count[host, kind] = out.count.get((host, kind), 0) + 1
                    out.span_bytes[host, kind] = out.span_bytes.get((host, kind), 0) + span.ByteSize()
                    if kind == "collective":
                        scope.spans.add().CopyFrom(span)
                        has = any(a.key == "gputrace.arrival.cause" for a in span.attributes)
                        out.arrival.setdefault(has, []).append(span.ByteSize())
    for host, req in only.items():
        data = req.SerializeToString()
        out.collective_only[host] = (len(data), len(gzip.compress(data)))
    return out


def check_traces(spans: Spans, job: dict[str, Any], checks: Checks) -> int:
    """One trace per collective instance holding its 8 ranks' spans from the 4 hosts; returns the instances."""
    from gputrace.exporters.otlp import collective_trace_id

    seqs = range(1, job["steps"] + 2)
    good = 0
    for seq in seqs:
        got = [(h, s) for h, s in spans.by_trace.get(collective_trace_id(job["comm"], seq).to_bytes(16, "big"), [])]
        ranks = sorted((h, next(a.value.int_value for a in s.attributes if a.key == "gputrace.collective.rank"))
                       for h, s in got)
        good += ranks == sorted((HOSTS[host_of(r)], r) for r in range(WORLD)) and all(
            s.name == f"collective all_reduce #{seq}" for _, s in got)
    collective_traces = {t for t, v in spans.by_trace.items() if any(kind_of(s.name) == "collective" for _, s in v)}
    others = len(spans.by_trace) - len(collective_traces)
    checks.check(good == len(seqs) and len(collective_traces) == len(seqs),
                 f"{good} of {len(seqs)} collective instances are one trace each with the 8 ranks' spans from the 4 "
                 f"hosts ({len(collective_traces)} collective traces, {others} others: one per capture's stalls)")
    marked = {seq: sorted(_attr(s, "gputrace.collective.rank") for _, s in spans.by_trace.get(
        collective_trace_id(job["comm"], seq).to_bytes(16, "big"), []) if _attr(s, "gputrace.collective.late"))
        for seq in seqs}
    right = sum(marked[k + 2] == [late] for k, (late, _) in job["plan"].items())
    checks.check(right == len(job["plan"]),
                 f"{right} of {len(job['plan'])} late steps' traces mark one span late, the late rank's (each host "
                 "exported alone); on-time instances with 2 or more marked (arrivals a gap apart on 2 hosts): "
                 f"{sum(len(v) > 1 for k, v in marked.items() if k - 2 not in job['plan'])}")
    return len(seqs)


def _attr(span: Any, key: str) -> Any:
    """A span attribute's value (int, bool or string), or None."""
    for a in span.attributes:
        if a.key == key:
            return getattr(a.value, a.value.WhichOneof("value"))
    return None


def check_hosts_alone(reports: list[dict[str, Any]], job: dict[str, Any], checks: Checks) -> None:
    """Each host's capture alone (what its own OTLP export is made of: 2 of the 8 ranks): on a late step, its
    ranks wait for the late rank, named where it is one of them, else a rank not captured; none is marked late
    unless it is the late rank."""
    right = total = 0
    wrong: list[str] = []
    for h, rep in enumerate(reports):
        for k, (late, cause) in sorted(job["plan"].items()):
            seq = k + 2
            for r in (r for r in rep["collectives"] if r["seq"] == seq):
                total += 1
                waits = [s for s in rep["stalls"] if s["cause"] == "collective" and s.get("device_pid") == r["pid"]
                         and s["culprit"].get("object") == f"all_reduce #{seq}"]
                if r["rank"] == late:
                    ok = r.get("late") is True and not waits
                elif host_of(late) == h:
                    ok = len(waits) == 1 and _names_late(waits[0], HOSTS[h], job["pids"][late], late, cause,
                                                         job["files"].get(str(k), [])) and not r.get("late")
                else:
                    ok = len(waits) == 1 and waits[0]["culprit"]["pid"] == 0 and not r.get("late")
                right += ok
                if not ok:
                    wrong.append(f"{HOSTS[h]} step {k} rank {r['rank']}: {[_brief(s) for s in waits]}")
    checks.check(right == total, f"{right} of {total} ranks' late steps, each host's capture alone: a wait for the "
                 "late rank (named when on that host, else not captured), and only the late rank marked late"
                 + (f"; first wrong: {wrong[:3]}" if wrong else ""))


def export_cpu_main(path: str, endpoint: str, repeat: int) -> None:
    """In a fresh process: the capture's analysis, then its OTLP export ``repeat`` times, each timed in CPU s
    (process time: the exporter's gRPC threads included). Prints one JSON line."""
    from gputrace import pipeline
    from gputrace.capture import open_capture
    from gputrace.exporters.otlp import OtlpExporter

    out: dict[str, Any] = {"export_cpu_s": []}
    with open_capture(path) as reader:
        t0 = time.process_time()
        report = pipeline.analyse(reader)
        out["analyse_cpu_s"] = time.process_time() - t0
        for _ in range(repeat):
            t0 = time.process_time()
            res = OtlpExporter(endpoint, report=report).write(reader)
            out["export_cpu_s"].append(time.process_time() - t0)
            out["spans"], out["dropped"] = res.items, res.dropped
    print(json.dumps(out))


def export_cpu(caps: list[Path], repeat: int) -> tuple[float, float, float, int]:
    """(median warm export CPU s per span, first export's, analysis CPU s per span, spans), over the captures."""
    from otlp_receiver import grpc_receiver

    warm: list[float] = []
    cold: list[float] = []
    analyse: list[float] = []
    spans = 0
    with grpc_receiver() as (_, port):
        for cap in caps:
            r = subprocess.run([sys.executable, __file__, "--export-cpu", str(cap), f"127.0.0.1:{port}",
                                str(repeat)], capture_output=True, text=True, timeout=600, check=True)
            d = json.loads(r.stdout.strip().splitlines()[-1])
            if d["dropped"]:
                raise SystemExit(f"{cap}: {d['dropped']} spans dropped")
            cold.append(d["export_cpu_s"][0] / d["spans"])
            warm += [t / d["spans"] for t in d["export_cpu_s"][1:]]
            analyse.append(d["analyse_cpu_s"] / d["spans"])
            spans += d["spans"]
    return statistics.median(warm or cold), statistics.median(cold), statistics.median(analyse), spans


# ------------------------------------------------------------------------------------------ printing ---
def si(x: float, unit: str) -> str:
    for scale, prefix in ((1e15, "P"), (1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:,.3g} {prefix}{unit}"
    return f"{x:,.3g} {unit}"


def table(rows: list[tuple[str, ...]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  " + "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in
                                      enumerate(zip(r, widths, strict=True))) for r in rows)


def measure(spans: Spans, instances: int, rate: float, cpu: tuple[float, float, float, int]) -> str:
    """The measured table, and its extrapolation to TARGET_HOSTS x TARGET_RANKS_PER_HOST."""
    def n(kinds: tuple[str, ...], host: str | None = None) -> int:
        return sum(v for (h, k), v in spans.count.items() if k in kinds and (host is None or h == host))

    def b(kinds: tuple[str, ...]) -> int:
        return sum(v for (_, k), v in spans.span_bytes.items() if k in kinds)

    ranks = WORLD
    all_kinds = ("collective", "stall", "evidence", "capture")
    total_spans = n(all_kinds)
    coll_bytes = sum(v[0] for v in spans.collective_only.values())
    coll_gzip = sum(v[1] for v in spans.collective_only.values())
    req_bytes, req_gzip = sum(spans.req_bytes.values()), sum(spans.req_gzip.values())

    def per_inst(x: float) -> float:
        return x / instances

    rows: list[tuple[str, ...]] = [("measured: 4 hosts x 2 ranks", "collective spans only", "all spans")]
    rows.append(("spans per collective instance (8 ranks)", f"{per_inst(n(('collective',))):.2f}",
                 f"{per_inst(total_spans):.2f}"))
    rows.append(("  per host per instance", f"{per_inst(n(('collective',))) / len(HOSTS):.2f}",
                 f"{per_inst(total_spans) / len(HOSTS):.2f}"))
    rows.append(("bytes per span (Span message)", f"{b(('collective',)) / n(('collective',)):,.0f}",
                 f"{b(all_kinds) / total_spans:,.0f}"))
    rows.append(("bytes per span (request, protobuf)", f"{coll_bytes / n(('collective',)):,.0f}",
                 f"{req_bytes / total_spans:,.0f}"))
    rows.append(("bytes per span (request, gzip)", f"{coll_gzip / n(('collective',)):,.0f}",
                 f"{req_gzip / total_spans:,.0f}"))
    rows.append(("bytes per host per instance (protobuf)", f"{per_inst(coll_bytes) / len(HOSTS):,.0f}",
                 f"{per_inst(req_bytes) / len(HOSTS):,.0f}"))
    rows.append(("bytes per host per instance (gzip)", f"{per_inst(coll_gzip) / len(HOSTS):,.0f}",
                 f"{per_inst(req_gzip) / len(HOSTS):,.0f}"))
    warm, cold, analyse, cpu_spans = cpu
    by_kind = ", ".join(f"{k} {n((k,))} ({b((k,)) / max(1, n((k,))):,.0f} B)" for k in all_kinds)
    arrivals = "; ".join(f"{'with' if has else 'without'} an arrival {len(v)} ({min(v):,}-{max(v):,} B, median "
                         f"{statistics.median(v):,.0f})" for has, v in sorted(spans.arrival.items()))
    lines = [table(rows), f"  spans by kind: {by_kind}; {instances} instances, {len(spans.by_trace)} traces",
             f"  collective spans {arrivals}",
             f"  export CPU per span: {warm * 1e6:,.0f} us warm (median of the repeats, {cpu_spans:,} spans), "
             f"{cold * 1e6:,.0f} us in a fresh process's first export; the capture's analysis before it: "
             f"{analyse * 1e6:,.0f} us per span exported",
             f"  collective rate of this job: {rate:,.1f} instances/s per rank"]
    # extrapolation: per rank per instance, as measured, times 8 ranks a host and 8,000 at the collector
    ncoll = n(("collective",))
    per_rank = {"collective": (per_inst(ncoll) / ranks, coll_bytes / ncoll, coll_gzip / ncoll),
                "all": (per_inst(total_spans) / ranks, req_bytes / total_spans, req_gzip / total_spans)}
    host_ranks, job_ranks = TARGET_RANKS_PER_HOST, TARGET_HOSTS * TARGET_RANKS_PER_HOST
    ext: list[tuple[str, ...]] = [(f"extrapolated: {TARGET_HOSTS:,} hosts x {TARGET_RANKS_PER_HOST} ranks",
                                   f"measured rate ({rate:,.1f}/s)", "", f"{TARGET_RATE:,.0f}/s per rank", "")]
    ext.append(("", "collective only", "all spans", "collective only", "all spans"))
    figures: tuple[tuple[str, Callable[[str, float], str]], ...] = (
        ("spans per instance (whole job)", lambda k, r: si(per_rank[k][0] * job_ranks, "")),
        ("spans/s per host", lambda k, r: si(per_rank[k][0] * host_ranks * r, "")),
        ("spans/s at the collector", lambda k, r: si(per_rank[k][0] * job_ranks * r, "")),
        ("trace of one instance (protobuf)", lambda k, r: si(job_ranks * per_rank["collective"][1], "B")),
        ("bytes/s per host (protobuf)", lambda k, r: si(per_rank[k][0] * host_ranks * r * per_rank[k][1], "B")),
        ("bytes/s per host (gzip)", lambda k, r: si(per_rank[k][0] * host_ranks * r * per_rank[k][2], "B")),
        ("bytes/s at the collector (protobuf)",
         lambda k, r: si(per_rank[k][0] * job_ranks * r * per_rank[k][1], "B")),
        ("bytes/s at the collector (gzip)", lambda k, r: si(per_rank[k][0] * job_ranks * r * per_rank[k][2], "B")),
        ("backend per day (protobuf)", lambda k, r: si(per_rank[k][0] * job_ranks * r * per_rank[k][1] * 86400,
                                                          "B")),
        ("export CPU per host (cores, warm)", lambda k, r: f"{per_rank[k][0] * host_ranks * r * warm:.3f}"),
    )
    for label, fn in figures:
        ext.append((label, fn("collective", rate), fn("all", rate), fn("collective", TARGET_RATE),
                    fn("all", TARGET_RATE)))
    return "\n".join([*lines, "", table(ext)])


# ------------------------------------------------------------------------------------------------ main ---
def _interrupted(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM as Ctrl-C: the cleanup below runs either way


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=48, help="steps of the job (every other one has a late rank)")
    ap.add_argument("--exports", type=int, default=3, help="OTLP exports per capture timed for CPU (>= 2)")
    ap.add_argument("--keep", type=Path, help="keep the captures and logs in this directory")
    ap.add_argument("--rank", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--host", nargs=2, help=argparse.SUPPRESS)
    ap.add_argument("--export-cpu", nargs=3, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.rank:
        rank_main(args.rank[0], int(args.rank[1]))
        return 0
    if args.host:
        return host_main(args.host[0], int(args.host[1]))
    if args.export_cpu:
        export_cpu_main(args.export_cpu[0], args.export_cpu[1], int(args.export_cpu[2]))
        return 0
    if os.geteuid() != 0:
        raise SystemExit("needs root: network namespaces, a loop device, a blkio cgroup, eBPF captures")
    if args.steps < 8 or args.exports < 2:
        raise SystemExit("--steps 8 or more, --exports 2 or more")
    signal.signal(signal.SIGTERM, _interrupted)
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even when started with SIGINT ignored (`cmd &`)
    if args.keep:
        args.keep.mkdir(parents=True, exist_ok=True)
    with contextlib.ExitStack() as stack:
        tmp = args.keep.resolve() if args.keep else Path(stack.enter_context(tempfile.TemporaryDirectory()))
        return bench(tmp, args)


def bench(tmp: Path, args: argparse.Namespace) -> int:
    from otlp_receiver import grpc_receiver

    with contextlib.ExitStack() as hosts:  # the namespaces, the loop device and the cgroup: for the job only
        job = run_job(tmp, args.steps, hosts)
    job["steps"] = args.steps
    caps = [str(c) for c in job["caps"]]
    sizes = ", ".join(f"{HOSTS[i]} {Path(c).stat().st_size / 1e6:.1f} MB" for i, c in enumerate(caps))
    print(f"job: {WORLD} ranks on {len(HOSTS)} hosts, {args.steps} steps, {len(job['plan'])} with a late rank, "
          f"captured in {job['wall_s']:.1f} s ({sizes})")
    checks = Checks()
    r, wall, cpu = timed([*GPUTRACE, "report", *caps, "--json"])
    if r.returncode != 0:
        raise SystemExit(f"gputrace report failed: {r.stderr}")
    rep = json.loads(r.stdout)
    print(f"gputrace report A B C D --json: {wall:.1f} s, {cpu:.1f} CPU s, {len(rep['stalls'])} stalls")
    check_report(rep, job, checks)
    alone = []
    for cap in caps:
        r = subprocess.run([*GPUTRACE, "report", cap, "--json"], capture_output=True, text=True, timeout=600)
        if r.returncode != 0:
            raise SystemExit(f"gputrace report {cap} failed: {r.stderr}")
        alone.append(json.loads(r.stdout))
    check_hosts_alone(alone, job, checks)
    rows = sorted((c for c in rep["collectives"] if c["rank"] == 0 and c["seq"] > 1), key=lambda c: c["seq"])
    rate = (len(rows) - 1) / ((rows[-1]["completed_ns"] - rows[0]["completed_ns"]) / 1e9)
    with grpc_receiver() as (receiver, port):
        r, wall, cpu = timed([*GPUTRACE, "export", *caps, "--otlp", f"127.0.0.1:{port}"])
        if r.returncode != 0:
            raise SystemExit(f"gputrace export failed: {r.stderr}")
    spans = read_requests(receiver.requests)
    sent = sum(spans.count.values())
    print(f"gputrace export A B C D --otlp: {wall:.1f} s, {cpu:.1f} CPU s (4 analyses included), {sent:,} spans")
    instances = check_traces(spans, job, checks)
    print("checks:")
    print("\n".join(checks.lines))
    print()
    print(measure(spans, instances, rate, export_cpu(job["caps"], args.exports)))
    return 1 if checks.failed else 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # the namespaces, loop device, cgroup and captures are gone by now
        print("interrupted", file=sys.stderr)
        sys.exit(130)
