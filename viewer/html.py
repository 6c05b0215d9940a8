"""The report as one self-contained HTML page: inline CSS, SVG and one small script, no external resource.

Per device: a timeline of the capture (stalls coloured by cause; hovering or clicking one shows its cause,
culprit and via chain), its stall budget as a chart, and the wait chain of its longest stalls as waterfalls.

Everything from the capture is escaped: paths, comms and peer names come from traced processes. The script
reads what it shows from escaped data attributes and writes it with textContent, never as markup.

Bounds, so that a capture with 100,000 stalls still gives a page of a few hundred KiB: a device with more than
MAX_MARKS stalls has its timeline drawn as TIMELINE_SLICES slices (each coloured by the cause with the most
stall time in it), WATERFALLS longest stalls per device get a waterfall of up to WATERFALL_ROWS evidence rows,
and the stall table lists the TABLE_STALLS longest stalls (all are in --json).
"""

from __future__ import annotations

import html
import os
import tempfile
from pathlib import Path
from typing import Any

from gputrace.analysis.notes import caveats, waiting_lines
from gputrace.capture import check_output_path
from gputrace.documents import CaptureInfo, Device, Report, Stall
from gputrace.errors import UserError
from gputrace.viewer import timeline
from gputrace.viewer.terminal import PROCESS_COLUMNS, describe, ended, input_bound_text, ms, pct, process_row, shown

MAX_MARKS = 2000
TIMELINE_SLICES = 1000
WATERFALLS = 10
WATERFALL_ROWS = 12
TABLE_STALLS = 500

STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:2em;color:#222}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:3px 8px;text-align:left}
th{background:#f3f3f3}.num{text-align:right}.alert{color:#b00;font-weight:bold}.note{color:#960;font-weight:bold}.info{color:#444}
.bar{display:inline-block;height:10px;background:#c55}
.bar.throttled{background:#e08a00}.throttled{color:#a55f00;font-weight:bold}
.bar.tracing{background:#8a8a8a}.tracing{color:#555;font-style:italic}
section.dev{border-top:2px solid #ddd;margin-top:1.5em}
svg.tl{width:100%;max-width:1100px;height:46px;display:block;border:1px solid #bbb;background:#eee}
svg.tl .busy{fill:#a8d5a2}svg.tl [data-cause]{cursor:pointer}svg.tl .sel{stroke:#000;stroke-width:2px}
svg.budget{width:100%;max-width:1100px;display:block}svg.budget text{font:12px system-ui,sans-serif;fill:#222}
.detail{min-height:3.2em;margin:.4em 0;padding:4px 8px;background:#fafafa;border-left:4px solid #888;
 max-width:1080px;overflow-wrap:anywhere}
.legend span{display:inline-block;margin-right:1em}.legend i{display:inline-block;width:10px;height:10px;
 margin-right:4px;vertical-align:middle}
.wf{margin:.8em 0 1.2em;max-width:1100px}.wf .chain{margin:.2em 0;overflow-wrap:anywhere}
.wf .row{display:grid;grid-template-columns:minmax(12em,38%) 1fr;gap:6px;align-items:center;font-size:12px}
.wf .lbl{overflow:hidden;text-overflow:ellipsis;white-space:nowrap}
.wf .trk{position:relative;height:12px;background:#f1f1f1}.wf .trk b{position:absolute;top:0;height:12px;min-width:2px}
.wf .ev-syscall{background:#6d8fb3}.wf .ev-offcpu{background:#b7b7b7}.wf .ev-wakeup{background:#c9a3d1}
.wf .ev-block{background:#2f5d8a}.wf .ev-gpu{background:#6aa84f}.wf .ev-other{background:#999}
"""
# One colour per cause of the contract (class names are fixed here, never taken from the capture).
COLOURS = {
    "storage": "#4e79a7", "network": "#f28e2b", "collective": "#b07aa1", "cpu": "#e15759", "cpu.runqueue": "#ff9d9a",
    "cpu.throttled": "#e08a00", "sync": "#76b7b2", "sleep": "#edc948", "device": "#9c755f", "launch": "#bab0ac",
    "tracing": "#8a8a8a", "unknown": "#444444",
}
OTHER_COLOUR = "#000000"
EVIDENCE_KINDS = ("syscall", "offcpu", "wakeup", "block", "gpu")
# Hovering or clicking a stall (or a slice of stalls) shows its data attributes in its section's panel; on load
# each panel shows the device's longest stall. textContent only: the attributes hold text from the capture.
SCRIPT = """
(function(){
var F=[['at','at'],['cause','cause'],['culprit','culprit'],['via','via']];
function show(el){var sec=el.closest('section');if(!sec)return;var p=sec.querySelector('.detail');if(!p)return;
p.textContent='';F.forEach(function(f){var v=el.getAttribute('data-'+f[1]);if(!v)return;
var d=document.createElement('div');var b=document.createElement('b');b.textContent=f[0]+': ';d.appendChild(b);
d.appendChild(document.createTextNode(v));p.appendChild(d);});
sec.querySelectorAll('.sel').forEach(function(x){x.classList.remove('sel');});el.classList.add('sel');}
function pick(ev){var t=ev.target;if(t&&t.closest){t=t.closest('[data-cause]');if(t)show(t);}}
document.addEventListener('mouseover',pick);document.addEventListener('click',pick);
document.querySelectorAll('section.dev').forEach(function(sec){var t=sec.querySelector('[data-first]');if(t)show(t);});
})();
"""
# Causes shown in a colour of their own: a CPU limit (a container's quota) is a setting to change, not load
CAUSE_CLASS = {"cpu.throttled": "throttled", "tracing": "tracing"}  # tracing: the tool's own cost, greyed


def e(x: Any) -> str:
    return html.escape(str(x), quote=True)


def table(headers: list[str], rows: list[list[Any]]) -> str:
    head = "".join(f"<th>{e(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in r) + "</tr>" for r in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def page(report: Report, title: str) -> str:
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
    parts.append("<h2>Timeline by device</h2>")
    parts += [device_section(report, d, i) for i, d in enumerate(report["devices"])]
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
    listed = report["stalls"]
    heading = "<h2>Stalls</h2>"
    if len(listed) > TABLE_STALLS:
        longest = sorted(listed, key=lambda s: -s["duration_ns"])[:TABLE_STALLS]
        listed = sorted(longest, key=lambda s: s["start_ns"])
        heading += (f"<p class=info>The {TABLE_STALLS} longest of {len(report['stalls']):,} stalls, in time order; "
                    "gputrace report --json lists them all.</p>")
    parts.append(heading + table(
        ["at (s)", "device", "duration", "cause", "via", "what it waited on", "lost data?"],
        [[f"{(s['start_ns'] - t0) / 1e9:.3f}", e(s["device"]), e(ms(s["duration_ns"])), cause_cell(s["cause"]),
          e(" → ".join(s["via"])), e(describe(s)), "yes" if s.get("overlaps_drops") else ""]
         for s in listed]))
    return _wrap(title, parts)


def colour(cause: str) -> str:
    return COLOURS.get(cause, OTHER_COLOUR)


def device_section(report: Report, dev: Device, index: int) -> str:
    """One device: its timeline with a detail panel, its stall budget chart, its longest stalls' waterfalls."""
    stalls = timeline.device_stalls(report, dev)
    name = f"{dev['id']} {dev['name']}" + (f" on {dev['host']}" if "host" in dev else "")
    out = [f"<section class=dev id=dev-{index}><h3>Device {e(name)}</h3>", timeline_svg(report, dev, stalls),
           "<div class=detail>Hover over or click a stall to see its cause, culprit and via chain.</div>",
           budget_svg(dev, stalls)]
    out += waterfalls(report, stalls)
    out.append("</section>")
    return "".join(out)


def _at(report: Report, ns: int) -> str:
    return f"{(ns - report['capture']['start_ns']) / 1e9:.3f}"


def _stall_attrs(report: Report, s: Stall) -> str:
    via = " → ".join(s["via"]) or "none: the stalled thread's own wait"
    return (f" data-at='{e(_at(report, s['start_ns']))} s, {e(ms(s['duration_ns']))}' data-cause='{e(s['cause'])}'"
            f" data-culprit='{e(describe(s))}' data-via='{e(via)}'")


def timeline_svg(report: Report, dev: Device, stalls: list[Stall]) -> str:
    """The capture on a 0..1000 wide axis: the device's window as busy, each stall over it in its cause's
    colour; beyond MAX_MARKS stalls, TIMELINE_SLICES slices instead, each in its dominant cause's colour."""
    t0, t1 = timeline.span(report)
    w = 1000.0
    scale = w / (t1 - t0)
    first, last = dev.get("first_ns", t0), dev.get("last_ns", t1)
    marks = [f"<rect class=busy x={(first - t0) * scale:.2f} y=4 width={max((last - first) * scale, 0.5):.2f} "
             "height=38><title>busy (or idle for less than the minimum gap)</title></rect>"]
    longest = max(stalls, key=lambda s: s["duration_ns"], default=None)
    if len(stalls) <= MAX_MARKS:
        for s in stalls:
            x, width = (s["start_ns"] - t0) * scale, max(s["duration_ns"] * scale, 0.4)
            first_attr = " data-first=1" if s is longest else ""
            marks.append(f"<rect class=stall x={x:.2f} y=4 width={width:.2f} height=38 fill='{colour(s['cause'])}'"
                         f"{_stall_attrs(report, s)}{first_attr}><title>{e(s['cause'])} {e(ms(s['duration_ns']))}: "
                         f"{e(describe(s))}</title></rect>")
        note = ""
    else:
        cells = timeline.slices(report, dev, stalls, TIMELINE_SLICES)
        top = max((c for c in cells if c.stalls), key=lambda c: c.stalled_ns, default=None)
        for i, c in enumerate(cells):
            if not c.stalls or c.longest is None:
                continue
            share = min(1.0, c.stalled_ns / max(c.window_ns, 1))
            causes = ", ".join(f"{k} {ms(v)}" for k, v in sorted(c.by_cause.items(), key=lambda kv: -kv[1]))
            summary = f"{c.stalls} stalls: {causes}; longest: {c.longest['cause']} {ms(c.longest['duration_ns'])}"
            first_attr = " data-first=1" if c is top else ""
            # a slice's height is the share of it that was stalled: many short stalls do not look like one long
            height = max(2.0, 38 * share)
            marks.append(f"<rect class=stall x={i * w / TIMELINE_SLICES:.1f} y={42 - height:.1f} "
                         f"width={w / TIMELINE_SLICES:.1f} height={height:.1f} fill='{colour(c.top_cause())}' "
                         f"data-at='{e(_at(report, c.start_ns))}–{e(_at(report, c.end_ns))} s' "
                         f"data-cause='{e(causes)}' data-culprit='{e(describe(c.longest))}' "
                         f"data-via='{e(' → '.join(c.longest['via']))}'{first_attr}><title>{e(summary)}</title></rect>")
        note = (f"<p class=info>{len(stalls):,} stalls, drawn as {TIMELINE_SLICES} slices of "
                f"{e(ms((t1 - t0) // TIMELINE_SLICES))}: each in the colour of the cause with the most stall time "
                "in it, as high as the share of it that was stalled.</p>")
    present = sorted({s["cause"] for s in stalls})
    legend = "".join(f"<span><i style='background:{fill}'></i>{e(label)}</span>" for label, fill in [
        ("busy (or idle under the minimum gap)", "#a8d5a2"), ("no GPU work", "#eeeeee"),
        *((c, colour(c)) for c in present)])
    axis = (f"<p class='info legend'>{e(_at(report, t0))} s … {e(_at(report, t1))} s of the capture: "
            f"{legend}</p>")
    return (f"<svg class=tl viewBox='0 0 {w:.0f} 46' preserveAspectRatio=none role=img "
            f"aria-label='timeline'>{''.join(marks)}</svg>{axis}{note}")


def budget_svg(dev: Device, stalls: list[Stall]) -> str:
    """The device's window as one stacked bar (busy, each cause, short gaps), then a bar per cause."""
    by_cause: dict[str, int] = {}
    for s in stalls:
        by_cause[s["cause"]] = by_cause.get(s["cause"], 0) + s["duration_ns"]
    window = max(dev.get("window_ns", 0), 1)
    busy = dev.get("busy_ns", 0)
    rest = max(0, window - busy - sum(by_cause.values()))
    order = sorted(by_cause.items(), key=lambda kv: -kv[1])
    w, x = 1000.0, 0.0
    stack = []
    for label, ns, fill in [("busy", busy, "#a8d5a2"), *((c, ns, colour(c)) for c, ns in order),
                            ("idle, gaps under the minimum", rest, "#dddddd")]:
        width = w * ns / window
        if width <= 0:
            continue
        stack.append(f"<rect x={x:.2f} y=0 width={width:.2f} height=22 fill='{fill}'><title>{e(label)}: "
                     f"{e(ms(ns))} ({e(pct(ns, window))} of the window)</title></rect>")
        x += width
    rows = []
    biggest = max((ns for _, ns in order), default=1)
    for i, (cause, ns) in enumerate(order):
        y = 34 + 20 * i
        rows.append(f"<text x=0 y={y + 12}>{e(cause)}</text>"
                    f"<rect x=130 y={y} width={max(600 * ns / biggest, 1):.1f} height=14 fill='{colour(cause)}'/>"
                    f"<text x={136 + 600 * ns / biggest:.1f} y={y + 12}>{e(ms(ns))} · {e(pct(ns, window))} of the "
                    "window</text>")
    height = 34 + 20 * len(order)
    return (f"<h4>Stall budget</h4><svg class=budget viewBox='0 0 {w:.0f} {height}' role=img "
            f"aria-label='stall budget' style='max-height:{height * 1.2:.0f}px'>{''.join(stack)}{''.join(rows)}</svg>")


def waterfalls(report: Report, stalls: list[Stall]) -> list[str]:
    """The WATERFALLS longest stalls, each as its chain (stalled thread → hops → root cause) and its evidence
    on one time axis: what each thread was in, and when, while the GPU waited."""
    worst = sorted(stalls, key=lambda s: -s["duration_ns"])[:WATERFALLS]
    if not worst:
        return []
    out = [f"<h4>Wait chains of the {len(worst)} longest stalls</h4>"]
    for s in worst:
        evidence = [ev for ev in s.get("evidence", []) if isinstance(ev, dict)][:WATERFALL_ROWS]
        lo = min([s["start_ns"], *(int(ev.get("start_ns", s["start_ns"])) for ev in evidence)])
        hi = max([s["end_ns"], *(int(ev.get("end_ns", s["end_ns"])) for ev in evidence)])
        scale = 100.0 / max(hi - lo, 1)
        waiter = evidence[0] if evidence else {"pid": s.get("device_pid", "?")}
        thread = f"pid {waiter.get('pid', '?')}" + (f" tid {waiter['tid']}" if waiter.get("tid") else "")
        chain = [thread, *s["via"], f"{s['cause']}: {describe(s)}"]

        rows = [_waterfall_row(f"GPU idle: {s['cause']} {ms(s['duration_ns'])}", "ev-other",
                               (s["start_ns"] - lo) * scale, s["duration_ns"] * scale,
                               f";background:{colour(s['cause'])}")]
        for ev in evidence:
            kind = str(ev.get("kind", ""))
            who = f"pid {ev.get('pid', '?')}" + (f" tid {ev['tid']}" if ev.get("tid") else "")
            start = int(ev.get("start_ns", s["start_ns"]))
            rows.append(_waterfall_row(f"{who} {kind}: {ev.get('what', '')}",
                                       f"ev-{kind}" if kind in EVIDENCE_KINDS else "ev-other",
                                       (start - lo) * scale, (int(ev.get("end_ns", start)) - start) * scale, ""))
        more = len(s.get("evidence", [])) - len(evidence)
        tail = f"<div class=info>{more} more evidence entries in --json</div>" if more > 0 else ""
        out.append(f"<div class=wf><div class=chain><b>{e(_at(report, s['start_ns']))} s, "
                   f"{e(ms(s['duration_ns']))}:</b> {e(' → '.join(chain))}</div>{''.join(rows)}{tail}</div>")
    return out


def cause_cell(cause: Any) -> str:
    cls = CAUSE_CLASS.get(str(cause))
    return f"<span class={cls}>{e(cause)}</span>" if cls else e(cause)


def notes(cap: CaptureInfo) -> list[str]:
    """What the capture could not record: no eBPF, probes the kernel skipped, malformed records, threads still
    waiting at the stop (every one the report lists)."""
    classes = {"alert": "alert", "info": "info"}
    out = [f"<p class={classes.get(severity, 'note')}>{e(note)}</p>" for severity, note in caveats(cap)]
    waiting = waiting_lines(cap, len(cap.get("in_progress") or []))
    if waiting:
        out.append(f"<p class=note>{e(waiting[0])}</p><ul>"
                   + "".join(f"<li>{e(line.strip())}</li>" for line in waiting[1:]) + "</ul>")
    return out


def _waterfall_row(label: str, cls: str, left: float, width: float, style: str) -> str:
    """A label and its bar, placed in percent of the waterfall's time axis (``cls``, ``style``: ours alone)."""
    return (f"<div class=row><span class=lbl title='{e(label)}'>{e(label)}</span><span class=trk>"
            f"<b class={cls} style='left:{left:.2f}%;width:{max(width, 0.2):.2f}%{style}'></b></span></div>")


def _wrap(title: str, parts: list[str]) -> str:
    return (f"<!doctype html><html><head><meta charset=utf-8><title>gputrace {e(title)}</title>"
            f"<style>{STYLE}</style></head><body>{''.join(parts)}<script>{SCRIPT}</script></body></html>\n")


def write(report: Report, out: Path, *, title: str = "", force: bool = False) -> Path:
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
