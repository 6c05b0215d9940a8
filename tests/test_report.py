"""`gputrace report`: terminal, --json, --html, and what it says about bad or partial captures."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
from workloads.loopdev import small_tmpfs

from gputrace.cli import main
from gputrace.testing.synth import Builder

TRAINER, WORKER = 100, 200
H100, OTHER_GPU = "GPU-5e0c1a7e-2b1f-4a8e-9d3c-7f1e2a3b4c5d", "GPU-00c0ffee-0000-4000-8000-000000000001"
HOSTILE = "/data/<script>alert(1)</script>.bin"


def storage_capture(path: Path, *, complete: bool = True, obj: str = "/data/shard-7.bin") -> Path:
    # The trainer's CUDA device 0 is NVML's device 1 (CUDA_VISIBLE_DEVICES=1): the UUID joins them.
    b = Builder().proc(TRAINER, "python").proc(WORKER, "worker", TRAINER).nvml_devices(OTHER_GPU, H100)
    b.device(TRAINER, simulated=False, name="NVIDIA H100 80GB HBM3", uuid=H100)
    b.op(TRAINER, TRAINER, 0, 0, 10, "fwd")
    b.op(TRAINER, TRAINER, 39.95, 40, 50, "bwd")
    b.syscall(TRAINER, TRAINER, "read", 9, 39.9, "pipe").offcpu(TRAINER, TRAINER, 9, 39.9, "S", 39.8,
                                                                (WORKER, WORKER, "worker"))
    b.syscall(WORKER, WORKER, "pread64", 11, 39, obj, 4 << 20).block(WORKER, WORKER, 11.1, 38.9, 4 << 20)
    b.nvml(1, 20, 97.0).nvml(0, 20, 3.0)
    return b.write(path, complete=complete)


def test_json_is_the_contract_schema(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cap = storage_capture(tmp_path / "a.gputrace")
    assert main(["report", str(cap), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["schema"] == "gputrace.report/1"
    s = report["stalls"][0]
    assert (s["cause"], s["culprit"]["object"], s["culprit"]["pid"]) == ("storage", "/data/shard-7.bin", WORKER)
    assert report["summary"]["by_cause"] == {"storage": s["duration_ns"]}
    [dev] = report["devices"]
    assert (dev["id"], dev["uuid"], dev["nvml_util_pct"], dev["simulated"]) == (1, H100, 97.0, False)
    assert dev["cuda_ids"] == [{"pid": TRAINER, "id": 0}] and "pid" not in dev and s["device"] == 1


def test_terminal_report_names_cause_culprit_and_verdict(tmp_path: Path) -> None:
    cap = storage_capture(tmp_path / "a.gputrace")
    out = subprocess.run([sys.executable, "-m", "gputrace", "report", str(cap)], capture_output=True, text=True,
                         check=True, env={"COLUMNS": "200", "PATH": "/usr/bin:/bin"}).stdout
    for needle in ("Stall budget by cause", "storage", "/data/shard-7.bin", "pid 200 (worker)",
                   "highly input-bound", "for comparison", "97%", "drops: none"):
        assert needle in out, needle


def test_min_gap_changes_what_counts(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cap = storage_capture(tmp_path / "a.gputrace")
    main(["report", str(cap), "--json", "--min-gap-ms", "50"])
    assert json.loads(capsys.readouterr().out)["stalls"] == []
    assert main(["report", str(cap), "--min-gap-ms", "0"]) == 2


def test_html_is_written_safely_and_escaped(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cap = storage_capture(tmp_path / "a.gputrace", obj=HOSTILE)
    out = tmp_path / "r.html"
    assert main(["report", str(cap), "--html", str(out)]) == 0
    text = out.read_text()
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in text and "<script>alert" not in text
    assert f"Wrote {out}" in capsys.readouterr().out
    out.write_text("keep me")
    assert main(["report", str(cap), "--html", str(out)]) == 2
    assert out.read_text() == "keep me"
    assert "--force" in capsys.readouterr().err
    assert main(["report", str(cap), "--html", str(out), "-f"]) == 0 and "storage" in out.read_text()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".r.html")], "temporary file left behind"


def test_truncated_capture_is_reported_incomplete(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    cap = storage_capture(tmp_path / "a.gputrace", complete=False)
    assert main(["report", str(cap)]) == 0
    out = capsys.readouterr().out
    assert "INCOMPLETE CAPTURE" in out and "cut off" in out
    main(["report", str(cap), "--json"])
    report = json.loads(capsys.readouterr().out)
    assert report["capture"]["complete"] is False and report["stalls"][0]["overlaps_drops"] is True


def test_no_gpu_capture_says_so_and_lists_what_was_captured(tmp_path: Path,
                                                            capsys: pytest.CaptureFixture[str]) -> None:
    b = Builder().proc(TRAINER, "python").syscall(TRAINER, TRAINER, "read", 1, 2, "/etc/hosts", 10)
    cap = b.write(tmp_path / "n.gputrace")
    assert main(["report", str(cap)]) == 0
    out = capsys.readouterr().out
    assert "No GPU activity" in out and "Syscall" in out and "ProcInfo" in out


def test_bad_inputs_are_one_line_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    junk = tmp_path / "junk.gputrace"
    junk.write_bytes(b"\x00not a capture")
    assert main(["report", str(junk)]) == 3
    assert main(["report", str(tmp_path / "missing.gputrace")]) == 2
    trace = tmp_path / "x.pftrace"
    trace.write_bytes(b"")
    assert main(["report", str(trace)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 3 and all(line.startswith("gputrace: error: ") for line in err)
    assert "gputrace view" in err[2]


def _write_syscalls() -> int:
    with open("/proc/self/io") as f:
        return next(int(line.split()[1]) for line in f if line.startswith("syscw:"))


def test_json_goes_out_in_few_writes_on_an_unbuffered_stdout(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Under PYTHONUNBUFFERED=1 (set in many container images) stdout writes every piece it is given at once:
    the JSON of a large capture must not become one write() per token."""
    b = Builder().proc(TRAINER, "python").device(TRAINER)
    for i in range(300):
        b.op(TRAINER, TRAINER, i * 3, i * 3, i * 3 + 1, f"k{i}")  # a 2 ms stall before each kernel
    cap = b.write(tmp_path / "many.gputrace")
    out = tmp_path / "report.json"
    with open(out, "wb", buffering=0) as raw:  # what python -u / PYTHONUNBUFFERED=1 gives sys.stdout
        unbuffered = io.TextIOWrapper(raw, encoding="utf-8", write_through=True)
        monkeypatch.setattr(sys, "stdout", unbuffered)
        before = _write_syscalls()
        assert main(["report", str(cap), "--json"]) == 0
        writes = _write_syscalls() - before
        unbuffered.detach()
    assert len(json.loads(out.read_text())["stalls"]) == 299
    assert writes < 20, f"{writes} write() calls for {out.stat().st_size:,} bytes"


@pytest.mark.kernel
@pytest.mark.parametrize("unbuffered", ["", "1"])
def test_json_cut_by_a_full_disk_is_told(tmp_path: Path, unbuffered: str) -> None:
    """`report --json > r.json` where the disk fills up part way (a real 64 KiB tmpfs): an unbuffered stdout
    takes a large write in part, silently; the report must still fail, and say so."""
    b = Builder().proc(TRAINER, "python").device(TRAINER)
    for i in range(300):
        b.op(TRAINER, TRAINER, i * 3, i * 3, i * 3 + 1, f"k{i}")
    cap = b.write(tmp_path / "many.gputrace")
    with small_tmpfs(tmp_path / "tiny") as tiny, open(tiny / "r.json", "w") as out:
        r = subprocess.run([sys.executable, "-m", "gputrace", "report", str(cap), "--json"], stdout=out,
                           stderr=subprocess.PIPE, text=True, timeout=60,
                           env={"PATH": "/usr/bin:/bin", "PYTHONUNBUFFERED": unbuffered})
    assert r.returncode == 1, r.stderr
    assert r.stderr == (f"gputrace: error: writing the output ({tiny}/r.json): No space left on device; "
                        "it is incomplete\n")


def test_pid_text_without_a_process_name() -> None:
    # A capture without eBPF has no process records, so a culprit may have no name (seen on an H100 host).
    from gputrace.analysis.report import pid_text

    assert pid_text({"pid": 651, "comm": "python3"}) == "pid 651 (python3)"
    assert pid_text({"pid": 651, "comm": ""}) == "pid 651"
    assert pid_text({"pid": 651, "pid_in_namespace": 3}) == "pid 651 (pid 3 in its namespace)"
    both = {"pid": 651, "comm": "python3", "pid_in_namespace": 3}
    assert pid_text(both) == "pid 651 (python3; pid 3 in its namespace)"
