"""Shared test scaffolding. Each section stands alone; add new ones as sections of their own.

pytest puts this file's directory (tests/) on sys.path, so the helper modules beside it import by name in
every test, the scenario tests under tests/scenarios/ included: ``waiting`` (wait for the event itself),
``agent_harness`` (a real agent channel), ``workloads.*`` (real processes, files and devices).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from workloads.loopdev import LoopFs, loop_filesystem

import gputrace.analysis
import gputrace.analysis.compare
import gputrace.analysis.join
import gputrace.cli.doctor
from gputrace.testing.schemas import validate

# ------------------------------------------------------------------------------------------ markers ---
# `kernel`: the test needs the host's kernel as root: eBPF (bcc), loop devices, mounts, cgroups, ptrace
# of other users' processes, setpriv, or a real training framework. `pytest -m "not kernel"` runs the rest
# (records, capture files, analysis, exporters, viewers, the simulated device, the agent channel) anywhere,
# unprivileged; CI runs everything. A module says so with `pytestmark = pytest.mark.kernel`; a test that
# takes a fixture in KERNEL_FIXTURES, or needs a GPU (`gpu`), is marked here.
# `slow`: the few tests that take tens of seconds without the kernel; `-m "not kernel and not slow"`.
KERNEL_FIXTURES = frozenset({"loopfs"})


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    for item in items:
        if KERNEL_FIXTURES & set(getattr(item, "fixturenames", ())) or item.get_closest_marker("gpu"):
            item.add_marker(pytest.mark.kernel)


# ------------------------------------------------------------------------------------- loop devices ---
@pytest.fixture
def loopfs(tmp_path: Path) -> Iterator[LoopFs]:
    """A fresh ext4 filesystem on a loop device, mounted under ``tmp_path`` and torn down after the test
    (tests/workloads/loopdev.py; ``loop_filesystem`` there for a size of one's own or several at once)."""
    if os.geteuid() != 0:
        pytest.fail("loop-device tests run as root (losetup, mount)")
    with loop_filesystem(tmp_path) as fs:
        yield fs


# ------------------------------------------------------------------------------- report schemas ---
# The functions that make reports, comparisons and doctor documents are wrapped before any test module imports
# them, so each document made in the test process (directly, or by an in-process `gputrace report`) is checked
# against the schema generated from gputrace/documents.py. A test that runs gputrace in a subprocess validates
# the JSON it reads itself (gputrace.testing.schemas.validate).


def _validated(make: Callable[..., Any], documents: Callable[[Any], list[Any]]) -> Callable[..., Any]:
    @functools.wraps(make)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        out = make(*args, **kwargs)
        for doc in documents(out):
            validate(doc)
        return out

    return wrapper


gputrace.analysis.analyze = _validated(gputrace.analysis.analyze, lambda r: [r])
gputrace.analysis.join.join = _validated(gputrace.analysis.join.join, lambda j: [j.report, *j.parts])
gputrace.analysis.compare.compare = _validated(gputrace.analysis.compare.compare, lambda c: [c])
gputrace.cli.doctor.document = _validated(gputrace.cli.doctor.document, lambda d: [d])
