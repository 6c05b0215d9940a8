"""The syscall hook: raw tracepoints sys_enter/sys_exit here, the classic per-syscall ones as a fallback;
both record the same calls with the same arguments."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from workloads.ebpfcap import ebpf_capture, of, read_capture

from gputrace.errors import UserError
from gputrace.probes.ebpf import EbpfSource, wanted_tracepoints
from gputrace.records import SourceStatus, Syscall

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
    assert of(raw_records, SourceStatus)[0].detail == "syscalls via raw tracepoints sys_enter/sys_exit"
    assert of(classic_records, SourceStatus)[0].detail == "syscalls via classic syscall tracepoints"
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
    assert wanted_tracepoints() == wanted_tracepoints("raw")  # what this x86_64 kernel uses


def test_unknown_hook_is_a_user_error() -> None:
    with pytest.raises(UserError, match="unknown syscall hook 'fentry'"):
        EbpfSource([1], syscall_hook="fentry")
