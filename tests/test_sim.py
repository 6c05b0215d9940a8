"""The simulated device: timing, ordering, blocking sync, and its records through a real agent channel."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from agent_harness import Harness, of

from gputrace.sim import Device
from gputrace.sim.backend import BACKEND

WORKLOAD = """
import time
from gputrace.sim import Device
dev = Device(0)
a, b = dev.stream(), dev.stream()
for i in range(4):
    a.launch(f"gemm_{i}", duration_ms=20, grid=(64, 1, 1))
    b.memcpy(1 << 20, duration_ms=8, kind="h2d", memory="pinned")
b.launch("softmax", duration_ms=5)
a.synchronize()
dev.synchronize()
print("done")
"""


def test_sim_records_through_the_agent_channel(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    p = h.spawn(WORKLOAD)
    assert p.wait(20) == 0
    recs = h.finish()
    pid = p.pid

    [device] = of(recs, "GpuDevice")
    assert device.simulated and "Simulated" in device.name and device.pid == pid
    assert [i.source for i in of(recs, "AgentInfo")] == ["sim"]

    kernels = {k.name: k for k in of(recs, "GpuKernel")}
    assert sorted(kernels) == ["gemm_0", "gemm_1", "gemm_2", "gemm_3", "softmax"]
    for i in range(4):
        k = kernels[f"gemm_{i}"]
        assert abs((k.end_ns - k.start_ns) - 20e6) <= 2e6, k
        assert list(k.grid) == [64, 1, 1]
    gemm_stream = kernels["gemm_0"].stream
    assert {kernels[f"gemm_{i}"].stream for i in range(4)} == {gemm_stream}
    copies = of(recs, "GpuMemcpy")
    assert len(copies) == 4 and {c.stream for c in copies} == {kernels["softmax"].stream} != {gemm_stream}
    assert all(c.kind == "h2d" and c.nbytes == 1 << 20 and c.memory == "pinned" for c in copies)
    # In order on one stream: each gemm starts when the one before ends.
    starts = sorted((k.start_ns, k.end_ns) for k in kernels.values() if k.stream == gemm_stream)
    assert all(nxt[0] >= prev[1] for prev, nxt in zip(starts, starts[1:], strict=False))

    api = {a.correlation_id: a for a in of(recs, "CudaApi")}
    for k in kernels.values():
        launch = api[k.correlation_id]
        assert launch.name == "cudaLaunchKernel" and launch.pid == pid and launch.tid == pid
        assert launch.start_ns <= k.start_ns
    for c in copies:
        assert api[c.correlation_id].name == "cudaMemcpyAsync"

    syncs = {s.kind: s for s in of(recs, "GpuSync")}
    stream_sync = syncs["stream"]
    assert stream_sync.stream == gemm_stream and stream_sync.tid == pid
    # The host really waited until the last gemm finished.
    assert stream_sync.end_ns >= kernels["gemm_3"].end_ns
    assert api[stream_sync.correlation_id].name == "cudaStreamSynchronize"
    assert syncs["context"].end_ns >= max(c.end_ns for c in copies)
    assert h.reader is not None and h.reader.complete


def test_sim_without_a_session_runs_and_emits_nothing() -> None:
    dev = Device(3)
    s = dev.stream()
    assert not BACKEND.enabled
    t0 = time.monotonic()
    for _ in range(5):
        s.launch("k", duration_ms=20)
    launched = time.monotonic() - t0
    s.synchronize()
    total = time.monotonic() - t0
    assert launched < 0.01, "launches must not wait for the device"
    assert 0.099 <= total <= 0.14, total  # 5 x 20 ms back to back, plus the waiter being scheduled


def test_streams_run_concurrently_and_sync_blocks() -> None:
    dev = Device(1)
    a, b = dev.stream(), dev.stream()
    t0 = time.monotonic()
    a.launch("x", duration_ms=60)
    b.launch("y", duration_ms=60)
    assert not a.query()
    dev.synchronize()
    elapsed = time.monotonic() - t0
    assert 0.059 <= elapsed < 0.1, elapsed
    assert a.query() and b.query()


def test_synchronize_is_woken_by_the_stream_thread() -> None:
    """The waiting host thread is parked on a condition until the stream's own thread signals it."""
    dev = Device(2)
    s = dev.stream()
    s.launch("long", duration_ms=80)
    done = threading.Event()
    waiter = threading.Thread(target=lambda: (s.synchronize(), done.set()))
    waiter.start()
    assert not done.wait(0.04), "synchronize returned before the kernel finished"
    assert done.wait(1.0)
    waiter.join()


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda s: s.launch("k", duration_ms=-1), "duration_ms"),
        (lambda s: s.launch("k", duration_ms=1e300), "duration_ms"),  # once killed the stream's thread
        (lambda s: s.launch("k", duration_ms=float("inf")), "duration_ms"),
        (lambda s: s.launch("k", duration_ms=float("nan")), "duration_ms"),
        (lambda s: s.launch("k", duration_ms=True), "duration_ms"),
        (lambda s: s.memcpy(1.5, duration_ms=1), "nbytes"),
        (lambda s: s.memcpy(10, duration_ms=1, kind="sideways"), "memcpy kind"),
        (lambda s: s.memcpy(-5, duration_ms=1), "nbytes"),
        (lambda s: s.launch("", duration_ms=1), "name"),
        (lambda s: s.launch("k", duration_ms=1, grid=(0, 1, 1)), "grid"),
    ],
)
def test_bad_arguments_are_refused(call: object, message: str) -> None:
    s = Device(0).stream()
    with pytest.raises(ValueError, match=message):
        call(s)  # type: ignore[operator]
    s.launch("after", duration_ms=1)  # the stream still works: nothing bad reached its thread
    s.synchronize()
