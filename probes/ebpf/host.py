"""Can this host run the eBPF source? Each check fails with one line saying how to fix it. Also what the
source asks of the host: its program text, which tracepoints exist, and unloading programs quickly."""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import functools
import os
import platform
import subprocess
import threading
import time
import warnings
from pathlib import Path
from typing import Any

from gputrace.caps import missing_tracing_caps
from gputrace.errors import PermissionDenied, UserError
from gputrace.probes.ebpf import bpfstats
from gputrace.probes.ebpf.btf import VMLINUX
from gputrace.records import SourceStatus
from gputrace.threads import Thread

TRACEFS = Path("/sys/kernel/tracing")
BPF_DIR = Path(__file__).resolve().parent.parent / "bpf"


def check_privileges() -> None:
    missing = missing_tracing_caps()
    if missing:
        raise PermissionDenied(f"eBPF tracing needs root or {' + '.join(missing)} (missing); run with sudo")


def check_tracefs() -> None:
    try:
        if (TRACEFS / "events").is_dir():
            return
    except PermissionError:
        raise PermissionDenied(f"{TRACEFS} is not readable by uid {os.geteuid()} (tracefs is root-only "
                               "by default); run as root (sudo)") from None
    if os.geteuid() == 0:
        r = subprocess.run(["mount", "-t", "tracefs", "tracefs", str(TRACEFS)], capture_output=True, text=True)
        if r.returncode == 0 and (TRACEFS / "events").is_dir():
            return
    raise UserError(f"tracefs is not mounted at {TRACEFS}; run: sudo mount -t tracefs tracefs {TRACEFS}")


def check_headers() -> None:
    mod = Path("/lib/modules") / os.uname().release
    if any((mod / d / "include/linux/kconfig.h").exists() for d in ("build", "source")):
        return
    raise UserError(f"kernel headers for {os.uname().release} are missing (bcc needs them); run ./setup.sh")


def import_bcc() -> Any:
    try:
        import bcc
    except ImportError:
        raise UserError("bcc is not importable (python3-bpfcc, system site packages); run ./setup.sh") from None
    return bcc


def check_host() -> Any:
    """Everything the source needs before compiling; returns the bcc module."""
    check_privileges()
    bcc = import_bcc()
    check_tracefs()
    check_headers()
    return bcc


def program_text() -> str:
    """The kernel program as compiled (header first), for the hidden ``--ebpf`` flag."""
    return (BPF_DIR / "gputrace.h").read_text() + "\n" + (BPF_DIR / "gputrace.bpf.c").read_text()


def format_has(category: str, name: str, field: str) -> bool:
    try:
        return f" {field};" in (TRACEFS / "events" / category / name / "format").read_text()
    except OSError:
        return False


def tracepoint_exists(category: str, name: str) -> bool:
    from bcc import BPF

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        return bool(BPF.tracepoint_exists(category, name))


# libbcc keeps every module's tables in one process-wide store (a map no lock guards): making a module (a
# compile), freeing one (cleanup) and finding a table by name all walk it, and two of them at once crash the
# process (a segfault in libbcc). gputraced runs several captures at once, each on threads of its own, so each of
# those takes this lock; a table's handle is made under it once (``_open_tables``) and reads the map through its
# fd alone from then on.
_libbcc = threading.Lock()


def compile_bpf(bpf_class: Any, **kwargs: Any) -> Any:
    """``bpf_class(**kwargs)`` (bcc's BPF: compile and load), one at a time in this process, with a handle
    made for each of its tables."""
    with _libbcc:
        # Made in two steps so a failed compile can still be forgotten: bcc registers the object with atexit
        # before it compiles, and gputraced would keep every failed attempt until it exits.
        bpf = bpf_class.__new__(bpf_class)
        try:
            bpf.__init__(**kwargs)
        except BaseException:
            with contextlib.suppress(Exception):  # half made: whatever it opened is closed, as far as it got
                bpf.cleanup()
            forget(bpf)
            raise
        _open_tables(bpf)
        return bpf


def _open_tables(bpf: Any) -> None:
    """A handle for every table of ``bpf``, under its name as str and as bytes (``bpf[name]`` then finds it
    made whichever a source asks with). A table bcc cannot make a handle for is left to be asked for."""
    lib = _table_names()
    for i in range(lib.bpf_num_tables(bpf.module)):
        name = lib.bpf_table_name(bpf.module, i)
        if not name:
            continue
        try:
            table = bpf.get_table(name)
        except Exception:  # noqa: BLE001, S112 - a map type bcc's Python has no class for
            continue
        bpf.tables[name] = bpf.tables[name.decode(errors="replace")] = table


@functools.cache
def _table_names() -> Any:
    """libbcc, its table-listing calls declared (bcc's Python leaves them out)."""
    from bcc.libbcc import lib

    lib.bpf_num_tables.restype, lib.bpf_num_tables.argtypes = ctypes.c_size_t, [ctypes.c_void_p]
    lib.bpf_table_name.restype, lib.bpf_table_name.argtypes = ctypes.c_char_p, [ctypes.c_void_p, ctypes.c_size_t]
    return lib


def forget(bpf: Any) -> None:
    """Take a BPF object off bcc's atexit list once it is cleaned up. bcc registers ``cleanup`` (and
    ``donothing`` on a failed load) as bound methods: the list would keep the object, its tables and their
    callbacks (with them the source, its sink and the capture writer) for the life of the process, one set
    per capture in gputraced."""
    for name in ("cleanup", "donothing"):
        if hasattr(bpf, name):
            atexit.unregister(getattr(bpf, name))


_unloading: list[threading.Thread] = []
_unloading_lock = threading.Lock()
_UNLOAD_WAIT_S = 30.0


def unload_in_background(bpf: Any) -> None:
    """unload() on a thread of its own, so stopping a source does not wait for it. The interpreter waits
    for it at exit: bcc freeing its modules while Python tears down crashes the process."""
    t = Thread(target=unload, args=(bpf,), name="gputrace-ebpf-unload", daemon=True)
    with _unloading_lock:
        if not _unloading:
            atexit.register(wait_for_unloads)
        # Only unloads still running are waited for: a service unloads for every capture it runs. The first
        # stays, so the list is never empty again and the exit hook is registered once.
        _unloading[1:] = [u for u in _unloading[1:] if u.is_alive()]
        _unloading.append(t)
        t.start()  # under the lock: a thread on the list has started, and can be joined


def wait_for_unloads(timeout_s: float = _UNLOAD_WAIT_S) -> None:
    """Wait (at most ``timeout_s``) for the unloads started so far: until then their programs' memory is
    not yet freed."""
    deadline = time.monotonic() + timeout_s
    with _unloading_lock:
        pending = list(_unloading)
    for t in pending:
        t.join(max(0.0, deadline - time.monotonic()))


def unload(bpf: Any) -> None:
    """Close every tracepoint link at once, detach its uprobes and perf events, then free the module (under
    ``_libbcc``). Each close waits for an RCU grace period (70 ms to seconds on a busy machine); concurrent
    closes share them, and none holds the lock another session's compile waits for."""
    from bcc.libbcc import lib

    forget(bpf)  # an exiting interpreter drops the links itself; never twice
    fds = list(bpf.tracepoint_fds.values())
    links = list(bpf.raw_tracepoint_fds.values())  # bpf links, not perf events: a plain close
    bpf.tracepoint_fds.clear()
    bpf.raw_tracepoint_fds.clear()
    closers = [threading.Thread(target=lib.bpf_close_perf_event_fd, args=(fd,), daemon=True) for fd in fds]
    closers += [threading.Thread(target=os.close, args=(fd,), daemon=True) for fd in links]
    try:
        for t in closers:
            t.start()
        for t in closers:
            t.join()
        for name in list(bpf.uprobe_fds):
            bpf.detach_uprobe_event(name)
        for ev_type, ev_config in list(bpf.open_perf_events):
            bpf.detach_perf_event(ev_type, ev_config)
        with _libbcc:
            bpf.cleanup()
    except Exception:  # noqa: BLE001 - interpreter shutting down: the kernel closes what is left
        pass


def file_faults_supported() -> bool:
    """filemap:mm_filemap_fault exists, and the program can read the fault's registers: x86_64 (orig_ax) and a
    kernel with BTF (bpf_task_pt_regs takes a BTF task pointer)."""
    return (platform.machine() == "x86_64" and VMLINUX.exists()
            and tracepoint_exists("filemap", "mm_filemap_fault"))


@functools.cache
def dirty_throttle_layout() -> str:
    """The prefix of the device's counts in writeback:balance_dirty_pages ("wb", "bdi" on older kernels), ""
    where the tracepoint or those fields are missing: then pauses for dirty pages are not recorded. Read
    once: the build and the source's status ask for each capture."""
    for prefix in ("wb", "bdi"):
        if format_has("writeback", "balance_dirty_pages", f"{prefix}_dirty"):
            return prefix
    return ""


def uring_supported() -> bool:
    """The io_uring request tracepoints exist with the fields the program reads (their layout changed in 5.19)."""
    from gputrace.probes.ebpf.syscalls import URING_FIELDS

    return all(format_has("io_uring", tp, f) for tp, fields in URING_FIELDS.items() for f in fields)


def final_status(source: str, now: int, detail: str, poll_error: str) -> SourceStatus:
    """A kernel source's last status: stopped, or ended early when its ring-buffer polling failed."""
    if poll_error:
        return SourceStatus(now, source, "ended_early", f"{detail}; polling stopped: {poll_error}")
    return SourceStatus(now, source, "stopped", detail)


def program_skips(bpf: Any, *, final: dict[str, int] | None = None) -> dict[str, int]:
    """How often the kernel skipped each loaded program (its ``recursion_misses``, from the program fd's
    fdinfo), by the tracepoint it serves: ``sched_waking``, ``sys_exit``, ``on_sample``. A tracepoint or
    perf-event program is skipped when another tracing program, anyone's, is running on that CPU (an
    interrupt arrived during one); what it would have recorded is missing, for any task, traced or not.
    ``final``: the counts read at stop, returned as they are once the programs are gone."""
    if final is not None:
        return dict(final)
    if bpf is None:
        return {}
    out: dict[str, int] = {}
    for name, fn in list(bpf.funcs.items()):
        try:
            text = Path(f"/proc/self/fdinfo/{fn.fd}").read_text()
        except OSError:
            continue
        out[_program_short_name(name)] = parse_recursion_misses(text)
    return out


def program_runs(bpf: Any, *, final: dict[str, tuple[int, int]] | None = None) -> dict[str, tuple[int, int]]:
    """(run count, run time ns) of each loaded program while the kernel's BPF statistics are on
    (probes/ebpf/bpfstats.py), by the tracepoint it serves; ``final``: as read at stop."""
    if final is not None:
        return dict(final)
    return bpfstats.program_runs(bpf, _program_short_name)


def parse_recursion_misses(fdinfo: str) -> int:
    """``recursion_misses`` of a BPF program's fdinfo text (0 on kernels that do not report it)."""
    for line in fdinfo.splitlines():
        key, _, value = line.partition(":")
        if key == "recursion_misses":
            return int(value.strip())
    return 0


def _program_short_name(name: bytes | str) -> str:
    text = name.decode() if isinstance(name, bytes) else name
    if text.startswith("tracepoint__"):
        return text.split("__", 2)[-1]  # tracepoint__sched__sched_waking -> sched_waking
    return text.removeprefix("gt_")

