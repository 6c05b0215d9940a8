"""The report's renderers and `gputrace view` on hostile or unusual input: markup in recorded text, what the JSON
says about a capture's gaps, file names browsers send unencoded, dropped downloads, busy ports, HEAD."""

from __future__ import annotations

import html
import os
import socket
import struct
import subprocess
import sys
import threading
import urllib.request
from collections.abc import Callable
from pathlib import Path
from urllib.parse import quote, unquote, urlsplit

import pytest
from test_view import _free_port, _get
from workloads.loopdev import small_tmpfs

from gputrace.analysis import analyze, summary_lines
from gputrace.capture import CaptureWriter, host_header, open_capture
from gputrace.errors import UserError
from gputrace.records import InProgress
from gputrace.testing.synth import Builder, ns
from gputrace.viewer.serve import UI_ORIGIN, TraceServer

TRAINER, WORKER = 100, 200


def _gputrace(*args: str | bytes, cwd: Path | None = None, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gputrace", *args], capture_output=True, text=True, timeout=60,
                          cwd=cwd, env={**os.environ, "COLUMNS": "400", **env})


def _storage_builder(obj: str, comm: str = "worker") -> Builder:
    """A simulated device that waits 30 ms on a worker ``comm`` reading ``obj``."""
    b = Builder().proc(TRAINER, "python").proc(WORKER, comm, TRAINER).device(TRAINER, name="GPU[x]")
    b.op(TRAINER, TRAINER, 0, 0, 10, "fwd")
    b.op(TRAINER, TRAINER, 39.95, 40, 50, "bwd")
    b.syscall(TRAINER, TRAINER, "read", 9, 39.9, "pipe").offcpu(TRAINER, TRAINER, 9, 39.9, "S", 39.8,
                                                                (WORKER, WORKER, comm))
    b.syscall(WORKER, WORKER, "pread64", 11, 39, obj, 4 << 20).block(WORKER, WORKER, 11.1, 38.9, 4 << 20)
    return b


# ------------------------------------------------------------------------------- terminal: no markup ---


@pytest.mark.parametrize(("obj", "comm", "host"), [("/data/[/b]shard.bin", "worker", "node7"),  # was a crash
                                                    ("/data/[red]shard.bin", "worker", "node7"),  # was swallowed
                                                    ("/data/shard.bin", "work[/]er", "node[/]7")])
def test_terminal_shows_recorded_text_exactly(tmp_path: Path, obj: str, comm: str, host: str) -> None:
    cap = _storage_builder(obj, comm).write(tmp_path / "m.gputrace", header={"host": host})
    r = _gputrace("report", str(cap))
    assert r.returncode == 0, r.stderr
    for exact in (f"host {host} ·", f"pid 200 ({comm})", "0 GPU[x] (pid 100) [simulated]", "wait:pid 200"):
        assert exact in r.stdout, exact
    assert r.stdout.count(obj) == 2, "the culprit table and the stall's description"


# ------------------------------------------------------------- terminal and HTML: the capture's gaps ---


def _capture_with_gaps(tmp_path: Path) -> Path:
    """No eBPF, probes the kernel skipped, a thread still waiting at the stop, and malformed records."""
    b = Builder().proc(TRAINER, "python").device(TRAINER)
    b.op(TRAINER, TRAINER, 0, 0, 10, "fwd")
    b.op(TRAINER, TRAINER, 39.95, 40, 50, "bwd")
    b.syscall(TRAINER, TRAINER, "clock_nanosleep", 10.2, 39.8)
    b.records.append(InProgress(TRAINER, TRAINER + 1, "read", ns(45), ns(50), "S", "/data/fifo", True))
    w = CaptureWriter(tmp_path / "gaps.gputrace", {**host_header(["t"]), "start_ns": ns(0)}, force=True)
    w.write(b.records)
    w.write_rows("Syscall", [[TRAINER, TRAINER, "read", "soon", ns(20), 0, 3, "/x", 0, 0]])
    w.write_rows("NvmlSample", [[ns(1), 0, "gpu_util_pct", "high"]])
    return w.close({"end_ns": ns(50), "drops": {}, "complete": True,
                    "sources": {"ebpf": ["missing", "kernel headers for 6.1.0 not found"]},
                    "skipped": {"ebpf.sched_waking": 8, "ebpf.sched_switch": 2}})


def test_terminal_and_html_say_what_the_capture_lacks(tmp_path: Path) -> None:
    from gputrace.analysis.notes import capture_notes

    cap = _capture_with_gaps(tmp_path)
    with open_capture(cap) as reader:
        report = analyze(reader)
    # the capture's own end-of-run summary: each of its caveats, phrased once, shown by both renderers
    caveats = [line for line in summary_lines(report)
               if line.startswith(("note: no eBPF", "note: the kernel skipped", "SKIPPED", "still waiting", "  pid"))]
    assert len(caveats) == 5, summary_lines(report)
    assert capture_notes(report["capture"]) == caveats, "the helper summary_lines can share"
    verdict = report["summary"]["input_bound"]["verdict"]
    r = _gputrace("report", str(cap), "--html", str(tmp_path / "r.html"))
    assert r.returncode == 0, r.stderr
    page = (tmp_path / "r.html").read_text()
    for line in [*(c.strip() for c in caveats), verdict]:
        assert line in r.stdout, line
        assert html.escape(line) in page, line


# --------------------------------------------------------------------------------------- HTML title ---


def test_non_utf8_capture_name_is_shown_with_a_replacement_character(tmp_path: Path) -> None:
    name = os.fsdecode(b"ex\xff.gputrace")
    cap = _storage_builder("/data/shard.bin").write(tmp_path / name)
    out = tmp_path / "r.html"
    r = _gputrace("report", os.fsencode(cap), "--html", str(out), PYTHONIOENCODING="utf-8")  # stdout: strict
    assert r.returncode == 0, r.stderr
    assert "<title>gputrace ex\ufffd.gputrace</title>" in out.read_text(encoding="utf-8")
    assert "gputrace report ex\ufffd.gputrace" in r.stdout


# ---------------------------------------------------------------------------------------- --html "" ---


def test_empty_html_path_is_a_user_error(tmp_path: Path) -> None:
    cap = _storage_builder("/data/shard.bin").write(tmp_path / "a.gputrace")
    r = _gputrace("report", str(cap), "--html", "", cwd=tmp_path)
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == "gputrace: error: --html needs a file name (e.g. --html report.html)\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.gputrace"]


# ------------------------------------------------------------------------------------ view: the link ---


NAMES = ["run (1).pftrace", "a&b+c.pftrace", "it's (!*).pftrace", "100% #2?.pftrace"]
# A browser's URL parser percent-encodes only the WHATWG path set (space " < > ` { }, and # ? where they would
# end the path) of a path it is given: everything else arrives as it is, "%" included.
BROWSER_SAFE = "/!$%&'()*+,;=:@[]\\^|~"


def _as_the_ui_fetches(link: str, port: int) -> str:
    """The URL the Perfetto UI fetches for one of our links, with 127.0.0.1:9001 forwarded to ``port``: the UI's
    router reads the fragment's query string ('+' as a space, then decodeURIComponent), and fetches that."""
    query = link.split("#!/?", 1)[1]
    args = dict(kv.split("=", 1) for kv in query.split("&"))
    target = urlsplit(unquote(args["url"].replace("+", " ")))
    assert (target.scheme, target.hostname, target.port) == ("http", "127.0.0.1", 9001)
    return f"http://127.0.0.1:{port}{quote(target.path, safe=BROWSER_SAFE)}" + \
        (f"?{target.query}" if target.query else "")


def _fetch_once(trace: Path, url_for: Callable[[TraceServer], str]) -> bytes:
    """Serve ``trace`` until fetched; GET ``url_for(server)`` as a browser would (an Origin, no re-encoding)."""
    server = TraceServer(trace, 0)
    done = threading.Thread(target=server.serve_until_fetched, args=(10,))
    done.start()
    try:
        request = urllib.request.Request(url_for(server), headers={"Origin": UI_ORIGIN})
        with urllib.request.urlopen(request, timeout=5) as resp:
            assert resp.status == 200
            body: bytes = resp.read()
    finally:
        done.join()
    assert server.fetched.is_set()
    return body


@pytest.mark.parametrize("name", NAMES)
def test_names_are_served_under_the_path_a_browser_sends(tmp_path: Path, name: str) -> None:
    data = os.urandom(5000)
    (tmp_path / name).write_bytes(data)
    raw = "/" + quote(name, safe=BROWSER_SAFE)  # "/run%20(1).pftrace", "/a&b+c.pftrace"
    assert _fetch_once(tmp_path / name, lambda server: f"http://127.0.0.1:{server.port}{raw}") == data


@pytest.mark.parametrize("name", [*NAMES, "50%41.pftrace"])  # "%41" itself: only the link can say it
def test_the_link_leads_the_ui_to_the_file(tmp_path: Path, name: str) -> None:
    data = os.urandom(5000)
    (tmp_path / name).write_bytes(data)
    assert _fetch_once(tmp_path / name, lambda server: _as_the_ui_fetches(server.url, server.port)) == data


def test_other_port_link_names_9001_and_says_to_forward_it(tmp_path: Path) -> None:
    assert "ssh -L 9001:127.0.0.1:9100" in _gputrace("view", "--help").stdout
    trace = tmp_path / "t.pftrace"
    trace.write_bytes(b"\x0a\x00")
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "gputrace", "view", "--no-browser", "--port", str(port),
                             str(trace)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        lines = [proc.stdout.readline() for _ in range(3)]  # printed before serving: the server is up
        status, _, body = _get(port, "/t.pftrace")
        out, err = proc.communicate(timeout=10)
    finally:
        proc.kill()
    assert status == 200 and body == b"\x0a\x00" and proc.returncode == 0
    assert f"ssh -L 9001:127.0.0.1:{port} HOST" in lines[1]
    assert lines[2] == "Open: https://ui.perfetto.dev/#!/?url=http%3A%2F%2F127.0.0.1%3A9001%2Ft.pftrace\n"


# ----------------------------------------------------------------------------------- view: the server ---


def test_head_answers_like_get_without_the_body_and_does_not_stop_the_server(tmp_path: Path) -> None:
    data = os.urandom(70_000)
    (tmp_path / "h.pftrace").write_bytes(data)
    server = TraceServer(tmp_path / "h.pftrace", 0)
    done = threading.Thread(target=server.serve_until_fetched, args=(20,))
    done.start()
    try:
        status, headers, body = _get(server.port, "/h.pftrace", "HEAD")
        assert (status, headers["content-length"], body) == (200, str(len(data)), b"")
        assert headers["access-control-allow-origin"] == UI_ORIGIN
        assert _get(server.port, "/nope.pftrace", "HEAD")[0] == 404
        assert not server.fetched.is_set(), "a HEAD is not the fetch the server waits for"
        assert _get(server.port, "/h.pftrace")[2] == data
    finally:
        done.join()
    assert server.fetched.is_set()


def test_dropped_download_is_quiet_and_not_counted_as_fetched(tmp_path: Path) -> None:
    trace = tmp_path / "big.pftrace"
    data = b"\x0a" + os.urandom(1 << 20) * 48  # far more than socket buffers hold: mid-send at the reset
    trace.write_bytes(data)
    port = _free_port()
    proc = subprocess.Popen([sys.executable, "-m", "gputrace", "view", "--no-browser", "--port", str(port),
                             str(trace)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        proc.stdout.readline()  # "Serving ...": listening
        with socket.create_connection(("127.0.0.1", port), timeout=5) as s:
            s.sendall(b"GET /big.pftrace HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            assert len(s.recv(100)) > 0
            s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a reset
        assert proc.poll() is None
        status, _, body = _get(port, "/big.pftrace")
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
    assert status == 200 and body == data and proc.returncode == 0
    assert "Traceback" not in err and "Exception" not in err, err
    assert err.rstrip().endswith("The Perfetto UI loaded the trace; server stopped.")


def test_busy_port_fails_before_anything_is_exported(tmp_path: Path) -> None:
    b = Builder().proc(TRAINER, "python").device(TRAINER)
    b.op(TRAINER, TRAINER, 0, 0, 10)
    b.op(TRAINER, TRAINER, 29.9, 30, 40)
    cap = b.write(tmp_path / "run.gputrace")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        r = _gputrace("view", "--no-browser", "--port", str(port), str(cap), TMPDIR=str(tmp))
    assert r.returncode == 2 and r.stdout == ""
    assert r.stderr == f"gputrace: error: cannot listen on 127.0.0.1:{port}: Address already in use " \
                       "(try another --port)\n"
    assert list(tmp.iterdir()) == [] and not (tmp_path / "run.pftrace").exists()


def test_busy_ui_port_says_how_to_serve_elsewhere(tmp_path: Path) -> None:
    (tmp_path / "t.pftrace").write_bytes(b"\x0a")
    with socket.socket() as holder:
        holder.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            holder.bind(("127.0.0.1", 9001))
            holder.listen()
        except OSError:
            pass  # something else listens there: as busy as this needs
        with pytest.raises(UserError, match="only from port 9001.*--port behind an ssh -L 9001 forward"):
            TraceServer(tmp_path / "t.pftrace", 9001)


def test_a_cut_off_capture_does_not_claim_no_drops(tmp_path: Path) -> None:
    # Drop totals are written in the trailer: a capture cut off before it cannot say there were none.
    b = Builder().proc(100, "python").device(100)
    b.op(100, 100, 0, 0, 1, "fwd")
    b.op(100, 100, 5, 5, 6, "bwd")
    cut = b.write(tmp_path / "cut.gputrace", complete=False)
    whole = b.write(tmp_path / "whole.gputrace")
    outs = {p.name: subprocess.run([sys.executable, "-m", "gputrace", "report", str(p)], capture_output=True,
                                   text=True, check=True, env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"}).stdout
            for p in (cut, whole)}  # fmt: skip
    assert "drops: none counted before the cut (the final counts were never written)" in outs["cut.gputrace"]
    assert "\ndrops: none\n" in outs["whole.gputrace"]


@pytest.mark.kernel
def test_a_full_temporary_directory_is_a_clear_error(tmp_path: Path) -> None:
    """A capture is exported under TMPDIR before it is served: a full one (a real 64 KiB tmpfs here) is named,
    with where else to write the trace, not taken for a failing stdout."""
    b = Builder().proc(TRAINER, "python").device(TRAINER)
    for i in range(2000):
        b.op(TRAINER, TRAINER, i * 3, i * 3, i * 3 + 1, f"k{i}")
    cap = b.write(tmp_path / "run.gputrace")
    with small_tmpfs(tmp_path / "tiny") as tiny:
        r = _gputrace("view", "--no-browser", "--port", str(_free_port()), str(cap), TMPDIR=str(tiny))
        left = list(tiny.iterdir())
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert f"cannot write the temporary Perfetto trace in {tiny}/gputrace-view-" in r.stderr
    assert "No space left on device (point TMPDIR at a directory with room" in r.stderr
    assert "gputrace export " in r.stderr and left == []
