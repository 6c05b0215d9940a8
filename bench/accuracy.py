"""Attribution accuracy on the ground-truth scenarios (tests/scenarios), as a table.

    sudo .venv/bin/python bench/accuracy.py [SCENARIO ...]

Each scenario is a training loop on the simulated device made slow by a real mechanism (throttled loop
device, FUSE, slow peer, CPU work, contention, a late rank, sleeps), captured with the real pipeline and
scored against the cause and culprit it was built with. Exit status 1 if any scenario misses a target.
``machine's load``: the share of stall time the report names the GPU process waiting for a CPU that a program
outside the capture held (a CPU hog beside it): no workload can label that, so it is left out of the scoring
(tests/scenarios/harness.py, ``machine_load``), up to half of the stall time.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "scenarios"))

import harness  # noqa: E402

COLUMNS = ("scenario", "stalls", "stall ms", "right cause+culprit", "unknown", "wrong culprits >=5 ms",
           "machine's load", "wall s")


def main(argv: list[str]) -> int:
    names = argv or list(harness.SCENARIOS)
    unknown = [n for n in names if n not in harness.SCENARIOS]
    if unknown:
        print(f"unknown scenario(s): {', '.join(unknown)}; choose from {', '.join(harness.SCENARIOS)}")
        return 2
    rows, ok = [], True
    for name in names:
        with tempfile.TemporaryDirectory(prefix=f"gputrace-accuracy-{name}-") as tmp:
            sc, _ = harness.run(name, Path(tmp))
        ok &= sc.passed()
        rows.append((name, str(sc.stalls), f"{sc.stall_ns / 1e6:.1f}", f"{sc.correct_pct:.1f}%",
                     f"{sc.unknown_pct:.1f}%", str(len(sc.wrong_culprits)), f"{sc.load_pct:.1f}%", f"{sc.wall_s:.1f}"))
        for miss in sc.misses[:5]:
            print(f"  {name}: {miss}", file=sys.stderr)
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(COLUMNS)]
    print("  ".join(c.ljust(w) for c, w in zip(COLUMNS, widths, strict=True)))
    for r in rows:
        print("  ".join(v.ljust(w) if i == 0 else v.rjust(w) for i, (v, w) in enumerate(zip(r, widths, strict=True))))
    print(f"targets: >= {harness.TARGET_CORRECT_PCT['*']:.0f}% right, <= {harness.TARGET_UNKNOWN_PCT:.0f}% unknown, "
          f"no wrong culprit on a stall >= 5 ms: {'all met' if ok else 'MISSED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
