"""Watch mode's metrics: per job and device, from each flight segment, as a node_exporter textfile.

Every segment adds its GPU busy time and stall time (counted exactly from its GPU records: tally.py). A
segment that got the full analysis adds its stall time by cause and culprit as the report gives them; one that
did not (watcher.py keeps the analysis within its CPU budget) has its stall time split by cause and culprit in
the shares of the job's last analysed segment, and is counted in ``estimated``.

Label cardinality is bounded: jobs are at most the watched ones plus KEEP_ENDED ended ones; causes are the
report's fixed set; culprit objects are the TOP_OBJECTS largest per job (the rest summed as "other", at most
MAX_OBJECTS tracked per job). The file is written whole to a temporary file beside it and renamed over it, so
node_exporter never reads half of one.
"""

from __future__ import annotations

import contextlib
import math
import os
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

from gputrace.daemon.watch.tally import SegmentGpu
from gputrace.documents import Report

TOP_OBJECTS = 5
MAX_OBJECTS = 64
OTHER = "other"
UNKNOWN = "unknown"


@dataclass
class JobMetrics:
    segments: int = 0
    stall_ns: dict[str, int] = field(default_factory=dict)  # by cause
    objects: dict[tuple[str, str], int] = field(default_factory=dict)  # (cause, culprit object) -> ns
    busy_ratio: float | None = None  # the job's, over its last segment with GPU records
    device_busy: dict[str, float] = field(default_factory=dict)  # device -> ratio, last segment
    device_busy_ns: dict[str, int] = field(default_factory=dict)  # device -> ns, all segments
    nvml_util: dict[str, float] = field(default_factory=dict)  # device -> NVML's utilization, last segment
    drops: dict[str, int] = field(default_factory=dict)
    dumps: dict[str, int] = field(default_factory=dict)  # by trigger kind
    cpu_share: float | None = None  # tracing's share of the host CPU for this job (probes and agents)
    analysed: int = 0  # segments with GPU records that got the full analysis
    estimated: int = 0  # ... that did not: their stall time split as in the last analysed one
    shares: dict[str, float] = field(default_factory=dict)  # cause -> share of the last analysed stall time
    object_shares: dict[tuple[str, str], float] = field(default_factory=dict)  # (cause, object) -> share

    def add(self, report: Report, drops: dict[str, int]) -> None:
        """One analysed segment's figures."""
        self.segments += 1
        self.analysed += 1
        summary = report.get("summary", {})
        by_cause = {cause: int(ns) for cause, ns in summary.get("by_cause", {}).items()}
        for cause, ns in by_cause.items():
            self.stall_ns[cause] = self.stall_ns.get(cause, 0) + ns
        objects: dict[tuple[str, str], int] = {}
        for stall in report.get("stalls", []):
            culprit = (stall.get("cause", UNKNOWN), str((stall.get("culprit") or {}).get("object") or "") or OTHER)
            objects[culprit] = objects.get(culprit, 0) + int(stall.get("duration_ns", 0))
        for (cause, obj), ns in objects.items():
            self._object(cause, obj, ns)
        total = sum(by_cause.values())
        if total > 0:
            self.shares = {cause: ns / total for cause, ns in by_cause.items()}
            self.object_shares = {culprit: ns / total for culprit, ns in objects.items()}
        window = int(summary.get("window_ns", 0))
        self.busy_ratio = round(int(summary.get("busy_ns", 0)) / window, 4) if window > 0 else None
        self.device_busy, self.nvml_util = {}, {}
        for dev in report.get("devices", []):
            key = str(dev.get("id", ""))
            busy, idle = int(dev.get("busy_ns", 0)), int(dev.get("idle_ns", 0))
            if busy + idle > 0:
                self.device_busy[key] = round(busy / (busy + idle), 4)
            self.device_busy_ns[key] = self.device_busy_ns.get(key, 0) + busy
            if "nvml_util_pct" in dev:
                self.nvml_util[key] = float(dev["nvml_util_pct"]) / 100
        self._drops(drops)

    def add_tally(self, gpu: SegmentGpu, drops: dict[str, int]) -> None:
        """A segment without the full analysis: busy and stall time from its GPU records, the stall time split
        in the last analysed segment's shares (all "unknown" before there are any)."""
        self.segments += 1
        self._drops(drops)
        if not gpu.devices:
            return
        self.estimated += 1
        ratio = gpu.busy_ratio()
        self.busy_ratio = round(ratio, 4) if ratio is not None else None
        busy: dict[str, list[int]] = {}  # device id -> [busy, window] over the job's processes
        for (_, index), t in gpu.devices.items():
            acc = busy.setdefault(str(index), [0, 0])
            acc[0] += t.busy_ns
            acc[1] += t.window_ns
        self.device_busy = {name: round(b / w, 4) for name, (b, w) in busy.items() if w > 0}
        for name, (b, _) in busy.items():
            self.device_busy_ns[name] = self.device_busy_ns.get(name, 0) + b
        stall = gpu.stall_ns
        for cause, share in (self.shares or {UNKNOWN: 1.0}).items():
            self.stall_ns[cause] = self.stall_ns.get(cause, 0) + round(stall * share)
        for (cause, obj), share in (self.object_shares or {(UNKNOWN, OTHER): 1.0}).items():
            self._object(cause, obj, round(stall * share))

    def _drops(self, drops: dict[str, int]) -> None:
        for k, v in drops.items():
            self.drops[k] = self.drops.get(k, 0) + int(v)

    def _object(self, cause: str, obj: str, ns: int) -> None:
        key = (cause, obj)
        if key not in self.objects and len(self.objects) >= MAX_OBJECTS:
            key = (cause, OTHER)
        self.objects[key] = self.objects.get(key, 0) + ns

    def top_objects(self) -> dict[tuple[str, str], int]:
        """The TOP_OBJECTS largest culprits; the rest summed per cause under "other"."""
        ranked = sorted(self.objects.items(), key=lambda kv: -kv[1])
        out = dict(ranked[:TOP_OBJECTS])
        for (cause, _), ns in ranked[TOP_OBJECTS:]:
            out[(cause, OTHER)] = out.get((cause, OTHER), 0) + ns
        return out


# name -> (kind, unit, help): every metric watch mode exports, in the textfile and by OTLP alike
METRICS: dict[str, tuple[str, str, str]] = {
    "gputrace_stall_seconds_total": ("counter", "s", "GPU stall time by cause (segments not analysed split as the "
                                     "last analysed one)"),
    "gputrace_stall_culprit_seconds_total": ("counter", "s", f"GPU stall time by culprit object (the {TOP_OBJECTS} "
                                             "largest per job, the rest as other)"),
    "gputrace_gpu_busy_ratio": ("gauge", "1", "share of the last flight segment the job's GPUs were busy "
                                "(device=\"all\": the job's; measured from kernel, copy and set times)"),
    "gputrace_gpu_busy_seconds_total": ("counter", "s", "GPU busy time measured"),
    "gputrace_nvml_utilization_ratio": ("gauge", "1", "NVML's utilization over the last analysed segment"),
    "gputrace_dropped_records_total": ("counter", "1", "records lost, by source"),
    "gputrace_tracing_cpu_ratio": ("gauge", "1", "share of the host's CPU the job's probes and agents took "
                                   "(the cost meter)"),
    "gputrace_flight_bytes": ("gauge", "By", "bytes the job's flight recorder holds on disk"),
    "gputrace_flight_dumps_total": ("counter", "1", "flight recorder dumps, by trigger"),
    "gputrace_watched_jobs": ("gauge", "1", "GPU jobs watched now"),
    "gputrace_watch_refused_total": ("counter", "1", "GPU processes not watched: the job cap was reached"),
    "gputrace_watch_released_total": ("counter", "1", "jobs found by their arming alone let go: no GPU work in "
                                      "--watch-idle-s"),
    "gputrace_watch_cpu_seconds_total": ("counter", "s", "CPU time of watch mode's own scan and analysis"),
    "gputrace_watch_segments_analysed_total": ("counter", "1", "flight segments given the full analysis"),
    "gputrace_watch_segments_estimated_total": ("counter", "1", "flight segments with GPU records not analysed "
                                                "(over the analysis budget, nothing changed): their stall time "
                                                "split as the last analysed segment"),
    "gputrace_watch_analysis_skipped_total": ("counter", "1", "flight segments not analysed: the queue was full"),
}


class Sample(NamedTuple):
    name: str  # a key of METRICS
    value: float
    labels: dict[str, str]


def samples(jobs: Iterable[Any], watcher: Any) -> list[Sample]:
    """Every metric of every job, then the watch mode's own."""
    out: list[Sample] = []

    def add(name: str, value: float, **labels: object) -> None:
        out.append(Sample(name, value, {k: str(v) for k, v in labels.items()}))

    for job in sorted(jobs, key=lambda j: (j.pid, j.found.start)):
        m: JobMetrics = job.metrics
        ids = {"pid": job.pid, "comm": job.found.comm}
        for cause, ns in sorted(m.stall_ns.items()):
            add("gputrace_stall_seconds_total", ns / 1e9, **ids, cause=cause)
        for (cause, obj), ns in sorted(m.top_objects().items()):
            add("gputrace_stall_culprit_seconds_total", ns / 1e9, **ids, cause=cause, object=obj)
        if m.busy_ratio is not None:
            add("gputrace_gpu_busy_ratio", m.busy_ratio, **ids, device="all")
        for dev, ratio in sorted(m.device_busy.items()):
            add("gputrace_gpu_busy_ratio", ratio, **ids, device=dev)
        for dev, ns in sorted(m.device_busy_ns.items()):
            add("gputrace_gpu_busy_seconds_total", ns / 1e9, **ids, device=dev)
        for dev, ratio in sorted(m.nvml_util.items()):
            add("gputrace_nvml_utilization_ratio", ratio, **ids, device=dev)
        for source, n in sorted(m.drops.items()):
            add("gputrace_dropped_records_total", n, **ids, source=source)
        if m.cpu_share is not None:
            add("gputrace_tracing_cpu_ratio", m.cpu_share, **ids)
        if job.recorder is not None:
            add("gputrace_flight_bytes", job.recorder.bytes_held(), **ids)
        for kind, n in sorted(m.dumps.items()):
            add("gputrace_flight_dumps_total", n, **ids, trigger=kind)
    status = watcher.status(0)
    cost = status["cost"]
    add("gputrace_watched_jobs", status["watching"])
    add("gputrace_watch_refused_total", status["refused"])
    add("gputrace_watch_released_total", status["released"])
    add("gputrace_watch_cpu_seconds_total", cost["scan_cpu_s"] + cost["analysis_cpu_s"])
    add("gputrace_watch_segments_analysed_total", cost["segments_analysed"])
    add("gputrace_watch_segments_estimated_total", cost["segments_estimated"])
    add("gputrace_watch_analysis_skipped_total", cost["analysis_skipped"])
    return out


def _label(value: object) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")[:200]


def render(jobs: Iterable[Any], watcher: Any) -> str:
    """The textfile's content, in node_exporter's text format."""
    lines: list[str] = []
    declared: set[str] = set()
    for name, value, labels in [*samples(jobs, watcher), Sample(WRITTEN, time.time(), {})]:
        if name not in declared:
            declared.add(name)
            kind, _, help_text = METRICS.get(name, ("gauge", "", "when this file was written"))
            lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        text = ",".join(f'{k}="{_label(v)}"' for k, v in labels.items())
        lines.append(f"{name}{{{text}}} {_number(value)}" if labels else f"{name} {_number(value)}")
    return "\n".join(lines) + "\n"


def _number(value: float) -> str:
    """A value as the text format writes it: the shortest text that reads back as the same float (the OTLP
    export carries the same figures, exactly), and Prometheus's spelling of the non-finite ones."""
    v = float(value)
    if math.isnan(v):
        return "NaN"
    if math.isinf(v):
        return "+Inf" if v > 0 else "-Inf"
    return repr(v)


WRITTEN = "gputrace_metrics_written_timestamp_seconds"


def write_textfile(path: Path, jobs: Iterable[Any], watcher: Any) -> None:
    """Written whole beside ``path`` and renamed over it (node_exporter's textfile collector reads *.prom)."""
    text = render(jobs, watcher)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            f.write(text)
            os.fchmod(f.fileno(), 0o644)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
