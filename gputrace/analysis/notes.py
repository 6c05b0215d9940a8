"""The caveats of a capture, phrased once for the end-of-capture summary, the terminal and HTML reports and
the exports: records lost, no eBPF, processes left out, probe runs the kernel skipped, malformed records,
threads still waiting when it stopped."""

from __future__ import annotations

from gputrace.analysis.overhead import cost_text
from gputrace.analysis.timefmt import fmt_ms
from gputrace.documents import CaptureInfo, InProgressThread
from gputrace.probes.ebpf.events import FDS_UNNAMED, UNREPORTED_SWITCHES

_NOT_PROBE_SKIPS = (*UNREPORTED_SWITCHES, FDS_UNNAMED)  # in skipped_probes, with notes of their own


def no_ebpf_note(cap: CaptureInfo) -> str:
    why = cap.get("ebpf_missing")
    return (f"note: no eBPF in this capture ({why}): GPU stalls are found, but none can be given a host-side "
            "cause") if why else ""


def skipped_probes_note(cap: CaptureInfo) -> str:
    skipped = {k: v for k, v in (cap.get("skipped_probes") or {}).items() if not k.endswith(_NOT_PROBE_SKIPS)}
    if not skipped:
        return ""
    return (f"note: the kernel skipped {sum(skipped.values())} probe runs, each nested in another tracing program "
            f"on its CPU ({', '.join(f'{k}={v}' for k, v in skipped.items())}); their events, for any task, are "
            "missing: e.g. the waker of an off-CPU span")


def unreported_switches_note(cap: CaptureInfo) -> str:
    skipped = cap.get("skipped_probes") or {}
    n, lost = (sum(v for k, v in skipped.items() if k.endswith(name)) for name in UNREPORTED_SWITCHES)
    if not n:
        return ""
    return (f"note: the kernel did not report {n} switch{'es' if n != 1 else ''} of traced threads on or off a "
            "CPU (it fires no scheduler event for some tasks); those off-CPU spans are bounded by what was seen: "
            "they end at the thread's wakeup, the return of the call it slept in or where a timer tick or the "
            "thread's own dirty pause, block request or file fault first found it running, or start where it was "
            "last seen running in that call"
            + (f"; {lost} with none of these (preempted, switched away again before a tick) "
               f"{'is' if lost == 1 else 'are'} missing" if lost else ""))


def unnamed_fds_note(cap: CaptureInfo) -> str:
    n = sum(v for k, v in (cap.get("skipped_probes") or {}).items() if k.endswith(FDS_UNNAMED))
    return (f"note: {n} fd{'s' if n != 1 else ''} received over unix sockets (SCM_RIGHTS) closed before "
            f"{'their names' if n != 1 else 'its name'} could be read from /proc: the calls on "
            f"{'them' if n != 1 else 'it'} name no file") if n else ""


def malformed_note(cap: CaptureInfo) -> str:
    n = cap.get("malformed_records")
    return f"SKIPPED {n} malformed records" if n else ""


def unknown_kinds_note(cap: CaptureInfo) -> str:
    kinds = cap.get("unknown_record_kinds") or {}
    if not kinds:
        return ""
    listed = ", ".join(f"{k} ({n})" for k, n in kinds.items())
    return (f"note: {sum(kinds.values())} records of kinds this gputrace does not know were skipped: {listed}; "
            "the capture was written by a later version, which reads them")


def waiting_lines(cap: CaptureInfo, limit: int = 3) -> list[str]:
    """Threads still waiting when the capture stopped: a heading, then the ``limit`` longest, one a line."""
    waiting = cap.get("in_progress") or []
    if not waiting:
        return []
    n = cap.get("in_progress_threads", len(waiting))
    return [f"still waiting when the capture stopped: {n} thread(s); the longest:",
            *(f"  {waiting_text(w)}" for w in waiting[:limit])]


def waiting_text(w: InProgressThread) -> str:
    """'pid 42 tid 43 (python): read(/data/fifo) for more than 2.0 ms, state S'."""
    what = f"{w['op']}({w['object']})" if w["object"] else w["op"]
    since = "more than " if w["since_before_capture"] else ""
    state = f", state {w['state']}" if w["state"] else ""
    text = f"pid {w['pid']} tid {w['tid']} ({w['comm']}): {what} for {since}{fmt_ms(w['duration_ns'])}{state}"
    requests = w.get("requests") or []
    if requests:  # io_uring_enter: the requests still in flight, the oldest named
        q = requests[0]
        more = w.get("requests_in_flight", len(requests)) - 1
        named = f"{q['op'].lower()}({q['object']})" if q["object"] else q["op"].lower()
        text += f"; in flight: io_uring {named} for {fmt_ms(q['duration_ns'])}" + (f" (+{more} more)" if more else "")
    return text


def left_out_note(cap: CaptureInfo) -> str:
    n = cap.get("left_out")
    return (f"note: {n} process(es) left out of this capture: they gained privileges its owner lacks "
            "(setuid/setgid/setcap), as the kernel would refuse that user ptrace on them") if n else ""


def cgroup_errors_note(cap: CaptureInfo) -> str:
    """cpu cgroup files the capture could not read: the waits for a CPU of the processes in those cgroups were
    not checked for CPU quota throttling, so they stay ``cpu.runqueue``."""
    rows = [r for r in cap.get("cpu_cgroup_errors") or [] if isinstance(r, dict)]
    if not rows:
        return ""
    listed = "; ".join(f"{r.get('path', '')}: {r.get('error', '')}" for r in rows[:3])
    more = f" (+{len(rows) - 3} more)" if len(rows) > 3 else ""
    return (f"note: cpu cgroup files could not be read ({listed}{more}): waits for a CPU of the processes in "
            "them stay cpu.runqueue, not checked for CPU quota throttling")


def off_note(cap: CaptureInfo) -> str:
    off = cap.get("off") or []
    return (f"note: source families turned off for this capture: {', '.join(off)} (gputrace capture --off); "
            "what they would have shown is not in it") if off else ""


def cost_note(cap: CaptureInfo) -> str:
    return cost_text(cap["overhead"]) if "overhead" in cap else ""


def device_timing_note(cap: CaptureInfo) -> str:
    """Device timing that began after the capture did (an agent injected into a running process): what came
    before on the GPU is not in the capture, and no stall is found there."""
    start, late = cap.get("start_ns"), cap.get("device_timing_from_ns")
    attached = [r for r in cap.get("attached") or [] if isinstance(r, dict) and r.get("how") == "injected"]
    if not attached or type(start) is not int or type(late) is not int or late - start < 1_000_000:
        return ""  # an agent armed at launch (capture -- CMD, an armed service) missed nothing
    how = ", ".join(f"pid {r['pid']} {r.get('method') or r.get('how')}"
                    + (f", paused {r['pause_ms']:.1f} ms" if "pause_ms" in r else "") for r in attached)
    return (f"note: device timing from +{(late - start) / 1e6:.1f} ms (when the GPU agent started"
            + (f": {how}" if how else "") + "); GPU work before that is not in the capture")


def caveats(cap: CaptureInfo) -> list[tuple[str, str]]:
    """(severity, text) of each caveat the capture has, in summary_lines' order: "warn" (no host side at all),
    "note", "alert" (records skipped) or "info" (what tracing cost). The threads still waiting are apart:
    waiting_lines."""
    notes = [("warn", no_ebpf_note(cap)), ("note", off_note(cap)), ("note", left_out_note(cap)),
             ("note", skipped_probes_note(cap)), ("note", unreported_switches_note(cap)),
             ("note", unnamed_fds_note(cap)),
             ("note", unknown_kinds_note(cap)), ("note", cgroup_errors_note(cap)),
             ("note", device_timing_note(cap)), ("alert", malformed_note(cap)), ("info", cost_note(cap))]  # fmt: skip
    return [(severity, text) for severity, text in notes if text]


def capture_notes(cap: CaptureInfo, waiting: int = 3) -> list[str]:
    """All of the above, as lines."""
    return [text for _, text in caveats(cap)] + waiting_lines(cap, waiting)


def lost_records(drops: dict[str, int]) -> str:
    """"1234 records (ebpf.ringbuf=1200, agent.pid42.queue=34)", or "" when no source lost any."""
    lost = {k: v for k, v in drops.items() if type(v) is int and v > 0}
    if not lost:
        return ""
    return f"{sum(lost.values())} records ({', '.join(f'{k}={v}' for k, v in lost.items())})"
