"""Watch mode's metrics: per job and device, from each analysed flight segment, as a node_exporter textfile.

Label cardinality is bounded: jobs are at most the watched ones plus KEEP_ENDED ended ones; causes are the
report's fixed set; culprit objects are the TOP_OBJECTS largest per job (the rest summed as "other", at most
MAX_OBJECTS tracked per job). The file is written whole to a temporary file beside it and renamed over it, so
node_exporter never reads half of one.
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from gputrace.documents import Report

TOP_OBJECTS = 5
MAX_OBJECTS = 64
OTHER = "other"


@dataclass
class JobMetrics:
    segments: int = 0
    stall_ns: dict[str, int] = field(default_factory=dict)  # by cause
    objects: dict[tuple[str, str], int] = field(default_factory=dict)  # (cause, culprit object) -> ns
    busy_ratio: float | None = None  # the job's, over its last analysed segment
    device_busy: dict[str, float] = field(default_factory=dict)  # device -> ratio, last segment
    device_busy_ns: dict[str, int] = field(default_factory=dict)  # device -> ns, all segments
    nvml_util: dict[str, float] = field(default_factory=dict)  # device -> NVML's utilization, last segment
    drops: dict[str, int] = field(default_factory=dict)
    dumps: dict[str, int] = field(default_factory=dict)  # by trigger kind
    cpu_share: float | None = None  # tracing's share of the host CPU for this job (probes and agents)

    def add(self, report: Report, drops: dict[str, int]) -> None:
        """One analysed segment's figures."""
        self.segments += 1
        summary = report.get("summary", {})
        for cause, ns in summary.get("by_cause", {}).items():
            self.stall_ns[cause] = self.stall_ns.get(cause, 0) + int(ns)
        for stall in report.get("stalls", []):
            self._object(stall.get("cause", "unknown"), str((stall.get("culprit") or {}).get("object") or ""),
                         int(stall.get("duration_ns", 0)))
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
        for k, v in drops.items():
            self.drops[k] = self.drops.get(k, 0) + int(v)

    def _object(self, cause: str, obj: str, ns: int) -> None:
        key = (cause, obj or OTHER)
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


def _label(value: object) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")[:200]


def _labels(**kv: object) -> str:
    return "{" + ",".join(f'{k}="{_label(v)}"' for k, v in kv.items()) + "}"


class _Text:
    def __init__(self) -> None:
        self.lines: list[str] = []
        self._declared: set[str] = set()

    def add(self, name: str, kind: str, help_text: str, value: float, **labels: object) -> None:
        if name not in self._declared:
            self._declared.add(name)
            self.lines += [f"# HELP {name} {help_text}", f"# TYPE {name} {kind}"]
        self.lines.append(f"{name}{_labels(**labels) if labels else ''} {value:.9g}")


def render(jobs: Iterable[Any], watcher: Any) -> str:
    """The textfile's content: every metric of every job, then the watch mode's own."""
    out = _Text()
    for job in sorted(jobs, key=lambda j: (j.pid, j.found.start)):
        m: JobMetrics = job.metrics
        ids = {"pid": job.pid, "comm": job.found.comm}
        for cause, ns in sorted(m.stall_ns.items()):
            out.add("gputrace_stall_seconds_total", "counter", "GPU stall time by cause, from the flight segments "
                    "analysed", ns / 1e9, **ids, cause=cause)
        for (cause, obj), ns in sorted(m.top_objects().items()):
            out.add("gputrace_stall_culprit_seconds_total", "counter", f"GPU stall time by culprit object (the "
                    f"{TOP_OBJECTS} largest per job, the rest as other)", ns / 1e9, **ids, cause=cause, object=obj)
        if m.busy_ratio is not None:
            out.add("gputrace_gpu_busy_ratio", "gauge", "share of the last flight segment the job's GPUs were busy "
                    "(device=\"all\": the job's; measured from kernel, copy and set times)", m.busy_ratio,
                    **ids, device="all")
        for dev, ratio in sorted(m.device_busy.items()):
            out.add("gputrace_gpu_busy_ratio", "gauge", "", ratio, **ids, device=dev)
        for dev, ns in sorted(m.device_busy_ns.items()):
            out.add("gputrace_gpu_busy_seconds_total", "counter", "GPU busy time measured", ns / 1e9, **ids,
                    device=dev)
        for dev, ratio in sorted(m.nvml_util.items()):
            out.add("gputrace_nvml_utilization_ratio", "gauge", "NVML's utilization over the last segment",
                    ratio, **ids, device=dev)
        for source, n in sorted(m.drops.items()):
            out.add("gputrace_dropped_records_total", "counter", "records lost, by source", n, **ids, source=source)
        if m.cpu_share is not None:
            out.add("gputrace_tracing_cpu_ratio", "gauge", "share of the host's CPU the job's probes and agents "
                    "took (the cost meter)", m.cpu_share, **ids)
        if job.recorder is not None:
            out.add("gputrace_flight_bytes", "gauge", "bytes the job's flight recorder holds on disk",
                    job.recorder.bytes_held(), **ids)
        for kind, n in sorted(m.dumps.items()):
            out.add("gputrace_flight_dumps_total", "counter", "flight recorder dumps, by trigger", n, **ids,
                    trigger=kind)
    status = watcher.status(0)
    out.add("gputrace_watched_jobs", "gauge", "GPU jobs watched now", status["watching"])
    out.add("gputrace_watch_refused_total", "counter", "GPU processes not watched: the job cap was reached",
            status["refused"])
    out.add("gputrace_watch_cpu_seconds_total", "counter", "CPU time of watch mode's own scan and analysis",
            status["cost"]["scan_cpu_s"] + status["cost"]["analysis_cpu_s"])
    out.add("gputrace_watch_segments_analysed_total", "counter", "flight segments analysed",
            status["cost"]["segments_analysed"])
    out.add("gputrace_watch_analysis_skipped_total", "counter", "flight segments not analysed: the queue was full",
            status["cost"]["analysis_skipped"])
    out.add("gputrace_metrics_written_timestamp_seconds", "gauge", "when this file was written", time.time())
    return "\n".join(out.lines) + "\n"


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
