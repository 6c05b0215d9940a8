"""Objects shaped like cupti-python 13.4's activity records (attribute names from its cupti.pyi).

Every attribute the classes declare that a converter could plausibly read is present, with CUPTI's
values for a small PyTorch step (kernels, pageable and pinned H2D copies, a memset, a stream sync, an NVTX
range), so a conversion that reads a wrong name fails here as it would on a GPU.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from gputrace.clock import RealtimeConverter


def kernel(start: int, end: int, corr: int, name: str = "void at::native::vectorized_elementwise_kernel<4>",
           *, device: int = 0, context: int = 1, stream: int = 7, kind: int = 10) -> SimpleNamespace:  # fmt: skip
    return SimpleNamespace(
        kind=kind, start=start, end=end, completed=end, queued=0, submitted=0, device_id=device,
        context_id=context, stream_id=stream, correlation_id=corr, name=name, grid_x=1024, grid_y=1, grid_z=1,
        block_x=128, block_y=1, block_z=1, registers_per_thread=16, static_shared_memory=0,
        dynamic_shared_memory=0, graph_id=0, graph_node_id=0, grid_id=42, launch_type=0, channel_id=3,
        channel_type=1, cluster_x=0, cluster_y=0, cluster_z=0, is_device_launched=0, priority=0,
        execution_model=0, source_graph_id=0, source_graph_node_id=0,
    )  # fmt: skip


def memcpy(start: int, end: int, corr: int, nbytes: int, copy_kind: int, src_kind: int, dst_kind: int,
           *, device: int = 0, context: int = 1, stream: int = 7) -> SimpleNamespace:  # fmt: skip
    return SimpleNamespace(
        kind=1, start=start, end=end, bytes=nbytes, copy_kind=copy_kind, src_kind=src_kind, dst_kind=dst_kind,
        flags_=1, device_id=device, context_id=context, stream_id=stream, correlation_id=corr,
        runtime_correlation_id=0, graph_id=0, graph_node_id=0, channel_id=2, channel_type=2, copy_count=1,
        is_device_launched=0, pad=0,
    )  # fmt: skip


def memset(start: int, end: int, corr: int, nbytes: int, *, stream: int = 7) -> SimpleNamespace:
    return SimpleNamespace(
        kind=2, start=start, end=end, bytes=nbytes, value=0, memory_kind=3, flags_=1, device_id=0, context_id=1,
        stream_id=stream, correlation_id=corr, graph_id=0, graph_node_id=0, channel_id=3, channel_type=1,
        is_device_launched=0, pad=0,
    )  # fmt: skip


def api(start: int, end: int, corr: int, cbid: int, *, driver: bool = False, pid: int = 4242,
        tid: int = 4243, ret: int = 0) -> SimpleNamespace:  # fmt: skip
    return SimpleNamespace(
        kind=4 if driver else 5, cbid=cbid, start=start, end=end, process_id=pid, thread_id=tid,
        correlation_id=corr, return_value=ret,
    )


def sync(start: int, end: int, corr: int, sync_type: int, *, context: int = 1, stream: int = 7) -> SimpleNamespace:
    return SimpleNamespace(
        kind=38, type=sync_type, start=start, end=end, correlation_id=corr, context_id=context, stream_id=stream,
        cuda_event_id=0, cuda_event_sync_id=0, return_value=0, pad=0,
    )  # fmt: skip


def marker(ts: int, marker_id: int, flags: int, name: str = "", *, domain: str = "", pid: int = 4242,
           tid: int = 4243, object_kind: int = 2) -> SimpleNamespace:  # fmt: skip
    object_id = SimpleNamespace(
        pt=SimpleNamespace(process_id=pid, thread_id=tid),
        dcs=SimpleNamespace(device_id=pid, context_id=tid, stream_id=0),
    )
    return SimpleNamespace(
        kind=12, flags_=flags, timestamp=ts, id=marker_id, object_kind=object_kind, object_id=object_id,
        name=name, domain=domain, pad=0,
    )  # fmt: skip


def device(dev_id: int = 0, name: str = "NVIDIA H100 80GB HBM3") -> SimpleNamespace:
    uuid = SimpleNamespace(bytes=bytes(range(0x10, 0x20)))
    return SimpleNamespace(
        kind=8, id=dev_id, name=name, uuid=uuid, mig_uuid=SimpleNamespace(bytes=bytes(16)),
        compute_capability_major=9, compute_capability_minor=0, global_memory_size=85 << 30,
        num_multiprocessors=132, flags_=0,
    )  # fmt: skip


def context(context_id: int = 1, device_id: int = 0) -> SimpleNamespace:
    return SimpleNamespace(kind=9, context_id=context_id, device_id=device_id, null_stream_id=7,
                           compute_api_kind=1, cig_mode=0, num_multiprocessors=132, parent_context_id=0,
                           is_green_context=0)  # fmt: skip


# Runtime/driver callback names for the ids used here (cupti.get_callback_name's answers).
API_NAMES = {
    (2, 211): "cudaLaunchKernel_v7000",
    (2, 41): "cudaMemcpyAsync_v3020",
    (2, 131): "cudaStreamSynchronize_v3020",
    (2, 51): "cudaMemsetAsync_v3020",
    (1, 307): "cuLaunchKernel",
    (2, 17): "cudaGetDevice_v3020",
    (1, 1101): "cuDevicePrimaryCtxGetState",
}


def api_name(domain: int, cbid: int) -> str:
    return API_NAMES[(domain, cbid)]


def realtime(clock: RealtimeConverter, mono: int) -> int:
    """A CUPTI (CLOCK_REALTIME) stamp for capture-clock time ``mono``."""
    return clock.to_realtime(mono)


def step(clock: RealtimeConverter, t0: int) -> list[Any]:
    """One training step as CUPTI delivers it, times given on the capture clock from ``t0``."""
    r = lambda ms: realtime(clock, t0 + int(ms * 1e6))  # noqa: E731
    return [
        context(), device(),
        marker(r(0.0), 9, 2, "step", domain="train"),
        api(r(0.1), r(0.2), 100, 41),
        memcpy(r(0.2), r(1.2), 100, 4 << 20, 1, 1, 3),      # H2D from pageable memory
        api(r(1.3), r(1.35), 101, 41),
        memcpy(r(1.4), r(1.6), 101, 4 << 20, 1, 2, 3),      # H2D from pinned memory
        api(r(1.7), r(1.72), 102, 51),
        memset(r(1.8), r(1.9), 102, 1 << 20),
        api(r(2.0), r(2.01), 103, 211),
        api(r(2.002), r(2.008), 104, 307, driver=True),
        kernel(r(2.1), r(5.1), 103),
        sync(r(2.05), r(5.2), 105, 3),                      # its API record comes in the next buffer
        memcpy(r(5.3), r(5.4), 106, 4096, 2, 3, 1),         # D2H into pageable memory
        marker(r(5.5), 9, 4),
    ]  # fmt: skip


def step_tail(clock: RealtimeConverter, t0: int) -> list[Any]:
    r = lambda ms: realtime(clock, t0 + int(ms * 1e6))  # noqa: E731
    return [api(r(2.04), r(5.25), 105, 131)]
