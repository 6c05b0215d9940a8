"""Training-loop workloads on the simulated device whose every GPU stall has a cause known by construction.

    python workload.py SCENARIO CONFIG.json

Each GPU step is launched right after the host got what it waited for; just before that launch the
process appends the ground truth for the stall that launch ends to ``config["truth"]`` (one JSON line:
device-owning pid, launch time, cause, culprit object, culprit pid). Kernels are short and the waits long,
so the only GPU gaps are the ones constructed here.
"""

from __future__ import annotations

import json
import mmap
import multiprocessing
import os
import queue
import re
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
import warnings
from collections.abc import Callable
from typing import Any

from gputrace.sim import Device, ProcessGroup

KERNEL_MS = 4.0


def now() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


def spin(ms: float) -> None:
    end = now() + int(ms * 1e6)
    x = 0
    while now() < end:
        x += 1


class Truth:
    def __init__(self, path: str) -> None:
        self.fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)

    def label(self, cause: str, obj: str = "", pid: int = 0, tid: int = 0, own_from_ns: int = 0,
              own_ok: bool = False) -> None:
        """``own_from_ns``: from when what the step waited for was over (a sleep's deadline), so that the rest of
        the stall was this process's own time (harness.labels_for). ``own_ok``: the whole stall may rightly be
        named this process's own time as well (it was on its CPU for a third of it or more)."""
        line: dict[str, Any] = {"pid": os.getpid(), "launch_ns": now(), "cause": cause, "object": obj,
                                "culprit_pid": pid}
        if tid:
            line["culprit_tid"] = tid
        if own_from_ns:
            line["own_from_ns"] = own_from_ns
        if own_ok:
            line["own_ok"] = True
        os.write(self.fd, (json.dumps(line) + "\n").encode())


# ------------------------------------------------------------------------------------ workers ---


class Workers:
    """DataLoader-style worker processes, one pipe each; batch k comes from worker k % n."""

    def __init__(self, n: int, body: Callable[[int, int, int], None], *, on_demand: bool = False) -> None:
        """``on_demand``: a worker starts each batch only when asked (no prefetch)."""
        self.requests: list[int] = []
        self.pipes: list[int] = []
        self.pids: list[int] = []
        self.pending: list[list[dict[str, Any]]] = []
        self.bufs: list[bytes] = []
        for i in range(n):
            r, w = os.pipe()
            req_r, req_w = os.pipe() if on_demand else (-1, -1)
            pid = os.fork()
            if pid == 0:
                os.close(r)
                if on_demand:
                    os.close(req_w)  # else this worker would never see EOF on its own request pipe
                try:
                    body(i, w, req_r)
                finally:
                    os._exit(0)
            os.close(w)
            if on_demand:
                os.close(req_r)
                self.requests.append(req_w)
            self.pipes.append(r)
            self.pids.append(pid)
            self.pending.append([])
            self.bufs.append(b"")
        for i in range(n):  # each worker says it is set up, so setup time is not mistaken for a batch's
            self.get(i, request=False)

    def get(self, k: int, *, request: bool = True) -> dict[str, Any]:
        i = k % len(self.pipes)
        if self.requests and request:
            os.write(self.requests[i], b"1")
        while not self.pending[i]:
            data = os.read(self.pipes[i], 4096)
            if not data:
                raise RuntimeError(f"worker {i} ended early")
            *lines, self.bufs[i] = (self.bufs[i] + data).split(b"\n")
            self.pending[i].extend(json.loads(x) for x in lines if x)
        return self.pending[i].pop(0)

    def join(self) -> None:
        for fd in self.requests:
            os.close(fd)
        for pid in self.pids:
            os.waitpid(pid, 0)


def send(w: int, cause: str, obj: str = "") -> None:
    os.write(w, (json.dumps({"cause": cause, "object": obj, "pid": os.getpid()}) + "\n").encode())


def join_cgroup(path: str) -> None:
    if path:
        with open(os.path.join(path, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))


def read_uncached(path: str) -> int:
    """Read a whole file after dropping it from the page cache, so the read goes to the device."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        n = 0
        while chunk := os.read(fd, 1 << 20):
            n += len(chunk)
        return n
    finally:
        os.close(fd)


def touch_mapped(path: str) -> int:
    """Read a file through a read-only mapping (as np.memmap or Arrow do), after dropping it from the page
    cache: the reads are page faults that wait for the device, with no read() at all."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        m = mmap.mmap(fd, 0, prot=mmap.PROT_READ)
    finally:
        os.close(fd)
    try:
        return sum(m[off] for off in range(0, len(m), mmap.PAGESIZE))
    finally:
        m.close()


def storage_body(cfg: dict[str, Any]) -> Callable[[int, int, int], None]:
    def body(i: int, w: int, req: int) -> None:
        join_cgroup(cfg["cgroups"][i % len(cfg["cgroups"])])
        send(w, "ready")
        for path in cfg["files"][i :: cfg["workers"]]:
            if req >= 0 and not os.read(req, 1):
                return
            (touch_mapped if cfg.get("mapped") else read_uncached)(path)
            send(w, "storage", path)
    return body


def cpu_body(cfg: dict[str, Any]) -> Callable[[int, int, int], None]:
    def body(_i: int, w: int, _req: int) -> None:
        send(w, "ready")
        for _ in range(cfg["steps"]):
            spin(cfg["work_ms"])  # "decode and augment" a sample
            send(w, "cpu")
    return body


# ---------------------------------------------------------------------------------- scenarios ---


def trainer_loop(cfg: dict[str, Any], wait: Callable[[int], tuple[Any, ...]]) -> None:
    """``wait(k)`` returns the truth of step k: (cause, object, culprit pid[, culprit tid])."""
    truth = Truth(cfg["truth"])
    s = Device(0).stream()
    s.launch("warmup", KERNEL_MS)
    for k in range(cfg["steps"]):
        truth.label(*wait(k))
        s.launch(f"train_step_{k}", KERNEL_MS)
    s.synchronize()


def with_workers(cfg: dict[str, Any], body: Callable[[int, int, int], None]) -> None:
    workers = Workers(cfg["workers"], body)

    def wait(k: int) -> tuple[str, str, int]:
        msg = workers.get(k)
        return msg["cause"], msg["object"], msg["pid"]

    trainer_loop(cfg, wait)
    workers.join()


def storage(cfg: dict[str, Any]) -> None:
    with_workers(cfg, storage_body(cfg))


def cpu_worker(cfg: dict[str, Any]) -> None:
    with_workers(cfg, cpu_body(cfg))


def spin_cpu(ms: float) -> None:
    """Use ``ms`` of this thread's CPU time: time spent throttled (off CPU) does not count, as it would not for
    real work."""
    end = time.thread_time_ns() + int(ms * 1e6)
    while time.thread_time_ns() < end:
        pass


def throttled_periods(cgroup: str) -> int:
    with open(os.path.join(cgroup, "cpu.stat")) as f:
        return next(int(line.split()[1]) for line in f if line.startswith("nr_throttled "))


def throttled_body(cfg: dict[str, Any]) -> Callable[[int, int, int], None]:
    """A worker in a cpu cgroup with a small quota: each batch needs more CPU than one period's quota, so the
    batch waits for the next period with the worker runnable and off CPU (throttled)."""

    def body(_i: int, w: int, _req: int) -> None:
        join_cgroup(cfg["cpu_cgroup"])
        # Throttled once before any step: the capture has seen this process in the cgroup and sampled the
        # cgroup's counters by then (every 20 ms; a throttle lasts most of a 100 ms period)
        first = throttled_periods(cfg["cpu_cgroup"])
        while throttled_periods(cfg["cpu_cgroup"]) == first:
            spin_cpu(1)
        send(w, "ready")
        for _ in range(cfg["steps"]):
            spin_cpu(cfg["work_ms"])
            send(w, "cpu.throttled")
    return body


def cpu_throttled(cfg: dict[str, Any]) -> None:
    with_workers(cfg, throttled_body(cfg))


def fuse(cfg: dict[str, Any]) -> None:
    def wait(k: int) -> tuple[str, str, int]:
        path = cfg["files"][k % len(cfg["files"])]
        with open(path, "rb") as f:
            f.read()
        return "storage", path, os.getpid()

    trainer_loop(cfg, wait)


def network(cfg: dict[str, Any]) -> None:
    sock = socket.create_connection(("127.0.0.1", cfg["port"]))
    peer = f"127.0.0.1:{cfg['port']}"

    def wait(_k: int) -> tuple[str, str, int]:
        sock.sendall(b"next\n")
        got = b""
        while not got.endswith(b"\n"):
            got += sock.recv(65536)
        return "network", peer, os.getpid()

    trainer_loop(cfg, wait)
    sock.close()


def asyncio_fetch(cfg: dict[str, Any]) -> None:
    """The batch comes from the slow peer through an asyncio stream: the trainer waits in epoll_wait on the
    event loop, with the loop's own wakeup socketpair registered beside the peer's socket."""
    import asyncio

    loop = asyncio.new_event_loop()
    reader, writer = loop.run_until_complete(asyncio.open_connection("127.0.0.1", cfg["port"]))
    peer = f"127.0.0.1:{cfg['port']}"

    async def fetch() -> bytes:
        writer.write(b"next\n")
        return await reader.readline()

    def wait(_k: int) -> tuple[str, str, int]:
        loop.run_until_complete(fetch())
        return "network", peer, os.getpid()

    trainer_loop(cfg, wait)
    writer.close()
    loop.close()


def gil(cfg: dict[str, Any]) -> None:
    """A thread of the trainer's process runs pure Python nonstop: the trainer's own short step of host work
    first waits for the GIL, a futex that times out every switch interval (5 ms) until the holder is asked
    to let go."""
    hog_tid, stop = [], threading.Event()

    def hog() -> None:
        hog_tid.append(threading.get_native_id())
        x = 0
        while not stop.is_set():
            x += 1

    threading.Thread(target=hog, daemon=True).start()
    while not hog_tid:
        time.sleep(0.001)

    truth = Truth(cfg["truth"])
    s = Device(0).stream()
    for k in range(cfg["steps"]):
        s.launch(f"train_step_{k}", KERNEL_MS)
        s.synchronize()  # the GPU drains; the trainer wakes and needs the GIL back
        t0 = time.thread_time()
        while time.thread_time() - t0 < cfg["work_ms"] / 1e3:  # host work, in this thread's own CPU time
            pass
        truth.label("cpu", "", os.getpid(), hog_tid[0])
    s.launch("last", KERNEL_MS)
    s.synchronize()
    stop.set()


def sleep(cfg: dict[str, Any]) -> None:
    def wait(_k: int) -> tuple[str, str, int, int, int]:
        # the sleep is over at its deadline: a late wakeup (no CPU free) is the trainer's wait for a CPU
        deadline = now() + int(cfg["sleep_ms"] * 1e6)
        time.sleep(cfg["sleep_ms"] / 1e3)
        return "sleep", "", os.getpid(), 0, deadline

    trainer_loop(cfg, wait)


def sync_then_work(cfg: dict[str, Any]) -> None:
    truth = Truth(cfg["truth"])
    s = Device(0).stream()
    for k in range(cfg["steps"]):
        s.launch(f"train_step_{k}", KERNEL_MS * 2)
        s.synchronize()  # the host waits for the GPU, then works while the GPU has nothing queued
        spin(cfg["work_ms"])
        truth.label("cpu", "", os.getpid())
    s.launch("last", KERNEL_MS)
    s.synchronize()


def save_checkpoint(path: str, nbytes: int) -> None:
    """Write a checkpoint as torch.save to a file does (chunks of serialized state), then make it durable."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        for _ in range(nbytes // (64 << 10)):
            os.write(fd, os.urandom(64 << 10))
        os.fsync(fd)
    finally:
        os.close(fd)


def checkpoint(cfg: dict[str, Any]) -> None:
    """Every other step the trainer waits for the device, then saves a checkpoint on a filesystem whose
    writes are throttled (its blkio cgroup) before it launches the next step: the fsync holds the GPU."""
    join_cgroup(cfg["cgroups"][0])
    truth = Truth(cfg["truth"])
    s = Device(0).stream()
    s.launch("warmup", KERNEL_MS)
    for k in range(cfg["steps"]):
        if k % 2:
            s.synchronize()  # the state to save is on the host now
            path = os.path.join(cfg["dir"], f"ckpt-{k:03d}.pt")
            save_checkpoint(path, cfg["ckpt_bytes"])
            truth.label("storage", path, os.getpid())
        s.launch(f"train_step_{k}", KERNEL_MS)
    s.synchronize()


def dirty_writes(cfg: dict[str, Any]) -> None:
    """Every other step the trainer waits for the device, then saves its state to a new file with write() and
    no fsync, on a device allowed few dirty pages and slow to write them back: the kernel pauses the writer
    (balance_dirty_pages) until writeback catches up, and the GPU waits for that write(). Whether a save is
    paused depends on the kernel's estimates: a save is labelled its file's, and the trainer's own time as well
    unless the kernel held it off its CPU for more than two thirds of it (a save not paused is its copying into
    the page cache)."""
    truth = Truth(cfg["truth"])
    s = Device(0).stream()
    chunk = os.urandom(64 << 10)
    s.launch("warmup", KERNEL_MS)
    for k in range(cfg["steps"]):
        if k % 2:
            s.synchronize()
            path = os.path.join(cfg["dir"], f"state-{k:03d}.bin")
            began = now()
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            off_cpu = 0  # the writes' time off this thread's CPU: the kernel's pauses (and any wait for a CPU)
            for _ in range(cfg["save_bytes"] // len(chunk)):
                t0, c0 = now(), time.thread_time_ns()
                os.write(fd, chunk)
                off_cpu += max(0, (now() - t0) - (time.thread_time_ns() - c0))
            os.close(fd)
            # the save is the trainer's calls on the file; its own time too unless they held it off its CPU for
            # more than two thirds of the save
            truth.label("storage", path, os.getpid(), own_ok=3 * off_cpu <= 2 * (now() - began))
        s.launch(f"train_step_{k}", KERNEL_MS)
    s.synchronize()


def contention(cfg: dict[str, Any]) -> None:
    """More busy processes than cores: the trainer shares CPU 0 with three spinning hogs."""
    hogs = []
    for _ in range(3):
        pid = os.fork()
        if pid == 0:
            os.sched_setaffinity(0, {0})
            spin(cfg["hog_ms"])
            os._exit(0)
        hogs.append(pid)
    # The device's stream thread inherits CPU 1 and keeps it; then this thread moves to the hogs' CPU 0.
    # (A stream thread starved by the hogs would delay the completion signal; the report follows that signal
    # to the stream thread, whose wait for a CPU is then the stall's cause.)
    os.sched_setaffinity(0, {1})
    s = Device(0).stream()
    os.sched_setaffinity(0, {0})
    truth = Truth(cfg["truth"])
    for k in range(cfg["steps"]):
        s.launch(f"train_step_{k}", KERNEL_MS)
        spin(cfg["work_ms"])
        s.synchronize()  # woken when the step ends, then waits behind the hogs for CPU 0
        truth.label("cpu.runqueue", "", os.getpid())
    s.launch("last", KERNEL_MS)
    s.synchronize()
    for pid in hogs:
        os.kill(pid, 9)
        os.waitpid(pid, 0)


def collective(cfg: dict[str, Any]) -> None:
    """Two ranks; rank 1 reads a throttled file before every all-reduce and so arrives late. The hosts do
    not synchronize per step (as with NCCL, the collective itself keeps the ranks together)."""
    pid = os.fork()
    if pid == 0:
        _rank(cfg, 1)
        sys.exit(0)  # a normal exit, so the agent hands over its last records
    _rank(cfg, 0)
    os.waitpid(pid, 0)


def _rank(cfg: dict[str, Any], rank: int) -> None:
    truth = Truth(cfg["truth"])
    if rank == 1:
        join_cgroup(cfg["cgroups"][-1])
    group = ProcessGroup(rank, 2, cfg["address"])
    s = Device(0).stream()
    late_pid = int(_exchange_pids(cfg, rank))
    for k in range(cfg["steps"]):
        s.launch(f"fwd_bwd_{k}", KERNEL_MS)
        if rank == 1:
            path = cfg["files"][k % len(cfg["files"])]
            read_uncached(path)
            truth.label("storage", path, os.getpid())
        else:
            truth.label("collective", "all_reduce", late_pid)
        s.all_reduce(group, 1 << 20, duration_ms=1.0)
    s.synchronize()
    group.close()


def _exchange_pids(cfg: dict[str, Any], rank: int) -> int:
    """Rank 0 learns rank 1's pid (the late rank, by construction) through a file."""
    path = cfg["address"] + ".pid"
    if rank == 1:
        with open(path + ".tmp", "w") as f:
            f.write(str(os.getpid()))
        os.rename(path + ".tmp", path)
        return os.getpid()
    while not os.path.exists(path):
        time.sleep(0.005)
    with open(path) as f:
        return int(f.read())


def gloo_collective(cfg: dict[str, Any]) -> None:
    """Two torch.distributed gloo ranks, each with its own simulated device; rank 1 reads a throttled file
    before every all-reduce and so arrives late. Each step launches device work and all-reduces a CPU tensor
    over gloo: the early rank's thread waits in the call (off CPU on gloo's threads and sockets), and its
    device idles meanwhile."""
    pid = os.fork()
    if pid == 0:
        _gloo_rank(cfg, 1)
        sys.exit(0)
    _gloo_rank(cfg, 0)
    os.waitpid(pid, 0)


def _gloo_rank(cfg: dict[str, Any], rank: int) -> None:
    import torch
    import torch.distributed as dist

    truth = Truth(cfg["truth"])
    if rank == 1:
        join_cgroup(cfg["cgroups"][-1])
    dist.init_process_group("gloo", init_method=f"file://{cfg['store']}", rank=rank, world_size=2)
    s = Device(0).stream()
    late_pid = int(_exchange_pids(cfg, rank))
    grads = torch.ones(1 << 16)
    dist.barrier()  # both ranks set up: the first step's wait is not the other's import
    for k in range(cfg["steps"]):
        s.launch(f"fwd_bwd_{k}", KERNEL_MS)
        if rank == 1:
            path = cfg["files"][k % len(cfg["files"])]
            read_uncached(path)
            truth.label("storage", path, os.getpid())
        else:
            truth.label("collective", "all_reduce", late_pid)
        dist.all_reduce(grads)
    s.launch("last", KERNEL_MS)
    s.synchronize()
    dist.destroy_process_group()


def mapped(cfg: dict[str, Any]) -> None:
    """Shards read through memory mappings: by the trainer itself on even steps, by a worker on odd ones."""
    join_cgroup(cfg["cgroups"][0])
    own, theirs = cfg["files"][0::2], cfg["files"][1::2]
    workers = Workers(1, storage_body({**cfg, "workers": 1, "files": theirs, "mapped": True}), on_demand=True)

    def wait(k: int) -> tuple[str, str, int]:
        if k % 2 == 0:
            path = own[k // 2]
            touch_mapped(path)
            return "storage", path, os.getpid()
        msg = workers.get(k // 2)
        return "storage", msg["object"], msg["pid"]

    trainer_loop(cfg, wait)
    workers.join()


def mixed(cfg: dict[str, Any]) -> None:
    """Storage through a worker, a slow peer, a sleep and host work, in turn."""
    workers = Workers(1, storage_body({**cfg, "workers": 1}), on_demand=True)
    sock = socket.create_connection(("127.0.0.1", cfg["port"]))
    peer = f"127.0.0.1:{cfg['port']}"
    kinds = ["storage", "network", "sleep", "cpu"]
    served = 0

    def wait(k: int) -> tuple[str, str, int]:
        nonlocal served
        kind = kinds[k % len(kinds)]
        if kind == "storage":
            msg = workers.get(served)
            served += 1
            return "storage", msg["object"], msg["pid"]
        if kind == "network":
            sock.sendall(b"next\n")
            got = b""
            while not got.endswith(b"\n"):
                got += sock.recv(65536)
            return "network", peer, os.getpid()
        if kind == "sleep":
            time.sleep(cfg["sleep_ms"] / 1e3)
            return "sleep", "", os.getpid()
        spin(cfg["work_ms"])
        return "cpu", "", os.getpid()

    trainer_loop(cfg, wait)
    sock.close()
    workers.join()


def mp_queue(cfg: dict[str, Any]) -> None:
    """A DataLoader-style worker process hands its batches over a multiprocessing.Queue (as PyTorch's
    DataLoader does), reading a throttled shard on request. The queue is fresh: its feeder thread, which
    writes to the queue's pipe and so wakes the trainer, is started by the worker's first put(), inside the
    first stall, after the read that stall waits for."""
    batches = multiprocessing.get_context("fork").Queue()
    ready_r, ready_w = os.pipe()
    req_r, req_w = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.close(ready_r)
            os.close(req_w)
            join_cgroup(cfg["cgroups"][0])
            send(ready_w, "ready")  # over a pipe: the queue's feeder thread must not start before the stalls
            for path in cfg["files"]:
                if not os.read(req_r, 1):
                    break
                read_uncached(path)
                batches.put({"object": path, "pid": os.getpid()})
            batches.close()
            batches.join_thread()
        finally:
            os._exit(0)
    os.close(ready_w)
    os.close(req_r)
    if not os.read(ready_r, 4096):
        raise RuntimeError("the worker ended early")

    def wait(_k: int) -> tuple[str, str, int]:
        os.write(req_w, b"1")
        msg = batches.get(timeout=30)
        return "storage", msg["object"], msg["pid"]

    trainer_loop({**cfg, "steps": min(cfg["steps"], len(cfg["files"]))}, wait)
    os.close(req_w)
    os.waitpid(pid, 0)


def timed_waits(cfg: dict[str, Any]) -> None:
    """Waits that time out before they end: the trainer polls a prefetching thread's queue with
    queue.get(timeout=...) (a futex wait that times out again and again until the thread's read of a
    throttled shard ends), and sleeps in an event loop's select() with only a timeout (asyncio.sleep)."""
    join_cgroup(cfg["cgroups"][0])
    batches: queue.Queue[str] = queue.Queue(maxsize=1)

    def prefetch() -> None:
        for path in cfg["files"]:
            read_uncached(path)
            batches.put(path)

    threading.Thread(target=prefetch, daemon=True).start()
    loop = selectors.DefaultSelector()

    def wait(k: int) -> tuple[str, str, int]:
        if k % 2 == 0:
            while True:
                try:
                    return "storage", batches.get(timeout=0.005), os.getpid()
                except queue.Empty:
                    pass
        loop.select(timeout=cfg["sleep_ms"] / 1e3)
        return "sleep", "", os.getpid()

    trainer_loop(cfg, wait)


def uring(cfg: dict[str, Any]) -> None:
    """The trainer reads each shard itself through io_uring between steps (a C reader in a shared library,
    called through ctypes, as a Rust or C++ reader in an extension is): it waits in io_uring_enter while the
    kernel reads, inline on even steps and in the ring's io-wq worker threads (IOSQE_ASYNC) on odd ones."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))  # tests/: workloads
    from workloads.uring_reader import ASYNC, DROP_CACHE, load

    join_cgroup(cfg["cgroups"][0])
    lib = load(cfg["lib"])
    if lib.gt_uring_open(8) < 0:
        raise RuntimeError("io_uring_setup failed")

    def wait(k: int) -> tuple[str, str, int]:
        path = cfg["files"][k % len(cfg["files"])]
        n = lib.gt_uring_read_file(path.encode(), 64 << 10, 2, DROP_CACHE | (ASYNC if k % 2 else 0))
        if n <= 0:
            raise RuntimeError(f"reading {path} through io_uring: {n}")
        return "storage", path, os.getpid()

    trainer_loop(cfg, wait)
    lib.gt_uring_close()


def pin_memory_thread_on_cpu() -> None:
    """Make PyTorch's DataLoader run its pin-memory thread on the CPU build, as it does on a GPU host: it
    asks the accelerator API whether there is a device (answered yes here) and pins each batch (a copy
    here). The thread, its queues and its hand-over to the trainer are PyTorch's own code."""
    import torch
    from torch.utils.data import _utils

    acc = torch.accelerator
    acc.is_available = lambda: True  # type: ignore[assignment]
    acc.current_accelerator = lambda *a, **k: torch.device("cpu")  # type: ignore[assignment]
    acc.current_device_index = lambda: 0  # type: ignore[assignment]
    acc.set_device_index = lambda _i: None  # type: ignore[assignment]
    _utils.pin_memory.pin_memory = lambda data, device=None: {  # type: ignore[assignment]
        k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in data.items()}


def torch_loader(cfg: dict[str, Any]) -> None:
    """PyTorch's own DataLoader (CPU build) with worker processes: the last worker reads each of its samples
    from a throttled device, the others "decode" theirs on the CPU. Batches come back through the
    DataLoader's one result queue, their tensors through shared memory; the trainer waits in the loader's
    next(), and sets aside the batches that come early (out of order) until the one it needs arrives."""
    import torch
    from torch.utils.data import DataLoader, Dataset, get_worker_info

    workers = cfg.get("workers", 2)
    warnings.filterwarnings("ignore", "This DataLoader will create")  # more workers than the VM's 2 CPUs, on purpose
    slow = workers - 1
    ready = workers  # one "ready" item per worker first, so worker start-up is not mistaken for a batch's wait

    class Samples(Dataset):  # type: ignore[type-arg]
        def __len__(self) -> int:
            return ready + cfg["steps"]

        def __getitem__(self, i: int) -> dict[str, Any]:
            info = get_worker_info()
            assert info is not None and i % info.num_workers == info.id  # the loader's round robin
            if i < ready:
                if info.id == slow and cfg.get("warm_up"):  # spend blk-throttle's first slice before the steps
                    read_uncached(cfg["files"][-1])
                return {"x": torch.zeros(1), "cause": "ready", "object": "", "pid": os.getpid()}
            if info.id != slow:
                spin(cfg["work_ms"])
                return {"x": torch.ones(64), "cause": "cpu", "object": "", "pid": os.getpid()}
            path = cfg["files"][(i - ready) // workers % len(cfg["files"])]
            read_uncached(path)
            return {"x": torch.ones(64), "cause": "storage", "object": path, "pid": os.getpid()}

    def init(worker_id: int) -> None:
        join_cgroup(cfg["cgroups"][-1 if worker_id == slow else 0])

    if cfg.get("pin_memory"):
        pin_memory_thread_on_cpu()
    batches = iter(DataLoader(Samples(), batch_size=None, num_workers=workers, worker_init_fn=init,
                              multiprocessing_context="fork", pin_memory=bool(cfg.get("pin_memory"))))
    for _ in range(ready):
        next(batches)

    def wait(_k: int) -> tuple[str, str, int]:
        b = next(batches)
        return b["cause"], b["object"], b["pid"]

    trainer_loop(cfg, wait)


EXAMPLE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "examples", "train_torch.py")


def train_torch(cfg: dict[str, Any]) -> None:
    """examples/train_torch.py --device sim, run as it is (PyTorch's DataLoader, its worker processes and fd
    sharing of the batches' tensors, the simulated GPU for the step's device work), in ``cfg["cgroups"]``'s
    first group where given. The truth comes from what it prints and its step log (``train_torch_truth``)."""
    join_cgroup(cfg.get("cgroups", [""])[0])
    log = cfg["truth"] + ".steps.json"
    args = ["--device", "sim", "--data", cfg["data"], "--batch", str(cfg["batch"]), "--files", str(cfg["files"]),
            "--steps", str(cfg["steps"]), "--step-log", log, *cfg["args"]]
    out = subprocess.run([sys.executable, EXAMPLE, *args], check=True, capture_output=True, text=True).stdout
    with open(log) as f:
        steps = json.load(f)
    with open(cfg["truth"], "a") as f:
        for label in train_torch_truth(cfg, out, steps["step_end_ns"], steps["batch_ns"]):
            f.write(json.dumps(label) + "\n")


def train_torch_truth(cfg: dict[str, Any], out: str, ends: list[int], got: list[int]) -> list[dict[str, Any]]:
    """One label per step, dated at the end of the step before (its launches come after that): step k's batch
    is the epoch's batch k % batches (``cfg["batch"]`` samples in a row, 64 a sample file), made by worker
    (k % batches) % workers. With ``cfg["cold"]``, the step waited for that batch's sample file; else for the
    slow worker's CPU, or, a fast worker's batch being long ready, for the trainer's own work between steps
    (or a fast worker, where the VM's load held batches up: the trainer also fetches the tensors of batches
    that arrive ahead of their turn). Either may have waited for a CPU rather than run: more busy processes
    than the VM's 2 cores, and other load, are not what the scenario is about. The batch was in the trainer's
    hands from ``got[k]`` on (``own_from_ns``): GPU idle time after that (the step's own launches delayed, or a
    batch that was ready before the trainer asked for it) is the trainer's own, whichever worker made the batch."""
    trainer = int(re.findall(r"train_torch: pid (\d+)", out)[0])
    pids = {int(w): int(p) for w, p in re.findall(r"loader worker (\d+): pid (\d+)", out)}
    workers = len(pids)
    batches = cfg["files"] * 64 // cfg["batch"]
    labels = []
    for k, launch in enumerate([0, *ends[:-1]]):
        batch = k % batches
        if cfg.get("cold"):
            path = os.path.join(cfg["data"], f"shard-{batch * cfg['batch'] // 64:04d}.bin")
            label: dict[str, Any] = {"cause": "storage", "object": path, "culprit_pid": 0}
        elif batch % workers == 1:  # the slow worker is worker 1
            label = {"cause": "cpu", "causes": ["cpu", "cpu.runqueue"], "object": "", "culprit_pid": pids[1]}
        else:  # the trainer's own time, or a fast worker's where the VM's load held batches up
            label = {"cause": "cpu", "causes": ["cpu", "cpu.runqueue"], "object": "", "culprit_pid": trainer,
                     "culprit_pids": [trainer, *(p for w, p in pids.items() if w != 1)]}
        labels.append({"pid": trainer, "launch_ns": launch, "own_from_ns": got[k], **label})
    return labels


SCENARIOS: dict[str, Callable[[dict[str, Any]], None]] = {
    "storage": storage, "fuse": fuse, "cpu_worker": cpu_worker, "contention": contention, "network": network,
    "collective": collective, "gloo_collective": gloo_collective, "sync_then_work": sync_then_work, "sleep": sleep,
    "mixed": mixed,
    "mapped": mapped, "timed_waits": timed_waits, "mp_queue": mp_queue, "asyncio_fetch": asyncio_fetch,
    "gil": gil, "uring": uring, "torch_loader": torch_loader, "torch_loader_pinned": torch_loader,
    "torch_straggler": torch_loader, "torch_straggler_pinned": torch_loader, "checkpoint": checkpoint,
    "dirty_writes": dirty_writes, "cpu_throttled": cpu_throttled, "train_torch_slow": train_torch,
    "train_torch_slow_pinned": train_torch,
    "train_torch_slow_4": train_torch, "train_torch_cold": train_torch,
}  # fmt: skip

if __name__ == "__main__":
    with open(sys.argv[2]) as f:
        config = json.load(f)
    signal.alarm(60)  # a scenario that hangs must fail, not stall the test suite
    if sys.argv[1] != "contention":
        # other load on a shared machine must not turn constructed CPU work into run-queue waits
        os.setpriority(os.PRIO_PROCESS, 0, -10)
    SCENARIOS[sys.argv[1]](config)
