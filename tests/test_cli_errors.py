"""The CLI met the way a user meets it on a bad day: bad numbers, thread ids, Ctrl-C at the wrong moment,
outputs over inputs, planted symlinks, files that are not what their names say, and too few privileges."""

from __future__ import annotations

import contextlib
import json
import os
import pty
import re
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import pytest
from signals import with_default
from test_capture_cli import capture_until_exit
from waiting import wait_for
from workloads.cpu_cgroup import remove_group
from workloads.loopdev import LoopFs, drop_cache

from gputrace.capture import CaptureReader, CaptureWriter, host_header
from gputrace.cli import main
from gputrace.errors import UserError
from gputrace.exporters.perfetto.export import PerfettoExporter
from gputrace.testing.synth import Builder
from gputrace.viewer.serve import trace_for

GPUTRACE = [sys.executable, "-m", "gputrace"]
TRAINER = 100
BLKIO = Path("/sys/fs/cgroup/blkio")


def _capture(path: Path, *, complete: bool = True, gpu: bool = True, stop_reason: str = "stopped") -> Path:
    b = Builder().proc(TRAINER, "python").syscall(TRAINER, TRAINER, "read", 1, 12, "/data/x.bin", 10)
    if gpu:
        b.device(TRAINER).op(TRAINER, TRAINER, 0, 0, 1, "fwd")
        b.op(TRAINER, TRAINER, 12, 12.1, 20, "bwd")
    return b.write(path, complete=complete, trailer={"stop_reason": stop_reason})


def _run(*args: str, cwd: Path, prefix: tuple[str, ...] = (), timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*prefix, *GPUTRACE, *args], cwd=cwd, capture_output=True, text=True, timeout=timeout)


def _sigint_default() -> None:
    """Run the child with Ctrl-C's default action, as a shell in a terminal would (not inherited SIG_IGN)."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


# ------------------------------------------------------------------------------------------------ capture ---
@pytest.mark.parametrize("bad", [
    ["--min-gap-ms", "-1"], ["--min-gap-ms", "inf"], ["-d", "nan"], ["-d", "inf"], ["--syscall-threshold-us", "nan"],
])
def test_bad_numbers_are_refused_before_tracing(tmp_path: Path, bad: list[str]) -> None:
    t0 = time.monotonic()
    r = _run("capture", "-o", "x.gputrace", *bad, "--", "true", cwd=tmp_path)
    assert r.returncode == 2 and r.stderr.startswith("gputrace: error: "), r.stderr
    assert "Traceback" not in r.stderr and "tracing" not in r.stderr
    assert not list(tmp_path.iterdir()) and time.monotonic() - t0 < 30


@pytest.mark.kernel
def test_thread_id_stands_for_its_process(tmp_path: Path) -> None:
    script = ("import os, sys, threading\n"
              "t = threading.Thread(target=sys.stdin.readline)\n"
              "t.start()\n"
              "print(t.native_id, flush=True)\n"
              "t.join()\n")
    target = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    assert target.stdout is not None
    tid = int(target.stdout.readline())
    assert tid != target.pid
    before = capture_until_exit(tmp_path, target, tid)
    assert f"gputrace: {tid} is a thread of pid {target.pid}; tracing pid {target.pid}" in before
    with CaptureReader(tmp_path / "t.gputrace") as reader:
        assert reader.header["targets"] == [target.pid]
        list(reader.records())
        assert reader.trailer is not None and reader.trailer["stop_reason"] == "targets exited"


def _loading(tmp_path: Path, **popen: Any) -> subprocess.Popen[str]:
    """`capture -- sleep 30` caught while its probes load: the partial file exists from before they are compiled
    and loaded (seconds) until tracing starts."""
    cap = subprocess.Popen(GPUTRACE + ["capture", "-o", "x.gputrace", "--", "sleep", "30"], cwd=tmp_path,
                           stderr=subprocess.PIPE, text=True, **popen)
    wait_for(lambda: list(tmp_path.glob(".x.gputrace.*.partial")), 60, "the partial capture")
    return cap


def _interrupt(cap: subprocess.Popen[str], sig: int) -> str:
    """Send ``sig`` and wait for the capture to end; its stderr."""
    try:
        cap.send_signal(sig)
        return cap.communicate(timeout=60)[1]
    finally:
        cap.kill()


@pytest.mark.kernel
def test_ctrl_c_while_probes_load_says_nothing_was_written(tmp_path: Path) -> None:
    cap = _loading(tmp_path, preexec_fn=_sigint_default)
    err = _interrupt(cap, signal.SIGINT)
    assert cap.returncode == 130, err
    assert err.strip().endswith("gputrace: interrupted before tracing began; nothing was written"), err
    assert "Traceback" not in err and not list(tmp_path.iterdir())


@pytest.mark.kernel
def test_sigterm_while_probes_load_leaves_nothing_behind(tmp_path: Path) -> None:
    """Not the partial file, and not the command held (forked, not yet exec'd) until tracing starts."""
    cap = _loading(tmp_path)
    held = [int(p) for p in Path(f"/proc/{cap.pid}/task/{cap.pid}/children").read_text().split()]
    err = _interrupt(cap, signal.SIGTERM)
    assert held, "the command is forked before the capture file is created"
    assert cap.returncode == 143, err
    assert err.strip().endswith("gputrace: interrupted before tracing began; nothing was written"), err
    assert not list(tmp_path.iterdir())
    wait_for(lambda: not any(Path(f"/proc/{pid}").exists() for pid in held), 10, "the held command to be gone")


@pytest.mark.kernel
def test_ctrl_c_after_tracing_names_the_written_capture(tmp_path: Path) -> None:
    cap = subprocess.Popen(GPUTRACE + ["capture", "-d", "1", "-o", "x.gputrace", "--", "sleep", "30"],
                           cwd=tmp_path, stderr=subprocess.PIPE, text=True, preexec_fn=_sigint_default)
    assert cap.stderr is not None
    child = 0
    try:
        line = cap.stderr.readline()
        child = int(re.search(r"tracing pid (\d+):", line).group(1))  # type: ignore[union-attr]
        # -d ends the capture and the command runs on; once the capture has its name, gputrace is analysing,
        # exporting, or waiting for the command: Ctrl-C there used to exit 130 without a word
        wait_for(lambda: (tmp_path / "x.gputrace").exists(), 60, "the capture to be written")
        cap.send_signal(signal.SIGINT)
        cap.wait(timeout=60)
    finally:
        cap.kill()
        if child:
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)  # it holds stderr open too
    err = cap.stderr.read()
    # 130, or death by SIGINT when CPython takes the interrupt for unhandled: a shell shows 130 for both
    assert cap.returncode in (130, -signal.SIGINT), err
    assert "interrupted after tracing ended; the capture x.gputrace was written" in err, err
    assert "gputrace report x.gputrace" in err and "Traceback" not in err
    with CaptureReader(tmp_path / "x.gputrace") as reader:
        list(reader.records())
        assert reader.complete and reader.trailer is not None and reader.trailer["stop_reason"] == "duration"


@pytest.mark.kernel
def test_capabilities_without_root_is_one_line(tmp_path: Path) -> None:
    """CAP_BPF + CAP_PERFMON pass the capability check, but tracefs stays root-only."""
    os.chmod(tmp_path, 0o777)
    caps = ("setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=+bpf,+perfmon",
            "--ambient-caps=+bpf,+perfmon")
    r = _run("capture", "-d", "1", "--", "true", cwd=tmp_path, prefix=caps)
    assert r.returncode == 4, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert "/sys/kernel/tracing" in r.stderr and "root" in r.stderr
    assert not list(tmp_path.iterdir())


def test_capturing_gputrace_itself_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # It would trace its own reading of its own events: a feedback loop, not a capture.
    assert main(["capture", "-p", str(os.getpid()), "-d", "1", "-o", str(tmp_path / "self.gputrace")]) == 2
    assert f"pid {os.getpid()} is this gputrace process" in capsys.readouterr().err
    assert not list(tmp_path.iterdir())


# ------------------------------------------------------------------------------------- report / export ---
def test_output_over_the_capture_being_read_is_refused(tmp_path: Path,
                                                       capsys: pytest.CaptureFixture[str]) -> None:
    cap = _capture(tmp_path / "a.gputrace")
    before = cap.read_bytes()
    link = tmp_path / "link.pftrace"
    link.symlink_to(cap.name)
    for argv in (["export", str(cap), "--perfetto", str(cap), "-f"],
                 ["export", str(cap), "--perfetto", str(link), "-f"],
                 ["report", str(cap), "--html", str(cap), "-f"]):
        assert main(argv) == 2, argv
        assert "is the capture being read" in capsys.readouterr().err
    assert cap.read_bytes() == before


def test_dangling_symlink_at_the_output_needs_force(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cap = _capture(tmp_path / "a.gputrace")
    out = tmp_path / "o.pftrace"
    out.symlink_to(tmp_path / "elsewhere")
    assert main(["export", str(cap), "--perfetto", str(out)]) == 2
    assert "--force" in capsys.readouterr().err
    assert out.is_symlink() and not (tmp_path / "elsewhere").exists()
    assert main(["export", str(cap), "--perfetto", str(out), "-f"]) == 0
    assert not out.is_symlink() and out.is_file() and not (tmp_path / "elsewhere").exists()


@pytest.mark.kernel
def test_force_never_replaces_a_device_node_fifo_or_redirected_stdout(tmp_path: Path,
                                                                       capsys: pytest.CaptureFixture[str]) -> None:
    # sudo gputrace export ... --perfetto /dev/null -f used to leave a regular file where /dev/null was.
    cap = _capture(tmp_path / "a.gputrace")
    null, fifo, stdout = tmp_path / "null", tmp_path / "fifo", tmp_path / "stdout"
    os.mknod(null, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    os.mkfifo(fifo)
    stdout.symlink_to("/proc/self/fd/1")
    cases = [(null, "is a character device, not a file"), (fifo, "is a FIFO, not a file"),
             (stdout, "is a link to a process's open file, not a file")]
    for out, message in cases:
        for argv in (["export", str(cap), "--perfetto", str(out), "-f"],
                     ["report", str(cap), "--html", str(out), "-f"]):
            assert main(argv) == 2, argv
            assert message in capsys.readouterr().err
    null_capture = tmp_path / "null.gputrace"
    os.mknod(null_capture, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
    r = _run("capture", "-f", "-o", str(null_capture), "--", "true", cwd=tmp_path)
    assert r.returncode == 2 and "is a character device, not a file" in r.stderr, r.stderr
    assert stat.S_ISCHR(os.lstat(null_capture).st_mode) and stat.S_ISCHR(os.lstat(null).st_mode)
    assert stat.S_ISFIFO(os.lstat(fifo).st_mode) and stdout.is_symlink()


def _long_capture(path: Path, n: int = 200_000) -> Path:
    """A capture whose Perfetto export takes seconds: ``n`` syscalls of one thread."""
    w = CaptureWriter(path, {**host_header(["test"]), "start_ns": 0}, force=True)
    w.write_rows("ProcInfo", [[0, TRAINER, 1, "python", ["python"], "/usr/bin/python3"]])
    for base in range(0, n, 10_000):
        w.write_rows("Syscall", [[TRAINER, TRAINER, "read", i * 10_000, i * 10_000 + 5_000, 4096, 3, "/data/x.bin",
                                  4096, 0] for i in range(base, base + 10_000)])  # fmt: skip
    w.close({"end_ns": n * 10_000, "drops": {}, "complete": True})
    return path


@pytest.mark.slow
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_export_stopped_by_sigterm_or_sighup_leaves_nothing_behind(tmp_path: Path, sig: signal.Signals) -> None:
    # SIGHUP: the ssh session running it closed. The partial trace (tens of MB on a real capture) must go.
    cap = _long_capture(tmp_path / "big.gputrace", 1_000_000)  # seconds of writing: the signal lands in them
    # the signal's default action in the export, whatever this run inherited (nohup ignores SIGHUP)
    proc = subprocess.Popen(with_default(sig, [*GPUTRACE, "export", str(cap), "--perfetto", "out.pftrace"]),
                            cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for(lambda: list(tmp_path.glob(".out.pftrace.*.partial")), 60, "the export to start writing")
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 128 + sig, err
    assert err.strip().endswith(f"gputrace: stopped by {sig.name}") and "Traceback" not in err, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big.gputrace"]


def _on_a_terminal(argv: list[str], cwd: Path, prefix: tuple[str, ...] = ()) -> tuple[bytes, list[str]]:
    """Run gputrace with its stderr on a pseudo-terminal: (its stdout, the lines the terminal showed)."""
    primary, secondary = pty.openpty()
    with os.fdopen(primary, "rb", buffering=0) as term:
        proc = subprocess.Popen([*prefix, *GPUTRACE, *argv], cwd=cwd, stdout=subprocess.PIPE, stderr=secondary)
        os.close(secondary)
        out, _ = proc.communicate(timeout=120)
        seen = b""
        with contextlib.suppress(OSError):  # EIO once the child's side is closed and drained
            while chunk := term.read(4096):
                seen += chunk
    assert proc.returncode == 0, seen
    return out, seen.decode().replace("\r\x1b[K", "\n").replace("\r", "\n").split("\n")


# A loop device's reads and writes throttled to this: a capture read from it, or a trace written to it, takes
# seconds of wall time on any CPU, while costing little of it
SLOW_BPS = 2 << 20


@contextlib.contextmanager
def _slow_device(majmin: str) -> Iterator[Callable[[], tuple[str, ...]]]:
    """Command prefixes, each running its command in a v1 blkio group of its own whose reads and writes (an
    fsync's) of device ``majmin`` are throttled to SLOW_BPS; the kernel's own writeback of it (the root group's)
    too."""
    root = BLKIO / "blkio.throttle.write_bps_device"
    groups: list[Path] = []

    def prefix() -> tuple[str, ...]:
        group = BLKIO / f"gputrace-progress-{os.getpid()}-{time.monotonic_ns()}"
        group.mkdir()
        groups.append(group)
        for way in ("read", "write"):
            (group / f"blkio.throttle.{way}_bps_device").write_text(f"{majmin} {SLOW_BPS}\n")
        return ("sh", "-c", 'echo $$ > "$0" && exec "$@"', str(group / "cgroup.procs"))

    try:
        root.write_text(f"{majmin} {SLOW_BPS}\n")
        yield prefix
    finally:
        with contextlib.suppress(OSError):
            root.write_text(f"{majmin} 0\n")  # 0 removes the rule
        for group in groups:
            remove_group(group)


def test_long_export_and_report_show_progress_on_a_terminal_only(loopfs: LoopFs) -> None:
    # On a throttled device, whatever the CPU: the export's trace takes over 2 s to write out (the fsync in its
    # writing stage), the report's capture over 2 s to read after its first MiB (read before the analysis, with
    # the header). The first progress line comes after 1 s. The three commands run at once, each throttled alone.
    here = loopfs.mountpoint
    cap = _long_capture(here / "big.gputrace", 45_000)  # in the page cache: only the trace's writes are slow
    bigger = _long_capture(here / "bigger.gputrace", 160_000)
    assert bigger.stat().st_size > (1 << 20) + 2 * SLOW_BPS
    drop_cache(bigger)
    with _slow_device(loopfs.majmin) as slowly, ThreadPoolExecutor(2) as pool:
        piped = subprocess.Popen([*slowly(), *GPUTRACE, "export", str(cap), "--perfetto", "b.pftrace"], cwd=here,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        export = pool.submit(_on_a_terminal, ["export", str(cap), "--perfetto", "a.pftrace"], here, slowly())
        report = pool.submit(_on_a_terminal, ["report", str(bigger), "--json"], here, slowly())
        try:
            out, lines = export.result()
            assert b"Wrote a.pftrace" in out and (here / "a.pftrace").stat().st_size > 2 * SLOW_BPS
            shown = r"gputrace: writing a\.pftrace: \d+% of [\d.]+ MB"
            assert [line for line in lines if re.fullmatch(shown, line)], lines
            out, lines = report.result()
            assert json.loads(out)["schema"] == "gputrace.report/1"
            assert [line for line in lines if re.fullmatch(r"gputrace: analysing: \d+% of [\d.]+ MB", line)], lines
            _, err = piped.communicate(timeout=120)  # stderr a pipe: nothing
        finally:
            if piped.poll() is None:
                piped.kill()
                piped.wait()
    assert piped.returncode == 0 and err == "" and (here / "b.pftrace").stat().st_size > 2 * SLOW_BPS


def test_perfetto_export_never_writes_through_a_planted_temporary(tmp_path: Path) -> None:
    cap = _capture(tmp_path / "a.gputrace")
    victim = tmp_path / "victim"
    victim.write_text("keep")
    out = tmp_path / "o.pftrace"
    planted = tmp_path / f".o.pftrace.{os.getpid()}.partial"  # the exporter's temporary name is predictable
    planted.symlink_to(victim)
    with CaptureReader(cap) as reader, pytest.raises(UserError, match="exists"):
        PerfettoExporter(out).write(reader)
    assert victim.read_text() == "keep" and planted.is_symlink() and not out.exists()


@pytest.mark.parametrize("content, message", [
    (b"", "is not a gputrace capture (the file is empty)"),
    (b"\x0a\x02\x08\x01", "it looks like a Perfetto trace; open it with: gputrace view"),
    (None, "a capture cut off inside its header"),
])
def test_unreadable_capture_says_what_it_is(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                            content: bytes | None, message: str) -> None:
    bad = tmp_path / "bad.gputrace"
    bad.write_bytes(_capture(tmp_path / "good.gputrace").read_bytes()[:40] if content is None else content)
    assert main(["report", str(bad)]) == 3
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1


@pytest.mark.kernel
def test_capture_the_user_may_not_read(tmp_path: Path) -> None:
    os.chmod(tmp_path, 0o755)
    cap = _capture(tmp_path / "a.gputrace")
    os.chmod(cap, 0o600)
    r = _run("report", str(cap), cwd=tmp_path, prefix=("setpriv", "--reuid=65534", "--regid=65534",
                                                       "--clear-groups"))
    assert r.returncode == 4 and "Permission denied" in r.stderr and "Traceback" not in r.stderr


def test_report_says_how_a_complete_capture_ended(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cap = _capture(tmp_path / "a.gputrace", stop_reason="stopped")
    assert main(["report", str(cap)]) == 0
    assert "complete: ended by Ctrl-C, SIGTERM or a stop request" in capsys.readouterr().out
    assert main(["report", str(cap), "--json"]) == 0
    doc = json.loads(capsys.readouterr().out)
    assert doc["schema"] == "gputrace.report/1" and doc["capture"]["complete"] is True
    assert doc["capture"]["stop_reason"] == "stopped"
    page = tmp_path / "r.html"
    assert main(["report", str(cap), "--html", str(page)]) == 0
    assert "complete: ended by Ctrl-C, SIGTERM or a stop request" in page.read_text()


def test_cut_off_capture_without_gpu_records_does_not_blame_the_job(tmp_path: Path,
                                                                    capsys: pytest.CaptureFixture[str]) -> None:
    cap = _capture(tmp_path / "a.gputrace", complete=False, gpu=False)
    assert main(["report", str(cap)]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "INCOMPLETE CAPTURE" in out and "may be in the part that is missing" in out
    assert "was the GPU agent armed" not in out


@pytest.mark.parametrize("argv", [["report", "CAP", "--json"], ["report", "CAP"], ["env"]])
def test_output_to_a_full_device_is_one_line(tmp_path: Path, argv: list[str]) -> None:
    """`report --json > r.json` on a full disk: the JSON is cut, and the user must hear it."""
    cap = _capture(tmp_path / "a.gputrace")
    with open("/dev/full", "w") as full:
        r = subprocess.run(GPUTRACE + [str(cap) if a == "CAP" else a for a in argv], stdout=full,
                           stderr=subprocess.PIPE, text=True, timeout=60)
    assert r.returncode == 1
    assert r.stderr == "gputrace: error: writing the output: No space left on device; it is incomplete\n"


@pytest.mark.parametrize("flag", ["inf", "nan", "-1"])
def test_report_and_export_refuse_bad_min_gap(tmp_path: Path, capsys: pytest.CaptureFixture[str], flag: str) -> None:
    cap = _capture(tmp_path / "a.gputrace")
    assert main(["report", str(cap), "--min-gap-ms", flag]) == 2
    assert main(["export", str(cap), "--perfetto", str(tmp_path / "o.pftrace"), "--min-gap-ms", flag]) == 2
    sock = str(tmp_path / "no-service.sock")  # refused before any request is sent
    assert main(["daemon", "capture", "-p", "1", "-d", "1", "--socket", sock, "--min-gap-ms", flag]) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 3 and all("--min-gap-ms must be a number > 0" in line for line in err), err


@pytest.mark.parametrize("jobs", ["0", "-2"])
def test_report_and_export_refuse_a_job_count_below_one(tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                                        jobs: str) -> None:
    cap = _capture(tmp_path / "a.gputrace")
    assert main(["report", str(cap), "--jobs", jobs]) == 2
    assert capsys.readouterr().err == f"gputrace: error: --jobs must be 1 or more, not {jobs}\n"
    assert main(["export", str(cap), "--perfetto", str(tmp_path / "o.pftrace"), "--jobs", jobs]) == 2
    assert capsys.readouterr().err == f"gputrace: error: --jobs must be 1 or more, not {jobs}\n"
    assert not (tmp_path / "o.pftrace").exists()


# ------------------------------------------------------------------------------------------------- view ---
def test_view_port_out_of_range_is_a_usage_error(tmp_path: Path) -> None:
    trace = tmp_path / "t.pftrace"
    trace.write_bytes(b"\x0a\x00")
    r = _run("view", "--no-browser", "--port", "99999", str(trace), cwd=tmp_path, timeout=30)
    assert r.returncode == 2 and "--port: must be 0 to 65535" in r.stderr and "Traceback" not in r.stderr


def test_view_refuses_an_empty_file_and_warns_on_unknown_contents(tmp_path: Path) -> None:
    bad = tmp_path / "t.pftrace"
    bad.write_bytes(b"")
    with pytest.raises(UserError, match="is empty: not a trace"):
        trace_for(bad, tmp_path, lambda _: None)
    bad.write_bytes(b"GIF89a")
    notes: list[str] = []
    assert trace_for(bad, tmp_path, notes.append) == bad
    assert notes == [f"gputrace: warning: {bad} does not look like a trace the Perfetto UI opens; serving it anyway"]
    for start in (b"\x0a\x00", b"\x1f\x8b", b"{}"):  # protobuf, gzip, JSON: served without a word
        bad.write_bytes(start)
        assert trace_for(bad, tmp_path, notes.append) == bad and len(notes) == 1


def test_view_of_a_trace_named_like_a_capture_serves_it(tmp_path: Path) -> None:
    trace = tmp_path / "a.gputrace"
    trace.write_bytes(b"\x0a\x00")
    assert trace_for(trace, tmp_path, lambda _: None) == trace


def test_view_of_a_cut_off_capture_warns(tmp_path: Path) -> None:
    cap = _capture(tmp_path / "a.gputrace", complete=False)
    notes: list[str] = []
    out = tmp_path / "tmp"
    out.mkdir()
    served = trace_for(cap, out, notes.append)
    assert served.parent == out and served.read_bytes()[:1] == b"\x0a"
    assert any("warning: the capture is incomplete: cut off" in n for n in notes), notes


def test_view_of_a_capture_named_like_a_trace_exports_it(tmp_path: Path) -> None:
    cap = _capture(tmp_path / "a.gputrace")
    renamed = cap.rename(tmp_path / "a.pftrace")
    out = tmp_path / "tmp"
    out.mkdir()
    served = trace_for(renamed, out, lambda _: None)
    assert served.parent == out and served.read_bytes()[:1] == b"\x0a"



# ------------------------------------------------------------------------------------------------- otlp ---
def test_otlp_partial_delivery_is_a_failure(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """A collector that refuses every other batch: the spans it refused are counted and the exit is 1."""
    from concurrent import futures

    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    class EveryOther(trace_service_pb2_grpc.TraceServiceServicer):
        calls = 0

        def Export(self, request: Any, context: Any) -> Any:  # noqa: N802
            EveryOther.calls += 1
            if EveryOther.calls % 2 == 0:
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, "every other batch refused")
            return trace_service_pb2.ExportTraceServiceResponse()

    b = Builder().proc(TRAINER, "python").device(TRAINER)
    for i in range(400):  # 400 gaps of 2 ms: 400 stalls, over 512 spans, so at least two batches
        b.op(TRAINER, TRAINER, i * 3, i * 3, i * 3 + 1, f"k{i}")
    cap = b.write(tmp_path / "many.gputrace")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(EveryOther(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        assert main(["export", str(cap), "--otlp", f"127.0.0.1:{port}"]) == 1
    finally:
        server.stop(None)
    out, err = capsys.readouterr()
    found = re.search(r"Sent ([\d,]+) spans .* \(([\d,]+) dropped\)", out)
    assert found, out
    sent, dropped = (int(x.replace(",", "")) for x in found.groups())
    assert sent > 0 and dropped > 0
    assert f"gputrace: warning: {dropped:,} of {sent + dropped:,} spans were not delivered" in err


@pytest.mark.parametrize("protocol", ["grpc", "http"])
def test_otlp_collector_that_never_answers_costs_one_timeout(tmp_path: Path, protocol: str) -> None:
    """A listener that accepts and never replies: after one batch waits out the timeout, the rest are not tried."""
    import socket

    from gputrace.exporters.otlp import OtlpExporter, OtlpUnreachable

    b = Builder().proc(TRAINER, "python").device(TRAINER)
    for i in range(200):
        b.op(TRAINER, TRAINER, i * 3, i * 3, i * 3 + 1, f"k{i}")
    cap = b.write(tmp_path / "many.gputrace")
    with socket.socket() as silent:
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        port = silent.getsockname()[1]
        endpoint = f"127.0.0.1:{port}" if protocol == "grpc" else f"http://127.0.0.1:{port}"
        exporter = OtlpExporter(endpoint, protocol, batch_size=50, timeout_s=1.0)
        t0 = time.monotonic()
        with CaptureReader(cap) as reader, pytest.raises(OtlpUnreachable) as err:
            exporter.write(reader)
        elapsed = time.monotonic() - t0
    assert err.value.result.items == 0 and err.value.result.dropped > 200  # 401 spans, in 9 batches
    assert elapsed < 4.0, f"{elapsed:.1f} s: a timeout per batch"


@pytest.mark.kernel
def test_terminal_is_told_while_the_probes_load(tmp_path: Path) -> None:
    """Seconds pass between the start and `tracing ...`; on a terminal, capture says why at once."""
    import pty

    master, slave = pty.openpty()
    cap = subprocess.Popen(GPUTRACE + ["capture", "-o", "x.gputrace", "--", "true"], cwd=tmp_path,
                           stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=slave)
    os.close(slave)
    text = b""
    try:
        while b"tracing pid" not in text:
            chunk = os.read(master, 4096)
            assert chunk, text
            text += chunk
        assert cap.wait(timeout=60) == 0
    finally:
        cap.kill()
        os.close(master)
    lines = text.decode().splitlines()
    assert lines[0] == "gputrace: compiling and loading the eBPF probes (a few seconds)..."
    assert lines[1].startswith("gputrace: tracing pid ")


def test_view_does_not_serve_a_trace_older_than_its_capture(tmp_path: Path) -> None:
    """`capture -f --no-perfetto` over an earlier run leaves that run's .pftrace beside the new capture."""
    old = tmp_path / "a.pftrace"
    old.write_bytes(b"\x0a\x00")
    cap = _capture(tmp_path / "a.gputrace")
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    out = tmp_path / "tmp"
    out.mkdir()
    notes: list[str] = []
    served = trace_for(cap, out, notes.append)
    assert served == out / "a.pftrace" and served.stat().st_size > 2
    assert notes[0] == f"{old} is older than {cap} (from an earlier capture?); not using it"


def test_capture_from_a_pipe_is_one_line(tmp_path: Path) -> None:
    """`cat run.gputrace | gputrace report /dev/stdin`: the reader passes over the file more than once."""
    cap = _capture(tmp_path / "a.gputrace")
    for command in ("report", "export"):
        extra = ["--perfetto", str(tmp_path / "o.pftrace")] if command == "export" else []
        r = subprocess.run(GPUTRACE + [command, "/dev/stdin", *extra], input=cap.read_bytes(),
                           capture_output=True, timeout=60)
        assert r.returncode == 2, r.stderr
        assert r.stderr.decode() == ("gputrace: error: /dev/stdin is not a regular file; a capture is read more "
                                     "than once: save it to a file first\n")


def test_otlp_export_shows_spans_sent_on_a_terminal(tmp_path: Path) -> None:
    """Sending takes longer than analysing where the collector is slow: the line counts spans, not the file."""
    from concurrent import futures

    import grpc
    from opentelemetry.proto.collector.trace.v1 import trace_service_pb2, trace_service_pb2_grpc

    class Slow(trace_service_pb2_grpc.TraceServiceServicer):
        def Export(self, request: Any, context: Any) -> Any:  # noqa: N802
            time.sleep(0.7)
            return trace_service_pb2.ExportTraceServiceResponse()

    b = Builder().proc(TRAINER, "python").device(TRAINER)
    for i in range(600):
        b.op(TRAINER, TRAINER, i * 3, i * 3, i * 3 + 1, f"k{i}")
    cap = b.write(tmp_path / "many.gputrace")
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=1))
    trace_service_pb2_grpc.add_TraceServiceServicer_to_server(Slow(), server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        out, lines = _on_a_terminal(["export", str(cap), "--otlp", f"127.0.0.1:{port}"], tmp_path)
    finally:
        server.stop(None)
    assert b"Sent 1,798 spans" in out  # 4 batches: 2.8 s of sending
    assert [line for line in lines if re.fullmatch(r"gputrace: sending: [\d,]+ of 1,798 spans", line)], lines
