"""Wait chains through many round trips, the GIL's possible holders, and the tracing's own time, on small
synthetic captures (gputrace.testing.synth): records in, expected stalls out."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gputrace.analysis import analyze
from gputrace.capture import open_capture
from gputrace.records import AgentThread
from gputrace.testing.synth import Builder, ns

TRAINER, WORKER = 100, 200
FEEDER, SHARER = WORKER + 1, WORKER + 2  # the worker's queue feeder and resource-sharer threads


def stall_of(b: Builder, tmp_path: Path) -> dict[str, Any]:
    path = b.write(tmp_path / "t.gputrace")
    with open_capture(path) as reader:
        stalls = analyze(reader)["stalls"]
    assert len(stalls) == 1, stalls
    return stalls[0]


def trainer(stall_to: float = 40.0) -> Builder:
    """A Python trainer with one kernel before and one after a stall [10, stall_to)."""
    b = Builder().proc(TRAINER, "python").device(TRAINER)
    b.op(TRAINER, TRAINER, 0.0, 0.0, 10.0, "step_fwd")
    b.op(TRAINER, TRAINER, stall_to - 0.05, stall_to, stall_to + 10, "step_bwd")
    return b


def resource_sharer(round_trips: int) -> Builder:
    """The trainer waits for a batch on the loader's queue (a pipe its worker's feeder thread writes once the
    worker's main thread, on CPU until 19.8 ms, put the batch), then fetches the batch's tensors' fds from the
    worker's resource-sharer thread: ``round_trips`` requests of 0.3 ms, each answered after 0.2 ms of that
    thread's work."""
    end = 20.0 + 0.3 * round_trips + 0.5
    b = trainer(end).proc(WORKER, "python", TRAINER)
    b.thread(WORKER, FEEDER, "python").thread(WORKER, SHARER, "python")
    b.syscall(TRAINER, TRAINER, "poll", 10.0, 20.0, "pipe:[7]")
    b.offcpu(TRAINER, TRAINER, 10.05, 19.95, "S", 19.9, (WORKER, FEEDER, "python"))
    b.syscall(WORKER, FEEDER, "futex", 9.0, 19.85)
    b.offcpu(WORKER, FEEDER, 9.0, 19.85, "S", 19.8, (WORKER, WORKER, "python"))
    asked = 9.0  # the sharer waits for the next request from here
    for k in range(round_trips):
        t = 20.0 + 0.3 * k
        b.syscall(TRAINER, TRAINER, "recvmsg", t, t + 0.25, "unix:/rs")
        b.offcpu(TRAINER, TRAINER, t + 0.01, t + 0.22, "S", t + 0.2, (WORKER, SHARER, "python"))
        b.syscall(WORKER, SHARER, "recvmsg", asked, t - 0.001, "unix:/rs")  # the request, sent just before t
        b.offcpu(WORKER, SHARER, asked, t - 0.003, "S", t - 0.005, (TRAINER, TRAINER, "python"))
        asked = t + 0.21
    return b


def test_a_hand_over_of_any_number_of_round_trips_reaches_the_worker_s_own_work(tmp_path: Path) -> None:
    """Each tensor's fd is fetched in several round trips with the worker's resource-sharer thread: walked
    as hops, 30 of them would end the chain long before the worker's main thread, whose CPU time the batch
    waited for. Walked as a loop at the trainer, each answer is the sharer's and the first wait the worker's."""
    for round_trips in (3, 30):
        s = stall_of(resource_sharer(round_trips), tmp_path)
        assert (s["cause"], s["culprit"]["pid"], s["culprit"]["tid"]) == ("cpu", WORKER, WORKER), s
        assert s["via"] == [f"wait:pid {WORKER}", f"wait:tid {WORKER}"], s["via"]
        causes = {(p["cause"], p["pid"]): p["ns"] for p in s["breakdown"]}
        assert "unknown" not in {c for c, _ in causes}, s["breakdown"]
        assert causes[("cpu", WORKER)] >= 0.9 * (ns(19.9) - ns(10) + round_trips * (ns(0.2) - ns(0))), causes


def gil_wait(b: Builder, *running: tuple[int, str]) -> Builder:
    """The trainer's GIL wait: a futex that timed out; each of ``running`` (tid, comm) threads of its
    process switched in before it and out after it."""
    b.syscall(TRAINER, TRAINER, "futex", 10.5, 39.5)
    b.records[-1] = b.records[-1]._replace(ret=-110, arg=0x9A5B8F0)
    b.offcpu(TRAINER, TRAINER, 10.6, 39.4, "S", 39.3, (0, 0, "[timer]"))
    for tid, comm in running:
        b.thread(TRAINER, tid, comm)
        b.offcpu(TRAINER, tid, 5.0, 9.8, "S", 9.7, (0, 0, "swapper/0"))
        b.offcpu(TRAINER, tid, 39.8, 45.0, "S", 44.9, (0, 0, "swapper/0"))
    return b


def test_the_gil_holder_is_never_a_thread_that_does_not_run_python(tmp_path: Path) -> None:
    """A native library's thread (CUDA's event handler, named by CUDA; one sampled only in libcuda) ran
    through the trainer's timed-out GIL wait beside a Python thread: the Python thread held the GIL. With
    the native thread alone running, nobody is named: it cannot have held the lock."""
    native, python = TRAINER + 1, TRAINER + 2
    s = stall_of(gil_wait(trainer(), (native, "cuda-EvtHandlr"), (python, "python")), tmp_path)
    assert (s["cause"], s["culprit"]["tid"], s["via"]) == ("cpu", python, [f"gil:tid {python}"]), s
    assert stall_of(gil_wait(trainer(), (native, "cuda-EvtHandlr")), tmp_path)["cause"] == "unknown"
    b = gil_wait(trainer(), (native, "python"), (python, "python"))
    b.samples(TRAINER, native, 11.0, 39.0, ["[unknown] (libcuda.so.1)", "start_thread (libc.so.6)"])
    b.samples(TRAINER, python, 11.0, 39.0, ["[unknown]", "_PyEval_EvalFrameDefault (python3.11)"], every_ms=5)
    s = stall_of(b, tmp_path)
    assert (s["cause"], s["culprit"]["tid"]) == ("cpu", python), s
    # a thread that took the GIL in the capture (it woke the trainer out of a wait on the same word) holds
    # it though it was sampled only outside the interpreter
    b = gil_wait(trainer(), (native, "python"))
    b.samples(TRAINER, native, 11.0, 39.0, ["at::native::add (libtorch_cpu.so)"])
    b.syscall(TRAINER, TRAINER, "futex", 1.0, 2.0)
    b.records[-1] = b.records[-1]._replace(arg=0x9A5B8F0)
    b.offcpu(TRAINER, TRAINER, 1.0, 2.0, "S", 1.9, (TRAINER, native, "python"))
    assert stall_of(b, tmp_path)["culprit"]["tid"] == native


def test_time_the_agent_takes_from_the_job_is_the_tracing_s(tmp_path: Path) -> None:
    """The agent's CUPTI conversion held the trainer's GIL through its timed-out wait, and the agent's I/O
    thread ended a wait of the trainer's: both are gputrace's own time, named as such, never the job's."""
    agent = TRAINER + 7
    b = gil_wait(trainer(), (agent, "python"))
    b.records.append(AgentThread(ns(0), TRAINER, agent, "cupti-convert"))
    s = stall_of(b, tmp_path)
    c = s["culprit"]
    assert (s["cause"], c["pid"], c["tid"], c["object"]) == ("tracing", TRAINER, agent,
                                                               "gputrace agent: CUPTI conversion"), s
    assert s["via"] == [f"gil:tid {agent}"], s
    b = trainer().thread(TRAINER, agent, "python")
    b.records.append(AgentThread(ns(0), TRAINER, agent, "io"))
    b.syscall(TRAINER, TRAINER, "futex", 10.5, 39.5)
    b.offcpu(TRAINER, TRAINER, 10.6, 39.4, "S", 39.3, (TRAINER, agent, "python"))
    s = stall_of(b, tmp_path)
    assert (s["cause"], s["culprit"]["tid"], s["culprit"]["object"]) == ("tracing", agent,
                                                                         "gputrace agent: record flush"), s


def test_a_wait_with_no_off_cpu_record_is_unknown_and_says_why(tmp_path: Path) -> None:
    """The trainer's 29 ms poll on the loader's pipe, with no off-CPU record in it (the scheduler hooks now and
    then see neither the wakeup nor the switch back in: docs/probes.md): who ended the wait is not known, and
    the stall says why, as a CI log shows it, instead of a bare `unknown`."""
    b = trainer().syscall(TRAINER, TRAINER, "poll", 10.5, 39.5, "pipe:[7]")
    s = stall_of(b, tmp_path)
    assert (s["cause"], s.get("why")) == ("unknown", "no off-CPU record of this wait: who ended it is not known"), s


def test_a_wait_chain_cut_at_its_depth_says_why(tmp_path: Path) -> None:
    """Ten threads, each waiting on a futex of its own for the next one's wakeup: the chain is followed 8 hops
    deep, and the time past them says so (seen on train_torch_slow_pinned: the pin-memory thread, a worker's
    resource sharer, its feeder and main thread, the trainer's index-queue feeder and main thread and back:
    20.6 ms of a 35.6 ms stall cut there)."""
    b = trainer()
    tids = [TRAINER, *range(TRAINER + 1, TRAINER + 10)]
    for i, tid in enumerate(tids):
        if tid != TRAINER:
            b.thread(TRAINER, tid, "python")
        end = 39.5 - 0.2 * i
        b.syscall(TRAINER, tid, "futex", 5.0 + 0.1 * i, end, arg=0x1000 + i)
        if i + 1 < len(tids):
            b.offcpu(TRAINER, tid, 5.0 + 0.1 * i, end - 0.05, "S", end - 0.1, (TRAINER, tids[i + 1], "python"))
    s = stall_of(b, tmp_path)
    assert (s["cause"], s.get("why")) == ("unknown", "the wait chain went on past 8 hops: not followed further"), s
    assert len(s["via"]) == 9, s["via"]
