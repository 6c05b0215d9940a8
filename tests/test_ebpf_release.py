"""A BPF object is freed once unloaded, or once its compile failed: bcc registers each with atexit, and a
long-lived process (gputraced, one set of programs per capture) would otherwise keep every one, with its
tables, their callbacks and what those reach (the source, its sink, the capture writer)."""

from __future__ import annotations

import gc
import linecache
import os
import sys
import threading
import weakref
from collections.abc import Sequence
from typing import Any

import pytest
from waiting import wait_for

from gputrace.probes.ebpf.host import compile_bpf, unload, unload_in_background, wait_for_unloads

pytestmark = pytest.mark.kernel  # root and the host's kernel (see tests/conftest.py)

GOOD = b"int probe(void *ctx) { return 0; }"
BAD = b"int probe(void *ctx) { return no_such_name; }"


def _still_kept(ref: weakref.ref[Any]) -> str:
    gc.collect()
    kept = ref()
    return "" if kept is None else f"kept by {[type(r).__name__ for r in gc.get_referrers(kept)]}"


def _acquiring(t: threading.Thread, lock: str) -> bool:
    """Thread ``t`` is in ``with <lock>:``, waiting to acquire it: its innermost Python frame is on that line
    (taking a lock is C code: the frame moves on to the block's first line once it is held)."""
    frame = sys._current_frames().get(t.ident or -1)
    return frame is not None and f"with {lock}" in linecache.getline(frame.f_code.co_filename, frame.f_lineno)


def test_an_unloaded_bpf_object_is_freed() -> None:
    import bcc  # the kernel marker: bcc is there (setup.sh installs python3-bpfcc)
    for release in (unload, unload_in_background):
        bpf = compile_bpf(bcc.BPF, text=GOOD)
        ref = weakref.ref(bpf)
        release(bpf)
        del bpf
        wait_for_unloads()
        assert not _still_kept(ref), f"after {release.__name__}: {_still_kept(ref)}"


def test_a_bpf_object_whose_compile_failed_is_freed() -> None:
    import bcc  # the kernel marker: bcc is there (setup.sh installs python3-bpfcc)
    made: list[weakref.ref[Any]] = []

    class Recorded(bcc.BPF):  # type: ignore[misc,name-defined]
        def __init__(self, **kwargs: Any) -> None:
            made.append(weakref.ref(self))  # the object bcc registered, though it is never returned
            super().__init__(**kwargs)

    with pytest.raises(Exception, match="Failed to compile") as failed:
        compile_bpf(Recorded, text=BAD)
    del failed  # its traceback holds the frames that held the object
    assert len(made) == 1 and not _still_kept(made[0]), _still_kept(made[0])


class _Sink:
    def emit(self, records: Sequence[tuple[Any, ...]]) -> None:
        pass

    def emit_kernel(self, blob: bytes, nevents: int) -> None:
        pass

    def emit_meta(self, source: str, meta: dict[str, Any]) -> None:
        pass


def test_a_stopped_uprobe_source_keeps_neither_its_programs_nor_its_sink() -> None:
    """The ring buffer's callback is the source's: an object kept by bcc keeps the source and the sink it
    writes to (in a capture, the session's queue and writer)."""
    import bcc  # noqa: F401 - the kernel marker: bcc is there (setup.sh installs python3-bpfcc)

    from gputrace.probes.uprobes import UprobeSource

    sink = _Sink()
    src = UprobeSource([os.getpid()], library="libno-such-library.so")
    src.start(sink)
    programs, sink_ref = weakref.ref(src._bpf), weakref.ref(sink)
    src.stop()
    del src, sink
    assert not _still_kept(programs), _still_kept(programs)
    assert not _still_kept(sink_ref), _still_kept(sink_ref)


TABLES = b"""BPF_HASH(counts, u32, u64, 16);
BPF_RINGBUF_OUTPUT(events, 8);
BPF_ARRAY(totals, u64, 4);
TRACEPOINT_PROBE(sched, sched_process_exec) { u32 k = 0; u64 *v = totals.lookup(&k); return v ? 0 : 1; }"""


def test_a_module_is_freed_only_between_compiles_and_its_tables_are_opened_at_its_compile() -> None:
    """libbcc keeps every module's tables in one store of the process, unguarded: freeing a module while
    another compiles or frees one crashed gputraced (two captures of one pid ending together). A module is
    freed under the lock compiles take, and every table handle is made at the compile (under it as well), so
    a source asking for a table later finds it made, by str or bytes name."""
    import bcc

    from gputrace.probes.ebpf import host

    bpf = compile_bpf(bcc.BPF, text=TABLES)
    made = {name: bpf.tables.get(name) for name in ("counts", b"counts", "events", b"events", "totals", b"totals")}
    assert all(t is not None for t in made.values()), made
    assert bpf[b"counts"] is made["counts"] and bpf["totals"] is made[b"totals"]
    assert bpf.tracepoint_fds  # TRACEPOINT_PROBE: attached at the compile
    with host._libbcc:  # a compile under way elsewhere
        t = threading.Thread(target=unload, args=(bpf,))
        t.start()
        # the unload closes its links, then waits for the lock (or, were it not waiting, frees the module)
        wait_for(lambda: _acquiring(t, "_libbcc") or not t.is_alive() or bpf.module is None, 60,
                 "the unload to wait for the lock or to free the module")
        assert t.is_alive() and bpf.module is not None, "the module was freed while the lock was held"
    t.join(60)
    assert not t.is_alive() and bpf.module is None and not bpf.tracepoint_fds
