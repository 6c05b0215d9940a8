"""A synthetic DataLoader-like capture of any length, written as it is generated (memory flat in its length).

A trainer launches a kernel and a copy every 10 ms step; four workers read shards (block requests, off-CPU
waits, wakeups); other workers make noise syscalls; every other step the GPU stalls on a wait chain that leads
to a worker's read. ``relay``: the trainer waits on a pin-memory thread's queue (a futex the thread wakes
after its own read of the workers' pipe) rather than on the pipe itself. About 20 records a step, written 500
steps at a time. Used by bench/analysis_scale.py and the windowed analysis's tests.
"""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

from gputrace.capture import CaptureWriter, host_header

TRAINER, WORKERS = 1000, (1001, 1002, 1003, 1004)
PIN = 1010  # the trainer's pin-memory thread
STEP_NS = 10_000_000
MS = 1_000_000


def step_rows(k: int, t: int, rng: random.Random, rows: dict[str, list[list[Any]]], relay: bool,
              stall_every: int = 2) -> None:
    """About 20 records: one training step, stalled on odd steps."""
    stalled = k % stall_every == 1
    w = WORKERS[k % len(WORKERS)]
    launch = t + (8 * MS if stalled else MS)
    # stalls sparser than every other step: the GPU is kept busy up to the next step's kernel between them
    kernel_end = launch + 4 * MS if stall_every <= 2 or stalled else t + STEP_NS + 2 * MS
    rows["CudaApi"].append([TRAINER, TRAINER, "cudaLaunchKernel", launch, launch + 5000, 2 * k, "runtime", 0])
    rows["GpuKernel"].append([TRAINER, 0, 1, 7, launch + 10_000, kernel_end, 2 * k, f"step_{k}", [1, 1, 1],
                              [128, 1, 1]])
    rows["CudaApi"].append([TRAINER, TRAINER, "cudaMemcpyAsync", launch + 6000, launch + 9000, 2 * k + 1,
                            "runtime", 0])
    rows["GpuMemcpy"].append([TRAINER, 0, 1, 8, launch + 20_000, launch + MS, 2 * k + 1, 1 << 20, "h2d",
                              "pinned"])
    if stalled:
        if relay:
            rows["Syscall"].append([TRAINER, TRAINER, "futex", t, launch - 1000, 0, -1, "", 0, 0x7000])
            rows["OffCpu"].append([TRAINER, TRAINER, t + 1000, launch - 2000, "S", launch - 2500, TRAINER, PIN,
                                   "pt_data_pin"])
            rows["Syscall"].append([TRAINER, PIN, "read", t, launch - 2800, 64, 9, "pipe", 64, 64])
            rows["OffCpu"].append([TRAINER, PIN, t + 1000, launch - 3000, "S", launch - 3000, w, w, "worker"])
        else:
            rows["Syscall"].append([TRAINER, TRAINER, "read", t, launch - 1000, 64, 9, "pipe", 64, 64])
            rows["OffCpu"].append([TRAINER, TRAINER, t + 1000, launch - 2000, "S", launch - 3000, w, w, "worker"])
        path = f"/data/shard-{k % 997:04d}.bin"
        rows["Syscall"].append([w, w, "pread64", t + 500, launch - 5000, 1 << 20, 5, path, 1 << 20, 1 << 20])
        rows["OffCpu"].append([w, w, t + 600, launch - 6000, "D", launch - 6500, 0, 0, "[irq]"])
        for j in range(2):
            issue = t + 700 + j * 1000
            rows["BlockIO"].append([w, w, "worker", "nvme0n1", 2048 * k + j, 512 << 10, "R", issue,
                                    issue + rng.randint(2, 6) * MS])
    for other in WORKERS:
        if other != w:
            s = t + rng.randint(0, 8 * MS)
            rows["Syscall"].append([other, other, "futex", s, s + 200_000, 0, -1, "", 0, 0])
            rows["OffCpu"].append([other, other, s + 10, s + 190_000, "R", 0, 0, 0, ""])
    rows["SyscallAgg"].append([TRAINER, TRAINER, "ioctl", 12, 48_000])


def container_mounts(n: int) -> list[list[str]]:
    """``n`` mount-table rows like a Kubernetes node's: each pod's service-account tmpfs and each container's
    overlay root (a node running tens of pods has hundreds)."""
    rows = []
    for i in range(n):
        uid = f"{i:08x}-5d1c-4c1e-9a7b-{i * 7919:012x}"
        if i % 2:
            rows.append([f"/var/lib/kubelet/pods/{uid}/volumes/kubernetes.io~projected/kube-api-access-{i:05x}",
                         "tmpfs", "tmpfs", f"0:{200 + i}"])
        else:
            rows.append([f"/run/containerd/io.containerd.runtime.v2.task/k8s.io/{uid}/rootfs", "overlay", "overlay",
                         f"0:{200 + i}"])
    return rows


def generate(path: Path, n_records: int, relay: bool, stall_every: int = 2, mounts: int = 0) -> int:
    """Write a capture of at least ``n_records`` records to ``path``, a stall every ``stall_every`` steps, its
    mount table this host's and ``mounts`` rows of a container host's (``container_mounts``); the number
    written."""
    rng = random.Random(42)
    header = host_header(["bench"])
    header["mounts"] = [*header.get("mounts", []), *container_mounts(mounts)]
    w = CaptureWriter(path, {**header, "start_ns": 0}, force=True)
    w.write_rows("ProcInfo", [[0, p, 1, "python", ["python"], "/usr/bin/python3"] for p in (TRAINER, *WORKERS)])
    w.write_rows("GpuDevice", [[0, "bench GPU", True, "uuid", TRAINER]])
    written, k, t = 0, 0, 1_000 * MS
    while written < n_records:
        rows: dict[str, list[list[Any]]] = {kind: [] for kind in (
            "CudaApi", "GpuKernel", "GpuMemcpy", "Syscall", "OffCpu", "BlockIO", "SyscallAgg")}
        for _ in range(500):
            step_rows(k, t, rng, rows, relay, stall_every)
            k, t = k + 1, t + STEP_NS
        for kind, batch in rows.items():
            w.write_rows(kind, batch)
            written += len(batch)
    w.close({"end_ns": t, "drops": {}, "complete": True})
    return written
