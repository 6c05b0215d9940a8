"""`gputrace view`: a real HTTP client against the real server (headers, 404s, the bytes, stop after fetch)."""

from __future__ import annotations

import http.client
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gputrace.errors import UserError
from gputrace.viewer.serve import UI_ORIGIN, TraceServer, trace_for


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _get(port: int, path: str, method: str = "GET") -> tuple[int, dict[str, str], bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
    conn.request(method, path, headers={"Origin": UI_ORIGIN})
    resp = conn.getresponse()
    body = resp.read()
    conn.close()
    return resp.status, {k.lower(): v for k, v in resp.getheaders()}, body


def _wait_listening(port: int) -> None:
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            time.sleep(0.05)
    raise AssertionError("server did not start")


def test_cli_serves_only_the_trace_and_stops_after_fetch(tmp_path: Path) -> None:
    trace = tmp_path / "run 1.pftrace"
    data = os.urandom(300_000)
    trace.write_bytes(data)
    (tmp_path / "secret.txt").write_text("not for the browser")
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "gputrace", "view", "--no-browser", "--port", str(port),
                             str(trace)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_listening(port)
        for other in ("/", "/secret.txt", "/../secret.txt", "/run%201.pftrace/..", "/etc/passwd"):
            status, headers, _ = _get(port, other)
            assert status == 404, other
        status, headers, _ = _get(port, "/run%201.pftrace", "OPTIONS")
        assert status == 204 and headers["access-control-allow-origin"] == UI_ORIGIN
        assert proc.poll() is None, "a preflight or a 404 must not stop the server"
        status, headers, body = _get(port, "/run%201.pftrace")
        assert status == 200 and body == data
        assert headers["access-control-allow-origin"] == UI_ORIGIN
        assert headers["content-length"] == str(len(data))
        out, err = proc.communicate(timeout=10)
    finally:
        proc.kill()
    assert proc.returncode == 0
    # the UI fetches only from 9001 (its CSP), and decodes url= once: the link names 9001, encoded whole
    assert "https://ui.perfetto.dev/#!/?url=http%3A%2F%2F127.0.0.1%3A9001%2Frun%25201.pftrace" in out
    assert f"ssh -L 9001:127.0.0.1:{port} HOST" in out
    assert "loaded the trace" in err
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=1).close()


def test_listens_on_loopback_only(tmp_path: Path) -> None:
    trace = tmp_path / "t.pftrace"
    trace.write_bytes(b"x")
    server = TraceServer(trace, 0)
    try:
        assert server.httpd.server_address[0] == "127.0.0.1"
        assert server.url == "https://ui.perfetto.dev/#!/?url=http%3A%2F%2F127.0.0.1%3A9001%2Ft.pftrace"
        assert re.fullmatch(r"http://127\.0\.0\.1:\d+/t\.pftrace", server.file_url)
    finally:
        server.close()


def test_port_in_use_is_a_clear_error(tmp_path: Path) -> None:
    trace = tmp_path / "t.pftrace"
    trace.write_bytes(b"x")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        with pytest.raises(UserError, match="cannot listen on 127.0.0.1:.*--port"):
            TraceServer(trace, s.getsockname()[1])


def test_capture_with_its_trace_beside_serves_the_trace(tmp_path: Path) -> None:
    (tmp_path / "a.gputrace").write_bytes(b"capture")
    (tmp_path / "a.pftrace").write_bytes(b"trace")
    notes: list[str] = []
    assert trace_for(tmp_path / "a.gputrace", tmp_path, notes.append) == tmp_path / "a.pftrace"
    assert "is a capture" in notes[0]


def test_missing_file_is_a_clear_error(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "gputrace", "view", "--no-browser", str(tmp_path / "nope.pftrace")],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 2 and r.stderr.strip().endswith("nope.pftrace: no such file")
    assert "Traceback" not in r.stderr


def test_capture_without_trace_is_exported_first(tmp_path: Path) -> None:
    from gputrace.testing.perfetto_check import check_trace
    from gputrace.testing.synth import Builder

    b = Builder().proc(100, "python").device(100)
    b.op(100, 100, 0.0, 0.0, 10.0, "fwd")
    b.op(100, 100, 29.9, 30.0, 40.0, "bwd")
    capture = b.write(tmp_path / "run.gputrace")
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "gputrace", "view", "--no-browser", "--port", str(port),
                             str(capture)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        _wait_listening(port)
        status, _, body = _get(port, "/run.pftrace")
        out, err = proc.communicate(timeout=10)
    finally:
        proc.kill()
    assert status == 200 and proc.returncode == 0
    assert "is a capture; exporting it to a temporary Perfetto trace first" in err
    fetched = tmp_path / "fetched.pftrace"
    fetched.write_bytes(body)
    check = check_trace(fetched)
    assert check.ok, check.problems
    assert not (tmp_path / "run.pftrace").exists(), "the temporary trace is not left beside the capture"
