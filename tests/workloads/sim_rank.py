"""One rank of a simulated data-parallel job: ``sim_rank.py CONFIG.json RANK``.

Each step runs a "forward/backward" kernel, then all-reduces over a ProcessGroup (gputrace.sim). The late
rank (``late_rank`` in the config) first reads a file it dropped from the page cache, on a throttled device:
it arrives late to every all-reduce by its own cold read, and every other rank waits for it. Ranks do not
synchronize per step: as with NCCL, the collective keeps them together. Writes ``RANK.done`` (its pid) last.
"""

from __future__ import annotations

import json
import os
import sys

from gputrace.sim import Device, ProcessGroup

KERNEL_MS = 5.0


def read_uncached(path: str) -> int:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        n = 0
        while chunk := os.read(fd, 1 << 20):
            n += len(chunk)
        return n
    finally:
        os.close(fd)


def main() -> None:
    with open(sys.argv[1]) as f:
        cfg = json.load(f)
    rank = int(sys.argv[2])
    late = rank == cfg["late_rank"]
    if late and cfg.get("cgroup"):
        with open(os.path.join(cfg["cgroup"], "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    group = ProcessGroup(rank, cfg["world"], cfg["address"], timeout_s=cfg.get("timeout_s", 120.0))
    s = Device(0).stream()
    s.all_reduce(group, 8, duration_ms=1.0)  # the ranks started at different times: line them up first
    s.synchronize()
    for k in range(cfg["steps"]):
        s.launch(f"fwd_bwd_{k}", KERNEL_MS)
        if late:
            read_uncached(cfg["files"][k % len(cfg["files"])])
        s.all_reduce(group, 1 << 20, duration_ms=1.0)
    s.synchronize()
    group.close()
    with open(os.path.join(cfg["out"], f"{rank}.done"), "w") as f:
        f.write(f"{os.getpid()} {group.comm_id}")


if __name__ == "__main__":
    main()
