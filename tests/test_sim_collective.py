"""A simulated all-reduce across real processes: a late rank shows up as long collectives on the others."""

from __future__ import annotations

from pathlib import Path

from agent_harness import Harness, of

RANK = """
import sys, time
from gputrace.sim import Device, ProcessGroup
rank, world, address, late_ms = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], float(sys.argv[4])
pg = ProcessGroup(rank, world, address)
s = Device(0).stream()
s.all_reduce(pg, 8, duration_ms=1)   # a barrier: ranks start at different times
s.synchronize()
for step in range(2):
    s.launch("backward", duration_ms=5)
    if step == 1 and late_ms:
        time.sleep(late_ms / 1000)   # this rank's host is late to the second all-reduce of the loop
    s.all_reduce(pg, 1 << 20, duration_ms=4)
    s.synchronize()
pg.close()
print("rank", rank, "done")
"""

LATE_MS = 150


def test_late_rank_holds_the_others_collective(tmp_path: Path) -> None:
    h = Harness(tmp_path)
    address = str(tmp_path / "pg.sock")
    world = 3
    procs = [h.spawn(RANK, str(r), str(world), address, str(LATE_MS if r == 2 else 0)) for r in range(world)]
    for p in procs:
        assert p.wait(30) == 0, p.stderr.read()  # type: ignore[union-attr]
    recs = h.finish()

    colls = [c for c in of(recs, "Collective") if c.seq > 1]  # after the barrier
    assert len(colls) == 2 * world
    assert {(c.rank, c.world, c.seq, c.nbytes, c.name) for c in colls} == {
        (r, world, seq, 1 << 20, "all_reduce") for r in range(world) for seq in (2, 3)
    }
    kernels = {(k.pid, k.correlation_id): k for k in of(recs, "GpuKernel")}
    dur_ms: dict[tuple[int, int], float] = {}
    for c in colls:
        k = kernels[(c.pid, c.correlation_id)]  # each Collective names its own rank's kernel
        assert "AllReduce" in k.name
        dur_ms[(c.rank, c.seq)] = (k.end_ns - k.start_ns) / 1e6
    late_pid = procs[2].pid
    assert {c.pid for c in colls if c.rank == 2} == {late_pid}
    for r in (0, 1):
        # Waited for rank 2's lateness (less the 5 ms backward they ran meanwhile), then the 4 ms transfer.
        assert LATE_MS * 0.9 <= dur_ms[(r, 3)] <= LATE_MS + 40, dur_ms
    assert dur_ms[(2, 3)] < 25, dur_ms  # the late rank itself finds everyone waiting
    for r in range(world):
        assert dur_ms[(r, 2)] < 40, dur_ms  # on time: about the transfer, plus scheduling jitter
