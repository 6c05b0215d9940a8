"""Checks on everything an agent sends, done by the session: a peer is a traced process, not a friend.

Only GPU-side record kinds are accepted, each row with the right arity and field types, and a row's pid
must be the peer's own (SO_PEERCRED): a process cannot speak for another one. A peer in a container's pid
namespace names itself and its threads by its own ids; they are rewritten to the session's
(daemon/agents/pidns.py).
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from itertools import chain
from operator import le
from typing import Any, TypeGuard

from gputrace.agent.wire import PROTOCOL, FrameError
from gputrace.capture import exact_columns
from gputrace.daemon.agents.pidns import PeerIds
from gputrace.records import (
    AgentInfo,
    AgentThread,
    Collective,
    CollectiveCall,
    CudaApi,
    Drops,
    GpuDevice,
    GpuKernel,
    GpuMemcpy,
    GpuMemset,
    GpuSync,
    NvtxRange,
)  # fmt: skip

ALLOWED_KINDS: tuple[type[Any], ...] = (
    GpuDevice, GpuKernel, GpuMemcpy, GpuMemset, CudaApi, GpuSync, NvtxRange, Collective, CollectiveCall, AgentInfo,
    AgentThread, Drops,
)  # fmt: skip
MAX_STR = 65536
MAX_INT = (1 << 64) - 1
MIN_INT = -(1 << 63)


def _is_int(v: Any) -> TypeGuard[int]:
    return type(v) is int and MIN_INT <= v <= MAX_INT


def _is_dims(v: Any) -> bool:
    return isinstance(v, list | tuple) and len(v) == 3 and all(_is_int(x) for x in v)


CHECKS: dict[str, Callable[[Any], bool]] = {
    "int": _is_int,
    "bool": lambda v: type(v) is bool,
    "str": lambda v: type(v) is str and len(v) <= MAX_STR,
    "float": lambda v: type(v) in (int, float),
    "tuple[int, int, int]": _is_dims,
}


def _annotation(cls: type[Any], field: str) -> str:
    """A field's declared type as written (records.py uses postponed annotations: strings or ForwardRefs)."""
    a = cls.__annotations__[field]
    return str(getattr(a, "__forward_arg__", a if isinstance(a, str) else getattr(a, "__name__", a)))


class Schema:
    """How to check and build one record kind from a positional row."""

    def __init__(self, cls: type[Any]) -> None:
        self.cls = cls
        self.kind = cls.__name__
        fields = list(cls._fields)
        self.arity = len(fields)
        types = [_annotation(cls, f) for f in fields]
        self.checks = [CHECKS[t] for t in types]
        self.dims = [i for i, t in enumerate(types) if t.startswith("tuple")]
        self.pid_at = fields.index("pid") if "pid" in fields else -1
        self.tid_at = fields.index("tid") if "tid" in fields else -1
        self.span = (fields.index("start_ns"), fields.index("end_ns")) if "start_ns" in fields else None
        self.ints = [i for i, t in enumerate(types) if t == "int"]
        self.strs = [i for i, t in enumerate(types) if t == "str"]
        self._make = functools.partial(tuple.__new__, cls)

    def build(self, row: Any, ids: PeerIds) -> tuple[Any, ...]:
        if not isinstance(row, list) or len(row) != self.arity:
            raise FrameError(f"{self.kind} row is not a list of {self.arity} fields")
        for i, check in enumerate(self.checks):
            if not check(row[i]):
                raise FrameError(f"{self.kind} field {self.cls._fields[i]} has a bad value")
        if self.pid_at >= 0:
            if row[self.pid_at] != ids.own_pid:
                raise FrameError(f"{self.kind} row claims pid {row[self.pid_at]}, peer is pid {_named(ids)}")
            row[self.pid_at] = ids.host_pid
        if self.tid_at >= 0 and ids.nested:
            row[self.tid_at] = ids.tid(row[self.tid_at])
        if self.span and not 0 <= row[self.span[0]] <= row[self.span[1]]:
            raise FrameError(f"{self.kind} row ends before it starts")
        for i in self.dims:
            row[i] = tuple(row[i])
        if self.cls is Drops:  # a peer's losses are filed under the agent source and its pid
            row = [row[0], "agent", f"pid{ids.host_pid}.{row[2]}", row[3]]
        return self.cls._make(row)  # type: ignore[no-any-return]

    def build_rows(self, rows: list[Any], ids: PeerIds) -> list[tuple[Any, ...]] | None:
        """``build`` of every row at once, checked column by column in C loops (``capture.exact_columns``: each
        value exactly its field's type, then bounds, the pid, the spans); None where any row fails a check
        (``build``, row by row, then names the first)."""
        n = len(rows)
        if not n or self.cls is Drops:
            return None
        columns = exact_columns(self.kind, rows)
        if columns is None or len(rows[0]) != self.arity:
            return None
        for i in self.ints:
            if min(columns[i]) < MIN_INT or max(columns[i]) > MAX_INT:
                return None
        for i in self.strs:
            if max(map(len, columns[i])) > MAX_STR:
                return None
        for i in self.dims:
            values = list(chain.from_iterable(columns[i]))
            if min(values) < MIN_INT or max(values) > MAX_INT:
                return None
            columns[i] = tuple(map(tuple, columns[i]))
        if self.span is not None:
            starts, ends = columns[self.span[0]], columns[self.span[1]]
            if min(starts) < 0 or not all(map(le, starts, ends)):
                return None
        if self.pid_at >= 0:
            if set(columns[self.pid_at]) != {ids.own_pid}:
                return None
            columns[self.pid_at] = (ids.host_pid,) * n
        if self.tid_at >= 0 and ids.nested:
            columns[self.tid_at] = tuple(map(ids.tid, columns[self.tid_at]))
        return list(map(self._make, zip(*columns, strict=True)))


SCHEMAS = {cls.__name__: Schema(cls) for cls in ALLOWED_KINDS}


def _named(ids: PeerIds) -> str:
    return f"{ids.host_pid} ({ids.own_pid} in its pid namespace)" if ids.nested else str(ids.host_pid)


def batch_records(msg: dict[str, Any], ids: PeerIds) -> list[tuple[Any, ...]]:
    """The records of a ``batch`` message, or FrameError naming the first thing wrong."""
    groups = msg.get("records")
    if not isinstance(groups, list):
        raise FrameError("batch without a records list")
    out: list[tuple[Any, ...]] = []
    for group in groups:
        if not (isinstance(group, list) and len(group) == 2 and isinstance(group[1], list)):
            raise FrameError("batch group is not [kind, rows]")
        schema = SCHEMAS.get(group[0]) if isinstance(group[0], str) else None
        if schema is None:
            raise FrameError(f"record kind {str(group[0])[:40]!r} is not accepted from an agent")
        built = schema.build_rows(group[1], ids)
        out.extend(built if built is not None else (schema.build(row, ids) for row in group[1]))
    return out


def _short_str(v: Any, limit: int = 4096) -> bool:
    return type(v) is str and len(v) <= limit


def hello_fields(msg: dict[str, Any], ids: PeerIds) -> dict[str, Any]:
    """The checked content of a ``hello``; its pid must be the peer's (as the peer sees it); the ids
    returned are the session's."""
    if msg.get("protocol", PROTOCOL) != PROTOCOL:
        raise FrameError(f"agent speaks protocol {str(msg.get('protocol'))[:20]}, this session {PROTOCOL}")
    if msg.get("pid") != ids.own_pid:
        raise FrameError(f"hello claims pid {str(msg.get('pid'))[:20]}, peer is pid {_named(ids)}")
    tid: Any = msg.get("tid")
    backends = msg.get("backends", [])
    unavailable = msg.get("unavailable", {})
    strings = [msg.get(k, "") for k in ("interpreter", "cuda_version", "driver_version")]
    if not (_is_int(tid) and all(_short_str(s) for s in strings)):
        raise FrameError("hello with bad tid or version fields")
    if not (isinstance(backends, list) and len(backends) <= 16 and all(_short_str(b, 64) for b in backends)):
        raise FrameError("hello with a bad backends list")
    if not (isinstance(unavailable, dict) and len(unavailable) <= 16
            and all(_short_str(k, 64) and _short_str(v) for k, v in unavailable.items())):
        raise FrameError("hello with a bad unavailable map")
    return {"pid": ids.host_pid, "tid": ids.tid(tid), "interpreter": strings[0], "cuda_version": strings[1],
            "driver_version": strings[2], "backends": backends, "unavailable": unavailable}


def drop_counts(msg: dict[str, Any]) -> dict[str, int]:
    counts = msg.get("counts")
    if not (isinstance(counts, dict) and len(counts) <= 64
            and all(_short_str(k, 64) and _is_int(v) and v >= 0 for k, v in counts.items())):
        raise FrameError("drops message without a map of counts")
    return dict(counts)


def cpu_ns(msg: dict[str, Any]) -> int:
    """An agent's own CPU time (ns), as its cost message says: a count, below a century."""
    value = msg.get("cpu_ns")
    if type(value) is not int or not 0 <= value < 100 * 365 * 86400 * 10**9:
        raise FrameError("cost message without a CPU time")
    return value
