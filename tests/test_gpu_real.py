"""End to end on a real NVIDIA GPU: a small PyTorch loop under `gputrace capture --`, read back from the capture.

Skips only where there is no NVIDIA GPU, CUDA, torch or cupti-python (the reason says which). Run on a GPU
machine as root:  .venv/bin/python -m pytest -q tests/test_gpu_real.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections import Counter
from functools import cache

import pytest

from gputrace.capture import CaptureReader
from gputrace.probes.cupti import real_gpu_missing
from gputrace.records import AgentInfo, CudaApi, GpuKernel, GpuMemcpy, GpuSync, NvmlSample, NvtxRange

pytestmark = pytest.mark.gpu

STEPS = 20
N = 1024  # float32 N×N tensors: 4 MiB per copy

WORKLOAD = textwrap.dedent(f"""
    import json, sys, threading, torch
    dev = torch.device("cuda")
    w = torch.randn({N}, {N}, device=dev)
    pinned = torch.randn({N}, {N}).pin_memory()
    for step in range({STEPS}):
        torch.cuda.nvtx.range_push("step")
        pageable = torch.randn({N}, {N})
        a = pageable.to(dev)                          # H2D from pageable memory
        b = pinned.to(dev, non_blocking=True)         # H2D from pinned memory
        for size in (256, 512, {N}):                  # a few kernel sizes
            (a[:size, :size] @ w[:size, :size]).relu_()
        c = (a @ b).sum()
        torch.cuda.synchronize()                      # a host wait for the device
        torch.cuda.nvtx.range_pop()
    print(json.dumps({{"tid": threading.get_native_id(), "pid": __import__("os").getpid(),
                      "sum": float(c.cpu())}}))
""")


@cache
def gpu_missing() -> str:
    """Why this host cannot run the real path ("" when it can)."""
    why = real_gpu_missing()
    if why:
        return why
    probe = subprocess.run([sys.executable, "-c", "import torch; print(torch.cuda.is_available())"],
                           capture_output=True, text=True, timeout=120)  # fmt: skip
    if probe.stdout.strip() != "True":
        return f"torch sees no CUDA device: {probe.stderr.strip()[-200:]}"
    return ""


@pytest.fixture(scope="module")
def captured(tmp_path_factory: pytest.TempPathFactory) -> tuple[list, dict, CaptureReader]:
    why = gpu_missing()
    if why:
        pytest.skip(f"needs a real NVIDIA GPU with CUDA, torch and cupti-python: {why}")
    assert os.geteuid() == 0, "run the tests as root: the capture loads eBPF programs"
    d = tmp_path_factory.mktemp("gpu")
    script = d / "loop.py"
    script.write_text(WORKLOAD)
    out = d / "loop.gputrace"
    run = subprocess.run([sys.executable, "-m", "gputrace", "capture", "-f", "-o", str(out), "--",
                          sys.executable, str(script)], capture_output=True, text=True, timeout=300)  # fmt: skip
    assert run.returncode == 0, run.stderr[-2000:]
    facts = json.loads([line for line in run.stdout.splitlines() if line.startswith("{")][-1])
    reader = CaptureReader(out)
    records = list(reader.records())
    return records, facts, reader


def of(records: list, cls: type, pid: int | None = None) -> list:
    return [r for r in records if type(r) is cls and (pid is None or r.pid == pid)]


def test_agent_said_hello_with_versions(captured: tuple) -> None:
    records, facts, _ = captured
    (hello,) = [a for a in of(records, AgentInfo, facts["pid"]) if a.source == "cupti"]
    assert hello.cuda_version and hello.driver_version


def test_kernels_on_streams_with_launches(captured: tuple) -> None:
    records, facts, reader = captured
    kernels = of(records, GpuKernel, facts["pid"])
    assert len(kernels) >= STEPS * 5
    assert len({k.name for k in kernels}) >= 3
    start, end = reader.header["start_ns"], reader.trailer["end_ns"] if reader.trailer else 1 << 62
    assert all(start <= k.start_ns <= k.end_ns <= end for k in kernels)
    launches = {a.correlation_id for a in of(records, CudaApi, facts["pid"]) if a.api == "runtime"}
    assert sum(k.correlation_id in launches for k in kernels) >= 0.95 * len(kernels)
    by_stream: dict[tuple[int, int], list[GpuKernel]] = {}
    for k in kernels:
        by_stream.setdefault((k.device, k.stream), []).append(k)
    for ks in by_stream.values():  # one stream runs one kernel at a time
        ks.sort(key=lambda k: k.start_ns)
        assert all(a.end_ns <= b.start_ns for a, b in zip(ks, ks[1:], strict=False))


def test_copies_pageable_and_pinned(captured: tuple) -> None:
    records, facts, _ = captured
    h2d = Counter((c.memory, c.nbytes) for c in of(records, GpuMemcpy, facts["pid"]) if c.kind == "h2d")
    assert h2d[("pageable", 4 * N * N)] >= STEPS
    assert h2d[("pinned", 4 * N * N)] >= STEPS


def test_api_calls_and_syncs_on_the_kernel_tid(captured: tuple) -> None:
    records, facts, _ = captured
    calls = of(records, CudaApi, facts["pid"])
    assert any(c.tid == facts["tid"] and c.name.startswith("cudaLaunchKernel") for c in calls)
    syncs = [s for s in of(records, GpuSync, facts["pid"]) if s.tid == facts["tid"]]
    assert len(syncs) >= STEPS and {s.kind for s in syncs} & {"context", "stream"}


def test_nvtx_ranges(captured: tuple) -> None:
    records, facts, _ = captured
    steps = [r for r in of(records, NvtxRange, facts["pid"]) if r.name == "step"]
    assert len(steps) == STEPS and all(r.tid == facts["tid"] and r.end_ns > r.start_ns for r in steps)


def test_nvml_and_no_cupti_drops(captured: tuple) -> None:
    records, _, reader = captured
    assert any(r.metric == "gpu_util_pct" for r in of(records, NvmlSample))
    assert not {k: v for k, v in reader.drops.items() if "cupti" in k and v}
