"""What tracing cost, as the capture measured it (daemon/cost.py): read safely, said in one line."""

from __future__ import annotations

from typing import Any, TypedDict

from gputrace.documents import Overhead, ProgramCost

KERNEL_SOURCES = ("ebpf", "sampler", "uprobe")  # kernel programs' run time
MAX_ENTRIES = 256  # a capture is untrusted input: a map longer than any capture writes is cut


def _int_map(raw: Any) -> dict[str, int]:
    if not isinstance(raw, dict):
        return {}
    items = list(raw.items())[:MAX_ENTRIES]
    return {str(k)[:64]: int(v) for k, v in items if type(v) is int and v >= 0}


def _num_map(raw: Any) -> dict[str, float]:
    if not isinstance(raw, dict):
        return {}
    items = list(raw.items())[:MAX_ENTRIES]
    return {str(k)[:64]: float(v) for k, v in items if type(v) in (int, float) and v >= 0}


def _programs(raw: Any) -> dict[str, ProgramCost]:
    if not isinstance(raw, dict):
        return {}
    out: dict[str, ProgramCost] = {}
    for name, v in list(raw.items())[:MAX_ENTRIES]:
        if isinstance(v, dict) and type(v.get("runs")) is int and type(v.get("ns")) is int:
            out[str(name)[:64]] = {"runs": int(v["runs"]), "ns": int(v["ns"])}
    return out


class _Optional(TypedDict, total=False):
    """Overhead's optional keys (the window and CPUs come before the counts, as they always have)."""

    window_ns: int
    host_cpus: int
    programs: dict[str, ProgramCost]
    missing: dict[str, str]


def read_overhead(raw: Any) -> Overhead | None:
    """The trailer's ``overhead`` as the report's ``capture.overhead``; None where the capture has none
    (an older capture, or one cut off before its trailer). Wrong-typed parts are left out."""
    if not isinstance(raw, dict):
        return None
    share = raw.get("cpu_share")
    if not isinstance(share, (int, float)) or isinstance(share, bool) or not 0 <= share < 1e6:
        return None
    size: _Optional = {}
    if type(raw.get("window_ns")) is int:
        size["window_ns"] = raw["window_ns"]
    if type(raw.get("host_cpus")) is int:
        size["host_cpus"] = raw["host_cpus"]
    out: Overhead = {"cpu_share": float(share), "by_source": _int_map(raw.get("by_source")), **size,
                     "events": _int_map(raw.get("events")), "wakeups": _int_map(raw.get("wakeups")),
                     "events_per_s": _num_map(raw.get("events_per_s"))}
    programs = _programs(raw.get("programs"))
    if programs:
        out["programs"] = programs
    missing = raw.get("missing")
    if isinstance(missing, dict):
        out["missing"] = {str(k)[:64]: str(v)[:300] for k, v in list(missing.items())[:16]}
    return out


def cost_text(ov: Overhead) -> str:
    """``tracing cost: 0.6 % of host CPU (probes 0.4 %, session 0.2 %, agents 0.0 %)``, with what is missing."""
    whole = ov.get("window_ns", 0) * ov.get("host_cpus", 0)
    by = ov.get("by_source", {})

    def part(ns: int) -> str:
        return f"{100.0 * ns / whole:.1f} %" if whole else "?"

    parts = []
    kernel = sum(ns for src, ns in by.items() if src in KERNEL_SOURCES)
    if any(src in by for src in KERNEL_SOURCES):
        parts.append(f"probes {part(kernel)}")
    if "session" in by:
        parts.append(f"session {part(by['session'])}")
    if "agent" in by:
        parts.append(f"agents {part(by['agent'])}")
    text = f"tracing cost: {100.0 * ov['cpu_share']:.1f} % of host CPU"
    if parts:
        text += f" ({', '.join(parts)})"
    missing = ov.get("missing", {})
    if missing:
        text += "; not measured: " + "; ".join(f"{k}: {v}" for k, v in missing.items())
    return text
