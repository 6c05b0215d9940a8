"""The bundled example under a real `gputrace capture` (real eBPF, real agent channel), launched and attached."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gputrace.agent import arming
from gputrace.capture import CaptureReader

pytestmark = pytest.mark.kernel  # root and the host's kernel (see tests/conftest.py)

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "train_sim.py"


def _gputrace(*args: str, env: dict[str, str] | None = None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "gputrace", *args], capture_output=True, text=True,
                          timeout=timeout, env=env, cwd=ROOT)


def _records(path: Path) -> tuple[CaptureReader, list[tuple[object, ...]]]:
    reader = CaptureReader(path)
    recs = list(reader.records())
    reader.close()
    return reader, recs


def test_example_captured_end_to_end(tmp_path: Path) -> None:
    out = tmp_path / "train.gputrace"
    run = _gputrace("capture", "-o", str(out), "--", sys.executable, str(EXAMPLE), "--steps", "16",
                    "--slow-worker", "1", "--data", str(tmp_path / "data"))
    assert run.returncode == 0, run.stderr
    assert "slow worker: worker 1" in run.stdout
    reader, recs = _records(out)
    assert reader.complete, reader.problem
    kinds = {type(r).__name__ for r in recs}
    assert {"GpuDevice", "GpuKernel", "GpuMemcpy", "CudaApi", "GpuSync", "OffCpu"} <= kinds
    [dev] = [r for r in recs if type(r).__name__ == "GpuDevice"]
    trainer = dev.pid  # type: ignore[attr-defined]
    assert dev.simulated  # type: ignore[attr-defined]
    kernels = [r for r in recs if type(r).__name__ == "GpuKernel"]
    assert len(kernels) == 16 * 3
    for k in kernels:
        want = {"forward": 4.0, "backward": 7.0, "optimizer_step": 1.5}[k.name]  # type: ignore[attr-defined]
        assert abs((k.end_ns - k.start_ns) / 1e6 - want) <= want * 0.1  # type: ignore[attr-defined]
    # Each stream sync shows on the trainer's thread as an off-CPU wait; where the kernel saw who woke it,
    # that is one of the trainer's own (stream) threads.
    offcpu = [r for r in recs if type(r).__name__ == "OffCpu" and r.tid == trainer]  # type: ignore[attr-defined]
    syncs = [r for r in recs if type(r).__name__ == "GpuSync" and r.kind == "stream"]  # type: ignore[attr-defined]
    waits = [[o for o in offcpu if s.start_ns <= o.start_ns and o.end_ns <= s.end_ns and o.state == "S"]
             for s in syncs]  # type: ignore[attr-defined]
    assert sum(bool(w) for w in waits) >= len(syncs) // 2, (len(syncs), offcpu[:5])
    wakers = {(o.waker_pid, o.waker_tid) for w in waits for o in w if o.waker_pid}  # type: ignore[attr-defined]
    assert wakers and all(pid == trainer and tid != trainer for pid, tid in wakers), wakers
    statuses = [r for r in recs if type(r).__name__ == "SourceStatus" and r.source == "agent"]  # type: ignore[attr-defined]
    assert not [s for s in statuses if s.status == "ended_early"], statuses  # type: ignore[attr-defined]

    report = _gputrace("report", str(out), "--json")
    assert report.returncode == 0, report.stderr
    data = json.loads(report.stdout)
    assert data["devices"][0]["simulated"] is True
    slow_pid = int(run.stdout.split("pids ")[1].split(",")[1].split(")")[0])
    blamed = sum(s["duration_ns"] for s in data["stalls"] if s["culprit"].get("pid") == slow_pid)
    assert blamed >= 0.8 * data["summary"]["stall_ns"] > 0, data["summary"]


def test_an_armed_process_is_attached_by_pid(tmp_path: Path) -> None:
    attach = tmp_path / "attach"
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUTRACE_")}
    env["GPUTRACE_ATTACH_DIR"] = str(attach)
    target_env = {**env, **arming.environment(None, base=env)}
    target = subprocess.Popen(
        [sys.executable, "-c", "import sys, time\nfrom gputrace.sim import Device\ns = Device(0).stream()\n"
         "print('up', flush=True)\nt = time.monotonic()\nwhile time.monotonic() - t < 20:\n"
         "    s.launch('serve_step', duration_ms=3)\n    s.synchronize()\n    time.sleep(0.005)\n"],
        env=target_env, stdout=subprocess.PIPE, text=True)
    try:
        assert target.stdout is not None and target.stdout.readline().strip() == "up"
        out = tmp_path / "svc.gputrace"
        run = _gputrace("capture", "-p", str(target.pid), "-d", "3", "-o", str(out), env=env)
        assert run.returncode == 0, run.stderr
        assert target.poll() is None, "the service keeps running after the capture"
    finally:
        target.kill()
        target.wait()
    _reader, recs = _records(out)
    kernels = [r for r in recs if type(r).__name__ == "GpuKernel"]
    assert len(kernels) > 50 and {k.pid for k in kernels} == {target.pid}  # type: ignore[attr-defined]
    assert not list(attach.glob("*.sock")), "the offer is withdrawn"
