"""`gputrace view TRACE`: open a Perfetto trace in the Perfetto UI."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from gputrace.cli import common
from gputrace.viewer.serve import (
    DEFAULT_PORT,
    UI_PORT,
    TraceServer,
    has_graphical_browser,
    open_in_browser,
    trace_for,
)

HELP = "open a Perfetto trace (or a capture's trace) in the Perfetto UI"
ORDER = 40
EXAMPLES = """\
  gputrace view gputrace-python.4242.pftrace           serve it on 127.0.0.1:9001 and open ui.perfetto.dev
  gputrace view gputrace-python.4242.gputrace          a capture: its .pftrace, exported first if missing
  gputrace view --no-browser --port 9100 run.pftrace   on a remote host whose 9001 is taken: serve on 9100, and
                                                       forward your 9001 to it: ssh -L 9001:127.0.0.1:9100 HOST

The trace is served only to the Perfetto UI (CORS origin https://ui.perfetto.dev), only on 127.0.0.1, and
only that one file; the server stops once the UI has loaded it. The UI fetches traces only from
127.0.0.1:9001 (its Content-Security-Policy), so the printed URL always names 9001. Over ssh, forward that
port first: ssh -L 9001:127.0.0.1:9001 HOST (or to the --port it serves on), then open the URL locally.
"""


def prepare_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", metavar="TRACE", help="a .pftrace file, or a .gputrace capture")
    p.add_argument("--port", type=common.port, default=DEFAULT_PORT,
                   help=f"local port to serve on (default {DEFAULT_PORT}, the only one the Perfetto UI fetches "
                        f"from: another needs local port {UI_PORT} forwarded to it)")
    p.add_argument("--no-browser", action="store_true", help="only print the URL; do not try to open a browser")


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    server = TraceServer(port=args.port)  # the port first: a busy one fails before anything is exported
    try:
        with tempfile.TemporaryDirectory(prefix="gputrace-view-") as tmp:
            server.serve_file(trace_for(Path(args.trace), Path(tmp), _log))
            _announce(server, browser=not args.no_browser)
            try:
                server.serve_until_fetched()
            except KeyboardInterrupt as e:
                _log("Stopped.")
                return 128 + e.signum if isinstance(e, common.Terminated) else 130
    finally:
        server.close()
    _log("The Perfetto UI loaded the trace; server stopped.")
    return 0


def _announce(server: TraceServer, *, browser: bool) -> None:
    from gputrace.viewer.terminal import shown  # rich, only when needed

    print(f"Serving {shown(str(server.path))} at {server.file_url} (only to the Perfetto UI)", flush=True)
    if server.needs_forward:  # a browser here would fetch from 9001, where this server is not
        print(f"The Perfetto UI fetches traces only from 127.0.0.1:{UI_PORT}: forward that port to this one first, "
              f"from the machine with the browser: ssh -L {UI_PORT}:127.0.0.1:{server.port} HOST", flush=True)
    print(f"Open: {server.url}", flush=True)
    if browser and not server.needs_forward and has_graphical_browser() and open_in_browser(server.url):
        _log("Opened the Perfetto UI in your browser; waiting for it to load the trace (Ctrl-C to stop)")
    else:
        _log("Open the URL above in a browser; waiting for it to load the trace (Ctrl-C to stop)")
