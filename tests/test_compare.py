"""`gputrace compare`: two captures' GPU busy share, stall budget and culprits side by side."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from gputrace.testing.schemas import validate
from gputrace.testing.synth import Builder, ns

TRAINER, WORKER = 100, 200
PATH = "/data/shard-0042.bin"


def _run(tmp_path: Path, name: str, read_ms: float, cpu_ms: float, worker: int = WORKER, **kw: bool) -> Path:
    """A trainer whose GPU waits on a worker's pread of PATH (read_ms), then on its own host work (cpu_ms)."""
    b = Builder().proc(TRAINER, "python").device(TRAINER)
    b.op(TRAINER, TRAINER, 0.0, 0.0, 10.0, "fwd")
    end = 10.0 + read_ms
    b.syscall(TRAINER, TRAINER, "futex", 9.0, end - 0.1)
    b.offcpu(TRAINER, TRAINER, 9.0, end - 0.15, "S", end - 0.2, (worker, worker, "pt_data_worker"))
    b.proc(worker, "pt_data_worker", TRAINER).syscall(worker, worker, "pread64", 9.5, end - 0.3, PATH, 1 << 20)
    b.offcpu(worker, worker, 9.6, end - 0.35, "D", waker=(0, 0, "swapper/1"))
    b.op(TRAINER, TRAINER, end - 0.05, end, end + 10, "bwd")
    b.op(TRAINER, TRAINER, end + 10 + cpu_ms - 0.05, end + 10 + cpu_ms, end + 20 + cpu_ms, "step")
    return b.write(tmp_path / name, **kw)


def _compare(*argv: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gputrace", "compare", *argv], capture_output=True, text=True,
                          timeout=60)


def test_compare_json_puts_the_same_file_side_by_side(tmp_path: Path) -> None:
    before, after = _run(tmp_path, "b.gputrace", 30, 20), _run(tmp_path, "a.gputrace", 5, 20)
    r = _compare(str(before), str(after), "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    validate(doc)
    assert doc["schema"] == "gputrace.compare/1" and doc["notes"] == []
    b, a = doc["before"], doc["after"]
    ms = ns(1) - ns(0)
    assert (b["window_ns"], a["window_ns"]) == (80 * ms, 55 * ms)  # first op start to last op end
    assert (b["busy_ns"], a["busy_ns"]) == (30 * ms, 30 * ms) and (b["stalls"], a["stalls"]) == (2, 2)
    assert doc["busy_change_points"] == round(100 * 30 / 55 - 100 * 30 / 80, 2) == 17.05
    assert doc["stall_change_points"] == -17.05
    storage, cpu = doc["by_cause"]  # most of a window first
    assert (storage["cause"], storage["before_ns"], storage["after_ns"]) == ("storage", 30 * ms, 5 * ms)
    assert storage["change_points"] == round(100 * 5 / 55 - 100 * 30 / 80, 2)
    assert (cpu["cause"], cpu["before_ns"], cpu["after_ns"]) == ("cpu", 20 * ms, 20 * ms)
    f = next(c for c in doc["culprits"] if c["kind"] == "file")
    assert (f["culprit"], f["before_ns"], f["after_ns"]) == (PATH, 30 * ms, 5 * ms)  # matched by name


def test_compare_matches_processes_by_name(tmp_path: Path) -> None:
    """The worker has another pid in the second run: the processes table matches them by name (and keeps
    the GPU process's own time apart)."""
    before = _run(tmp_path, "b.gputrace", 30, 20)
    after = _run(tmp_path, "a.gputrace", 5, 20, worker=WORKER + 77)
    r = _compare(str(before), str(after), "--json")
    assert r.returncode == 0, r.stderr
    doc = json.loads(r.stdout)
    validate(doc)
    worker, own = doc["processes"]
    assert (worker["comm"], worker["gpu_process"], worker["before_processes"], worker["after_processes"]) == \
        ("pt_data_worker", False, 1, 1), worker
    ms = ns(1) - ns(0)
    assert abs(worker["before_ns"] - 30 * ms) < ms and abs(worker["after_ns"] - 5 * ms) < ms, worker
    assert worker["change_points"] == round(100 * worker["after_ns"] / (55 * ms)
                                            - 100 * worker["before_ns"] / (80 * ms), 2)
    assert (own["comm"], own["gpu_process"]) == ("python", True) and abs(own["after_ns"] - 20 * ms) < ms, own
    out = _compare(str(before), str(after)).stdout
    assert "Stall time by process name" in out and "pt_data_worker" in out and "python (GPU process)" in out
    assert "1 → 1" in out, out


def test_compare_on_a_terminal_and_its_warnings(tmp_path: Path) -> None:
    before, after = _run(tmp_path, "b.gputrace", 30, 20), _run(tmp_path, "a.gputrace", 5, 20, complete=False)
    r = _compare(str(before), str(after))
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "gputrace compare b.gputrace → a.gputrace" in out
    assert "note: the after capture is incomplete" in out
    assert "GPU busy" in out and "37.5%" in out and "54.5%" in out and "+17.1 pts" in out and "-17.1 pts" in out
    assert PATH in out and "storage" in out


def test_a_run_without_gpu_activity_has_nothing_to_compare(tmp_path: Path) -> None:
    empty = Builder().proc(TRAINER, "python").syscall(TRAINER, TRAINER, "read", 1.0, 2.0).write(tmp_path / "e.gputrace")
    r = _compare(str(empty), str(_run(tmp_path, "a.gputrace", 5, 20)), "--json")
    doc = json.loads(r.stdout)
    validate(doc)
    assert doc["notes"] == ["the before capture has no GPU activity"]
    assert doc["busy_change_points"] is None and all(c["change_points"] is None for c in doc["by_cause"])
    r = _compare(str(empty), str(_run(tmp_path, "a.gputrace", 5, 20)))
    busy = next(line for line in r.stdout.splitlines() if "GPU busy" in line)
    assert "pts" not in busy and busy.rstrip("│ ").endswith("-"), busy


def test_compare_errors(tmp_path: Path) -> None:
    good = _run(tmp_path, "b.gputrace", 30, 20)
    bad = tmp_path / "bad.gputrace"
    bad.write_bytes(b"not a capture")
    for other in (bad, tmp_path / "missing.gputrace"):  # the same error and status as `gputrace report`
        r = _compare(str(good), str(other))
        report = subprocess.run([sys.executable, "-m", "gputrace", "report", str(other)], capture_output=True,
                                text=True, timeout=60)
        assert r.returncode == report.returncode > 0 and r.stderr == report.stderr, (r.stderr, report.stderr)
        assert other.name in r.stderr and "Traceback" not in r.stderr
    r = _compare(str(good))
    assert r.returncode == 2 and "AFTER" in r.stderr
