"""A host where eBPF cannot run (here: no kernel headers for bcc, hidden by a mount namespace) still captures
the GPU side: agents and NVML, the targets followed through /proc, and every output says eBPF was missing.
A GPU machine without bcc is the case this is for."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from gputrace.capture import CaptureReader
from gputrace.testing.schemas import validate

pytestmark = pytest.mark.kernel  # root and the host's kernel (see tests/conftest.py)

ROOT = Path(__file__).resolve().parents[1]
PY314 = ROOT / "build" / "python3.14" / "usr" / "bin" / "python3.14"
NO_HEADERS = "mount -t tmpfs no-headers /lib/modules && exec \"$@\""


def _without_headers(args: list[str], timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["unshare", "--mount", "sh", "-c", NO_HEADERS, "sh", *args], capture_output=True,
                          text=True, timeout=timeout, cwd=ROOT)


def _records(path: Path) -> tuple[dict[str, int], dict[str, list[str]], list]:  # type: ignore[type-arg]
    with CaptureReader(path) as reader:
        recs = list(reader.records())
        assert reader.complete and reader.trailer is not None
        sources = reader.trailer["sources"]
    counts: dict[str, int] = {}
    for r in recs:
        counts[type(r).__name__] = counts.get(type(r).__name__, 0) + 1
    return counts, sources, recs


def test_a_command_is_captured_from_the_gpu_side_alone(tmp_path: Path) -> None:
    out = tmp_path / "job.gputrace"
    job = [sys.executable, "examples/train_sim.py", "--steps", "12", "--slow-worker", "1", "--data", f"{tmp_path}/d"]
    r = _without_headers([sys.executable, "-m", "gputrace", "capture", "-o", str(out), "--", *job])
    assert r.returncode == 0, r.stderr
    assert "gputrace: eBPF unavailable: kernel headers for" in r.stderr
    assert "GPU activity (agents, NVML) only" in r.stderr
    assert "note: no eBPF in this capture (kernel headers" in r.stdout + r.stderr
    counts, sources, _ = _records(out)
    assert sources["ebpf"][0] == "missing" and "kernel headers" in sources["ebpf"][1]
    assert counts["GpuKernel"] == 36 and counts["GpuSync"] > 0  # 3 kernels a step, all of them
    assert not {"Syscall", "OffCpu", "BlockIO", "SchedWake"} & set(counts)
    report = json.loads(subprocess.run([sys.executable, "-m", "gputrace", "report", str(out), "--json"],
                                       capture_output=True, text=True, timeout=60, cwd=ROOT).stdout)
    validate(report)
    assert report["capture"]["ebpf_missing"].startswith("kernel headers for")
    assert report["devices"] and report["devices"][0]["stalls"] > 0
    # No stall can be traced to input without the host side: the verdict must not say "not input-bound".
    assert report["summary"]["input_bound"]["verdict"].startswith("unknown (no host-side data")
    assert "input-bound: unknown (no host-side data: the capture ran without eBPF)" in r.stderr


def test_a_running_process_is_followed_through_proc_until_it_exits(tmp_path: Path) -> None:
    """-p of an unarmed Python 3.14 (the agent injected), which ends on its own: the capture ends with it."""
    assert PY314.is_file(), f"{PY314} is missing: run ./setup.sh --test"
    work = tmp_path / "loop.py"
    # it runs until the agent is in it (or for 60 s), then for 200 steps more (a second or so) and ends
    work.write_text("import sys, time\nfrom gputrace.sim import Device\ns = Device(0).stream()\n"
                    "print('up', flush=True)\nend = time.monotonic() + float(sys.argv[1])\n"
                    "def agent():\n    arming = sys.modules.get('gputrace.agent.arming')\n"
                    "    return arming is not None and arming.current() is not None\n"
                    "def step():\n    s.launch('step', duration_ms=5); s.synchronize()\n"
                    "while time.monotonic() < end and not agent():\n    step()\n"
                    "for _ in range(200):\n    step()\n")
    p = subprocess.Popen([str(PY314), str(work), "60"], stdout=subprocess.PIPE, text=True,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    assert p.stdout is not None and p.stdout.readline().strip() == "up"
    out = tmp_path / "attached.gputrace"
    t0 = time.monotonic()
    r = _without_headers([sys.executable, "-m", "gputrace", "capture", "-p", str(p.pid), "-o", str(out),
                          "--no-perfetto", "-d", "60"])
    p.wait(10)
    assert r.returncode == 0, r.stderr
    assert time.monotonic() - t0 < 30, "the capture did not end with its target"
    assert f"GPU agent of pid {p.pid}: injected" in r.stderr and "eBPF unavailable" in r.stderr
    counts, sources, recs = _records(out)
    assert sources["ebpf"][0] == "missing"
    kernels = [k for k in recs if type(k).__name__ == "GpuKernel"]
    assert len(kernels) > 50 and {k.pid for k in kernels} == {p.pid}
    with CaptureReader(out) as reader:
        list(reader.records())
        assert reader.trailer is not None and reader.trailer["stop_reason"] == "targets exited"
