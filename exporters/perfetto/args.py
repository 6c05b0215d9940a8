"""What the Perfetto exporter calls its slices and tracks, and which debug annotations they carry."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from gputrace.analysis.report import holders_text
from gputrace.documents import Stall
from gputrace.exporters.perfetto import proto as pp
from gputrace.probes.ebpf import uring
from gputrace.records import Collective, GpuKernel, GpuMemcpy

_DIRECTION = {"h2d": "HtoD", "d2h": "DtoH", "d2d": "DtoD", "h2h": "HtoH", "p2p": "PtoP"}


# The annotations of GPU work, encoded (pp.int_arg, pp.str_arg: what pp.debug_args writes for each).
_CORRELATION, _SEQ = pp.int_arg("correlation_id"), pp.int_arg("seq")
_PID, _CONTEXT, _BYTES, _RANK, _WORLD = (pp.int_arg(n, recurring=True) for n in ("pid", "context", "bytes", "rank",
                                                                                  "world"))
_GRID, _BLOCK, _COLLECTIVE, _KIND, _MEMORY = (pp.str_arg(n) for n in ("grid", "block", "collective", "direction",
                                                                       "memory"))
_MEMSET = pp.event_name("Memset")


def activity_fields(r: Any, coll: Collective | None) -> tuple[bytes, bytes]:
    """The encoded name and annotations of a kernel, copy or memset (a kernel of a collective says which):
    correlation_id, pid, context, then a kernel's grid and block (and its collective's name, seq, rank, world
    and bytes), a copy's bytes, direction and memory, a memset's bytes."""
    head = _CORRELATION(r.correlation_id) + _PID(r.pid) + _CONTEXT(r.context)
    if isinstance(r, GpuKernel):
        args = head + _GRID(_dims(r.grid)) + _BLOCK(_dims(r.block))
        if coll is not None:
            args += (_COLLECTIVE(coll.name) + _SEQ(coll.seq) + _RANK(coll.rank) + _WORLD(coll.world)
                     + _BYTES(coll.nbytes))
        return pp.event_name(r.name), args
    if isinstance(r, GpuMemcpy):
        name = pp.event_name(f"Memcpy {_DIRECTION.get(r.kind, r.kind)}")
        return name, head + _BYTES(r.nbytes) + _KIND(r.kind) + _MEMORY(r.memory)
    return _MEMSET, head + _BYTES(r.nbytes)


def _dims(v: Any) -> str:
    if type(v) is list and len(v) == 3 and type(v[0]) is int and type(v[1]) is int and type(v[2]) is int:
        return f"{v[0]}x{v[1]}x{v[2]}"  # as read from a capture: str(int(x)) of each
    try:
        return "x".join(str(int(x)) for x in v)
    except (TypeError, ValueError):
        return str(v)


def stall_args(st: Stall, dur: int) -> dict[str, Any]:
    """A report stall's culprit, object, bytes and hops, flattened to annotations."""
    args: dict[str, Any] = {"duration_ns": dur}
    raw = st.get("culprit")
    culprit: Mapping[str, Any] = raw if isinstance(raw, dict) else {}
    for k, name in (("comm", "culprit_comm"), ("pid", "culprit_pid"), ("tid", "culprit_tid"), ("op", "op"),
                    ("object", "object"), ("bytes", "bytes"), ("duration_ns", "culprit_duration_ns")):
        v = culprit.get(k)
        if v not in (None, "", 0):
            args[name] = v if isinstance(v, int | str | float) else str(v)
    for k in ("quota_us", "period_us", "cgroup_version", "throttled_ns", "cgroup_periods", "cgroup_throttled_periods",
              "cgroup_throttled_ns"):  # a cpu.throttled culprit's cgroup quota and what was measured
        if isinstance(culprit.get(k), int):
            args[k] = culprit[k]
    if isinstance(culprit.get("cpu_held_by"), list) and culprit["cpu_held_by"]:
        args["cpu_held_by"] = holders_text(culprit["cpu_held_by"])
    via = st.get("via") or []
    if via:
        args["via"] = " → ".join(str(v) for v in via)
    args["evidence"] = len(st.get("evidence") or [])
    return args


_UNITS = (("_pct", "%"), ("_mhz", "MHz"), ("_bytes", "B"), ("_mw", "mW"), ("_bps", "B/s"), ("_c", "C"))


def unit_of(metric: str) -> str:
    """An NVML metric's unit, from its name's suffix (gpu_util_pct, sm_clock_mhz, power_mw, ...)."""
    return next((u for suffix, u in _UNITS if metric.endswith(suffix)), "")


def header_int(header: dict[str, Any], key: str) -> int:
    """An integer field of the capture header; a missing or mistyped one counts as 0."""
    value = header.get(key, 0)
    return value if isinstance(value, int) and not isinstance(value, bool) else 0


_URING_FLAGS = ((uring.FIXED, "fixed file"), (uring.ASYNC, "async"), (uring.SQPOLL, "sqpoll"), (uring.MORE, "more"),
                (uring.UNFINISHED, "in flight at stop"), (uring.SKIP_CQE, "skip success CQE"))


def uring_flags(flags: int) -> str:
    """An io_uring request's flags in words ("fixed file, async")."""
    return ", ".join(word for bit, word in _URING_FLAGS if flags & bit)
