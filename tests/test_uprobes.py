"""libcuda uprobes for real: a shared library named libcuda.so.1, built here, exporting the driver's symbols.

Each exported function sleeps a known time and returns a known CUresult; a child process loads it with
ctypes and calls the functions from two threads after a ready-handshake. The source attaches real uprobes
and uretprobes; the CudaApi records must carry the right names, tids, counts and durations.
"""

from __future__ import annotations

import ctypes
import json
import os
import shutil
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from workloads.piped import PipedChild

from gputrace.probes.uprobes import SYMBOLS, UprobeEvent, UprobeSource, find_library, program_text, visible_path
from gputrace.records import CudaApi, SourceStatus

pytestmark = pytest.mark.kernel  # root and the host's kernel (see tests/conftest.py)

MS = 1_000_000
# symbol → (sleep in µs, CUresult returned)
FUNCS = {
    "cuLaunchKernel": (2000, 0), "cuLaunchKernelEx": (1000, 0), "cuMemcpyHtoD_v2": (3000, 0),
    "cuMemcpyDtoH_v2": (4000, 0), "cuMemcpyAsync": (1000, 0), "cuMemcpyHtoDAsync_v2": (1000, 0),
    "cuMemcpyDtoHAsync_v2": (1000, 0), "cuStreamSynchronize": (20000, 0), "cuCtxSynchronize": (10000, 700),
    "cuEventSynchronize": (5000, 0),
}  # fmt: skip

LIB_C = """
#include <time.h>
static void pause_us(long us) {
    struct timespec ts = {us / 1000000, (us % 1000000) * 1000};
    while (nanosleep(&ts, &ts) != 0) {}
}
"""

CHILD = textwrap.dedent("""
    import ctypes, json, sys, threading
    lib_path = sys.argv[1]
    lib = None if sys.argv[2] == "later" else ctypes.CDLL(lib_path)
    print("ready", flush=True)
    tids = {}
    def sync_twice():
        tids["worker"] = threading.get_native_id()
        for _ in range(2):
            lib.cuStreamSynchronize(None)
    for line in sys.stdin:
        if line.strip() == "load":
            lib = ctypes.CDLL(lib_path)
            print("loaded", flush=True)
            continue
        tids["main"] = threading.get_native_id()
        t = threading.Thread(target=sync_twice)
        t.start()
        for name in json.loads(line):
            for _ in range(3):
                getattr(lib, name)(None, None, None)
        t.join()
        print(json.dumps(tids), flush=True)
""")


class ListSink:
    def __init__(self) -> None:
        self.records: list[Any] = []
        self.meta: dict[str, Any] = {}

    def emit(self, records: Sequence[tuple[Any, ...]]) -> None:
        self.records.extend(records)

    def emit_kernel(self, blob: bytes, nevents: int) -> None:
        raise AssertionError("the uprobe source emits typed records only")

    def emit_meta(self, source: str, meta: dict[str, Any]) -> None:
        self.meta[source] = meta

    def of(self, cls: type) -> list[Any]:
        return [r for r in self.records if type(r) is cls]


@pytest.fixture(scope="module")
def libcuda(tmp_path_factory: pytest.TempPathFactory) -> Path:
    d = tmp_path_factory.mktemp("fakecuda")
    src = d / "libcuda.c"
    bodies = [f"int {n}(void) {{ pause_us({us}); return {rc}; }}" for n, (us, rc) in FUNCS.items()]
    src.write_text(LIB_C + "\n".join(bodies) + "\n")
    lib = d / "libcuda.so.1"
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-o", str(lib), str(src)], check=True)
    return lib


class Child(PipedChild):
    """The CHILD script: loads the library (now, or on ``load``) and calls the functions it is sent."""

    def __init__(self, lib: Path, when: str = "now") -> None:
        super().__init__([sys.executable, "-c", CHILD, str(lib), when])
        assert self.readline() == "ready"

    def run(self, names: list[str]) -> dict[str, int]:
        self.send(json.dumps(names))
        return json.loads(self.readline())


@pytest.fixture
def child(libcuda: Path) -> Iterator[Child]:
    c = Child(libcuda)
    yield c
    c.close()


def test_calls_recorded_with_names_tids_counts_durations(libcuda: Path, child: Child) -> None:
    sink = ListSink()
    src = UprobeSource([child.proc.pid])
    src.start(sink)
    try:
        names = [n for n in FUNCS if n != "cuStreamSynchronize"]
        tids = child.run(names)
    finally:
        src.stop()
    calls = sink.of(CudaApi)
    by_name: dict[str, list[CudaApi]] = {}
    for c in calls:
        by_name.setdefault(c.name, []).append(c)
    assert {n: len(v) for n, v in by_name.items()} == {**{n: 3 for n in names}, "cuStreamSynchronize": 2}
    for name, recs in by_name.items():
        us, rc = FUNCS[name]
        want_tid = tids["worker"] if name == "cuStreamSynchronize" else tids["main"]
        for r in recs:
            got = (r.pid, r.tid, r.api, r.result, r.correlation_id)
            assert got == (child.proc.pid, want_tid, "enqueue-only", rc, 0)
            assert us * 1000 <= r.end_ns - r.start_ns < us * 1000 + 100 * MS, (name, r)  # slack: a loaded CI
    assert src.attached[child.proc.pid][0] == str(libcuda)
    assert set(src.attached[child.proc.pid][1]) == set(FUNCS)  # the rest of SYMBOLS are not exported
    assert src.drops() == {"ringbuf": 0, "inflight": 0, "malformed": 0}
    assert sink.meta["uprobe"]["api"] == "enqueue-only"
    assert any(s.status == "started" and str(libcuda) in s.detail for s in sink.of(SourceStatus))


def test_process_without_libcuda_is_watched_until_it_loads_it(libcuda: Path) -> None:
    late = Child(libcuda, when="later")
    sink = ListSink()
    src = UprobeSource([late.proc.pid], rescan_s=0.05)
    src.start(sink)
    try:
        (status,) = sink.of(SourceStatus)
        assert status.status == "degraded" and "no libcuda.so* mapped" in status.detail
        late.send("load")
        assert late.readline() == "loaded"
        for _ in range(100):  # the watcher rescans every 50 ms
            if late.proc.pid in src.attached:
                break
            time.sleep(0.05)
        assert late.proc.pid in src.attached
        late.run(["cuEventSynchronize"])
    finally:
        src.stop()
        late.close()
    assert [c.name for c in sink.of(CudaApi)].count("cuEventSynchronize") == 3


def test_gone_process_is_reported_and_capture_goes_on(libcuda: Path) -> None:
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    pid = int(gone.stdout)
    sink = ListSink()
    src = UprobeSource([pid])
    src.start(sink)
    src.stop()
    assert [s.detail for s in sink.of(SourceStatus)] == [f"pid {pid} is gone"]


def unprobeable_lib(d: Path, refused: str) -> Path:
    """libcuda.so.1 exporting FUNCS and ``refused``, whose first instruction is int3: the kernel refuses a
    uprobe there (arch_uprobe_analyze_insn), as a kernel without uprobe support refuses every one."""
    d.mkdir()
    bodies = [f"int {n}(void) {{ pause_us({us}); return {rc}; }}" for n, (us, rc) in FUNCS.items() if n != refused]
    trap = f'__asm__(".text\\n.globl {refused}\\n.type {refused},@function\\n{refused}:\\n int3\\n ret\\n");'
    (d / "libcuda.c").write_text(LIB_C + "\n".join(bodies) + "\n" + trap + "\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-O1", "-o", str(d / "libcuda.so.1"), str(d / "libcuda.c")], check=True)
    return d / "libcuda.so.1"


def probed(children: list[Child], names: list[str]) -> tuple[UprobeSource, ListSink]:
    """A source on ``children``'s pids while the first calls ``names``; the children are closed after."""
    sink = ListSink()
    src = UprobeSource([c.proc.pid for c in children])
    src.start(sink)
    try:
        children[0].run(names)
    finally:
        src.stop()
        for c in children:
            c.close()
    return src, sink


def test_a_library_whose_first_probe_is_refused_is_not_tried_again(tmp_path: Path) -> None:
    """The kernel refusing the first probe (a GPU host's kernel without uprobes refused every one with EINVAL,
    libbcc printing a line for each): the source says so once per process, tries nothing after it, and a
    second process mapping the same library is not probed at all."""
    lib = unprobeable_lib(tmp_path / "lib", SYMBOLS[0])
    first, second = Child(lib), Child(lib)
    src, sink = probed([first, second], ["cuLaunchKernelEx", "cuMemcpyHtoD_v2"])
    assert src.attached == {first.proc.pid: (str(lib), []), second.proc.pid: (str(lib), [])}
    assert src.unprobed == {str(lib)} and src.refused == {str(lib): [SYMBOLS[0]]}
    details = sorted(s.detail for s in sink.of(SourceStatus) if s.status == "degraded")
    assert details == sorted([f"pid {first.proc.pid}: the kernel refused a uprobe on {lib} ({SYMBOLS[0]}; libbcc says "
                              "why on the tracer's stderr): its CUDA calls are not probed",
                              f"pid {second.proc.pid}: not probed: the kernel refused uprobes on {lib}"]), details
    assert not sink.of(CudaApi)


def test_a_refused_probe_after_others_leaves_the_rest_probed(tmp_path: Path) -> None:
    """One symbol the kernel cannot probe, after others it could: the others are probed and recorded."""
    lib = unprobeable_lib(tmp_path / "lib", "cuMemcpyHtoD_v2")
    child = Child(lib)
    src, sink = probed([child], ["cuLaunchKernel", "cuMemcpyDtoH_v2"])
    assert src.refused == {str(lib): ["cuMemcpyHtoD_v2"]} and not src.unprobed
    assert set(src.attached[child.proc.pid][1]) == set(FUNCS) - {"cuMemcpyHtoD_v2"}
    names = [c.name for c in sink.of(CudaApi)]
    assert names.count("cuLaunchKernel") == 3 and names.count("cuMemcpyDtoH_v2") == 3, names
    [started] = [s for s in sink.of(SourceStatus) if s.status == "started"]
    assert started.detail.endswith("; refused by the kernel: cuMemcpyHtoD_v2"), started.detail


def test_event_mirror_and_symbol_table() -> None:
    assert ctypes.sizeof(UprobeEvent) == 32
    assert "struct cu_event" in program_text()
    assert len(SYMBOLS) <= 24 and len(set(SYMBOLS)) == len(SYMBOLS)


def test_find_library_in_maps(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    (proc / "77").mkdir(parents=True)
    (proc / "77" / "maps").write_text(
        "7f00-7f10 r-xp 00000000 08:01 123 /usr/lib/libc.so.6\n"
        "7f20-7f30 r-xp 00000000 08:01 456 /opt/drv/libcuda.so.580.65.06\n"
        "7f40-7f50 rw-p 00000000 00:00 0 \n"
    )
    assert find_library(77, proc=proc) == str(proc / "77" / "root" / "opt/drv/libcuda.so.580.65.06")
    assert find_library(77, "libnothing", proc=proc) is None
    with pytest.raises(ProcessLookupError):
        find_library(78, proc=proc)
    assert visible_path(1, "/proc") == "/proc"


# A uid-65534 process calls cuLaunchKernel three times, then execs a setuid-root copy of python that calls
# it three times more: the same pid, the same library inode, so the same probes fire.
PRIV_CHILD = textwrap.dedent("""
    import ctypes, os, sys
    lib = ctypes.CDLL(sys.argv[1])
    print("ready", os.geteuid(), flush=True)
    sys.stdin.readline()
    for _ in range(3):
        lib.cuLaunchKernel(None, None, None)
    print("ran", flush=True)
    if len(sys.argv) > 2:
        os.execv(sys.argv[2], [sys.argv[2], __file__, sys.argv[1]])
""")


@pytest.fixture(scope="module")
def privileged(libcuda: Path) -> Iterator[Path]:
    """A directory uid 65534 can reach: the library, the child script, and a setuid-root python."""
    d = Path(tempfile.mkdtemp(prefix="gputrace-uprobe-"))
    os.chmod(d, 0o755)
    shutil.copy(libcuda, d / libcuda.name)
    (d / "child.py").write_text(PRIV_CHILD)
    shutil.copy(Path(sys.executable).resolve(), d / "suid-python")
    os.chown(d / "suid-python", 0, 0)
    os.chmod(d / "suid-python", 0o4755)
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.mark.parametrize("owner", [None, 65534])
def test_calls_after_a_setuid_exec_are_not_recorded_for_a_user(privileged: Path, owner: int | None) -> None:
    """Root sees all six calls; the process's owner sees the three made before it gained root."""
    child = PipedChild(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sys.executable,
                        str(privileged / "child.py"), str(privileged / "libcuda.so.1"),
                        str(privileged / "suid-python")])  # fmt: skip
    sink = ListSink()
    src = UprobeSource([child.pid], owner_uid=owner)
    try:
        assert child.readline() == "ready 65534"
        src.start(sink)
        assert child.pid in src.attached
        for euid in ("65534", "0"):
            child.send("go")
            assert child.readline() == "ran"
            if euid == "65534":
                assert child.readline() == "ready 0"  # the setuid copy, same pid, same library
    finally:
        src.stop()
        child.close()
    launches = [c for c in sink.of(CudaApi) if c.name == "cuLaunchKernel"]
    assert len(launches) == (6 if owner is None else 3)
    assert src.drops() == {"ringbuf": 0, "inflight": 0, "malformed": 0}
    left = [s.detail for s in sink.of(SourceStatus) if "not recorded" in s.detail]
    assert left == ([] if owner is None else ["3 calls not recorded, of processes left out: they gained "
                                              "privileges you lack (setuid/setgid/setcap)"])


def test_a_process_privileged_when_found_is_not_probed_for_a_user(libcuda: Path, child: Child) -> None:
    """A root process, for uid 65534: not even its maps are read, nothing is attached or recorded."""
    sink = ListSink()
    src = UprobeSource([child.pid], owner_uid=65534)
    src.start(sink)
    try:
        child.run(["cuLaunchKernel"])
    finally:
        src.stop()
    assert src.attached == {} and src.left_out == {child.pid}
    assert not sink.of(CudaApi)
    assert [s.detail for s in sink.of(SourceStatus)] == [
        f"pid {child.pid} left out: it holds privileges you lack (setuid/setgid/setcap)"]
