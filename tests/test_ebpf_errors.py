"""Bad input and unusable hosts give one clear error; a missing tracepoint degrades, the rest runs."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from workloads.ebpfcap import ebpf_capture, of, read_capture

from gputrace.errors import PermissionDenied, UserError
from gputrace.probes.ebpf.source import EbpfSource, wanted_tracepoints
from gputrace.records import ProcExit, ProcFork, SourceStatus, Syscall

pytestmark = pytest.mark.kernel  # root and the host's kernel (see tests/conftest.py)


def _exited_pid() -> int:
    p = subprocess.Popen(["true"])
    p.wait()
    return p.pid


def test_nonexistent_pid(tmp_path: Path) -> None:
    pid = _exited_pid()
    with pytest.raises(UserError, match=f"no process with pid {pid}"), ebpf_capture(tmp_path / "x.gputrace", [pid]):
        pass
    assert not list(tmp_path.iterdir()), "nothing half-written"


def test_bad_options() -> None:
    with pytest.raises(UserError, match="threshold"):
        EbpfSource([os.getpid()], threshold_ns=-1)
    with pytest.raises(UserError, match="power of two"):
        EbpfSource([os.getpid()], ring_mib=3)


def test_unprivileged_user_is_told_which_capability(tmp_path: Path) -> None:
    code = "import os\nfrom gputrace.probes.ebpf.source import EbpfSource\nEbpfSource([os.getpid()]).start(None)\n"
    r = subprocess.run(
        ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", "--inh-caps=-all",
         "--bounding-set=-all", sys.executable, "-c", code],
        capture_output=True, text=True, cwd=tmp_path,
    )  # fmt: skip
    assert r.returncode != 0
    assert "PermissionDenied" in r.stderr and "CAP_BPF + CAP_PERFMON" in r.stderr, r.stderr
    assert PermissionDenied.exit_code == 4


def test_missing_tracepoint_degrades(tmp_path: Path) -> None:
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys, os\nsys.stdin.readline()\nos.read(os.open('/etc/hostname', 0), 64)"],
        stdin=subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdin is not None
    path = tmp_path / "d.gputrace"
    with ebpf_capture(path, [proc.pid], threshold_ns=0, syscalls=["read", "openat", "no_such_call"]) as src:
        assert src.missing == ["syscalls:sys_enter_no_such_call"]
        proc.stdin.write(b"go\n")
        proc.stdin.close()
        assert proc.wait(timeout=10) == 0
    records, _ = read_capture(path)
    status = of(records, SourceStatus)[0]
    assert status.status == "degraded" and "no_such_call" in status.detail
    assert any(s.name == "read" and s.obj == "/etc/hostname" for s in of(records, Syscall))


def test_target_exits_mid_capture(tmp_path: Path) -> None:
    proc = subprocess.Popen(["sleep", "60"])
    path = tmp_path / "e.gputrace"
    with ebpf_capture(path, [proc.pid]) as src:
        assert src.live_targets() == {proc.pid}
        proc.kill()
        proc.wait()
        assert src.live_targets() == set()
    records, reader = read_capture(path)
    assert reader.complete
    assert [e.pid for e in of(records, ProcExit)] == [proc.pid]


def test_wanted_tracepoints_all_exist_here() -> None:
    wanted = wanted_tracepoints()
    assert ("sched", "sched_switch", "off-CPU intervals") in wanted
    missing = [f"{c}:{n}" for c, n, _ in wanted if not Path(f"/sys/kernel/tracing/events/{c}/{n}").is_dir()]
    assert missing == []


def test_on_proc_gets_live_events_and_its_failures_are_reported(tmp_path: Path) -> None:
    seen: list[object] = []

    def on_proc(rec: object) -> None:
        seen.append(rec)
        raise RuntimeError("caller bug")

    proc = subprocess.Popen([sys.executable, "-c", "import os, sys\nsys.stdin.readline()\nos.system('true')"],
                            stdin=subprocess.PIPE)  # fmt: skip
    assert proc.stdin is not None
    path = tmp_path / "p.gputrace"
    with ebpf_capture(path, [proc.pid], on_proc=on_proc):
        proc.stdin.write(b"go\n")
        proc.stdin.close()
        assert proc.wait(timeout=10) == 0
    forks = [r for r in seen if isinstance(r, ProcFork) and r.parent_pid == proc.pid]
    assert forks, "no live fork event"
    records, reader = read_capture(path)
    final = of(records, SourceStatus)[-1]
    assert final.status == "stopped" and "on_proc callback failed" in final.detail
    assert reader.drops["ebpf.callback"] == 0
