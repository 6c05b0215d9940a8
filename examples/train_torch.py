"""A small PyTorch training loop on a real GPU, fed by a DataLoader whose workers read sample files.

Each worker process reads its batch's samples from files with pread, "decodes" the bytes into a float tensor on
the CPU and hands the batch to the trainer, in step order, as PyTorch's DataLoader does. The trainer copies the
batch to the GPU, runs forward, backward and the optimizer, and reads the loss back every step (a host wait for
the device, as a logging loop does). With --slow-worker N, worker N spends extra CPU time on every batch it
prepares, so the GPU idles while the trainer waits for that worker: the stall gputrace should pin on it.
With --cold, every sample is read from the device (dropped from the page cache first): storage stalls.

    sudo gputrace capture -o real.gputrace -- python examples/train_torch.py --slow-worker 1
    gputrace report real.gputrace

Needs PyTorch; --device cpu runs the same loop without a GPU (no GPU activity to trace then). --device sim
runs it with gputrace's simulated GPU standing in for CUDA: the same DataLoader, worker processes and tensor
hand-over (file-descriptor sharing, PyTorch's default on Linux), with every copy, kernel and loss read-back of a
step done on a simulated stream (an H2D copy of the batch's bytes, forward, backward and optimizer kernels of
fixed durations, a stream synchronize for loss.item()); its default sizes are small, so it runs in seconds on
a small VM. A worker's "slow worker: pid P" line names the slow worker's process.

    sudo gputrace capture -o sim.gputrace -- python examples/train_torch.py --device sim --slow-worker 1

--step-log PATH writes {"step_end_ns": [...], "batch_ns": [...], "steps": N}: time.monotonic_ns() at the end of
every step (after the loss read-back), for step-time benchmarks, and when the loader handed each step its batch
(what the step waited for until then, and what it did with the batch after).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

SAMPLE_BYTES = 64 << 10  # one sample: 64 KiB of bytes, 65,536 features
PER_FILE = 64  # samples in a sample file
# --device sim: the step's device work, and what the simulated copy engine moves per millisecond
SIM_KERNELS_MS = (("forward", 3.0), ("backward", 5.0), ("optimizer_step", 1.0), ("loss", 0.2))
SIM_COPY_BYTES_PER_MS = {"pageable": 12 << 20, "pinned": 24 << 20}  # 12 and 24 GiB/s
DEFAULTS = {"steps": 100, "batch": 64, "hidden": 4096, "layers": 6, "files": 16}
SIM_DEFAULTS = {"steps": 40, "batch": 16, "hidden": 64, "layers": 1, "files": 4}  # a cheap host side of a step


def make_samples(data: Path, count: int, per_file: int) -> list[Path]:
    """Sample files shard-0000.bin ...; existing ones of the right size are kept."""
    data.mkdir(parents=True, exist_ok=True)
    paths = [data / f"shard-{i:04d}.bin" for i in range(count)]
    for p in paths:
        if not p.exists() or p.stat().st_size != SAMPLE_BYTES * per_file:
            p.write_bytes(os.urandom(SAMPLE_BYTES * per_file))
    return paths


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, help="training steps (default: 100; sim: 40)")
    p.add_argument("--batch", type=int, help="samples per batch (default: 64; sim: 16)")
    p.add_argument("--hidden", type=int, help="hidden width of the MLP (default: 4096; sim: 64)")
    p.add_argument("--layers", type=int, help="hidden layers (default: 6; sim: 1)")
    p.add_argument("--workers", type=int, default=2, help="DataLoader worker processes (default: 2)")
    p.add_argument("--slow-worker", type=int, default=-1, metavar="N",
                   help="worker N spends --slow-ms of extra CPU on every batch (default: none)")  # fmt: skip
    p.add_argument("--slow-ms", type=float, default=60.0, help="the slow worker's extra time per batch (default: 60)")
    p.add_argument("--files", type=int, help="sample files of 64 samples each (default: 16; sim: 4)")
    p.add_argument("--data", type=Path, default=Path(tempfile.gettempdir()) / f"gputrace-train-torch-{os.getuid()}",
                   help="folder of the sample files (made if missing)")  # fmt: skip
    p.add_argument("--cold", action="store_true", help="drop each sample from the page cache before reading it")
    p.add_argument("--pin-memory", action="store_true", help="DataLoader pin_memory=True, non-blocking copies")
    p.add_argument("--device", default="cuda",
                   help="torch device, or sim: gputrace's simulated GPU does the step's device work (default: cuda)")
    p.add_argument("--compile", action="store_true",
                   help='run the model through torch.compile(mode="reduce-overhead"): CUDA graphs (cuda only)')
    p.add_argument("--step-log", type=Path, metavar="PATH",
                   help='write {"step_end_ns": [...], "batch_ns": [...], "steps": N} there: time.monotonic_ns() at '
                        'the end of each step, and when the loader handed each step its batch')
    args = p.parse_args()
    for key, value in (SIM_DEFAULTS if args.device == "sim" else DEFAULTS).items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.compile and args.device in ("sim", "cpu"):
        p.error("--compile needs a CUDA device (its CUDA graphs are what it is there for)")
    if args.workers < 1 or not -1 <= args.slow_worker < args.workers:
        p.error("--slow-worker must name one of the --workers (0 .. workers-1)")
    return args


def main() -> int:
    args = parse_args()

    import torch

    sim = args.device == "sim"
    dev = torch.device("cpu" if sim else args.device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        sys.exit("train_torch: torch sees no CUDA device (use --device cpu or sim to run without a GPU)")
    files = make_samples(args.data, args.files, PER_FILE)
    if args.cold:
        drop_cached(files)
    if sim and args.pin_memory and not torch.cuda.is_available():
        pin_memory_thread_on_cpu()
    loader = make_loader(args, files)
    step = SimStep(args) if sim else TorchStep(args, dev)
    slow = f"worker {args.slow_worker} (+{args.slow_ms:g} ms CPU per batch)" if args.slow_worker >= 0 else "none"
    print(f"train_torch: pid {os.getpid()}, {args.steps} steps on {step.where}, "
          f"{args.workers} loader workers, slow worker: {slow}", flush=True)  # fmt: skip

    ends: list[int] = []
    got: list[int] = []  # when the loader handed each step its batch
    value = 0.0
    started = time.monotonic()
    while len(ends) < args.steps:
        for batch in loader:
            got.append(time.monotonic_ns())
            value = step(batch)
            ends.append(time.monotonic_ns())  # the loss is on the host: the step is over
            if len(ends) == args.steps:
                break
    wall = time.monotonic() - started
    if args.step_log:
        args.step_log.write_text(json.dumps({"step_end_ns": ends, "batch_ns": got, "steps": len(ends)}))
    epochs = args.steps / (args.files * PER_FILE // args.batch)
    print(f"train_torch: {args.steps} steps ({epochs:.1f} epochs) in {wall:.2f} s, "
          f"{1e3 * wall / args.steps:.1f} ms per step, last loss {value:.3f}", flush=True)  # fmt: skip
    return 0


def make_loader(args: argparse.Namespace, files: list[Path]) -> Any:
    """PyTorch's DataLoader over the sample files: batch i (``args.batch`` samples in a row) is made by worker
    i % workers, which reads each sample with pread, decodes the bytes to floats and hands the tensors to the
    trainer through shared memory (their file descriptors, sent by the worker's resource-sharer thread)."""
    import torch
    from torch.utils.data import BatchSampler, DataLoader, Dataset, SequentialSampler, get_worker_info

    class Samples(Dataset):  # type: ignore[type-arg]
        """Batch i: the batch's samples read with pread, decoded to floats; labels from the first byte."""

        def __len__(self) -> int:
            return args.files * PER_FILE

        def __getitem__(self, indices: list[int]) -> dict[str, torch.Tensor]:
            info = get_worker_info()
            started = time.thread_time()
            raw = bytearray()
            for i in indices:
                raw += read_sample(files[i // PER_FILE], i % PER_FILE, args.cold)
            x = torch.frombuffer(raw, dtype=torch.uint8).view(len(indices), SAMPLE_BYTES).float().div_(255.0)
            y = x[:, 0].mul(9.99).long()
            if info is not None and info.id == args.slow_worker:
                # CPU, as a heavy decode is; the clock read (a system call on some VMs) every ~0.1 ms of it
                while time.thread_time() - started < args.slow_ms / 1e3:
                    sum(range(5000))
            return {"x": x, "y": y}

    def hello(worker: int) -> None:
        print(f"train_torch: loader worker {worker}: pid {os.getpid()}", flush=True)
        if worker == args.slow_worker:
            print(f"train_torch: slow worker: pid {os.getpid()}", flush=True)

    sampler = BatchSampler(SequentialSampler(range(args.files * PER_FILE)), args.batch, drop_last=True)
    return DataLoader(Samples(), batch_size=None, sampler=sampler, num_workers=args.workers,
                      pin_memory=args.pin_memory, persistent_workers=True, worker_init_fn=hello)  # fmt: skip


def drop_cached(files: list[Path]) -> None:
    """Write the sample files out (dirty pages cannot be dropped) and drop them from the page cache whole: pages
    written in one go may sit in large folios, which dropping one sample's range would leave in place."""
    os.sync()
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def read_sample(path: Path, index: int, cold: bool) -> bytes:
    """Sample ``index`` of a sample file. When ``cold``, it is dropped from the page cache first and read
    without readahead (which would bring in the next samples too): every sample is read from the device."""
    fd = os.open(path, os.O_RDONLY)
    try:
        if cold:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            os.posix_fadvise(fd, index * SAMPLE_BYTES, SAMPLE_BYTES, os.POSIX_FADV_DONTNEED)
        return os.pread(fd, SAMPLE_BYTES, index * SAMPLE_BYTES)
    finally:
        os.close(fd)


def mlp(args: argparse.Namespace, features: int) -> Any:
    import torch

    layers: list[torch.nn.Module] = [torch.nn.Linear(features, args.hidden), torch.nn.ReLU()]
    for _ in range(args.layers):
        layers += [torch.nn.Linear(args.hidden, args.hidden), torch.nn.ReLU()]
    return torch.nn.Sequential(*layers, torch.nn.Linear(args.hidden, 10))


class TorchStep:
    """One training step in PyTorch on ``dev``: copy the batch there, forward, backward, optimizer, and read
    the loss back (a host wait for the device, as a logging loop does)."""

    def __init__(self, args: argparse.Namespace, dev: Any) -> None:
        import torch

        self.dev, self.non_blocking = dev, args.pin_memory
        model = mlp(args, SAMPLE_BYTES).to(dev)
        self.opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        self.model = torch.compile(model, mode="reduce-overhead") if args.compile else model
        self.nvtx = torch.cuda.nvtx if dev.type == "cuda" else None
        self.where = f"{dev} ({torch.cuda.get_device_name(dev) if dev.type == 'cuda' else 'CPU'})"

    def __call__(self, batch: dict[str, Any]) -> float:
        import torch

        if self.nvtx:
            self.nvtx.range_push("step")
        x = batch["x"].to(self.dev, non_blocking=self.non_blocking)
        y = batch["y"].to(self.dev, non_blocking=self.non_blocking)
        loss = torch.nn.functional.cross_entropy(self.model(x), y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        value = float(loss.item())  # the host waits for the device here, every step
        if self.nvtx:
            self.nvtx.range_pop()
        return value


class SimStep:
    """One training step with gputrace's simulated GPU doing the device work: an H2D copy of the batch's bytes
    (pinned with --pin-memory), forward, backward, optimizer and loss kernels of fixed durations, and a stream
    synchronize standing for loss.item(). While the device runs, the host computes a small real loss on the
    CPU (an MLP over the first SIM_FEATURES features): the step's host work, cheap next to the kernels."""

    SIM_FEATURES = 256

    def __init__(self, args: argparse.Namespace) -> None:
        import torch

        from gputrace.sim import Device

        # the host's loss is tiny: intra-op threads would only take the CPUs the workers need
        torch.set_num_threads(1)
        self.memory = "pinned" if args.pin_memory else "pageable"
        self.stream = Device(0).stream()
        self.model = mlp(args, self.SIM_FEATURES)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=1e-3)
        self.where = "sim (gputrace simulated GPU)"

    def __call__(self, batch: dict[str, Any]) -> float:
        import torch

        nbytes = sum(t.nbytes for t in batch.values())
        self.stream.memcpy(nbytes, nbytes / SIM_COPY_BYTES_PER_MS[self.memory], "h2d", memory=self.memory)
        for name, ms in SIM_KERNELS_MS:
            self.stream.launch(name, ms)
        loss = torch.nn.functional.cross_entropy(self.model(batch["x"][:, : self.SIM_FEATURES]), batch["y"])
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        self.stream.synchronize()  # loss.item(): the host waits for the device, every step
        return float(loss.item())


def pin_memory_thread_on_cpu() -> None:
    """Without CUDA, PyTorch's DataLoader would drop pin_memory=True (nothing to pin for). The simulated GPU
    stands in for CUDA, so the loader runs its pin-memory thread as on a GPU host: it is told there is an
    accelerator, and "pins" each batch by copying it. The thread, its queues and its hand-over to the trainer
    are PyTorch's own."""
    import torch
    from torch.utils.data import _utils

    acc = torch.accelerator
    acc.is_available = lambda: True  # type: ignore[assignment]
    acc.current_accelerator = lambda *a, **k: torch.device("cpu")  # type: ignore[assignment]
    acc.current_device_index = lambda: 0  # type: ignore[assignment]
    acc.set_device_index = lambda _i: None  # type: ignore[assignment]

    def pin(data: Any, device: Any = None) -> Any:  # a batch; the loader's own markers (None) pass through
        if not isinstance(data, dict):
            return data
        return {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in data.items()}

    _utils.pin_memory.pin_memory = pin


if __name__ == "__main__":
    sys.exit(main())
