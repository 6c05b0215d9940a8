"""`gputrace doctor` on this real host: everything required is OK as root; an unprivileged user is told why not."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gputrace.cli.doctor import verdict
from gputrace.hostcheck import (
    FAIL,
    INFO,
    OK,
    WARN,
    Check,
    check_attach,
    check_socket_dir,
    check_tracepoints,
    failed_required,
)
from gputrace.testing.schemas import validate

pytestmark = pytest.mark.kernel  # root and the host's kernel (see tests/conftest.py)

ROOT = Path(__file__).resolve().parents[1]
NOBODY = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups"]


def _doctor(*args: str, prefix: list[str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*(prefix or []), sys.executable, "-m", "gputrace", "doctor", *args],
                          capture_output=True, text=True, timeout=180, cwd=ROOT)


def test_everything_required_works_here_as_root() -> None:
    assert os.geteuid() == 0, "the test suite runs as root"
    r = _doctor("--json")
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads(r.stdout)
    validate(doc)
    assert doc["schema"] == "gputrace.doctor/1" and doc["ok"] is True
    by_name = {c["name"]: c for c in doc["checks"]}
    for name in ("privileges", "bpf() syscall", "tracefs", "bcc (python3-bpfcc)", "kernel headers",
                 "bcc program load", "unix socket dir"):
        assert by_name[name]["status"] == OK and by_name[name]["required"], by_name[name]
    tracepoints = [c for c in doc["checks"] if c["name"].startswith("tracepoint ")]
    assert len(tracepoints) > 10 and all(c["status"] == OK for c in tracepoints)
    assert by_name["tracepoint raw_syscalls:sys_enter"]["status"] == OK  # the syscall path in use here
    assert by_name["tracepoint sched:sched_switch"]["detail"] == "off-CPU intervals"
    assert by_name["kprobes"]["status"] == "INFO"  # absent on this kernel, and not needed
    assert by_name["uprobes"]["status"] == OK
    assert by_name["NVML"]["status"] == "INFO" and "unavailable" in by_name["NVML"]["detail"]


def test_table_output_and_exit_code() -> None:
    r = _doctor("--no-load")
    assert r.returncode == 0, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert any(ln.startswith("OK    privileges") for ln in lines)
    assert any(ln.startswith("OK    tracepoints") and "present" in ln for ln in lines)
    assert any(ln.startswith("INFO  CUDA driver") for ln in lines)
    assert any("fix:" in ln for ln in lines)
    assert lines[-1] == "gputrace capture can run on this host."


def test_unprivileged_user_is_told_which_capability_is_missing() -> None:
    r = _doctor("--json", prefix=NOBODY)
    assert r.returncode == 1, r.stdout + r.stderr
    doc = json.loads(r.stdout)
    validate(doc)
    assert doc["ok"] is False
    by_name = {c["name"]: c for c in doc["checks"]}
    priv = by_name["privileges"]
    assert priv["status"] == FAIL and "CAP_BPF" in priv["detail"] and "CAP_PERFMON" in priv["detail"]
    assert by_name["bpf() syscall"]["status"] == FAIL and "EPERM" in by_name["bpf() syscall"]["detail"]
    assert by_name["bcc program load"]["status"] == FAIL and "CAP_BPF" in by_name["bcc program load"]["fix"]
    assert by_name["tracefs"]["status"] == FAIL and "not readable" in by_name["tracefs"]["detail"]


def test_unprivileged_table_names_the_fix() -> None:
    r = _doctor("--no-load", prefix=NOBODY)
    assert r.returncode == 1
    assert "FAIL  privileges" in r.stdout and "without CAP_BPF, CAP_PERFMON" in r.stdout
    assert r.stdout.rstrip().endswith("(see above).")
    assert "Traceback" not in r.stderr


def test_missing_tracepoint_is_reported_as_missing() -> None:
    checks = check_tracepoints([("sched", "sched_switch", "off-CPU intervals"),
                                ("nosuchcat", "no_such_tracepoint", "something optional")])
    assert [c.status for c in checks] == [OK, WARN]
    assert checks[1].name == "tracepoint nosuchcat:no_such_tracepoint"
    assert "missing on this kernel" in checks[1].detail and "something optional degraded" in checks[1].detail
    assert not failed_required(checks), "a missing tracepoint degrades a source, it does not stop the capture"


def test_a_tracepoint_of_an_older_layout_is_degraded(tmp_path: Path) -> None:
    """io_uring's request tracepoints changed in 5.19: present without the fields the program reads is a warning."""
    from gputrace.hostcheck import _tracepoint

    tp = tmp_path / "events" / "io_uring" / "io_uring_file_get"
    tp.mkdir(parents=True)
    (tp / "id").write_text("1\n")
    (tp / "format").write_text("\tfield:void * ctx;\toffset:8;\tsize:8;\tsigned:0;\n\tfield:int fd;\toffset:16;\n")
    c = _tracepoint(tmp_path, "io_uring", "io_uring_file_get", "files", ("ctx", "req", "fd"))
    assert (c.status, c.detail) == (WARN, "an older layout, without req: files degraded")
    assert _tracepoint(tmp_path, "io_uring", "io_uring_file_get", "files", ("ctx", "fd")).status == OK
    by_name = {c.name: c for c in check_tracepoints()}  # this kernel's: the current layout
    assert by_name["tracepoint io_uring:io_uring_complete"].status == OK


def test_unwritable_socket_dir_fails(tmp_path: Path) -> None:
    assert check_socket_dir(str(tmp_path)).status == OK
    r = subprocess.run([*NOBODY, sys.executable, "-c",
                        "from gputrace.hostcheck import check_socket_dir;"
                        f"c = check_socket_dir({str(ROOT)!r}); print(c.status, c.detail)"],
                       capture_output=True, text=True, timeout=60, cwd="/")
    assert r.stdout.startswith("FAIL cannot bind a unix socket in"), r.stdout + r.stderr


def test_attach_line_follows_the_yama_scope(tmp_path: Path) -> None:
    yama = tmp_path / "ptrace_scope"
    assert check_attach(str(tmp_path / "no-yama")).status == OK
    for scope, status, says in [("0", OK, "take the agent"), ("1", INFO, "only root can change"),
                                ("2", INFO, "only root can change"), ("3", INFO, "ptrace is disabled")]:
        yama.write_text(scope + "\n")
        c = check_attach(str(yama))
        assert (c.status, says in c.detail) == (status, True), c
        assert c.status == OK or "gputrace env" in c.fix


def test_verdict_on_a_gpu_host_without_ebpf_says_what_a_capture_still_records() -> None:
    # As on an H100 machine with no bcc and tracefs unmounted: the capture runs, GPU side only.
    checks = [Check("privileges", OK, "root", required=True), Check("tracefs", FAIL, "not mounted", required=True),
              Check("bcc (python3-bpfcc)", FAIL, "cannot import bcc", required=True),
              Check("CUDA driver", OK, "libcuda.so.1 loads"), Check("cupti-python", OK, "importable"),
              Check("NVML", OK, "1 device(s)"), Check("unix socket dir", OK, "/tmp", required=True)]  # fmt: skip
    text = verdict(failed_required(checks), checks)
    assert text.startswith("gputrace capture runs here without eBPF: GPU activity only (cupti-python, NVML)")
    assert text.endswith("For causes, fix tracefs, bcc (python3-bpfcc) (see above).")
    checks[-1] = Check("unix socket dir", FAIL, "cannot bind", required=True)  # then no agent can report either
    assert verdict(failed_required(checks), checks).startswith("gputrace capture cannot run here: fix tracefs")
    no_gpu = [c for c in checks if c.name not in ("cupti-python", "NVML")]
    assert verdict(failed_required(no_gpu), no_gpu).startswith("gputrace capture cannot run here")


def test_an_old_cupti_python_is_a_warning_that_says_what_it_costs() -> None:
    from gputrace.hostcheck import WARN, check_cupti

    if importlib.util.find_spec("cupti") is None:  # the check's first question: installed at all
        assert check_cupti("13.0.1").status == "INFO"
        return
    old = check_cupti("13.0.1")
    assert old.status == WARN and "13.0.1" in old.detail and "cupti-python>=13.4" in old.fix, old
    assert check_cupti("13.4.0").status == "OK" and check_cupti("14.1").status == "OK"
