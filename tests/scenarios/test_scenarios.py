"""Ground truth: training loops on the simulated device whose stalls have known causes, made with real slow
storage (throttled loop device), a FUSE filesystem, a slow TCP peer, CPU work and contention, a late rank
and sleeps, captured with `run_capture` (real eBPF + the agent) and scored against what was constructed.

Targets: >= 95 % of stall time with the right cause and culprit, <= 5 % unknown, and no stall of
5 ms or more that names a wrong culprit.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from pathlib import Path
from typing import Any

import harness
import pytest

pytestmark = pytest.mark.kernel  # root and the host's kernel (see tests/conftest.py)


def _check_details(name: str, report: dict[str, Any]) -> None:
    """What each mechanism must leave in the report beyond cause and culprit."""
    stalls = report["stalls"]
    if name == "storage":
        assert all(s["culprit"]["op"] in ("read", "pread64") and s["culprit"]["bytes"] > 0 for s in stalls)
        assert all(s["via"] and s["via"][0].startswith("wait:pid ") for s in stalls)
        assert {"syscall", "wakeup", "gpu"} <= {e["kind"] for e in stalls[0]["evidence"]}
        # blk-throttle holds the reads' bios and a kworker dispatches them: the requests are still under the
        # read, on the loop device, tied as dispatched (two workers read the same device at once: some shared)
        for s in stalls:
            c = s["culprit"]
            assert c.get("block_requests", 0) > 0 and c["block_device"].startswith("loop"), c
            assert c["block_attribution"] == "dispatched" and c["dispatched_by"].startswith("kworker"), c
            assert any(e["kind"] == "block" for e in s["evidence"]), s["evidence"]
    elif name == "fuse":
        assert all(s["culprit"].get("filesystem", "").startswith("fuse") for s in stalls)
    elif name == "collective":
        waits = [s for s in stalls if s["cause"] == "collective"]
        assert waits and all(s.get("late_rank_cause", {}).get("cause") == "storage" for s in waits)
        assert all(d["collective_wait_ns"] >= 0 for d in report["devices"])
    elif name == "gloo_collective":
        # torch.distributed gloo ranks: the early rank's stalls name the late rank's call and, from its own
        # records, its read; every instance is one communicator id and sequence number on both ranks
        waits = [s for s in stalls if s["cause"] == "collective"]
        assert waits and all(s["late_rank"]["cause"] == "storage" and s["culprit"]["rank"] == 1
                             and re.fullmatch(r"all_reduce #\d+", s["culprit"]["object"]) for s in waits), waits
        rows = report["collectives"]
        assert len({r["comm"] for r in rows}) == 1 and all(r["backend"] == "gloo" for r in rows), rows
        by_seq: dict[int, list[dict[str, Any]]] = {}
        for r in rows:
            by_seq.setdefault(r["seq"], []).append(r)
        assert all(sorted(r["rank"] for r in rs) == [0, 1] and len({r["op"] for r in rs}) == 1
                   for rs in by_seq.values()), by_seq
        # why rank 1 arrived when it did, on its own records: its read since its previous all-reduce returned
        reads = [r for r in rows if r["rank"] == 1 and r["op"] == "all_reduce"]
        assert sum(1 for r in reads if r.get("arrival", {}).get("cause") == "storage") >= len(reads) - 1, reads
        for s in waits:  # the instance a stall names is one where rank 1 came last and rank 0 waited for it
            pair = {r["rank"]: r for r in by_seq[int(s["culprit"]["object"].split("#")[1])]}
            assert pair[1]["late"] and pair[0]["waited_ns"] > 0 and pair[0]["pid"] == s["device_pid"], pair
    elif name == "mapped":
        # no read() at all: the waits are page faults on the mapped shards, with the device's requests
        assert all(s["culprit"]["op"] == "page_fault" and s["culprit"]["bytes"] > 0 for s in stalls), stalls
        assert all(s["culprit"].get("block_requests", 0) > 0 for s in stalls)
        assert any(s["via"] for s in stalls) and any(not s["via"] for s in stalls)  # the worker's and the trainer's
    elif name == "mp_queue":
        # the first stall's waker is the queue's feeder thread, created inside it: the time before that is
        # the worker's main thread's, reading
        first = stalls[0]
        c = first["culprit"]
        wakers = {(e["waker_pid"], e["waker_tid"]) for e in first["evidence"] if e["kind"] == "wakeup"}
        assert c["op"] == "read" and any(p == c["pid"] and t != c["tid"] for p, t in wakers), first
        assert all(s["via"] and s["via"][0] == f"wait:pid {c['pid']}" for s in stalls)
    elif name == "contention":
        # who had the CPU the trainer waited for: the hogs (its children) are named, never the waiting thread.
        # Not only them: the capture's own threads, kernel threads and other load share that CPU too.
        hogs = set(report["capture"]["pids"]) - {s["device_pid"] for s in stalls}
        waits = [s for s in stalls if s["cause"] == "cpu.runqueue"]
        held = [h for s in waits for h in s["culprit"].get("cpu_held_by", [])]
        assert len(hogs) == 3 and {h["pid"] for h in held} & hogs, [s["culprit"].get("cpu_held_by") for s in waits]
        assert all(h["tid"] != s["culprit"]["tid"] for s in waits for h in s["culprit"].get("cpu_held_by", []))
    elif name == "network":
        assert all(s["culprit"]["object"].startswith("127.0.0.1:") for s in stalls)
    elif name.startswith("torch_loader"):
        # PyTorch's DataLoader: the trainer waits on the loader's queue (pinned: on the pin-memory thread's
        # queue first, a hop inside its own process); the worker's feeder thread, woken by the worker's main
        # thread, hands the batch over, and its resource-sharer thread the tensors' fds (those hops stay
        # inside the worker: they name threads, the last one the culprit)
        reads = [s for s in stalls if s["cause"] == "storage"]
        assert len(reads) >= 3 and all(s["culprit"]["op"] == "read" and s["culprit"].get("block_requests", 0) > 0
                                       for s in reads), [s["culprit"] for s in reads]
        # not the trainer's own time, nor the tool's (its session holding a CPU the job waited for)
        for s in (s for s in stalls if s["culprit"]["pid"] != s["device_pid"] and s["cause"] != "tracing"):
            c, via = s["culprit"], s["via"]
            if name == "torch_loader_pinned":
                assert via[0] == f"wait:pid {s['device_pid']}", via
                via = via[1:]
            assert via[0] == f"wait:pid {c['pid']}", s["via"]
            assert all(h.startswith(("wait:tid ", "gil:tid ")) for h in via[1:]), s["via"]
            assert len(via) == 1 or via[-1] in (f"wait:tid {c['tid']}", f"gil:tid {c['tid']}"), s["via"]
    elif name.startswith("torch_straggler"):
        # the fast workers' batches that arrived out of order while the trainer waited for the slow worker's
        # (their tensors' fds fetched from them, then set aside) decided nothing: the slow worker's stalls
        # are its read, with next to nothing left on the fast workers. Pinned: the pin-memory thread fetched
        # them and passed each on through the trainer's queue.Queue (a futex), the slow worker's batch last
        reads = [s for s in stalls if s["cause"] == "storage"]
        assert len(reads) >= 3, [s["culprit"] for s in stalls]
        fast = {p["pid"] for s in stalls for p in s["breakdown"]} - {s["device_pid"] for s in stalls} \
            - {s["culprit"]["pid"] for s in reads}
        held = sum(p["ns"] for s in reads for p in s["breakdown"] if p["pid"] in fast)
        assert held < 0.02 * sum(s["duration_ns"] for s in reads), [s["breakdown"] for s in reads]
        slow = reads[0]["culprit"]["pid"]  # whose stall time it is, by process: the slow worker's
        assert report["top_processes"][0]["pid"] == slow and report["top_processes"][0]["share_pct"] >= 95, \
            report["top_processes"]
        pinned = name == "torch_straggler_pinned"
        assert all(s["via"][:pinned + 1] == [f"wait:pid {s['device_pid']}"] * pinned
                   + [f"wait:pid {s['culprit']['pid']}"] for s in reads), [s["via"] for s in reads]
    elif name == "uring":
        # the trainer's own waits in io_uring_enter, named by the ring's read requests that completed in them
        # (read inline on even steps, by io-wq worker threads on odd ones), with the requests the throttle's
        # kworker dispatched for them
        for s in stalls:
            c = s["culprit"]
            assert c["op"] == "io_uring read" and c["bytes"] > 0 and c["pid"] == s["device_pid"] and not s["via"], c
            assert c.get("block_requests", 0) > 0 and c["block_attribution"] == "dispatched", c
            whats = [e["what"].split("(")[0] for e in s["evidence"][:2]]
            assert whats == ["io_uring_enter", "io_uring read"], s["evidence"]
    elif name == "checkpoint":
        # the trainer's own fsync of each checkpoint: its data sat in blk-throttle until a kworker dispatched
        # it (the fsync itself may read some metadata first); the journal's commit is jbd2's
        for s in stalls:
            c = s["culprit"]
            assert c["op"] == "fsync" and c["pid"] == s["device_pid"] and not s["via"], c
            assert c["block_attribution"] == "dispatched" and "kworker" in c["dispatched_by"], c
            assert c["block_bytes"] >= 256 * 1024, c
            assert any(e["kind"] == "block" and e["what"].startswith("W") for e in s["evidence"]), s["evidence"]
    elif name == "dirty_writes":
        # the trainer's own write()s of a save, paused by the kernel for dirty pages on the loop device: the
        # pauses are the stall (the first save is always paused; later ones as the kernel's estimates go). A
        # save the kernel did not pause is a few ms of creating the file and copying into the page cache,
        # which the report may name by the file's calls when they hold most of the stall: then it claims no
        # pause
        saves = [s for s in stalls if s["cause"] == "storage"]
        paused = [s for s in saves if "dirty_pauses" in s["culprit"]]
        assert paused, [s["culprit"] for s in stalls]
        for s in saves:
            c = s["culprit"]
            assert c["pid"] == s["device_pid"] and not s["via"] and "/state-" in c["object"], c
            if s not in paused:
                assert c["op"] in ("openat", "write", "close"), c
                assert s["duration_ns"] < 20_000_000 and "dirty_device" not in c, (c, s["duration_ns"])
                assert not any(e["kind"] == "dirty" for e in s["evidence"]), s["evidence"]
                continue
            assert c["op"] == "write" and c["dirty_pauses"] >= 1 and c["dirty_device"].startswith("loop"), c
            assert c["dirty_paused_ns"] >= 0.8 * s["duration_ns"], (c, s["duration_ns"])
            assert any(e["kind"] == "dirty" for e in s["evidence"]), s["evidence"]
    elif name == "cpu_throttled":
        # the worker's cgroup (v1, 20 ms per 100 ms) named with its quota and what its counters measured
        for s in (s for s in stalls if s["cause"] == "cpu.throttled"):
            c = s["culprit"]
            assert c["object"].startswith("/gputrace-test-") and c["cgroup_version"] == 1, c
            assert (c["quota_us"], c["period_us"]) == (20_000, 100_000), c
            assert 0 < c["throttled_ns"] <= s["duration_ns"] and c["cgroup_throttled_periods"] >= 1, c
    elif name.startswith("train_torch_slow"):
        # examples/train_torch.py: the slow worker's batches reach the trainer through PyTorch's fd sharing
        # (resource_sharer round trips with a worker thread that waits for the worker's GIL): its stalls end
        # on the worker's main thread, the process that holds the most stall time, reached by a wait on it:
        # at once, or through the other worker (its feeder waiting for the shared queue's lock, which the slow
        # worker's feeder held: a chain seen beside a CPU hog). A stall that names no one (`unknown`: beside a CPU
        # hog, once a chain of those round trips longer than the 8 hops followed) is the scoring's to count
        slow = [s for s in stalls if s["culprit"]["pid"] not in (s["device_pid"], 0) and s["cause"] != "tracing"]
        assert slow and report["top_processes"][0]["pid"] == slow[0]["culprit"]["pid"], report["top_processes"]
        hop = 1 if name.endswith("pinned") else 0  # pinned: the pin-memory thread's queue first
        off_path = [s for s in slow if not s["via"][hop:hop + 1]
                    or f"wait:pid {s['culprit']['pid']}" not in s["via"][hop:]]
        assert not off_path, [(s["start_ns"], s["duration_ns"], s["cause"], s["via"], s["culprit"]) for s in off_path]
    elif name == "train_torch_cold":
        reads = [s for s in stalls if s["cause"] == "storage"]
        assert reads and all(s["culprit"]["op"] == "pread64" and s["culprit"].get("block_requests", 0) > 0
                             for s in reads), [s["culprit"] for s in reads]
    elif name == "asyncio_fetch":  # the event loop's epoll_wait names the peer's socket it found ready
        assert all(s["culprit"]["op"].startswith("epoll") for s in stalls), [s["culprit"] for s in stalls]


@pytest.mark.parametrize("name", list(harness.SCENARIOS))
def test_scenario_meets_the_accuracy_targets(name: str, tmp_path: Path) -> None:
    score, report = harness.run(name, tmp_path)
    try:
        _check_targets(name, score, report)
    except AssertionError:
        _keep(name, tmp_path, report)
        raise


def _keep(name: str, workdir: Path, report: dict[str, Any]) -> None:
    """With GPUTRACE_KEEP_FAILED=DIR, a failing scenario's capture, truth, configuration and report are copied to
    DIR/NAME-PID-TIME (``gputrace report --json`` and the explain code read the capture again there): a flake
    seen once in a long run is kept to be read, not only its summary line."""
    keep = os.environ.get("GPUTRACE_KEEP_FAILED")
    if not keep:
        return
    dest = Path(keep) / f"{name}-{os.getpid()}-{time.strftime('%Y%m%d-%H%M%S')}"
    dest.mkdir(parents=True, exist_ok=True)
    for f in workdir.iterdir():
        if f.is_file():
            shutil.copy2(f, dest / f.name)
    (dest / "report.json").write_text(json.dumps(report))


def _check_targets(name: str, score: harness.Score, report: dict[str, Any]) -> None:
    cap = report["capture"]
    detail = f"{name}: {score.stalls} stalls, {score.correct_pct:.1f}% right, {score.unknown_pct:.1f}% unknown, " \
             f"{score.load_pct:.1f}% the machine's load; misses: {score.misses[:5]}; skipped probe runs: " \
             f"{cap.get('skipped_probes')}; pids: {cap.get('pids')}"
    assert score.stalls >= 3, detail
    assert cap["complete"], (cap.get("problem"), {k: v for k, v in cap["drops"].items() if v})
    assert score.load_pct <= harness.MAX_LOAD_PCT, detail  # else the run says little of the tool
    assert score.correct_pct >= harness.TARGET_CORRECT_PCT.get(name, harness.TARGET_CORRECT_PCT["*"]), detail
    assert score.unknown_pct <= harness.UNKNOWN_ALLOWED_PCT.get(name, harness.TARGET_UNKNOWN_PCT), detail
    assert not score.wrong_culprits, detail
    _check_details(name, report)


def test_scoring_counts_a_wrong_culprit_and_unknown() -> None:
    truth = {7: [{"pid": 7, "launch_ns": 100, "cause": "storage", "object": "/a", "culprit_pid": 8}]}
    culprit = {"pid": 8, "tid": 8, "comm": "w", "op": "read", "object": "/b", "bytes": 0, "duration_ns": 0}
    empty = {**culprit, "pid": 0, "object": ""}
    report = {"stalls": [
        {"device_pid": 7, "start_ns": 0, "end_ns": 6_000_000, "duration_ns": 6_000_000, "cause": "storage",
         "culprit": culprit},
        {"device_pid": 7, "start_ns": 0, "end_ns": 1_000, "duration_ns": 2_000_000, "cause": "unknown",
         "culprit": empty},
        {"device_pid": 7, "start_ns": 0, "end_ns": 1_000, "duration_ns": 2_000_000, "cause": "storage",
         "culprit": {**culprit, "object": "/a"}},
    ]}
    sc = harness.score("t", report, truth)
    assert (sc.stalls, sc.correct_ns, sc.unknown_ns) == (3, 2_000_000, 2_000_000)
    assert len(sc.wrong_culprits) == 1 and not sc.passed()
    # the trainer waiting 6 ms for a CPU: a miss, not a wrong culprit; another process named: wrong
    runq = {"device_pid": 7, "start_ns": 0, "end_ns": 1_000, "duration_ns": 6_000_000, "cause": "cpu.runqueue",
            "culprit": {**culprit, "pid": 7, "tid": 7, "object": ""}}
    sc = harness.score("t", {"stalls": [runq, {**runq, "culprit": {**runq["culprit"], "pid": 9}}]}, truth)
    assert (sc.correct_ns, len(sc.misses), [w["culprit"]["pid"] for w in sc.wrong_culprits]) == (0, 2, [9])
    # the tool naming its own cost (its session held the CPU the worker waited for): a miss, not wrong
    ours = {**runq, "cause": "tracing", "culprit": {**runq["culprit"], "pid": 4242, "comm": "gputrace"}}
    sc = harness.score("t", {"stalls": [ours]}, truth)
    assert (sc.correct_ns, len(sc.misses), sc.wrong_culprits) == (0, 1, [])


def test_scoring_takes_a_wait_for_a_cpu_as_the_launching_process_own_cpu_time() -> None:
    # gil beside a CPU hog (stalls as in a run kept): steps labelled the trainer's own CPU time, named its wait
    # for a CPU or the tool's session holding that CPU: its own time all along, right
    own = {7: [{"pid": 7, "launch_ns": 0, "cause": "cpu", "object": "", "culprit_pid": 7}]}
    trainer = {"pid": 7, "tid": 7, "comm": "python", "op": "cpu", "object": "", "bytes": 0, "duration_ns": 0}
    session = {**trainer, "pid": 4242, "tid": 0, "comm": "gputrace"}
    for cause, culprit in (("cpu", trainer), ("cpu.runqueue", trainer), ("tracing", session)):
        stall = {"device_pid": 7, "start_ns": 0, "end_ns": 10, "duration_ns": 3_500_000, "cause": cause,
                 "culprit": culprit}
        sc = harness.score("t", {"stalls": [stall]}, own)
        assert (sc.correct_ns, sc.wrong_culprits) == (3_500_000, []), cause
        # a worker's CPU time labelled: the trainer's wait for a CPU is a miss, another process's CPU wrong
        worker = {7: [{**own[7][0], "culprit_pid": 8}]}
        sc = harness.score("t", {"stalls": [stall]}, worker)
        assert sc.correct_ns == 0 and len(sc.misses) == 1, cause
    other = {**stall, "cause": "cpu", "culprit": {**trainer, "pid": 9}, "duration_ns": harness.WRONG_CULPRIT_MIN_NS}
    sc = harness.score("t", {"stalls": [other]}, own)
    assert sc.correct_ns == 0 and len(sc.wrong_culprits) == 1


def test_scoring_takes_a_wait_for_a_cpu_the_labelled_thread_held() -> None:
    # gil on a loaded machine (a kept run: an 8.3 ms stall): the trainer (pid 7) waited for a CPU that the
    # interpreter's holder (tid 21, the labelled thread) held 4.3 ms of: that thread named, right
    label = {7: [{"pid": 7, "launch_ns": 0, "cause": "cpu", "object": "", "culprit_pid": 7, "culprit_tid": 21}]}
    held = [{"pid": 7, "tid": 21, "comm": "python", "ns": 4_345_038}, {"pid": 7, "tid": 20, "comm": "python",
                                                                        "ns": 25_358}]
    culprit = {"pid": 7, "tid": 7, "comm": "python", "op": "preempted", "object": "", "bytes": 0, "duration_ns": 0,
               "cpu_held_by": held}
    stall = {"device_pid": 7, "start_ns": 0, "end_ns": 10, "duration_ns": 8_311_610, "cause": "cpu.runqueue",
             "culprit": culprit}
    assert harness.score("t", {"stalls": [stall]}, label).correct_ns == 8_311_610
    # another thread held most of it, or none is known: a miss
    for other in ([{**held[0], "tid": 20}, {**held[1], "tid": 21}], []):
        sc = harness.score("t", {"stalls": [{**stall, "culprit": {**culprit, "cpu_held_by": other}}]}, label)
        assert sc.correct_ns == 0 and len(sc.misses) == 1 and not sc.wrong_culprits, other


def test_scoring_leaves_out_a_wait_for_a_cpu_another_program_held() -> None:
    # gil beside two CPU hogs (a 17.0 ms stall of a kept run): the simulated device's completion thread (tid 22)
    # of the trainer (pid 7) woken but waiting for a CPU a spinning `sh` (pid 900) held: the machine's load, not
    # scored; the same wait named as held by a thread of the job is scored as before (a miss here), and so is
    # one held by a process the capture traced
    label = {7: [{"pid": 7, "launch_ns": 0, "cause": "cpu", "object": "", "culprit_pid": 7, "culprit_tid": 21}]}
    held = [{"pid": 900, "tid": 900, "comm": "sh", "ns": 4_786_052}, {"pid": 901, "tid": 901, "comm": "sh",
                                                                      "ns": 10_280}]
    culprit = {"pid": 7, "tid": 22, "comm": "python", "op": "woken, waiting for a CPU", "object": "", "bytes": 0,
               "duration_ns": 0, "cpu_held_by": held}
    stall = {"device_pid": 7, "start_ns": 0, "end_ns": 10, "duration_ns": 17_000_000, "cause": "cpu.runqueue",
             "culprit": culprit, "breakdown": [{"cause": "cpu.runqueue", "pid": 7, "object": "", "ns": 8_946_000},
                                               {"cause": "cpu", "pid": 7, "object": "", "ns": 8_054_000}]}
    right = {**stall, "duration_ns": 83_000_000, "cause": "cpu", "culprit": {**culprit, "tid": 21, "op": "cpu"}}
    report = {"capture": {"pids": [7]}, "stalls": [stall, right]}
    sc = harness.score("t", report, label)
    assert (sc.load_ns, sc.correct_ns, sc.misses, sc.wrong_culprits) == (17_000_000, 83_000_000, [], [])
    assert sc.correct_pct == 100.0 and sc.load_pct == 17.0 and sc.passed()
    for other in ([{**held[0], "pid": 7, "tid": 23}], []):  # a thread of the job, or no holder known: a miss
        sc = harness.score("t", {**report, "stalls": [{**stall, "culprit": {**culprit, "cpu_held_by": other}}]}, label)
        assert (sc.load_ns, sc.correct_ns, len(sc.misses)) == (0, 0, 1), other
    # gil beside two CPU hogs (a 34.8 ms stall of a kept run): the sleeping thread's 31.9 ms past its deadline,
    # most of it with no switch recorded, so no holder known; `sh` seen holding the CPU for 12.6 us of it: a miss
    seen = [{**held[1], "ns": 12_551}]
    glimpse = {**stall, "duration_ns": 34_800_000, "culprit": {**culprit, "cpu_held_by": seen},
               "breakdown": [{"cause": "cpu.runqueue", "pid": 7, "object": "", "ns": 31_942_476}]}
    sc = harness.score("t", {**report, "stalls": [glimpse]}, label)
    assert (sc.load_ns, sc.correct_ns, len(sc.misses), sc.wrong_culprits) == (0, 0, 1, [])
    traced = {"capture": {"pids": [7, 900]}, "stalls": [stall]}  # a process the capture traced
    assert harness.score("t", traced, label).load_ns == 0
    # more than MAX_LOAD_PCT of the stall time the machine's load: the run proves too little to pass
    assert not harness.score("t", {**report, "stalls": [stall, {**stall, "duration_ns": 1_000}]}, label).passed()


def test_scoring_takes_a_chain_through_the_labelled_process_and_beyond_it() -> None:
    # train_torch_slow under load (a 22.4 ms stall kept from a run): the fast worker's (pid 8) batch, its
    # feeder thread waiting for the shared result queue's lock, which the slow worker's (pid 9) feeder held while
    # waiting for its own GIL. The chain passes through the labelled worker and names the slow one: right.
    label = {"pid": 7, "launch_ns": 0, "cause": "cpu", "causes": ["cpu", "cpu.runqueue"], "object": "",
             "culprit_pid": 7, "culprit_pids": [7, 8]}
    slow = {"pid": 9, "tid": 9, "comm": "pt_data_worker", "op": "cpu", "object": "", "bytes": 0, "duration_ns": 0}
    stall = {"device_pid": 7, "start_ns": -22_400_000, "end_ns": 10, "duration_ns": 22_400_000, "cause": "cpu",
             "culprit": slow, "via": ["wait:pid 8", "wait:pid 9", "gil:tid 9"]}
    sc = harness.score("t", {"stalls": [stall]}, {7: [label]})
    assert (sc.correct_ns, sc.wrong_culprits) == (22_400_000, [])
    # the same culprit reached without the labelled worker, or only through the GPU process itself: wrong
    for via in (["wait:pid 9", "gil:tid 9"], ["wait:pid 7", "wait:pid 9"]):
        sc = harness.score("t", {"stalls": [{**stall, "via": via}]}, {7: [label]})
        assert sc.correct_ns == 0 and len(sc.wrong_culprits) == 1, via
    # the GPU process's own CPU where the label says it waited for its worker: a miss; a wrong culprit unless its
    # CPU samples show it running then
    own, worker = {**slow, "pid": 7, "tid": 7}, {7: [{**label, "culprit_pid": 8, "culprit_pids": [8]}]}
    sampled = harness.score("t", {"stalls": [{**stall, "culprit": {**own, "samples": 7}, "via": []}]}, worker)
    unsampled = harness.score("t", {"stalls": [{**stall, "culprit": own, "via": []}]}, worker)
    assert (sampled.correct_ns, sampled.wrong_culprits, len(sampled.misses)) == (0, [], 1)
    assert unsampled.correct_ns == 0 and len(unsampled.wrong_culprits) == 1


def test_scoring_gives_the_time_after_what_the_step_waited_for_to_the_launching_process() -> None:
    # train_torch_slow_pinned (an 8.9 ms stall as in a CI failure): a step whose batch came from the slow worker
    # (pid 9), in the trainer's hands at 100 (own_from_ns); the GPU then idled 8.9 ms between the step's own
    # launches, the trainer on its CPU. That time is the trainer's own: right, not a wrong culprit (scored wrong
    # before: the label named the slow worker for all of the step's idle time)
    label = {"pid": 7, "launch_ns": 0, "cause": "cpu", "causes": ["cpu", "cpu.runqueue"], "object": "",
             "culprit_pid": 9, "own_from_ns": 100}
    truth = {7: [label]}
    trainer = {"pid": 7, "tid": 7, "comm": "python", "op": "cpu", "object": "", "bytes": 0, "duration_ns": 0}
    worker = {**trainer, "pid": 9, "tid": 9}

    def stall(start: int, end: int, cause: str, culprit: dict[str, Any]) -> dict[str, Any]:
        return {"device_pid": 7, "start_ns": start, "end_ns": end, "duration_ns": end - start, "cause": cause,
                "culprit": culprit}

    inside = stall(200, 200 + 8_900_000, "cpu", trainer)
    sc = harness.score("t", {"stalls": [inside]}, truth)
    assert (sc.correct_ns, sc.wrong_culprits) == (8_900_000, [])
    # waited for the batch all along: only the slow worker is right, the trainer named is a wrong culprit
    waited = stall(-8_900_000, 100, "cpu", trainer)
    sc = harness.score("t", {"stalls": [waited, {**waited, "culprit": worker}]}, truth)
    assert sc.correct_ns == 8_900_100 and [w["culprit"]["pid"] for w in sc.wrong_culprits] == [7]
    # after the batch came, the worker named is wrong
    sc = harness.score("t", {"stalls": [{**inside, "culprit": worker}]}, truth)
    assert sc.correct_ns == 0 and len(sc.wrong_culprits) == 1
    # half and half: either side may hold the dominant part (the worker's time, or the trainer's CPU time
    # and its wait for a CPU, told apart), so either is right; the run queue's or the session's holding the CPU
    half = stall(100 - 6_000_000, 100 + 6_000_000, "cpu.runqueue", trainer)
    tracing = {**half, "cause": "tracing", "culprit": {**trainer, "pid": 4242, "tid": 0, "comm": "gputrace"}}
    sc = harness.score("t", {"stalls": [half, {**half, "cause": "cpu", "culprit": worker}, tracing]}, truth)
    assert (sc.correct_ns, sc.wrong_culprits) == (36_000_000, [])
    # the sleep scenario: woken at the deadline, then 12 ms without a CPU, of a 23 ms stall: the run queue
    sleep = {"pid": 7, "launch_ns": 0, "cause": "sleep", "object": "", "culprit_pid": 7, "own_from_ns": 11_000_000}
    late = stall(0, 23_000_000, "cpu.runqueue", trainer)
    sc = harness.score("t", {"stalls": [late, {**late, "cause": "sleep"}]}, {7: [sleep]})
    assert sc.correct_ns == 46_000_000
    # woken on time: the sleep only
    sc = harness.score("t", {"stalls": [{**late, "end_ns": 11_100_000, "duration_ns": 11_100_000}]}, {7: [sleep]})
    assert sc.correct_ns == 0 and sc.misses


def test_scoring_takes_a_save_on_its_cpu_as_its_file_or_its_own_time() -> None:
    # dirty_writes (a CI failure: 16.2 and 8.9 ms stalls named the save's file where the label said the trainer's
    # own cpu): a save is the trainer's calls on its file, right as `storage` of that file; while it was on its CPU
    # for a third of the save or more (own_ok) its own time is right too, never another file
    path = "/mnt/state-001.bin"
    trainer = {"pid": 7, "tid": 7, "comm": "python", "op": "write", "object": path, "bytes": 0, "duration_ns": 0}
    stall = {"device_pid": 7, "start_ns": 0, "end_ns": 16_200_000, "duration_ns": 16_200_000, "cause": "storage",
             "culprit": trainer}
    own = {**stall, "cause": "cpu", "culprit": {**trainer, "op": "cpu", "object": ""}}
    other = {**stall, "culprit": {**trainer, "object": "/mnt/state-003.bin"}}
    for own_ok, right in ((True, 2), (False, 1)):
        label = {"pid": 7, "launch_ns": 0, "cause": "storage", "object": path, "culprit_pid": 7}
        truth = {7: [{**label, "own_ok": True} if own_ok else label]}
        sc = harness.score("t", {"stalls": [stall, own, other]}, truth)
        assert sc.correct_ns == right * 16_200_000 and len(sc.misses) == 3 - right, (own_ok, sc.misses)
        # another file: a miss where the process's own time is right too; else a wrong culprit, as is its own time
        wrong = [w["culprit"]["object"] for w in sc.wrong_culprits]
        assert wrong == ([] if own_ok else ["", "/mnt/state-003.bin"]), wrong
