"""The session's checks on an agent's records: a group of rows is checked column by column (``build_rows``) and
gives exactly what checking each row (``build``) gives: the same records, or an error for the same rows."""

from __future__ import annotations

import copy
import os
from typing import Any

import pytest

from gputrace.agent.wire import FrameError
from gputrace.daemon.agents import validate
from gputrace.daemon.agents.pidns import PeerIds

# a value of each declared type, and values each check must refuse in a field of that type
GOOD: dict[str, Any] = {"int": 7, "bool": True, "str": "gemm", "float": 1.5, "tuple[int, int, int]": [1, 2, 3]}
BAD: list[Any] = [None, "7", 7.5, True, 1 << 64, -(1 << 63) - 1, [1, 2], [1, 2, "3"], [1, 2, 1 << 64], (1, 2, 3),
                  "x" * (validate.MAX_STR + 1), {"a": 1}, b"7"]


def _good_row(schema: validate.Schema, ids: PeerIds, i: int) -> list[Any]:
    types = [validate._annotation(schema.cls, f) for f in schema.cls._fields]
    row = [copy.copy(GOOD[t]) for t in types]
    for k, t in enumerate(types):
        if t == "int":
            row[k] = 1000 + 10 * i + k
    if schema.pid_at >= 0:
        row[schema.pid_at] = ids.own_pid
    if schema.span is not None:
        row[schema.span[0]], row[schema.span[1]] = 100 + i, 200 + i
    return row


def _slow(schema: validate.Schema, rows: list[Any], ids: PeerIds) -> list[Any] | str:
    try:
        return [schema.build(row, ids) for row in copy.deepcopy(rows)]
    except FrameError as e:
        return str(e)


def _fast(kind: str, rows: list[Any], ids: PeerIds) -> list[Any] | str:
    try:
        return validate.batch_records({"records": [[kind, copy.deepcopy(rows)]]}, ids)
    except FrameError as e:
        return str(e)


@pytest.mark.parametrize("kind", sorted(validate.SCHEMAS))
def test_rows_checked_together_give_what_each_checked_alone_gives(kind: str) -> None:
    ids = PeerIds(os.getpid())
    schema = validate.SCHEMAS[kind]
    good = [_good_row(schema, ids, i) for i in range(3)]
    got = _fast(kind, good, ids)
    assert got == _slow(schema, good, ids) and isinstance(got, list) and len(got) == 3
    assert all(type(r) is schema.cls for r in got)
    assert (schema.build_rows(copy.deepcopy(good), ids) is None) == (kind == "Drops")  # (Drops: row by row)
    cases = 0
    for k in range(schema.arity):
        for bad in BAD:
            rows = copy.deepcopy(good)
            rows[1][k] = bad
            assert _fast(kind, rows, ids) == _slow(schema, rows, ids), (schema.cls._fields[k], bad)
            cases += 1
    wrong = [[*good[:2], good[2][:-1]], [*good[:2], [*good[2], 1]]]  # a field short, one too many
    if schema.pid_at >= 0:
        wrong.append(copy.deepcopy(good))
        wrong[-1][2][schema.pid_at] = ids.own_pid + 1  # another process's pid
    if schema.span is not None:
        wrong.append(copy.deepcopy(good))
        wrong[-1][0][schema.span[1]] = 50  # ends before it starts
    for rows in wrong:
        fast = _fast(kind, rows, ids)
        assert isinstance(fast, str) and fast == _slow(schema, rows, ids)  # refused, saying the same
    assert cases == schema.arity * len(BAD)


def test_a_batch_of_thousands_of_kernels_is_checked_together_and_its_pids_made_the_sessions() -> None:
    ids = PeerIds(os.getpid())
    ids.host_pid = 424242  # as for a peer in a pid namespace: its rows name it by its own pid
    rows = [[os.getpid(), 0, 1, 7, 10 * i, 10 * i + 5, i, f"k{i % 7}", [1, 1, 1], [128, 1, 1]] for i in range(5000)]
    got = validate.batch_records({"records": [["GpuKernel", rows]]}, ids)
    assert [r.pid for r in got] == [424242] * 5000 and got[4999].grid == (1, 1, 1) and got[4999].end_ns == 49995
    assert rows[0][0] == os.getpid()  # checked together: the rows themselves left as they came
