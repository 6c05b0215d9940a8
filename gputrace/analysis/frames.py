"""Time-local records by time bucket, for a windowed analysis (analysis/windowed.py): where each frame of them is,
read again a bucket range at a time.

A frame the capture holds as plain rows (``CaptureReader.batches``: every field of exactly its type) is not copied:
its place in the file and the buckets its rows reach are noted, and a window that reaches them reads the frame
again (``CaptureReader.rows_at``). Records that only exist once decoded (raw kernel events: their fds are resolved
against tables the whole capture's earlier events built) or that had to be checked one by one are written, in the
order they came, to a private temporary file (``Spool.add``): a frame per bucket of those buffered, holding the
records that start in it and those from earlier buckets that reach it, so that a read goes through the records of
the buckets it asks for and no others.

A record belongs to the bucket (``bucket_ns``) it starts in and to each later one it overlaps, up to the one it ends
in; one spanning more than ``LONG_BUCKETS`` buckets (a sleep of minutes: few) is kept in memory instead, as one
starting in its first bucket. ``read(b0, b1)`` gives every record that overlaps buckets [b0, b1], each once, in the
order the records would come from one file per bucket (device records, then host ones) read bucket after bucket,
each file in the order the records came, a record that began before b0 first read in b0's; those kept in memory
last. Attribution's ties (two records of a thread starting at the same time) fall by that order, so it is the
same whatever way the records were stored.
"""

from __future__ import annotations

import os
import tempfile
from bisect import bisect_left, bisect_right
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import compress, repeat
from operator import floordiv, itemgetter, ne
from typing import Any

import msgpack

from gputrace.capture import RowsAt, has_lists, records_of
from gputrace.records import RECORD_TYPES

CACHED_READS = 4  # reads whose frames' records are kept for the next reads
LONG_BUCKETS = 64  # a record spanning more buckets is kept in memory rather than read with every window it reaches
WIDE_BUCKETS = 256  # a frame reaching more buckets (records flushed long after others) is looked at by every read
FLUSH_RECORDS = 50_000  # records given one by one, buffered before they are written, a frame per bucket
# Where a time-local record's time span is: (start field, end field)
EXTENT: dict[str, tuple[str, str]] = {
    "GpuKernel": ("start_ns", "end_ns"), "GpuMemcpy": ("start_ns", "end_ns"), "GpuMemset": ("start_ns", "end_ns"),
    "CudaApi": ("start_ns", "end_ns"), "GpuSync": ("start_ns", "end_ns"),
    "Syscall": ("start_ns", "end_ns"), "OffCpu": ("start_ns", "end_ns"), "BlockIO": ("issue_ns", "complete_ns"),
    "PageFault": ("start_ns", "end_ns"), "IoUringRequest": ("start_ns", "end_ns"), "DirtyPause": ("ts", "ts"),
    "StackSample": ("ts", "ts"),
}  # fmt: skip
DEVICE_KINDS = frozenset({"GpuKernel", "GpuMemcpy", "GpuMemset", "CudaApi"})  # read before host ones in a bucket
FIELDS = {k: (RECORD_TYPES[k]._fields.index(a), RECORD_TYPES[k]._fields.index(b)) for k, (a, b) in EXTENT.items()}
_KINDS = sorted(EXTENT)
_KIND_ID = {k: i for i, k in enumerate(_KINDS)}
_MAKE = [partial(tuple.__new__, RECORD_TYPES[k]) for k in _KINDS]  # a row's record, by kind id

Run = tuple[str, list[Any]]  # records of one kind, in order
Groups = dict[int, list[Run]]  # 2 * bucket (+ 1 for host records) -> the runs read from that bucket's records


@dataclass
class _Frame:
    """One frame of records: in the capture (``spilled`` False: rows of ``kind``) or in the spool's file (``kind``
    None: [kind id, row] items of any kinds, of one bucket: ``lo``, ``hi`` and ``first``, the records that start
    in it and those from earlier buckets that reach it). ``lo``..``hi``: the buckets its rows (but those kept in
    memory) reach; ``first``: the one bucket they all start in, where they do; ``long``: its rows kept in memory,
    by index.
    ``steps``: where its rows come in the order of the buckets they start in, (bucket, index of its first row)
    of each."""

    spilled: bool
    offset: int
    length: int
    kind: str | None
    device: bool | None  # whether its rows are device records (None: some are, some are not)
    lo: int
    hi: int
    first: int | None
    long: frozenset[int]
    steps: tuple[tuple[int, int], ...] | None


class Spool:
    """The time-local records of a capture by time bucket (the module's docstring). ``add_frame`` notes a frame
    the capture holds (``rows_at`` reads it again), ``add`` takes a record the capture cannot give again as it is;
    both in the order the records come. The spool's file is private (mode 0700) and removed by ``close``."""

    def __init__(self, bucket_ns: int, rows_at: RowsAt | None = None) -> None:
        self.bucket_ns = bucket_ns
        self._rows_at = rows_at
        self._dir = tempfile.TemporaryDirectory(prefix="gputrace-windows-")
        self._file = open(os.path.join(self._dir.name, "spool"), "w+b")  # noqa: SIM115 (closed by close)
        self._written = 0
        self._pending: list[list[Any]] = []  # [kind id, record] of records given one by one, not yet written
        self._packer = msgpack.Packer()
        self.frames: list[_Frame] = []
        self.buckets: set[int] = set()  # buckets holding any record
        self.long: list[tuple[int, int, str, Any]] = []  # (first bucket, last bucket, kind, record), as they came
        self.spooled = 0
        self._index: tuple[list[int], list[int], int, list[int]] | None = None  # see _candidates
        # the records of the frames the last CACHED_READS reads used, by frame: a window's device records are
        # read, then the host ones around each of its stalls; the next window's reach back into the last one's
        self._cache: dict[int, list[Any]] = {}
        self._used: deque[list[int]] = deque()  # the frames each of those reads used, oldest first

    # ------------------------------------------------------------------------------------------ writing ---

    def add_frame(self, kind: str, rows: Sequence[Sequence[Any]] | None, offset: int, length: int,
                  starts: Sequence[int], ends: Sequence[int]) -> None:
        """A frame of rows of ``kind`` the capture holds at ``offset`` (``length`` bytes), with its rows' start and
        end times (``rows``: the rows, where they are at hand; else read again if a row is kept in memory)."""
        self.flush()

        def record(i: int) -> Any:
            if rows is None:
                assert self._rows_at is not None
                return records_of(kind, [self._rows_at(offset, length)[i]])[0]
            return records_of(kind, [rows[i]])[0]

        self._note(False, offset, length, kind, kind in DEVICE_KINDS, starts, ends, record)

    def add(self, kind: str, r: Any) -> None:
        """One record, as it came."""
        pending = self._pending
        pending.append([_KIND_ID[kind], r])
        if len(pending) >= FLUSH_RECORDS:
            self.flush()

    def flush(self) -> None:
        """The records given one by one so far, written as a frame per bucket: each holds, in the order they came,
        the records that start in it and those from earlier buckets that reach it (a record spanning more than
        LONG_BUCKETS is kept in memory instead)."""
        items, self._pending = self._pending, []
        if not items:
            return
        bn = self.bucket_ns
        of: dict[int, list[list[Any]]] = {}  # bucket -> its items
        for item in items:
            kind = _KINDS[item[0]]
            r = item[1]
            i_s, i_e = FIELDS[kind]
            start = r[i_s]
            first = start // bn
            last = max(start, r[i_e]) // bn
            if last - first > LONG_BUCKETS:
                self.long.append((first, last, kind, r))
                self.buckets.add(first)
            elif last == first:
                of.setdefault(first, []).append(item)
            else:
                for b in range(first, last + 1):
                    of.setdefault(b, []).append(item)
        self.buckets |= of.keys()
        self.spooled += len(items)
        self._index = None
        write = self._file.write
        self._file.seek(self._written)
        for b in sorted(of):
            got = of[b]
            data = self._packer.pack(got)
            write(data)
            devices = {_KINDS[k] in DEVICE_KINDS for k, _ in got}
            device = devices.pop() if len(devices) == 1 else None
            self.frames.append(_Frame(True, self._written, len(data), None, device, b, b, b, frozenset(), None))
            self._written += len(data)
        self._file.flush()  # (read with pread: _records)

    def _note(self, spilled: bool, offset: int, length: int, kind: str | None, device: bool | None,
              starts: Sequence[int], ends: Sequence[int], record: Callable[[int], Any]) -> None:
        """A frame noted: the buckets its rows reach, and its rows spanning more than LONG_BUCKETS kept in memory
        (``record``: the record of a row, by index). The rows that end in the bucket they start in (nearly all)
        are taken column by column; only those reaching past it are looked at one by one."""
        bn = self.bucket_ns
        firsts = list(map(floordiv, starts, repeat(bn)))
        lasts = list(map(floordiv, ends, repeat(bn)))
        distinct = set(firsts)
        self.buckets |= distinct
        long: set[int] = set()
        hi = max(distinct, default=-1)
        if lasts != firsts:  # some rows end in another bucket (later: they reach it; earlier: they end before start)
            for i in compress(range(len(firsts)), map(ne, firsts, lasts)):
                first = firsts[i]
                span = lasts[i] - first
                if span > LONG_BUCKETS:
                    long.add(i)
                    r = record(i)
                    self.long.append((first, first + span, kind or type(r).__name__, r))
                elif span > 0:
                    self.buckets.update(range(first + 1, first + span + 1))
                    hi = max(hi, first + span)
        steps = None
        if len(distinct) == 1 or firsts == sorted(firsts):  # in the order of their first buckets
            steps = tuple((b, bisect_left(firsts, b)) for b in sorted(distinct))
        self.spooled += len(firsts)
        self._index = None
        if long:  # the buckets the others reach
            kept = [i for i in range(len(firsts)) if i not in long]
            hi = max((firsts[i] + max(lasts[i] - firsts[i], 0) for i in kept), default=-1)
            firsts = [firsts[i] for i in kept]
            distinct = set(firsts)
        lo = min(distinct, default=0)
        first = lo if len(distinct) == 1 else None
        self.frames.append(_Frame(spilled, offset, length, kind, device, lo, hi, first, frozenset(long), steps))

    # ------------------------------------------------------------------------------------------ reading ---

    def read(self, b0: int, b1: int, *, host: bool = True) -> Iterator[Any]:
        """The records that overlap buckets [b0, b1], each once (device records only, unless ``host``), in the
        order the module's docstring says."""
        for _, recs in self.runs(b0, b1, host=host):
            yield from recs

    def runs(self, b0: int, b1: int, *, host: bool = True, api: bool = True) -> list[Run]:
        """``read``'s records as runs of one kind each (``api`` False: without the CUDA API calls, CudaApi)."""
        self.flush()
        groups: Groups = {}
        cache, used = self._cache, []
        for i in self._candidates(b0, b1):
            f = self.frames[i]
            if (not host and f.device is False) or (not api and f.kind == "CudaApi"):
                continue
            recs = cache.get(i)
            if recs is None:
                recs = cache[i] = self._records(f)
            used.append(i)
            if f.kind is not None:
                self._group_frame(groups, f, f.kind, recs, b0, b1)
            else:
                self._group_items(groups, f, recs, b0, b1, host, api)
        self._used.append(used)
        if len(self._used) > CACHED_READS:  # the oldest read's frames let go, but those a later read used
            oldest = self._used.popleft()
            kept = set().union(*self._used)
            for i in oldest:
                if i not in kept:
                    cache.pop(i, None)
        out = [run for key in sorted(groups) for run in groups[key]]
        for first, last, kind, r in self.long:
            if first <= b1 and last >= b0 and (host or kind in DEVICE_KINDS) and (api or kind != "CudaApi"):
                out.append((kind, [r]))
        return out

    def _candidates(self, b0: int, b1: int) -> list[int]:
        """The frames whose rows reach [b0, b1], in the order they came: by their first bucket (bisect), those
        reaching far (more than WIDE_BUCKETS) looked at always."""
        if self._index is None:
            frames = self.frames
            narrow = sorted((f.lo, i) for i, f in enumerate(frames) if 0 <= f.hi - f.lo <= WIDE_BUCKETS)
            wide = [i for i, f in enumerate(frames) if f.hi - f.lo > WIDE_BUCKETS]
            reach = max((frames[i].hi - lo for lo, i in narrow), default=0)
            self._index = ([lo for lo, _ in narrow], [i for _, i in narrow], reach, wide)
        los, order, reach, wide = self._index
        found = [i for i in order[bisect_left(los, b0 - reach) : bisect_right(los, b1)] if self.frames[i].hi >= b0]
        found += [i for i in wide if self.frames[i].lo <= b1 and self.frames[i].hi >= b0]
        found.sort()
        return found

    def _records(self, f: _Frame) -> list[Any]:
        """A frame's records (of a frame of the spool's own, (kind, record) items)."""
        if not f.spilled:
            assert self._rows_at is not None and f.kind is not None
            return records_of(f.kind, self._rows_at(f.offset, f.length, lists=has_lists(f.kind)))
        # (pread: processes forked to explain windows share the file's offset; analysis/windowed.py)
        items = msgpack.unpackb(os.pread(self._file.fileno(), f.length, f.offset), raw=False, use_list=True)
        kinds, make = _KINDS, _MAKE  # (rows the spool wrote from records: each as long as its kind's)
        return [(kinds[k], make[k](row)) for k, row in items]

    def _group_frame(self, groups: Groups, f: _Frame, kind: str, recs: list[Any], b0: int, b1: int) -> None:
        """The records of a frame of one kind that reach [b0, b1], each onto its group (its first bucket there)."""
        bit = 0 if kind in DEVICE_KINDS else 1
        if f.first is not None and b0 <= f.first <= b1 and not f.long:  # all start in one bucket of the range
            groups.setdefault(2 * f.first + bit, []).append((kind, recs))
            return
        if f.steps is not None and not f.long:  # slices, and before them in b0's the rows reaching it from before
            i_e = FIELDS[kind][1]
            prefix = recs[: next((at for bucket, at in f.steps if bucket >= b0), len(recs))]  # begun before b0
            before = list(compress(prefix, map((b0 * self.bucket_ns).__le__, map(itemgetter(i_e), prefix))))
            steps = f.steps
            for k, (bucket, at) in enumerate(steps):
                if bucket > b1:
                    break
                if bucket >= b0:
                    part = recs[at : steps[k + 1][1] if k + 1 < len(steps) else len(recs)]
                    if bucket == b0 and before:
                        part, before = before + part, []
                    groups.setdefault(2 * bucket + bit, []).append((kind, part))
            if before:  # no row starts in b0
                groups.setdefault(2 * b0 + bit, []).append((kind, before))
            return
        i_s, i_e = FIELDS[kind]
        starts = list(map(itemgetter(i_s), recs))
        firsts = map(floordiv, starts, repeat(self.bucket_ns))
        lasts = map(floordiv, map(max, starts, map(itemgetter(i_e), recs)), repeat(self.bucket_ns))
        # the group of a row that began before b0 and reaches it is b0's; one that ended before b0 falls below
        keys = list(map(max, firsts, map(min, lasts, repeat(b0))))
        for i in f.long:
            keys[i] = b0 - 1
        order = sorted(range(len(keys)), key=keys.__getitem__)
        ordered = list(map(keys.__getitem__, order))
        i, stop = bisect_left(ordered, b0), bisect_right(ordered, b1)
        while i < stop:
            key = ordered[i]
            j = bisect_right(ordered, key, i, stop)
            groups.setdefault(2 * key + bit, []).append((kind, list(map(recs.__getitem__, order[i:j]))))
            i = j

    def _group_items(self, groups: Groups, f: _Frame, items: list[Any], b0: int, b1: int, host: bool,
                     api: bool = True) -> None:
        """The records of a frame of the spool's own (one bucket's, in [b0, b1]) onto their groups, in order: in
        b0's, those from earlier buckets that reach it too; in a later bucket's, only those that start in it."""
        bucket = f.lo
        since = bucket * self.bucket_ns if bucket > b0 else None  # where its own records start
        last: dict[int, Run] = {}  # each group's run this frame adds to
        for kind, r in items:
            device = kind in DEVICE_KINDS
            if (not host and not device) or (not api and kind == "CudaApi"):
                continue
            if since is not None and r[FIELDS[kind][0]] < since:  # from an earlier bucket: read in that one's
                continue
            key = 2 * bucket + (0 if device else 1)
            run = last.get(key)
            if run is None or run[0] != kind:
                run = last[key] = (kind, [])
                groups.setdefault(key, []).append(run)
            run[1].append(r)

    def close(self) -> None:
        self._file.close()
        self._dir.cleanup()
