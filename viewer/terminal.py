"""The report on a terminal (rich): devices, stall budget by cause, top culprits, the worst stalls.

Whatever comes from the capture (paths, comms, host and device names) goes to rich as ``Text``, never as a
markup string: a path such as ``/data/[/b]x`` is shown as it was recorded instead of being parsed as markup.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from gputrace.analysis.notes import caveats, waiting_lines
from gputrace.analysis.report import causes_text, culprit_label, holders_text, pid_text
from gputrace.analysis.throttle import quota_text
from gputrace.analysis.timefmt import size_text
from gputrace.documents import CaptureInfo, Comparison, Culprit, InputBound, Report, Stall, TopProcess
from gputrace.viewer import timeline

TOP_STALLS = 10
PROCESS_COLUMNS = ("process", "runs a GPU", "stall time", "share", "stalls", "causes")
TOP_WAITING = 10


def ms(ns: int) -> str:
    return f"{ns / 1e6:,.1f} ms"


def pct(part: int, whole: int) -> str:
    return f"{100.0 * part / whole:.1f}%" if whole else "-"


def shown(name: str) -> str:
    """A name as it can be printed: bytes of a file name that are not UTF-8 (surrogate escapes) become U+FFFD."""
    try:
        return name.encode("utf-8", "surrogateescape").decode("utf-8", "replace")
    except UnicodeEncodeError:  # a lone surrogate no file name decoding made
        return name.encode("utf-8", "replace").decode("utf-8")


def _cells(*values: object) -> list[Text]:
    return [v if isinstance(v, Text) else Text(str(v)) for v in values]


def render(report: Report, console: Console, capture_name: str = "") -> None:
    _header(report, console, capture_name)
    if not report["devices"]:
        _no_gpu(report, console)
        return
    console.print(_devices(report))
    _strips(report, console)
    if report["stalls"]:
        console.print(_budget(report))
        console.print(_culprits(report))
        if report.get("top_processes"):
            console.print(_processes(report))
        console.print(_worst(report))
    else:
        console.print("No GPU stall of at least the minimum gap: the devices were never idle that long.")
    _input_bound(report, console)


def _header(report: Report, console: Console, name: str) -> None:
    cap = report["capture"]
    span = cap["end_ns"] - cap["start_ns"]
    console.print(Text(f"gputrace report {shown(name)}".rstrip(), style="bold"))
    pids = ", ".join(map(str, cap["pids"])) or "-"
    console.print(Text(f"host {cap['host'] or '?'} · {ms(span)} captured · pids {pids}"))
    if not cap["complete"]:
        why = cap.get("problem") or "records were lost"
        console.print(Text(f"INCOMPLETE CAPTURE: {why}. Stalls marked ! overlap missing data.", style="bold red"))
    elif cap.get("stop_reason"):
        console.print(Text(f"complete: {ended(cap['stop_reason'])}"))
    lost = {k: v for k, v in cap["drops"].items() if v}
    if lost:
        detail = ", ".join(f"{k} {v:,}" for k, v in lost.items())
        console.print(Text(f"LOST RECORDS: {detail}", style="bold red"))
    elif "no trailer" not in (cap.get("problem") or ""):
        console.print("drops: none")
    else:  # the totals are in the trailer, which a cut-off capture lacks
        console.print("drops: none counted before the cut (the final counts were never written)")
    _notes(cap, console)
    if report.get("join"):
        _join(report, console)


def _join(report: Report, console: Console) -> None:
    """Several captures: each one's host, how its clock was put on the first's, and what the join says."""
    for c in report.get("captures", []):
        if c["shift_ns"] == 0 and c["anchors"] == 0 and c["uncertainty_ns"] is None:
            how = "the reference clock" if c is report["captures"][0] else "header offset 0"
        else:
            unc = f" ± {ms(c['uncertainty_ns'])}" if c["uncertainty_ns"] is not None else " (uncertainty unknown)"
            how = f"shifted {c['shift_ns'] / 1e6:+.3f} ms{unc}, {c['anchors']} shared collectives"
        console.print(Text(f"capture {shown(c['name'])}: host {c['host'] or '?'}, {how}"))
    for note in report["join"].get("notes", []):
        console.print(Text(f"note: {note}", style="yellow"))


_STYLES = {"warn": "bold yellow", "note": "yellow", "alert": "bold red", "info": ""}


def _notes(cap: CaptureInfo, console: Console) -> None:
    for severity, note in caveats(cap):
        console.print(Text(note, style=_STYLES[severity]))
    for i, line in enumerate(waiting_lines(cap, TOP_WAITING)):
        console.print(Text(line, style="bold" if i == 0 else ""))


_ENDED = {
    "stopped": "ended by Ctrl-C, SIGTERM or a stop request",
    "duration": "ended after -d/--duration",
    "command exited": "ended when the command exited",
    "targets exited": "ended when the traced processes exited",
}


def ended(stop_reason: str) -> str:
    """How a capture ended, from its trailer's stop_reason, in words."""
    return _ENDED.get(stop_reason, f"ended: {stop_reason}")


def _no_gpu(report: Report, console: Console) -> None:
    console.print(Text("No GPU activity in this capture: no kernel, copy or memset was recorded, so there is no "
                       "GPU timeline to find stalls in.", style="bold yellow"))
    if report["capture"]["complete"]:
        console.print("Was the job using the GPU, and was the GPU agent armed (gputrace capture -- CMD)? Captured:")
    else:  # GPU records arrive in batches: a cut-off capture may have lost every one of them
        console.print("The capture is incomplete: its GPU records may be in the part that is missing. Captured:")
    t = Table("record kind", "count", box=None)
    for kind, n in report["capture"].get("records", {}).items():
        t.add_row(*_cells(kind, f"{n:,}"))
    console.print(t)


def _devices(report: Report) -> Table:
    t = Table(title="GPU devices", title_justify="left")
    for col in ("device", "window", "busy", "stalls", "stall time", "NVML util"):
        t.add_column(col, justify="right" if col != "device" else "left")
    for d in report["devices"]:
        name = f"{d['id']} {d['name']}" + (f" (pid {d['pid']})" if "pid" in d else "")
        if d["simulated"]:
            name += " [simulated]"
        nvml = f"{d['nvml_util_pct']:.0f}% (measured busy {pct(d['busy_ns'], d['window_ns'])})" \
            if "nvml_util_pct" in d else "not sampled"
        t.add_row(*_cells(name, ms(d["window_ns"]), f"{ms(d['busy_ns'])} ({pct(d['busy_ns'], d['window_ns'])})",
                          d["stalls"], f"{ms(d['stall_ns'])} ({pct(d['stall_ns'], d['window_ns'])})", nvml))
    return t


# Colours of the strip's letters; the letters alone still read on a console without colour.
STRIP_STYLES = {"storage": "blue", "network": "dark_orange", "collective": "magenta", "cpu": "red",
                "cpu.runqueue": "bright_red", "cpu.throttled": "yellow", "sync": "cyan", "sleep": "bright_yellow",
                "device": "bright_magenta", "launch": "bright_black", "tracing": "bright_black", "unknown": "white"}
STRIP_LABEL = 16  # characters of the device's label before its strip


def _strips(report: Report, console: Console) -> None:
    """One line per device: the capture from start to end, a character per equal slice, as wide as the console."""
    t0, t1 = timeline.span(report)
    width = max(10, console.width - STRIP_LABEL - 2)
    console.print(Text(f"Timeline ({ms(t1 - t0)}, {ms((t1 - t0) // width)} a character)", style="bold"))
    seen: dict[str, str] = {}
    for d in report["devices"]:
        label = shown(f"{d['host']} {d['id']}" if "host" in d else f"dev {d['id']}")
        line = Text(f"{label[:STRIP_LABEL - 1]:<{STRIP_LABEL - 1}} |")
        causes = {s["cause"]: timeline.letter(s["cause"]) for s in timeline.device_stalls(report, d)}
        styles = {ch: STRIP_STYLES.get(cause, "") for cause, ch in causes.items()}
        seen.update({ch: cause for cause, ch in causes.items()})
        for ch in timeline.strip(report, d, width):
            line.append(ch, style="dim" if ch in (timeline.BUSY, timeline.OUTSIDE) else styles.get(ch, ""))
        line.append("|")
        console.print(line, no_wrap=True, overflow="crop")
    legend = [f"{timeline.BUSY} busy", f"{timeline.OUTSIDE} no GPU work",
              *(f"{ch} {cause}" for ch, cause in sorted(seen.items(), key=lambda kv: kv[1]))]
    console.print(Text("  ".join(legend)))


def _budget(report: Report) -> Table:
    summ = report["summary"]
    t = Table(title="Stall budget by cause", title_justify="left")
    t.add_column("cause")
    t.add_column("time", justify="right")
    t.add_column("% of stall time", justify="right")
    t.add_column("% of GPU window", justify="right")
    for cause, ns in summ["by_cause"].items():
        t.add_row(*_cells(cause, ms(ns), pct(ns, summ["stall_ns"]), pct(ns, summ["window_ns"])))
    t.add_row("total", ms(summ["stall_ns"]), "100%", pct(summ["stall_ns"], summ["window_ns"]), style="bold")
    return t


def _culprits(report: Report) -> Table:
    t = Table(title="Top culprits (files, peers, workers)", title_justify="left")
    for col in ("kind", "culprit", "stall time", "share", "stalls"):
        t.add_column(col, justify="right" if col in ("stall time", "share", "stalls") else "left")
    for c in report.get("top_culprits", []):
        t.add_row(*_cells(c["kind"], c["culprit"], ms(c["stall_ns"]), f"{c['share_pct']:.1f}%", c["stalls"]))
    return t


def _processes(report: Report) -> Table:
    t = Table(title="Stall time by process", title_justify="left")
    for col in PROCESS_COLUMNS:
        t.add_column(col, justify="right" if col in ("stall time", "share", "stalls") else "left")
    for p in report["top_processes"]:
        t.add_row(*_cells(*process_row(p)))
    return t


def process_row(p: TopProcess) -> list[Any]:
    """A ``top_processes`` entry as the terminal and HTML tables show it (PROCESS_COLUMNS)."""
    return [pid_text(p), "yes" if p["gpu_process"] else "", ms(p["stall_ns"]), f"{p['share_pct']:.1f}%",
            p["stalls"], causes_text(p["by_cause"])]


def describe(s: Stall) -> str:
    """One line saying what a stall waited on, e.g. 'pid 4242 (worker) pread64 /data/x.bin, 3 block requests'."""
    c = s["culprit"]
    if s["cause"] == "unknown":
        return "nothing recorded explains it" + (f" ({s['why']})" if s.get("why") else "")
    who = pid_text(c) if c.get("pid") else ""
    if who and s["cause"] in ("cpu", "cpu.runqueue") and c.get("tid") and c["tid"] != c["pid"]:
        who += f", thread {c['tid']}"  # not the process's main thread: a worker thread, a GIL holder
    if who and c.get("host") and c["host"] != s.get("host"):  # a late rank on another host
        who += f" on {c['host']}"
    if who and s["cause"] == "collective" and "rank" in c:
        who = f"rank {c['rank']} {who}"
    op, obj = str(c.get("op", "")), str(c.get("object", ""))
    if op and obj.startswith(f"{op} #"):  # a collective call on the host: its op is in the instance's name
        op = ""
    what = " ".join(x for x in (op, obj) if x)
    text = " ".join(x for x in (who, what) if x) or culprit_label(s)[1]
    if c.get("block_requests"):
        n = c["block_requests"]
        size = f" ({size_text(c['block_bytes'])})" if c.get("block_bytes") else ""
        text += f", {n} block request{'s' if n != 1 else ''}{size} on {c['block_device']}, " \
                f"{ms(c['block_latency_ns'])} device latency"
        if c.get("dispatched_by"):  # throttled I/O: a kernel worker issued the requests the read waited on
            text += f" (dispatched by {c['dispatched_by']})"
        if c.get("block_shared"):
            text += ", shared with pids " + ", ".join(str(p) for p in c.get("block_shared_with", []))
    if c.get("dirty_pauses"):  # the kernel held the writer back: its device's writeback lagged its writes
        n, calls = c["dirty_pauses"], c.get("dirty_calls", 1)
        text += f", paused {n}× ({ms(c['dirty_paused_ns'])}" + (f" in {calls} calls" if calls > 1 else "") + \
                f") for dirty pages on {c['dirty_device']} ({size_text(c['dirty_bytes'])} dirty, " \
                f"setpoint {size_text(c['dirty_setpoint_bytes'])})"
    if c.get("filesystem"):
        text += f" [{c['filesystem']}]"
    if c.get("cpu_held_by"):
        text += "; the CPU was held by " + holders_text(c["cpu_held_by"])
    if s["cause"] == "cpu.throttled":
        text += throttled_text(c)
    late = s.get("late_rank") or s.get("late_rank_cause")
    if isinstance(late, dict) and isinstance(late.get("culprit"), dict):
        lc = late["culprit"]
        who = f" ({pid_text(lc)})" if lc.get("pid") and lc.get("pid") != c.get("pid") else ""
        text += f"; late rank was in {late.get('cause', '')} {lc.get('object', '')}".rstrip() + who
    return text


def throttled_text(c: Culprit) -> str:
    """', quota 20 ms per 100 ms (cgroup v1): 80.0 ms throttled; the cgroup 2 of 2 periods, 160.0 ms': a
    throttled culprit's quota and what was measured (its own waits, then the cgroup's counters)."""
    quota, period = c.get("quota_us"), c.get("period_us")
    if not isinstance(quota, int) or not isinstance(period, int):
        return ""
    text = f", quota {quota_text(quota, period)} (cgroup v{c.get('cgroup_version', '?')})"
    if isinstance(c.get("throttled_ns"), int):
        text += f": {ms(c['throttled_ns'])} throttled"
    if isinstance(c.get("cgroup_throttled_periods"), int):
        text += f"; the cgroup {c['cgroup_throttled_periods']} of {c.get('cgroup_periods', '?')} periods, " \
                f"{ms(int(c.get('cgroup_throttled_ns', 0)))}"
    return text


def _worst(report: Report) -> Table:
    t = Table(title=f"Longest stalls (top {TOP_STALLS})", title_justify="left")
    for col in ("at", "dev", "duration", "cause", "via", "what it waited on"):
        t.add_column(col, justify="right" if col in ("at", "duration") else "left")
    t0 = report["capture"]["start_ns"]
    worst = sorted(report["stalls"], key=lambda s: -s["duration_ns"])[:TOP_STALLS]
    for s in worst:
        mark = "!" if s.get("overlaps_drops") else ""
        t.add_row(*_cells(f"{mark}{(s['start_ns'] - t0) / 1e9:.3f} s", s["device"], ms(s["duration_ns"]), s["cause"],
                          " → ".join(s["via"]), describe(s)))
    return t


def _input_bound(report: Report, console: Console) -> None:
    ib = report["summary"].get("input_bound")
    if not ib:
        return
    console.print(Text(input_bound_text(ib)))


def input_bound_text(ib: InputBound) -> str:
    """The verdict as the report has it; without a share (none could be measured) the verdict alone."""
    share, measured = ib.get("pct"), ""
    if isinstance(share, int | float):
        measured = f"{share:.1f}% of the GPU window was spent waiting on input (storage, network, data workers) → "
    return f"Input-bound: {measured}{ib['verdict']} (TensorFlow profiler's 5% / 20% thresholds, for comparison)."


def _points(x: float | None) -> str:
    if x is None:  # a run without GPU activity
        return "-"
    return f"{x:+.1f} pts" if abs(x) >= 0.05 else "same"


def _share(pct: float, ns: int) -> str:
    """A compare row's share of one run's window, "-" where that run had none of it."""
    return f"{pct:.1f}%" if ns else "-"


def render_compare(doc: Comparison, console: Console, before: str, after: str) -> None:
    """`gputrace compare`: the two runs' GPU busy share, stall budget by cause and culprits side by side."""
    b, a = doc["before"], doc["after"]
    console.print(Text(f"gputrace compare {shown(before)} → {shown(after)}", style="bold"))
    for note in doc["notes"]:
        console.print(Text(f"note: {note}"))
    t = Table(title="GPU time (shares of each run's GPU window)", title_justify="left")
    for col in ("", "before", "after", "change"):
        t.add_column(col, justify="left" if not col else "right")
    t.add_row(*_cells("GPU window", ms(b["window_ns"]), ms(a["window_ns"]), ""))
    t.add_row(*_cells("GPU busy", f"{b['busy_pct']:.1f}%", f"{a['busy_pct']:.1f}%", _points(doc["busy_change_points"])))
    t.add_row(*_cells("stalled", f"{b['stall_pct']:.1f}%", f"{a['stall_pct']:.1f}%",
                      _points(doc["stall_change_points"])))
    t.add_row(*_cells("stalls", f"{b['stalls']:,}", f"{a['stalls']:,}", f"{a['stalls'] - b['stalls']:+,}"))
    if b["input_bound_pct"] is not None and a["input_bound_pct"] is not None:
        t.add_row(*_cells("waiting on input", f"{b['input_bound_pct']:.1f}%", f"{a['input_bound_pct']:.1f}%",
                          _points(doc["input_change_points"])))
    console.print(t)
    if doc["by_cause"]:
        t = Table(title="Stall time by cause (% of GPU window)", title_justify="left")
        for col in ("cause", "before", "after", "change"):
            t.add_column(col, justify="left" if col == "cause" else "right")
        for r in doc["by_cause"]:
            t.add_row(*_cells(r["cause"], f"{r['before_pct']:.1f}%", f"{r['after_pct']:.1f}%",
                              _points(r["change_points"])))
        console.print(t)
    if doc["culprits"]:
        t = Table(title="Culprits (% of GPU window; processes are per run: new pids each run)", title_justify="left")
        for col in ("kind", "culprit", "before", "after"):
            t.add_column(col, justify="right" if col in ("before", "after") else "left")
        for c in doc["culprits"]:
            t.add_row(*_cells(c["kind"], shown(c["culprit"]), _share(c["before_pct"], c["before_ns"]),
                              _share(c["after_pct"], c["after_ns"])))
        console.print(t)
    if doc.get("processes"):
        t = Table(title="Stall time by process name (% of GPU window; processes of one name summed)",
                  title_justify="left")
        for col in ("process", "processes", "before", "after", "change"):
            t.add_column(col, justify="left" if col == "process" else "right")
        for p in doc["processes"]:
            name = f"{p['comm']} (GPU process)" if p["gpu_process"] else p["comm"]
            t.add_row(*_cells(shown(name), f"{p['before_processes']} → {p['after_processes']}",
                              _share(p["before_pct"], p["before_ns"]), _share(p["after_pct"], p["after_ns"]),
                              _points(p["change_points"])))
        console.print(t)
