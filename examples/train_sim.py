"""A small training loop on gputrace's simulated GPU, fed by DataLoader-style worker processes.

Each worker process reads sample files with pread (optionally from a cold page cache), "decodes" them on
the CPU and hands batches to the trainer through a queue, in step order as PyTorch's DataLoader does.
The trainer copies each batch to the device, launches forward/backward/optimizer kernels and
synchronizes. With --slow-worker N, worker N spends extra CPU time on every batch it prepares, so the
GPU idles while the trainer waits for that worker: the stall gputrace should pin on it.

    gputrace capture -- .venv/bin/python examples/train_sim.py --slow-worker 1
    gputrace report gputrace-python.<pid>.gputrace
"""

from __future__ import annotations

import argparse
import hashlib
import multiprocessing as mp
import os
import sys
import tempfile
import time
import zlib
from pathlib import Path
from typing import NamedTuple

SAMPLE_BYTES = 1 << 20
CHUNK = 256 << 10
KERNELS_MS = (("forward", 4.0), ("backward", 7.0), ("optimizer_step", 1.5))
COPY_MS = 1.0


def make_samples(data: Path, count: int) -> list[Path]:
    """Sample files shard-0000.bin ...; existing ones are kept as they are."""
    data.mkdir(parents=True, exist_ok=True)
    paths = [data / f"shard-{i:04d}.bin" for i in range(count)]
    for p in paths:
        if not p.exists() or p.stat().st_size != SAMPLE_BYTES:
            p.write_bytes(os.urandom(SAMPLE_BYTES))
    return paths


def read_sample(path: Path, cold: bool) -> bytes:
    fd = os.open(path, os.O_RDONLY)
    try:
        if cold:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        parts, offset = [], 0
        while chunk := os.pread(fd, CHUNK, offset):
            parts.append(chunk)
            offset += len(chunk)
        return b"".join(parts)
    finally:
        os.close(fd)


def burn_cpu(ms: float) -> None:
    """Busy preprocessing (a decode/augment that is too slow), on this worker's CPU."""
    deadline = time.perf_counter() + ms / 1000
    h = hashlib.sha256()
    while time.perf_counter() < deadline:
        h.update(b"x" * 4096)


def worker(rank: int, nworkers: int, steps: int, files: list[Path], out: mp.Queue, cold: bool,
           slow_ms: float) -> None:
    for step in range(rank, steps, nworkers):
        data = read_sample(files[step % len(files)], cold)
        checksum = zlib.crc32(data)
        if slow_ms:
            burn_cpu(slow_ms)
        out.put((step, len(data), checksum))


class Result(NamedTuple):
    wall_s: float
    busy_s: float  # the simulated GPU's work, by construction
    nbytes: int
    worker_pids: list[int]


def train(args: argparse.Namespace, files: list[Path]) -> Result:
    ctx = mp.get_context("fork")  # the DataLoader default on Linux
    queues = [ctx.Queue(maxsize=2) for _ in range(args.workers)]  # prefetch_factor=2
    procs = [
        ctx.Process(target=worker, args=(r, args.workers, args.steps, files, queues[r], args.cold,
                                         args.slow_ms if r == args.slow_worker else 0.0),
                    name=f"loader-{r}", daemon=True)
        for r in range(args.workers)
    ]
    for p in procs:
        p.start()

    from gputrace.sim import Device

    dev = Device(0)
    compute, copy = dev.stream(), dev.stream()
    nbytes = 0
    t0 = time.monotonic()
    for step in range(args.steps):
        got, size, _checksum = queues[step % args.workers].get()  # in order, like a DataLoader
        assert got == step
        nbytes += size
        copy.memcpy(size, duration_ms=COPY_MS, kind="h2d", memory="pinned")
        copy.synchronize()
        for name, ms in KERNELS_MS:
            compute.launch(name, duration_ms=ms)
        compute.synchronize()
    wall = time.monotonic() - t0
    for p in procs:
        p.join()
    busy = args.steps * (COPY_MS + sum(ms for _, ms in KERNELS_MS)) / 1000
    return Result(wall, busy, nbytes, [p.pid or 0 for p in procs])


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=150, help="training steps (default: 150, about 3 s)")
    p.add_argument("--data", type=Path, default=Path(tempfile.gettempdir()) / f"gputrace-train-sim-{os.getuid()}",
                   help="directory of sample files, created when missing (default: %(default)s)")
    p.add_argument("--files", type=int, default=16, help="number of sample files (default: 16)")
    p.add_argument("--workers", type=int, default=2, help="loader worker processes (default: 2)")
    p.add_argument("--slow-worker", type=int, default=-1, metavar="N",
                   help="make loader worker N slow: extra CPU work on each of its batches")
    p.add_argument("--slow-ms", type=float, default=60.0, help="the slow worker's extra time per batch")
    p.add_argument("--cold", action="store_true", help="drop each file from the page cache before reading it")
    args = p.parse_args(argv)
    if args.steps < 1 or args.files < 1 or args.workers < 1:
        p.error("--steps, --files and --workers must be >= 1")
    if args.slow_worker >= args.workers:
        p.error(f"--slow-worker must be < --workers ({args.workers})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    try:
        files = make_samples(args.data, args.files)
    except OSError as e:
        print(f"train_sim: error: cannot prepare sample files in {args.data}: {e.strerror}", file=sys.stderr)
        return 2
    r = train(args, files)
    slow = f"worker {args.slow_worker} (+{args.slow_ms:g} ms CPU per batch)" if args.slow_worker >= 0 else "none"
    print(f"train_sim: pid {os.getpid()}, {args.steps} steps, {args.workers} loader workers "
          f"(pids {', '.join(map(str, r.worker_pids))}), slow worker: {slow}")
    print(f"train_sim: read {r.nbytes / 2**20:.0f} MiB from {len(files)} files in {args.data}"
          f"{' (cold cache)' if args.cold else ''}")
    print(f"train_sim: wall {r.wall_s:.2f} s, simulated GPU busy {r.busy_s:.2f} s "
          f"({100 * r.busy_s / r.wall_s:.0f} %)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
