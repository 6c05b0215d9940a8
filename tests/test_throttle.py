"""CPU quota throttling (cause ``cpu.throttled``): the cgroup files read (v2 from recorded file contents, v1 for
real on this kernel), and the attribution of runnable waits on synthetic captures."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from test_analysis import TRAINER, only_stall, run, trainer
from workloads.cpu_cgroup import CPU, SPINNER, cpu_cgroup, remove_group

from gputrace.analysis import summary_lines
from gputrace.analysis.throttle import windows
from gputrace.exporters.perfetto.args import stall_args
from gputrace.probes.cgroups import (
    CgroupFiles,
    CgroupSampler,
    Hierarchy,
    Limits,
    Stat,
    find_hierarchy,
    parse_cpu_max,
    parse_cpu_stat,
    parse_mountinfo,
    parse_proc_cgroup,
)
from gputrace.records import CpuCgroup, CpuThrottle
from gputrace.testing.synth import Builder, ns
from gputrace.viewer.html import page
from gputrace.viewer.terminal import describe

MS = 1_000_000
POD, CONTAINER = "/kubepods/burstable/pod1", "/kubepods/burstable/pod1/c1"


class ListSink:
    def __init__(self) -> None:
        self.records: list[Any] = []

    def emit(self, records: Sequence[tuple[Any, ...]]) -> None:
        self.records.extend(records)

    def emit_kernel(self, blob: bytes, nevents: int) -> None:
        pass

    def emit_meta(self, source: str, meta: dict[str, Any]) -> None:
        pass

    def of(self, kind: type[Any]) -> list[Any]:
        return [r for r in self.records if isinstance(r, kind)]


# ------------------------------------------------------------------------------------- the files ---

MOUNTINFO = """\
25 24 0:22 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
26 25 0:23 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
27 25 0:24 / /sys/fs/cgroup/cpuacct rw,relatime - cgroup cgroup rw,cpuacct
28 25 0:25 / /sys/fs/cgroup/cpuset rw,relatime - cgroup cgroup rw,cpuset
35 25 0:30 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
36 25 0:31 /sub /mnt/cpu-sub rw,relatime - cgroup cgroup rw,cpu
"""


def test_mountinfo_finds_the_cpu_controller_not_cpuset_or_cpuacct() -> None:
    assert parse_mountinfo(MOUNTINFO) == Hierarchy("/sys/fs/cgroup/cpu", "/sys/fs/cgroup/unified")
    v2_only = "30 1 0:26 / /sys/fs/cgroup rw - cgroup2 cgroup2 rw,nsdelegate\n"
    assert parse_mountinfo(v2_only) == Hierarchy("", "/sys/fs/cgroup")
    both = "26 25 0:23 / /sys/fs/cgroup/cpu,cpuacct rw - cgroup cgroup rw,cpu,cpuacct\n"
    assert parse_mountinfo(both).v1 == "/sys/fs/cgroup/cpu,cpuacct"


def test_proc_cgroup_names_the_v1_cpu_group_where_mounted_else_the_unified_one() -> None:
    text = f"9:name=systemd:/\n3:cpuset:/\n2:cpu,cpuacct:{CONTAINER}\n0::/system.slice/x.service\n"
    assert parse_proc_cgroup(text, Hierarchy("/sys/fs/cgroup/cpu", "/u")) == (CONTAINER, 1)
    assert parse_proc_cgroup(text, Hierarchy("", "/sys/fs/cgroup")) == ("/system.slice/x.service", 2)
    assert parse_proc_cgroup("0::/a\n", Hierarchy("/sys/fs/cgroup/cpu", "")) == ("", 0)


def test_cpu_max_and_cpu_stat_of_both_versions() -> None:
    assert parse_cpu_max("20000 100000\n") == Limits(20_000, 100_000)
    assert parse_cpu_max("max 100000\n") == Limits(-1, 100_000)
    v2 = ("usage_usec 8391\nuser_usec 8000\nsystem_usec 391\nnr_periods 12\nnr_throttled 9\nthrottled_usec 693196\n"
          "nr_bursts 0\nburst_usec 0\n")
    assert parse_cpu_stat(v2, 2) == Stat(12, 9, 693_196_000)
    v1 = "nr_periods 13\nnr_throttled 9\nthrottled_time 693196383\nnr_bursts 0\nburst_time 0\n"
    assert parse_cpu_stat(v1, 1) == Stat(13, 9, 693_196_383)
    assert parse_cpu_stat("usage_usec 5\nuser_usec 5\nsystem_usec 0\n", 2) == Stat(0, 0, 0)  # no cpu controller


def _v2_tree(root: Path, pid: int) -> Path:
    """A unified hierarchy as a Kubernetes node has it: the pod's and the container's cpu.max, the files as the
    kernel writes them."""
    (root / "proc" / str(pid)).mkdir(parents=True)
    (root / "proc" / str(pid) / "cgroup").write_text(f"0::{CONTAINER}\n")
    pod, container = root / "sys/fs/cgroup" / POD.lstrip("/"), root / "sys/fs/cgroup" / CONTAINER.lstrip("/")
    container.mkdir(parents=True)
    (pod / "cpu.max").write_text("50000 100000\n")
    (pod / "cpu.stat").write_text("usage_usec 1\nnr_periods 3\nnr_throttled 0\nthrottled_usec 0\n")
    (container / "cpu.max").write_text("20000 100000\n")
    (container / "cpu.stat").write_text("usage_usec 1\nnr_periods 4\nnr_throttled 1\nthrottled_usec 70000\n")
    return container


def test_v2_sampler_records_the_group_its_limited_ancestor_changes_and_unreadable_files(tmp_path: Path) -> None:
    pid = 4242
    container = _v2_tree(tmp_path, pid)
    files = CgroupFiles(Hierarchy("", "/sys/fs/cgroup"), root=tmp_path, proc=tmp_path / "proc")
    sink = ListSink()
    sampler = CgroupSampler([pid], tick_s=3600, files=files)  # ticks by hand below
    sampler.start(sink)
    sampler.sample()  # nothing changed: nothing more recorded
    (container / "cpu.stat").write_text("usage_usec 9\nnr_periods 6\nnr_throttled 3\nthrottled_usec 230000\n")
    sampler.sample()
    (container / "cpu.stat").unlink()  # the group is still there, its file is not
    sampler.sample()
    sampler.stop()
    assert sink.of(CpuCgroup) == [CpuCgroup(sink.of(CpuCgroup)[0].ts, pid, CONTAINER, 2, "")]
    rows = [(r.path, r.quota_us, r.period_us, r.nr_periods, r.nr_throttled, r.throttled_ns, bool(r.error))
            for r in sink.of(CpuThrottle)]
    assert rows == [(CONTAINER, 20_000, 100_000, 4, 1, 70_000_000, False), (POD, 50_000, 100_000, 3, 0, 0, False),
                    (CONTAINER, 20_000, 100_000, 6, 3, 230_000_000, False), (CONTAINER, -1, 0, 0, 0, 0, True)], rows
    changed, failed = sink.of(CpuThrottle)[2:]
    first = sink.of(CpuThrottle)[0]
    assert first.ts <= changed.prev_ts < changed.ts  # the change came after a sample that still read as before
    assert "No such file" in failed.error and "cpu.stat" in failed.error
    w = windows(sink.of(CpuThrottle))
    assert [(x.path, x.throttled_ns, x.nr_throttled) for x in w] == [(CONTAINER, 160_000_000, 2)]


def test_a_process_that_exits_is_dropped_and_a_removed_group_is_no_error(tmp_path: Path) -> None:
    pid = 4343
    container = _v2_tree(tmp_path, pid)
    files = CgroupFiles(Hierarchy("", "/sys/fs/cgroup"), root=tmp_path, proc=tmp_path / "proc")
    sink = ListSink()
    sampler = CgroupSampler([pid], tick_s=3600, files=files)
    sampler.start(sink)
    (tmp_path / "proc" / str(pid) / "cgroup").unlink()
    (tmp_path / "proc" / str(pid)).rmdir()
    for f in container.iterdir():
        f.unlink()
    container.rmdir()
    sampler.stop()
    assert not [r for r in sink.of(CpuThrottle) if r.error], sink.records


@pytest.mark.kernel
def test_v1_throttling_of_a_real_process_is_recorded(tmp_path: Path) -> None:
    """A process in a real v1 cpu group allowed 20 ms per 100 ms, using CPU until the kernel throttled it twice:
    its membership, the group's quota and the throttled time the kernel counted, in samples that bound each
    throttle's end."""
    assert find_hierarchy().v1 == str(CPU) or not (CPU / "cpu.stat").exists()
    with cpu_cgroup(20_000, 100_000) as group:
        proc = subprocess.Popen([sys.executable, "-c", SPINNER, str(group), "2"])
        sink = ListSink()
        sampler = CgroupSampler([proc.pid])
        sampler.start(sink)
        try:
            assert proc.wait(timeout=30) == 0
        finally:
            sampler.stop()
    path = "/" + group.name
    assert any(m.pid == proc.pid and (m.path, m.version, m.error) == (path, 1, "") for m in sink.of(CpuCgroup))
    rows = [r for r in sink.of(CpuThrottle) if r.path == path]
    assert rows and all((r.quota_us, r.period_us, r.version, r.error) == (20_000, 100_000, 1, "") for r in rows)
    w = windows(rows)
    assert sum(x.nr_throttled for x in w) >= 2, rows
    # each throttle holds the group off for most of a period: what is left of 100 ms after its 20 ms
    assert all(0 < x.throttled_ns <= 2 * 100_000_000 for x in w) and all(x.end_ns - x.start_ns < 1e9 for x in w)


JOBS = """
import os, sys
with open(os.path.join(sys.argv[1], "cgroup.procs"), "w") as f:
    f.write(str(os.getpid()))
from gputrace.cli.report import default_jobs
print(default_jobs())
"""


@pytest.mark.kernel
def test_report_runs_no_more_jobs_than_its_cpu_cgroup_quota_allows(tmp_path: Path) -> None:
    """``gputrace report``'s default job count, in a real v1 cpu group: no more than the quota allows whole (1.5
    CPUs: 1; a fifth of one: still 1), nor than a limited ancestor's, and the CPUs it may run on where no group
    has a quota."""
    cpus = len(os.sched_getaffinity(0))

    def jobs(group: Path) -> int:
        return int(subprocess.run([sys.executable, "-c", JOBS, str(group)], capture_output=True, text=True,
                                  check=True).stdout)

    with cpu_cgroup(150_000, 100_000) as group:
        assert jobs(group) == 1
        child = group / "inner"
        child.mkdir()
        try:
            assert (child / "cpu.cfs_quota_us").read_text().strip() == "-1"  # none of its own: its parent's bounds it
            assert jobs(child) == 1
        finally:
            remove_group(child)
    with cpu_cgroup(20_000, 100_000) as group:
        assert jobs(group) == 1
    with cpu_cgroup(-1, 100_000) as group:
        assert jobs(group) == min(cpus, 8)
    if cpus >= 2:
        with cpu_cgroup(200_000, 100_000) as group:
            assert jobs(group) == 2


# -------------------------------------------------------------------------------------- analysis ---


def _throttled_trainer(path: str = CONTAINER, member: str = CONTAINER, throttled_ms: float = 27.0) -> Builder:
    """The trainer runnable and off CPU over [11, 38) ms of a stall [10, 40) ms; its group's counters say a
    throttle of ``throttled_ms`` ended between samples at 37 and 39 ms."""
    b = trainer().offcpu(TRAINER, TRAINER, 11.0, 38.0, "R").cpu_cgroup(TRAINER, 1.0, member)
    return b.throttle(path, 2.0, 0.0, 500.0, 10).throttle(path, 39.0, 37.0, 500.0 + throttled_ms, 11)


def test_a_cgroup_first_read_after_the_stall_began_is_counted_from_that_reading(tmp_path: Path) -> None:
    """The worker joined its cgroup after the stall began, so the group's first reading (12 ms) came after the
    stall's start (10 ms): its counters are taken from that reading, which the culprit says; the throttle named
    (between 37 and 39 ms) is after it, so none of it is left out."""
    b = trainer().offcpu(TRAINER, TRAINER, 11.0, 38.0, "R").cpu_cgroup(TRAINER, 1.0, CONTAINER)
    b.throttle(CONTAINER, 12.0, 0.0, 500.0, 10).throttle(CONTAINER, 39.0, 37.0, 527.0, 11)
    c = only_stall(run(b, tmp_path))["culprit"]
    assert (c["throttled_ns"], c["cgroup_throttled_periods"], c["cgroup_throttled_ns"]) == (27 * MS, 1, 27 * MS), c
    assert c["cgroup_counted_from_ns"] == ns(12), c
    assert "cgroup_counted_from_ns" not in only_stall(run(_throttled_trainer(), tmp_path))["culprit"]


def test_a_runnable_wait_a_throttle_ended_is_cpu_throttled(tmp_path: Path) -> None:
    r = run(_throttled_trainer(), tmp_path)
    s = only_stall(r)
    c = s["culprit"]
    assert (s["cause"], c["pid"], c["tid"], c["object"]) == ("cpu.throttled", TRAINER, TRAINER, CONTAINER), s
    assert (c["quota_us"], c["period_us"], c["cgroup_version"], c["throttled_ns"]) == (20_000, 100_000, 2, 27 * MS)
    assert (c["cgroup_throttled_periods"], c["cgroup_throttled_ns"]) == (1, ns(527) - ns(500))
    assert "cpu_held_by" not in c
    assert describe(s).startswith(f"pid {TRAINER} (python) throttled by its cgroup's CPU quota {CONTAINER}, quota "
                                  "20 ms per 100 ms (cgroup v2): 27.0 ms throttled; the cgroup 1 of 1 periods")
    args = stall_args(s, 1)
    assert (args["quota_us"], args["period_us"], args["throttled_ns"], args["object"]) == (20_000, 100_000, 27 * MS,
                                                                                           CONTAINER)
    assert "class=throttled>cpu.throttled<" in page(r, "t")
    assert r["capture"]["cpu_cgroups"] == [{"path": CONTAINER, "version": 2, "quota_us": 20_000,
                                            "period_us": 100_000, "periods": 1, "throttled_periods": 1,
                                            "throttled_ns": ns(527) - ns(500)}]
    assert any(e["kind"] == "offcpu" and "throttled" in e["what"] for e in s["evidence"]), s["evidence"]


def test_only_what_the_group_counted_is_throttled_the_rest_waited_for_a_cpu(tmp_path: Path) -> None:
    s = only_stall(run(_throttled_trainer(throttled_ms=20.0), tmp_path))
    parts = {p["cause"]: p["ns"] for p in s["breakdown"]}
    assert s["cause"] == "cpu.throttled" and parts["cpu.throttled"] == 20 * MS, s["breakdown"]
    assert parts["cpu.runqueue"] == ns(38) - ns(11) - 20 * MS, s["breakdown"]


def test_a_pods_quota_throttles_its_containers(tmp_path: Path) -> None:
    s = only_stall(run(_throttled_trainer(path=POD), tmp_path))
    assert (s["cause"], s["culprit"]["object"]) == ("cpu.throttled", POD), s


def test_no_throttle_no_membership_or_another_group_stay_run_queue_waits(tmp_path: Path) -> None:
    unchanged = trainer().offcpu(TRAINER, TRAINER, 11.0, 38.0, "R").cpu_cgroup(TRAINER, 1.0, CONTAINER)
    unchanged.throttle(CONTAINER, 2.0, 0.0, 500.0, 10)  # the counters never moved
    elsewhere = _throttled_trainer(member="/kubepods/burstable/pod2/c9")
    unknown_member = _throttled_trainer()
    unknown_member.records = [r for r in unknown_member.records if not isinstance(r, CpuCgroup)]
    for i, b in enumerate((unchanged, elsewhere, unknown_member)):
        (tmp_path / str(i)).mkdir()
        s = only_stall(run(b, tmp_path / str(i)))
        assert s["cause"] == "cpu.runqueue" and "quota_us" not in s["culprit"], (i, s)


def test_an_unreadable_cgroup_file_leaves_the_wait_a_run_queue_wait_and_says_why(tmp_path: Path) -> None:
    b = trainer().offcpu(TRAINER, TRAINER, 11.0, 38.0, "R").cpu_cgroup(TRAINER, 1.0, CONTAINER)
    why = f"Permission denied (/sys/fs/cgroup{CONTAINER}/cpu.stat)"
    b.throttle(CONTAINER, 2.0, 0.0, 0.0, 0, quota_us=-1, period_us=0, error=why)
    b.throttle(CONTAINER, 39.0, 37.0, 0.0, 0, quota_us=-1, period_us=0, error=why)
    r = run(b, tmp_path)
    assert only_stall(r)["cause"] == "cpu.runqueue"
    assert r["capture"]["cpu_cgroup_errors"] == [{"path": CONTAINER, "error": why}]
    note = [line for line in summary_lines(r) if "cgroup" in line]
    assert note == [f"note: cpu cgroup files could not be read ({CONTAINER}: {why}): waits for a CPU of the "
                    "processes in them stay cpu.runqueue, not checked for CPU quota throttling"], summary_lines(r)


def test_a_late_sampler_window_holds_each_throttled_period_and_a_member_recorded_late(tmp_path: Path) -> None:
    """A sampler kept off the CPU by a busy host: one window of the group's counters holds two throttled
    periods, and the process was first recorded in the group during the first wait. Both runnable waits are
    the group's throttles, not one of them and a run-queue wait."""
    b = trainer().offcpu(TRAINER, TRAINER, 11.0, 24.0, "R").offcpu(TRAINER, TRAINER, 26.0, 38.0, "R")
    b.cpu_cgroup(TRAINER, 20.0, CONTAINER)
    b.throttle(CONTAINER, 2.0, 0.0, 500.0, 10).throttle(CONTAINER, 39.0, 5.0, 525.0, 12)
    s = only_stall(run(b, tmp_path))
    parts: dict[str, int] = {}
    for p in s["breakdown"]:
        parts[p["cause"]] = parts.get(p["cause"], 0) + p["ns"]
    assert s["cause"] == "cpu.throttled" and parts["cpu.throttled"] == ns(24) - ns(11) + ns(38) - ns(26), parts
    assert "cpu.runqueue" not in parts, s["breakdown"]
