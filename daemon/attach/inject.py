"""Attach the agent to a running, unarmed Python process: with ``sys.remote_exec`` (Python >= 3.14), or with
a ptrace injector of ours and ``Py_AddPendingCall`` (Python 3.9 to 3.13: gputrace.daemon.attach.pyattach). Both
run the same script.

``sys.remote_exec`` only works between interpreters of the same version, so the call is made by the
target's own interpreter (its /proc/PID/exe), in a helper process. That file is the target owner's (or a
container's) to choose, so the helper runs with the target's credentials, in its container's namespaces
and root when it has them (gputrace.daemon.attach.nsexec), never with ours. A host process is in no container, even
seen from gputraced's own mount and network namespaces: the helper then stays in the service's sandbox,
which gives it less than the host would. Before trying, everything that would make it fail is checked and
reported as one clear line: not Python, too old, remote debugging disabled, no permission to ptrace it, a
container that cannot be entered, an interpreter the sandbox does not show at its path.

A process that sees another filesystem than ours (a container's, or the host's seen from gputraced, whose
/tmp is private) is given the session's socket and the script in its own root (the caller makes them there,
through /proc/PID/root: daemon/agents/server.py); the script carries the agent's modules, which it may lack.
"""

from __future__ import annotations

import ast
import base64
import contextlib
import functools
import importlib.util
import json
import os
import re
import signal
import subprocess
import zlib
from dataclasses import dataclass
from pathlib import Path

from gputrace.caps import CAP_SYS_ADMIN, CAP_SYS_PTRACE, has_cap
from gputrace.daemon.agents.listen import as_owner, container_root, in_container, own_namespace
from gputrace.daemon.agents.pidns import PeerIds
from gputrace.daemon.attach import nsexec, pyattach
from gputrace.daemon.attach.nsexec import trusted_binary
from gputrace.errors import PermissionDenied, UserError
from gputrace.probes import procfs

MIN_VERSION = (3, 14)  # sys.remote_exec; older interpreters (from pyattach.MIN_VERSION) through ptrace
HELPER_TIMEOUT_S = 10.0
_VERSION_RE = re.compile(r"python(\d+)\.(\d+)")
METHODS = ("sys.remote_exec", "ptrace")


@dataclass(frozen=True)
class Injection:
    """How the agent was sent: the script the target was told to run (as the target sees it), the way
    ("sys.remote_exec" or "ptrace") and, for ptrace, how long the target's main thread was stopped (ms)."""

    script: Path
    method: str
    pause_ms: float | None = None

    def describe(self) -> str:
        if self.pause_ms is None:
            return f"injected ({self.method})"
        return f"injected (ptrace, Py_AddPendingCall; its main thread was stopped {self.pause_ms:.1f} ms)"


def inject(pid: int, sock_path: str, dir_fd: int | None = None, owner: tuple[int, int] | None = None,
           method: str | None = None) -> Injection:
    """Make ``pid`` run the agent and connect to ``sock_path`` (as it sees that path). The script it is given
    lies beside the socket (in ``dir_fd`` when the caller made the socket in a container, made as ``owner``
    where that must be: listen.owner_for), so the session's cleanup removes it with the socket.

    ``method``: "sys.remote_exec" (Python >= 3.14) or "ptrace" (Python >= 3.9); by default the first the
    interpreter has. Everything that would make it fail is checked before anything is written."""
    exe = target_exe(pid)
    version = python_version(pid, exe)
    if method is None:
        method = "sys.remote_exec" if version >= MIN_VERSION else "ptrace"
    if method not in METHODS:
        raise UserError(f"unknown way to inject the agent: {method!r} (one of {', '.join(METHODS)})")
    if method == "ptrace":
        return _inject_ptrace(pid, exe, version, sock_path, dir_fd, owner)
    if version < MIN_VERSION:
        raise UserError(
            f"pid {pid} runs Python {version[0]}.{version[1]} ({exe}); sys.remote_exec needs Python >= 3.14"
        )
    check_remote_debug_allowed(pid)
    check_ptrace_permission(pid, exe)
    with as_owner(owner):
        script = write_script(PeerIds(int(pid)).own_pid, sock_path, dir_fd)
    run_helper(exe, pid, script)
    return Injection(script, "sys.remote_exec")


def _inject_ptrace(pid: int, exe: str, version: tuple[int, int], sock_path: str, dir_fd: int | None,
                   owner: tuple[int, int] | None) -> Injection:
    if version < pyattach.MIN_VERSION:
        low = pyattach.MIN_VERSION
        raise UserError(f"pid {pid} runs Python {version[0]}.{version[1]} ({exe}); attaching to a running process "
                        f"needs Python >= {low[0]}.{low[1]}. Start it armed instead: see `gputrace env`")
    ptrace = pyattach.check(pid)
    with as_owner(owner):
        script = write_script(PeerIds(int(pid)).own_pid, sock_path, dir_fd)
    result = pyattach.run(pid, script, ptrace=ptrace)
    return Injection(script, "ptrace", result.pause_ms)


def target_exe(pid: int) -> str:
    proc = Path(f"/proc/{int(pid)}")
    if not proc.is_dir():
        raise UserError(f"no process with pid {pid}")
    try:
        return os.readlink(proc / "exe")
    except PermissionError:
        if os.geteuid() == 0:  # root refused: the process hides its executable (pid 1 under some inits, LSMs)
            raise UserError(f"pid {pid}: its executable (/proc/{pid}/exe) cannot be read, even by root; "
                            "start it armed instead (see `gputrace env`)") from None
        raise PermissionDenied(f"cannot read /proc/{pid}/exe: run as root or as the process's user") from None
    except OSError as e:
        if not procfs.running(pid):
            raise UserError(f"pid {pid} has exited") from None
        raise UserError(f"pid {pid}: cannot read its executable ({e.strerror}); is it a kernel thread?") from None


def python_version(pid: int, exe: str) -> tuple[int, int]:
    """The interpreter version, from the executable's name or a libpython in its maps."""
    m = _VERSION_RE.search(os.path.basename(exe))
    if m is None:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text(errors="replace")
        except OSError:
            maps = ""
        m = re.search(r"libpython(\d+)\.(\d+)", maps)
    if m is None:
        raise UserError(f"pid {pid} is not a Python process ({exe}); only Python processes can take the agent")
    return int(m.group(1)), int(m.group(2))


def check_remote_debug_allowed(pid: int) -> None:
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return  # the ptrace check below names the permission problem
    if any(e.startswith(b"PYTHON_DISABLE_REMOTE_DEBUG=") and e != b"PYTHON_DISABLE_REMOTE_DEBUG=" for e in environ):
        raise UserError(f"pid {pid} disables remote debugging (PYTHON_DISABLE_REMOTE_DEBUG); start it armed instead")
    if any(b"disable_remote_debug" in a for a in cmdline):
        raise UserError(f"pid {pid} disables remote debugging (-X disable_remote_debug); start it armed instead")


def check_ptrace_permission(pid: int, exe: str) -> None:
    """What the kernel will demand of the helper's ptrace access. Run by root, the helper has the target's
    own credentials, which suffice unless Yama limits ptrace to ancestors: then it also gets CAP_SYS_PTRACE,
    but only to run an interpreter of the host's that only root can change. Run by anyone else, it has
    theirs: the target's user, and CAP_SYS_PTRACE for Yama."""
    scope = _read_int("/proc/sys/kernel/yama/ptrace_scope", 0)
    if scope >= 3:
        raise PermissionDenied("ptrace is disabled on this host (kernel.yama.ptrace_scope = 3)")
    try:
        uid = os.stat(f"/proc/{pid}").st_uid
    except OSError:
        raise UserError(f"no process with pid {pid}") from None
    if os.geteuid() == 0:
        # A container's namespaces are entered; the host's are not, even where ours differ (gputraced runs
        # in a mount, network and UTS namespace of its own): the helper then stays in ours (nsexec).
        contained = any(in_container(pid, n) for n in (*nsexec.NAMESPACES, "user"))
        if contained and not has_cap(CAP_SYS_ADMIN):
            raise PermissionDenied(
                f"pid {pid} runs in a container, and entering it needs CAP_SYS_ADMIN, which this process does "
                f"not hold (gputraced does not keep it): run `sudo gputrace capture -p {pid}`, or start it armed"
            )
        foreign = container_root(pid)
        if not foreign and not own_namespace(pid, "mnt"):
            check_interpreter_visible(pid, exe)
        if scope >= 1 and (foreign or not trusted_binary(exe)):
            why = "it runs in a container" if foreign else f"its interpreter {exe} is not root's alone"
            raise PermissionDenied(
                f"kernel.yama.ptrace_scope = {scope} lets only ancestors attach, and the attach helper cannot be "
                f"given CAP_SYS_PTRACE for pid {pid} ({why}); start it armed instead: see `gputrace env`"
            )
        return
    if uid != os.geteuid():
        raise PermissionDenied(f"pid {pid} belongs to uid {uid}: attaching needs root")
    if scope >= 1 and not has_cap(CAP_SYS_PTRACE):
        raise PermissionDenied(
            f"kernel.yama.ptrace_scope = {scope} lets only ancestors attach; attaching needs CAP_SYS_PTRACE"
        )


def check_interpreter_visible(pid: int, exe: str) -> None:
    """A host process seen from our own mount namespace (gputraced's): the helper runs its interpreter in
    ours, where that interpreter must find its own files at the paths the process has them, and where Yama's
    trust in it (``trusted_binary``) is judged by its path. So the path must name the very file the process
    runs, here too: not one in a private /tmp or a hidden home directory, or another file put in its place."""
    try:
        a, b = os.stat(exe), os.stat(f"/proc/{pid}/exe")
        same = (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)
    except OSError:
        same = False
    if not same:
        raise UserError(
            f"pid {pid}: its interpreter {exe} is not that file in this process's view of the file system "
            "(gputraced has a private /tmp and may hide home directories), where the attach helper would run "
            f"it; run `sudo gputrace capture -p {pid}`, or start it armed"
        )


def _read_int(path: str, default: int) -> int:
    try:
        return int(Path(path).read_text().strip())
    except (OSError, ValueError):
        return default


def write_script(pid: int, sock_path: str, dir_fd: int | None = None) -> Path:
    """The code the target runs, written beside ``sock_path`` (the socket as the target sees it), or into
    ``dir_fd`` (that directory inside a container's root, opened by the caller); its path as the target sees it.

    It carries the agent's own modules, so a target that cannot import gputrace (most can't) still runs
    it: they are loaded from memory, leaving nothing behind that the target might need later.
    """
    name = script_name(pid)
    code = _SCRIPT.format(sources=_packed_sources(), sock=sock_path).encode()
    if dir_fd is None:
        where = Path(sock_path).parent
        fd = os.open(where / name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=dir_fd)  # left by a session that died (a file or a link, never followed)
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644, dir_fd=dir_fd)
    with os.fdopen(fd, "wb") as f:
        os.fchmod(f.fileno(), 0o644)
        f.write(code)
    return Path(sock_path).parent / name


def script_name(pid: int) -> str:
    return f"inject-{int(pid)}.py"


_SCRIPT = """\
def _gputrace_attach():
    import base64, importlib.abc, importlib.util, json, sys, zlib
    if importlib.util.find_spec("gputrace") is None:
        sources = json.loads(zlib.decompress(base64.b64decode({sources!r})))

        class Embedded(importlib.abc.MetaPathFinder, importlib.abc.Loader):
            def find_spec(self, name, path=None, target=None):
                if name in sources:
                    return importlib.util.spec_from_loader(name, self, is_package=sources[name][0])
                return None

            def create_module(self, spec):
                return None

            def exec_module(self, module):
                code = compile(sources[module.__name__][1], "<gputrace>/" + module.__name__, "exec")
                exec(code, module.__dict__)

        sys.meta_path.append(Embedded())
    from gputrace.agent import arming
    arming.attach({sock!r})
_gputrace_attach()
"""

AGENT_ROOTS = ("gputrace.agent.arming", "gputrace.agent.runtime", "gputrace.sim", "gputrace.probes.cupti")


@functools.cache
def _packed_sources() -> str:
    return base64.b64encode(zlib.compress(json.dumps(agent_sources()).encode(), 9)).decode()


def agent_sources(roots: tuple[str, ...] = AGENT_ROOTS) -> dict[str, tuple[bool, str]]:
    """The agent's modules, by name: (is a package, source). The closure of the gputrace modules that
    ``roots`` import, anywhere in them (a function's import included), with every parent package."""
    out: dict[str, tuple[bool, str]] = {}
    todo = list(roots)
    while todo:
        name = todo.pop()
        if name in out or not name.startswith("gputrace"):
            continue
        spec = importlib.util.find_spec(name)
        if spec is None or spec.origin is None or not spec.origin.endswith(".py"):
            continue
        source = Path(spec.origin).read_text()
        is_pkg = spec.submodule_search_locations is not None
        out[name] = (is_pkg, source)
        package = name if is_pkg else name.rpartition(".")[0]
        todo.extend(_parents(name))
        todo.extend(_imported(source, package))
    return out


def _parents(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _imported(source: str, package: str) -> list[str]:
    found: list[str] = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = importlib.util.resolve_name("." * node.level + base, package)
            found.append(base)
            found += [f"{base}.{a.name}" for a in node.names if _is_module(f"{base}.{a.name}")]
    return [n for n in found if n.startswith("gputrace")]


def _is_module(name: str) -> bool:
    if not name.startswith("gputrace"):
        return False
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def run_helper(exe: str, pid: int, script: Path) -> None:
    """``sys.remote_exec`` from the target's own interpreter. Run by root, it runs as the target would
    (nsexec: its credentials, namespaces and root), so the file we execute gains nothing by being run by us."""
    nspid = PeerIds(int(pid)).own_pid
    call = ["-I", "-c", f"import sys; sys.remote_exec({nspid}, {str(script)!r})"]
    if os.geteuid() == 0:
        ptrace = _read_int("/proc/sys/kernel/yama/ptrace_scope", 0) >= 1
        argv = nsexec.argv_for(pid, ["@exe", *call], ptrace=ptrace)
    else:
        argv = [exe, *call]
    try:
        helper = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                  text=True, start_new_session=True)
    except OSError as e:
        raise UserError(f"pid {pid}: cannot run its interpreter {exe}: {e.strerror}") from None
    try:
        _, err = helper.communicate(timeout=HELPER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(helper.pid, signal.SIGKILL)  # the launcher and the helper it forked
        helper.communicate()
        raise UserError(f"pid {pid}: sys.remote_exec did not return within {HELPER_TIMEOUT_S:g} s") from None
    if helper.returncode != 0:
        last = (err.strip().splitlines() or ["no message"])[-1]
        raise UserError(f"pid {pid}: sys.remote_exec failed: {last}")
