"""CUPTI activity records → gputrace.records, as pure conversion with no CUPTI import.

The objects handed in are cupti-python's activity records (``cupti.ActivityKernel*``, ``ActivityMemcpy*``,
``ActivityMemset*``, ``ActivityAPI``, ``ActivitySynchronization*``, ``ActivityMarker2``, ``ActivityDevice*``,
``ActivityContext*``), read only through the attribute names those classes declare, so any version of a
kind converts. The numeric enum values below are CUPTI's C ABI (cupti_activity.h) and never change.

Times arrive on CUPTI's clock (CLOCK_REALTIME ns) and leave on the capture clock through ``to_monotonic``,
which the caller takes from gputrace.clock: no clock arithmetic happens here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from gputrace.records import CudaApi, GpuDevice, GpuKernel, GpuMemcpy, GpuMemset, GpuSync, NvtxRange

# CUpti_ActivityKind
KIND_MEMCPY = 1
KIND_MEMSET = 2
KIND_KERNEL = 3
KIND_DRIVER = 4
KIND_RUNTIME = 5
KIND_DEVICE = 8
KIND_CONTEXT = 9
KIND_CONCURRENT_KERNEL = 10
KIND_MARKER = 12
KIND_SYNCHRONIZATION = 38

# CUpti_CallbackDomain
DOMAIN_DRIVER = 1
DOMAIN_RUNTIME = 2

# CUpti_ActivityFlag for markers; MARKER_END is absent from cupti-python's enum.
MARKER_INSTANTANEOUS = 1
MARKER_START = 2
MARKER_END = 4

OBJECT_KIND_THREAD = 2

# CUpti_ActivityMemcpyKind → GpuMemcpy.kind. CUDA arrays live on the device.
MEMCPY_KINDS = {1: "h2d", 2: "d2h", 3: "h2d", 4: "d2h", 5: "d2d", 6: "d2d", 7: "d2d", 8: "d2d", 9: "h2h", 10: "p2p"}
# CUpti_ActivityMemoryKind
MEMORY_KINDS = {
    0: "unknown", 1: "pageable", 2: "pinned", 3: "device", 4: "array",
    5: "managed", 6: "device_static", 7: "managed_static",
}  # fmt: skip
# CUpti_ActivitySynchronizationType → GpuSync.kind
SYNC_KINDS = {0: "unknown", 1: "event", 2: "stream_wait_event", 3: "stream", 4: "context"}

# Only these API calls can own a synchronization record, so only their threads are remembered.
_SYNC_API_WORDS = ("ynchronize", "WaitEvent")

# Lookups that PyTorch and CUDA's libraries make dozens of times per kernel, each well under a microsecond and
# never waiting on anything. In a PyTorch training loop on an H100 they were 89 % of all API records
# (cudaGetDevice alone 58 %), and converting them costs the target's GIL. Not recorded: CuptiBackend turns
# them off in CUPTI, and the converter drops (and counts, as ``quiet_api``) any that still arrive. An API
# is matched by its name's start, so every version of it (cuCtxGetDevice, cuCtxGetDevice_v2) is included.
QUIET_APIS = (
    "cudaGetDevice_", "cudaGetLastError_", "cudaPeekAtLastError_", "cuDevicePrimaryCtxGetState",
    "cuCtxGetCurrent", "cuCtxGetDevice", "cuKernelGetName", "cuFuncGetName", "cuGetProcAddress",
    # PyTorch's allocator and launch path ask these per allocation or per kernel; none of them waits
    "cudaThreadExchangeStreamCaptureMode_", "cudaStreamIsCapturing_", "cuStreamIsCapturing",
    "cudaStreamGetCaptureInfo", "cuStreamGetCaptureInfo", "cuDeviceGetAttribute", "cudaDeviceGetAttribute_",
    "cuKernelGetFunction", "cuOccupancyMaxActiveBlocksPerMultiprocessor", "cudaOccupancyMaxActiveClusters_",
    "cuFuncGetAttribute", "cudaFuncGetAttributes_",
)  # fmt: skip
ALL_APIS_ENV = "GPUTRACE_CUPTI_ALL_APIS"  # "1": record the quiet lookups too


def quiet_api(name: str) -> bool:
    return name.startswith(QUIET_APIS)

ToMonotonic = Callable[[int], int]
ApiName = Callable[[int, int], str]


def kernel_record(a: Any, pid: int, to_mono: ToMonotonic) -> GpuKernel:
    return GpuKernel(
        pid, a.device_id, a.context_id, a.stream_id, to_mono(a.start), to_mono(a.end), a.correlation_id,
        a.name or "", (a.grid_x, a.grid_y, a.grid_z), (a.block_x, a.block_y, a.block_z),
    )  # fmt: skip


def memcpy_record(a: Any, pid: int, to_mono: ToMonotonic) -> GpuMemcpy:
    kind = MEMCPY_KINDS.get(a.copy_kind, "unknown")
    return GpuMemcpy(
        pid, a.device_id, a.context_id, a.stream_id, to_mono(a.start), to_mono(a.end), a.correlation_id,
        a.bytes, kind, memory_of(kind, a.src_kind, a.dst_kind),
    )  # fmt: skip


def memory_of(kind: str, src_kind: int, dst_kind: int) -> str:
    """The host side's memory kind for host copies (pageable vs pinned is what matters), else the source's."""
    side = dst_kind if kind == "d2h" else src_kind
    return MEMORY_KINDS.get(side, "unknown")


def memset_record(a: Any, pid: int, to_mono: ToMonotonic) -> GpuMemset:
    return GpuMemset(
        pid, a.device_id, a.context_id, a.stream_id, to_mono(a.start), to_mono(a.end), a.correlation_id, a.bytes
    )


def api_record(a: Any, name: str, to_mono: ToMonotonic) -> CudaApi:
    api = "driver" if a.kind == KIND_DRIVER else "runtime"
    return CudaApi(
        a.process_id, a.thread_id, name, to_mono(a.start), to_mono(a.end), a.correlation_id, api, a.return_value
    )


def sync_record(a: Any, pid: int, tid: int, device: int, to_mono: ToMonotonic) -> GpuSync:
    return GpuSync(
        pid, tid, device, a.context_id, a.stream_id, to_mono(a.start), to_mono(a.end), a.correlation_id,
        SYNC_KINDS.get(a.type, "unknown"),
    )  # fmt: skip


def device_record(a: Any, pid: int) -> GpuDevice:
    return GpuDevice(a.id, a.name or "", False, format_uuid(a.uuid), pid)


def format_uuid(uuid: Any) -> str:
    """A CUuuid (``.bytes``, 16 bytes) in nvidia-smi's form: GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx."""
    raw = getattr(uuid, "bytes", uuid)
    if isinstance(raw, str):
        raw = raw.encode("latin-1")
    if not isinstance(raw, bytes | bytearray) or len(raw) != 16:
        return ""
    h = raw.hex()
    return f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"


def marker_thread(a: Any, default_pid: int) -> tuple[int, int]:
    """(pid, tid) of an NVTX marker; markers on other object kinds belong to no thread (tid 0)."""
    if a.object_kind != OBJECT_KIND_THREAD:
        return default_pid, 0
    pt = a.object_id.pt
    return (pt.process_id or default_pid), pt.thread_id


def has_valid_times(a: Any) -> bool:
    # CUPTI leaves end at 0 for work that never completed (a context torn down mid-kernel).
    return bool(0 < a.start <= a.end)


class ActivityConverter:
    """Converts batches of CUPTI activity records, keeping the little state that spans batches.

    State: context → device (synchronization records carry only a context), the launching thread of
    synchronize calls (their records carry no thread; the API record with the same correlation id does),
    and open NVTX ranges (start and end markers arrive as separate records, maybe in different buffers).
    Not thread-safe: the caller serialises batches.
    """

    def __init__(
        self, pid: int, to_monotonic: ToMonotonic, api_name: ApiName, *, max_pending: int = 65536,
        all_apis: bool = False,
    ) -> None:  # fmt: skip
        self.pid = pid
        self._to_mono = to_monotonic
        self._api_name = api_name
        self._max_pending = max_pending
        self._all_apis = all_apis
        self._names: dict[tuple[int, int], str] = {}
        # per API: (name, a quiet lookup left out, a call that can own a synchronization record), worked out
        # once, since every API record of a buffer asks
        self._apis: dict[tuple[int, int], tuple[str, bool, bool]] = {}
        self._ctx_device: dict[int, int] = {}
        self._sync_threads: dict[int, tuple[int, int]] = {}  # correlation id → (pid, tid)
        self._open_markers: dict[int, tuple[int, int, str, str, int]] = {}
        self._pending_syncs: list[Any] = []
        self.skipped: dict[str, int] = {}  # records not converted, by reason

    def convert(self, activities: Iterable[Any]) -> list[tuple[Any, ...]]:
        out: list[tuple[Any, ...]] = []
        for a in activities:
            rec = self._one(a)
            if rec is not None:
                out.append(rec)
        out.extend(self._resolve_syncs(final=False))
        return out

    def finish(self) -> list[tuple[Any, ...]]:
        """At the end of a capture: syncs whose API record never came, with tid 0; open ranges are counted."""
        out = self._resolve_syncs(final=True)
        self._skip("nvtx_unclosed", len(self._open_markers))
        self._open_markers.clear()
        return out

    def api_name(self, domain: int, cbid: int) -> str:
        key = (domain, cbid)
        name = self._names.get(key)
        if name is None:
            try:
                name = str(self._api_name(domain, cbid))
            except Exception:  # noqa: BLE001 - an unnamed call is still a call
                name = f"cbid:{cbid}"
            self._names[key] = name
        return name

    def _one(self, a: Any) -> tuple[Any, ...] | None:
        kind = a.kind
        if kind in (KIND_CONCURRENT_KERNEL, KIND_KERNEL, KIND_MEMCPY, KIND_MEMSET):
            return self._device_work(a, kind)
        if kind in (KIND_RUNTIME, KIND_DRIVER):
            return self._api(a, kind)
        if kind == KIND_SYNCHRONIZATION:
            self._pending_syncs.append(_SyncCopy(a))
            return None
        if kind == KIND_MARKER:
            return self._marker(a)
        if kind == KIND_CONTEXT:
            self._ctx_device[a.context_id] = a.device_id
            return None
        if kind == KIND_DEVICE:
            return device_record(a, self.pid)
        self._skip(f"kind_{kind}", 1)
        return None

    def _device_work(self, a: Any, kind: int) -> tuple[Any, ...] | None:
        if not has_valid_times(a):
            self._skip("incomplete", 1)
            return None
        self._ctx_device[a.context_id] = a.device_id
        if kind == KIND_MEMCPY:
            return memcpy_record(a, self.pid, self._to_mono)
        if kind == KIND_MEMSET:
            return memset_record(a, self.pid, self._to_mono)
        return kernel_record(a, self.pid, self._to_mono)

    def _api(self, a: Any, kind: int) -> CudaApi | None:
        key = (DOMAIN_DRIVER if kind == KIND_DRIVER else DOMAIN_RUNTIME, a.cbid)
        known = self._apis.get(key)
        if known is None:
            name = self.api_name(*key)
            known = self._apis[key] = (name, not self._all_apis and quiet_api(name),
                                       any(w in name for w in _SYNC_API_WORDS))  # fmt: skip
        name, quiet, sync = known
        if quiet:
            self._skip("quiet_api", 1)
            return None
        if not has_valid_times(a):
            self._skip("incomplete", 1)
            return None
        if sync:
            self._remember_sync_thread(a.correlation_id, a.process_id, a.thread_id)
        return api_record(a, name, self._to_mono)

    def _remember_sync_thread(self, correlation_id: int, pid: int, tid: int) -> None:
        if len(self._sync_threads) >= self._max_pending:
            self._sync_threads.pop(next(iter(self._sync_threads)))
        self._sync_threads[correlation_id] = (pid, tid)

    def _resolve_syncs(self, *, final: bool) -> list[tuple[Any, ...]]:
        out: list[tuple[Any, ...]] = []
        waiting: list[Any] = []
        for s in self._pending_syncs:
            thread = self._sync_threads.pop(s.correlation_id, None)
            if thread is None and not final and len(waiting) < self._max_pending:
                waiting.append(s)
                continue
            if thread is None:
                self._skip("sync_without_thread", 1)
            pid, tid = thread or (self.pid, 0)
            if has_valid_times(s):
                out.append(sync_record(s, pid, tid, self._ctx_device.get(s.context_id, -1), self._to_mono))
            else:
                self._skip("incomplete", 1)
        self._pending_syncs = waiting
        return out

    def _marker(self, a: Any) -> NvtxRange | None:
        flags = a.flags_
        pid, tid = marker_thread(a, self.pid)
        ts = self._to_mono(a.timestamp)
        domain = a.domain or ""
        if flags & MARKER_START:
            if len(self._open_markers) >= self._max_pending:
                self._open_markers.pop(next(iter(self._open_markers)))
                self._skip("nvtx_unclosed", 1)
            self._open_markers[a.id] = (pid, tid, a.name or "", domain, ts)
            return None
        if flags & MARKER_END:
            opened = self._open_markers.pop(a.id, None)
            if opened is None:
                self._skip("nvtx_end_without_start", 1)
                return None
            spid, stid, name, sdomain, start = opened
            return NvtxRange(spid, stid, name, start, max(ts, start), sdomain or domain)
        if flags & MARKER_INSTANTANEOUS:
            return NvtxRange(pid, tid, a.name or "", ts, ts, domain)
        self._skip("marker_other", 1)
        return None

    def _skip(self, why: str, n: int) -> None:
        if n:
            self.skipped[why] = self.skipped.get(why, 0) + n


class _SyncCopy:
    """The fields of a synchronization record, copied out: CUPTI reuses the buffer once the callback returns."""

    __slots__ = ("context_id", "correlation_id", "end", "start", "stream_id", "type")

    def __init__(self, a: Any) -> None:
        self.context_id, self.stream_id, self.correlation_id = a.context_id, a.stream_id, a.correlation_id
        self.start, self.end, self.type = a.start, a.end, a.type


# ------------------------------------------------------------------------------ recorded batches ----
# The attributes conversion reads, per kind: enough to replay a real GPU's records through the converter
# on a machine without one (tests/data/cupti/*.jsonl, written by CuptiBackend(record_path=...)).
_WORK = ("start", "end", "device_id", "context_id", "stream_id", "correlation_id")
RECORDED_FIELDS: dict[int, tuple[str, ...]] = {
    KIND_CONCURRENT_KERNEL: _WORK + ("name", "grid_x", "grid_y", "grid_z", "block_x", "block_y", "block_z"),
    KIND_KERNEL: _WORK + ("name", "grid_x", "grid_y", "grid_z", "block_x", "block_y", "block_z"),
    KIND_MEMCPY: _WORK + ("bytes", "copy_kind", "src_kind", "dst_kind"),
    KIND_MEMSET: _WORK + ("bytes",),
    KIND_RUNTIME: ("cbid", "start", "end", "process_id", "thread_id", "correlation_id", "return_value"),
    KIND_DRIVER: ("cbid", "start", "end", "process_id", "thread_id", "correlation_id", "return_value"),
    KIND_SYNCHRONIZATION: ("type", "start", "end", "context_id", "stream_id", "correlation_id"),
    KIND_MARKER: ("flags_", "timestamp", "id", "object_kind", "name", "domain"),
    KIND_CONTEXT: ("context_id", "device_id"),
    KIND_DEVICE: ("id", "name"),
}


def dump_activity(a: Any, api_name: ApiName | None = None) -> dict[str, Any]:
    """A CUPTI record as plain JSON-able data (API records also keep their callback name)."""
    d: dict[str, Any] = {"kind": a.kind}
    for field in RECORDED_FIELDS.get(a.kind, ()):
        d[field] = getattr(a, field)
    if a.kind == KIND_MARKER:
        pt = a.object_id.pt
        d["pt"] = [pt.process_id, pt.thread_id]
    elif a.kind == KIND_DEVICE:
        d["uuid"] = format_uuid(a.uuid)
    elif a.kind in (KIND_RUNTIME, KIND_DRIVER) and api_name is not None:
        d["api_name"] = api_name(DOMAIN_DRIVER if a.kind == KIND_DRIVER else DOMAIN_RUNTIME, a.cbid)
    return d


def load_activity(d: dict[str, Any]) -> Any:
    """The inverse of dump_activity: an object with the attributes conversion reads."""
    from types import SimpleNamespace

    a = SimpleNamespace(**{k: v for k, v in d.items() if k not in ("pt", "uuid", "api_name")})
    if "pt" in d:
        a.object_id = SimpleNamespace(pt=SimpleNamespace(process_id=d["pt"][0], thread_id=d["pt"][1]))
    if "uuid" in d:
        raw = bytes.fromhex(d["uuid"].removeprefix("GPU-").replace("-", "")) if d["uuid"] else b""
        a.uuid = SimpleNamespace(bytes=raw)
    return a


def recorded_api_names(batches: Iterable[Iterable[dict[str, Any]]]) -> dict[tuple[int, int], str]:
    """(domain, cbid) → name, from the names recorded beside API records."""
    names = {}
    for batch in batches:
        for d in batch:
            if "api_name" in d:
                names[(DOMAIN_DRIVER if d["kind"] == KIND_DRIVER else DOMAIN_RUNTIME, d["cbid"])] = d["api_name"]
    return names


def load_recording(path: str) -> tuple[dict[str, Any], list[list[dict[str, Any]]]]:
    """(meta, batches) of a file written by CuptiBackend(record_path=...), gzip-compressed if it ends in .gz."""
    import gzip
    import json

    meta: dict[str, Any] = {}
    batches: list[list[dict[str, Any]]] = []
    with (gzip.open if path.endswith(".gz") else open)(path, "rt", encoding="utf-8") as f:
        for line in f:
            obj = json.loads(line)
            if "meta" in obj:
                meta = obj["meta"]
            else:
                batches.append(obj["batch"])
    return meta, batches


def replay(path: str) -> tuple[list[tuple[Any, ...]], ActivityConverter]:
    """Converts a recording as the backend did live, with the clock offset it recorded."""
    meta, batches = load_recording(path)
    names = recorded_api_names(batches)
    offset = int(meta.get("realtime_offset_ns", 0))
    conv = ActivityConverter(int(meta.get("pid", 0)), lambda t: t - offset, lambda d, c: names[(d, c)])
    out: list[tuple[Any, ...]] = []
    for batch in batches:
        out += conv.convert([load_activity(d) for d in batch])
    return out + conv.finish(), conv
