"""Golden test: one small capture mixing every rule in, the exact stalls out (tests/data/analysis/).

After an intended change of the analysis, regenerate with GPUTRACE_REGEN_GOLDEN=1 and review the diff.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from gputrace.analysis import analyze
from gputrace.capture import open_capture
from gputrace.testing.synth import BASE_NS, Builder

GOLDEN = Path(__file__).parent / "data" / "analysis" / "mixed_stalls.json"
TRAINER, WORKER, PEER_RANK = 100, 200, 300


def mixed_capture(path: Path) -> Path:
    """Ten stalls on the trainer's device, one per rule, plus the late rank's own device."""
    b = Builder().proc(TRAINER, "train.py").proc(WORKER, "loader0", TRAINER).proc(PEER_RANK, "rank1")
    b.device(TRAINER).device(PEER_RANK)
    t = TRAINER
    b.op(t, t, 0, 0, 10, "k0")
    # 1 storage via a worker: [10, 40)
    b.syscall(t, t, "read", 9, 39.9, "pipe", 64).offcpu(t, t, 9, 39.9, "S", 39.8, (WORKER, WORKER, "loader0"))
    b.syscall(WORKER, WORKER, "pread64", 11, 39.5, "/data/shard-1.bin", 1 << 20)
    b.block(WORKER, WORKER, 11.1, 39.4, 1 << 20).offcpu(WORKER, WORKER, 11.2, 39.45, "D", 39.4, (0, 0, "[irq]"))
    b.op(t, t, 39.95, 40, 45, "k1")
    # 2 network: [45, 60)
    b.syscall(t, t, "recvfrom", 45.5, 59.5, "10.1.2.3:8470", 4096)
    b.op(t, t, 59.9, 60, 65, "k2")
    # 3 sleep: [65, 80)
    b.syscall(t, t, "clock_nanosleep", 65.2, 79.8)
    b.op(t, t, 79.9, 80, 85, "k3")
    # 4 runqueue: [85, 100)
    b.offcpu(t, t, 85.1, 99.5, "R")
    b.op(t, t, 99.9, 100, 105, "k4")
    # 5 cpu: [105, 120) nothing recorded: running
    b.op(t, t, 119.9, 120, 125, "k5")
    # 6 device: launched at 110, before the stall [125, 140)
    b.op(t, t, 110, 140, 145, "k6")
    # 7 sync: [145, 160), waiting for the trainer's other device
    b.device(t, dev=1).op(t, t, 139, 140, 159.5, "k_dev1", dev=1)
    b.sync(t, t, 145.1, 159.5).syscall(t, t, "futex", 145.1, 159.5).offcpu(t, t, 145.1, 159.5, "S", 159.5,
                                                                               (t, t + 1, "sim-stream"))
    b.op(t, t, 159.9, 160, 165, "k7")
    # 8 unknown: a wait ended by an untraced process: [165, 180)
    b.syscall(t, t, "futex", 165, 179.9).offcpu(t, t, 165, 179.9, "S", 179.8, (999, 999, "outsider"))
    b.op(t, t, 179.95, 180, 185, "k8")
    # 9 collective: rank 1 (pid 300) arrives late because of its own read: wait [185, 200)
    c0 = b.op(t, t, 184, 185, 202, "ncclDevKernel_AllReduce")
    b.op(PEER_RANK, PEER_RANK, 0, 0, 184, "r1_k")
    b.syscall(PEER_RANK, PEER_RANK, "pread64", 184.5, 199.5, "/data/rank1.bin", 1 << 20)
    c1 = b.op(PEER_RANK, PEER_RANK, 199.9, 200, 202, "ncclDevKernel_AllReduce")
    b.collective(t, c0, "all_reduce", 1, 0, 2).collective(PEER_RANK, c1, "all_reduce", 1, 1, 2)
    b.op(PEER_RANK, PEER_RANK, 201, 202, 210, "r1_tail")
    # 10 launch: launched at 212, during the stall [210, 220), started at 220
    b.op(t, t, 201, 202, 210, "k9")
    b.op(t, t, 212, 220, 225, "k10")
    return b.write(path, header={"mounts": [["/", "ext4"]], "host": "golden"})


def essentials(report: dict[str, Any]) -> list[dict[str, Any]]:
    """What the golden file pins down, with times relative to the capture base."""
    out = []
    for s in report["stalls"]:
        c = s["culprit"]
        out.append({
            "device_pid": s.get("device_pid"), "start_ms": (s["start_ns"] - BASE_NS) / 1e6,
            "end_ms": (s["end_ns"] - BASE_NS) / 1e6, "cause": s["cause"], "via": s["via"],
            "culprit": {k: c[k] for k in ("pid", "tid", "comm", "op", "object", "bytes")},
            "evidence": sorted([e["kind"], e["pid"], (e["start_ns"] - BASE_NS) / 1e6] for e in s["evidence"]),
        })
    return out


def test_mixed_capture_matches_the_golden_stalls(tmp_path: Path) -> None:
    with open_capture(mixed_capture(tmp_path / "mixed.gputrace")) as reader:
        got = essentials(analyze(reader))
    if os.environ.get("GPUTRACE_REGEN_GOLDEN"):
        GOLDEN.write_text(json.dumps(got, indent=1) + "\n")
    assert got == json.loads(GOLDEN.read_text())
