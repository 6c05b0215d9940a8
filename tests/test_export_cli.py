"""`gputrace export`: the command line, its errors, and stalls from the analysis in the trace."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from gputrace.capture import CaptureWriter, host_header
from gputrace.cli import main
from gputrace.errors import UserError
from gputrace.pipeline import export_perfetto
from gputrace.records import (
    BlockIO,
    CudaApi,
    GpuDevice,
    GpuKernel,
    OffCpu,
    ProcInfo,
    Syscall,
    ThreadInfo,
)
from gputrace.testing.perfetto_check import check_trace

MS = 1_000_000
T0 = 10_000 * MS


def _storage_stall_capture(path: Path) -> Path:
    """Kernel, then a 20 ms gap while the launching thread reads a file, then the next kernels."""
    w = CaptureWriter(path, host_header(["test"]))
    w.write([
        ProcInfo(T0, 100, 1, "trainer", ["python", "train.py"], "/usr/bin/python3"),
        ThreadInfo(T0, 100, 101, "loader"),
        GpuDevice(0, "Simulated GPU", True, "sim-0", 100),
        CudaApi(100, 100, "cudaLaunchKernel", T0, T0 + 10_000, 1, "runtime", 0),
        GpuKernel(100, 0, 1, 7, T0 + 20_000, T0 + 5 * MS, 1, "k1", (1, 1, 1), (1, 1, 1)),
        Syscall(100, 100, "pread64", T0 + 5 * MS, T0 + 24 * MS, 1 << 20, 3, "/data/shard.bin", 1 << 20, 1 << 20),
        OffCpu(100, 100, T0 + 5 * MS + 1000, T0 + 24 * MS - 1000, "D", T0 + 24 * MS - 2000, 0, 0, "swapper/0"),
        BlockIO(100, 100, "trainer", "loop0", 0, 1 << 20, "R", T0 + 6 * MS, T0 + 23 * MS),
        CudaApi(100, 100, "cudaLaunchKernel", T0 + 24 * MS + 1000, T0 + 24 * MS + 20_000, 2, "runtime", 0),
        GpuKernel(100, 0, 1, 7, T0 + 25 * MS, T0 + 30 * MS, 2, "k2", (1, 1, 1), (1, 1, 1)),
        CudaApi(100, 100, "cudaLaunchKernel", T0 + 30 * MS, T0 + 30 * MS + 20_000, 3, "runtime", 0),
        GpuKernel(100, 0, 1, 7, T0 + 30 * MS + 30_000, T0 + 31 * MS, 3, "k3", (1, 1, 1), (1, 1, 1)),
    ])
    return w.close({"complete": True})


@pytest.fixture
def capture(tmp_path: Path) -> Path:
    return _storage_stall_capture(tmp_path / "run.gputrace")


def test_export_writes_a_valid_trace_with_stalls(capture: Path, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run.pftrace"
    assert main(["export", str(capture), "--perfetto", str(out)]) == 0
    stdout = capsys.readouterr().out
    check = check_trace(out)
    assert check.problems == []
    assert f"Wrote {out} ({check.packets:,} packets)" in stdout and f"gputrace view {out}" in stdout
    stalls = check.track("stalls", parent="GPU 0: Simulated GPU (simulated)")
    [stall] = [s for s in check.slices_on(stalls) if s.depth == 0]
    assert (stall.name, stall.ts, stall.dur) == ("storage", T0 + 5 * MS, 20 * MS)
    assert stall.args["object"] == "/data/shard.bin" and stall.args["culprit_comm"] == "trainer"
    sources = {(check.track_of(src).name, src.name) for src, _ in check.flows_into(stalls)}
    assert ("trainer", "pread64") in sources and ("lane 0", "R 1 MiB") in sources


def test_export_jobs_draw_the_same_trace(capture: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str],
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    # --jobs 2 on a capture as large as PARALLEL_MIN_BYTES (here: any): its kernel records drawn by a second process
    from gputrace.exporters.perfetto import export

    made: list[int] = []
    two_parts = export.PerfettoExporter._two_parts
    monkeypatch.setattr(export, "PARALLEL_MIN_BYTES", 0)
    monkeypatch.setattr(export.PerfettoExporter, "_two_parts",
                        lambda self, *a: made.append(1) or two_parts(self, *a))  # type: ignore[func-returns-value]
    shown = []
    for jobs in ("1", "2"):
        out = tmp_path / f"run{jobs}.pftrace"
        assert main(["export", str(capture), "--perfetto", str(out), "--jobs", jobs]) == 0
        check = check_trace(out)
        assert check.problems == [] and f"Wrote {out} ({check.packets:,} packets)" in capsys.readouterr().out
        shown.append(check.shown())
    assert made == [1] and shown[0] == shown[1]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["run.gputrace", "run1.pftrace", "run2.pftrace"]


def test_existing_output_needs_force(capture: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "run.pftrace"
    out.write_text("keep me")
    assert main(["export", str(capture), "--perfetto", str(out)]) == 2
    assert "exists; use --force" in capsys.readouterr().err and out.read_text() == "keep me"
    assert main(["export", str(capture), "--perfetto", str(out), "-f"]) == 0
    assert check_trace(out).ok


def test_truncated_capture_exports_with_warning(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    w = CaptureWriter(tmp_path / "big.gputrace", host_header(["test"]))
    w.write([ProcInfo(T0, 1, 0, "x", ["x"], "/x")])
    for b in range(20):
        w.write([Syscall(1, 1, "read", T0 + i * 10, T0 + i * 10 + 5, 0, 0, "", 0, 0)
                 for i in range(b * 100, b * 100 + 100)])
    data = w.close({"complete": True}).read_bytes()
    cut = tmp_path / "cut.gputrace"
    cut.write_bytes(data[: len(data) // 2])
    out = tmp_path / "cut.pftrace"
    assert main(["export", str(cut), "--perfetto", str(out)]) == 0
    captured = capsys.readouterr()
    assert "gputrace: warning: the capture is incomplete: cut off at byte" in captured.err
    assert "Wrote" in captured.out
    check = check_trace(out)
    assert check.ok and 0 < len(check.slices_on(check.thread(1))) < 2000


@pytest.mark.parametrize("content, message", [
    (b"\x93\x01\x02\x03", "is not a gputrace capture"),
    (b"", "is not a gputrace capture"),
])
def test_not_a_capture(tmp_path: Path, capsys: pytest.CaptureFixture[str], content: bytes, message: str) -> None:
    bad = tmp_path / "bad.gputrace"
    bad.write_bytes(content)
    assert main(["export", str(bad), "--perfetto", str(tmp_path / "o.pftrace")]) == 3
    assert message in capsys.readouterr().err
    assert not (tmp_path / "o.pftrace").exists()


def test_bad_arguments(capture: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["export", str(tmp_path / "missing.gputrace"), "--perfetto", str(tmp_path / "o.pftrace")]) == 2
    assert "no such capture file" in capsys.readouterr().err
    trace = tmp_path / "t.pftrace"
    trace.write_bytes(b"")
    assert main(["export", str(trace), "--perfetto", str(tmp_path / "o.pftrace")]) == 2
    assert "is a Perfetto trace, not a capture" in capsys.readouterr().err
    assert main(["export", str(capture), "--perfetto", str(tmp_path / "nodir" / "o.pftrace")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert main(["export", str(capture), "--perfetto", str(tmp_path / "o.pftrace"), "--min-gap-ms", "0"]) == 2
    with pytest.raises(SystemExit):
        main(["export", str(capture)])  # neither --perfetto nor --otlp
    assert main(["export", str(capture), "--otlp", ""]) == 2
    assert "--otlp needs an endpoint" in capsys.readouterr().err
    assert main(["export", str(capture), "--perfetto", ""]) == 2
    assert "--perfetto needs an output file name" in capsys.readouterr().err


def test_records_lost_while_recording_are_told(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    # The trailer counts 1234 events the kernel ring buffer dropped: the export must not look whole.
    w = CaptureWriter(tmp_path / "lossy.gputrace", host_header(["test"]))
    w.write([ProcInfo(T0, 1, 0, "x", ["x"], "/x"), Syscall(1, 1, "read", T0, T0 + 5, 0, 0, "", 0, 0)])
    cap = w.close({"complete": True, "drops": {"ebpf.ringbuf": 1234, "agent.pid1.queue": 0}})
    assert main(["export", str(cap), "--perfetto", str(tmp_path / "lossy.pftrace")]) == 0
    err = capsys.readouterr().err
    assert "gputrace: warning: the capture lost 1234 records (ebpf.ringbuf=1234) while recording" in err
    assert "incomplete" not in err


_FULL_DISK = """
import resource, signal, sys
from gputrace.cli import main
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG, like a full disk
resource.setrlimit(resource.RLIMIT_FSIZE, (20000, 20000))
sys.exit(main(sys.argv[1:]))
"""


def test_full_disk_leaves_nothing_half_written(tmp_path: Path) -> None:
    w = CaptureWriter(tmp_path / "c.gputrace", host_header(["test"]))
    w.write([ProcInfo(T0, 1, 0, "x", ["x"], "/x")])
    w.write([Syscall(1, 1, "read", T0 + i * 10, T0 + i * 10 + 5, 0, 0, "/f", 0, 0) for i in range(1000)])
    cap = w.close({"complete": True})
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    r = subprocess.run([sys.executable, "-c", _FULL_DISK, "export", str(cap), "--perfetto", str(out_dir / "o.pftrace")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stderr
    assert "File too large; nothing was written under that name" in r.stderr and "Traceback" not in r.stderr
    assert list(out_dir.iterdir()) == []


def test_export_perfetto_function(capture: Path, tmp_path: Path) -> None:
    out = tmp_path / "f.pftrace"
    result = export_perfetto(capture, out)
    assert result.target == str(out) and result.items == check_trace(out).packets
    assert check_trace(out).tracks_named("stalls") == []  # no report given: no stalls
    with pytest.raises(UserError, match="exists"):
        export_perfetto(capture, out)
    export_perfetto(capture, out, force=True)


def test_otlp_unreachable_is_a_clear_error(capture: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once we leave: nothing listens there
    rc = main(["export", str(capture), "--otlp", f"127.0.0.1:{port}"])
    err = capsys.readouterr().err
    assert rc != 0 and err.startswith("gputrace: error:") and "unreachable" in err and "Traceback" not in err


def test_installed_command(capture: Path, tmp_path: Path) -> None:
    out = tmp_path / "cli.pftrace"
    exe = Path(sys.executable).with_name("gputrace")
    r = subprocess.run([str(exe), "export", str(capture), "--perfetto", str(out)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"Wrote {out} (") and check_trace(out).ok
    r = subprocess.run([str(exe), "export", "--help"], capture_output=True, text=True, timeout=60)
    assert "--perfetto" in r.stdout and "examples:" in r.stdout
