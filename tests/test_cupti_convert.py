"""CUPTI activity records → gputrace records, on objects shaped like cupti-python's (tests/cupti_shapes.py)."""

from __future__ import annotations

from typing import Any

import cupti_shapes as shapes
import pytest

from gputrace.clock import RealtimeConverter, monotonic_ns
from gputrace.probes.cupti_convert import ActivityConverter, format_uuid, memory_of
from gputrace.records import CudaApi, GpuDevice, GpuKernel, GpuMemcpy, GpuMemset, GpuSync, NvtxRange

MS = 1_000_000


@pytest.fixture
def clock() -> RealtimeConverter:
    return RealtimeConverter(period_s=3600)


def convert_step(clock: RealtimeConverter) -> tuple[int, list, ActivityConverter]:
    t0 = monotonic_ns()
    conv = ActivityConverter(4242, clock.to_monotonic, shapes.api_name)
    out = conv.convert(shapes.step(clock, t0)) + conv.convert(shapes.step_tail(clock, t0)) + conv.finish()
    return t0, out, conv


def of(records: list, cls: type) -> list:
    return [r for r in records if type(r) is cls]


def test_kernel_fields_and_clock(clock: RealtimeConverter) -> None:
    t0, out, _ = convert_step(clock)
    (k,) = of(out, GpuKernel)
    assert k == GpuKernel(4242, 0, 1, 7, t0 + int(2.1 * MS), t0 + int(5.1 * MS), 103,
                          "void at::native::vectorized_elementwise_kernel<4>", (1024, 1, 1), (128, 1, 1))  # fmt: skip


def test_memcpy_direction_bytes_and_host_memory(clock: RealtimeConverter) -> None:
    t0, out, _ = convert_step(clock)
    copies = of(out, GpuMemcpy)
    assert [(c.kind, c.memory, c.nbytes, c.correlation_id) for c in copies] == [
        ("h2d", "pageable", 4 << 20, 100), ("h2d", "pinned", 4 << 20, 101), ("d2h", "pageable", 4096, 106),
    ]  # fmt: skip
    assert copies[0].end_ns - copies[0].start_ns == MS
    assert copies[0].stream == 7 and copies[0].device == 0


def test_memset(clock: RealtimeConverter) -> None:
    t0, out, _ = convert_step(clock)
    assert of(out, GpuMemset) == [GpuMemset(4242, 0, 1, 7, t0 + int(1.8 * MS), t0 + int(1.9 * MS), 102, 1 << 20)]


def test_api_calls_named_with_tid_and_result(clock: RealtimeConverter) -> None:
    t0, out, _ = convert_step(clock)
    calls = of(out, CudaApi)
    assert [(c.name, c.api, c.correlation_id) for c in calls] == [
        ("cudaMemcpyAsync_v3020", "runtime", 100), ("cudaMemcpyAsync_v3020", "runtime", 101),
        ("cudaMemsetAsync_v3020", "runtime", 102), ("cudaLaunchKernel_v7000", "runtime", 103),
        ("cuLaunchKernel", "driver", 104), ("cudaStreamSynchronize_v3020", "runtime", 105),
    ]  # fmt: skip
    assert {(c.pid, c.tid, c.result) for c in calls} == {(4242, 4243, 0)}


def test_sync_gets_thread_from_its_api_record_in_a_later_buffer(clock: RealtimeConverter) -> None:
    t0, out, conv = convert_step(clock)
    (s,) = of(out, GpuSync)
    assert s == GpuSync(4242, 4243, 0, 1, 7, t0 + int(2.05 * MS), t0 + int(5.2 * MS), 105, "stream")
    assert conv.skipped == {}


def test_sync_without_api_record_is_emitted_at_finish_and_counted(clock: RealtimeConverter) -> None:
    t0 = monotonic_ns()
    conv = ActivityConverter(4242, clock.to_monotonic, shapes.api_name)
    r = clock.to_realtime
    assert conv.convert([shapes.sync(r(t0), r(t0 + MS), 9, 4, context=5)]) == []
    (s,) = conv.finish()
    assert (s.tid, s.device, s.kind) == (0, -1, "context")  # context 5 never seen: device unknown
    assert conv.skipped == {"sync_without_thread": 1}


def test_nvtx_range_paired_across_records(clock: RealtimeConverter) -> None:
    t0, out, _ = convert_step(clock)
    assert of(out, NvtxRange) == [NvtxRange(4242, 4243, "step", t0, t0 + int(5.5 * MS), "train")]


def test_nvtx_instantaneous_unmatched_and_unclosed(clock: RealtimeConverter) -> None:
    t0 = monotonic_ns()
    r = clock.to_realtime
    conv = ActivityConverter(1, clock.to_monotonic, shapes.api_name)
    out = conv.convert([
        shapes.marker(r(t0), 1, 1, "checkpoint"),
        shapes.marker(r(t0), 2, 4),                 # end without start
        shapes.marker(r(t0), 3, 2, "never closed"),
    ])  # fmt: skip
    assert out == [NvtxRange(4242, 4243, "checkpoint", t0, t0, "")]
    conv.finish()
    assert conv.skipped == {"nvtx_end_without_start": 1, "nvtx_unclosed": 1}


def test_device_record(clock: RealtimeConverter) -> None:
    _, out, _ = convert_step(clock)
    assert of(out, GpuDevice) == [
        GpuDevice(0, "NVIDIA H100 80GB HBM3", False, "GPU-10111213-1415-1617-1819-1a1b1c1d1e1f", 4242)
    ]


def test_incomplete_and_unknown_kinds_are_counted_not_emitted(clock: RealtimeConverter) -> None:
    conv = ActivityConverter(1, clock.to_monotonic, shapes.api_name)
    out = conv.convert([shapes.kernel(5, 0, 1), shapes.api(10, 0, 2, 211),
                        shapes.SimpleNamespace(kind=17)])  # fmt: skip
    assert out == []
    assert conv.skipped == {"incomplete": 2, "kind_17": 1}


def test_unnamed_callback_and_legacy_kernel_kind(clock: RealtimeConverter) -> None:
    conv = ActivityConverter(1, clock.to_monotonic, lambda d, c: (_ for _ in ()).throw(ValueError("bad cbid")))
    t = clock.to_realtime(monotonic_ns())
    out = conv.convert([shapes.api(t, t + 5, 1, 999), shapes.kernel(t, t + 9, 1, kind=3, name=None)])
    assert out[0].name == "cbid:999"
    assert out[1].name == "" and out[1].end_ns - out[1].start_ns == 9


def test_memory_side_and_uuid_forms() -> None:
    assert memory_of("d2h", 3, 2) == "pinned"
    assert memory_of("d2d", 3, 3) == "device"
    assert memory_of("h2d", 9, 3) == "unknown"
    assert format_uuid(b"\x00" * 16) == "GPU-00000000-0000-0000-0000-000000000000"
    assert format_uuid("x" * 3) == ""


def test_bounded_state_under_a_flood(clock: RealtimeConverter) -> None:
    conv = ActivityConverter(1, clock.to_monotonic, shapes.api_name, max_pending=8)
    t = clock.to_realtime(monotonic_ns())
    conv.convert([shapes.marker(t, i, 2, "open") for i in range(20)])
    conv.convert([shapes.sync(t, t + 1, 1000 + i, 3) for i in range(20)])
    assert conv.skipped["nvtx_unclosed"] == 12
    assert len(conv.finish()) == 8 and conv.skipped["sync_without_thread"] == 20


def test_real_cupti_python_record_objects(clock: RealtimeConverter) -> None:
    """The same conversion on cupti-python's own record classes, filled through their numpy dtypes."""
    import ctypes

    import numpy as np
    from cupti import cupti

    name = ctypes.create_string_buffer(b"gemm_kernel")
    k = np.zeros(1, dtype=cupti.activity_kernel10_dtype)
    t = clock.to_realtime(monotonic_ns())
    for field, value in dict(kind=10, start=t, end=t + 500, device_id=0, context_id=1, stream_id=13,
                             correlation_id=77, grid_x=4, grid_y=2, grid_z=1, block_x=256, block_y=1,
                             block_z=1, name=ctypes.addressof(name)).items():  # fmt: skip
        k[field] = value
    a = np.zeros(1, dtype=cupti.activity_api_dtype)
    for field, value in dict(kind=5, cbid=211, start=t, end=t + 50, process_id=4242, thread_id=4243,
                             correlation_id=77).items():  # fmt: skip
        a[field] = value
    records = [cupti.ActivityKernel10.from_data(k), cupti.ActivityAPI.from_data(a)]
    out = ActivityConverter(4242, clock.to_monotonic, shapes.api_name).convert(records)
    assert [type(r) for r in out] == [GpuKernel, CudaApi]
    assert (out[0].name, out[0].stream, out[0].grid, out[0].end_ns - out[0].start_ns) == (
        "gemm_kernel", 13, (4, 2, 1), 500)  # fmt: skip
    assert (out[1].tid, out[1].correlation_id, out[1].name) == (4243, 77, "cudaLaunchKernel_v7000")


def test_every_kind_on_real_cupti_python_records_directly_and_through_a_recording(clock: RealtimeConverter) -> None:
    """Each kind the converter reads, as cupti-python's own record classes (filled through their numpy
    dtypes): converted directly, and dumped as a GPU recording is (dump_activity, JSON) then loaded and
    converted again, which must give the same records: the recorder is right about the real classes."""
    import ctypes
    import json

    import numpy as np
    from cupti import cupti

    from gputrace.probes.cupti_convert import dump_activity, load_activity

    keep: list[ctypes.Array[ctypes.c_char]] = []

    def text(s: str) -> int:
        keep.append(ctypes.create_string_buffer(s.encode()))
        return ctypes.addressof(keep[-1])

    def record(cls: Any, dtype: Any, **fields: Any) -> Any:
        a = np.zeros(1, dtype=dtype)
        for k, v in fields.items():
            if k == "pt":
                a["object_id"]["pt"]["process_id"], a["object_id"]["pt"]["thread_id"] = v
            elif isinstance(v, bytes):  # a fixed-size byte field: V16 in 13.4, u1[16] in 13.0
                a[k] = np.void(v) if dtype.fields[k][0].subdtype is None else np.frombuffer(v, dtype=np.uint8)
            else:
                a[k] = v
        return cls.from_data(a)

    t = clock.to_realtime(monotonic_ns())
    work = dict(device_id=0, context_id=1, stream_id=7)
    records = [
        record(cupti.ActivityDevice5, cupti.activity_device5_dtype, kind=8, id=0, name=text("NVIDIA H100 80GB HBM3"),
               uuid=bytes(range(16))),
        record(cupti.ActivityContext3, cupti.activity_context3_dtype, kind=9, context_id=1, device_id=0),
        record(cupti.ActivityMemcpy6, cupti.activity_memcpy6_dtype, kind=1, copy_kind=1, src_kind=1, dst_kind=3,
               bytes=1 << 20, start=t, end=t + 90, correlation_id=11, **work),
        record(cupti.ActivityMemset4, cupti.activity_memset4_dtype, kind=2, bytes=4096, start=t + 100, end=t + 110,
               correlation_id=12, **work),
        record(cupti.ActivityAPI, cupti.activity_api_dtype, kind=5, cbid=131, start=t + 120, end=t + 400,
               process_id=4242, thread_id=4250, correlation_id=13),
        record(cupti.ActivitySynchronization2, cupti.activity_synchronization2_dtype, kind=38, type=3,
               start=t + 130, end=t + 390, correlation_id=13, context_id=1, stream_id=7),
        record(cupti.ActivityMarker2, cupti.activity_marker2_dtype, kind=12, flags_=2, timestamp=t + 5, id=3,
               object_kind=2, pt=(4242, 4250), name=text("data_wait"), domain=text("")),
        record(cupti.ActivityMarker2, cupti.activity_marker2_dtype, kind=12, flags_=4, timestamp=t + 95, id=3,
               object_kind=2, pt=(4242, 4250), name=text(""), domain=text("")),
    ]  # fmt: skip
    direct = ActivityConverter(4242, clock.to_monotonic, shapes.api_name)
    out = direct.convert(records) + direct.finish()
    dumped = json.loads(json.dumps([dump_activity(a, shapes.api_name) for a in records]))
    again = ActivityConverter(4242, clock.to_monotonic, shapes.api_name)
    replayed = again.convert([load_activity(d) for d in dumped]) + again.finish()
    assert replayed == out and direct.skipped == again.skipped == {}
    [dev] = of(out, GpuDevice)
    assert (dev.name, dev.uuid) == ("NVIDIA H100 80GB HBM3", "GPU-00010203-0405-0607-0809-0a0b0c0d0e0f")
    [cp] = of(out, GpuMemcpy)
    assert (cp.nbytes, cp.kind, cp.memory, cp.end_ns - cp.start_ns) == (1 << 20, "h2d", "pageable", 90)
    [ms] = of(out, GpuMemset)
    assert ms.nbytes == 4096 and ms.stream == 7
    [sync] = of(out, GpuSync)
    assert (sync.tid, sync.device, sync.kind, sync.end_ns - sync.start_ns) == (4250, 0, "stream", 260)
    [nvtx] = of(out, NvtxRange)
    assert (nvtx.tid, nvtx.name, nvtx.end_ns - nvtx.start_ns) == (4250, "data_wait", 90)
    [api] = of(out, CudaApi)
    assert api.name == "cudaStreamSynchronize_v3020" and api.tid == 4250


def test_quiet_lookups_are_dropped_and_counted_unless_all_apis_are_asked_for() -> None:
    batch = [shapes.api(100, 200, 1, 17), shapes.api(300, 400, 2, 1101, driver=True), shapes.api(500, 600, 3, 211)]
    conv = ActivityConverter(4242, lambda t: t, shapes.api_name)
    assert [r.name for r in conv.convert(batch)] == ["cudaLaunchKernel_v7000"]
    assert conv.skipped == {"quiet_api": 2}
    everything = ActivityConverter(4242, lambda t: t, shapes.api_name, all_apis=True)
    assert [r.name for r in everything.convert(batch)] == [
        "cudaGetDevice_v3020", "cuDevicePrimaryCtxGetState", "cudaLaunchKernel_v7000"]
    assert everything.skipped == {}
