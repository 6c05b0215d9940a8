"""A non-root caller's capture leaves out children that gain privileges it lacks (setuid, setgid): real
gputraced, real uid-65534 workloads running real setuid/setgid copies of /usr/bin/id, real eBPF. The same
workload captured by root keeps them. And without the kernel's credential layout, such a capture refuses to
trace rather than trace unfiltered."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_btf import Blob
from test_service import NOBODY, ROOT, Svc, running_service

from gputrace.capture import CaptureReader
from gputrace.errors import UserError
from gputrace.probes.ebpf import btf, events
from gputrace.probes.ebpf import owner as ebpf_owner
from gputrace.records import ProcLeftOut

pytestmark = pytest.mark.kernel  # root and the host's kernel (see tests/conftest.py)

# Records that say what a process did: none may come from a left-out process after it was left out.
TIMED = {"Syscall": "end_ns", "OffCpu": "end_ns", "BlockIO": "issue_ns", "PageFault": "end_ns",
         "InProgress": "at_ns", "StackSample": "ts", "FileMap": "ts", "FdInfo": "ts", "ProcExec": "ts",
         "ProcInfo": "ts", "ThreadInfo": "ts"}  # fmt: skip


@pytest.fixture(scope="module")
def svc() -> Iterator[Svc]:
    with running_service("gputraced-priv-") as service:
        yield service


@pytest.fixture(scope="module")
def programs() -> Iterator[Path]:
    """A directory uid 65534 can reach with a setuid-root and a setgid-root copy of /usr/bin/id."""
    d = Path(tempfile.mkdtemp(prefix="gputrace-suid-"))
    os.chmod(d, 0o755)
    for name, mode in (("suid-id", 0o4755), ("sgid-id", 0o2755)):
        shutil.copy("/usr/bin/id", d / name)
        os.chown(d / name, 0, 0)
        os.chmod(d / name, mode)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _workload(d: Path) -> subprocess.Popen[bytes]:
    """A uid-65534 shell loop: the privileged programs, and an ordinary child (cat) between them."""
    loop = f"while :; do {d}/suid-id -u >/dev/null; {d}/sgid-id -g >/dev/null; cat /etc/hostname >/dev/null; " \
           "sleep 0.2; done"
    return subprocess.Popen([*NOBODY, "sh", "-c", loop])


def _records(path: Path) -> list[Any]:
    with CaptureReader(path) as reader:
        return list(reader.records())


def _of(recs: list[Any], kind: str) -> list[Any]:
    return [r for r in recs if type(r).__name__ == kind]


def _exec_pids(recs: list[Any], suffix: str) -> set[int]:
    return {r.pid for r in _of(recs, "ProcExec") if r.filename.endswith(suffix)}


def _did(recs: list[Any], pids: set[int]) -> set[int]:
    """Of ``pids``, those with a syscall recorded (one by one or summed)."""
    return {r.pid for r in _of(recs, "Syscall") + _of(recs, "SyscallAgg") if r.pid in pids}


def test_user_capture_leaves_out_setuid_and_setgid_children(svc: Svc, programs: Path) -> None:
    work = _workload(programs)
    try:
        r = svc.client("capture", "-p", str(work.pid), "-d", "3", "--name", "priv", "--json", user=NOBODY)
    finally:
        work.kill()
        work.wait()
    assert r.returncode == 0, r.stdout + r.stderr
    job = json.loads(r.stdout)["job"]
    recs = _records(svc.state / "65534" / "priv.gputrace")
    left = _of(recs, "ProcLeftOut")
    names = {Path(x.filename).name for x in left}
    assert names == {"suid-id", "sgid-id"}, left
    # Counted and said: in the job's summary and in the eBPF source's final status in the capture.
    assert job["left_out"] == len(left) >= 4
    final = [s for s in _of(recs, "SourceStatus") if s.source == "ebpf" and s.status == "stopped"]
    assert f"{len(left)} processes left out" in final[0].detail
    report = subprocess.run([sys.executable, "-m", "gputrace", "report", str(svc.state / "65534" / "priv.gputrace")],
                            capture_output=True, text=True, timeout=60, env={"COLUMNS": "300", "PATH": "/usr/bin"})
    assert f"note: {len(left)} process(es) left out of this capture: they gained privileges" in report.stdout
    # Nothing of a left-out process after it was left out, and none of its syscalls summed either.
    since = {x.pid: x.ts for x in left}
    for kind, field in TIMED.items():
        late = [x for x in _of(recs, kind) if x.pid in since and getattr(x, field) >= since[x.pid]]
        assert not late, late[:3]
    assert not [a for a in _of(recs, "SyscallAgg") if a.pid in since]
    assert not _exec_pids(recs, "-id")
    # The ordinary child is there, and so is the shell.
    cats = _exec_pids(recs, "/cat")
    assert cats and _did(recs, cats), "the ordinary child's records are in the capture"
    assert _did(recs, {work.pid})


def test_root_capture_keeps_them(programs: Path, tmp_path: Path) -> None:
    work = _workload(programs)
    out = tmp_path / "root.gputrace"
    try:
        r = subprocess.run([sys.executable, "-m", "gputrace", "capture", "-p", str(work.pid), "-d", "3", "-o",
                            str(out), "--no-perfetto"], capture_output=True, text=True, timeout=120, cwd=ROOT)
    finally:
        work.kill()
        work.wait()
    assert r.returncode == 0, r.stdout + r.stderr
    recs = _records(out)
    assert not _of(recs, "ProcLeftOut")
    for name in ("suid-id", "sgid-id"):
        pids = _exec_pids(recs, f"/{name}")
        assert pids and _did(recs, pids), f"root sees what {name} does"


# ------------------------------------------------------------------------------- without BTF ----


def _btf_without(member: str) -> btf.Btf:
    """A BTF with task_struct, cred and mm_struct as gt_task_foreign reads them, less `member` of cred."""
    b = Blob()
    u32, u64 = b.int_("unsigned int", 4), b.int_("long long unsigned int", 8)
    kuid = b.add(8, "kuid_t", 0, b.struct_("", 4, [("val", u32, 0)]))
    kcap = b.add(8, "kernel_cap_t", 0, b.struct_("", 8, [("val", u64, 0)]))
    cred_fields = [(m, kuid, 32 * i) for i, m in enumerate(("uid", "gid", "suid", "sgid", "euid", "egid", "fsuid",
                                                            "fsgid"))]  # fmt: skip
    cred_fields += [("cap_permitted", kcap, 448), ("cap_effective", kcap, 512)]
    b.struct_("cred", 72, [f for f in cred_fields if f[0] != member])
    ptr = b.add(2, "", 0, 0)
    b.struct_("task_struct", 64, [("mm", ptr, 0), ("real_cred", ptr, 64)])
    b.struct_("mm_struct", 16, [("flags", u64, 64)])
    return btf.Btf(b.bytes())


def test_owner_check_needs_every_credential_field() -> None:
    whole = _btf_without("")
    flags = ebpf_owner.owner_cflags(65534, whole)
    assert "-DGT_OWNER_UID=65534U" in flags and "-DGT_CRED_FSGID_OFF=28" in flags
    assert "-DGT_CRED_CAP_EFFECTIVE_OFF=64" in flags and "-DGT_MM_FLAGS_OFF=8" in flags
    assert ebpf_owner.owner_cflags(None, whole) == [], "root: nothing filtered, no check compiled"
    with pytest.raises(UserError, match=r"cred\.fsgid not found in the kernel's BTF"):
        ebpf_owner.owner_cflags(65534, _btf_without("fsgid"))


def test_sources_refuse_to_start_without_the_layout(monkeypatch: pytest.MonkeyPatch) -> None:
    """Real sources, a BTF lacking cred.euid: with an owner, neither the eBPF source nor the sampler starts."""
    from gputrace.probes.ebpf.source import EbpfSource
    from gputrace.probes.sampler import StackSampler

    monkeypatch.setattr(ebpf_owner, "_cred_offsets", lambda: ebpf_owner.cred_offsets(_btf_without("euid")))
    for source in (EbpfSource([os.getpid()], owner_uid=65534), StackSampler([os.getpid()], owner_uid=65534)):
        with pytest.raises(UserError, match=r"cred\.euid not found"):
            source.start(_NoSink())


def test_the_kernels_layout_has_every_field() -> None:
    offsets, why = ebpf_owner.cred_offsets(btf.kernel_btf())
    assert not why and len(offsets) == 13


def test_left_out_exec_event_decodes_to_its_record() -> None:
    raw = events.PROC.pack(events.EV_EXEC, events.EXEC_LEFT_OUT, 42, 42, 7, 0, 0, b"suid-id", b"/x/suid-id")
    assert events.proc_record(raw) == ProcLeftOut(7, 42, 42, "suid-id", "/x/suid-id")
    assert type(events.proc_record(events.PROC.pack(events.EV_EXEC, 0, 42, 42, 7, 0, 0, b"", b""))).__name__ == \
        "ProcExec"


class _NoSink:
    """Start fails before anything is emitted; anything emitted is a failure of the test."""

    def emit(self, records: list[Any]) -> None:
        raise AssertionError(f"emitted {records}")

    def emit_meta(self, source: str, meta: dict[str, Any]) -> None:
        raise AssertionError(f"meta of {source}")

    def emit_kernel(self, blob: bytes, n: int) -> None:
        raise AssertionError("kernel events")
