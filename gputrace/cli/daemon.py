"""`gputrace daemon`: run the gputraced service in the foreground, or talk to it."""

from __future__ import annotations

import argparse
import json
import socket
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from gputrace.cli import common
from gputrace.errors import UserError
from gputrace.families import parse_off

HELP = "run the gputraced capture service in the foreground, or ask it for a capture"
ORDER = 70
EXAMPLES = """\
  sudo gputrace daemon                                  run the service (what systemd/gputraced.service runs)
  sudo gputrace daemon --socket /tmp/g.sock --state-dir /tmp/gstate     a private instance
  gputrace daemon capture -p 4242 -d 10                 capture your own process 4242 for 10 s, wait for it
  gputrace daemon capture -p 4242 -d 600 --name run7 --no-wait           start it and return
  gputrace daemon list                                  your captures (root: everyone's) and your files
  gputrace daemon status                                the service's version, uptime, running captures
  gputrace daemon stop 3                                end capture job 3 early (it is still written)
  sudo gputrace daemon --watch --metrics-textfile /var/lib/node_exporter/textfile/gputrace.prom
                                                        also watch every GPU job (flight recorder, metrics)
  gputrace daemon dump 4242                             write the last minute of your watched job 4242

The service listens only on a unix socket (default /run/gputrace/gputraced.sock). Each request is checked
with the caller's kernel credentials (SO_PEERCRED): you may capture only your own processes; root may
capture any. Captures land in /var/lib/gputrace/<your uid>/ (mode 0700, owned by you): NAME.gputrace and
NAME.pftrace. Needs no privileges of its own on the client side.
"""


def _socket_arg(p: argparse.ArgumentParser, default: Any) -> None:
    from gputrace.daemon.service.server import DEFAULT_SOCKET

    p.add_argument("--socket", type=Path, default=default, help=f"the service's socket (default {DEFAULT_SOCKET})")


def prepare_parser(p: argparse.ArgumentParser) -> None:
    from gputrace.daemon.service.server import add_service_args

    add_service_args(p)
    sub = p.add_subparsers(dest="daemon_command", metavar="CLIENT-COMMAND")
    cap = sub.add_parser("capture", help="ask the service to capture processes")
    common.add_pid(cap)
    cap.add_argument("-d", "--duration", type=common.positive_float, required=True, metavar="SEC",
                     help="how long to capture")
    cap.add_argument("--name", help="file name for the capture (a name, not a path; .gputrace added)")
    common.add_min_gap(cap)
    cap.add_argument("--off", action="append", default=[], metavar="FAMILY[,FAMILY]",
                     help="turn a source family off (repeatable; the names and what each costs: "
                          "gputrace capture --help)")  # fmt: skip
    cap.add_argument("--no-wait", action="store_true", help="return once the capture started")
    stop = sub.add_parser("stop", help="end a running capture job early")
    stop.add_argument("job", type=int, help="the job id (from `gputrace daemon list`)")
    sub.add_parser("list", help="list capture jobs and your capture files")
    sub.add_parser("status", help="show the service's status (with --watch: the jobs watched, cost, drops)")
    dump = sub.add_parser("dump", help="write a watched job's flight recorder window as a capture")
    dump.add_argument("pid", type=int, help="a process of the job (gputrace daemon status lists the jobs)")
    for sp in (cap, stop, sub.choices["list"], sub.choices["status"], dump):
        _socket_arg(sp, argparse.SUPPRESS)
        sp.add_argument("--json", action="store_true", help="print the service's reply as JSON")


def run(args: argparse.Namespace) -> int:
    if not args.daemon_command:
        from gputrace.daemon.service.server import serve_from_args

        return serve_from_args(args)
    if args.daemon_command == "capture":
        return _capture(args)
    req: dict[str, Any] = {"op": args.daemon_command}
    if args.daemon_command == "stop":
        req["job"] = args.job
    if args.daemon_command == "dump":
        req["pid"] = args.pid
    reply = next(request(args.socket, req))
    _print(reply, args.json)
    return 0


class _Replies:
    """One request on its own connection, and the service's reply frames read one at a time: a Ctrl-C while
    waiting for one leaves the connection usable (a generator would be closed by it)."""

    def __init__(self, path: Path, req: dict[str, Any], timeout_s: float | None = 30.0) -> None:
        from gputrace.daemon.service.protocol import send_frame

        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(timeout_s)
        try:
            self.sock.connect(str(path))
        except OSError as e:
            self.sock.close()
            raise UserError(f"cannot reach gputraced at {path}: {e.strerror} (is the service running?)") from None
        try:
            send_frame(self.sock, req)
        except (BrokenPipeError, ConnectionResetError):
            # A refusal (busy) is sent at once and the connection closed, maybe before our request was: the
            # reply is still there to read, and says why.
            if self.next() is None:
                self.sock.close()
                raise UserError("gputraced closed the connection before the request was sent") from None

    def next(self) -> dict[str, Any] | None:
        """The next reply frame (None: the service closed the connection). A refusal is a UserError."""
        from gputrace.daemon.service.protocol import MAX_REPLY, ProtocolError, recv_frame

        try:
            reply = recv_frame(self.sock, MAX_REPLY)
        except ProtocolError as e:
            raise UserError(f"bad reply from gputraced: {e}") from None
        if reply is not None and not reply.get("ok") and reply.get("event") != "done":
            raise UserError(f"gputraced refused: {reply.get('error', 'no reason given')}")
        return reply

    def close(self) -> None:
        self.sock.close()


def request(path: Path, req: dict[str, Any], timeout_s: float | None = 30.0) -> Iterator[dict[str, Any]]:
    """Send one request; yield the service's reply frames until it closes. A refusal is a UserError."""
    replies = _Replies(path, req, timeout_s)
    try:
        while (reply := replies.next()) is not None:
            yield reply
    finally:
        replies.close()


def _capture(args: argparse.Namespace) -> int:
    if not args.pid:
        raise UserError("give the processes to capture with -p/--pid PID")
    common.require_positive("--min-gap-ms", args.min_gap_ms)
    req = {"op": "capture", "pids": args.pid, "duration_s": args.duration, "min_gap_ms": args.min_gap_ms,
           "wait": not args.no_wait, **({"name": args.name} if args.name else {}),
           **({"off": sorted(parse_off(args.off))} if args.off else {})}
    replies = _Replies(args.socket, req, timeout_s=None if not args.no_wait else 30.0)
    try:
        started = replies.next()
        if started is None:
            raise UserError("gputraced closed the connection without starting the capture")
        job = started["job"]
        print(f"gputraced: job {job['id']} capturing pids {job['pids']} for {job['duration_s']:g} s",
              file=sys.stderr)
        if args.no_wait:
            _print(started, args.json)
            return 0
        try:
            final = replies.next()
        except KeyboardInterrupt:  # the job is the service's: ask it to stop, and still report what it wrote
            next(request(args.socket, {"op": "stop", "job": job["id"]}))
            print("gputraced: stopping the capture, it is still written", file=sys.stderr)
            final = replies.next()
    finally:
        replies.close()
    if final is None:
        raise UserError(f"gputraced closed the connection before job {job['id']} ended (gputrace daemon list "
                        "shows its state)")
    if not args.json:
        for line in final.get("log", []):  # what the capture said: notes, warnings, its stall summary
            print(line, file=sys.stderr)
    _print(final, args.json)
    return 0 if final.get("ok") else 1


def _print(reply: dict[str, Any], as_json: bool) -> None:
    if as_json:
        print(json.dumps(reply, indent=2))
        return
    if "jobs" in reply:
        for job in reply["jobs"]:
            print(_job_line(job))
        print(f"files in {reply.get('directory', '')}:")
        for f in reply.get("files", []):
            print(f"  {f['name']}  {f['bytes']:,} bytes")
    elif "path" in reply:
        print(f"Wrote {reply['path']}")
        print(f"Next:\n  gputrace report {reply['path']}")
    elif "job" in reply:
        print(_job_line(reply["job"]))
        for path in reply["job"].get("files", []):
            print(f"Wrote {path}")
    else:
        for key, value in reply.items():
            if key not in ("ok", "watch"):
                print(f"{key}: {value}")
        if "watch" in reply:
            _print_watch(reply["watch"])


def _print_watch(w: dict[str, Any]) -> None:
    cost = w.get("cost", {})
    print(f"watch: {w.get('watching', 0)} jobs watched (at most {w.get('max_jobs')}), {w.get('refused', 0)} refused "
          f"at the cap, {w.get('vanished', 0)} gone before tracing began, {w.get('released', 0)} let go (no GPU "
          f"work in {w.get('idle_s', 0):g} s); flight recorder "
          f"{w.get('flight_seconds'):g} s, at most {w.get('flight_mib'):g} MiB per job; "
          f"off: {', '.join(w.get('off', [])) or 'none'}")
    print(f"watch cost: {cost.get('host_cpu_share', 0):.2%} of host CPU (jobs' probes and agents "
          f"{cost.get('jobs_cpu_share', 0):.2%}, the service {cost.get('service_cpu_share', 0):.2%}); "
          f"{cost.get('scans', 0)} scans of {cost.get('processes', 0)} processes took {cost.get('scan_cpu_s', 0)} s "
          f"CPU; {cost.get('segments_analysed', 0)} segments analysed in {cost.get('analysis_cpu_s', 0)} s CPU "
          f"(budget {cost.get('analysis_budget_share', 0):.2%}), {cost.get('segments_estimated', 0)} estimated, "
          f"{cost.get('analysis_skipped', 0)} skipped")
    kernel = w.get("kernel_programs")
    if kernel:
        sets = kernel.get("sets", [])
        print(f"watch kernel programs: {len(sets)} set(s) loaded now ({kernel.get('loaded', 0)} since the start), "
              + "; ".join(f"uid {s['owner_uid'] if s['owner_uid'] is not None else 0}: {s['jobs']} jobs, "
                          f"{s['processes']} processes, {s['unrouted']} events of no job" for s in sets))
        for s in sets:
            busiest = s.get("busiest", [])
            if busiest:
                print("  busiest programs (every such event on the host runs them): " + ", ".join(
                    f"{b['program']} {b['runs_per_s']:,.0f}/s at {b['ns_per_run']:.0f} ns ({b['host_share']:.2%})"
                    for b in busiest))
    otlp = w.get("otlp")
    if otlp:
        print(f"watch metrics by OTLP to {otlp['target']}: {otlp['exports']} exports, {otlp['failed']} failed"
              + (f" ({otlp['error']})" if otlp.get("error") else ""))
    for job in w.get("jobs", []):
        busy = "-" if job.get("busy_ratio") is None else f"{job['busy_ratio']:.0%}"
        drops = sum(job.get("drops", {}).values())
        print(f"  pid {job['pid']} ({job['comm']}, uid {job['uid']}, {job['found_by']}): {job['state']}, GPU busy "
              f"{busy}, top stall cause {job.get('top_cause') or '-'}, {job['segments']} segments "
              f"{job['flight_bytes'] / 1048576:.1f} MiB, {drops:,} records dropped, {len(job.get('dumps', []))} dumps"
              + (f": {job['error']}" if job.get("error") else "")
              + (f"; let go: {job['released']}" if job.get("released") else ""))


def _job_line(job: dict[str, Any]) -> str:
    extra = ""
    if job.get("state") == "done":
        extra = f", {job.get('stalls', 0)} stalls, {job.get('stall_ns', 0) / 1e6:.1f} ms stalled" + _losses(job)
        if job.get("stop_reason") not in (None, "", "duration"):
            from gputrace.viewer.terminal import ended

            extra += f"; {ended(job['stop_reason'])}"
    elif job.get("error"):
        extra = f": {job['error']}"
    return f"job {job['id']}: {job['state']}, uid {job['uid']}, pids {job['pids']}, {job['name']}{extra}"


def _losses(job: dict[str, Any]) -> str:
    """What the capture lacks, counted: records lost per source, processes left out."""
    out = ""
    drops = job.get("drops") or {}
    if drops or not job.get("complete", True):
        lost = ", ".join(f"{k} {v:,}" for k, v in drops.items())
        out += f", INCOMPLETE: records lost ({lost or 'see gputrace report'})"
    if job.get("left_out"):
        from gputrace.probes.ebpf.owner import LEFT_OUT_WHY

        out += f", {job['left_out']} processes left out: {LEFT_OUT_WHY}"
    return out
