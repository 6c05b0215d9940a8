"""Attach the agent to a running, unarmed Python process with ``sys.remote_exec`` (Python >= 3.14).

``sys.remote_exec`` only works between interpreters of the same version, so the call is made by the
target's own interpreter (its /proc/PID/exe), in a helper process. Before trying, everything that would
make it fail is checked and reported as one clear line: not Python, too old, remote debugging disabled,
no permission to ptrace it.
"""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

from gputrace.errors import PermissionDenied, UserError

MIN_VERSION = (3, 14)
HELPER_TIMEOUT_S = 10.0
_VERSION_RE = re.compile(r"python(\d+)\.(\d+)")


def inject(pid: int, sock_path: str) -> Path:
    """Make ``pid`` run the agent and connect to ``sock_path``; returns the script it was given.

    The script lies beside the socket, so the session's cleanup removes it with the socket.
    """
    exe = target_exe(pid)
    version = python_version(pid, exe)
    if version < MIN_VERSION:
        raise UserError(
            f"pid {pid} runs Python {version[0]}.{version[1]} ({exe}); attaching to a running process needs "
            f"Python >= 3.14 (sys.remote_exec). Start it armed instead: see `gputrace env`"
        )
    check_remote_debug_allowed(pid)
    check_ptrace_permission(pid)
    script = write_script(pid, sock_path)
    run_helper(exe, pid, script)
    return script


def target_exe(pid: int) -> str:
    proc = Path(f"/proc/{int(pid)}")
    if not proc.is_dir():
        raise UserError(f"no process with pid {pid}")
    try:
        return os.readlink(proc / "exe")
    except PermissionError:
        raise PermissionDenied(f"cannot read /proc/{pid}/exe: run as root or as the process's user") from None
    except OSError as e:
        raise UserError(f"pid {pid}: cannot read its executable ({e.strerror}); is it a kernel thread?") from None


def python_version(pid: int, exe: str) -> tuple[int, int]:
    """The interpreter version, from the executable's name or a libpython in its maps."""
    m = _VERSION_RE.search(os.path.basename(exe))
    if m is None:
        try:
            maps = Path(f"/proc/{pid}/maps").read_text()
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


def check_ptrace_permission(pid: int) -> None:
    """What the kernel will demand of the helper's ptrace access: same user or CAP_SYS_PTRACE, and Yama."""
    scope = _read_int("/proc/sys/kernel/yama/ptrace_scope", 0)
    if scope >= 3:
        raise PermissionDenied("ptrace is disabled on this host (kernel.yama.ptrace_scope = 3)")
    if _has_cap_sys_ptrace():
        return
    try:
        uid = os.stat(f"/proc/{pid}").st_uid
    except OSError:
        raise UserError(f"no process with pid {pid}") from None
    if uid != os.geteuid():
        raise PermissionDenied(f"pid {pid} belongs to uid {uid}: attaching needs root or CAP_SYS_PTRACE")
    if scope >= 1:
        raise PermissionDenied(
            f"kernel.yama.ptrace_scope = {scope} lets only ancestors attach; attaching needs CAP_SYS_PTRACE"
        )


def _read_int(path: str, default: int) -> int:
    try:
        return int(Path(path).read_text().strip())
    except (OSError, ValueError):
        return default


def _has_cap_sys_ptrace() -> bool:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("CapEff:"):
            return bool(int(line.split()[1], 16) & (1 << 19))
    return False


def write_script(pid: int, sock_path: str) -> Path:
    """The code the target runs: load the agent (from this gputrace if it has none) and connect."""
    home = str(Path(__file__).resolve().parents[2])
    code = f"""\
import importlib.util, os, sys
if importlib.util.find_spec("gputrace") is None:
    _init = os.path.join({home!r}, "gputrace", "__init__.py")
    _spec = importlib.util.spec_from_file_location(
        "gputrace", _init, submodule_search_locations=[os.path.dirname(_init)])
    _mod = importlib.util.module_from_spec(_spec)
    sys.modules["gputrace"] = _mod
    _spec.loader.exec_module(_mod)
from gputrace.agent import arming
arming.attach({sock_path!r})
"""
    script = Path(sock_path).parent / f"inject-{int(pid)}.py"
    script.write_text(code)
    script.chmod(0o644)
    return script


def run_helper(exe: str, pid: int, script: Path) -> None:
    argv = [exe, "-I", "-c", f"import sys; sys.remote_exec({int(pid)}, {str(script)!r})"]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=HELPER_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        raise UserError(f"pid {pid}: sys.remote_exec did not return within {HELPER_TIMEOUT_S:g} s") from None
    except OSError as e:
        raise UserError(f"pid {pid}: cannot run its interpreter {exe}: {e.strerror}") from None
    if done.returncode != 0:
        last = (done.stderr.strip().splitlines() or ["no message"])[-1]
        raise UserError(f"pid {pid}: sys.remote_exec failed: {last}")
