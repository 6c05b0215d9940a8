"""A small PyTorch training loop on a real GPU, fed by a DataLoader whose workers read sample files.

Each worker process reads its batch's samples from files with pread, "decodes" the bytes into a float tensor on
the CPU and hands the batch to the trainer, in step order, as PyTorch's DataLoader does. The trainer copies the
batch to the GPU, runs forward, backward and the optimizer, and reads the loss back every step (a host wait for
the device, as a logging loop does). With --slow-worker N, worker N spends extra CPU time on every batch it
prepares, so the GPU idles while the trainer waits for that worker: the stall gputrace should pin on it.
With --cold, every sample is read from the device (dropped from the page cache first): storage stalls.

    sudo gputrace capture -o real.gputrace -- python examples/train_torch.py --slow-worker 1
    gputrace report real.gputrace

Needs PyTorch; --device cpu runs the same loop without a GPU (no GPU activity to trace then).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

SAMPLE_BYTES = 64 << 10  # one sample: 64 KiB of bytes, 65,536 features


def make_samples(data: Path, count: int, per_file: int) -> list[Path]:
    """Sample files shard-0000.bin ...; existing ones of the right size are kept."""
    data.mkdir(parents=True, exist_ok=True)
    paths = [data / f"shard-{i:04d}.bin" for i in range(count)]
    for p in paths:
        if not p.exists() or p.stat().st_size != SAMPLE_BYTES * per_file:
            p.write_bytes(os.urandom(SAMPLE_BYTES * per_file))
    return paths


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=100, help="training steps (default: 100)")
    p.add_argument("--batch", type=int, default=64, help="samples per batch (default: 64)")
    p.add_argument("--hidden", type=int, default=4096, help="hidden width of the MLP (default: 4096)")
    p.add_argument("--layers", type=int, default=6, help="hidden layers (default: 6)")
    p.add_argument("--workers", type=int, default=2, help="DataLoader worker processes (default: 2)")
    p.add_argument("--slow-worker", type=int, default=-1, metavar="N",
                   help="worker N spends --slow-ms of extra CPU on every batch (default: none)")  # fmt: skip
    p.add_argument("--slow-ms", type=float, default=60.0, help="the slow worker's extra time per batch (default: 60)")
    p.add_argument("--files", type=int, default=16, help="sample files (default: 16, 64 samples each)")
    p.add_argument("--data", type=Path, default=Path(tempfile.gettempdir()) / f"gputrace-train-torch-{os.getuid()}",
                   help="folder of the sample files (made if missing)")  # fmt: skip
    p.add_argument("--cold", action="store_true", help="drop each sample from the page cache before reading it")
    p.add_argument("--pin-memory", action="store_true", help="DataLoader pin_memory=True, non-blocking copies")
    p.add_argument("--device", default="cuda", help="torch device (default: cuda)")
    args = p.parse_args()
    if args.workers < 1 or not -1 <= args.slow_worker < args.workers:
        p.error("--slow-worker must name one of the --workers (0 .. workers-1)")

    import torch
    from torch.utils.data import BatchSampler, DataLoader, Dataset, SequentialSampler, get_worker_info

    dev = torch.device(args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        sys.exit("train_torch: torch sees no CUDA device (use --device cpu to run without a GPU)")
    per_file = 64
    files = make_samples(args.data, args.files, per_file)
    if args.cold:
        os.sync()  # dirty pages cannot be dropped: write the samples out first

    class Samples(Dataset):
        """Batch i: the batch's samples read with pread, decoded to floats; labels from the first byte."""

        def __len__(self) -> int:
            return args.files * per_file

        def __getitem__(self, indices: list[int]) -> dict[str, torch.Tensor]:
            info = get_worker_info()
            started = time.thread_time()
            raw = bytearray()
            for i in indices:
                fd = os.open(files[i // per_file], os.O_RDONLY)
                try:
                    if args.cold:
                        os.posix_fadvise(fd, (i % per_file) * SAMPLE_BYTES, SAMPLE_BYTES, os.POSIX_FADV_DONTNEED)
                    raw += os.pread(fd, SAMPLE_BYTES, (i % per_file) * SAMPLE_BYTES)
                finally:
                    os.close(fd)
            x = torch.frombuffer(raw, dtype=torch.uint8).view(len(indices), SAMPLE_BYTES).float().div_(255.0)
            y = x[:, 0].mul(9.99).long()
            if info is not None and info.id == args.slow_worker:
                while time.thread_time() - started < args.slow_ms / 1e3:  # CPU, as a heavy decode is
                    pass
            return {"x": x, "y": y}

    def hello(worker: int) -> None:
        print(f"train_torch: loader worker {worker}: pid {os.getpid()}", flush=True)

    sampler = BatchSampler(SequentialSampler(range(args.files * per_file)), args.batch, drop_last=True)
    batches_per_epoch = len(sampler)
    loader = DataLoader(Samples(), batch_size=None, sampler=sampler, num_workers=args.workers,
                        pin_memory=args.pin_memory, persistent_workers=True, worker_init_fn=hello)  # fmt: skip

    layers: list[torch.nn.Module] = [torch.nn.Linear(SAMPLE_BYTES, args.hidden), torch.nn.ReLU()]
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU()]
    model = torch.nn.Sequential(*layers, torch.nn.Linear(args.hidden, 10)).to(dev)
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    nvtx = torch.cuda.nvtx if dev.type == "cuda" else None
    slow = f"worker {args.slow_worker} (+{args.slow_ms:g} ms CPU per batch)" if args.slow_worker >= 0 else "none"
    print(f"train_torch: pid {os.getpid()}, {args.steps} steps on {dev} "
          f"({torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'CPU'}), "
          f"{args.workers} loader workers, slow worker: {slow}", flush=True)  # fmt: skip

    step = 0
    started = time.monotonic()
    while step < args.steps:
        for batch in loader:
            if nvtx:
                nvtx.range_push("step")
            x = batch["x"].to(dev, non_blocking=args.pin_memory)
            y = batch["y"].to(dev, non_blocking=args.pin_memory)
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            value = loss.item()  # the host waits for the device here, every step
            if nvtx:
                nvtx.range_pop()
            step += 1
            if step == args.steps:
                break
    wall = time.monotonic() - started
    epochs = args.steps / batches_per_epoch
    print(f"train_torch: {args.steps} steps ({epochs:.1f} epochs) in {wall:.2f} s, "
          f"{1e3 * wall / args.steps:.1f} ms per step, last loss {value:.3f}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
