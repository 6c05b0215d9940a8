"""Flows for the Perfetto exporter: launch → GPU work, and stall evidence → stall (a collective call's
evidence is the call's slice, on its thread's "collectives" track).

A flow id is written only when both of its ends are known, so no arrow dangles. Launches and their GPU
work can arrive in either order; the first end waits in a bounded buffer for the other.
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from typing import Any, cast

from gputrace.documents import Report, Stall
from gputrace.records import CudaApi

# API calls that enqueue device work with the correlation id of that work.
_LAUNCHES = re.compile(r"launch|memcpy|memset", re.IGNORECASE)

Key = tuple[int, int]
_DONE_CAP = 8192  # matched launches remembered, for the further kernels of a graph launch


class FlowIds:
    def __init__(self) -> None:
        self._next = 0

    def new(self) -> int:
        self._next += 1
        return self._next

    @property
    def count(self) -> int:
        return self._next

    def skip_to(self, n: int) -> None:
        """Give ids above ``n`` from now on: another writer of the same trace gives those below."""
        self._next = max(self._next, n)


class LaunchMatcher:
    """Pairs CudaApi launches with the kernels/copies/memsets that carry the same (pid, correlation id).

    ``api()`` and ``activity()`` return the ``(record, flow_id)`` pairs ready to write (flow_id 0: no flow).
    At most ``cap`` records wait on each side; beyond that the oldest is written without a flow and
    counted in ``unmatched``.
    """

    def __init__(self, flows: FlowIds, cap: int = 50_000) -> None:
        self._flows = flows
        self._cap = cap
        self._api: OrderedDict[Key, CudaApi] = OrderedDict()
        self._act: OrderedDict[Key, tuple[Any, ...]] = OrderedDict()
        self._done: OrderedDict[Key, None] = OrderedDict()  # matched launches (graphs launch many kernels)
        self._launch_names: dict[str, bool] = {}
        self.matched = 0
        self.unmatched = 0

    def api(self, rec: CudaApi) -> list[tuple[Any, int]]:
        key = (rec.pid, rec.correlation_id)
        act = self._act.pop(key, None)
        if act is not None:
            return self._pair(key, rec, act)
        if rec.correlation_id != 0 and self._launches(rec.name) and key not in self._done:
            self._api[key] = rec
            return self._evict(self._api) if len(self._api) > self._cap else []
        return [(rec, 0)]

    def activity(self, rec: Any) -> list[tuple[Any, int]]:
        key = (rec.pid, rec.correlation_id)
        api = self._api.pop(key, None)
        if api is not None:
            return self._pair(key, api, rec)
        if rec.correlation_id == 0 or key in self._done or key in self._act:
            return [(rec, 0)]
        self._act[key] = rec
        return self._evict(self._act) if len(self._act) > self._cap else []

    def take_api(self, key: Key) -> tuple[CudaApi, int] | None:
        """GPU work of ``key`` arriving: the launch that waited for it and their flow id (``activity()``'s pair,
        written launch first); None when no launch waits, and ``activity()`` then decides."""
        api = self._api.pop(key, None)
        if api is None:
            return None
        flow = self._flows.new()  # _paired()'s, inline: GPU work's rows take this way
        self.matched += 1
        done = self._done
        done[key] = None
        if len(done) > _DONE_CAP:
            done.popitem(last=False)
        return api, flow

    def drain(self) -> Iterator[tuple[tuple[Any, ...], int]]:
        """Everything still waiting, without flows (its other end never came)."""
        for pending in (self._api, self._act):
            self.unmatched += len(pending)
            for rec in pending.values():
                yield rec, 0
            pending.clear()

    def _launches(self, name: str) -> bool:
        """Whether an API call of this name enqueues device work (``_LAUNCHES``), known per name."""
        known = self._launch_names.get(name)
        if known is None:
            if len(self._launch_names) >= _DONE_CAP:
                self._launch_names.clear()
            known = self._launch_names[name] = bool(_LAUNCHES.search(name))
        return known

    def _pair(self, key: Key, api: CudaApi, act: tuple[Any, ...]) -> list[tuple[Any, int]]:
        flow = self._paired(key)
        return [(api, flow), (act, flow)]

    def _paired(self, key: Key) -> int:
        """The flow id of a launch and its work just matched under ``key``, remembered as matched."""
        flow = self._flows.new()
        self.matched += 1
        self._done[key] = None
        if len(self._done) > _DONE_CAP:
            self._done.popitem(last=False)
        return flow

    def _evict(self, pending: OrderedDict[Key, Any]) -> list[tuple[Any, int]]:
        out = []
        while len(pending) > self._cap:
            self.unmatched += 1
            out.append((pending.popitem(last=False)[1], 0))
        return out


EVIDENCE_KINDS = {"syscall": "syscall", "block": "block", "offcpu": "offcpu", "wakeup": "offcpu", "gpu": "gpu",
                  "dirty": "dirty", "collective": "collective"}


def evidence_key(kind: str, pid: int, tid: int, start_ns: int) -> tuple[str, int, int, int]:
    """The key under which a slice the exporter writes can be found from a report's evidence entry."""
    return (kind, pid, 0 if kind == "gpu" else tid, start_ns)


EvidenceKey = tuple[str, int, int, int]
# Which capture an evidence entry's slice is in (-1: none here), for a trace of several hosts' captures.
Locate = Callable[[Stall, Any], int]


class StallLinks:
    """Flow ids from report evidence to stalls, assigned before the pass so evidence slices can carry them.

    A stall gets a flow from an evidence slice only if that slice was actually written (``take``). Of
    several captures, ``locate`` names the capture each entry's slice is in: pids and times alone do not
    (hosts have their own pid spaces), and a late rank's evidence is on its own host.
    """

    def __init__(self, report: Report | None, flows: FlowIds, locate: Locate | None = None) -> None:
        self.stalls: list[Stall] = []
        self._by_key: dict[tuple[int, str, int, int, int], list[tuple[int, int]]] = {}
        self._stall_flows: list[list[int]] = []
        self._locate = locate
        self.malformed = 0
        for stall in (report.get("stalls") or [] if report else []):
            self._add_stall(stall, flows)
        self.waiting = bool(self._by_key)  # evidence not yet found: without any, slices need not look

    def _add_stall(self, stall: Any, flows: FlowIds) -> None:
        try:
            start, end = int(stall["start_ns"]), int(stall["end_ns"])
        except (TypeError, KeyError, ValueError):
            self.malformed += 1
            return
        index = len(self.stalls)
        self.stalls.append(stall)
        self._stall_flows.append([])
        seen: set[tuple[int, str, int, int, int]] = set()
        for ev in stall.get("evidence", []) or []:
            key = _evidence_entry_key(ev)
            # An arrow runs forward in time: evidence that began after the stall ended cannot point at it.
            if key is None or not (key[3] <= end and start <= end):
                continue
            where = self._locate(stall, ev) if self._locate is not None else 0
            if where < 0 or (where, *key) in seen:
                continue
            seen.add((where, *key))
            self._by_key.setdefault((where, *key), []).append((flows.new(), index))

    def take(self, key: EvidenceKey, capture: int = 0) -> list[int]:
        """Flow ids for a slice of ``capture`` being written under ``key``; each evidence entry is used once."""
        links = self._by_key.pop((capture, *key), None)
        if not links:
            return []
        self.waiting = bool(self._by_key)
        for flow, index in links:
            self._stall_flows[index].append(flow)
        return [flow for flow, _ in links]

    def flows_of(self, index: int) -> list[int]:
        return self._stall_flows[index]

    def pending(self) -> frozenset[tuple[int, str, int, int, int]]:
        """The evidence entries no slice took yet, by (capture, *key)."""
        return frozenset(self._by_key)

    def take_entries(self, entries: Iterable[tuple[int, str, int, int, int]]) -> None:
        """``take`` of each entry another writer of the same trace found its slice for (``pending``'s keys; ids
        are assigned alike in every writer of one report): the stalls get their flows."""
        for where, *key in entries:
            self.take(cast(EvidenceKey, tuple(key)), where)

    @property
    def unmatched(self) -> int:
        return sum(len(v) for v in self._by_key.values())


class CaptureLinks:
    """One capture's side of a joined trace's StallLinks: its slices take flows under its own index; the
    stalls, and the notes on them, are the joined export's (empty here)."""

    malformed = 0
    unmatched = 0

    def __init__(self, links: StallLinks, capture: int) -> None:
        self._links, self._capture = links, capture
        self.stalls: list[Stall] = []

    @property
    def waiting(self) -> bool:
        return self._links.waiting

    def take(self, key: EvidenceKey) -> list[int]:
        return self._links.take(key, self._capture)

    def flows_of(self, index: int) -> list[int]:
        return []


def _evidence_entry_key(ev: Any) -> tuple[str, int, int, int] | None:
    try:
        kind = EVIDENCE_KINDS.get(str(ev["kind"]))
        if kind is None:
            return None
        return evidence_key(kind, int(ev["pid"]), int(ev.get("tid", 0)), int(ev["start_ns"]))
    except (TypeError, KeyError, ValueError, AttributeError):
        return None
