"""One rank of a torch.distributed gloo job: ``gloo_rank.py CONFIG.json RANK``.

Each step launches a "forward/backward" kernel on a simulated device (gputrace.sim), then all-reduces a CPU
tensor over gloo; the calling thread blocks until every rank's data is in. The late rank (``late_rank``)
first reads a file it dropped from the page cache, on a throttled device: it arrives late to every
all-reduce by its own cold read. The ranks meet through a TCPStore at ``address`` (rank 0's), and gloo
talks over ``ifaces[RANK]`` (a host's name resolves to no address in a namespace of its own). Writes
``RANK.done`` (its pid and the group's communicator id) last.
"""

from __future__ import annotations

import datetime
import json
import os
import sys

from sim_rank import KERNEL_MS, read_uncached

from gputrace.sim import Device


def main() -> None:
    with open(sys.argv[1]) as f:
        cfg = json.load(f)
    rank = int(sys.argv[2])
    late = rank == cfg["late_rank"]
    if late and cfg.get("cgroup"):
        with open(os.path.join(cfg["cgroup"], "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    os.environ["GLOO_SOCKET_IFNAME"] = cfg["ifaces"][rank]
    import torch
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    from gputrace.agent.collectives import communicator_id

    dist.init_process_group("gloo", init_method=f"tcp://{cfg['address']}", rank=rank, world_size=cfg["world"],
                            timeout=datetime.timedelta(seconds=cfg.get("timeout_s", 120)))
    comm = communicator_id(c10d, c10d._get_default_group())
    s = Device(0).stream()
    grads = torch.ones(1 << 16)
    dist.barrier()  # both ranks set up: the first step's wait is not the other's start
    for k in range(cfg["steps"]):
        s.launch(f"fwd_bwd_{k}", KERNEL_MS)
        if late:
            read_uncached(cfg["files"][k % len(cfg["files"])])
        dist.all_reduce(grads)
    s.launch("last", KERNEL_MS)
    s.synchronize()
    dist.destroy_process_group()
    with open(os.path.join(cfg["out"], f"{rank}.done"), "w") as f:
        f.write(f"{os.getpid()} {comm}")


if __name__ == "__main__":
    main()
