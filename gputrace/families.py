"""The source families a capture can turn off (``gputrace capture --off``), what each costs, what it buys."""

from __future__ import annotations

from collections.abc import Iterable
from typing import NamedTuple

from gputrace.errors import UserError


class Family(NamedTuple):
    what: str  # what it records
    cost: str  # who pays, and what
    lost: str  # what attribution loses without it


FAMILIES: dict[str, Family] = {
    "syscalls": Family("system calls of the traced processes (raw sys_enter/sys_exit)",
                       "every system call on the host runs the two programs: ~0.1-0.3 us each, traced or not",
                       "no stall is tied to a read(), recv(), poll or CUDA sync; waits show only as off-CPU time"),
    "sched": Family("context switches and wakeups (sched_switch, sched_waking, interrupt entry/exit)",
                    "every context switch and interrupt on the host: ~0.2-0.7 us each",
                    "no off-CPU time, no run-queue waits, no wait chains: waits for workers are unknown"),
    "block": Family("block I/O requests (block_io_start, block_rq_complete)",
                    "each block request on the host: well under 1 us",
                    "storage stalls name the file but not the device, its requests or their latency"),
    "faults": Family("waits in page faults on file mappings (mm_filemap_fault)",
                     "each page-cache fault on the host: ~0.1-0.9 us",
                     "a stall waiting in a fault on a mapped file (np.memmap, safetensors) is unknown"),
    "uring": Family("io_uring requests (io_uring_submit_req, file_get, complete)",
                    "each io_uring request on the host",
                    "a wait in io_uring_enter is not tied to its requests' files"),
    "dirty": Family("writers paused for dirty pages (writeback:balance_dirty_pages)",
                    "each such pause on the host (rare)",
                    "a slow write() is storage without the dirty-page pause that made it slow"),
    "sampler": Family("CPU stack samples of the traced processes (perf events, 499 Hz by default)",
                      "a program run per sample of a traced thread on CPU",
                      "cpu stalls name the process but not its hottest frames"),
    "agent": Family("the in-process GPU agent (CUPTI activity; the simulated device's records)",
                    "the target's own CPU: CUPTI and the conversion of its records (a PyTorch step on an H100: "
                    "+0.4 % with cupti-python 13.4, +31 % with 13.0)",
                    "no device timing: no kernels, copies or syncs, so no stalls at all"),
    "cgroups": Family("the traced processes' cpu cgroups and their CPU-quota throttling (cpu.stat, every 20 ms)",
                      "the session's CPU only: a few file reads per traced process and sample",
                      "a thread throttled by its container's CPU limit is cpu.runqueue, not cpu.throttled"),
    "nvml": Family("NVML counters (utilization, clocks, memory, power, PCIe)", "the session's CPU only",
                   "no NVML utilization beside the measured busy share"),
    "uprobes": Family("libcuda uprobes for processes without an agent (capture -p only)",
                      "each CUDA launch, copy and sync of such a process: several us",
                      "a process without an agent has no host-side CUDA timing"),
}

EBPF_FAMILIES = ("syscalls", "sched", "block", "faults", "uring", "dirty")


def parse_off(values: Iterable[str]) -> frozenset[str]:
    """``--off`` values (each a name or a comma-separated list) as a set; an unknown name is a user error."""
    names = {n.strip() for v in values for n in v.split(",") if n.strip()}
    unknown = sorted(names - FAMILIES.keys())
    if unknown:
        raise UserError(f"unknown source family {', '.join(unknown)} for --off (one of: {', '.join(FAMILIES)})")
    return frozenset(names)


def help_text() -> str:
    """One line per family for --help: what it records, what it costs, what is lost without it."""
    return "\n".join(f"  {name:9s} {f.what}; costs {f.cost}; without it: {f.lost}" for name, f in FAMILIES.items())
