"""Analysis a frame at a time (analysis/windowed.py's ``analyze_capture``, analysis/frames.py): frames of plain rows
are taken column by column and read again only by the windows that reach them, and the report is the one the same
analysis gives record by record (``analyze_records``), and the whole capture's where that one is the same."""

from __future__ import annotations

import random
from operator import attrgetter
from pathlib import Path
from typing import Any

import pytest
from recorded import CAPTURES, unpacked

from gputrace.analysis import analyze
from gputrace.analysis.frames import DEVICE_KINDS, FIELDS, LONG_BUCKETS, Spool
from gputrace.analysis.load import COLUMN_KINDS, Lazy, _Loader, load
from gputrace.analysis.report import assemble
from gputrace.analysis.windowed import analyze_capture, analyze_records
from gputrace.capture import CaptureWriter, exact_columns, host_header, open_capture, records_of
from gputrace.probes.ebpf.events import EV_SYS, LAYOUT, SYS
from gputrace.probes.ebpf.syscalls import SPECS
from gputrace.records import RECORD_TYPES, OffCpu, Syscall
from gputrace.testing.scale import generate

MS = 1_000_000
S = 1_000_000_000


def by_frames(path: Path, **kw: Any) -> dict[str, Any]:
    with open_capture(path) as reader:
        return dict(analyze_capture(reader, **kw))


def by_records(path: Path, **kw: Any) -> dict[str, Any]:
    with open_capture(path) as reader:
        return dict(analyze_records(reader, reader.records(), **kw))


def whole(path: Path) -> dict[str, Any]:
    with open_capture(path) as reader:
        return dict(assemble(load(reader), 1_000_000))


# --------------------------------------------------------------------- state set long before a stall ---

TRAINER, WORKER, PIN = 100, 200, 101
NRS = {spec.name: nr for nr, spec in enumerate(SPECS)}


def kernel_call(pid: int, tid: int, name: str, start: int, end: int, ret: int = 0, a0: int = 0) -> bytes:
    return SYS.pack(EV_SYS, NRS[name], pid, tid, start, end, ret, a0, 0, 0)


def long_lived_state_capture(path: Path, stall_at_s: int = 120) -> Path:
    """A trainer launching a kernel every 100 ms for ``stall_at_s`` + 20 s, in frames written as they would be;
    what names the stall's culprit is all said at the start: the processes' and the pin-memory thread's names,
    the worker's fd 7 (its /proc snapshot: /data/early.bin). At ``stall_at_s`` the GPU waits 60 ms for the
    trainer's read of a pipe that began 50 s earlier, ended by the worker, whose read of fd 7 (a raw kernel
    event, its fd resolved from that snapshot) and block request took the time."""
    w = CaptureWriter(path, {**host_header(["frames"]), "start_ns": 0, "tracer_pid": 0}, force=True)
    w.write_meta("ebpf", {"layout": LAYOUT, "threshold_ns": 100_000,
                          "syscalls": {nr: s.name for nr, s in enumerate(SPECS)},
                          "sysflags": {nr: s.flags for nr, s in enumerate(SPECS)}})  # fmt: skip
    w.write_rows("ProcInfo", [[0, TRAINER, 1, "train.py", ["train.py"], "/usr/bin/python3", 0],
                              [0, WORKER, TRAINER, "loader0", ["loader0"], "/usr/bin/python3", 0]])
    w.write_rows("ThreadInfo", [[0, TRAINER, PIN, "pt_data_pin"]])
    w.write_rows("GpuDevice", [[0, "sim-gpu", True, "uuid-0", TRAINER]])
    w.write_rows("FdInfo", [[0, WORKER, 7, "file", "/data/early.bin"]])
    stall = stall_at_s * S
    corr = 0
    for second in range(1, stall_at_s + 20):
        t0 = second * S
        api, kernels, noise = [], [], []
        for k in range(10):
            t = t0 + k * 100 * MS
            launch, start = t, t + 1 * MS
            if t == stall:  # the op that ends the stall was launched once the read returned
                launch, start = stall + 50 * MS, stall + 60 * MS
            corr += 1
            api.append([TRAINER, TRAINER, "cudaLaunchKernel", launch, launch + 5000, corr, "runtime", 0])
            kernels.append([TRAINER, 0, 1, 7, start, t + 99 * MS, corr, f"k{corr}", [1, 1, 1], [128, 1, 1]])
            noise.append([WORKER, WORKER, "futex", t + 10 * MS, t + 12 * MS, 0, -1, "", 0, 0x7000])
        w.write_rows("CudaApi", api)
        w.write_rows("GpuKernel", kernels)
        w.write_rows("Syscall", noise)
        w.write_kernel(kernel_call(WORKER, WORKER, "write", t0 + 500 * MS, t0 + 501 * MS, ret=64, a0=1), 1)
        if second == stall_at_s - 50:  # the trainer starts waiting on the pipe, 50 s before the stall
            w.write_rows("Syscall", [[TRAINER, TRAINER, "read", t0, stall + 45 * MS, 64, 9, "pipe", 64, 64]])
            w.write_rows("OffCpu", [[TRAINER, TRAINER, t0 + 1000, stall + 44 * MS, "S", stall + 40 * MS, WORKER,
                                     WORKER, "loader0", 0, 0, ""]])
        if t0 == stall:
            read = kernel_call(WORKER, WORKER, "pread64", stall + 1 * MS, stall + 39 * MS, ret=1 << 20, a0=7)
            w.write_kernel(read, 1)
            w.write_rows("BlockIO", [[WORKER, WORKER, "loader0", "nvme0n1", 8, 1 << 20, "R", stall + 2 * MS,
                                      stall + 38 * MS]])
            w.write_rows("OffCpu", [[WORKER, WORKER, stall + 2 * MS, stall + 38 * MS, "D", stall + 38 * MS, 0, 0,
                                     "[irq]", 0, 0, ""]])
    w.close({"end_ns": (stall_at_s + 20) * S, "drops": {}, "complete": True})
    return path


@pytest.mark.parametrize("windows", [{"small_records": 0}, {"small_records": 0, "bucket_ns": 100 * MS},
                                     {"small_records": 0, "bucket_ns": 40 * MS, "window_buckets": 3}])
def test_state_set_long_before_the_stall_names_its_culprit(tmp_path: Path, windows: dict[str, Any]) -> None:
    """The worker's fd table, the processes' and threads' names are said 120 s before the stall they explain,
    and the trainer's wait began 50 s before it: a window reads none of those records' frames, yet the report
    names the file and the worker, the same report as record by record and as the whole capture's."""
    path = long_lived_state_capture(tmp_path / "state.gputrace")
    got = by_frames(path, **windows)
    assert got == by_records(path, **windows) == whole(path)
    stall = next(s for s in got["stalls"] if s["duration_ns"] > 50 * MS)
    assert stall["cause"] == "storage", stall
    assert stall["culprit"]["object"] == "/data/early.bin" and stall["culprit"]["comm"] == "loader0", stall
    assert stall["via"] == [f"wait:pid {WORKER}"], stall


# ------------------------------------------------------------------------- captures of other shapes ---


@pytest.mark.parametrize("relay", [False, True])
@pytest.mark.parametrize("stall_every", [pytest.param(3, marks=pytest.mark.slow), 50])
def test_scale_captures_frame_by_frame_and_record_by_record(tmp_path: Path, relay: bool, stall_every: int) -> None:
    path = tmp_path / "scale.gputrace"
    generate(path, 30_000, relay, stall_every)
    for windows in ({"small_records": 0}, {"bucket_ns": 30 * MS, "window_buckets": 1, "small_records": 0}):
        assert by_frames(path, **windows) == by_records(path, **windows)


# one recording of each shape: a slow worker under `capture --`, an attached job, a storage-bound one (the others
# repeat their frames' kinds and layouts; analysis/windowed.py's test reads every recording)
FRAME_SHAPES = ("h100-slow-worker", "h100-attach200", "h100-cold-throttled")


@pytest.mark.parametrize("name", [pytest.param(name, marks=[] if name.startswith("h100-cold") else pytest.mark.slow)
                                  for name in CAPTURES if name in FRAME_SHAPES])
def test_recorded_h100_captures_frame_by_frame(tmp_path: Path, name: str) -> None:
    """Raw kernel events and CUPTI's frames of a real capture, in windows of 50 ms."""
    path = unpacked(name, tmp_path)
    windows = {"bucket_ns": 50 * MS, "window_buckets": 1, "small_records": 0}
    assert by_frames(path, **windows) == by_records(path, **windows)


def odd_capture(path: Path, seed: int, steps: int = 400, *, cut: bool = False) -> Path:
    """Frames of every time-local kind at random: rows with a bool for an int, a field of the wrong type, rows
    of an older, shorter layout, frames flushed late, records longer than LONG_BUCKETS buckets of 5 ms, spans
    that end before they start, correlation ids used twice, a thread seen under two processes; ``cut``: the file
    cut off inside a frame."""
    rng = random.Random(seed)
    w = CaptureWriter(path, {**host_header(["odd"]), "start_ns": 0, "tracer_pid": 0}, force=True)
    threads = {100: [100, 101], 200: [200, 201]}
    w.write_rows("ProcInfo", [[0, p, 1, f"p{p}", [f"p{p}"], "/usr/bin/python3"] for p in threads])
    w.write_rows("GpuDevice", [[0, "gpu", True, "u0", 100], [0, "gpu", True, "u1", 200]])
    w.write_rows("StackFrames", [[100, 1, ["PyEval_EvalFrameDefault (libpython3.11.so)"]]])
    late: list[tuple[str, list[list[Any]]]] = []
    corr, t = 0, S
    for _ in range(steps):
        rows: dict[str, list[list[Any]]] = {}
        for _ in range(rng.randint(1, 4)):
            pid = rng.choice(list(threads))
            tid = rng.choice(threads[pid])
            corr += rng.random() > 0.05
            launch = t + rng.randint(0, 10 * MS)
            start = launch + rng.randint(1000, 20 * MS)
            end = start + rng.randint(-1000, 6 * MS)
            rows.setdefault("CudaApi", []).append([pid, tid, "cudaLaunchKernel", launch, launch + 5000, corr,
                                                   "runtime", 0])
            if rng.random() < 0.8:
                rows.setdefault("GpuKernel", []).append([pid, 0, 1, 7, start, end, corr, rng.choice(["k", "gemm"]),
                                                         [1, 1, 1], [32, 1, 1]])
            else:
                rows.setdefault("GpuMemcpy", []).append([pid, 0, 1, 8, start, end, corr, 4096, "h2d", "pinned"])
        for _ in range(rng.randint(2, 12)):
            pid = rng.choice(list(threads))
            tid = rng.choice(threads[pid]) if rng.random() > 0.02 else 300  # 300: under both processes
            start = t + rng.randint(-3 * MS, 10 * MS)
            end = start + rng.choice([rng.randint(1, 4 * MS), rng.randint(1, 40 * MS), (LONG_BUCKETS + 5) * 5 * MS])
            name = rng.choice(["read", "futex", "pread64", "epoll_wait"])
            ret = rng.choice([0, 64, -110])
            rows.setdefault("Syscall", []).append([pid, tid, name, start, end, ret, 9, "pipe", max(ret, 0), 0x7000])
            waker = rng.choice([(0, 0, ""), (200, 201, "w"), (100, 100, "t"), (0, 0, "[timer]")])
            off = [pid, tid, start + 10, end - 10, rng.choice("SDR"), end - 20 if waker[1] else 0, *waker]
            rows.setdefault("OffCpu", []).append(off + ([0, 0, ""] if rng.random() < 0.5 else []))
            if rng.random() < 0.3:
                rows.setdefault("BlockIO", []).append([pid, tid, "c", "nvme0n1", 8, 4096, "R", start, start + MS])
            if rng.random() < 0.1:
                rows.setdefault("PageFault", []).append([pid, tid, start, end - rng.choice([0, 2 * MS]), MS,
                                                         "/data/m.bin", 0, "259:0", 12])
            if rng.random() < 0.1:
                rows.setdefault("IoUringRequest", []).append([pid, tid, "READ", start, end - rng.choice([0, 9 * MS]),
                                                              64, 5, "/data/u.bin", 64, 4, 0, 22, 0])
            if rng.random() < 0.1:
                rows.setdefault("DirtyPause", []).append([pid, tid, start, 4 * MS, "nvme0n1", 1, 1, 1, 1, 1])
            if rng.random() < 0.1:
                rows.setdefault("GpuSync", []).append([pid, tid, 0, 1, 7, start, end, 0, "context"])
            if rng.random() < 0.3:
                rows.setdefault("StackSample", []).append([start, pid, tid, 1])
        rows["SyscallAgg"] = [[100, 100, "ioctl", 2, 400]]
        if rng.random() < 0.05:
            rows["Syscall"][0][5] = True  # a bool for an int: read, but not as plain rows
        if rng.random() < 0.03:
            rows["Syscall"][-1][3] = "?"  # unsound: passed over and counted
        for kind, batch in rows.items():
            if rng.random() < 0.1:
                late.append((kind, batch))
            else:
                w.write_rows(kind, batch)
        if late and rng.random() < 0.1:
            for kind, batch in late:
                w.write_rows(kind, batch)
            late = []
        t += 10 * MS
    for kind, batch in late:
        w.write_rows(kind, batch)
    size = w.written
    w.close({"end_ns": t, "drops": {}, "complete": True})
    if cut:
        with open(path, "r+b") as f:
            f.truncate(size * 2 // 3)
    return path


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("cut", [False, True])
def test_odd_frames_give_the_same_report(tmp_path: Path, seed: int, cut: bool) -> None:
    path = odd_capture(tmp_path / "odd.gputrace", seed, cut=cut)
    with open_capture(path) as reader:
        assert analyze(reader) == by_records(path)
    for windows in ({"small_records": 0}, {"bucket_ns": 5 * MS, "window_buckets": 3, "small_records": 0},
                    {"bucket_ns": 50 * MS, "window_buckets": 1, "small_records": 500}):
        assert by_frames(path, **windows) == by_records(path, **windows)


def test_batches_hold_every_record_once_in_file_order(tmp_path: Path) -> None:
    """Frames taken as plain rows, made records, and the others as read: ``records()``, problems included."""
    for path in (odd_capture(tmp_path / "a.gputrace", 3), odd_capture(tmp_path / "b.gputrace", 4, cut=True),
                 long_lived_state_capture(tmp_path / "c.gputrace", 30)):
        with open_capture(path) as reader:
            want = list(reader.records())
            problem, malformed = reader.problem, reader.malformed
            got: list[Any] = []
            plain = 0
            for b in reader.batches(exact=COLUMN_KINDS):
                if b.columns is None:
                    got += b.records
                else:
                    plain += 1
                    got += records_of(b.kind, b.records)
                    made = records_of(b.kind, b.records)
                    assert [list(c) for c in b.columns] == [list(c) for c in zip(*made, strict=True)]
                    assert list(reader.rows_at(b.offset, b.length)) == b.records
            assert plain and got == want and [type(r) for r in got] == [type(r) for r in want]
            assert (reader.problem, reader.malformed) == (problem, malformed)


def test_exact_columns_take_only_rows_of_exactly_their_types() -> None:
    row = [1, 2, "read", 10, 20, 0, 3, "/x", 0, 0]
    assert exact_columns("Syscall", [row, row]) == [tuple(v for _ in range(2)) for v in row]
    assert exact_columns("Syscall", [row, [*row[:5], True, *row[6:]]]) is None  # a bool: no int here
    assert exact_columns("Syscall", [row, [*row[:2], 5, *row[3:]]]) is None  # an int for a str
    assert exact_columns("Syscall", [row, row[:9]]) is None  # one row short
    assert exact_columns("Syscall", [row, (*row,)]) is None  # not a list
    short: list[Any] = [1, 2, 10, 20, "S", 0, 0, 0, ""]  # an OffCpu of a capture from before the held_* fields
    cols = exact_columns("OffCpu", [short])
    assert cols is not None and [c[0] for c in cols] == [*short, 0, 0, ""]
    assert records_of("OffCpu", [short]) == [OffCpu(*short)]
    kernel = [1, 0, 1, 7, 10, 20, 3, "k", [1, 1, 1], [32, 1, 1]]
    assert exact_columns("GpuKernel", [kernel]) is not None
    assert exact_columns("GpuKernel", [[*kernel[:8], [1, 1], [32, 1, 1]]]) is None
    assert exact_columns("GpuKernel", [[*kernel[:8], [1, 1, "1"], [32, 1, 1]]]) is None
    assert exact_columns("GpuKernel", [kernel, [*kernel[:8], (1, 1, 1), [32, 1, 1]]]) is None  # a tuple: no list
    assert exact_columns("OffCpu", [short, [*short[:4], 3, *short[5:]]]) is None  # an int for the state
    assert exact_columns("Syscall", [row, [*row, 0]]) is None  # one row longer than the others


# ------------------------------------------------------------------------------------- the spool's order ---


def reference_read(records: list[Any], bucket_ns: int, b0: int, b1: int, host: bool) -> list[Any]:
    """The order of one file per bucket, device records then host ones, each in the order they came, read bucket
    after bucket, a record begun before b0 read in b0's; those spanning more than LONG_BUCKETS buckets last."""
    span = {id(r): (r[FIELDS[type(r).__name__][0]] // bucket_ns,
                    max(r[FIELDS[type(r).__name__][0]], r[FIELDS[type(r).__name__][1]]) // bucket_ns) for r in records}
    out = []
    for b in range(b0, b1 + 1):
        for device in (True, False) if host else (True,):
            for r in records:
                first, last = span[id(r)]
                if (type(r).__name__ in DEVICE_KINDS) == device and last - first <= LONG_BUCKETS and (
                        first == b or (b == b0 and first < b0 <= last)):
                    out.append(r)
    out += [r for r in records if span[id(r)][1] - span[id(r)][0] > LONG_BUCKETS
            and span[id(r)][0] <= b1 and span[id(r)][1] >= b0 and (host or type(r).__name__ in DEVICE_KINDS)]
    return out


def random_record(rng: random.Random, kind: str, n: int) -> Any:
    start = rng.randint(0, 400)
    end = start + rng.choice([0, rng.randint(0, 3), rng.randint(0, 30), LONG_BUCKETS + rng.randint(1, 9),
                              -rng.randint(1, 5)])
    fields = RECORD_TYPES[kind]._fields
    i, j = FIELDS[kind]
    values: list[Any] = []
    for f, ann in zip(fields, RECORD_TYPES[kind].__annotations__.values(), strict=True):
        values.append(n if "int" in str(ann) and "tuple" not in str(ann) else
                      [1, 1, 1] if "tuple" in str(ann) else False if "bool" in str(ann) else f)
    values[i], values[j] = start, end if i != j else start
    return RECORD_TYPES[kind]._make(values)


@pytest.mark.parametrize("seed", range(12))
def test_the_spool_reads_records_in_the_order_of_a_file_per_bucket(seed: int) -> None:
    """Frames the capture holds (as rows, read again) and records given one by one (written to the spool), in
    any order of time: every read gives the records of the buckets asked, each once, in the order one file per
    bucket gave them."""
    rng = random.Random(seed)
    kinds = sorted(FIELDS)
    frames: dict[int, list[list[Any]]] = {}
    spool = Spool(1, lambda offset, length, lists=True: frames[offset])
    came: list[Any] = []
    n = 0
    for f in range(60):
        kind = rng.choice(kinds)
        batch = [random_record(rng, kind, n + i) for i in range(rng.randint(1, 40))]
        n += len(batch)
        if rng.random() < 0.5:
            batch.sort(key=lambda r: r[FIELDS[kind][0]])  # in the order of time, as most frames are
        came += batch
        if rng.random() < 0.6:
            frames[f] = [list(r) for r in batch]
            i, j = FIELDS[kind]
            spool.add_frame(kind, frames[f], f, 0, [r[i] for r in batch], [r[j] for r in batch])
        else:
            for r in batch:
                spool.add(kind, r)
    try:
        for _ in range(40):
            b0 = rng.randint(-5, 420)
            b1 = b0 + rng.randint(0, 60)
            host = rng.random() < 0.7
            assert list(spool.read(b0, b1, host=host)) == reference_read(came, 1, b0, b1, host), (b0, b1, host)
    finally:
        spool.close()
    starts = {r[FIELDS[type(r).__name__][0]] for r in came}
    assert starts <= spool.buckets


def test_a_sparse_captures_spooled_records_are_read_a_bucket_at_a_time() -> None:
    """Records given one by one to a sparse capture's spool (a real job's watch-mode dump: 2k records a second,
    50 ms buckets) are written a frame per bucket: a read goes through the frames of the buckets it asks for
    alone (one frame reaching the whole capture was read through, record by record, by every window: the
    recorded dump's windowed analysis took 30 s against the whole capture's 1 s). A record reaching into later
    buckets is in theirs too, and a read gives it once: in the first bucket of the read that it reaches."""
    spool = Spool(1_000)
    for n in range(20_000):  # 50 ns apart: 1000 buckets
        spool.add("Syscall", Syscall(1, 1, "read", 50 * n, 50 * n + (2_990 if n == 10_010 else 10), 0, 3, "f", 0, 0))
    spool.flush()
    assert len(spool.frames) == 1_000 and all(f.lo == f.hi == f.first for f in spool.frames)
    assert [spool.frames[i].lo for i in spool._candidates(500, 501)] == [500, 501]
    assert [r.start_ns for r in spool.read(500, 500)] == list(range(500_000, 501_000, 50))
    # 500,500 ns begins in bucket 500 and reaches 503: read in 500's, or in the first bucket asked that it reaches
    assert [r.start_ns for r in spool.read(501, 503)].count(500_500) == 1
    assert [r.start_ns for r in spool.read(502, 502)][0] == 500_500
    assert 500_500 not in [r.start_ns for r in spool.read(504, 504)]
    spool.close()


def test_a_row_is_its_record() -> None:
    row: list[Any] = [1, 2, "read", 3, 4, 5, 6, "x", 7, 8]
    assert records_of("Syscall", [row]) == records_of("Syscall", [tuple(row)]) == [Syscall(*row)]


def test_a_lazy_index_is_the_dict_its_records_make_one_by_one() -> None:
    """Keys in the order they first came, each entry its records in order and then its ``extra`` ones, whether
    asked for alone or after the records were sorted by key at once (past ASKED_ALONE keys)."""
    rng = random.Random(7)
    runs = [[Syscall(1, rng.choice([5, 6, 7, 8, 9, 10]), "read", rng.randint(0, 99), 100, n, 0, "", 0, 0)
             for n in range(rng.randint(0, 30))] for _ in range(8)]
    extra = {6: [Syscall(1, 6, "page_fault", 3, 4, 0, -1, "", 0, 0)], 11: [Syscall(1, 11, "page_fault", 5, 6, 0, -1,
                                                                                    "", 0, 0)]}
    want: dict[int, list[Any]] = {}
    for run in runs:
        for r in run:
            want.setdefault(r.tid, []).append(r)
    for tid, more in extra.items():
        want.setdefault(tid, []).extend(more)
    lazy = Lazy(runs, attrgetter("tid"), list, extra)
    assert list(lazy) == list(want) and len(lazy) == len(want)
    assert 12 not in lazy and lazy.get(12) is None
    for tid in rng.sample(list(want), len(want)):
        assert tid in lazy and lazy[tid] == want[tid] and lazy.get(tid) is lazy[tid]
    assert dict(lazy.items()) == want


def random_rows(rng: random.Random, kind: str, n: int) -> list[list[Any]]:
    """Rows of ``kind`` with every field of its type, the values few (threads seen under two processes or
    none, wakers and none, spans ending before they start), so that the order they come in matters."""
    rows = []
    for _ in range(n):
        row: list[Any] = []
        for name, ann in zip(RECORD_TYPES[kind]._fields, RECORD_TYPES[kind].__annotations__.values(), strict=True):
            text = str(ann)
            if "tuple" in text:
                row.append([1, 1, 1])
            elif "list" in text:
                row.append(["x"])
            elif "bool" in text:
                row.append(rng.random() < 0.5)
            elif "float" in text:
                row.append(rng.random())
            elif "str" in text:
                row.append(rng.choice(["futex", "read", "w", "", "nccl_x", "cudaStreamSynchronize"]))
            elif name.endswith("_ns") or name == "ts":
                row.append(rng.randint(-2, 40))
            else:
                row.append(rng.choice([0, 1, 2, 3, -1]) if name.startswith("waker") else rng.randint(0, 4))
        rows.append(row)
    return rows


@pytest.mark.parametrize("seed", range(4))
def test_columns_tell_the_whole_capture_what_records_one_by_one_do(seed: int) -> None:
    """``note_columns`` (and, for a window, ``add_local``) of frames of every kind it takes: the same counts,
    threads and their first processes (in order), processes, comms, span, malformed records and indexes as
    ``add`` of each record in turn."""
    rng = random.Random(seed)
    by_record, by_columns = _Loader({}), _Loader({})
    for _ in range(30):
        kind = rng.choice(sorted(COLUMN_KINDS - {"ProcInfo", "AgentInfo"}))
        rows = random_rows(rng, kind, rng.randint(1, 25))
        columns = exact_columns(kind, rows)
        assert columns is not None
        recs = records_of(kind, rows)
        for r in recs:
            by_record.add(r)
        by_columns.note_columns(kind, columns)
        if kind in FIELDS:
            by_columns.add_local(kind, recs)
    a, b = by_record.finish(), by_columns.finish()
    for name in ("counts", "malformed", "pids", "kernel_pids", "first_ns", "last_ns"):
        assert getattr(a, name) == getattr(b, name), name
    assert list(a.tgid.items()) == list(b.tgid.items()) and list(a.comms.items()) == list(b.comms.items())
    for name in ("syscalls", "offcpu", "blocks", "blocks_by_dev", "syncs", "dirty"):
        assert {k: v.records for k, v in getattr(a, name).items()} == \
            {k: v.records for k, v in getattr(b, name).items()}, name
    assert list(a.launches.items()) == list(b.launches.items()) and a.ops == b.ops
    assert {k: v.stacks for k, v in a.samples.items()} == {k: v.stacks for k, v in b.samples.items()}
    assert {k: v.requests for k, v in a.uring.items()} == {k: v.requests for k, v in b.uring.items()}


@pytest.mark.parametrize("seed", range(4))
def test_a_record_told_teaches_the_whole_capture_what_adding_it_does(seed: int) -> None:
    """``tell`` of a time-local record (a windowed analysis's first pass, which keeps no index of them): the same
    counts, threads and their first processes (in order), processes, comms, span and malformed records as
    ``add``, records of every other kind added in between; a field of the wrong type is counted malformed."""
    rng = random.Random(seed)
    added, told = _Loader({}), _Loader({})
    for _ in range(40):
        kind = rng.choice(sorted(COLUMN_KINDS - {"ProcInfo", "AgentInfo"}))
        for row in random_rows(rng, kind, rng.randint(1, 25)):
            if rng.random() < 0.1:  # a hostile record: any field of another type
                row[rng.randrange(len(row))] = rng.choice([None, 1.5, "7", True, [1]])
            r = RECORD_TYPES[kind]._make(row)
            want = added.add(r)
            if kind in FIELDS:
                assert told.tell(r) == want, r
            else:
                told.add(r)
    a, b = added.finish(), told.finish()
    for name in ("counts", "malformed", "pids", "kernel_pids", "first_ns", "last_ns"):
        assert getattr(a, name) == getattr(b, name), name
    assert a.malformed > 0
    assert list(a.tgid.items()) == list(b.tgid.items()) and list(a.comms.items()) == list(b.comms.items())
