#!/usr/bin/env python3
"""Cost of converting CUPTI activity records to gputrace records (what the agent spends per record, on
CUPTI's buffer thread, holding the GIL). Uses cupti-python's own record classes, filled through their numpy
dtypes, where cupti-python is installed (no GPU needed); else objects of the same shape.

    .venv/bin/python bench/cupti_convert.py [--records 20000]
"""

from __future__ import annotations

import argparse
import ctypes
import importlib.util
import sys
import time
from pathlib import Path
from typing import Any

from gputrace.clock import RealtimeConverter, monotonic_ns
from gputrace.probes.cupti_convert import ActivityConverter

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
import cupti_shapes as shapes  # noqa: E402

_KEEP: list[Any] = []


def real_records(n: int, t0: int) -> dict[str, list[Any]]:
    import numpy as np
    from cupti import cupti

    name = ctypes.create_string_buffer(b"void at::native::vectorized_elementwise_kernel<4>")
    _KEEP.append(name)  # the records point at it
    k = np.zeros(n, dtype=cupti.activity_kernel10_dtype)
    k["kind"], k["start"], k["correlation_id"] = 10, t0 + np.arange(n) * 1000, np.arange(n)
    k["name"] = ctypes.addressof(name)
    k["end"] = k["start"] + 500
    a = np.zeros(n, dtype=cupti.activity_api_dtype)
    a["kind"], a["cbid"], a["start"] = 5, 211, t0 + np.arange(n) * 1000
    a["end"] = a["start"] + 300
    return {"kernel": [cupti.ActivityKernel10.from_data(k[i : i + 1]) for i in range(n)],
            "runtime api": [cupti.ActivityAPI.from_data(a[i : i + 1]) for i in range(n)]}  # fmt: skip


def shaped_records(n: int, t0: int) -> dict[str, list[Any]]:
    return {"kernel": [shapes.kernel(t0 + i * 1000, t0 + i * 1000 + 500, i) for i in range(n)],
            "runtime api": [shapes.api(t0 + i * 1000, t0 + i * 1000 + 300, i, 211) for i in range(n)]}  # fmt: skip


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", type=int, default=20_000)
    args = p.parse_args()
    clock = RealtimeConverter(3600)
    t0 = clock.to_realtime(monotonic_ns())
    real = importlib.util.find_spec("cupti") is not None
    batches = real_records(args.records, t0) if real else shaped_records(args.records, t0)
    conv = ActivityConverter(1, clock.to_monotonic, lambda d, c: "cudaLaunchKernel_v7000")
    print(f"records: {'cupti-python ' if real else 'shaped like cupti-python '}objects, {args.records:,} per kind")
    for label, batch in batches.items():
        t = time.perf_counter()
        out = conv.convert(batch)
        dt = time.perf_counter() - t
        print(f"  {label:12s} {dt / len(out) * 1e9:7.0f} ns/record")
    return 0


if __name__ == "__main__":
    sys.exit(main())
