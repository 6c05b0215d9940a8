"""Run a ground-truth scenario under the real capture pipeline and score the report against the truth.

Score of a scenario: the share of stall time whose cause AND culprit (path / peer / pid) match the
ground truth, the share explained as `unknown`, and the stalls of >= 5 ms that name a wrong culprit.
"""

from __future__ import annotations

import contextlib
import json
import sys
from bisect import bisect_right
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import fixtures

HERE = Path(__file__).resolve().parent
WORKLOAD = HERE / "workload.py"
WRONG_CULPRIT_MIN_NS = 5_000_000
OBJECT_CAUSES = ("storage", "network")  # their culprit is an object (path, peer); the others' a process

# Targets the CI asserts. One exception: in `contention` a stall is sometimes scored short when
# the trainer's wait for a CPU is explained as `sync` or `sleep` (where the truth says `cpu.runqueue`).
# With raw scheduler hooks and wakeups that race the switch kept (docs/probes.md), 36 repeated runs on the
# 2-core VM: 33 at 100 %, misses at 97.0 and 92.0 % (the third's score was not kept). CI asserts 80 % for
# it; bench/accuracy.py reports it against the 95 % target.
# A second: in `timed_waits` the batch sometimes lands between two of the trainer's timed waits, so its put()
# wakes nobody and that storage stall has no wakeup edge to follow: `unknown`, honestly, never a guess. Each
# such stall is about 22 % of the scenario's stall time. On the 2-core VM: 1 run in 13 with one; later, 3 runs
# in 14 (one with two of its four storage stalls), and 22 runs in a row with none. CI allows two.
TARGET_CORRECT_PCT, TARGET_UNKNOWN_PCT = {"*": 95.0, "contention": 80.0, "timed_waits": 50.0}, 5.0
UNKNOWN_ALLOWED_PCT = {"timed_waits": 50.0}
# A third: on the 2-core VM the trainer, its batch ready, sometimes waits for a CPU the workers and the capture
# hold, and the report says so (`cpu.runqueue` of the trainer, up to 7 ms; 22 ms once with a CPU hog beside the
# suite) where the truth names the batch's worker: scored a miss, never a wrong culprit (``score``). Seen in
# cpu_worker and both torch_straggler ones. cpu_worker runs 40 steps of 20 ms, so that one such wait is under
# 3 % of its stall time, not 11 % of 10 steps'. Seen in gil too (7.1 ms of its 10 steps' 113 ms, with other
# tests running beside the suite): it runs 30 steps, so one such wait is about 2 %.


# A fourth: beside a CPU hog (the suite is run so), the trainer's interpreter or the simulated device's completion
# thread sometimes waits 6-27 ms for a CPU that the hog holds, and the report says so: `cpu.runqueue` of the
# trainer's process, the hog named in `cpu_held_by`. No workload can label another program's load. Such a stall,
# its CPU held mostly by a task outside the captured processes (seen holding it for at least a quarter of the
# wait: not a glimpse of it in a wait mostly unseen), is the machine's load: not scored (``load_ns``),
# neither right nor wrong, as long as it is under MAX_LOAD_PCT of the stall time. gil before this: 4 runs in 100
# under its 95 % beside one CPU hog, 2 of 45 beside two (88.8-94.5 %), each by such waits (a `sh` spinning named
# as the holder). Since, beside two hogs: 2 runs of 155, both the simulated device's thread starved of a CPU as
# it delivered a sync's completion (docs/report.md, "Accuracy on ground truth").
MAX_LOAD_PCT = 50.0


@dataclass
class Score:
    scenario: str
    stalls: int = 0
    stall_ns: int = 0
    correct_ns: int = 0
    unknown_ns: int = 0
    load_ns: int = 0  # stalls that were the machine's load (above): not scored
    wrong_culprits: list[dict[str, Any]] = field(default_factory=list)
    misses: list[str] = field(default_factory=list)
    labels: int = 0
    wall_s: float = 0.0

    @property
    def scored_ns(self) -> int:
        return self.stall_ns - self.load_ns

    @property
    def correct_pct(self) -> float:
        return 100.0 * self.correct_ns / self.scored_ns if self.scored_ns else 0.0

    @property
    def unknown_pct(self) -> float:
        return 100.0 * self.unknown_ns / self.scored_ns if self.scored_ns else 0.0

    @property
    def load_pct(self) -> float:
        return 100.0 * self.load_ns / self.stall_ns if self.stall_ns else 0.0

    def passed(self) -> bool:
        target = TARGET_CORRECT_PCT["*"]
        return (self.stalls > 0 and self.correct_pct >= target and self.unknown_pct <= TARGET_UNKNOWN_PCT
                and self.load_pct <= MAX_LOAD_PCT and not self.wrong_culprits)


def machine_load(stall: dict[str, Any], pids: set[int]) -> bool:
    """Whether ``stall`` is the launching process waiting for a CPU that a task outside the captured processes
    ``pids`` held most of (by ``cpu_held_by``), seen holding it for at least a quarter of the process's wait for
    a CPU in the stall (where it was seen at all, over half): another program's load on the machine. Not where
    the captured processes are not known."""
    c = stall["culprit"]
    held = c.get("cpu_held_by") or []
    if stall["cause"] != "cpu.runqueue" or c["pid"] != stall.get("device_pid") or not held or not pids:
        return False
    top = max(held, key=lambda h: h.get("ns", 0))
    waited = sum(b["ns"] for b in stall.get("breakdown", []) if b["cause"] == "cpu.runqueue" and b["pid"] == c["pid"])
    outside = sum(h.get("ns", 0) for h in held if h.get("pid") not in pids)
    return (bool(top.get("pid")) and top["pid"] not in pids and top["pid"] != stall.get("device_pid")
            and 4 * outside >= waited)


def load_truth(path: Path) -> dict[int, list[dict[str, Any]]]:
    by_pid: dict[int, list[dict[str, Any]]] = {}
    for line in path.read_text().splitlines():
        t = json.loads(line)
        by_pid.setdefault(t["pid"], []).append(t)
    for labels in by_pid.values():
        labels.sort(key=lambda t: t["launch_ns"])
    return by_pid


def truth_for(stall: dict[str, Any], truth: dict[int, list[dict[str, Any]]]) -> dict[str, Any] | None:
    """The label written just before the launch that ended this stall (latest launch <= stall end)."""
    labels = truth.get(stall.get("device_pid", -1), [])
    i = bisect_right([t["launch_ns"] for t in labels], stall["end_ns"]) - 1
    return labels[i] if i >= 0 else None


def same_culprit(stall: dict[str, Any], t: dict[str, Any]) -> bool:
    c = stall["culprit"]
    if t["cause"] in OBJECT_CAUSES:
        return c["object"] == t["object"]
    if stall["cause"] == "tracing" and "tracing" in t.get("causes", ()):  # it names the tool's session
        return True
    pids = t.get("culprit_pids", [t["culprit_pid"]])  # where either of two processes is a right answer
    if c["pid"] in pids and c["tid"] == t.get("culprit_tid", c["tid"]):  # a thread where it says
        return True
    # a wait for a CPU that the labelled thread held most of: that thread named, as "held the CPU" (gil: the
    # interpreter's holder spinning on the CPU the trainer needed, on a loaded machine)
    held = c.get("cpu_held_by") or []
    if stall["cause"] == "cpu.runqueue" and "culprit_tid" in t and held:
        top = max(held, key=lambda h: h.get("ns", 0))
        return top.get("pid") in pids and top.get("tid") == t["culprit_tid"]
    # The wait chain went through the labelled process and on to what held that process up in turn: deeper than
    # the label, which cannot see it (train_torch's workers share one result queue, and a fast worker's batch
    # can wait for the queue's lock, held by the slow worker's feeder thread while it waits for its own GIL).
    via = stall.get("via") or ()
    return "culprit_tid" not in t and any(f"wait:pid {p}" in via for p in pids if p != stall.get("device_pid"))


# A label's ``own_from_ns`` says when what the step waited for was over (the batch in the trainer's hands, a
# sleep's deadline): GPU idle time after it was the launching process's own, on a CPU or waiting for one (the
# capture's session may be what held that CPU: `tracing`), not the label's cause. A stall is scored by the
# dominant part of its time, and a share of it may be told apart in two parts (a process's CPU time and its
# wait for a CPU): of a stall one side of which holds between a third and two thirds, either side may rightly
# be the dominant part, so either answer is right; outside that band, only the side holding the most.
OWN_CAUSES = ["cpu", "cpu.runqueue", "tracing"]


def labels_for(stall: dict[str, Any], t: dict[str, Any] | None) -> list[dict[str, Any]]:
    """The labels a stall may rightly be scored against: its label, or the launching process's own time, or
    both, by the share of the stall after the label's ``own_from_ns`` (see OWN_CAUSES). A label of the
    launching process's own CPU time (a thread of it, where it says which) is its own time all along: on a
    CPU or, on a loaded machine, waiting for one (the workload cannot label the machine's load, nor the
    tool's); ``same_culprit`` still asks for the thread."""
    if t is None:
        return []
    if t["cause"] == OWN_CAUSES[0] and not t.get("object") and t.get("culprit_pid") == stall.get("device_pid"):
        return [{**t, "causes": OWN_CAUSES}]
    own = {"pid": t["pid"], "launch_ns": t["launch_ns"], "cause": OWN_CAUSES[0], "causes": OWN_CAUSES, "object": "",
           "culprit_pid": stall.get("device_pid", t["pid"])}
    if t.get("own_ok"):  # the label's calls were this process's own time as much as what they waited for
        return [t, own]
    own_from = t.get("own_from_ns")
    if not own_from:
        return [t]
    start, end = stall["start_ns"], stall["end_ns"]
    share = max(0, end - max(start, own_from)) / max(end - start, 1)
    return ([t] if share <= 2 / 3 else []) + ([own] if share >= 1 / 3 else [])


def score(name: str, report: dict[str, Any], truth: dict[int, list[dict[str, Any]]]) -> Score:
    sc = Score(name, labels=sum(len(v) for v in truth.values()))
    pids = set(report.get("capture", {}).get("pids", ()))
    for s in report["stalls"]:
        ns = s["duration_ns"]
        sc.stalls += 1
        sc.stall_ns += ns
        t = truth_for(s, truth)
        right = labels_for(s, t)
        if not any(s["cause"] in r.get("causes", [r["cause"]]) and same_culprit(s, r) for r in right) \
                and machine_load(s, pids):
            sc.load_ns += ns
            continue
        if s["cause"] == "unknown":
            sc.unknown_ns += ns
        elif any(s["cause"] in r.get("causes", [r["cause"]]) and same_culprit(s, r) for r in right):
            sc.correct_ns += ns
            continue
        named = bool(s["culprit"]["pid"] or s["culprit"]["object"])
        # the GPU process itself waiting for a CPU blames no one else, nor does the tool naming its own cost
        # (its session holding the CPU a traced thread waited for): misses (the workloads cannot label the
        # machine's load or the tool's), not wrong culprits
        own_runqueue = s["cause"] == "cpu.runqueue" and s["culprit"]["pid"] == s.get("device_pid")
        tools_own = s["cause"] == "tracing"
        # nor does the GPU process's own CPU time where its CPU samples show it running (on a loaded host the
        # trainer's own hand-over of a batch, before the step gets it, can outlast the worker's part of a stall)
        own_sampled = (s["cause"] == "cpu" and s["culprit"]["pid"] == s.get("device_pid")
                       and s["culprit"].get("samples", 0) > 0)  # fmt: skip
        if (named and not own_runqueue and not tools_own and not own_sampled and ns >= WRONG_CULPRIT_MIN_NS
                and not any(same_culprit(s, r) for r in right)):
            sc.wrong_culprits.append(s)
        why = f", why: {s['why']}" if s.get("why") else ""  # an unknown stall's reason, for a CI log to show
        sc.misses.append(f"{ns / 1e6:.1f} ms {s['cause']} {s['culprit']['object'] or s['culprit']['pid']} "
                         f"(truth: {t and (t['cause'], t['object'] or t['culprit_pid'])}{why})")
    return sc


# ---------------------------------------------------------------------------------- scenarios ---

Setup = Callable[[Path, contextlib.ExitStack], dict[str, Any]]
KIB = 1024


def _loop(workdir: Path, stack: contextlib.ExitStack, rates: list[int], nfiles: int, size: int) -> dict[str, Any]:
    mnt, devnum = stack.enter_context(fixtures.loop_filesystem(workdir))
    files = fixtures.make_files(mnt, "shard", nfiles, size)
    cgroups = stack.enter_context(fixtures.blkio_cgroups(devnum, rates))
    return {"files": files, "cgroups": cgroups}


def _storage(w: Path, st: contextlib.ExitStack) -> dict[str, Any]:
    # worker 0 reads at 8 MiB/s, worker 1 (the slow one) at 1 MiB/s. blk-throttle lets a new slice
    # (100 ms) through at once, so files are larger than the slow group's slice: ~90 ms a file there.
    return {"workers": 2, "steps": 10, **_loop(w, st, [8 << 20, 1 << 20], 10, 192 * KIB)}


def _fuse(w: Path, st: contextlib.ExitStack) -> dict[str, Any]:
    names = {f"sample-{i:02d}.bin": 64 * KIB for i in range(8)}
    slow = {n for i, n in enumerate(names) if i % 2 == 0}
    mnt = st.enter_context(fixtures.fuse_filesystem(w, names, slow, delay_ms=20))
    return {"steps": 8, "files": [str(mnt / n) for n in sorted(slow)]}


def _network(_w: Path, st: contextlib.ExitStack) -> dict[str, Any]:
    return {"steps": 10, "port": st.enter_context(fixtures.slow_peer(delay_ms=20))}


def _collective(w: Path, st: contextlib.ExitStack) -> dict[str, Any]:
    return {"steps": 6, "address": str(w / "pg.sock"), **_loop(w, st, [1 << 20], 6, 160 * KIB)}


def _gloo_collective(w: Path, st: contextlib.ExitStack) -> dict[str, Any]:
    # rank 1 reads 6 shards of 160 KiB at 1 MiB/s, one before each all-reduce
    cfg = _loop(w, st, [1 << 20], 6, 160 * KIB)
    return {**cfg, "steps": 6, "address": str(w / "pg"), "store": str(w / "gloo.store")}


def _mixed(w: Path, st: contextlib.ExitStack) -> dict[str, Any]:
    cfg = _loop(w, st, [1 << 20], 6, 160 * KIB)
    return {**cfg, "steps": 12, "port": st.enter_context(fixtures.slow_peer(delay_ms=20)), "sleep_ms": 15,
            "work_ms": 15}


def _mapped(w: Path, st: contextlib.ExitStack) -> dict[str, Any]:
    # 8 shards of 256 KiB at 2 MiB/s: each is a few read-around faults of up to 128 KiB
    return {"steps": 8, **_loop(w, st, [2 << 20], 8, 256 * KIB)}


def _timed_waits(w: Path, st: contextlib.ExitStack) -> dict[str, Any]:
    # 4 shards of 160 KiB at 1 MiB/s (~50 ms each beyond blk-throttle's first slice), and 4 sleeps
    return {"steps": 8, "sleep_ms": 15, **_loop(w, st, [1 << 20], 4, 160 * KIB)}


def _mp_queue(w: Path, st: contextlib.ExitStack) -> dict[str, Any]:
    # 5 shards of 160 KiB at 1 MiB/s, one per step, handed over a fresh multiprocessing.Queue
    return {"steps": 5, **_loop(w, st, [1 << 20], 5, 160 * KIB)}


def _uring(w: Path, st: contextlib.ExitStack) -> dict[str, Any]:
    # the trainer reads 6 shards of 192 KiB at 1 MiB/s itself through io_uring: inline on even steps, by the
    # ring's io-wq worker threads on odd ones (IOSQE_ASYNC)
    return {"steps": 6, "lib": fixtures.uring_lib(w), **_loop(w, st, [1 << 20], 6, 192 * KIB)}


def _torch_loader(w: Path, st: contextlib.ExitStack) -> dict[str, Any]:
    # worker 1's cgroup reads at 1 MiB/s: 5 shards of 160 KiB; worker 0 spends 30 ms of CPU a sample
    cfg = _loop(w, st, [64 << 20, 1 << 20], 5, 160 * KIB)
    return {**cfg, "steps": 10, "work_ms": 30}


def _torch_straggler(w: Path, st: contextlib.ExitStack) -> dict[str, Any]:
    # a slow worker among fast ones: workers 0 and 1 spend 30 ms of CPU a sample, worker 2 reads its shards at
    # 1 MiB/s. The fast workers' batches arrive out of order while the trainer waits for the slow one's.
    return {**_torch_loader(w, st), "workers": 3, "steps": 15, "work_ms": 30, "warm_up": True}


def _checkpoint(w: Path, st: contextlib.ExitStack) -> dict[str, Any]:
    # 4 checkpoints of 256 KiB, each written and fsynced at 1 MiB/s (~250 ms beyond blk-throttle's first slice)
    mnt, devnum = st.enter_context(fixtures.loop_filesystem(w))
    cgroups = st.enter_context(fixtures.blkio_cgroups(devnum, [64 << 20], write_bps=1 << 20))
    return {"steps": 8, "dir": str(mnt), "ckpt_bytes": 256 * KIB, "cgroups": cgroups}


def _dirty_writes(w: Path, st: contextlib.ExitStack) -> dict[str, Any]:
    # 4 saves of 2 MiB written (no fsync) to a device allowed 256 KiB of dirty pages, written back at 4 MiB/s:
    # the kernel's dirty throttling (balance_dirty_pages) pauses the writer several times in most saves
    mnt, devnum = st.enter_context(fixtures.loop_filesystem(w))
    st.enter_context(fixtures.loopdev.dirty_limit(devnum, 256 * KIB, 4 << 20))
    return {"steps": 8, "dir": str(mnt), "save_bytes": 2048 * KIB}


def _cpu_throttled(_w: Path, st: contextlib.ExitStack) -> dict[str, Any]:
    # a worker allowed 20 ms of CPU per 100 ms spends 30 ms of CPU on each batch: it is throttled in every batch.
    # The group competes with the tasks beside it as one entity of its weight, whatever its members' nice: the
    # weight of nice -10 (the workloads' own) keeps other load on a shared machine from turning the
    # constructed throttling into run-queue waits
    group = st.enter_context(fixtures.cpu_cgroup(20_000, 100_000, shares=9548))
    return {"workers": 1, "steps": 8, "work_ms": 30, "cpu_cgroup": str(group)}
def _train_torch(w: Path, _st: contextlib.ExitStack, *args: str, slow_ms: int = 100) -> dict[str, Any]:
    # examples/train_torch.py --device sim: worker 1 spends ``slow_ms`` of CPU on each batch of 8 samples, long
    # next to the trainer's own time between steps (a few ms, more where the VM's other load takes its CPU)
    return {"data": str(w / "samples"), "files": 1, "batch": 8, "steps": 12,
            "args": ["--slow-worker", "1", "--slow-ms", str(slow_ms), *args]}


def _train_torch_cold(w: Path, st: contextlib.ExitStack) -> dict[str, Any]:
    # --cold: every sample dropped from the page cache and read from a loop device at 4 MiB/s (the whole job's
    # cgroup): a batch of 8 samples of 64 KiB is ~0.13 s of reads. One worker: with two, each one's reads
    # would wait for the other's share of the throttled device as well
    mnt, devnum = st.enter_context(fixtures.loop_filesystem(w))
    cgroups = st.enter_context(fixtures.blkio_cgroups(devnum, [4 << 20]))
    return {"data": str(mnt / "samples"), "files": 2, "batch": 8, "steps": 6, "cold": True, "cgroups": cgroups,
            "args": ["--cold", "--workers", "1"]}


SCENARIOS: dict[str, Setup] = {
    "storage": _storage,
    "fuse": _fuse,
    "cpu_worker": lambda w, st: {"workers": 1, "steps": 40, "work_ms": 20},
    "contention": lambda w, st: {"steps": 25, "work_ms": 1, "hog_ms": 30_000},
    "network": _network,
    "collective": _collective,
    "gloo_collective": _gloo_collective,
    "sync_then_work": lambda w, st: {"steps": 10, "work_ms": 15},
    "sleep": lambda w, st: {"steps": 10, "sleep_ms": 15},
    "mixed": _mixed,
    "mapped": _mapped,
    "timed_waits": _timed_waits,
    "mp_queue": _mp_queue,
    "asyncio_fetch": _network,
    "gil": lambda w, st: {"steps": 30, "work_ms": 0.2},
    "uring": _uring,
    "torch_loader": _torch_loader,
    "torch_loader_pinned": lambda w, st: {**_torch_loader(w, st), "pin_memory": True},
    "torch_straggler": _torch_straggler,
    "torch_straggler_pinned": lambda w, st: {**_torch_straggler(w, st), "pin_memory": True},
    "checkpoint": _checkpoint,
    "dirty_writes": _dirty_writes,
    "cpu_throttled": _cpu_throttled,
    "train_torch_slow": _train_torch,
    "train_torch_slow_pinned": lambda w, st: _train_torch(w, st, "--pin-memory"),
    "train_torch_slow_4": lambda w, st: {**_train_torch(w, st, "--workers", "4", slow_ms=200), "steps": 20},
    "train_torch_cold": _train_torch_cold,
}


@contextlib.contextmanager
def prepared(name: str, workdir: Path, setup: Setup | None = None) -> Iterator[dict[str, Any]]:
    with contextlib.ExitStack() as stack:
        cfg = (setup or SCENARIOS[name])(workdir, stack)
        cfg["truth"] = str(workdir / "truth.jsonl")
        yield cfg


def run(name: str, workdir: Path, setup: Setup | None = None) -> tuple[Score, dict[str, Any]]:
    """Capture the scenario with `run_capture` (the same path as `gputrace capture -- CMD`) and score it.
    ``setup`` replaces the scenario's own configuration (a smaller or differently made variant)."""
    import time

    from gputrace.daemon.session import CaptureOptions, run_capture

    t0 = time.monotonic()
    with prepared(name, workdir, setup) as cfg:
        cfg_path = workdir / "config.json"
        cfg_path.write_text(json.dumps(cfg))
        opts = CaptureOptions(output=workdir / f"{name}.gputrace", command=[sys.executable, str(WORKLOAD), name,
                              str(cfg_path)], force=True, min_gap_ms=1.0, progress=False, perfetto=False)
        result = run_capture(opts, log=lambda _msg: None)
    if result.exit_code != 0:
        raise RuntimeError(f"scenario {name} exited with {result.exit_code}")
    assert result.report is not None
    sc = score(name, result.report, load_truth(Path(cfg["truth"])))
    sc.wall_s = time.monotonic() - t0
    return sc, result.report
