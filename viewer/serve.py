"""Open a Perfetto trace in the Perfetto UI the way Perfetto's own tooling does.

The UI (https://ui.perfetto.dev) runs in the browser and fetches the trace from a local HTTP server on
127.0.0.1:9001 that allows that origin: its Content-Security-Policy (connect-src) lets it fetch from that port
only, so the link always names 9001, and a server on another port needs local port 9001 forwarded to it. The
server here serves exactly one file under exactly one URL path (nothing else on disk is reachable), answers
everything else with 404, and stops once the UI has fetched the whole file.
"""

from __future__ import annotations

import errno
import http.server
import os
import shutil
import sys
import threading
import webbrowser
from collections.abc import Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote, unquote_to_bytes

from gputrace.errors import OutputError, UserError

UI_ORIGIN = "https://ui.perfetto.dev"
UI_PORT = 9001  # the one port the UI's Content-Security-Policy lets it fetch from (connect-src http://127.0.0.1:9001)
DEFAULT_PORT = UI_PORT


def url_path(name: str) -> str:
    """The URL path of a file name: every byte of it but letters, digits and ``_.-~`` percent-encoded (the name
    need not be UTF-8)."""
    return "/" + quote(os.fsencode(name), safe="")


def ui_url(file_url: str) -> str:
    """The Perfetto UI link that loads ``file_url``. The UI decodes its ``url=`` argument once before fetching
    it, so the argument is encoded whole (as the UI's own router writes it): the path reaches the server as
    ``url_path`` made it, whatever the name holds (``% & + # ?``)."""
    return f"{UI_ORIGIN}/#!/?url={quote(file_url, safe='')}"


def _listen_error(port: int, err: OSError) -> UserError:
    if port == UI_PORT:
        hint = ("another viewer running? the Perfetto UI loads traces only from port 9001: stop that one, or serve "
                "on another --port behind an ssh -L 9001 forward")
    else:
        hint = "try another --port"
    return UserError(f"cannot listen on 127.0.0.1:{port}: {err.strerror} ({hint})")


class TraceServer:
    """Serves one trace file on 127.0.0.1:port until it was fetched once in full (or ``close()``).

    The port is taken first (``TraceServer(port=P)``), the file named later (``serve_file``): a busy port fails
    before anything is exported. Until then every request is a 404.
    """

    def __init__(self, path: Path | None = None, port: int = DEFAULT_PORT) -> None:
        self.path: Path | None = None
        self.name = self.url_path = self.url = self.file_url = ""
        self.fetched = threading.Event()
        self._serving = False
        self.requests: list[str] = []
        try:
            self.httpd = _Server(("127.0.0.1", port), _handler_for(self))
        except OSError as e:
            raise _listen_error(port, e) from None
        self.port = int(self.httpd.server_address[1])
        if path is not None:
            self.serve_file(path)

    def serve_file(self, path: Path) -> None:
        self.path, self.name, self.url_path = path, path.name, url_path(path.name)
        self.file_url = f"http://127.0.0.1:{self.port}{self.url_path}"
        self.url = ui_url(f"http://127.0.0.1:{UI_PORT}{self.url_path}")

    @property
    def needs_forward(self) -> bool:
        """Served on a port the UI does not fetch from: local port 9001 must be forwarded to it."""
        return self.port != UI_PORT

    def is_trace(self, request_path: str) -> bool:
        """Whether a request's path names the trace, compared decoded: browsers percent-encode only some
        characters of a path (a space, not ``( ) & + ' ! *``)."""
        path = request_path.split("?", 1)[0]
        return unquote_to_bytes(path) == b"/" + os.fsencode(self.name)

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

    def handle_error(self, request: Any, client_address: Any) -> None:
        if isinstance(sys.exception(), ConnectionError):  # the browser went away (a reload, a closed tab)
            return
        super().handle_error(request, client_address)


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
        self.send_header("Access-Control-Allow-Methods", "GET, HEAD, OPTIONS")
        self.send_header("Access-Control-Allow-Headers", "*")
        self.send_header("Access-Control-Allow-Private-Network", "true")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def do_GET(self) -> None:  # noqa: N802
        if self._send_trace(body=True):
            self.trace.fetched.set()

    def do_HEAD(self) -> None:  # noqa: N802 - the headers alone: not the fetch the server waits for
        self._send_trace(body=False)

    def _send_trace(self, body: bool) -> bool:
        """Answer with the trace; True once all of it was sent."""
        self.trace.requests.append(self.path)
        if self.trace.path is None or not self.trace.is_trace(self.path):
            self.send_error(404, "only the trace is served here")
            return False
        try:
            f = open(self.trace.path, "rb")  # noqa: SIM115 - closed below
        except OSError:
            self.send_error(404, "the trace file is gone")
            return False
        with f:
            self.send_response(200)
            self.send_header("Content-Type", "application/octet-stream")
            self.send_header("Content-Length", str(os.fstat(f.fileno()).st_size))
            self.end_headers()
            if not body:
                return False
            try:
                shutil.copyfileobj(f, self.wfile)
            except ConnectionError:  # the browser dropped the download: not fetched, and nothing to report
                self.close_connection = True
                return False
        return True

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
    try:
        _export(path, out, log)
    except OutputError as e:
        if e.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
            raise
        raise UserError(f"cannot write the temporary Perfetto trace in {tmpdir}: {os.strerror(e.errno)} (point "
                        f"TMPDIR at a directory with room, or write it elsewhere: gputrace export {path} --perfetto "
                        f"DIR/{beside.name}, then gputrace view DIR/{beside.name})") from None
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


def _export(capture: Path, out: Path, log: Callable[[str], None]) -> None:
    from gputrace import pipeline
    from gputrace.cli.common import progress  # a line on a terminal while a large capture is read

    def incomplete(reader: Any) -> None:
        if not reader.complete:
            log(f"gputrace: warning: the capture is incomplete: {reader.problem or 'records were lost'}; "
                "the trace has what was readable")

    # No stalls track when the analysis fails: the trace still opens (the stalls are what `report` shows).
    pipeline.export_perfetto(capture, out, force=True, analyse=True, stage=progress, done=incomplete)
