"""Open a Perfetto trace in the Perfetto UI the way Perfetto's own tooling does.

The UI (https://ui.perfetto.dev) runs in the browser and fetches the trace from a local HTTP server on
127.0.0.1:9001 that allows that origin. The server here serves exactly one file under exactly one URL path
(nothing else on disk is reachable), answers everything else with 404, and stops once the UI has fetched
the whole file.
"""

from __future__ import annotations

import http.server
import os
import shutil
import threading
import webbrowser
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

from gputrace.errors import UserError

UI_ORIGIN = "https://ui.perfetto.dev"
DEFAULT_PORT = 9001


def ui_url(port: int, name: str) -> str:
    return f"{UI_ORIGIN}/#!/?url=http://127.0.0.1:{port}/{quote(name)}"


class TraceServer:
    """Serves one trace file on 127.0.0.1:port until it was fetched once (or ``stop()``)."""

    def __init__(self, path: Path, port: int = DEFAULT_PORT) -> None:
        self.path = path
        self.name = path.name
        self.url_path = "/" + quote(self.name)
        self.fetched = threading.Event()
        self._serving = False
        self.requests: list[str] = []
        try:
            self.httpd = _Server(("127.0.0.1", port), _handler_for(self))
        except OSError as e:
            raise UserError(
                f"cannot listen on 127.0.0.1:{port}: {e.strerror} (another viewer running? try --port)") from None
        self.port = int(self.httpd.server_address[1])
        self.url = ui_url(self.port, self.name)
        self.file_url = f"http://127.0.0.1:{self.port}{self.url_path}"

    def serve_until_fetched(self, timeout_s: float | None = None) -> bool:
        """Handle requests until the file was served completely; False on timeout."""
        thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.1}, daemon=True)
        self._serving = True
        thread.start()
        try:
            return self.fetched.wait(timeout_s)
        finally:
            self.close()
            thread.join()

    def close(self) -> None:
        if self._serving:  # shutdown() waits for serve_forever() to notice, so only when it runs
            self._serving = False
            self.httpd.shutdown()
        self.httpd.server_close()


class _Server(http.server.ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True


def _handler_for(server: TraceServer) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(_TraceHandler):
        trace = server

    return Handler


class _TraceHandler(http.server.BaseHTTPRequestHandler):
    trace: TraceServer

    def version_string(self) -> str:
        return "gputrace-view"

    def end_headers(self) -> None:
        self.send_header("Access-Control-Allow-Origin", UI_ORIGIN)
        self.send_header("Cache-Control", "no-cache")
        super().end_headers()

    def do_OPTIONS(self) -> None:  # noqa: N802 - a browser's CORS / private-network preflight
        self.send_response(204)
        self.send_header("Access-Control-Allow-Methods", "GET, OPTIONS")
        self.send_header("Access-Control-Allow-Headers", "*")
        self.send_header("Access-Control-Allow-Private-Network", "true")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self) -> None:  # noqa: N802
        self.trace.requests.append(self.path)
        if self.path.split("?", 1)[0] != self.trace.url_path:
            self.send_error(404, "only the trace is served here")
            return
        try:
            f = open(self.trace.path, "rb")  # noqa: SIM115 - closed below
        except OSError:
            self.send_error(404, "the trace file is gone")
            return
        with f:
            size = os.fstat(f.fileno()).st_size
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(size))
            self.end_headers()
            shutil.copyfileobj(f, self.wfile)
        self.trace.fetched.set()

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
        pass


def has_graphical_browser() -> bool:
    """Only open a browser where a display exists: in a terminal, webbrowser would start a text browser."""
    return bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))


def open_in_browser(url: str) -> bool:
    try:
        return bool(webbrowser.open_new_tab(url))
    except webbrowser.Error:
        return False


def trace_for(path: Path, tmpdir: Path, log: Callable[[str], None]) -> Path:
    """The Perfetto trace to serve for ``path``: the file itself, or for a capture its trace (exported if needed)."""
    from gputrace.capture import open_capture

    if not path.is_file():
        what = "a directory" if path.is_dir() else "not a regular file" if path.exists() else "no such file"
        raise UserError(f"{path}: {what}" + (", not a trace" if path.is_dir() else ""))
    kind = _kind_of(path)
    if kind == "empty":
        raise UserError(f"{path} is empty: not a trace")
    if kind == "trace":
        return path
    if kind == "unknown" and path.suffix != ".gputrace":
        log(f"gputrace: warning: {path} does not look like a trace the Perfetto UI opens; serving it anyway")
        return path
    beside = path.with_suffix(".pftrace")
    if beside != path and beside.is_file() and _kind_of(beside) not in ("empty", "capture"):
        if beside.stat().st_mtime >= path.stat().st_mtime:
            log(f"{path} is a capture; opening its Perfetto trace {beside}")
            return beside
        log(f"{beside} is older than {path} (from an earlier capture?); not using it")
    if kind != "capture":
        open_capture(path).close()  # raises what is wrong with it
    out = tmpdir / beside.name
    log(f"{path} is a capture; exporting it to a temporary Perfetto trace first "
        f"(to keep one: gputrace export {path} --perfetto {beside.name})")
    export_perfetto(path, out, log)
    return out


# How the files the Perfetto UI opens begin: protobuf (field 1, TracePacket), gzip, JSON, systrace text.
_TRACE_STARTS = (b"\x0a", b"\x1f\x8b", b"{", b"[", b"#")


def _kind_of(path: Path) -> str:
    """'capture', 'trace', 'empty' or 'unknown', by the first bytes, whatever the name."""
    from gputrace.capture import HEADER_PREFIX

    try:
        with open(path, "rb") as f:
            head = f.read(len(HEADER_PREFIX))
    except OSError as e:
        raise UserError(f"cannot open {path}: {e.strerror}") from None
    if not head:
        return "empty"
    if head.startswith(HEADER_PREFIX):
        return "capture"
    return "trace" if head.startswith(_TRACE_STARTS) else "unknown"


def export_perfetto(capture: Path, out: Path, log: Callable[[str], None] = lambda _: None) -> None:
    from gputrace.capture import open_capture

    try:
        from gputrace.exporters.perfetto import PerfettoExporter
    except ImportError:
        raise UserError("the Perfetto exporter is not available in this installation") from None
    with open_capture(capture) as reader:
        report = _report(reader)
    with open_capture(capture) as reader:
        PerfettoExporter(out, report=report).write(reader)
        complete, problem = reader.complete, reader.problem
    if not complete:
        log(f"gputrace: warning: the capture is incomplete: {problem or 'records were lost'}; "
            "the trace has what was readable")


def _report(reader: Any) -> dict[str, Any] | None:
    """The stall analysis, so the trace gets its stalls track; without it the trace still opens."""
    try:
        from gputrace.analysis import analyze

        result: dict[str, Any] = analyze(reader)
        return result
    except (ImportError, UserError):
        return None
