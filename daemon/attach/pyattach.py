"""Attach the agent to a running, unarmed CPython 3.9 to 3.13 (no ``sys.remote_exec``): a small ptrace
injector of our own.

It stops the main thread alone (PTRACE_SEIZE + PTRACE_INTERRUPT; the other threads keep running), saves its
general and SSE registers, and makes it call, by address,

    page = mmap(NULL, 4096, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0)
    (the bootstrap, a few lines of Python, written into that page through /proc/PID/mem)
    Py_AddPendingCall(PyRun_SimpleString, page)

each call returning to address 0, where the fault stops it again; then it puts every register back and
detaches. Nothing of Python runs while the thread is stopped: ``Py_AddPendingCall`` only queues the call and
sets the interpreter's eval breaker; the main thread runs the bootstrap, holding the GIL, the next time it
checks the breaker (between bytecodes, where signal handlers run). The bootstrap starts a thread that reads
and runs the same script ``sys.remote_exec`` is given on 3.14 (gputrace.daemon.attach.inject.write_script): the
same agent. ``mmap``,
not ``malloc``: the thread may have been stopped inside malloc, holding its lock. A thread stopped in a system
call has it restarted when its registers are put back, as for any signal without a handler.

Why not gdb (as memray does): the distribution's gdb 13 cannot write a thread's registers back on CPUs with
AMX (Sapphire Rapids, the CPUs of many H100 hosts): "Couldn't write extended state status: Bad address", the
interrupted system call is then not restarted and the target fails (``OSError: [Errno 514]`` from
``time.sleep``, or glibc aborting on a futex). Stopping one thread for a few milliseconds, rather than all of
them, is also gentler on a training job. x86-64 only, for now.

Run as the target's user (gputrace.daemon.attach.nsexec ``stay``: its credentials, our namespaces, plus CAP_SYS_PTRACE
where Yama needs it), as ``python -m gputrace.daemon.attach.pyattach PID SCRIPT``; prints one JSON line. It reads the
target's symbols itself (gputrace.daemon.attach.symbols), so the root side never parses the target's files.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import gputrace
from gputrace.errors import PermissionDenied, UserError

MIN_VERSION = (3, 9)
PAGE = 4096
CALL_TIMEOUT_S = 1.0  # a call that does not return by then is abandoned, its thread put back as it was
HELPER_TIMEOUT_S = 20.0
PYTHON_SYMBOLS = ("Py_AddPendingCall", "PyRun_SimpleString")
LIBC_SYMBOLS = ("mmap",)
YAMA = "/proc/sys/kernel/yama/ptrace_scope"

_PTRACE_POKEDATA, _PTRACE_CONT, _PTRACE_DETACH = 5, 7, 17
_PTRACE_GETREGS, _PTRACE_SETREGS, _PTRACE_GETFPREGS, _PTRACE_SETFPREGS = 12, 13, 14, 15
_PTRACE_SEIZE, _PTRACE_INTERRUPT, _PTRACE_EVENT_STOP = 0x4206, 0x4207, 128
_WALL = 0x40000000

# What PyRun_SimpleString runs, in the target's __main__: it defines no name there, never raises (a pending
# call that fails is taken for an exception of whatever the main thread was running), and only starts a
# thread that loads and connects the agent (tens of ms of imports, which would otherwise stall the job's
# main thread all at once). That thread does nothing when the script is gone (the session ended before the
# main thread ran Python code again) and never prints.
_LOADER = """\
import threading
def _run(p):
    try:
        exec(compile(open(p, "rb").read(), p, "exec"), {"__name__": "__gputrace_attach__"})
    except Exception:
        pass
threading.Thread(target=_run, args=(%r,), name="gputrace-attach", daemon=True).start()
"""
BOOTSTRAP = """\
try:
    __import__("builtins").exec(%r, {"__name__": "__gputrace_attach__"})
except Exception:
    pass
"""


def bootstrap(script: str) -> bytes:
    return (BOOTSTRAP % (_LOADER % script)).encode() + b"\0"


class _Regs(ctypes.Structure):
    _fields_ = [(n, ctypes.c_ulonglong) for n in (
        "r15", "r14", "r13", "r12", "rbp", "rbx", "r11", "r10", "r9", "r8", "rax", "rcx", "rdx", "rsi", "rdi",
        "orig_rax", "rip", "cs", "eflags", "rsp", "ss", "fs_base", "gs_base", "ds", "es", "fs", "gs")]


class _FpRegs(ctypes.Structure):
    _fields_ = [("data", ctypes.c_ubyte * 512)]  # the FXSAVE area: x87 and SSE state


@dataclass(frozen=True)
class Result:
    pause_ms: float


class Failed(Exception):
    """The attach failed; ``kind``: exited, denied, symbol, call."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


# ------------------------------------------------------------------------------- the caller's side ---
def yama_scope() -> int | None:
    try:
        return int(Path(YAMA).read_text().strip())
    except (OSError, ValueError):
        return None  # no Yama: ptrace is decided by credentials (and dumpability) alone


def check(pid: int) -> bool:
    """Whether the helper may ptrace ``pid``; True when it needs CAP_SYS_PTRACE for it (Yama). Raises
    PermissionDenied naming the reason and the way out."""
    from gputrace.caps import CAP_SYS_PTRACE, has_cap
    from gputrace.daemon.attach import nsexec

    if os.uname().machine != "x86_64":
        raise UserError(f"pid {pid}: attaching to a running Python < 3.14 is implemented for x86-64 only "
                        f"(this is {os.uname().machine}); start it armed instead: see `gputrace env`")
    scope = yama_scope() or 0
    if scope >= 3:
        raise PermissionDenied("ptrace is disabled on this host (kernel.yama.ptrace_scope = 3; only a reboot lowers "
                               "it): start the process armed instead, see `gputrace env`")
    try:
        uid = os.stat(f"/proc/{int(pid)}").st_uid
    except OSError:
        raise UserError(f"no process with pid {pid}") from None
    if os.geteuid() == 0:
        if scope >= 1 and not (has_cap(CAP_SYS_PTRACE) and nsexec.trusted_binary(os.path.realpath(sys.executable))):
            raise PermissionDenied(
                f"kernel.yama.ptrace_scope = {scope} lets only ancestors attach, and the attach helper cannot be "
                f"given CAP_SYS_PTRACE here: `sudo sysctl kernel.yama.ptrace_scope=0`, or start pid {pid} armed")
        return scope >= 1
    if uid != os.geteuid():
        raise PermissionDenied(f"pid {pid} belongs to uid {uid}: attaching needs root")
    if scope >= 1 and not has_cap(CAP_SYS_PTRACE):
        raise PermissionDenied(f"kernel.yama.ptrace_scope = {scope} lets only ancestors attach: run as root, or "
                               "`sudo sysctl kernel.yama.ptrace_scope=0`, or start the process armed (`gputrace env`)")
    return False


def run(pid: int, script: Path, *, ptrace: bool) -> Result:
    """Run the helper for ``pid`` (as its user when we are root) and return the target's pause."""
    from gputrace.daemon.attach import nsexec
    from gputrace.probes import procfs

    home = gputrace.import_root()
    boot = (f"import sys; sys.path.insert(0, {home!r}); "
            "from gputrace.daemon.attach.pyattach import main; sys.exit(main())")
    args = [sys.executable, "-I", "-c", boot, str(int(pid)), str(script)]
    # The helper stays in our pid namespace, so the pid it is given is ours (the host's) for a container too.
    argv = nsexec.argv_for(pid, args, ptrace=ptrace, stay=True) if os.geteuid() == 0 else args
    try:
        proc = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, errors="replace", start_new_session=True)
        out, err = proc.communicate(timeout=HELPER_TIMEOUT_S)
    except OSError as e:
        raise UserError(f"pid {pid}: cannot run the attach helper: {e.strerror}") from None
    except subprocess.TimeoutExpired:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise UserError(f"pid {pid}: the attach helper did not finish within {HELPER_TIMEOUT_S:g} s") from None
    try:
        answer = json.loads(out.strip().splitlines()[-1])
        kind, message = str(answer.get("kind", "")), str(answer.get("message", ""))[:400]
        pause = float(answer.get("pause_ms", 0.0))
    except (ValueError, IndexError, AttributeError, TypeError):
        if not procfs.running(pid):
            raise UserError(f"pid {pid} exited during the attach") from None
        last = (err.strip().splitlines() or ["no message"])[-1][:300]
        raise UserError(f"pid {pid}: the attach helper failed (exit status {proc.returncode}): {last}") from None
    if kind == "":
        return Result(pause)
    if kind == "exited" or not procfs.running(pid):
        raise UserError(f"pid {pid} exited during the attach")
    if kind == "denied":
        raise PermissionDenied(message)
    raise UserError(message)


# ---------------------------------------------------------------------------------- the helper ---
def main(args: list[str] | None = None) -> int:
    args = sys.argv[1:] if args is None else args
    try:
        pid, script = int(args[0]), args[1]
    except (ValueError, IndexError):
        print("usage: python -m gputrace.daemon.attach.pyattach PID SCRIPT", file=sys.stderr)
        return 2
    try:
        result = attach(pid, script)
        out: dict[str, object] = {"pause_ms": result.pause_ms}
    except Failed as e:
        out = {"kind": e.kind, "message": str(e)}
    except UserError as e:
        out = {"kind": "symbol", "message": str(e)}
    print(json.dumps(out), flush=True)
    return 0


def attach(pid: int, script: str) -> Result:
    from gputrace.daemon.attach import symbols as elfsyms

    code = bootstrap(script)
    if len(code) > PAGE:
        raise Failed("call", f"pid {pid}: the agent's script path is too long")
    try:
        exe = os.readlink(f"/proc/{pid}/exe")
        os.close(os.open(f"/proc/{pid}/maps", os.O_RDONLY | os.O_CLOEXEC))
    except PermissionError:  # what ptrace would refuse too: say it that way
        raise Failed("denied", _denied(pid, "Permission denied")) from None
    except OSError:
        raise Failed("exited", f"pid {pid} has exited") from None
    addrs = elfsyms.resolve(pid, exe, PYTHON_SYMBOLS, LIBC_SYMBOLS).addresses
    return _Tracer(pid).inject(addrs, code)


def _denied(pid: int, why: str) -> str:
    scope = yama_scope()
    yama = "Yama is off here" if scope is None else f"kernel.yama.ptrace_scope = {scope}"
    return (f"pid {pid}: ptrace denied ({why}; {yama}): the process may have made itself non-dumpable or changed "
            "its user, or a security module forbids it; where Yama is the cause, `sudo sysctl "
            "kernel.yama.ptrace_scope=0` allows it, else start the process armed (`gputrace env`)")


class _Tracer:
    """The target's main thread, seized."""

    def __init__(self, tid: int) -> None:
        self.tid = tid
        self.libc = ctypes.CDLL(None, use_errno=True)
        self.libc.ptrace.restype = ctypes.c_long
        self.libc.ptrace.argtypes = [ctypes.c_long, ctypes.c_long, ctypes.c_void_p, ctypes.c_void_p]
        self.signals: list[int] = []  # arrived while we held the thread: handed back at detach

    def _ptrace(self, req: int, addr: int = 0, data: object = None) -> int:
        ctypes.set_errno(0)
        ret = self.libc.ptrace(req, self.tid, addr, data)
        err = ctypes.get_errno()
        if ret == -1 and err:
            raise OSError(err, os.strerror(err))
        return int(ret)

    def inject(self, addrs: dict[str, int], code: bytes) -> Result:
        try:
            self._ptrace(_PTRACE_SEIZE)
        except OSError as e:
            if e.errno == 3:  # ESRCH
                raise Failed("exited", f"pid {self.tid} has exited") from None
            raise Failed("denied", _denied(self.tid, e.strerror or "")) from None
        t0 = time.monotonic()
        self._ptrace(_PTRACE_INTERRUPT)
        self._wait_interrupt()
        saved, fp = _Regs(), _FpRegs()
        self._ptrace(_PTRACE_GETREGS, 0, ctypes.addressof(saved))
        self._ptrace(_PTRACE_GETFPREGS, 0, ctypes.addressof(fp))
        failure: Failed | None = None
        try:
            page = self._call(saved, addrs["mmap"], 0, PAGE, 3, 0x22, (1 << 64) - 1, 0)
            if page in (0, (1 << 64) - 1) or page % PAGE:
                raise Failed("call", f"pid {self.tid}: mmap in the process failed")
            fd = os.open(f"/proc/{self.tid}/mem", os.O_RDWR | os.O_CLOEXEC)
            try:
                os.pwrite(fd, code, page)
            finally:
                os.close(fd)
            rc = ctypes.c_int32(self._call(saved, addrs["Py_AddPendingCall"], addrs["PyRun_SimpleString"], page)
                                & 0xFFFFFFFF).value
            if rc != 0:
                raise Failed("call", f"pid {self.tid}: Py_AddPendingCall refused the call ({rc}): its queue of "
                             "pending calls is full; try again")
        except Failed as e:
            failure = e
        except OSError as e:
            gone = e.errno == 3  # ESRCH: the thread is no longer there to trace
            failure = Failed("exited", f"pid {self.tid} exited during the attach") if gone else Failed(
                "call", f"pid {self.tid}: {e.strerror}")
        finally:
            self._restore(saved, fp)
        pause = (time.monotonic() - t0) * 1000
        if failure is not None:
            raise failure
        return Result(pause)

    def _restore(self, saved: _Regs, fp: _FpRegs) -> None:
        with contextlib.suppress(OSError):
            self._ptrace(_PTRACE_SETREGS, 0, ctypes.addressof(saved))
            self._ptrace(_PTRACE_SETFPREGS, 0, ctypes.addressof(fp))
        first, rest = (self.signals[0], self.signals[1:]) if self.signals else (0, [])
        with contextlib.suppress(OSError):
            self._ptrace(_PTRACE_DETACH, 0, first)
        for sig in rest:
            with contextlib.suppress(OSError):
                os.kill(self.tid, sig)

    def _call(self, saved: _Regs, func: int, *args: int) -> int:
        """Call ``func(*args)`` (up to six integer arguments) in the stopped thread; its return value."""
        regs = _Regs.from_buffer_copy(saved)
        for name, value in zip(("rdi", "rsi", "rdx", "rcx", "r8", "r9"), args, strict=False):
            setattr(regs, name, value)
        # Below the red zone, 16-byte aligned, then the return address 0, as a call instruction would leave it.
        sp = ((saved.rsp - 4096) & ~0xF) - 8
        self._ptrace(_PTRACE_POKEDATA, sp, 0)
        regs.rsp, regs.rip, regs.rax = sp, func, 0
        regs.orig_rax = (1 << 64) - 1  # not in a system call: nothing to restart on the way
        self._ptrace(_PTRACE_SETREGS, 0, ctypes.addressof(regs))
        self._ptrace(_PTRACE_CONT, 0, 0)
        deadline = time.monotonic() + CALL_TIMEOUT_S
        while True:
            status = self._wait(deadline)
            if status is None:
                self._ptrace(_PTRACE_INTERRUPT)
                self._wait_interrupt()
                raise Failed("call", f"pid {self.tid}: a call in the process did not return within "
                             f"{CALL_TIMEOUT_S:g} s; abandoned, the thread put back as it was")
            sig = os.WSTOPSIG(status)
            if sig == signal.SIGSEGV and status >> 16 == 0:
                self._ptrace(_PTRACE_GETREGS, 0, ctypes.addressof(regs))
                if regs.rip == 0:
                    return int(regs.rax)
                raise Failed("call", f"pid {self.tid}: the call faulted in the process; put back as it was")
            if status >> 16 == 0:
                self.signals.append(sig)  # delivered after we let go
            self._ptrace(_PTRACE_CONT, 0, 0)

    def _wait_interrupt(self) -> None:
        deadline = time.monotonic() + CALL_TIMEOUT_S
        while True:
            status = self._wait(deadline)
            if status is None:
                raise Failed("call", f"pid {self.tid}: the thread did not stop within {CALL_TIMEOUT_S:g} s")
            if status >> 16 == _PTRACE_EVENT_STOP:
                return
            self.signals.append(os.WSTOPSIG(status))  # a signal on its way in: kept for later
            self._ptrace(_PTRACE_CONT, 0, 0)

    def _wait(self, deadline: float) -> int | None:
        """The thread's next stop (its wait status); None at the deadline. Failed when it exited."""
        while True:
            try:
                got, status = os.waitpid(self.tid, os.WNOHANG | _WALL)
            except ChildProcessError:
                raise Failed("exited", f"pid {self.tid} exited during the attach") from None
            if got:
                if os.WIFEXITED(status) or os.WIFSIGNALED(status):
                    raise Failed("exited", f"pid {self.tid} exited during the attach")
                return status
            if time.monotonic() >= deadline:
                return None
            time.sleep(0.0002)


if __name__ == "__main__":
    sys.exit(main())
