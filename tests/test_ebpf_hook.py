"""The hooks: raw tracepoints here, classic ones as a fallback, for the syscalls (raw sys_enter/sys_exit or
the per-syscall tracepoints) and for the scheduler (raw sched_switch/sched_waking reading the task's tid at
the offset BTF gives, or the classic tracepoints' fields). Both kinds record the same things."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from workloads.ebpfcap import ebpf_capture, of, read_capture

from gputrace.errors import UserError
from gputrace.probes.ebpf import events
from gputrace.probes.ebpf import hooks as ebpf_hooks
from gputrace.probes.ebpf.btf import struct_offset
from gputrace.probes.ebpf.host import program_skips
from gputrace.probes.ebpf.source import EbpfSource, wanted_tracepoints
from gputrace.records import Drops, OffCpu, SourceStatus, Syscall

pytestmark = pytest.mark.kernel  # root and the host's kernel (see tests/conftest.py)

# Reads with distinct counts (the `arg` the kernel program copies from the registers), a failed open
# (its negative return), a path open, and getpid (not a traced syscall: it must leave no record).
WORKLOAD = """
import os, sys
sys.stdin.readline()
path = sys.argv[1]
fd = os.open(path, os.O_RDONLY)
os.pread(fd, 100, 7)
os.read(fd, 33)
os.getpid()
try:
    os.open(path + ".absent", os.O_RDONLY)
except FileNotFoundError:
    pass
os.close(fd)
"""


def _record(tmp_path: Path, hook: str) -> tuple[EbpfSource, list[object], dict[str, object]]:
    data = tmp_path / "data.bin"
    data.write_bytes(bytes(range(256)) * 4)
    proc = subprocess.Popen([sys.executable, "-c", WORKLOAD, str(data)], stdin=subprocess.PIPE)
    assert proc.stdin is not None
    path = tmp_path / f"{hook}.gputrace"
    with ebpf_capture(path, [proc.pid], threshold_ns=0, syscall_hook=hook) as src:
        proc.stdin.write(b"go\n")
        proc.stdin.close()
        assert proc.wait(timeout=10) == 0
    records, reader = read_capture(path)
    return src, records, reader.meta["ebpf"]


def _calls(records: list[object], data: Path) -> list[tuple[object, ...]]:
    """The workload's calls on its file, without times and ids (which differ between runs)."""
    mine = [s for s in of(records, Syscall) if s.obj.startswith(str(data))]
    return [(s.name, s.ret, s.fd >= 0, s.obj, s.nbytes, s.arg) for s in mine]


def test_raw_path_is_used_here_and_classic_records_the_same(tmp_path: Path) -> None:
    raw, raw_records, raw_meta = _record(tmp_path, "auto")
    classic, classic_records, classic_meta = _record(tmp_path, "classic")
    data = tmp_path / "data.bin"

    assert raw.hook == "raw" and raw_meta["syscall_hook"] == "raw" and raw_meta["syscall_hook_note"] == ""
    assert classic.hook == "classic" and classic_meta["syscall_hook"] == "classic"
    assert of(raw_records, SourceStatus)[0].detail == ("syscalls via raw tracepoints sys_enter/sys_exit; "
                                                       "scheduler via raw tracepoints; io_uring via raw tracepoints")
    assert of(classic_records, SourceStatus)[0].detail == ("syscalls via classic syscall tracepoints; "
                                                           "scheduler via raw tracepoints; io_uring via raw "
                                                           "tracepoints")
    assert raw.attached == classic.attached and len(raw.attached) == len(raw_meta["syscalls"])  # type: ignore[arg-type]

    calls = _calls(raw_records, data)
    assert calls == _calls(classic_records, data)
    names = [c[0] for c in calls]
    assert ("pread64", 100, True, str(data), 100, 100) in calls
    assert ("read", 33, True, str(data), 33, 33) in calls
    assert ("openat", -2, False, f"{data}.absent", 0, os.O_CLOEXEC) in calls  # Python adds O_CLOEXEC
    assert names.count("openat") == 2 and "close" in names
    for records in (raw_records, classic_records):
        assert not [s for s in of(records, Syscall) if s.name.startswith("syscall_") or s.name == "getpid"]


def test_wanted_tracepoints_follow_the_hook() -> None:
    raw = {(c, n) for c, n, _ in wanted_tracepoints("raw")}
    classic = {(c, n) for c, n, _ in wanted_tracepoints("classic")}
    assert {("raw_syscalls", "sys_enter"), ("raw_syscalls", "sys_exit")} <= raw
    assert not [c for c, _ in raw if c == "syscalls"]
    assert ("syscalls", "sys_enter_pread64") in classic and ("raw_syscalls", "sys_enter") not in classic
    assert wanted_tracepoints() == wanted_tracepoints("raw", "raw")  # what this x86_64 kernel with BTF uses


def test_sched_wakeup_is_wanted_only_with_the_raw_scheduler_hooks() -> None:
    # Only the raw scheduler programs use sched_wakeup (early wakeups): doctor must not ask for it otherwise.
    assert ("sched", "sched_wakeup") in {(c, n) for c, n, _ in wanted_tracepoints("raw", "raw")}
    classic = {(c, n) for c, n, _ in wanted_tracepoints("raw", "classic")}
    assert ("sched", "sched_wakeup") not in classic and ("sched", "sched_switch") in classic


def test_unknown_hook_is_a_user_error() -> None:
    with pytest.raises(UserError, match="unknown syscall hook 'fentry'"):
        EbpfSource([1], syscall_hook="fentry")


HANDOFF = Path(__file__).parent / "workloads" / "handoff.py"  # prints the main and releaser tids at the end


def _handoffs(tmp_path: Path, name: str, **options: object) -> tuple[EbpfSource, list[object], dict[str, object],
                                                                      tuple[int, int]]:
    # 50 ms a round: a main thread that gets back on a CPU late still waits well over the 10 ms _waits counts
    proc = subprocess.Popen([sys.executable, str(HANDOFF), "5", "50", "--gate"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    path = tmp_path / f"{name}.gputrace"
    with ebpf_capture(path, [proc.pid], **options) as src:
        proc.stdin.write("go\n")
        proc.stdin.close()
        out = proc.stdout.read()
        assert proc.wait(timeout=10) == 0
    records, reader = read_capture(path)
    main_tid, releaser_tid = map(int, out.split())
    return src, records, reader.meta["ebpf"], (main_tid, releaser_tid)


def _waits(records: list[object], tid: int) -> list[OffCpu]:
    return [w for w in of(records, OffCpu) if w.tid == tid and w.end_ns - w.start_ns > 10_000_000]


def test_raw_and_classic_scheduler_hooks_name_the_same_wakers(tmp_path: Path) -> None:
    for hook in ("auto", "classic"):
        src, records, meta, (main_tid, releaser_tid) = _handoffs(tmp_path, hook, sched_hook=hook)
        want = "raw" if hook == "auto" else "classic"
        assert src.sched == want and meta["sched_hook"] == want and meta["sched_hook_note"] == ""
        assert of(records, SourceStatus)[0].detail.endswith(f"scheduler via {want} tracepoints; io_uring via {want} "
                                                            "tracepoints")
        assert meta["uring_hook"] == want
        waits = [w for w in _waits(records, main_tid) if w.state == "S"]  # not a page-in under memory pressure
        assert len(waits) == 5, hook
        assert {(w.waker_tid, w.waker_pid) for w in waits} == {(releaser_tid, main_tid)}, hook
        assert all(w.start_ns < w.wake_ns <= w.end_ns for w in waits)
        # who had the CPU each time it came back: never the thread itself, a named task or none (idle)
        offs = [w for w in of(records, OffCpu) if w.tid in (main_tid, releaser_tid)]
        assert all(w.held_tid != w.tid and bool(w.held_tid) == bool(w.held_comm) for w in offs), hook
        # The releaser's sleeps end in a timer interrupt: named as such, not after whoever was running. A wakeup
        # the kernel skipped the program for (the timer came while a tracing program ran on that CPU) or did not
        # report leaves a sleep with no waker: no more of those than the kernel said it missed.
        sleeps = [w for w in _waits(records, releaser_tid) if w.state != "R"]  # not preempted
        unseen = [w for w in sleeps if not w.wake_ns]
        skipped = src.skipped()
        missed = sum(skipped.get(k, 0) for k in ("sched_waking", "sched_wakeup", events.UNREPORTED_SWITCHES[0]))
        assert len(sleeps) >= 4 and {w.waker_comm for w in sleeps if w.wake_ns} == {"[timer]"}, hook
        assert all((w.waker_tid, w.waker_comm) == (0, "") for w in unseen) and len(unseen) <= missed, (hook, skipped)
        layout = [d for d in of(records, Drops) if d.what == "layout"]
        assert layout and layout[0].count == 0


def test_each_raw_scheduler_program_reports_its_skips(tmp_path: Path) -> None:
    src, _, _, _ = _handoffs(tmp_path, "skips")
    assert src.sched == "raw"
    assert {name for _, name, _ in ebpf_hooks.SCHED_TRACEPOINTS} <= set(src.skipped())
    assert program_skips(None) == {}


def test_a_wrong_task_offset_records_nothing_and_counts_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The raw programs check the offset on every switch (the previous task is `current`): if BTF were
    wrong, waits go missing and a drop says why, instead of spans with made-up tids."""
    comm = struct_offset("task_struct", "comm")
    assert comm is not None
    monkeypatch.setattr(ebpf_hooks, "task_pid_offset", lambda: comm)
    _, records, _, (main_tid, _) = _handoffs(tmp_path, "bad-offset")
    assert _waits(records, main_tid) == []
    assert [d.count for d in of(records, Drops) if d.what == "layout"][0] > 0


def test_sched_hook_choice() -> None:
    assert ebpf_hooks.choose("sched", "auto") == ("raw", "")  # this kernel has BTF and raw tracepoints
    assert ebpf_hooks.choose("sched", "classic") == ("classic", "")
    with pytest.raises(UserError, match="unknown sched hook 'fentry'"):
        EbpfSource([1], sched_hook="fentry")


def test_raw_tracepoint_support_is_read_from_kallsyms_names_not_addresses(tmp_path: Path) -> None:
    """A process without CAP_SYSLOG (gputraced after it drops capabilities) reads kallsyms with every address
    0: the kernel's support for raw tracepoints is still seen from the names. This kernel lists them."""
    from gputrace.probes.ebpf.syscalls import KALLSYMS, kernel_has_raw_tracepoints

    assert kernel_has_raw_tracepoints(KALLSYMS)
    hidden = tmp_path / "kallsyms"
    lines = [f"{'0' * 16} {line.split(' ', 1)[1]}" for line in KALLSYMS.read_text().splitlines() if " " in line]
    hidden.write_text("\n".join(lines) + "\n")
    assert kernel_has_raw_tracepoints(hidden)
    older = tmp_path / "older"  # a kernel without BPF raw tracepoints (before 4.17)
    older.write_text("".join(line + "\n" for line in lines if "_raw_tracepoint" not in line))
    assert not kernel_has_raw_tracepoints(older)
    assert not kernel_has_raw_tracepoints(tmp_path / "absent")


DUMP = """
import hashlib, json, sys, warnings
warnings.simplefilter("ignore")
import bcc
from bcc.libbcc import lib
from gputrace.probes.ebpf import build as ebpf_build
bcc.BPF._trace_autoload = lambda self: None  # compiled, never attached
b = ebpf_build.compile_program(bcc, ebpf_build.cflags(100000, 64, "raw", "raw", None))
names = [lib.bpf_function_name(b.module, i) for i in range(lib.bpf_num_functions(b.module))]
print(json.dumps({n.decode(): hashlib.sha1(b.dump_func(n)).hexdigest() for n in names}))
"""


def test_the_service_without_cap_syslog_compiles_the_same_program_as_root() -> None:
    """gputraced drops CAP_SYSLOG, and kallsyms then shows it no addresses, so bcc would swap the read helpers for
    the legacy bpf_probe_read: the program calls them by names of its own, and every instruction is the same."""
    def dump(*prefix: str) -> dict[str, str]:
        r = subprocess.run([*prefix, sys.executable, "-c", DUMP], capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, r.stderr[-2000:]
        return json.loads(r.stdout)

    as_root = dump()
    without = dump("setpriv", "--inh-caps=-syslog", "--bounding-set=-syslog")
    assert len(as_root) >= 15 and without == as_root
