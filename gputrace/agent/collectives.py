"""Collective identity from torch.distributed, recorded in the target (docs/agent.md, "Collectives").

When the target imports ``torch.distributed`` (or already had, for an agent injected later), its collective
entry points (all_reduce, broadcast, all_gather, reduce_scatter, ...) are wrapped: each call becomes a
``CollectiveCall`` record on the capture clock, naming the communicator, the collective's sequence number in
it, its op, bytes, rank, world size and backend, when this rank arrived (the call entered) and when the
collective completed (the call returned; an async op's work finished).

The communicator id must be the same on every rank, on every host, and differ between groups: it is a hash
of what all ranks of a group were given alike, the rendezvous store (a TCPStore's host and port, a
FileStore's path), the group's name (PyTorch numbers groups in creation order, which every rank follows)
and the group's ranks. The sequence number is PyTorch's own per-group count where the process group keeps
one (gloo and NCCL do, from the group's creation: an agent injected mid-run still numbers instances as
the other ranks do), else this process's count of calls on the group.

Without a session nothing is recorded: a wrapped call costs one attribute test.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

# torch.distributed's collectives and the name each is recorded under (point-to-point send/recv have no
# group-wide sequence and are left alone)
OPS = ("all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
       "reduce_scatter_tensor", "reduce", "barrier", "all_to_all", "all_to_all_single", "gather", "scatter")
# The argument holding what this rank sends, where it is not the first (output first, then input)
INPUT_AT = {"all_gather": 1, "all_gather_into_tensor": 1, "reduce_scatter": 1, "reduce_scatter_tensor": 1,
            "all_to_all": 1, "all_to_all_single": 1, "barrier": -1}
MODULE = "torch.distributed.distributed_c10d"
WRAPPED = "__gputrace_wrapped__"
MAX_IDS = 256  # communicator ids kept per process (groups are few; a job making groups forever is not)

Emit = Callable[[Sequence[tuple[Any, ...]]], None]


def _now() -> int:
    return time.clock_gettime_ns(time.CLOCK_MONOTONIC)


class CollectiveBackend:
    """The agent backend of torch.distributed's collectives: its records go out only while a session runs."""

    name = "torch.distributed"
    fork_safe = True  # plain Python state: a forked rank records for itself

    def __init__(self) -> None:
        self._emit: Emit | None = None
        self._registered_in = 0
        self._ids: dict[int, str] = {}  # id() of a process group -> its communicator id
        self._counts: dict[str, int] = {}  # comm -> calls, where the group keeps no sequence number
        self._local = threading.local()
        self.dropped = 0  # calls whose identity could not be read

    @property
    def enabled(self) -> bool:
        return self._emit is not None

    def start(self, emit: Emit) -> None:
        self._emit = emit

    def stop(self) -> None:
        self._emit = None  # records are handed over as calls complete: nothing is pending here

    def drops(self) -> dict[str, int]:
        return {"collective": self.dropped} if self.dropped else {}

    def info(self) -> dict[str, str]:
        return {}

    def register(self) -> None:
        """Known to this process's agent (once per process: a forked child registers again)."""
        if self._registered_in != os.getpid():
            from gputrace.agent import arming

            self._registered_in = os.getpid()
            arming.register_backend(self)

    # ------------------------------------------------------------------------------------ calls ---
    def call(self, sig: Signature, fn: Callable[..., Any], args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        """``fn(*args, **kwargs)``, recorded when a session runs and this is the outermost collective."""
        if self._emit is None or getattr(self._local, "inside", False):
            return fn(*args, **kwargs)
        start, tid = _now(), threading.get_native_id()
        self._local.inside = True
        try:
            out = fn(*args, **kwargs)
        finally:
            self._local.inside = False
        end = _now()
        try:
            is_async = bool(sig.get(args, kwargs, "async_op"))
            nbytes = _nbytes(sig.get(args, kwargs, sig.input))
            row = self._row(sig.name, sig.get(args, kwargs, "group"), nbytes, tid, start, end, not is_async)
        except Exception:  # noqa: BLE001 - reading identity must never break the target's collective
            self.dropped += 1
            return out
        if row is None:
            return out
        if is_async and out is not None and hasattr(out, "get_future"):
            self._on_done(out, row)
        else:
            self._send(row)
        return out

    def _on_done(self, work: Any, row: tuple[Any, ...]) -> None:
        """An async op completes later: recorded then, from the future's callback (gloo's own thread)."""
        def done(_fut: Any) -> None:
            self._send(row._replace(end_ns=_now()))  # type: ignore[attr-defined]

        try:
            work.get_future().add_done_callback(done)
        except Exception:  # noqa: BLE001 - a Work without a future (some backends): its enqueue is what is known
            self._send(row)

    def _send(self, row: tuple[Any, ...]) -> None:
        out = self._emit
        if out is not None:
            out([row])

    def _row(self, name: str, group: Any, nbytes: int, tid: int, start: int, end: int,
             waited: bool) -> tuple[Any, ...] | None:
        from gputrace.records import CollectiveCall

        c10d = sys.modules.get(MODULE)
        if c10d is None:
            return None
        pg = group if group is not None else c10d._get_default_group()
        comm = self._comm(c10d, pg)
        backend = str(c10d.get_backend(pg))
        seq = self._seq(pg, comm)
        waited = waited and backend == "gloo"  # NCCL's call only enqueues: its kernel waits on the device
        return CollectiveCall(os.getpid(), tid, name, comm, seq, int(c10d.get_rank(pg)), int(c10d.get_world_size(pg)),
                              nbytes, backend[:32], start, end, waited)

    def _seq(self, pg: Any, comm: str) -> int:
        get = getattr(pg, "_get_sequence_number_for_group", None)
        if get is not None:
            try:
                return int(get())
            except Exception:  # noqa: BLE001 - a group that keeps none: counted here
                pass
        self._counts[comm] = self._counts.get(comm, 0) + 1
        return self._counts[comm]

    def _comm(self, c10d: Any, pg: Any) -> str:
        comm = self._ids.get(id(pg))
        if comm is None:
            comm = communicator_id(c10d, pg)
            if len(self._ids) >= MAX_IDS:
                self._ids.clear()
            self._ids[id(pg)] = comm
        return comm


def communicator_id(c10d: Any, pg: Any) -> str:
    """What every rank of ``pg`` computes alike: a hash of the rendezvous store's address, the group's name
    (its creation order) and its ranks."""
    import hashlib

    store: Any = None
    pg_map = getattr(getattr(c10d, "_world", None), "pg_map", {})
    if pg in pg_map:
        store = pg_map[pg][1]
    elif hasattr(c10d, "_get_default_store"):
        store = c10d._get_default_store()
    try:
        ranks = list(c10d.get_process_group_ranks(pg))
    except Exception:  # noqa: BLE001 - older releases: the group's size names it
        ranks = [int(c10d.get_world_size(pg))]
    text = f"{store_address(store)}|{getattr(pg, 'group_name', '')}|{','.join(map(str, ranks))}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def store_address(store: Any) -> str:
    """The rendezvous every rank reached: a TCPStore's host and port, a FileStore's path (below any
    PrefixStore); else the launcher's variables, which every rank of a job is given alike."""
    for _ in range(16):
        inner = getattr(store, "underlying_store", None)
        if inner is None:
            break
        store = inner
    host, port, path = (getattr(store, k, None) for k in ("host", "port", "path"))
    if host is not None and port is not None:
        return f"tcp:{host}:{port}"
    if path:
        return f"file:{path}"
    env = os.environ
    return f"env:{env.get('MASTER_ADDR', '')}:{env.get('MASTER_PORT', '')}:{env.get('TORCHELASTIC_RUN_ID', '')}"


class Signature:
    """Where a collective takes its group, its async flag and what it sends, read once when it is wrapped."""

    def __init__(self, name: str, fn: Callable[..., Any]) -> None:
        import inspect

        try:
            params = list(inspect.signature(fn).parameters)
        except (TypeError, ValueError):
            params = []
        self.name = name
        at = INPUT_AT.get(name, 0)
        self.input = params[at] if 0 <= at < len(params) else ""
        self.at = {p: i for i, p in enumerate(params)}

    def get(self, args: tuple[Any, ...], kwargs: dict[str, Any], param: str) -> Any:
        if param in kwargs:
            return kwargs[param]
        i = self.at.get(param, -1)
        return args[i] if 0 <= i < len(args) else None


def _nbytes(v: Any) -> int:
    """Bytes of a tensor, or of a list of tensors; 0 for anything else."""
    if isinstance(v, list | tuple):
        return sum(_nbytes(x) for x in v[:4096])
    numel, size = getattr(v, "numel", None), getattr(v, "element_size", None)
    if callable(numel) and callable(size):
        try:
            return int(numel()) * int(size())
        except Exception:  # noqa: BLE001
            return 0
    return 0


BACKEND = CollectiveBackend()


# ---------------------------------------------------------------------------------- wrapping ---
def wrap(c10d: Any, package: Any = None) -> int:
    """Wrap ``c10d``'s collectives, and ``package``'s names bound to the same functions (torch.distributed
    re-exports them); returns how many were wrapped. Wrapping twice wraps nothing more."""
    n = 0
    for name in OPS:
        fn = getattr(c10d, name, None)
        if fn is None or getattr(fn, WRAPPED, False) or not callable(fn):
            continue
        wrapped = _wrapper(name, fn)
        setattr(c10d, name, wrapped)
        if package is not None and getattr(package, name, None) is fn:
            setattr(package, name, wrapped)
        n += 1
    if n:
        BACKEND.register()
    return n


def _wrapper(name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
    sig = Signature(name, fn)

    def collective(*args: Any, **kwargs: Any) -> Any:
        return BACKEND.call(sig, fn, args, kwargs)

    collective.__name__ = collective.__qualname__ = getattr(fn, "__name__", name)
    collective.__doc__ = getattr(fn, "__doc__", None)
    collective.__wrapped__ = fn  # type: ignore[attr-defined]
    setattr(collective, WRAPPED, True)
    return collective


def wrap_loaded() -> bool:
    """Wrap now if torch.distributed is already imported (an agent injected into a running process)."""
    c10d = sys.modules.get(MODULE)
    if c10d is None or not getattr(c10d, "is_available", lambda: True)():
        return False
    wrap(c10d, sys.modules.get("torch.distributed"))
    return True


class _Finder:
    """A meta path finder that only waits for torch.distributed's c10d module to be imported, then wraps it
    as soon as its body ran (before torch.distributed re-exports its names). Every other import passes."""

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> Any:
        if name != MODULE:
            return None
        import importlib.machinery

        spec = importlib.machinery.PathFinder.find_spec(name, path, target)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return spec
        loader, run = spec.loader, spec.loader.exec_module

        def exec_module(module: Any) -> None:
            run(module)
            try:
                wrap(module)
            except Exception:  # noqa: BLE001 - the target's import must succeed whatever happens here
                BACKEND.dropped += 1

        loader.exec_module = exec_module  # type: ignore[method-assign]
        return spec


def install() -> None:
    """Wrap torch.distributed now if loaded, else when it is imported; once per process."""
    if wrap_loaded() or any(isinstance(f, _Finder) for f in sys.meta_path):
        return
    sys.meta_path.insert(0, _Finder())
