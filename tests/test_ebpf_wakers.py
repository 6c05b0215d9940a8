"""Who woke whom: a thread-to-thread handoff must name the releasing thread, not an interrupt."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gputrace.capture import CaptureReader
from gputrace.records import OffCpu

pytestmark = pytest.mark.kernel  # root and the host's kernel (see tests/conftest.py)

HANDOFF = Path(__file__).parent / "workloads" / "handoff.py"


def test_semaphore_handoffs_name_the_releasing_thread(tmp_path: Path) -> None:
    # Several captures in a row: each attaches the programs anew, which is when interrupt-context
    # bookkeeping can go wrong (an entry seen before its exit program is attached).
    for i in range(3):
        out = tmp_path / f"h{i}.gputrace"
        r = subprocess.run([sys.executable, "-m", "gputrace", "capture", "--no-perfetto", "-o", str(out), "--",
                            sys.executable, str(HANDOFF), "10", "30"], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr
        main_tid, releaser_tid = map(int, r.stdout.split())
        with CaptureReader(out) as reader:
            offs = [x for x in reader.records() if isinstance(x, OffCpu) and x.tid == main_tid]
            drops = {k: v for k, v in (reader.trailer or {}).get("drops", {}).items() if v}
        # not preempted, not a page-in
        waits = [x for x in offs if x.state == "S" and x.end_ns - x.start_ns > 20_000_000]
        # a GIL wait of the main thread on a loaded machine can add one; a miss says what the thread's waits were
        seen = [(x.state, round((x.end_ns - x.start_ns) / 1e6, 1), x.waker_tid) for x in offs
                if x.end_ns - x.start_ns > 1_000_000]
        assert len(waits) >= 10, (seen, drops)
        assert {w.waker_tid for w in waits} == {releaser_tid}, [(w.waker_tid, w.waker_comm) for w in waits]
        assert all(w.start_ns < w.wake_ns <= w.end_ns for w in waits)
