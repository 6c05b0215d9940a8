"""The CPU-sample half of the Perfetto check: a sequence's interned callstacks, and the samples that use them.

Every callstack, frame, function name, mapping and path id a PerfSample uses must have been interned earlier
in the same sequence (or in the same packet), after that sequence cleared its incremental state.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .perfetto_check import TraceCheck

SEQ_INCREMENTAL_STATE_CLEARED, SEQ_NEEDS_INCREMENTAL_STATE = 1, 2
_TS_MAX = (1 << 63) - 1  # the exporter clamps broken timestamps here: a sample at either end is suspect


@dataclass
class Sample:
    """One CPU sample, its callstack resolved from the interned data: ``frames`` root first, "func (module)"."""

    ts: int
    pid: int
    tid: int
    frames: list[str]
    index: int = 0  # packet index
    cpu: int = -1  # -1: the sample names no CPU

    @property
    def leaf(self) -> str:
        return self.frames[-1] if self.frames else ""


class Interned:
    """A sequence's interned data since it last cleared its incremental state, resolved to text."""

    def __init__(self) -> None:
        self.tables: dict[str, dict[int, Any]] = {k: {} for k in (
            "function_names", "mapping_paths", "build_ids", "mappings", "frames", "callstacks")}

    def define(self, check: TraceCheck, index: int, kind: str, iid: int, value: Any) -> None:
        table = self.tables[kind]
        if iid == 0:
            check.problem("interned", f"packet {index}: {kind} entry with iid 0 (iids start at 1)")
        elif table.get(iid, value) != value:
            check.problem("interned", f"packet {index}: {kind} iid {iid} redefined as something else")
        table[iid] = value

    def use(self, check: TraceCheck, index: int, kind: str, iid: int, user: str) -> Any:
        value = self.tables[kind].get(iid)
        if value is None:
            check.problem("interned", f"packet {index}: {user} uses {kind} iid {iid}, not interned before")
        return value


def check_interned_data(check: TraceCheck, index: int, state: Interned | None, data: Any) -> None:
    """Entries in dependency order: the trace processor reads a packet's interned data before using it."""
    if state is None:
        check.problem("interned", f"packet {index}: interned data before its sequence cleared incremental state")
        state = Interned()  # checked all the same, so one mistake is not reported many times over
    for kind in ("function_names", "mapping_paths", "build_ids"):
        for e in getattr(data, kind):
            state.define(check, index, kind, e.iid, e.str.decode("utf-8", "replace"))
    for m in data.mappings:
        parts = [state.use(check, index, "mapping_paths", p, f"mapping {m.iid}") for p in m.path_string_ids]
        if m.build_id:
            state.use(check, index, "build_ids", m.build_id, f"mapping {m.iid}")
        state.define(check, index, "mappings", m.iid, "/".join(p for p in parts if p))
    for f in data.frames:
        name = state.use(check, index, "function_names", f.function_name_id, f"frame {f.iid}")
        module = state.use(check, index, "mappings", f.mapping_id, f"frame {f.iid}")
        state.define(check, index, "frames", f.iid, f"{name} ({module})" if module else str(name))
    for c in data.callstacks:
        if not c.frame_ids:
            check.problem("interned", f"packet {index}: callstack {c.iid} has no frames")
        frames = [state.use(check, index, "frames", f, f"callstack {c.iid}") for f in c.frame_ids]
        state.define(check, index, "callstacks", c.iid, tuple(str(f) for f in frames))


def check_perf_sample(check: TraceCheck, index: int, state: Interned | None, pkt: Any) -> None:
    ps = pkt.perf_sample
    if state is None:
        check.problem("sample", f"packet {index}: CPU sample before its sequence cleared incremental state")
        return
    if not pkt.sequence_flags & SEQ_NEEDS_INCREMENTAL_STATE:
        check.problem("sample", f"packet {index}: CPU sample uses interned data without SEQ_NEEDS_INCREMENTAL_STATE")
    if not pkt.HasField("timestamp") or not 0 < pkt.timestamp < _TS_MAX:
        check.problem("sample", f"packet {index}: CPU sample without a plausible timestamp ({pkt.timestamp})")
    if ps.pid not in check.pids:  # a thread track's pid is in it too
        check.problem("sample", f"packet {index}: CPU sample of pid {ps.pid} tid {ps.tid}: no such thread or process "
                                "described before it")
    if not ps.HasField("callstack_iid"):
        check.problem("sample", f"packet {index}: CPU sample without a callstack")
        return
    frames = state.use(check, index, "callstacks", ps.callstack_iid, "CPU sample")
    cpu = ps.cpu if ps.HasField("cpu") else -1
    check.samples.append(Sample(pkt.timestamp, ps.pid, ps.tid, list(frames or ()), index, cpu))
