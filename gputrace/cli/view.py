"""`gputrace view TRACE`: open a Perfetto trace in the Perfetto UI."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from gputrace.cli import common
from gputrace.viewer.serve import DEFAULT_PORT, TraceServer, has_graphical_browser, open_in_browser, trace_for

HELP = "open a Perfetto trace (or a capture's trace) in the Perfetto UI"
ORDER = 40
EXAMPLES = """\
  gputrace view gputrace-python.4242.pftrace           serve it on 127.0.0.1:9001 and open ui.perfetto.dev
  gputrace view gputrace-python.4242.gputrace          a capture: its .pftrace, exported first if missing
  gputrace view --no-browser --port 9100 run.pftrace   print the URL only (e.g. over ssh -L 9100:127.0.0.1:9100)

The trace is served only to the Perfetto UI (CORS origin https://ui.perfetto.dev), only on 127.0.0.1, and
only that one file; the server stops once the UI has loaded it. Over ssh, forward the port first:
ssh -L 9001:127.0.0.1:9001 HOST, then open the printed URL locally.
"""


def prepare_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("trace", metavar="TRACE", help="a .pftrace file, or a .gputrace capture")
    p.add_argument("--port", type=common.port, default=DEFAULT_PORT,
                   help=f"local port to serve on (default {DEFAULT_PORT}, what the Perfetto UI expects)")
    p.add_argument("--no-browser", action="store_true", help="only print the URL; do not try to open a browser")


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    with tempfile.TemporaryDirectory(prefix="gputrace-view-") as tmp:
        path = trace_for(Path(args.trace), Path(tmp), _log)
        server = TraceServer(path, args.port)
        print(f"Serving {path} at {server.file_url} (only to the Perfetto UI)", flush=True)
        print(f"Open: {server.url}", flush=True)
        if not args.no_browser and has_graphical_browser() and open_in_browser(server.url):
            _log("Opened the Perfetto UI in your browser; waiting for it to load the trace (Ctrl-C to stop)")
        else:
            _log("Open the URL above in a browser; waiting for it to load the trace (Ctrl-C to stop)")
        try:
            server.serve_until_fetched()
        except KeyboardInterrupt:
            _log("Stopped.")
            return 130
    _log("The Perfetto UI loaded the trace; server stopped.")
    return 0
