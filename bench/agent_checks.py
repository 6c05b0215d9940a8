#!/usr/bin/env python3
"""What the session's checks of an agent's batches cost, row by row against column by column, in one run.

    .venv/bin/python bench/agent_checks.py [--rows 1000] [--batches 300] [--rounds 5]

An agent's batch (CUDA calls, kernels, copies and syncs, as a training step's launches give them) is decoded
and checked as the agent server does it (``wire.decode_body`` with the session's item bound, then
``validate.batch_records``), and the same batch the way the session did before: the decoder counting every
array it builds (a call per array) and each row checked on its own (``Schema.build``). The two take turns
``--rounds`` times; it prints µs per record of each (CPU time of this process), their ratio, and that both
gave the same records.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from typing import Any

import msgpack

from gputrace.agent import wire
from gputrace.daemon.agents import validate
from gputrace.daemon.agents.pidns import PeerIds
from gputrace.records import CudaApi, GpuKernel, GpuMemcpy, GpuSync

FRAME_ITEMS = 1 << 18  # the agent server's bound (daemon/agents/server.py's Limits.frame_items)


def batch(rows: int) -> bytes:
    """One batch message of ``rows`` records: per step a launch and its kernel, a copy, a sync."""
    pid, tid = os.getpid(), os.getpid() + 1
    api, kernels, copies, syncs = [], [], [], []
    for i in range(rows // 5):
        t = 1_000_000 + 100_000 * i
        api += [list(CudaApi(pid, tid, "cudaLaunchKernel", t, t + 5_000, 2 * i, "runtime", 0)),
                list(CudaApi(pid, tid, "cudaStreamSynchronize", t + 60_000, t + 90_000, 2 * i + 1, "runtime", 0))]
        kernels.append(list(GpuKernel(pid, 0, 1, 7, t + 10_000, t + 50_000, 2 * i, f"gemm_{i % 5}", (64, 1, 1),
                                      (256, 1, 1))))
        copies.append(list(GpuMemcpy(pid, 0, 1, 7, t + 50_000, t + 55_000, 2 * i, 1 << 20, "HtoD", "pinned")))
        syncs.append(list(GpuSync(pid, tid, 0, 1, 7, t + 60_000, t + 90_000, 2 * i + 1, "stream")))
    msg = {"type": "batch", "records": [["CudaApi", api], ["GpuKernel", kernels], ["GpuMemcpy", copies],
                                        ["GpuSync", syncs]]}
    body: bytes = msgpack.packb(msg, use_bin_type=True)
    return body


def checked(body: bytes, ids: PeerIds) -> list[Any]:
    """As the session does it now."""
    return validate.batch_records(wire.decode_body(body, FRAME_ITEMS), ids)


def row_by_row(body: bytes, ids: PeerIds) -> list[Any]:
    """As the session did it before: every array counted as it is built, each row checked alone."""
    msg = wire._decode_bounded(body, FRAME_ITEMS)
    out: list[Any] = []
    for kind, rows in msg["records"]:
        schema = validate.SCHEMAS[kind]
        out.extend(schema.build(row, ids) for row in rows)
    return out


def timed(fn: Any, bodies: list[bytes], ids: PeerIds) -> float:
    """CPU seconds for ``fn`` over every body."""
    c0 = time.process_time()
    for body in bodies:
        fn(body, ids)
    return time.process_time() - c0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", type=int, default=1000, help="records per batch (default 1000)")
    p.add_argument("--batches", type=int, default=300, help="batches per timing (default 300)")
    p.add_argument("--rounds", type=int, default=5, help="turns each way (default 5)")
    args = p.parse_args()
    ids = PeerIds(os.getpid())
    body = batch(args.rows)
    if 2 * len(body) > FRAME_ITEMS:
        raise SystemExit(f"agent_checks: a batch of {args.rows} rows is {len(body)} bytes, over half the item bound: "
                         "both ways would count its arrays; use fewer --rows")
    same = checked(body, ids) == row_by_row(body, ids)
    n = len(checked(body, ids)) * args.batches
    bodies = [body] * args.batches
    now_s, before_s = [], []
    for _ in range(args.rounds):
        before_s.append(timed(row_by_row, bodies, ids))
        now_s.append(timed(checked, bodies, ids))
    before, now = statistics.median(before_s), statistics.median(now_s)
    print(f"# {args.batches} batches of {n // args.batches} records ({len(body):,} bytes each), medians of "
          f"{args.rounds} turns, CPU time")
    print(f"row by row (before)      {before / n * 1e6:6.2f} µs a record  ({n / before:,.0f} records/s)")
    print(f"column by column (now)   {now / n * 1e6:6.2f} µs a record  ({n / now:,.0f} records/s)")
    print(f"now / before: {now / before:.2f}; the same records: {'yes' if same else 'NO'}")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
