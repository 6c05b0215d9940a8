"""examples/train_torch.py, the real-GPU example, runs its whole loop on the CPU here (no GPU on CI): the
DataLoader workers, the reads (cold ones too) and the slow worker, so the example cannot rot unseen."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "train_torch.py"


def run(tmp_path: Path, *args: str, device: str = "cpu") -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(EXAMPLE), "--device", device, "--hidden", "64", "--layers", "1",
                           "--files", "2", "--data", str(tmp_path / "d"), *args],
                          capture_output=True, text=True, timeout=180)  # fmt: skip


@pytest.mark.kernel  # PyTorch
def test_the_torch_example_trains_on_the_cpu_with_a_slow_worker_and_cold_reads(tmp_path: Path) -> None:
    r = run(tmp_path, "--steps", "4", "--batch", "16", "--slow-worker", "1", "--slow-ms", "40", "--cold")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "slow worker: worker 1 (+40 ms CPU per batch)" in r.stdout
    workers = set(re.findall(r"loader worker (\d): pid (\d+)", r.stdout))
    assert {w for w, _ in workers} == {"0", "1"}
    done = re.search(r"4 steps \(0\.5 epochs\) in ([\d.]+) s, ([\d.]+) ms per step", r.stdout)
    assert done, r.stdout
    assert float(done.group(2)) >= 40 / 2  # worker 1 makes every second batch, 40 ms of CPU each
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == ["shard-0000.bin", "shard-0001.bin"]


def test_the_torch_example_refuses_a_slow_worker_it_does_not_have(tmp_path: Path) -> None:
    r = run(tmp_path, "--workers", "2", "--slow-worker", "2")
    assert r.returncode == 2 and "--slow-worker must name one of the --workers" in r.stderr


@pytest.mark.kernel  # PyTorch
def test_the_torch_example_runs_its_device_work_on_the_simulated_gpu_and_logs_each_step(tmp_path: Path) -> None:
    log = tmp_path / "steps.json"
    # 4 batches an epoch: the persistent workers go on into a second one
    r = run(tmp_path, "--steps", "6", "--batch", "32", "--slow-worker", "1", "--slow-ms", "20", "--pin-memory",
            "--step-log", str(log), device="sim")
    assert r.returncode == 0, r.stderr[-2000:]
    assert "6 steps on sim (gputrace simulated GPU)" in r.stdout, r.stdout
    workers = dict(re.findall(r"loader worker (\d): pid (\d+)", r.stdout))
    assert re.findall(r"slow worker: pid (\d+)", r.stdout) == [workers["1"]], r.stdout
    steps = json.loads(log.read_text())
    ends = steps["step_end_ns"]
    assert steps["steps"] == len(ends) == 6 and ends == sorted(ends) and len(set(ends)) == 6, steps
    # each step's batch was handed over after the step before ended, and before its own end
    got = steps["batch_ns"]
    assert len(got) == 6 and all(b < e for b, e in zip(got, ends, strict=True)), steps
    assert all(e < b for e, b in zip(ends[:-1], got[1:], strict=True)), steps
