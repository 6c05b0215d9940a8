"""Stalls on write()s the kernel paused for dirty pages (balance_dirty_pages): the pauses are named in the
storage culprit, summed over the stall's calls on the same file, and none are found where there were none."""

from __future__ import annotations

from pathlib import Path

from test_analysis import TRAINER, only_stall, run, trainer
from test_analysis_uring import MOUNTS

from gputrace.records import DirtyPause
from gputrace.testing.synth import ns
from gputrace.viewer.terminal import describe

SAVE = "/data/state-001.bin"


def test_a_save_paused_in_three_writes_names_every_pause(tmp_path: Path) -> None:
    """Four 64 KiB writes in the stall [10, 40) ms; three were paused (one of them twice), one was not. The
    culprit is the longest write; the pauses are the stall's: 4 in 3 calls, measured by the sleeps they were."""
    b = trainer()
    b.syscall(TRAINER, TRAINER, "write", 10.1, 18.0, SAVE, 64 << 10).dirty(TRAINER, TRAINER, 10.2, 7.7)
    b.syscall(TRAINER, TRAINER, "write", 18.1, 18.3, SAVE, 64 << 10)  # dirtied, not paused: too short to record
    b.syscall(TRAINER, TRAINER, "write", 18.4, 30.0, SAVE, 64 << 10)
    b.dirty(TRAINER, TRAINER, 18.5, 5.0).dirty(TRAINER, TRAINER, 23.6, 6.3, dirty=320 << 10)
    b.syscall(TRAINER, TRAINER, "write", 30.1, 39.9, SAVE, 64 << 10).dirty(TRAINER, TRAINER, 30.2, 9.6, dirty=288 << 10)
    s = only_stall(run(b, tmp_path, header=MOUNTS))
    c = s["culprit"]
    assert (s["cause"], c["op"], c["object"], c["pid"], c["duration_ns"]) == ("storage", "write", SAVE, TRAINER,
                                                                              11_600_000)
    assert (c["dirty_pauses"], c["dirty_calls"], c["dirty_device"]) == (4, 3, "loop0"), c
    # each pause from its tracepoint to the end of its sleep: 7.7 + 5.0 + 6.3 + 9.6 ms
    assert c["dirty_paused_ns"] == 28_600_000, c
    assert (c["dirty_bytes"], c["dirty_setpoint_bytes"]) == (288 << 10, 216 << 10)  # as of the last pause
    whats = [e["what"] for e in s["evidence"] if e["kind"] == "dirty"]
    assert whats == ["paused 5.0 ms for dirty pages on loop0: 256 KiB dirty or in writeback, setpoint 216 KiB",
                     "paused 6.3 ms for dirty pages on loop0: 320 KiB dirty or in writeback, setpoint 216 KiB"]
    assert "paused 4× (28.6 ms in 3 calls) for dirty pages on loop0 (288 KiB dirty, setpoint 216 KiB)" in describe(s)


def test_a_pause_is_counted_up_to_its_calls_end(tmp_path: Path) -> None:
    """A pause whose sleep was not recorded counts what the kernel set, cut at the call's end; a pause of
    another thread, or outside the write, is not the write's."""
    b = trainer()
    b.syscall(TRAINER, TRAINER, "write", 10.1, 39.9, SAVE, 64 << 10)
    b.offcpu(TRAINER, TRAINER, 10.3, 39.8, "D", waker=(0, 0, "[irq]"))
    b.records.append(DirtyPause(TRAINER, TRAINER, ns(35.0), 200_000_000, "loop0", 1, 1, 1, 1, 0))  # no sleep of its own
    b.records.append(DirtyPause(TRAINER, TRAINER + 1, ns(20.0), 5_000_000, "loop0", 1, 1, 1, 1, 0))  # another thread
    b.records.append(DirtyPause(TRAINER, TRAINER, ns(5.0), 5_000_000, "loop0", 1, 1, 1, 1, 0))  # before the call
    c = only_stall(run(b, tmp_path, header=MOUNTS))["culprit"]
    assert (c["dirty_pauses"], c["dirty_calls"], c["dirty_paused_ns"]) == (1, 1, 4_900_000), c


def test_a_write_that_was_not_paused_says_nothing_of_dirty_pages(tmp_path: Path) -> None:
    b = trainer()
    b.syscall(TRAINER, TRAINER, "write", 10.1, 39.9, SAVE, 64 << 10)
    b.offcpu(TRAINER, TRAINER, 10.3, 39.8, "D", waker=(0, 0, "[irq]"))
    c = only_stall(run(b, tmp_path, header=MOUNTS))["culprit"]
    assert c["op"] == "write" and not any(k.startswith("dirty_") for k in c), c


def test_a_store_to_a_shared_mapping_paused_outside_any_call_is_storage_on_the_device(tmp_path: Path) -> None:
    """No write(): the page was dirtied by a store to a shared file mapping and the pause came in that fault.
    The sleep it began is the device's, not unknown; a sleep no pause began stays unknown."""
    b = trainer()
    b.dirty(TRAINER, TRAINER, 10.5, 25.0)
    report = run(b, tmp_path, header=MOUNTS)
    s = only_stall(report)
    c = s["culprit"]
    assert (s["cause"], c["op"], c["object"], c["pid"]) == ("storage", "balance_dirty_pages", "loop0", TRAINER), c
    assert (report["top_culprits"][0]["kind"], report["top_culprits"][0]["culprit"]) == ("device", "loop0")
    assert (c["dirty_pauses"], c["dirty_paused_ns"], c["dirty_device"]) == (1, 25_000_000, "loop0"), c
    assert [e["kind"] for e in s["evidence"]][:2] == ["dirty", "offcpu"]

    b = trainer()
    b.offcpu(TRAINER, TRAINER, 10.5, 35.5, "D", waker=(0, 0, "[timer]"))
    b.records.append(DirtyPause(TRAINER, TRAINER, ns(8.0), 1_000_000, "loop0", 1, 1, 1, 1, 0))  # 2.5 ms before it
    assert only_stall(run(b, tmp_path, header=MOUNTS))["cause"] == "unknown"
