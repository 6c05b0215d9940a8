"""Attribution rules (docs/report.md, "How a stall is explained") on small synthetic captures: records in,
expected stalls out."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from gputrace.analysis import analyze, summary_lines
from gputrace.capture import open_capture
from gputrace.exporters.perfetto.args import stall_args
from gputrace.records import CudaApi, OffCpu
from gputrace.testing.synth import Builder, ns
from gputrace.viewer.terminal import describe, render

TRAINER, WORKER, WORKER2 = 100, 200, 300
PATH = "/data/shard-0042.bin"


def run(b: Builder, tmp_path: Path, **kw: Any) -> dict[str, Any]:
    path = b.write(tmp_path / "t.gputrace",
                   **{k: v for k, v in kw.items() if k in ("complete", "drops", "header", "trailer")})
    with open_capture(path) as reader:
        return analyze(reader, **{k: v for k, v in kw.items() if k == "min_gap_ns"})


def trainer(stall_from: float = 10.0, stall_to: float = 40.0, launch_at: float | None = None) -> Builder:
    """A trainer with one kernel before and one after a stall [stall_from, stall_to)."""
    b = Builder().proc(TRAINER, "python").device(TRAINER)
    b.op(TRAINER, TRAINER, 0.0, 0.0, stall_from, "step_fwd")
    launch = stall_to - 0.05 if launch_at is None else launch_at
    b.op(TRAINER, TRAINER, launch, stall_to, stall_to + 10, "step_bwd")
    return b


def only_stall(report: dict[str, Any]) -> dict[str, Any]:
    assert len(report["stalls"]) == 1, report["stalls"]
    return report["stalls"][0]


def worker_reads(b: Builder, pid: int, path: str = PATH, start: float = 12.0, end: float = 38.0) -> Builder:
    b.proc(pid, "pt_data_worker", TRAINER)
    b.syscall(pid, pid, "pread64", start, end, path, 1 << 20)
    b.block(pid, pid, start + 0.1, end - 0.1, 512 << 10).block(pid, pid, start + 0.2, end - 0.2, 512 << 10)
    return b.offcpu(pid, pid, start + 0.2, end - 0.05, "D", waker=(0, 0, "swapper/1"))


def test_gap_geometry_and_schema(tmp_path: Path) -> None:
    b = trainer()
    b.op(TRAINER, TRAINER, 50.2, 50.3, 55.0, "tiny_gap")  # 0.3 ms gap: below the 1 ms default
    r = run(b, tmp_path)
    s = only_stall(r)
    assert (s["start_ns"], s["end_ns"], s["duration_ns"]) == (ns(10), ns(40), ns(40) - ns(10))
    assert r["schema"] == "gputrace.report/1"
    assert set(r) >= {"schema", "capture", "devices", "summary", "stalls"}
    assert set(r["capture"]) >= {"start_ns", "end_ns", "pids", "host", "drops", "complete"}
    d = r["devices"][0]
    assert d["simulated"] is True and d["busy_ns"] == ns(55) - ns(40) + ns(10) - ns(0) - (ns(50.3) - ns(50))
    assert r["summary"]["stall_ns"] == s["duration_ns"] and r["summary"]["by_cause"] == {s["cause"]: s["duration_ns"]}
    assert set(s) >= {"device", "start_ns", "end_ns", "duration_ns", "cause", "via", "culprit", "evidence"}
    assert set(s["culprit"]) >= {"pid", "tid", "comm", "op", "object", "bytes", "duration_ns"}
    assert run(b, tmp_path, min_gap_ns=100_000)["summary"]["stalls"] == 2


def test_storage_through_a_wakeup_chain(tmp_path: Path) -> None:
    b = trainer()
    b.syscall(TRAINER, TRAINER, "futex", 9.0, 39.9).offcpu(TRAINER, TRAINER, 9.0, 39.85, "S", 39.8,
                                                           (WORKER, WORKER, "pt_data_worker"))
    worker_reads(b, WORKER)
    s = only_stall(run(b, tmp_path))
    assert s["cause"] == "storage"
    assert s["culprit"]["pid"] == WORKER and s["culprit"]["object"] == PATH and s["culprit"]["op"] == "pread64"
    assert s["culprit"]["bytes"] == 1 << 20 and s["culprit"]["block_requests"] == 2
    assert s["via"] == [f"wait:pid {WORKER}"]
    kinds = {(e["kind"], e["pid"], e["start_ns"]) for e in s["evidence"]}
    assert ("syscall", WORKER, ns(12)) in kinds and ("block", WORKER, ns(12.1)) in kinds
    assert ("wakeup", TRAINER, ns(9)) in kinds and any(k == "gpu" for k, _, _ in kinds)


def test_time_before_a_waker_existed_is_its_creators(tmp_path: Path) -> None:
    """A multiprocessing.Queue's feeder thread, started by the worker's first put(), wakes the trainer: before
    it was created, the worker's main thread was reading the batch, and that read is the stall's cause."""
    feeder = WORKER + 1
    b = trainer()
    b.syscall(TRAINER, TRAINER, "futex", 9.0, 39.9).offcpu(TRAINER, TRAINER, 9.0, 39.85, "S", 39.8,
                                                           (WORKER, feeder, "QueueFeederThr"))
    worker_reads(b, WORKER, start=12.0, end=34.0)
    b.fork(WORKER, WORKER, WORKER, feeder, 35.0, "QueueFeederThr")
    b.syscall(WORKER, feeder, "write", 39.0, 39.7, "pipe:[77]", 4096)  # hands the batch over, on CPU
    s = only_stall(run(b, tmp_path))
    assert s["cause"] == "storage", s
    assert (s["culprit"]["pid"], s["culprit"]["tid"]) == (WORKER, WORKER)
    assert s["culprit"]["object"] == PATH and s["culprit"]["op"] == "pread64"
    assert s["via"] == [f"wait:pid {WORKER}"]  # a thread created by its own process's thread: no hop
    kinds = {(e["kind"], e["pid"], e["tid"], e["start_ns"]) for e in s["evidence"]}
    assert ("wakeup", TRAINER, TRAINER, ns(9)) in kinds and ("syscall", WORKER, WORKER, ns(12)) in kinds
    # the feeder's own time, from its creation on, is what remains of the window: on CPU
    cpu = [p for p in s["breakdown"] if p["cause"] == "cpu" and p["pid"] == WORKER]
    assert cpu and sum(p["ns"] for p in cpu) >= ns(39.8) - ns(35.0)


def test_time_before_a_forked_waker_existed_is_its_parents(tmp_path: Path) -> None:
    """A process forked inside the window wakes the trainer: the time before the fork is explained on the
    forking thread, and the hop says so. Creators that name each other (hostile input) still end."""
    b = trainer()
    b.syscall(TRAINER, TRAINER, "read", 9.0, 39.9, "pipe:[4242]")
    b.offcpu(TRAINER, TRAINER, 9.0, 39.85, "S", 39.8, (WORKER2, WORKER2, "pool_child"))
    worker_reads(b, WORKER, start=11.0, end=30.0)
    b.fork(WORKER, WORKER, WORKER2, WORKER2, 31.0, "pool_child").proc(WORKER2, "pool_child", WORKER)
    b.fork(WORKER2, WORKER2, WORKER, WORKER, 10.5)  # impossible: each created by the other
    s = only_stall(run(b, tmp_path))
    assert s["cause"] == "storage" and s["culprit"]["pid"] == WORKER and s["culprit"]["object"] == PATH
    assert s["via"] == [f"wait:pid {WORKER2}", f"fork:pid {WORKER}"]


def test_wakeup_chain_across_two_processes(tmp_path: Path) -> None:
    b = trainer()
    b.syscall(TRAINER, TRAINER, "read", 9.0, 39.9, "pipe:[4242]")
    b.offcpu(TRAINER, TRAINER, 9.0, 39.85, "S", 39.8, (WORKER, WORKER, "collate"))
    b.proc(WORKER, "collate", TRAINER).syscall(WORKER, WORKER, "futex", 8.0, 39.5)
    b.offcpu(WORKER, WORKER, 8.0, 39.5, "S", 39.4, (WORKER2, WORKER2, "reader"))
    worker_reads(b, WORKER2, "/data/b.bin", 11.0, 39.0)
    s = only_stall(run(b, tmp_path))
    assert s["cause"] == "storage" and s["culprit"]["pid"] == WORKER2 and s["culprit"]["object"] == "/data/b.bin"
    assert s["via"] == [f"wait:pid {WORKER}", f"wait:pid {WORKER2}"]


@pytest.mark.parametrize("used", [False, True])
def test_a_delivery_set_aside_is_not_what_the_wait_was_for(tmp_path: Path, used: bool) -> None:
    """PyTorch's DataLoader with a slow worker among fast ones: while the trainer waits for the slow worker's
    batch, a fast worker's later batch arrives first on the shared queue; the trainer fetches its tensors'
    fds from that worker (a wait its busy worker answers late) and sets it aside, then waits on the queue
    again. Its waits on the queue are one wait, for the slow worker's batch: the stall is the slow worker's
    read, the early batch's fds included. Had the trainer used that batch (a launch before it waited on the
    queue again), the fds were what it waited for then: the fast worker keeps that part."""
    fast, sharer, feeder, slow = WORKER, WORKER + 1, WORKER + 2, WORKER2
    b = trainer()
    b.proc(fast, "pt_data_worker", TRAINER).thread(fast, sharer, "pt_data_worker")
    b.thread(fast, feeder, "QueueFeederThr")
    b.syscall(TRAINER, TRAINER, "poll", 5.0, 8.0, "pipe:[77]", fd=6, arg=1)  # the fast batch comes first
    b.offcpu(TRAINER, TRAINER, 5.0, 7.95, "S", 7.9, (fast, feeder, "QueueFeederThr"))
    b.syscall(TRAINER, TRAINER, "read", 8.2, 28.0, "unix:/tmp/pymp-x/listener-y", fd=9)  # its fds, slowly
    b.offcpu(TRAINER, TRAINER, 8.2, 27.9, "S", 27.8, (fast, sharer, "pt_data_worker"))
    if used:
        b.records.append(CudaApi(TRAINER, TRAINER, "cudaMemcpyAsync", ns(28.2), ns(28.3), 999, "runtime", 0))
    b.syscall(TRAINER, TRAINER, "poll", 28.5, 39.9, "pipe:[77]", fd=6, arg=1)  # the queue again
    b.offcpu(TRAINER, TRAINER, 28.5, 39.85, "S", 39.8, (slow, slow, "pt_data_worker"))
    worker_reads(b, slow, start=5.0, end=39.6)
    s = only_stall(run(b, tmp_path))
    by = {(p["cause"], p["pid"]): p["ns"] for p in s["breakdown"]}
    if used:
        assert s["cause"] == "cpu" and s["culprit"]["pid"] == fast, s
        assert by[("cpu", fast)] >= ns(27.8) - ns(10) and by[("storage", slow)] >= ns(39.5) - ns(28.5), by
        return
    assert s["cause"] == "storage" and (s["culprit"]["pid"], s["culprit"]["object"]) == (slow, PATH), s
    assert s["via"] == [f"wait:pid {slow}"]
    assert not [p for p in s["breakdown"] if p["pid"] == fast], s["breakdown"]
    assert by[("storage", slow)] >= ns(39.5) - ns(10), by


def test_a_lock_handed_over_after_the_wait_is_not_a_hand_off(tmp_path: Path) -> None:
    """The trainer reads its file itself, then waits a moment for the GIL, which a thread of its own process
    took while it was reading (back from a timed sleep) and hands back: a futex delivers nothing, so the
    read stays the stall's cause instead of that thread's sleep."""
    other = TRAINER + 1
    b = trainer()
    b.thread(TRAINER, other, "python")
    b.syscall(TRAINER, TRAINER, "read", 9.0, 39.5, PATH, 1 << 20)
    b.offcpu(TRAINER, TRAINER, 9.0, 39.5, "D", 39.4, (0, 0, "swapper/0"))
    b.syscall(TRAINER, TRAINER, "futex", 39.55, 39.9).offcpu(TRAINER, TRAINER, 39.55, 39.9, "S", 39.85,
                                                             (TRAINER, other, "python"))
    b.syscall(TRAINER, other, "pselect6", 1.0, 39.6).offcpu(TRAINER, other, 1.0, 39.6, "S", 39.55, (0, 0, "[timer]"))
    s = only_stall(run(b, tmp_path))
    assert s["cause"] == "storage" and (s["culprit"]["pid"], s["culprit"]["object"]) == (TRAINER, PATH), s


def test_a_queue_between_threads_passes_the_delivery_on(tmp_path: Path) -> None:
    """PyTorch's pin-memory thread takes each batch off the workers' queue (a pipe) and puts it on the
    trainer's ``queue.Queue`` (a futex). A fast worker's batch comes first and is set aside; the trainer's
    futex waits are one wait, for the slow worker's batch, which the pin-memory thread was handed while the
    trainer waited: the stall is the slow worker's read, with nothing on the fast worker."""
    pin, fast, slow = TRAINER + 1, WORKER, WORKER2
    b = trainer()
    b.thread(TRAINER, pin, "pt_data_pin").proc(fast, "pt_data_worker", TRAINER)
    b.syscall(TRAINER, pin, "poll", 5.0, 14.9, "pipe:[77]", fd=6, arg=1)
    b.offcpu(TRAINER, pin, 5.0, 14.85, "S", 14.8, (fast, fast, "pt_data_worker"))
    b.syscall(TRAINER, pin, "poll", 16.0, 38.0, "pipe:[77]", fd=6, arg=1)
    b.offcpu(TRAINER, pin, 16.0, 37.95, "S", 37.9, (slow, slow, "pt_data_worker"))
    b.syscall(TRAINER, TRAINER, "futex", 9.0, 16.0, fd=-1, arg=0x7000)  # the fast batch, set aside
    b.offcpu(TRAINER, TRAINER, 9.0, 15.97, "S", 15.95, (TRAINER, pin, "pt_data_pin"))
    b.syscall(TRAINER, TRAINER, "futex", 16.5, 39.9, fd=-1, arg=0x7000)
    b.offcpu(TRAINER, TRAINER, 16.5, 38.6, "S", 38.5, (TRAINER, pin, "pt_data_pin"))
    worker_reads(b, slow, start=5.0, end=37.8)
    s = only_stall(run(b, tmp_path))
    assert s["cause"] == "storage" and (s["culprit"]["pid"], s["culprit"]["object"]) == (slow, PATH), s
    assert s["via"] == [f"wait:pid {TRAINER}", f"wait:pid {slow}"]
    assert not [p for p in s["breakdown"] if p["pid"] == fast], s["breakdown"]


@pytest.mark.parametrize("shared", [False, True])
def test_a_lock_handed_over_by_a_thread_with_data_is_no_relay(tmp_path: Path, shared: bool) -> None:
    """The trainer reads its file itself, then waits a moment for the GIL, which its pin-memory thread hands
    over. That thread had been handed a batch, but before the trainer waited (it took the GIL to unpickle it),
    or while the trainer waited yet on a futex word both wait on (the GIL's, which it took first): a lock
    handed over, not a batch passed on, so the read stays the stall's cause, not the worker's CPU."""
    pin, gil = TRAINER + 1, 0xA5B8F4
    b = trainer()
    b.thread(TRAINER, pin, "pt_data_pin").proc(WORKER, "pt_data_worker", TRAINER)
    b.syscall(TRAINER, TRAINER, "read", 9.0, 39.5, PATH, 1 << 20)
    b.offcpu(TRAINER, TRAINER, 9.0, 39.5, "D", 39.4, (0, 0, "swapper/0"))
    b.syscall(TRAINER, TRAINER, "futex", 39.55, 39.9, fd=-1, arg=gil)
    b.offcpu(TRAINER, TRAINER, 39.55, 39.87, "S", 39.85, (TRAINER, pin, "pt_data_pin"))
    handed = 39.6 if shared else 29.9
    b.syscall(TRAINER, pin, "poll", 1.0, handed + 0.01, "pipe:[77]", fd=6, arg=1)
    b.offcpu(TRAINER, pin, 1.0, handed + 0.005, "S", handed, (WORKER, WORKER, "pt_data_worker"))
    b.syscall(WORKER, WORKER, "write", handed - 0.1, handed - 0.05, "pipe:[77]", 4096)  # on CPU before that
    if shared:
        b.syscall(TRAINER, pin, "futex", 39.62, 39.7, fd=-1, arg=gil)
        b.offcpu(TRAINER, pin, 39.62, 39.7, "S", 39.69, (TRAINER, TRAINER, "python"))
    s = only_stall(run(b, tmp_path))
    assert s["cause"] == "storage" and (s["culprit"]["pid"], s["culprit"]["object"]) == (TRAINER, PATH), s


def test_a_wait_the_next_task_spent_waiting_for_this_thread_stays_on_its_own_waker(tmp_path: Path) -> None:
    """A chain of requests: the trainer waits for A's answer, then asks B, which was idle until asked, and
    waits for B's. A's time is on the way (B could not start before A answered): the hand-off rule follows B
    back to the trainer's request and from there to A; the hops name A alone, as if the trainer had waited
    for A directly (the detour through B and back to the trainer is not repeated)."""
    a_pid, b_pid = WORKER, WORKER2
    b = trainer()
    b.proc(a_pid, "encoder", TRAINER).proc(b_pid, "reader", TRAINER)
    b.syscall(TRAINER, TRAINER, "read", 9.0, 30.0, "pipe:[1]")  # A's answer (A computes, on CPU)
    b.offcpu(TRAINER, TRAINER, 9.0, 29.9, "S", 29.8, (a_pid, a_pid, "encoder"))
    b.syscall(TRAINER, TRAINER, "read", 30.5, 39.9, "pipe:[2]")  # B's answer
    b.offcpu(TRAINER, TRAINER, 30.5, 39.85, "S", 39.8, (b_pid, b_pid, "reader"))
    b.syscall(b_pid, b_pid, "read", 1.0, 30.4, "pipe:[3]")  # B idle until the trainer's request
    b.offcpu(b_pid, b_pid, 1.0, 30.4, "S", 30.3, (TRAINER, TRAINER, "python"))
    worker_reads(b, b_pid, start=30.6, end=39.6)
    s = only_stall(run(b, tmp_path))
    assert s["cause"] == "cpu" and s["culprit"]["pid"] == a_pid, s
    assert s["via"] == [f"wait:pid {a_pid}"]
    by = {(p["cause"], p["pid"]): p["ns"] for p in s["breakdown"]}
    assert by[("cpu", a_pid)] >= ns(29.7) - ns(10) and by[("storage", b_pid)] >= ns(39.5) - ns(30.7), by


def test_a_chain_that_comes_back_to_a_task_it_named_drops_the_detour(tmp_path: Path) -> None:
    """The trainer's last wait is for a worker's resource-sharer thread (the batch's fd), which sat idle until
    the trainer connected; before that the trainer waited on the queue for the worker's feeder. The chain
    goes worker, trainer, worker again: the hops name the worker once, then its main thread that read."""
    sharer, feeder = WORKER + 1, WORKER + 2
    b = trainer()
    b.thread(WORKER, sharer, "pt_data_worker").thread(WORKER, feeder, "QueueFeederThr")
    b.syscall(TRAINER, TRAINER, "poll", 9.0, 29.9, "pipe:[77]", arg=1)
    b.offcpu(TRAINER, TRAINER, 9.0, 29.85, "S", 29.8, (WORKER, feeder, "QueueFeederThr"))
    b.syscall(TRAINER, TRAINER, "read", 30.0, 39.9, "unix:/tmp/pymp-x/listener-y")
    b.offcpu(TRAINER, TRAINER, 30.0, 39.85, "S", 39.8, (WORKER, sharer, "pt_data_worker"))
    b.syscall(WORKER, sharer, "accept4", 1.0, 30.2, "unix:/tmp/pymp-x/listener-y")
    b.offcpu(WORKER, sharer, 1.0, 30.15, "S", 30.1, (TRAINER, TRAINER, "python"))
    b.syscall(WORKER, feeder, "futex", 1.0, 29.7).offcpu(WORKER, feeder, 1.0, 29.7, "S", 29.6,
                                                         (WORKER, WORKER, "pt_data_worker"))
    worker_reads(b, WORKER, start=5.0, end=29.5)
    s = only_stall(run(b, tmp_path))
    assert s["cause"] == "storage" and s["culprit"]["object"] == PATH, s
    assert s["via"] == [f"wait:pid {WORKER}", f"wait:tid {WORKER}"]
    by = {(p["cause"], p["pid"]): p["ns"] for p in s["breakdown"]}
    assert by[("storage", WORKER)] >= ns(29.4) - ns(10) and by[("cpu", WORKER)] >= ns(39.7) - ns(30.2), by


def test_a_hop_inside_the_process_already_named_names_the_thread(tmp_path: Path) -> None:
    """A worker's queue feeder thread wakes the trainer, itself woken by the worker's main thread that read
    the batch: the second hop stays inside the worker, so it names the thread, not the worker again."""
    feeder = WORKER + 1
    b = trainer()
    b.syscall(TRAINER, TRAINER, "read", 9.0, 39.9, "pipe:[4242]")
    b.offcpu(TRAINER, TRAINER, 9.0, 39.85, "S", 39.8, (WORKER, feeder, "QueueFeederThr"))
    b.fork(WORKER, WORKER, WORKER, feeder, 1.0, "QueueFeederThr")
    b.syscall(WORKER, feeder, "futex", 8.0, 39.5).offcpu(WORKER, feeder, 8.0, 39.5, "S", 39.4,
                                                         (WORKER, WORKER, "pt_data_worker"))
    worker_reads(b, WORKER, start=11.0, end=39.0)
    s = only_stall(run(b, tmp_path))
    assert s["cause"] == "storage" and (s["culprit"]["pid"], s["culprit"]["tid"]) == (WORKER, WORKER)
    assert s["via"] == [f"wait:pid {WORKER}", f"wait:tid {WORKER}"]


def test_stall_time_by_process(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """Stalls on different files can be one worker's: ``top_processes`` sums every stall's breakdown by
    process, the GPU process's own time marked as such, and the capture's summary says whose the files were
    when its top culprits are files."""
    b = trainer()
    b.op(TRAINER, TRAINER, 79.95, 80.0, 90.0, "step_opt")  # a second stall [50, 80)
    b.syscall(TRAINER, TRAINER, "futex", 9.0, 39.9).offcpu(TRAINER, TRAINER, 9.0, 39.85, "S", 39.8,
                                                           (WORKER, WORKER, "pt_data_worker"))
    worker_reads(b, WORKER)
    # on CPU from 50 to 60 (nothing recorded), then waits for the worker's next read
    b.syscall(TRAINER, TRAINER, "futex", 60.0, 79.9).offcpu(TRAINER, TRAINER, 60.0, 79.85, "S", 79.8,
                                                            (WORKER, WORKER, "pt_data_worker"))
    b.syscall(WORKER, WORKER, "pread64", 61.0, 79.5, "/data/b.bin", 1 << 20)
    b.offcpu(WORKER, WORKER, 61.1, 79.45, "D", waker=(0, 0, "swapper/1"))
    r = run(b, tmp_path)
    assert [s["cause"] for s in r["stalls"]] == ["storage", "storage"]
    assert {c["culprit"] for c in r["top_culprits"]} == {PATH, "/data/b.bin"}
    procs = r["top_processes"]
    assert [(p["pid"], p["comm"], p["gpu_process"], p["stalls"]) for p in procs] == \
        [(WORKER, "pt_data_worker", False, 2), (TRAINER, "python", True, 2)], procs
    worker, own = procs
    assert worker["by_cause"]["storage"] >= ns(29.3) - ns(10) + ns(79.4) - ns(61.1), worker
    assert own["by_cause"]["cpu"] >= ns(60) - ns(50) and own["stall_ns"] < ns(11), own
    total = r["summary"]["stall_ns"]
    assert [p["share_pct"] for p in procs] == [round(100 * p["stall_ns"] / total, 1) for p in procs]
    assert worker["stall_ns"] + own["stall_ns"] <= total
    line = next(x for x in summary_lines(r) if x.startswith("  by process: "))
    assert line == f"  by process: pid {WORKER} (pt_data_worker) {worker['share_pct']:.1f}%, " \
                   f"pid {TRAINER} (python) {own['share_pct']:.1f}%"
    render(r, Console(width=200, force_terminal=False))
    out = capsys.readouterr().out
    row = f"pid {WORKER} (pt_data_worker) │            │    49.6 ms │ 82.7% │      2 │ storage 90%, cpu 10%"
    assert "Stall time by process" in out and row in out, out


def test_a_breakdown_keeps_every_part(tmp_path: Path) -> None:
    """A worker that read eight shard files for one stall: the breakdown names the five largest and folds
    the other three into one entry for that worker and cause, so the entries add up to the whole stall and
    the worker's row in ``top_processes`` holds all eight reads."""
    b = trainer()
    b.syscall(TRAINER, TRAINER, "futex", 9.0, 39.9).offcpu(TRAINER, TRAINER, 9.0, 39.85, "S", 39.8,
                                                           (WORKER, WORKER, "pt_data_worker"))
    b.proc(WORKER, "pt_data_worker", TRAINER)
    reads = [(10.5 + 3.5 * k, 10.5 + 3.5 * k + 3.0 - 0.1 * k) for k in range(8)]  # shorter and shorter
    for k, (start, end) in enumerate(reads):
        b.syscall(WORKER, WORKER, "pread64", start, end, f"/data/shard-{k}.bin", 1 << 20)
        b.offcpu(WORKER, WORKER, start + 0.05, end - 0.05, "D", waker=(0, 0, "swapper/1"))
    r = run(b, tmp_path)
    s = only_stall(r)
    # the worker's CPU between its reads (8.6 ms) is the largest part: it and four shards are named
    assert [(p["cause"], p["object"]) for p in s["breakdown"][:5]] == \
        [("cpu", "")] + [("storage", f"/data/shard-{k}.bin") for k in range(4)], s["breakdown"]
    storage = [p for p in s["breakdown"] if p["cause"] == "storage"]
    assert [p["object"] for p in storage] == [f"/data/shard-{k}.bin" for k in range(4)] + [""], s["breakdown"]
    assert storage[-1]["objects"] == 4 and all("objects" not in p for p in s["breakdown"][:5])
    read_ns = [ns(end) - ns(start) for start, end in reads]
    assert abs(storage[-1]["ns"] - sum(read_ns[4:])) <= 4, storage[-1]
    assert sum(p["ns"] for p in storage) == pytest.approx(sum(read_ns), abs=10)
    assert sum(p["ns"] for p in s["breakdown"]) == pytest.approx(ns(39.8) - ns(10), abs=ns(0.2))
    worker = next(p for p in r["top_processes"] if p["pid"] == WORKER)
    assert worker["by_cause"]["storage"] == sum(p["ns"] for p in storage), worker


def test_cpu_in_a_worker(tmp_path: Path) -> None:
    b = trainer()
    b.syscall(TRAINER, TRAINER, "futex", 9.0, 39.9).offcpu(TRAINER, TRAINER, 9.0, 39.85, "S", 39.8,
                                                           (WORKER, WORKER, "pt_data_worker"))
    b.proc(WORKER, "pt_data_worker", TRAINER)  # traced, and never off CPU: it was computing
    s = only_stall(run(b, tmp_path))
    assert (s["cause"], s["culprit"]["pid"], s["via"]) == ("cpu", WORKER, [f"wait:pid {WORKER}"])


def test_cpu_on_the_launching_thread(tmp_path: Path) -> None:
    s = only_stall(run(trainer().syscall(TRAINER, TRAINER, "write", 20, 20.5, "/dev/pts/0"), tmp_path))
    assert (s["cause"], s["culprit"]["pid"], s["culprit"]["tid"], s["via"]) == ("cpu", TRAINER, TRAINER, [])


def test_runqueue(tmp_path: Path) -> None:
    s = only_stall(run(trainer().offcpu(TRAINER, TRAINER, 11.0, 38.0, "R"), tmp_path))
    assert s["cause"] == "cpu.runqueue" and s["culprit"]["pid"] == TRAINER
    assert "cpu_held_by" not in s["culprit"]  # a capture that does not say who had the CPU names nobody


def test_a_wait_for_the_cpu_the_capturing_process_had_is_the_tracings(tmp_path: Path) -> None:
    """The tool never blames the job for its own cost: run-queue time while gputrace itself (the header's
    tracer_pid) had the CPU is `tracing`; the rest, with a hog on the CPU, stays `cpu.runqueue`."""
    tracer, hog = 4242, 700
    b = trainer()
    b.offcpu(TRAINER, TRAINER, 11.0, 30.0, "R", held=(tracer, tracer + 1, "gt-agents"))  # one of its threads
    b.offcpu(TRAINER, TRAINER, 30.5, 38.0, "R", held=(hog, hog, "hog"))
    r = run(b, tmp_path, header={"tracer_pid": tracer})
    s = only_stall(r)
    # the process is gputrace, whatever its thread that held the CPU is called
    assert {p["pid"]: p["comm"] for p in r["top_processes"]}[tracer] == "gputrace"
    parts = {p["cause"]: p for p in s["breakdown"]}
    assert s["cause"] == "tracing" and s["culprit"]["pid"] == tracer, s
    assert parts["tracing"]["ns"] == ns(30) - ns(11) and parts["cpu.runqueue"]["ns"] == ns(38) - ns(30.5), parts
    assert s["culprit"]["object"] == "gputrace session: held the CPU the job waited for"


def test_runqueue_names_who_had_the_cpu(tmp_path: Path) -> None:
    """Preempted three times: twice the CPU came back from a hog, once from a kernel worker; the hog first,
    by time."""
    hog = 700
    b = trainer()
    b.offcpu(TRAINER, TRAINER, 11.0, 25.0, "R", held=(hog, hog, "hog"))
    b.offcpu(TRAINER, TRAINER, 25.5, 30.0, "R", held=(55, 55, "kworker/0:1"))
    b.offcpu(TRAINER, TRAINER, 30.5, 38.0, "R", held=(hog, hog + 1, "hog"))
    r = run(b, tmp_path)
    s = only_stall(r)
    assert s["cause"] == "cpu.runqueue" and s["culprit"]["pid"] == TRAINER
    assert s["culprit"]["cpu_held_by"] == [
        {"pid": hog, "tid": hog, "comm": "hog", "ns": ns(25) - ns(11)},
        {"pid": hog, "tid": hog + 1, "comm": "hog", "ns": ns(38) - ns(30.5)},
        {"pid": 55, "tid": 55, "comm": "kworker/0:1", "ns": ns(30) - ns(25.5)}]
    assert summary_lines(r)[-2] == "waiting for a CPU (30.0 ms): the CPU was held by pid 700 (hog) 83%, " \
                                   "pid 55 (kworker/0:1) 17%"  # by process
    text = "preempted; the CPU was held by pid 700 (hog) 54%, pid 700 (hog) thread 701 29%, pid 55 (kworker/0:1) 17%"
    assert describe(s).endswith(text), describe(s)
    assert stall_args(s, 1)["cpu_held_by"] == text.split("held by ")[1]


def test_a_woken_thread_waiting_for_a_cpu_names_who_had_it(tmp_path: Path) -> None:
    """Woken at 12 ms from a sleep, the trainer got its CPU back only at 38 ms, from a hog: the wait from the
    wakeup on is the run queue's, and the hog held the CPU (the sleep before it is not counted)."""
    b = trainer()
    b.syscall(TRAINER, TRAINER, "clock_nanosleep", 9.0, 38.5)
    b.offcpu(TRAINER, TRAINER, 9.0, 38.0, "S", 12.0, (0, 0, "[timer]"), held=(700, 700, "hog"))
    s = only_stall(run(b, tmp_path))
    assert (s["cause"], s["culprit"]["op"]) == ("cpu.runqueue", "woken, waiting for a CPU"), s
    assert s["culprit"]["cpu_held_by"] == [{"pid": 700, "tid": 700, "comm": "hog", "ns": ns(38) - ns(12)}]


def test_network_peer(tmp_path: Path) -> None:
    b = trainer().syscall(TRAINER, TRAINER, "recvfrom", 10.5, 39.5, "10.0.0.7:29500", 4096)
    b.offcpu(TRAINER, TRAINER, 10.6, 39.4, "S", 39.4, (0, 0, "swapper/0"))
    s = only_stall(run(b, tmp_path))
    assert (s["cause"], s["culprit"]["object"], s["culprit"]["pid"]) == ("network", "10.0.0.7:29500", TRAINER)


@pytest.mark.parametrize("call", ["poll", "pselect6"])
def test_a_poll_on_one_socket_is_a_wait_on_the_peer_even_when_it_timed_out(tmp_path: Path, call: str) -> None:
    """socket.settimeout(): the wait is a poll() of that socket (or a select() of it, on some paths), woken by
    the network (softirq) or by its own timeout in a retry loop; a poll of several fds names none and stays a
    wait for whoever wakes it."""
    b = trainer().syscall(TRAINER, TRAINER, call, 10.5, 25.0, "10.0.0.7:29500")
    b.offcpu(TRAINER, TRAINER, 10.6, 24.9, "S", 24.9, (0, 0, "swapper/0"))
    b.records[-2] = b.records[-2]._replace(ret=0)  # timed out: the peer sent nothing yet
    b.syscall(TRAINER, TRAINER, call, 25.0, 39.5, "10.0.0.7:29500")
    b.offcpu(TRAINER, TRAINER, 25.1, 39.4, "S", 39.4, (0, 0, "ksoftirqd/0"))
    s = only_stall(run(b, tmp_path))
    assert (s["cause"], s["culprit"]["object"], s["culprit"]["op"]) == ("network", "10.0.0.7:29500", call)
    assert s["breakdown"][0]["ns"] >= 28_000_000, s["breakdown"]  # both polls, the timed-out one too
    b = trainer().syscall(TRAINER, TRAINER, call, 10.5, 39.5)  # several fds, the ready one not known
    b.records[-1] = b.records[-1]._replace(ret=1)
    b.offcpu(TRAINER, TRAINER, 10.6, 39.4, "S", 39.4, (0, 0, "ksoftirqd/0"))
    assert only_stall(run(b, tmp_path))["cause"] == "unknown"


def _gil_wait(b: Builder, *running: int, ret: int = -110) -> Builder:
    """The trainer's GIL wait: a futex that timed out (woken by the timer); ``running`` threads of its process
    were switched in before it and out after it."""
    b.syscall(TRAINER, TRAINER, "futex", 10.5, 39.5)
    b.records[-1] = b.records[-1]._replace(ret=ret)
    b.offcpu(TRAINER, TRAINER, 10.6, 39.4, "S", 39.3, (0, 0, "[timer]"))
    for tid in running:
        b.thread(TRAINER, tid, "python")
        b.offcpu(TRAINER, tid, 5.0, 9.8, "S", 9.7, (0, 0, "swapper/0"))
        b.offcpu(TRAINER, tid, 39.8, 45.0, "S", 44.9, (0, 0, "swapper/0"))
    return b


def test_a_timed_out_gil_wait_is_the_running_thread_s(tmp_path: Path) -> None:
    """Python's GIL wait is a futex with a 5 ms timeout; the holder drops the lock when asked, too fast for a
    recorded wait. In a Python process, the one other thread that ran through the timed-out wait held it."""
    s = only_stall(run(_gil_wait(trainer(), TRAINER + 1), tmp_path))
    assert (s["cause"], s["culprit"]["tid"], s["via"]) == ("cpu", TRAINER + 1, [f"gil:tid {TRAINER + 1}"]), s
    assert describe(s) == f"pid {TRAINER} (python), thread {TRAINER + 1} cpu"  # the report names the thread
    # woken by its timeout's timer, though a wake that raced it made the call return 0: timed out all the same
    s = only_stall(run(_gil_wait(trainer(), TRAINER + 1, ret=0), tmp_path))
    assert (s["cause"], s["culprit"]["tid"]) == ("cpu", TRAINER + 1), s
    # preempted for a quarter of the wait, in the run queue: a holder that cannot run still holds the lock
    b = _gil_wait(trainer(), TRAINER + 1).offcpu(TRAINER, TRAINER + 1, 20.0, 27.0, "R")
    s = only_stall(run(b, tmp_path))
    assert (s["culprit"]["tid"], s["breakdown"][0]["cause"]) == (TRAINER + 1, "cpu"), s
    assert {b["cause"] for b in s["breakdown"]} == {"cpu", "cpu.runqueue"}, s["breakdown"]
    # blocked for a quarter of it: it let go of the lock, and may not have held it at all
    b = _gil_wait(trainer(), TRAINER + 1).offcpu(TRAINER, TRAINER + 1, 20.0, 27.0, "S", 26.9, (0, 0, "[timer]"))
    assert only_stall(run(b, tmp_path))["cause"] == "unknown"
    # not an interpreter with a global lock: a timed-out wait names nobody
    b = Builder().proc(TRAINER, "trainer").device(TRAINER)
    b.op(TRAINER, TRAINER, 0.0, 0.0, 10.0, "step_fwd")
    b.op(TRAINER, TRAINER, 39.95, 40.0, 50.0, "step_bwd")
    assert only_stall(run(_gil_wait(b, TRAINER + 1), tmp_path))["cause"] == "unknown"
    # two threads ran: either may have held it
    assert only_stall(run(_gil_wait(trainer(), TRAINER + 1, TRAINER + 2), tmp_path))["cause"] == "unknown"


def test_a_timed_out_gil_wait_whose_wakeup_was_not_recorded_is_still_the_holder_s(tmp_path: Path) -> None:
    """A kernel that runs no probe while certain tasks hold the CPU (a VM's guest agent) loses the wakeup of a
    sleep its timer ended then: the off-CPU span has no waker. The call timed out, so its timer woke it."""
    b = _gil_wait(trainer(), TRAINER + 1)
    i = next(i for i, r in enumerate(b.records) if isinstance(r, OffCpu) and r.tid == TRAINER)
    b.records[i] = b.records[i]._replace(wake_ns=0, waker_comm="")
    s = only_stall(run(b, tmp_path))
    assert (s["cause"], s["culprit"]["tid"], s["via"]) == ("cpu", TRAINER + 1, [f"gil:tid {TRAINER + 1}"]), s
    # a wait that did not time out (ret 0) with no waker says nothing about who ended it
    b = _gil_wait(trainer(), TRAINER + 1, ret=0)
    b.records[i] = b.records[i]._replace(wake_ns=0, waker_comm="")
    assert only_stall(run(b, tmp_path))["cause"] == "unknown"


def test_of_two_threads_that_could_hold_the_gil_the_one_another_waited_behind_is_the_holder(tmp_path: Path) -> None:
    """Two other threads were not blocked through the trainer's timed-out GIL wait, but one of them spent it
    preempted, waiting for the CPU the other had: the one that ran holds the lock (or ran without it)."""
    b = _gil_wait(trainer(), TRAINER + 1, TRAINER + 2)
    b.offcpu(TRAINER, TRAINER + 2, 10.8, 39.0, "R", held=(TRAINER, TRAINER + 1, "python"))
    s = only_stall(run(b, tmp_path))
    assert (s["culprit"]["tid"], s["via"][:1]) == (TRAINER + 1, [f"gil:tid {TRAINER + 1}"]), s
    # preempted by a task outside the two: either may have held it
    b = _gil_wait(trainer(), TRAINER + 1, TRAINER + 2)
    b.offcpu(TRAINER, TRAINER + 2, 10.8, 39.0, "R", held=(77, 77, "kworker/0:1"))
    assert only_stall(run(b, tmp_path))["cause"] == "unknown"
    # each waited behind the other for part of it only: either may have held it
    b = _gil_wait(trainer(), TRAINER + 1, TRAINER + 2)
    b.offcpu(TRAINER, TRAINER + 2, 10.8, 20.0, "R", held=(TRAINER, TRAINER + 1, "python"))
    b.offcpu(TRAINER, TRAINER + 1, 20.0, 30.0, "R", held=(TRAINER, TRAINER + 2, "python"))
    assert only_stall(run(b, tmp_path))["cause"] == "unknown"


def test_a_lock_several_threads_time_out_on_is_its_holder_s_before_a_later_hand_over(tmp_path: Path) -> None:
    """The trainer and another thread both time out waiting on one futex word (the GIL): the trainer's next
    wait, ended by a third thread that briefly took the lock in between, is a hand-over, not what the
    timed-out wait was for. The thread that ran through it holds the lock. A word only the trainer times
    out on (a queue's timed wait) keeps the rule that follows its next woken wait."""
    gil = 0x9A5B8F0

    def build(word: int) -> Builder:
        b = _gil_wait(trainer(), TRAINER + 1)
        b.records[-5] = b.records[-5]._replace(arg=word)  # the trainer's timed-out futex
        b.thread(TRAINER, TRAINER + 2, "python")  # another waiter, timed out on the same word earlier
        b.syscall(TRAINER, TRAINER + 2, "futex", 1.0, 6.0)
        b.records[-1] = b.records[-1]._replace(ret=-110, arg=gil)
        b.thread(TRAINER, TRAINER + 3, "python")  # takes the lock for a moment, then hands it to the trainer
        b.syscall(TRAINER, TRAINER, "futex", 39.6, 39.9)
        b.records[-1] = b.records[-1]._replace(arg=word)
        b.offcpu(TRAINER, TRAINER, 39.6, 39.85, "S", 39.8, (TRAINER, TRAINER + 3, "python"))
        return b

    s = only_stall(run(build(gil), tmp_path))
    assert (s["culprit"]["tid"], s["via"][:1]) == (TRAINER + 1, [f"gil:tid {TRAINER + 1}"]), s
    s = only_stall(run(build(0x7F0000001000), tmp_path))
    assert s["via"][:1] == [f"wait:pid {TRAINER}"], s


def test_the_culprit_is_the_thread_with_most_of_its_process_s_time(tmp_path: Path) -> None:
    """CPU time of one process sums to one cause; its culprit is the thread that holds most of it, not the
    one with the longest single part (the trainer's own 12 ms of work against 3 x 6 ms of a lock holder's)."""
    b = trainer()
    for at in (10.0, 18.0, 26.0):
        b.syscall(TRAINER, TRAINER, "futex", at + 0.5, at + 6.5)
        b.records[-1] = b.records[-1]._replace(ret=-110)
        b.offcpu(TRAINER, TRAINER, at + 0.6, at + 6.4, "S", at + 6.3, (0, 0, "[timer]"))
    b.thread(TRAINER, TRAINER + 1, "python")
    for a, z in ((5.0, 10.2), (16.8, 18.2), (24.8, 26.2), (32.8, 45.0)):
        b.offcpu(TRAINER, TRAINER + 1, a, z, "S", z - 0.1, (0, 0, "swapper/0"))
    s = only_stall(run(b, tmp_path))
    assert (s["cause"], s["culprit"]["tid"]) == ("cpu", TRAINER + 1), s
    assert s["breakdown"][0]["cause"] == "cpu" and s["breakdown"][0]["ns"] > 25_000_000, s["breakdown"]


def test_an_event_loop_wait_is_named_by_the_fd_it_found_ready(tmp_path: Path) -> None:
    """asyncio waits in epoll_wait: the first ready fd names the wait. A peer's socket makes it a network wait
    (woken by the network's softirq); a pipe or unix socket stays a wait for whoever wrote to it."""
    b = trainer().syscall(TRAINER, TRAINER, "epoll_wait", 10.5, 39.5, "10.0.0.7:29500")
    b.records[-1] = b.records[-1]._replace(ret=1)
    b.offcpu(TRAINER, TRAINER, 10.6, 39.4, "S", 39.4, (0, 0, "swapper/1"))
    s = only_stall(run(b, tmp_path))
    assert (s["cause"], s["culprit"]["object"], s["culprit"]["op"]) == ("network", "10.0.0.7:29500", "epoll_wait")
    b = trainer().syscall(TRAINER, TRAINER, "epoll_wait", 10.5, 39.5, "pipe:[77]")
    b.records[-1] = b.records[-1]._replace(ret=1)
    b.offcpu(TRAINER, TRAINER, 10.6, 39.4, "S", 39.4, (WORKER, WORKER, "worker"))
    b.syscall(WORKER, WORKER, "read", 10.0, 39.0, "/data/shard-3.bin")
    s = only_stall(run(b, tmp_path))
    assert (s["cause"], s["culprit"]["object"], s["via"]) == ("storage", "/data/shard-3.bin", [f"wait:pid {WORKER}"])


EPFD, FILE_FD, SOCK_FD = 3, 5, 7
PEER = "10.0.0.7:29500"
DATA_OK = 1 << 32  # a0 of an epoll event: a1 holds a data word (probes/ebpf/events.py EPOLL_DATA_OK)


def epoll_loop(b: Builder, ready: int, registered: int | None = None, created: bool = True) -> Builder:
    """A trainer waiting in epoll_wait on EPFD, ended by the peer (a softirq wakes it), whose first ready event
    carries the data word ``ready``. FILE_FD is a regular file, SOCK_FD the peer's socket; when ``created``
    the capture saw EPFD's epoll_create1, and the socket's registration with the word ``registered``."""
    b.fd(TRAINER, FILE_FD, PATH, "file").fd(TRAINER, SOCK_FD, PEER)
    if created:
        b.kernel_call(TRAINER, TRAINER, "epoll_create1", 1.0, 1.01, ret=EPFD)
    if registered is not None:  # EPOLL_CTL_ADD: arg is the fd | op << 32
        b.kernel_call(TRAINER, TRAINER, "epoll_ctl", 2.0, 2.01, 0, EPFD | DATA_OK, registered, SOCK_FD | 1 << 32)
    b.kernel_call(TRAINER, TRAINER, "epoll_wait", 10.5, 39.5, 1, EPFD | DATA_OK, ready, 1000)
    return b.offcpu(TRAINER, TRAINER, 10.6, 39.4, "S", 39.4, (0, 0, "[softirq]"))


def test_an_epoll_token_names_the_fd_registered_with_it_not_the_fd_of_its_number(tmp_path: Path) -> None:
    """mio/tokio register a token, not the fd: the socket's token here is the number of an open file's fd. The
    wait is the socket's (network, the peer), through the registration, never the file's."""
    s = only_stall(run(epoll_loop(trainer(), FILE_FD, FILE_FD), tmp_path))
    assert (s["cause"], s["culprit"]["object"], s["culprit"]["op"]) == ("network", PEER, "epoll_wait")
    big = 0x7F00_DEAD_0000_0000 | FILE_FD  # a pointer: its low half is no help either
    s = only_stall(run(epoll_loop(trainer(), big, big), tmp_path))
    assert (s["cause"], s["culprit"]["object"]) == ("network", PEER)


def test_an_epoll_data_word_no_registration_had_names_no_fd(tmp_path: Path) -> None:
    """A capture that traced epoll_ctl knows every registration made since it began, and the /proc snapshot
    those made before: a data word none of them has names no fd, rather than the fd of its number (here the
    peer's socket), and the wait stays unexplained (woken by an interrupt). So does a wait on an epoll fd the
    capture knows nothing of."""
    for b in (epoll_loop(trainer(), SOCK_FD, 0x66), epoll_loop(trainer(), SOCK_FD, created=False)):
        s = only_stall(run(b, tmp_path))
        assert (s["cause"], s["culprit"]["pid"], s["culprit"]["object"]) == ("unknown", 0, ""), s
    b = trainer().fd(TRAINER, EPFD, "anon_inode:[eventpoll]", "anon").epoll_entry(TRAINER, EPFD, SOCK_FD, 0x55)
    s = only_stall(run(epoll_loop(b, 0x55, created=False), tmp_path))  # registered before the capture: fdinfo
    assert (s["cause"], s["culprit"]["object"]) == ("network", PEER)


def test_an_epoll_data_word_is_taken_for_the_fd_where_the_capture_cannot_know_better(tmp_path: Path) -> None:
    """Captures of earlier versions (the kernel reported the data word's low half as the fd), and captures that
    did not trace epoll_ctl, name the fd of the data word's number, where asyncio, libuv and libev put it."""
    b = epoll_loop(trainer().ebpf(leave_out=("epoll_ctl",)), SOCK_FD, created=False)
    assert only_stall(run(b, tmp_path))["culprit"]["object"] == PEER
    b = trainer().ebpf(leave_out=("epoll_ctl",), flags={"epoll_wait": 0x1 | 0x2000})  # F_FD | F_EPOLLFD
    b.fd(TRAINER, SOCK_FD, PEER).kernel_call(TRAINER, TRAINER, "epoll_wait", 10.5, 39.5, 1, SOCK_FD, 0, 1000)
    b.offcpu(TRAINER, TRAINER, 10.6, 39.4, "S", 39.4, (0, 0, "[softirq]"))
    s = only_stall(run(b, tmp_path))
    assert (s["cause"], s["culprit"]["object"]) == ("network", PEER)


def test_a_wait_woken_before_the_stall_counts_only_its_run_queue_time_inside_it(tmp_path: Path) -> None:
    """Woken at 6 ms, on a CPU again at 12: of the stall [10, 40), 2 ms waiting for a CPU, not 6; the
    breakdown never adds up to more than the stall."""
    b = trainer().syscall(TRAINER, TRAINER, "futex", 5.0, 12.0)
    b.offcpu(TRAINER, TRAINER, 5.0, 12.0, "S", 6.0, (WORKER, WORKER, "pt_data_worker"))
    b.proc(WORKER, "pt_data_worker", TRAINER)
    s = only_stall(run(b, tmp_path))
    runq = sum(p["ns"] for p in s["breakdown"] if p["cause"] == "cpu.runqueue")
    assert runq == 2_000_000, s["breakdown"]
    assert sum(p["ns"] for p in s["breakdown"]) <= s["duration_ns"], s["breakdown"]


def test_sleep(tmp_path: Path) -> None:
    s = only_stall(run(trainer().syscall(TRAINER, TRAINER, "clock_nanosleep", 10.2, 39.8), tmp_path))
    assert s["cause"] == "sleep" and s["culprit"]["op"] == "clock_nanosleep"


def _parts(s: dict[str, Any]) -> dict[str, int]:
    return {p["cause"]: p["ns"] for p in s["breakdown"]}


# A completed time.sleep(0.01) as recorded on this kernel: clock_nanosleep with TIMER_ABSTIME, its timespec (``arg``)
# a CLOCK_MONOTONIC deadline (tests/test_ebpf_capture.py); usleep's and coreutils sleep's are durations
@pytest.mark.parametrize("deadline", ["absolute", "relative"])
def test_sleep_past_its_deadline_with_no_wakeup_recorded_is_a_wait_for_a_cpu(tmp_path: Path, deadline: str) -> None:
    """A sleep that lasted past its timer (plus the timer's own lateness) with no wakeup recorded (a switch back
    the kernel did not report): the time past it was a wait for a CPU, not the sleep's; the sleep is the stall's
    cause only up to its deadline."""
    arg = ns(20.2) if deadline == "absolute" else 10_000_000  # due at 20.2 ms either way
    b = trainer().syscall(TRAINER, TRAINER, "clock_nanosleep", 10.2, 39.8, arg=arg)
    b.offcpu(TRAINER, TRAINER, 10.25, 39.75, "S")
    s = only_stall(run(b, tmp_path))
    late = ns(39.75) - (ns(20.2) + 200_000)  # past the deadline and the timer's lateness
    assert (s["cause"], s["culprit"]["op"]) == ("cpu.runqueue", "woken, waiting for a CPU"), s
    assert _parts(s)["cpu.runqueue"] == late, s["breakdown"]
    assert _parts(s)["sleep"] == 29_600_000 - late, s["breakdown"]  # the call's time but that
    assert s["why"].startswith("clock_nanosleep returned 19.6 ms past its deadline"), s
    assert s["evidence"][0]["what"] == "clock_nanosleep", s["evidence"]


def test_sleep_that_returned_long_after_its_wakeup_with_no_switch_recorded_waited_for_a_cpu(tmp_path: Path) -> None:
    """As recorded beside two CPU hogs (the ``gil`` scenario): time.sleep's timer woke the thread 0.9 ms late, then
    the call returned 28 ms later with no off-CPU record in between (a switch the kernel did not report, or the
    virtual CPU held by the host). Back from its sleep a thread only returns: that time was a wait for a CPU,
    not the sleep's (it was named ``sleep``, a wrong culprit, before)."""
    b = trainer().syscall(TRAINER, TRAINER, "clock_nanosleep", 5.0, 38.0, arg=ns(10.0))
    b.offcpu(TRAINER, TRAINER, 5.0, 10.9, "S", 10.9, (0, 0, "[timer]"))
    s = only_stall(run(b, tmp_path))
    assert (s["cause"], s["culprit"]["op"]) == ("cpu.runqueue", "woken, waiting for a CPU"), s
    assert _parts(s)["cpu.runqueue"] == ns(38.0) - ns(10.9), s["breakdown"]  # the S span's time is the sleep's
    assert _parts(s)["sleep"] == ns(10.9) - ns(10.0), s["breakdown"]
    assert "28.0 ms past its deadline" in s["why"] and s["evidence"][0]["what"] == "clock_nanosleep", s


@pytest.mark.parametrize("timeout_ms", [10, 0, 30])
def test_poll_that_timed_out_long_after_its_timeout_waited_for_a_cpu_past_it(tmp_path: Path, timeout_ms: int) -> None:
    """An event loop's timed-out epoll_wait (an ``asyncio.sleep``) with its timeout (``arg``, ms) recorded, asleep
    past it with no wakeup recorded: woken when due (its timeout and the timer's slack), the rest a wait for a
    CPU. A timeout not recorded (0), or not reached by its span's end, leaves the whole a timed-out wait."""
    b = trainer().syscall(TRAINER, TRAINER, "epoll_wait", 10.2, 39.8, arg=timeout_ms)
    b.offcpu(TRAINER, TRAINER, 10.25, 39.75, "S")
    s = only_stall(run(b, tmp_path))
    if timeout_ms != 10:
        assert (s["cause"], s["culprit"]["op"]) == ("sleep", "epoll_wait") and "cpu.runqueue" not in _parts(s), s
        return
    late = ns(39.75) - (ns(20.2) + 200_000)
    assert (s["cause"], s["culprit"]["op"]) == ("cpu.runqueue", "woken, waiting for a CPU"), s
    assert _parts(s)["cpu.runqueue"] == late and _parts(s)["sleep"] == ns(20.4) - ns(10.25), s["breakdown"]
    assert s["why"] == ("epoll_wait returned 19.6 ms past its deadline, no wakeup recorded: the time past it is "
                        "taken as a wait for a CPU, not the wait"), s


@pytest.mark.parametrize(("arg", "ret", "wake"), [
    (0, 0, None),  # no time asked (a record without it)
    (ns(20.2), -4, None),  # cut short by a signal (EINTR): never reached its deadline
    (1_700_000_000_000_000_000, 0, None),  # a CLOCK_REALTIME deadline: on no clock the records are on
    (39_000_000, 0, None),  # due after the call ended: neither reading fits its times
    (ns(39.9), 0, None),  # the same for a deadline
    (ns(20.2), 0, 39.7),  # its wakeup recorded at 39.7: the late part is that wakeup's
])
def test_sleep_whose_deadline_is_not_known_is_the_sleeps(tmp_path: Path, arg: int, ret: int,
                                                          wake: float | None) -> None:
    b = trainer().syscall(TRAINER, TRAINER, "clock_nanosleep", 10.2, 39.8, arg=arg)
    b.records[-1] = b.records[-1]._replace(ret=ret)
    b.offcpu(TRAINER, TRAINER, 10.25, 39.75, "S", wake, (0, 0, "[timer]") if wake else (0, 0, ""))
    s = only_stall(run(b, tmp_path))
    assert (s["cause"], s["culprit"]["op"]) == ("sleep", "clock_nanosleep"), s
    assert _parts(s).get("cpu.runqueue", 0) == (ns(39.75) - ns(39.7) if wake else 0), s["breakdown"]


@pytest.mark.parametrize("seen", [False, True])
def test_sync_past_its_devices_end_with_no_off_cpu_record_is_unknown(tmp_path: Path, seen: bool) -> None:
    """A sync whose device had finished (at 10 ms), its thread shown by no off-CPU record after that (a switch the
    kernel did not report; the ``gil`` scenario beside a CPU hog, its trainer's interpreter-lock waits inside the
    simulated device's sync): not the device's, and nothing says whose: ``unknown``, never ``sync`` (it was). Seen
    off CPU and woken from an interrupt (the driver), it stays ``sync``."""
    b = trainer().sync(TRAINER, TRAINER, 10.2, 39.8).syscall(TRAINER, TRAINER, "futex", 10.2, 39.8)
    if seen:
        b.offcpu(TRAINER, TRAINER, 10.25, 39.75, "S", 39.7, (0, 0, ""))
    s = only_stall(run(b, tmp_path))
    if seen:
        assert s["cause"] == "sync" and s["culprit"]["pid"] == TRAINER, s
        return
    assert s["cause"] == "unknown" and s["why"].startswith("the GPU had finished: no off-CPU record"), s
    assert _parts(s)["unknown"] == ns(39.8) - ns(10.2) and s["evidence"][0]["what"] == "futex", s


def test_gpu_sync_is_not_followed_to_the_device_thread(tmp_path: Path) -> None:
    b = trainer().sync(TRAINER, TRAINER, 10.1, 39.0).syscall(TRAINER, TRAINER, "futex", 10.1, 39.0)
    b.op(TRAINER, TRAINER, 5.0, 5.0, 39.0, "on_device_1", dev=1)  # what the sync waited for
    b.offcpu(TRAINER, TRAINER, 10.1, 39.0, "S", 39.0, (TRAINER, TRAINER + 1, "sim-device"))
    s = only_stall(run(b, tmp_path))
    assert s["cause"] == "sync" and s["culprit"]["pid"] == TRAINER


def test_sync_woken_late_by_a_starved_device_thread_is_that_threads_run_queue(tmp_path: Path) -> None:
    # The device finished at 10; its stream thread (traced, same process) waited for a CPU until 36 and
    # only then woke the synchronizing trainer: the wait past 10 is for that thread, not for the device.
    stream = TRAINER + 1
    b = trainer().thread(TRAINER, stream, "sim-gpu0-s1")
    b.sync(TRAINER, TRAINER, 8.0, 38.0).syscall(TRAINER, TRAINER, "futex", 8.0, 38.0)
    b.offcpu(TRAINER, TRAINER, 8.0, 38.0, "S", 36.5, (TRAINER, stream, "sim-gpu0-s1"))
    b.offcpu(TRAINER, stream, 9.0, 36.0, "R")
    s = only_stall(run(b, tmp_path))
    assert s["cause"] == "cpu.runqueue" and s["culprit"]["tid"] == stream, s
    assert s["via"] == [f"wait:pid {TRAINER}"]
    # The same wake while another device of the process was still running: the wait is for that device.
    b.op(TRAINER, TRAINER, 0.0, 5.0, 36.4, "other_device", dev=1)
    r = run(b, tmp_path)
    assert next(s for s in r["stalls"] if s["device"] == 0)["cause"] == "sync"


def test_sync_woken_late_by_a_device_thread_blocked_for_no_known_reason_is_unknown(tmp_path: Path) -> None:
    # The device finished at 10; its stream thread then sat in a call nothing interprets (an ioctl woken by an
    # interrupt) until 36 and only then woke the trainer: the wait past 10 was not the GPU's (it was done), and
    # the chain cannot say whose it was: unknown, never sync. (The gil scenario beside a CPU hog: the stream
    # thread's wait for the interpreter's lock, two threads that could have held it.)
    stream = TRAINER + 1
    b = trainer().thread(TRAINER, stream, "sim-gpu0-s1")
    b.sync(TRAINER, TRAINER, 8.0, 38.0).syscall(TRAINER, TRAINER, "futex", 8.0, 38.0)
    b.offcpu(TRAINER, TRAINER, 8.0, 38.0, "S", 36.5, (TRAINER, stream, "sim-gpu0-s1"))
    b.syscall(TRAINER, stream, "ioctl", 9.0, 36.0, "/dev/other")
    b.offcpu(TRAINER, stream, 9.0, 36.0, "S", 35.9, (0, 0, "[irq]"))
    s = only_stall(run(b, tmp_path))
    parts = {p["cause"]: p["ns"] for p in s["breakdown"]}
    assert s["cause"] == "unknown" and s["via"] == [f"wait:pid {TRAINER}"], s
    assert parts["unknown"] == ns(35.9) - ns(10) and "sync" not in parts, parts


def test_sync_timed_out_on_a_lock_once_the_device_was_done_names_its_holder_or_nobody(tmp_path: Path) -> None:
    # The device finished at 10; the synchronizing trainer's futex then timed out (the interpreter's lock,
    # held by another thread): the one thread that ran through it held it; of two, nobody is named, and the
    # time is unknown with why, never sync.
    from gputrace.analysis.explain import LOCK_HOLDER_WHY

    s = only_stall(run(_gil_wait(trainer().sync(TRAINER, TRAINER, 10.5, 39.5), TRAINER + 1), tmp_path))
    assert (s["cause"], s["via"]) == ("cpu", [f"gil:tid {TRAINER + 1}"]), s
    s = only_stall(run(_gil_wait(trainer().sync(TRAINER, TRAINER, 10.5, 39.5), TRAINER + 1, TRAINER + 2), tmp_path))
    parts = {p["cause"]: p["ns"] for p in s["breakdown"]}
    assert (s["cause"], s["why"]) == ("unknown", LOCK_HOLDER_WHY), s
    assert parts["unknown"] >= ns(39.3) - ns(10.6) and parts.get("sync", 0) < 1_000_000, parts


def test_sync_api_call_without_a_sync_record_is_sync(tmp_path: Path) -> None:
    from gputrace.records import CudaApi

    b = trainer().syscall(TRAINER, TRAINER, "ioctl", 10.1, 39.0, "/dev/other")
    b.offcpu(TRAINER, TRAINER, 10.1, 39.0, "S", 39.0, (0, 0, "[irq]"))
    b.records.append(CudaApi(TRAINER, TRAINER, "cuCtxSynchronize", ns(10.05), ns(39.1), 999, "enqueue-only", 0))
    s = only_stall(run(b, tmp_path))
    assert s["cause"] == "sync" and s["culprit"]["pid"] == TRAINER


def test_fuse_read_names_the_filesystem_and_its_server(tmp_path: Path) -> None:
    b = trainer()
    b.syscall(TRAINER, TRAINER, "read", 10.5, 39.5, "/mnt/slowfs/x.bin", 65536)
    b.offcpu(TRAINER, TRAINER, 10.6, 39.4, "S", 39.3, (555, 556, "slowfs"))
    s = only_stall(run(b, tmp_path, header={"mounts": [["/", "ext4"]]}))  # mounted after the capture began
    assert s["cause"] == "storage" and s["culprit"]["object"] == "/mnt/slowfs/x.bin"
    assert s["culprit"]["filesystem"] == "fuse" and s["culprit"]["served_by"]["pid"] == 555
    hdr = {"mounts": [["/", "ext4"], ["/mnt/slowfs", "fuse.slowfs"]]}
    s = only_stall(run(b, tmp_path, header=hdr))
    assert s["culprit"]["filesystem"] == "fuse.slowfs" and s["remote_fs"] is True


def test_device_dependency(tmp_path: Path) -> None:
    s = only_stall(run(trainer(launch_at=5.0), tmp_path))
    assert s["cause"] == "device" and s["culprit"]["object"] == "step_bwd"


def test_launch_latency(tmp_path: Path) -> None:
    s = only_stall(run(trainer(launch_at=12.0), tmp_path))
    assert s["cause"] == "launch"


def test_collective_names_the_late_rank(tmp_path: Path) -> None:
    b = Builder().proc(TRAINER, "rank0").proc(WORKER2, "rank1").device(TRAINER).device(WORKER2)
    for pid in (TRAINER, WORKER2):
        b.op(pid, pid, 0.0, 0.0, 10.0, "fwd")
    c0 = b.op(TRAINER, TRAINER, 9.0, 10.0, 45.0, "ncclDevKernel_AllReduce_Sum_f32")
    b.syscall(WORKER2, WORKER2, "pread64", 10.5, 39.5, "/data/rank1.bin", 1 << 20)
    c1 = b.op(WORKER2, WORKER2, 39.9, 40.0, 45.0, "ncclDevKernel_AllReduce_Sum_f32")
    b.collective(TRAINER, c0, "allreduce", 1, 0, 2).collective(WORKER2, c1, "allreduce", 1, 1, 2)
    r = run(b, tmp_path)
    by_dev = {s["device_pid"]: s for s in r["stalls"]}
    assert len(r["stalls"]) == 2
    waiting, late = by_dev[TRAINER], by_dev[WORKER2]
    assert waiting["cause"] == "collective" and waiting["culprit"]["pid"] == WORKER2
    assert waiting["culprit"]["object"] == "allreduce #1" and waiting["culprit"]["rank"] == 1
    assert (waiting["start_ns"], waiting["end_ns"]) == (ns(10), ns(40))
    assert waiting["late_rank_cause"]["cause"] == "storage"
    assert late["cause"] == "storage" and late["culprit"]["object"] == "/data/rank1.bin"
    dev0 = next(d for d in r["devices"] if d["pid"] == TRAINER)
    assert dev0["collective_wait_ns"] == ns(40) - ns(10)


def test_collective_by_kernel_name_alone(tmp_path: Path) -> None:
    b = Builder().proc(TRAINER, "rank0").proc(WORKER2, "rank1").device(TRAINER).device(WORKER2)
    for pid in (TRAINER, WORKER2):
        b.op(pid, pid, 0.0, 0.0, 10.0, "fwd")
    b.op(TRAINER, TRAINER, 9.0, 10.0, 45.0, "ncclKernel_AllReduce")
    b.op(WORKER2, WORKER2, 29.9, 30.0, 45.0, "ncclKernel_AllReduce")
    r = run(b, tmp_path)
    waiting = next(s for s in r["stalls"] if s["device_pid"] == TRAINER)
    assert waiting["cause"] == "collective" and waiting["culprit"]["pid"] == WORKER2


def test_untraced_waker_is_unknown_with_an_empty_culprit(tmp_path: Path) -> None:
    b = trainer().syscall(TRAINER, TRAINER, "futex", 9.0, 39.9)
    b.offcpu(TRAINER, TRAINER, 9.0, 39.85, "S", 39.8, (999, 999, "mystery"))
    s = only_stall(run(b, tmp_path))
    assert s["cause"] == "unknown" and s["culprit"]["pid"] == 0 and s["culprit"]["object"] == ""
    assert s["via"] == ["wait:pid 999"]


def test_no_kernel_source_means_unknown_not_cpu(tmp_path: Path) -> None:
    s = only_stall(run(trainer(), tmp_path))  # GPU records only: nothing says what the host did
    assert s["cause"] == "unknown" and s["culprit"] == {"pid": 0, "tid": 0, "comm": "", "op": "", "object": "",
                                                         "bytes": 0, "duration_ns": 0, "host": s["host"]}


def test_stalls_overlapping_losses_say_so(tmp_path: Path) -> None:
    b = trainer().syscall(TRAINER, TRAINER, "write", 1, 1.5, "/dev/null")
    b.op(TRAINER, TRAINER, 59.9, 60.0, 70.0, "later")  # second stall [50, 60)
    b.drops(5, "ebpf", "ringbuf", 0).drops(25, "ebpf", "ringbuf", 7).drops(65, "ebpf", "ringbuf", 7)
    r = run(b, tmp_path, drops={"ebpf.ringbuf": 7})
    first, second = r["stalls"]
    assert first["overlaps_drops"] is True and second["overlaps_drops"] is False
    assert r["capture"]["drops"]["ebpf.ringbuf"] == 7
    assert any("LOST 7" in line for line in summary_lines(r))


def test_untimed_trailer_losses_mark_every_stall(tmp_path: Path) -> None:
    r = run(trainer(), tmp_path, drops={"agent.queue": 3})
    assert only_stall(r)["overlaps_drops"] is True


def test_truncated_capture_is_analysed_up_to_the_cut(tmp_path: Path) -> None:
    b = trainer().syscall(TRAINER, TRAINER, "clock_nanosleep", 10.2, 39.8)
    r = run(b, tmp_path, complete=False)
    assert r["capture"]["complete"] is False and "cut off" in r["capture"]["problem"]
    s = only_stall(r)
    assert s["cause"] == "sleep" and s["overlaps_drops"] is True
    assert summary_lines(r)[0].startswith("INCOMPLETE")


def test_no_gpu_activity(tmp_path: Path) -> None:
    b = Builder().proc(TRAINER, "python").syscall(TRAINER, TRAINER, "read", 1, 2, PATH, 10)
    r = run(b, tmp_path)
    assert r["devices"] == [] and r["stalls"] == [] and r["summary"]["stall_ns"] == 0
    assert r["capture"]["records"] == {"ProcInfo": 1, "Syscall": 1}
    assert summary_lines(r) == ["no GPU activity in this capture"]


def test_breakdown_keeps_the_minor_causes(tmp_path: Path) -> None:
    b = trainer().syscall(TRAINER, TRAINER, "clock_nanosleep", 10.0, 30.0)
    b.offcpu(TRAINER, TRAINER, 31.0, 36.0, "R")
    s = only_stall(run(b, tmp_path))
    assert s["cause"] == "sleep"
    causes = {p["cause"] for p in s["breakdown"]}
    assert causes == {"sleep", "cpu.runqueue", "cpu"}
    assert sum(p["ns"] for p in s["breakdown"]) == ns(39.95) - ns(10)


@pytest.mark.parametrize("bad", [0, -5])
def test_min_gap_must_be_positive(tmp_path: Path, bad: int) -> None:
    with pytest.raises(ValueError):
        run(trainer(), tmp_path, min_gap_ns=bad)


def test_malformed_records_are_counted_and_skipped(tmp_path: Path) -> None:
    from gputrace.capture import CaptureWriter, host_header

    path = trainer().syscall(TRAINER, TRAINER, "clock_nanosleep", 10.2, 39.8).write(tmp_path / "ok.gputrace")
    w = CaptureWriter(tmp_path / "bad.gputrace", host_header(["t"]), force=True)
    with open_capture(path) as reader:
        w.write(list(reader.records()))
    w.write_rows("Syscall", [[TRAINER, TRAINER, "read", "soon", ns(20), 0, 3, "/x", 0, 0],
                             [TRAINER, TRAINER, ["read"], ns(20), ns(21), 0, 3, "/x", 0, 0]])
    w.write_rows("GpuKernel", [[TRAINER, 0, 1, 7, None, ns(60), 99, "k", [1, 1, 1], [1, 1, 1]]])
    w.write_rows("NvmlSample", [[ns(1), 0, "gpu_util_pct", "high"]])
    bad = w.close({"end_ns": ns(60), "drops": {}})
    with open_capture(bad) as reader:
        r = analyze(reader)
    # 4: the NVML sample's value too, a string where a number belongs (the reader checks every kind)
    assert r["capture"]["malformed_records"] == 4
    assert only_stall(r)["cause"] == "sleep"
    assert "SKIPPED 4 malformed records" in summary_lines(r)


def test_single_rank_collective_wait_is_measured_against_its_fastest_run(tmp_path: Path) -> None:
    b = Builder().proc(TRAINER, "rank0").device(TRAINER)
    b.op(TRAINER, TRAINER, 0.0, 0.0, 10.0, "fwd")
    c1 = b.op(TRAINER, TRAINER, 9.0, 10.0, 12.0, "ncclDevKernel_AllReduce")  # 2 ms: the transfer
    c2 = b.op(TRAINER, TRAINER, 11.0, 12.0, 40.0, "ncclDevKernel_AllReduce")  # waited 26 ms for a peer
    b.op(TRAINER, TRAINER, 39.0, 40.0, 45.0, "next")
    b.collective(TRAINER, c1, "allreduce", 1, 0, 8).collective(TRAINER, c2, "allreduce", 2, 0, 8)
    s = only_stall(run(b, tmp_path))
    assert (s["cause"], s["culprit"]["pid"], s["culprit"]["object"]) == ("collective", 0, "allreduce #2")
    assert (s["start_ns"], s["end_ns"]) == (ns(12), ns(38))


def test_elementwise_broadcast_kernels_are_not_collectives(tmp_path: Path) -> None:
    b = Builder().proc(TRAINER, "python").device(TRAINER).offcpu(TRAINER, TRAINER, 1, 2, "R")
    b.op(TRAINER, TRAINER, 0.0, 0.0, 2.0, "broadcast_add_kernel")
    b.op(TRAINER, TRAINER, 0.0, 2.0, 40.0, "broadcast_add_kernel")
    assert run(b, tmp_path)["stalls"] == []


def test_page_fault_on_a_mapped_file_is_storage(tmp_path: Path) -> None:
    """The trainer reads a shard through a mapping: two waits in one fault make one storage stall on the file,
    with the block requests it submitted inside and what they read as its bytes."""
    b = trainer()
    b.fault(TRAINER, TRAINER, 10.5, 10.6, 25.0, PATH, offset=8192)
    b.fault(TRAINER, TRAINER, 10.5, 25.2, 39.5, PATH, offset=8192)  # the same fault, waiting again
    b.block(TRAINER, TRAINER, 10.55, 24.9, 128 << 10).block(TRAINER, TRAINER, 25.3, 39.4, 64 << 10)
    s = only_stall(run(b, tmp_path))
    assert s["cause"] == "storage" and s["via"] == []
    c = s["culprit"]
    assert (c["op"], c["object"], c["offset"], c["pid"]) == ("page_fault", PATH, 8192, TRAINER)
    assert c["bytes"] == 192 << 10 and c["block_requests"] == 2 and c["block_attribution"] == "submitted"
    assert c["duration_ns"] == ns(39.5) - ns(10.5)
    fault_ev = [e for e in s["evidence"] if e["what"].startswith("page fault on ")]
    assert [(e["kind"], e["start_ns"]) for e in fault_ev] == [("offcpu", ns(10.5))]
    # the stall's time: storage, but for the bits where the trainer ran or was woken and waited for a CPU
    by_cause = run(b, tmp_path)["summary"]["by_cause"]
    assert by_cause["storage"] >= 0.9 * (ns(40) - ns(10)), by_cause


def test_page_fault_through_a_worker_and_an_unnamed_file(tmp_path: Path) -> None:
    """A worker's fault on a file whose path was not found: storage, named by inode and device."""
    b = trainer()
    b.syscall(TRAINER, TRAINER, "futex", 9.0, 39.9).offcpu(TRAINER, TRAINER, 9.0, 39.85, "S", 39.8,
                                                           (WORKER, WORKER, "pt_data_worker"))
    b.proc(WORKER, "pt_data_worker", TRAINER).fault(WORKER, WORKER, 12.0, 12.1, 39.7, "", dev="7:3", ino=77)
    s = only_stall(run(b, tmp_path, header={}))
    assert s["cause"] == "storage" and s["via"] == [f"wait:pid {WORKER}"]
    c = s["culprit"]
    assert (c["pid"], c["op"], c["object"]) == (WORKER, "page_fault", "inode 77 on 7:3")


def test_probes_the_kernel_skipped_are_reported_apart_from_drops(tmp_path: Path) -> None:
    skipped = {"ebpf.sched_waking": 8, "ebpf.hrtimer_expire_entry": 2, "sampler.on_sample": 0}
    r = run(trainer(), tmp_path, trailer={"skipped": skipped})
    assert r["capture"]["skipped_probes"] == {"ebpf.sched_waking": 8, "ebpf.hrtimer_expire_entry": 2}
    assert r["capture"]["complete"] is True and not any(r["capture"]["drops"].values())
    line = next(x for x in summary_lines(r) if "skipped" in x)
    assert "skipped 10 probe runs" in line and "(ebpf.sched_waking=8, ebpf.hrtimer_expire_entry=2)" in line
    assert "skipped_probes" not in run(trainer(), tmp_path)["capture"]
    # switches back the kernel did not report: their own note, not the nested runs' (whose count leaves them out)
    skipped = {"ebpf.sched_waking": 8, "ebpf.sched_switch.unreported": 5, "ebpf.sched_switch.unreported_lost": 2}
    lines = summary_lines(run(trainer(), tmp_path, trailer={"skipped": skipped}))
    assert any("skipped 8 probe runs" in x and "unreported" not in x for x in lines), lines
    line = next(x for x in lines if "did not report" in x)
    assert "did not report 5 switches of traced threads" in line
    assert "; 2 with none of these (preempted, switched away again before a tick) are missing" in line
    lines = summary_lines(run(trainer(), tmp_path, trailer={"skipped": {"ebpf.sched_switch.unreported": 1}}))
    assert not any("skipped" in x or "missing" in x for x in lines), lines
    assert any("did not report 1 switch of" in x for x in lines), lines

