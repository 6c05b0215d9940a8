"""Collective identity from torch.distributed (gputrace/agent/collectives.py): what the wrapper records in a
real gloo process group, what the session accepts of it, and how the analysis uses a call that only
enqueued device work (NCCL's). The whole path, eBPF and two ranks included: the gloo_collective scenario
(tests/scenarios)."""

from __future__ import annotations

import json
import lzma
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gputrace.agent.wire import FrameError
from gputrace.analysis.load import Capture, _call, _Loader, link_device_calls
from gputrace.capture import CaptureReader
from gputrace.daemon.agents.pidns import PeerIds
from gputrace.daemon.agents.validate import batch_records
from gputrace.records import CollectiveCall, CudaApi, GpuKernel, NvtxRange

# One process, world size 1, a FileStore: the wrapper armed as the agent arms it, records printed as JSON
_ONE_RANK = r"""
import json, sys
from gputrace.agent import collectives
collectives.install()  # before torch.distributed is imported: wrapped when it is
import torch, torch.distributed as dist
rows = []
collectives.BACKEND.start(rows.extend)
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
assert dist.all_reduce is dist.distributed_c10d.all_reduce and dist.all_reduce.__gputrace_wrapped__
t = torch.ones(1000)
dist.all_reduce(t)
dist.broadcast(t, src=0)
dist.all_gather_into_tensor(torch.zeros(1000), t)
dist.barrier()
w = dist.all_reduce(torch.ones(8), async_op=True)
w.wait()
sub = dist.new_group([0])
dist.all_reduce(t, group=sub)
w.get_future().wait()
collectives.BACKEND.stop()
dist.all_reduce(t)  # no session: not recorded
print(json.dumps([list(r) for r in rows]))
"""


def _one_rank(tmp_path: Path) -> list[CollectiveCall]:
    out = subprocess.run([sys.executable, "-c", _ONE_RANK, str(tmp_path / "store")], capture_output=True, text=True,
                         timeout=120, check=False)
    assert out.returncode == 0, out.stderr[-2000:]
    return [CollectiveCall(*r) for r in json.loads(out.stdout.strip().splitlines()[-1])]


@pytest.mark.kernel  # PyTorch
def test_the_wrapper_records_each_collective_with_its_identity(tmp_path: Path) -> None:
    calls = _one_rank(tmp_path)
    assert [c.name for c in calls] == ["all_reduce", "broadcast", "all_gather_into_tensor", "barrier", "all_reduce",
                                       "all_reduce"]
    world, sub = calls[:5], calls[5]
    # PyTorch's own sequence numbers of the group, one communicator id for it, another for the subgroup
    assert [c.seq for c in world] == [1, 2, 3, 4, 5] and sub.seq == 1
    assert len({c.comm for c in world}) == 1 and sub.comm != world[0].comm and len(sub.comm) == 16
    assert [c.nbytes for c in calls] == [4000, 4000, 4000, 0, 32, 4000]
    assert all((c.rank, c.world, c.backend, c.pid) == (0, 1, "gloo", calls[0].pid) for c in calls)
    assert all(0 < c.start_ns <= c.end_ns for c in calls)
    # the calling thread blocked in every synchronous call; the async one completed on gloo's thread, later
    assert [c.waited for c in calls] == [True, True, True, True, False, True]


def _row(**kw: object) -> list[object]:
    base = CollectiveCall(os.getpid(), os.getpid(), "all_reduce", "ab12", 3, 0, 2, 4096, "gloo", 10, 20, True)
    return list(base._replace(**kw))


def test_the_session_checks_every_field_of_a_call() -> None:
    ids = PeerIds(os.getpid())
    got = batch_records({"records": [["CollectiveCall", [_row()]]]}, ids)
    assert got == [CollectiveCall(*_row())]
    bad = [_row(waited=1), _row(start_ns=30), _row(pid=os.getpid() + 1), _row(seq="3"), _row(comm=None)]
    for row in [*bad, _row()[:-1]]:
        with pytest.raises(FrameError):
            batch_records({"records": [["CollectiveCall", [row]]]}, ids)


def test_the_analysis_skips_a_call_with_impossible_values() -> None:
    ld = _Loader({})
    for r in (CollectiveCall(*_row(seq=-1)), CollectiveCall(*_row(name="x" * 100)),
              CollectiveCall(*_row(start_ns=0, end_ns=0)), CollectiveCall(*_row()), CollectiveCall(*_row(waited=0))):
        _call(ld, r)
    assert len(ld.cap.calls) == 1 and ld.cap.malformed == 4


def test_an_nccl_call_names_the_kernel_it_launched() -> None:
    """NCCL's call only enqueues: the collective kernel launched on its thread inside the call gets the call's
    identity (a Collective record), the kernel launched outside it does not."""
    pid, tid = 100, 101
    cap = Capture(header={})
    kernels = [GpuKernel(pid, 0, 1, 7, 500, 900, 11, "ncclDevKernel_AllReduce_Sum_f32_RING_LL", (1, 1, 1), (1, 1, 1)),
               GpuKernel(pid, 0, 1, 7, 950, 990, 12, "ncclDevKernel_AllReduce_Sum_f32_RING_LL", (1, 1, 1), (1, 1, 1)),
               GpuKernel(pid, 0, 1, 7, 400, 450, 10, "gemm", (1, 1, 1), (1, 1, 1))]
    cap.ops[(pid, 0)] = kernels
    for cid, start in ((10, 90), (11, 120), (12, 300)):
        cap.launches[(pid, cid)] = CudaApi(pid, tid, "cudaLaunchKernel", start, start + 5, cid, "runtime", 0)
    cap.calls = [CollectiveCall(pid, tid, "all_reduce", "c0ffee", 17, 1, 8, 1 << 20, "nccl", 100, 150, False),
                 CollectiveCall(pid, tid + 1, "all_reduce", "c0ffee", 18, 1, 8, 1 << 20, "nccl", 290, 310, False)]
    link_device_calls(cap)
    assert list(cap.collectives) == [(pid, 11)]
    meta = cap.collectives[(pid, 11)]
    assert (meta.comm, meta.seq, meta.name, meta.rank, meta.world, meta.nbytes) == ("c0ffee", 17, "all_reduce", 1, 8,
                                                                                     1 << 20)


# A running single-rank gloo job, unarmed: 50 all-reduces before it says it is up, then one every 5 ms
_RUNNING = r"""
import os, sys, time
import torch, torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
dist.init_process_group("gloo", init_method="file://" + sys.argv[1], rank=0, world_size=1)
t = torch.ones(256)
for _ in range(50):
    dist.all_reduce(t)
from gputrace.agent.collectives import communicator_id
print("up", os.getpid(), communicator_id(c10d, c10d._get_default_group()), flush=True)
while True:
    dist.all_reduce(t)
    time.sleep(0.005)
"""


@pytest.mark.kernel  # PyTorch, ptrace and a capture, as root
def test_an_agent_injected_into_a_running_job_wraps_its_collectives(tmp_path: Path) -> None:
    """``capture -p``: the agent arms in a process that imported torch.distributed long before, wraps its
    collectives then, and numbers them as the group does (PyTorch's count, not one from the attach)."""
    root = Path(__file__).resolve().parents[1]
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUTRACE")}
    env["PYTHONPATH"] = str(root)
    p = subprocess.Popen([sys.executable, "-c", _RUNNING, str(tmp_path / "store")], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert p.stdout is not None
        up = p.stdout.readline().split()
        assert up[:1] == ["up"], p.stderr.read() if p.stderr else ""
        out = tmp_path / "attached.gputrace"
        done = subprocess.run([sys.executable, "-m", "gputrace", "capture", "-p", str(p.pid), "-o", str(out), "-d",
                               "2", "--no-perfetto"], capture_output=True, text=True, timeout=180, cwd=root)
        assert done.returncode == 0 and f"GPU agent of pid {p.pid}: injected" in done.stderr, done.stderr
    finally:
        p.kill()
        p.wait(timeout=10)
    from gputrace.capture import CaptureReader

    with CaptureReader(out) as reader:
        calls = [r for r in reader.records() if isinstance(r, CollectiveCall)]
    assert len(calls) > 10, calls
    assert {(c.pid, c.comm, c.name, c.backend, c.waited) for c in calls} == {(p.pid, up[2], "all_reduce", "gloo", True)}
    seqs = [c.seq for c in calls]
    assert seqs[0] > 50 and seqs == list(range(seqs[0], seqs[0] + len(seqs))), seqs


def test_a_real_nccl_communicator_on_an_h100_gives_every_call_with_nccls_own_range(tmp_path: Path) -> None:
    """A capture recorded on an H100 (tests/data/collectives/README.md): `gputrace capture --` around a one-rank
    NCCL process group calling all_reduce and broadcast 12 times each, 4 KiB to 8 MiB. The report holds every
    call in order, and each lies around the NVTX range NCCL itself opened for it (CUPTI's record, a source
    independent of the wrapper)."""
    cap = tmp_path / "nccl.gputrace"
    cap.write_bytes(lzma.decompress((Path(__file__).parent / "data/collectives/h100-nccl-one-rank.gputrace.xz")
                                    .read_bytes()))  # fmt: skip
    out = subprocess.run([sys.executable, "-m", "gputrace", "report", "--json", str(cap)], capture_output=True,
                         text=True, timeout=300, cwd=tmp_path)  # fmt: skip
    assert out.returncode == 0, out.stderr
    calls = json.loads(out.stdout)["collectives"]
    assert [c["seq"] for c in calls] == list(range(1, 25))
    assert [c["op"] for c in calls] == ["all_reduce", "broadcast"] * 12
    assert [c["bytes"] for c in calls] == [4 << (i // 2 + 10) for i in range(24)]
    assert {(c["backend"], c["rank"], c["world"], c["comm"]) for c in calls} == {("nccl", 0, 1, calls[0]["comm"])}
    with CaptureReader(cap) as reader:
        ranges = [r for r in reader.records() if type(r) is NvtxRange and r.domain == "NCCL"]
    name = {"all_reduce": "ncclAllReduce", "broadcast": "ncclBroadcast"}
    for c in calls:
        assert c["started_ns"] <= c["completed_ns"], c
        inside = [r.name for r in ranges if c["started_ns"] <= r.start_ns and r.end_ns <= c["completed_ns"]]
        assert inside == [name[c["op"]]], (c, inside)
