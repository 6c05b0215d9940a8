"""The JSON documents gputrace writes, as types the checker sees: the report (``gputrace.report/1``, docs/report.md),
the comparison of two reports (``gputrace.compare/1``) and the host check (``gputrace.doctor/1``).

Producers build these dicts and readers (the viewers, the exporters, ``compare``) index them by literal keys, so
mypy checks every key and value type on both sides. ``NotRequired`` marks keys written only when they apply.
The JSON Schemas in docs/ (``docs/report.schema.json`` ...) are generated from these types
(``python -m gputrace.testing.schemas``); ``OneOf`` narrows a string to the values this version writes.
Annotations are evaluated here (no ``from __future__ import annotations``): ``NotRequired`` must be seen when
each class is made for ``__required_keys__``, which the generator reads, to be right.
"""

from dataclasses import dataclass
from typing import Annotated, NotRequired, TypedDict

REPORT_SCHEMA = "gputrace.report/1"
COMPARE_SCHEMA = "gputrace.compare/1"
DOCTOR_SCHEMA = "gputrace.doctor/1"
CAUSES = ("storage", "network", "collective", "cpu", "cpu.runqueue", "cpu.throttled", "sync", "sleep", "device",
          "launch", "tracing", "unknown")
EVIDENCE_KINDS = ("syscall", "block", "offcpu", "wakeup", "gpu", "dirty", "collective")


@dataclass(frozen=True)
class OneOf:
    """Schema metadata on a ``str`` (``Annotated[str, OneOf(...)]``): the values allowed."""

    values: tuple[str, ...]


Cause = Annotated[str, OneOf(CAUSES)]

# ---- gputrace.report/1: the capture section ----


class ProgramCost(TypedDict):
    runs: int
    ns: int


class Overhead(TypedDict):
    """What tracing cost, measured in the capture: ``cpu_share`` of the host's CPU time over ``window_ns``."""

    cpu_share: float
    by_source: dict[str, int]
    window_ns: NotRequired[int]
    host_cpus: NotRequired[int]
    events: dict[str, int]
    wakeups: dict[str, int]
    events_per_s: dict[str, float]
    programs: NotRequired[dict[str, ProgramCost]]
    missing: NotRequired[dict[str, str]]


class InFlightRequest(TypedDict):
    op: str
    object: str
    fd: int
    start_ns: int
    duration_ns: int


class InProgressThread(TypedDict):
    """A thread still waiting when the capture stopped."""

    pid: int
    tid: int
    comm: str
    op: str
    object: str
    state: str
    start_ns: int
    duration_ns: int
    since_before_capture: bool
    requests_in_flight: NotRequired[int]
    requests: NotRequired[list[InFlightRequest]]


class CpuCgroup(TypedDict):
    """A sampled cpu cgroup with a quota, and its counters' increase over the capture."""

    path: str
    version: int
    quota_us: int
    period_us: int
    periods: int
    throttled_periods: int
    throttled_ns: int


class CgroupError(TypedDict):
    path: str
    error: str


class DeviceTimingFrom(TypedDict):
    pid: int
    ns: int


class Attached(TypedDict):
    """A ``-p`` target's agent: how it got there."""

    pid: int
    how: str
    method: NotRequired[str]
    pause_ms: NotRequired[float]


class CaptureInfo(TypedDict):
    """The capture: its window on the capture clock, the traced pids, what each source lost."""

    start_ns: int
    end_ns: int
    pids: list[int]
    host: str
    drops: dict[str, int]
    complete: bool
    records: dict[str, int]
    stop_reason: NotRequired[str]
    problem: NotRequired[str]
    malformed_records: NotRequired[int]
    unknown_record_kinds: NotRequired[dict[str, int]]
    ebpf_missing: NotRequired[str]
    skipped_probes: NotRequired[dict[str, int]]
    in_progress: NotRequired[list[InProgressThread]]
    in_progress_threads: NotRequired[int]
    cpu_cgroups: NotRequired[list[CpuCgroup]]
    cpu_cgroup_errors: NotRequired[list[CgroupError]]
    left_out: NotRequired[int]
    off: NotRequired[list[str]]
    overhead: NotRequired[Overhead]
    device_timing_from_ns: NotRequired[int]
    device_timing_from: NotRequired[list[DeviceTimingFrom]]
    attached: NotRequired[list[Attached]]


# ---- devices and summary ----


class CudaId(TypedDict):
    pid: int
    id: int


class Device(TypedDict):
    """A GPU (or simulated device) and its analysed window."""

    id: int
    name: str
    simulated: bool
    busy_ns: int
    idle_ns: int
    window_ns: int
    first_ns: int
    last_ns: int
    stall_ns: int
    stalls: int
    collective_wait_ns: int
    pid: NotRequired[int]
    uuid: NotRequired[str]
    cuda_ids: NotRequired[list[CudaId]]
    nvml_util_pct: NotRequired[float]
    host: NotRequired[str]


class InputBound(TypedDict):
    input_ns: int
    pct: float
    verdict: str
    thresholds_pct: list[float]


class Summary(TypedDict):
    window_ns: int
    busy_ns: int
    stall_ns: int
    stalls: int
    by_cause: dict[str, int]
    input_bound: InputBound


# ---- stalls ----


class Holder(TypedDict):
    """A task that had the CPU a run-queue wait waited for."""

    pid: int
    tid: int
    comm: str
    ns: int


class Frame(TypedDict):
    frame: str
    samples: int
    pct: float


class Task(TypedDict):
    pid: int
    tid: int
    comm: str


class DirtyFields(TypedDict, total=False):
    """A storage culprit's pauses for dirty pages (balance_dirty_pages)."""

    dirty_pauses: int
    dirty_paused_ns: int
    dirty_calls: int
    dirty_device: str
    dirty_bytes: int
    dirty_setpoint_bytes: int


class CgroupFields(TypedDict, total=False):
    """A ``cpu.throttled`` culprit's cgroup (its ``object`` is the cgroup's path), quota and what was measured."""

    cgroup_version: int
    quota_us: int
    period_us: int
    throttled_ns: int
    cgroup_periods: int
    cgroup_throttled_periods: int
    cgroup_throttled_ns: int
    cgroup_counted_from_ns: int  # the cgroup was first read after the stall began: its counters from then


class SampledFields(TypedDict, total=False):
    """A ``cpu`` culprit's CPU samples in the window and its most-sampled leaf frames."""

    frames: list[Frame]
    samples: int


class BlockFields(TypedDict, total=False):
    """The block requests under a storage call (docs/report.md, "Block requests under a read")."""

    block_requests: int
    block_bytes: int
    block_device: str
    block_latency_ns: int
    block_attribution: Annotated[str, OneOf(("submitted", "dispatched"))]
    dispatched_by: str
    block_shared: bool
    block_shared_with: list[int]


class ThrottleFields(CgroupFields, total=False):
    """What a throttled wait adds to its culprit: the cgroup as ``object``, and its quota."""

    object: str


class UringFields(TypedDict, total=False):
    io_uring_requests: int
    ring_fd: int


class Culprit(DirtyFields, CgroupFields, SampledFields, BlockFields, UringFields):
    """Who or what a stall waited on: the process whose action was the root cause, the operation and its
    object (a path, ``host:port``, a collective instance, a cgroup). ``unknown`` has an empty culprit."""

    pid: int
    tid: int
    comm: str
    op: str
    object: str
    bytes: int
    duration_ns: int
    host: NotRequired[str]
    rank: NotRequired[int]
    offset: NotRequired[int]
    filesystem: NotRequired[str]
    served_by: NotRequired[Task]
    pid_in_namespace: NotRequired[int]
    cpu_held_by: NotRequired[list[Holder]]


class Evidence(TypedDict):
    """A record that proves a stall's explanation, with its exact times."""

    pid: int
    tid: int
    kind: Annotated[str, OneOf(EVIDENCE_KINDS)]
    what: str
    start_ns: int
    end_ns: int
    waker_pid: NotRequired[int]
    waker_tid: NotRequired[int]
    wake_ns: NotRequired[int]
    host: NotRequired[str]


class BreakdownEntry(TypedDict):
    """A stall's time by (cause, process, object); the entries add up to the whole stall."""

    cause: Cause
    pid: int
    object: str
    ns: int
    objects: NotRequired[int]


class LateRank(TypedDict):
    """Why a collective's late rank arrived late, on its own records."""

    cause: Cause
    culprit: Culprit
    via: list[str]


class Verdict(TypedDict):
    """A stall's explanation, before its device, times and host are added."""

    cause: Cause
    via: list[str]
    culprit: Culprit
    evidence: list[Evidence]
    why: NotRequired[str]
    breakdown: NotRequired[list[BreakdownEntry]]
    remote_fs: NotRequired[bool]
    late_rank: NotRequired[LateRank]
    late_rank_cause: NotRequired[LateRank]


class StallPlace(TypedDict):
    """Where a stall is: its device (and the device's process, for a simulated one) and times."""

    device: int
    start_ns: int
    end_ns: int
    duration_ns: int
    device_pid: NotRequired[int]


class Stall(StallPlace, Verdict):
    """A GPU idle gap of at least the minimum gap, and what it waited on."""

    host: str
    overlaps_drops: bool


# ---- the rest of the report ----


class TopCulprit(TypedDict):
    kind: str
    culprit: str
    stall_ns: int
    stalls: int
    share_pct: float


class TopProcess(TypedDict):
    pid: int
    comm: str
    gpu_process: bool
    stall_ns: int
    share_pct: float
    stalls: int
    by_cause: dict[str, int]
    pid_in_namespace: NotRequired[int]
    host: NotRequired[str]


class Arrival(TypedDict):
    """The stall a rank's collective kernel ended (a call on the host: its thread's time since its previous
    collective call returned): why that rank arrived when it did."""

    cause: Cause
    culprit: Culprit
    via: list[str]
    stall_ns: int


class CollectiveRow(TypedDict):
    """One rank's part in one collective instance."""

    comm: str
    seq: int
    op: str
    bytes: int
    rank: int
    world: int
    host: str
    pid: int
    device: int
    kernel: str
    tid: NotRequired[int]  # a host-side call (device -1): the calling thread and its backend
    backend: NotRequired[str]
    enqueued_ns: int
    started_ns: int
    completed_ns: int
    waited_ns: int
    ranks_captured: int
    late: NotRequired[bool]
    arrival: NotRequired[Arrival]


class JoinedCapture(TypedDict):
    """One of several captures of a job, and how its clock was put on the first's."""

    name: str
    host: str
    job: int
    capture: CaptureInfo
    shift_ns: int
    header_shift_ns: int
    correction_ns: int
    uncertainty_ns: int | None
    anchors: int
    joined: bool


class JoinInfo(TypedDict):
    captures: int
    jobs: list[list[int]]
    clock: str
    uncertainty_ns: int | None
    notes: list[str]


class Report(TypedDict):
    """``gputrace.report/1``: what each GPU stall of a capture (or of one job's captures) waited on. Times are
    nanoseconds on the capture clock (the first capture's, for several)."""

    schema: Annotated[str, OneOf((REPORT_SCHEMA,))]
    capture: CaptureInfo
    devices: list[Device]
    summary: Summary
    stalls: list[Stall]
    top_culprits: list[TopCulprit]
    top_processes: list[TopProcess]
    min_gap_ns: int
    collectives: NotRequired[list[CollectiveRow]]
    captures: NotRequired[list[JoinedCapture]]
    join: NotRequired[JoinInfo]


# ---- gputrace.compare/1 ----


class SideDevice(TypedDict):
    id: int
    name: str
    simulated: bool


class Side(TypedDict):
    """One run of a comparison: its GPU window, busy and stall time (and their shares of the window)."""

    window_ns: int
    busy_ns: int
    busy_pct: float
    stall_ns: int
    stall_pct: float
    stalls: int
    input_bound_pct: float | None
    devices: list[SideDevice]
    complete: bool
    lost: str
    min_gap_ns: int | None


class CauseChange(TypedDict):
    cause: str
    before_ns: int
    after_ns: int
    before_pct: float
    after_pct: float
    change_points: float | None


class CulpritChange(TypedDict):
    kind: str
    culprit: str
    before_ns: int
    after_ns: int
    before_pct: float
    after_pct: float


class ProcessChange(TypedDict):
    """Processes of one name (and whether their GPU stalled) in each run."""

    comm: str
    gpu_process: bool
    before_processes: int
    after_processes: int
    before_ns: int
    after_ns: int
    before_pct: float
    after_pct: float
    change_points: float | None


class Comparison(TypedDict):
    """``gputrace.compare/1``: two reports side by side, as shares of each run's GPU window (percentage
    points for the changes; null where a run has no GPU window)."""

    schema: Annotated[str, OneOf((COMPARE_SCHEMA,))]
    before: Side
    after: Side
    busy_change_points: float | None
    stall_change_points: float | None
    input_change_points: float | None
    by_cause: list[CauseChange]
    culprits: list[CulpritChange]
    processes: list[ProcessChange]
    notes: list[str]


# ---- gputrace.doctor/1 ----


class CheckResult(TypedDict):
    """One host check: what was found and, for a problem, the fix. A FAIL of a required check means
    ``gputrace capture`` cannot run."""

    name: str
    status: Annotated[str, OneOf(("OK", "WARN", "FAIL", "INFO"))]
    detail: str
    fix: str
    required: bool


class Doctor(TypedDict):
    """``gputrace.doctor/1``: what works on this host."""

    schema: Annotated[str, OneOf((DOCTOR_SCHEMA,))]
    version: str
    ok: bool
    checks: list[CheckResult]
