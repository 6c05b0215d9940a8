"""How a process gets an agent: at startup from the environment, dormant until offered, or injected.

``arm()`` is what boot/sitecustomize.py calls. With GPUTRACE_AGENT_SOCK set (``gputrace capture -- CMD``)
the agent connects at once, from its own thread. With GPUTRACE_AGENT=1 (a service armed by ``gputrace
env``) a daemon thread stat()s ``<attach dir>/<pid>.sock`` once a second and connects when a session
offers it. Forked children get their own connection (the parent's socket speaks for the parent's pid).
"""

from __future__ import annotations

import atexit
import contextlib
import os
import sys
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import gputrace
from gputrace.agent import wire
from gputrace.agent.threads import debug as _debug
from gputrace.agent.threads import start_thread

if TYPE_CHECKING:
    from gputrace.agent.backend import GpuBackend
    from gputrace.agent.runtime import Agent

WATCH_PERIOD_S = 1.0

# What a dormant process pays is this module and one thread that stat()s once a second; the agent
# runtime (sockets, logging, msgpack) is loaded only when a session offers itself.
_agent: Agent | None = None
_mode = ""  # "socket", "armed" or "attached"
_early: list[GpuBackend] = []  # registered while there is no agent (yet)
_lock = threading.Lock()
_exiting = threading.Event()
_hooks_installed = False


def current() -> Agent | None:
    """This process's agent, or None when it was never armed (then nothing is ever sent)."""
    return _agent


def register_backend(backend: GpuBackend) -> bool:
    """Give a backend to this process's agent; False when there is none (the backend stays silent)."""
    with _lock:
        agent = _agent
        if agent is None:
            # Kept for an agent made later: at a dormant process's first offer, or by injection.
            if not any(b is backend for b in _early):
                _early.append(backend)
            return _mode == "armed"
    agent.add_backend(backend)
    return True


def arm(environ: Mapping[str, str] | None = None) -> Agent | None:
    """Arm this process from its environment; does nothing when neither variable is set."""
    env = os.environ if environ is None else environ
    sock = env.get(wire.ENV_SOCKET, "")
    if sock:
        return _install("socket", sock)
    if env.get(wire.ENV_ARMED, "") not in ("", "0"):
        return _install("armed", "")
    return None


def attach(sock_path: str) -> Agent:
    """Connect to a session now (what an injected process runs)."""
    agent = _agent
    if agent is None:
        return _install("attached", sock_path)  # type: ignore[return-value]
    if not agent.connected:
        agent.sock_path = sock_path
        agent.connect()
    return agent


def environ_of(pid: int) -> dict[bytes, bytes]:
    """The environment process ``pid`` was started with (/proc/PID/environ); empty where it cannot be read."""
    try:
        with open(f"/proc/{int(pid)}/environ", "rb") as f:
            return dict(e.partition(b"=")[::2] for e in f.read().split(b"\0") if e)
    except OSError:
        return {}


def armed_by(env: Mapping[bytes, bytes]) -> bool:
    """Whether an environment (``environ_of``'s) holds arming variables."""
    return bool(env.get(wire.ENV_SOCKET.encode())) or env.get(wire.ENV_ARMED.encode(), b"") not in (b"", b"0")


def is_armed(pid: int) -> bool:
    """Whether process ``pid`` was started with arming variables (from its /proc environ)."""
    return armed_by(environ_of(pid))


def attach_dir(environ: Mapping[str, str] | None = None) -> str:
    env = os.environ if environ is None else environ
    return env.get(wire.ENV_ATTACH_DIR) or wire.DEFAULT_ATTACH_DIR


def _install(mode: str, sock: str) -> Agent | None:
    global _mode
    if _mode:
        return _agent
    _mode = mode
    _install_hooks()
    _watch_collectives()
    if mode == "armed":
        _start_watcher()
        return None
    agent = _create(sock, eager=mode == "socket")
    agent.connect()
    return agent


def _create(sock: str, *, eager: bool) -> Agent:
    global _agent
    from gputrace.agent.runtime import Agent

    agent = Agent(sock, eager=eager)
    agent.discover = discover_cupti
    with _lock:
        _agent = agent
        early = _early[:]
        _early.clear()
    for backend in early:
        agent.add_backend(backend)
    return agent


def _start_watcher() -> None:
    start_thread(_watch)


def _install_hooks() -> None:
    global _hooks_installed
    if not _hooks_installed:
        _hooks_installed = True
        atexit.register(_at_exit)
        os.register_at_fork(after_in_child=_after_fork_child)


def _watch_collectives() -> None:
    """torch.distributed's collectives recorded (gputrace.agent.collectives): wrapped now where the target
    already imported it (an injected agent), else when it does. A target without it pays one finder's
    name test per import."""
    try:
        from gputrace.agent import collectives

        collectives.install()
    except Exception as e:  # noqa: BLE001 - the agent must arm whatever torch does
        _debug("collectives not watched: %s", e)


def _at_exit() -> None:
    _exiting.set()
    if _agent is not None:
        _agent.close()


# --------------------------------------------------------------------------------- dormant mode ---
def _watch() -> None:
    """Near-zero cost until offered: one stat() a second; the agent itself is built at the first offer.

    Reconnects only to a new offer, so a stale path left by a dead session is ignored. An offer is new when
    its file is: a file system reuses a freed inode at once (ext4 gives the next session's socket the same
    number), so the identity includes the change time, and a path that went away forgets the last one.
    """
    path = os.path.join(attach_dir(), f"{os.getpid()}.sock")
    last: tuple[int, int, int] | None = None
    while not _exiting.wait(WATCH_PERIOD_S):
        ident = _trusted_offer(path)
        if ident is None:
            last = None
            continue
        if ident == last:
            continue
        last = ident
        agent = _agent or _create(path, eager=False)
        agent.sock_path = path
        agent.serve(retry_s=0.0)


def _trusted_offer(path: str) -> tuple[int, int, int] | None:
    """(dev, ino, ctime ns) of an offer made by root or by our own user; anything else is ignored."""
    try:
        link = os.lstat(path)
        target = os.stat(path)
    except OSError:
        return None
    owners = (0, os.getuid())
    if link.st_uid not in owners or os.stat(os.path.dirname(path)).st_uid not in owners:
        return None
    return (target.st_dev, target.st_ino, target.st_ctime_ns)


# ----------------------------------------------------------------------------------------- fork ---
def _after_fork_child() -> None:
    """A forked child (a DataLoader worker) speaks for itself: a fresh connection or watcher."""
    global _lock
    _lock = threading.Lock()  # another thread may have held it at the fork
    if _mode == "armed":
        if _agent is not None:
            _agent.reset_after_fork()
        _start_watcher()
    elif _agent is not None:
        # A child of a launched command always reports (the session asked for the whole tree, and the
        # parent may still have been connecting); an injected process's children only if it was live.
        wanted = _mode == "socket" or _agent.connected
        _agent.reset_after_fork()
        if wanted:
            _agent.connect()
            _say_bye_in_multiprocessing_children()


def _say_bye_in_multiprocessing_children() -> None:
    """multiprocessing ends forked children with os._exit, skipping atexit; its own finalizers still run."""
    util: Any = sys.modules.get("multiprocessing.util")
    if util is None:
        return
    with contextlib.suppress(Exception):
        # Registered to run after multiprocessing clears the parent's finalizers in the child.
        util.register_after_fork(_agent, lambda _a: util.Finalize(None, _at_exit, exitpriority=-100))


# -------------------------------------------------------------------------------------- backends ---
def discover_cupti(agent: Agent) -> None:
    """Start CUPTI when it can work here; otherwise note why once (hello and debug log) and stay out."""
    import importlib.util

    if importlib.util.find_spec("cupti") is None:  # the common case, decided without loading the backend
        agent.unavailable["cupti"] = "cupti-python is not installed (pip install cupti-python)"
        _debug("CUPTI unavailable: %s", agent.unavailable["cupti"])
        return
    try:
        from gputrace.probes.cupti import CuptiBackend

        ok: Any = CuptiBackend.available()
    except Exception as e:  # noqa: BLE001 - ImportError, missing libraries, anything: not our target's problem
        agent.unavailable["cupti"] = f"{type(e).__name__}: {e}"
        _debug("CUPTI unavailable: %s", agent.unavailable["cupti"])
        return
    reason = ""
    if isinstance(ok, tuple):
        ok, reason = bool(ok[0]), str(ok[1]) if len(ok) > 1 else ""
    if not ok:
        agent.unavailable["cupti"] = reason or "unavailable"
        _debug("CUPTI unavailable: %s", agent.unavailable["cupti"])
        return
    try:
        agent.add_backend(CuptiBackend())
    except Exception as e:  # noqa: BLE001
        agent.unavailable["cupti"] = f"{type(e).__name__}: {e}"


# ---------------------------------------------------------------------------- what arms a process ---
def boot_dir() -> str:
    """The directory holding our sitecustomize.py, which PYTHONPATH must name first."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), "boot")


def environment(sock_path: str | None, base: Mapping[str, str] | None = None) -> dict[str, str]:
    """The variables that arm a process: connect to ``sock_path`` at startup, or (None) stay dormant.

    PYTHONPATH keeps whatever ``base`` had, after the boot directory, empty entries included (each puts the
    current directory on sys.path); GPUTRACE_HOME lets an interpreter without gputrace installed still load
    the agent.
    """
    env = os.environ if base is None else base
    boot = boot_dir()
    given = env.get("PYTHONPATH", "")
    old = [p for p in given.split(os.pathsep) if p != boot] if given else []
    out = {
        "PYTHONPATH": os.pathsep.join([boot, *old]),
        wire.ENV_HOME: gputrace.import_root(),
    }
    if sock_path:
        out[wire.ENV_SOCKET] = sock_path
    else:
        out[wire.ENV_ARMED] = "1"
    nvtx = _nvtx_injection_path()
    if nvtx:
        out["NVTX_INJECTION64_PATH"] = nvtx
    return out


def _nvtx_injection_path() -> str:
    """libcupti for NVTX injection, only where CUPTI can run: on a host without the CUDA driver, naming it
    would make every NVTX-using process load a library that cannot work there."""
    try:
        from gputrace.probes.cupti import CuptiBackend, nvtx_injection_path

        if not CuptiBackend.available()[0]:
            return ""
        return str(nvtx_injection_path() or "")
    except Exception:  # noqa: BLE001 - no CUPTI here: NVTX ranges simply are not collected
        return ""
