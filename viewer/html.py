"""The report as one self-contained HTML page (no scripts, no external resources).

Everything from the capture is escaped: paths, comms and peer names come from traced processes.
"""

from __future__ import annotations

import html
import os
import tempfile
from pathlib import Path
from typing import Any

from gputrace.analysis.notes import caveats, waiting_lines
from gputrace.capture import check_output_path
from gputrace.errors import UserError
from gputrace.viewer.terminal import PROCESS_COLUMNS, describe, ended, input_bound_text, ms, pct, process_row, shown

STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:2em;color:#222}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:3px 8px;text-align:left}
th{background:#f3f3f3}.num{text-align:right}.alert{color:#b00;font-weight:bold}.note{color:#960;font-weight:bold}.info{color:#444}
.bar{display:inline-block;height:10px;background:#c55}
.bar.throttled{background:#e08a00}.throttled{color:#a55f00;font-weight:bold}
.bar.tracing{background:#8a8a8a}.tracing{color:#555;font-style:italic}
"""
# Causes shown in a colour of their own: a CPU limit (a container's quota) is a setting to change, not load
CAUSE_CLASS = {"cpu.throttled": "throttled", "tracing": "tracing"}  # tracing: the tool's own cost, greyed


def e(x: Any) -> str:
    return html.escape(str(x), quote=True)


def table(headers: list[str], rows: list[list[Any]]) -> str:
    head = "".join(f"<th>{e(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def page(report: dict[str, Any], title: str) -> str:
    cap, summ = report["capture"], report["summary"]
    title = shown(title)
    parts = [f"<h1>gputrace report {e(title)}</h1>",
             f"<p>host {e(cap['host'])} · {e(ms(cap['end_ns'] - cap['start_ns']))} captured</p>"]
    if not cap["complete"]:
        parts.append(f"<p class=alert>INCOMPLETE CAPTURE: {e(cap.get('problem') or 'records were lost')}</p>")
    elif cap.get("stop_reason"):
        parts.append(f"<p>complete: {e(ended(cap['stop_reason']))}</p>")
    lost = {k: v for k, v in cap["drops"].items() if v}
    if lost:
        parts.append("<p class=alert>LOST RECORDS: " + e(", ".join(f"{k} {v}" for k, v in lost.items())) + "</p>")
    parts += notes(cap)
    if not report["devices"]:
        parts.append("<p class=alert>No GPU activity in this capture. Captured records:</p>")
        parts.append(table(["kind", "count"], [[e(k), v] for k, v in cap.get("records", {}).items()]))
        return _wrap(title, parts)
    parts.append("<h2>Devices</h2>" + table(
        ["device", "window", "busy", "stalls", "stall time", "NVML util"],
        [[e(f"{d['id']} {d['name']}" + (" [simulated]" if d["simulated"] else "")), e(ms(d["window_ns"])),
          e(f"{ms(d['busy_ns'])} ({pct(d['busy_ns'], d['window_ns'])})"), d["stalls"], e(ms(d["stall_ns"])),
          e(f"{d['nvml_util_pct']:.0f}%" if "nvml_util_pct" in d else "not sampled")] for d in report["devices"]]))
    parts.append("<h2>Stall budget by cause</h2>" + table(
        ["cause", "time", "share", ""],
        [[e(c), e(ms(ns)), e(pct(ns, summ["stall_ns"])),
          f"<span class='bar {CAUSE_CLASS.get(c, '')}' style='width:{int(300 * ns / max(summ['stall_ns'], 1))}px'>"
          "</span>"]
         for c, ns in summ["by_cause"].items()]))
    parts.append("<h2>Top culprits</h2>" + table(
        ["kind", "culprit", "stall time", "share"],
        [[e(c["kind"]), e(c["culprit"]), e(ms(c["stall_ns"])), e(f"{c['share_pct']}%")]
         for c in report.get("top_culprits", [])]))
    if report.get("top_processes"):
        parts.append("<h2>Stall time by process</h2>" + table(
            list(PROCESS_COLUMNS), [[e(str(x)) for x in process_row(p)] for p in report["top_processes"]]))
    ib = summ.get("input_bound", {})
    if ib:
        parts.append(f"<p>{e(input_bound_text(ib))}</p>")
    t0 = cap["start_ns"]
    parts.append("<h2>Stalls</h2>" + table(
        ["at (s)", "device", "duration", "cause", "via", "what it waited on", "lost data?"],
        [[f"{(s['start_ns'] - t0) / 1e9:.3f}", s["device"], e(ms(s["duration_ns"])), cause_cell(s["cause"]),
          e(" → ".join(s["via"])), e(describe(s)), "yes" if s.get("overlaps_drops") else ""]
         for s in report["stalls"]]))
    return _wrap(title, parts)


def cause_cell(cause: Any) -> str:
    cls = CAUSE_CLASS.get(str(cause))
    return f"<span class={cls}>{e(cause)}</span>" if cls else e(cause)


def notes(cap: dict[str, Any]) -> list[str]:
    """What the capture could not record: no eBPF, probes the kernel skipped, malformed records, threads still
    waiting at the stop (every one the report lists)."""
    classes = {"alert": "alert", "info": "info"}
    out = [f"<p class={classes.get(severity, 'note')}>{e(note)}</p>" for severity, note in caveats(cap)]
    waiting = waiting_lines(cap, len(cap.get("in_progress") or []))
    if waiting:
        out.append(f"<p class=note>{e(waiting[0])}</p><ul>"
                   + "".join(f"<li>{e(line.strip())}</li>" for line in waiting[1:]) + "</ul>")
    return out


def _wrap(title: str, parts: list[str]) -> str:
    return (f"<!doctype html><html><head><meta charset=utf-8><title>gputrace {e(title)}</title>"
            f"<style>{STYLE}</style></head><body>{''.join(parts)}</body></html>\n")


def write(report: dict[str, Any], out: Path, *, title: str = "", force: bool = False) -> Path:
    """Write the page beside ``out`` and rename it into place: never a half-written page under that name."""
    check_output_path(out, force=force)
    parent = out.parent if str(out.parent) else Path(".")
    data = page(report, title).encode()
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{out.name}.", dir=parent)
    except OSError as err:
        raise UserError(f"cannot write in {parent}: {err.strerror}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        os.chmod(tmp, 0o644)
        if not force and out.exists():
            raise UserError(f"{out} exists; use --force to overwrite it")
        os.replace(tmp, out)
    except OSError as err:
        Path(tmp).unlink(missing_ok=True)
        raise UserError(f"writing {out}: {err.strerror}") from None
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return out
