"""What works on this host, checked for real: the checks behind `gputrace doctor`.

Each check returns a Check with a status (OK, WARN, FAIL, INFO), what was found, and the fix. A FAIL of a
``required`` check means `gputrace capture` cannot run; WARN means a source is degraded; INFO is for what is
optional (GPU sources, kprobes). The proof that eBPF tracing works is a real tiny bcc program compiled,
loaded and attached in a child process.
"""

from __future__ import annotations

import ctypes
import errno
import importlib
import importlib.util
import os
import platform
import socket
import subprocess
import sys
import tempfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from gputrace import caps
from gputrace.documents import CheckResult

OK, WARN, FAIL, INFO = "OK", "WARN", "FAIL", "INFO"
SETUP_FIX = "run ./setup.sh as root (installs python3-bpfcc and kernel headers)"
TRACEFS_DIRS = (Path("/sys/kernel/tracing"), Path("/sys/kernel/debug/tracing"))
_BPF_SYSCALL = {"x86_64": 321, "aarch64": 280, "ppc64le": 361, "s390x": 351}
# Compiles, loads and attaches a tracepoint program with a ring buffer: every piece the eBPF source needs.
_PROBE_PROGRAM = """
import sys
from bcc import BPF
b = BPF(text='BPF_RINGBUF_OUTPUT(events, 8); TRACEPOINT_PROBE(sched, sched_process_exec) { return 0; }')
b.cleanup()
print("loaded")
"""


@dataclass
class Check:
    name: str
    status: str
    detail: str
    fix: str = ""
    required: bool = False

    def as_dict(self) -> CheckResult:
        return {"name": self.name, "status": self.status, "detail": self.detail, "fix": self.fix,
                "required": self.required}


def failed_required(checks: Iterable[Check]) -> list[Check]:
    return [c for c in checks if c.required and c.status == FAIL]


def run_checks(tracepoints: list[tuple[str, str, str]] | None = None, *, load_program: bool = True) -> list[Check]:
    """Every check, in the order a user fixes things. ``tracepoints`` defaults to what the eBPF source wants."""
    checks = [check_privileges(), check_bpf_syscall(), check_lockdown(), check_btf(), check_tracefs()]
    checks += check_tracepoints(tracepoints)
    checks += [check_kprobes(), check_uprobes(), check_bcc_import(), check_kernel_headers()]
    if load_program:
        checks.append(check_bcc_program())
    checks += [check_cuda(), check_cupti(), check_nvml(), check_attach(), check_socket_dir()]
    return checks


# ---------------------------------------------------------------------------------------- privileges ---


def check_privileges() -> Check:
    name = "privileges"
    eff = caps.effective_caps()
    who = "root" if os.geteuid() == 0 else f"uid {os.geteuid()}"
    missing = caps.missing_tracing_caps()
    if missing:
        return Check(name, FAIL, f"{who} without {', '.join(missing)}",
                     f"run as root (sudo gputrace ...) or grant {' and '.join(missing)} "
                     "(e.g. the gputraced service's unit, or setcap on a dedicated interpreter)", True)
    if not caps.has_cap(caps.CAP_SYS_PTRACE, eff):
        return Check(name, WARN, f"{who} with CAP_BPF and CAP_PERFMON but without CAP_SYS_PTRACE",
                     "add CAP_SYS_PTRACE to resolve file descriptors and maps of other users' processes", True)
    have = "all capabilities" if caps.has_cap(caps.CAP_SYS_ADMIN, eff) else "CAP_BPF, CAP_PERFMON"
    return Check(name, OK, f"{who} with {have}", required=True)


def bpf_map_create() -> int:
    """0 when the bpf() syscall creates a tiny array map, else the errno."""
    nr = _BPF_SYSCALL.get(platform.machine())
    if nr is None:
        return errno.ENOSYS
    attr = (ctypes.c_uint32 * 32)(2, 4, 4, 1)  # BPF_MAP_TYPE_ARRAY, key 4 bytes, value 4 bytes, 1 entry
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.syscall(nr, 0, ctypes.byref(attr), ctypes.sizeof(attr))  # 0: BPF_MAP_CREATE
    if fd < 0:
        return ctypes.get_errno()
    os.close(fd)
    return 0


def check_bpf_syscall() -> Check:
    name = "bpf() syscall"
    err = bpf_map_create()
    if err == 0:
        return Check(name, OK, "created a BPF map", required=True)
    if err == errno.EPERM:
        return Check(name, FAIL, "denied (EPERM)", "needs root or CAP_BPF; in a container, allow bpf() "
                     "(seccomp) and grant CAP_BPF + CAP_PERFMON", True)
    if err == errno.ENOSYS:
        return Check(name, FAIL, "not implemented by this kernel", "use a kernel built with CONFIG_BPF_SYSCALL", True)
    return Check(name, FAIL, f"failed: {os.strerror(err)}", "see dmesg; the kernel refused a minimal BPF map", True)


def check_lockdown() -> Check:
    name = "kernel lockdown"
    try:
        text = Path("/sys/kernel/security/lockdown").read_text()
    except OSError:
        return Check(name, OK, "no lockdown LSM interface (not locked down)")
    mode = text[text.find("[") + 1 : text.find("]")] if "[" in text else text.strip()
    if mode == "confidentiality":
        return Check(name, WARN, "confidentiality mode: BPF may not read kernel memory",
                     "boot with lockdown=integrity or none (Secure Boot setups set this)")
    return Check(name, OK, f"mode {mode}")


def check_btf() -> Check:
    name = "BTF"
    from gputrace.probes.ebpf.btf import VMLINUX as path

    if not path.is_file():
        return Check(name, WARN, f"{path} missing", "the scheduler hooks fall back to classic tracepoints (the "
                     "kernel skips some wakeups) and page-fault waits are not named; use a kernel with "
                     "CONFIG_DEBUG_INFO_BTF")
    from gputrace.probes.ebpf.hooks import task_pid_offset, uring_hook
    from gputrace.probes.ebpf.host import uring_supported

    size = f"{path} ({path.stat().st_size // 1024} KiB)"
    if task_pid_offset() is None:
        return Check(name, WARN, f"{size}: task_struct.pid not found in it",
                     "the scheduler hooks fall back to classic tracepoints (the kernel skips some wakeups)")
    if not uring_supported():
        return Check(name, OK, f"{size}, task_struct.pid found")
    why = uring_hook("raw")[1]
    return Check(name, OK, f"{size}, task_struct.pid found; " + (f"io_uring hooks classic: {why}" if why
                                                                else "io_uring request layout found"))


# ------------------------------------------------------------------------------------- tracepoints ----


def tracefs_dir() -> Path | None:
    for d in TRACEFS_DIRS:
        if _readable_dir(d / "events"):
            return d
    return None


def _readable_dir(path: Path) -> bool:
    try:
        return path.is_dir() and os.access(path, os.R_OK | os.X_OK)
    except OSError:  # EACCES on a parent: tracefs is root-only
        return False


def check_tracefs() -> Check:
    name = "tracefs"
    d = tracefs_dir()
    if d is None:
        for cand in TRACEFS_DIRS:
            if os.path.isdir(cand) and not os.access(cand, os.R_OK | os.X_OK):
                return Check(name, FAIL, f"{cand} is not readable by uid {os.geteuid()}",
                             "run as root (tracefs is root-only)", True)
        return Check(name, FAIL, "not mounted", "mount -t tracefs tracefs /sys/kernel/tracing (./setup.sh does)",
                     True)
    return Check(name, OK, f"mounted at {d}", required=True)


def wanted_tracepoints() -> list[tuple[str, str, str]] | None:
    try:
        from gputrace.probes.ebpf.source import wanted_tracepoints as wanted
    except Exception:  # noqa: BLE001 - an unusable probe module is reported as "probe list unavailable"
        return None
    return [(str(t[0]), str(t[1]), str(t[2]) if len(t) > 2 else "") for t in wanted()]


def check_tracepoints(tracepoints: list[tuple[str, str, str]] | None = None) -> list[Check]:
    wanted = tracepoints if tracepoints is not None else wanted_tracepoints()
    if wanted is None:
        return [Check("tracepoints", WARN, "the probe list is unavailable (gputrace.probes.ebpf.source did not load)",
                      "reinstall gputrace (pip install -e .)")]
    d = tracefs_dir()
    if d is None:
        return [Check("tracepoints", WARN, f"cannot check {len(wanted)} tracepoints: tracefs not readable",
                      "fix tracefs first")]
    fields = tracepoint_fields()
    return [_tracepoint(d, cat, tp, purpose, fields.get((cat, tp), ())) for cat, tp, purpose in wanted]


def tracepoint_fields() -> dict[tuple[str, str], tuple[str, ...]]:
    """The fields the eBPF source reads from tracepoints whose layout changed between kernels."""
    try:
        from gputrace.probes.ebpf.syscalls import URING_FIELDS
    except Exception:  # noqa: BLE001 - the probe list is reported unavailable elsewhere
        return {}
    return {("io_uring", tp): f for tp, f in URING_FIELDS.items()}


def _tracepoint(d: Path, category: str, name: str, purpose: str, fields: tuple[str, ...] = ()) -> Check:
    label = f"tracepoint {category}:{name}"
    where = d / "events" / category / name
    if not os.path.exists(where / "id"):
        return Check(label, WARN, f"missing on this kernel: {purpose} degraded",
                     "a kernel with this tracepoint (the rest of the capture still works)")
    try:
        text = (where / "format").read_text() if fields else ""
    except OSError:
        text = ""
    lacking = [f for f in fields if f" {f};" not in text]
    if lacking:
        return Check(label, WARN, f"an older layout, without {', '.join(lacking)}: {purpose} degraded",
                     "a newer kernel (the rest of the capture still works)")
    return Check(label, OK, purpose)


def check_kprobes() -> Check:
    d = tracefs_dir()
    if d is None:
        return Check("kprobes", INFO, "cannot check: tracefs not readable (not needed: tracepoints only)")
    if d is not None and (d / "kprobe_events").exists():
        return Check("kprobes", INFO, "available (not needed: gputrace uses tracepoints only)")
    return Check("kprobes", INFO, "not available on this kernel (not needed: gputrace uses tracepoints only)")


def check_uprobes() -> Check:
    d = tracefs_dir()
    if d is None:
        return Check("uprobes", WARN, "cannot check: tracefs not readable", "fix tracefs first")
    if d is not None and (d / "uprobe_events").exists():
        return Check("uprobes", OK, "available (libcuda launch/sync timing for processes without the agent)")
    return Check("uprobes", WARN, "not available: no libcuda fallback for processes without the agent",
                 "a kernel with CONFIG_UPROBE_EVENTS, or arm the process with the CUPTI agent (gputrace env)")


# ---------------------------------------------------------------------------------------------- bcc ---


def check_bcc_import() -> Check:
    name = "bcc (python3-bpfcc)"
    try:
        bcc = importlib.import_module("bcc")
    except Exception as e:  # noqa: BLE001 - any import failure means bcc is unusable
        return Check(name, FAIL, f"cannot import bcc: {e}",
                     f"{SETUP_FIX}; or apt install python3-bpfcc and use a venv with --system-site-packages", True)
    version = getattr(bcc, "__version__", "?")
    return Check(name, OK, f"bcc {version} from {Path(bcc.__file__ or '?').parent}", required=True)


def check_kernel_headers() -> Check:
    name = "kernel headers"
    rel = os.uname().release
    base = Path("/lib/modules") / rel
    for sub in ("build", "source"):
        if (base / sub / "include/linux/kconfig.h").exists():
            return Check(name, OK, f"{base / 'build'} -> {os.path.realpath(base / 'build')}", required=True)
    return Check(name, FAIL, f"none for {rel} at {base}/build", SETUP_FIX + " (links the nearest headers)", True)


def check_bcc_program(timeout_s: float = 120.0) -> Check:
    """The real proof: compile, load and attach a tiny tracepoint program with a ring buffer."""
    name = "bcc program load"
    try:
        r = subprocess.run([sys.executable, "-c", _PROBE_PROGRAM], capture_output=True, text=True,
                           timeout=timeout_s, env={**os.environ, "PYTHONWARNINGS": "ignore"})
    except subprocess.TimeoutExpired:
        return Check(name, FAIL, f"compiling a tiny program took over {timeout_s:.0f} s", "check the kernel headers",
                     True)
    if r.returncode == 0 and "loaded" in r.stdout:
        return Check(name, OK, "compiled, loaded and attached a tracepoint program with a ring buffer", required=True)
    return Check(name, FAIL, f"failed: {_last_error(r.stderr)}", _program_fix(r.stderr), True)


def _last_error(stderr: str) -> str:
    lines = [ln.strip() for ln in stderr.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "Error" in ln or "error" in ln or "denied" in ln or "not permitted" in ln:
            return ln[:200]
    return lines[-1][:200] if lines else "no output"


def _program_fix(stderr: str) -> str:
    if "ModuleNotFoundError" in stderr:
        return SETUP_FIX
    if "Operation not permitted" in stderr or "Permission denied" in stderr:
        return "run as root or with CAP_BPF + CAP_PERFMON"
    if "kconfig.h" in stderr or "No such file" in stderr:
        return SETUP_FIX
    return "run the program by hand to see the compiler's output"


# --------------------------------------------------------------------------------------------- GPU ----


def check_cuda() -> Check:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return Check("CUDA driver", INFO, "libcuda.so.1 not found: GPU sources unavailable",
                     "on a GPU host install the NVIDIA driver; elsewhere use the simulated device (gputrace.sim)")
    return Check("CUDA driver", OK, "libcuda.so.1 loads")


CUPTI_PYTHON_MIN = (13, 4)  # 13.0's agent took ~10 ms of a PyTorch step's CPU on an H100 (docs/gpu.md)


def check_cupti(version: str | None = None) -> Check:
    if importlib.util.find_spec("cupti") is None:
        return Check("cupti-python", INFO, "not installed: no CUPTI activity from the in-process agent",
                     "pip install 'gputrace[gpu]' (cupti-python) on a GPU host")
    if version is None:
        version = _dist_version("cupti-python")
    if _release(version) < CUPTI_PYTHON_MIN:
        return Check("cupti-python", WARN, f"{version}: the agent costs a PyTorch job far more with it (measured: "
                     "1.31x a step's time, against +0.4 % with 13.4; docs/gpu.md)",
                     "pip install 'cupti-python>=13.4' (it brings a matching nvidia-cuda-cupti)")  # fmt: skip
    return Check("cupti-python", OK, f"importable ({version})")


def _dist_version(dist: str) -> str:
    try:
        from importlib.metadata import version

        return version(dist)
    except Exception:  # noqa: BLE001 - not installed as a distribution (a source tree on the path)
        return ""


def _release(version: str) -> tuple[int, ...]:
    """(13, 4) of "13.4.0"; an unreadable version sorts as new (no warning on a guess)."""
    parts = []
    for piece in version.split(".")[:2]:
        if not piece.isdigit():
            return (1 << 30,)
        parts.append(int(piece))
    return tuple(parts) if parts else (1 << 30,)


def check_nvml() -> Check:
    try:
        import pynvml

        pynvml.nvmlInit()
    except Exception as e:  # noqa: BLE001 - NVMLError and OSError alike mean: no NVML here
        return Check("NVML", INFO, f"unavailable ({type(e).__name__}): no GPU counter tracks",
                     "on a GPU host install the NVIDIA driver (libnvidia-ml)")
    try:
        count = pynvml.nvmlDeviceGetCount()
        driver = pynvml.nvmlSystemGetDriverVersion()
    finally:
        pynvml.nvmlShutdown()
    return Check("NVML", OK, f"{count} device(s), driver {driver}")


def check_attach(yama: str = "/proc/sys/kernel/yama/ptrace_scope") -> Check:
    """Whether `capture -p` can inject the agent into an unarmed Python >= 3.14 (gputrace.daemon.attach.inject)."""
    name = "attach to Python 3.14"
    try:
        scope = int(Path(yama).read_text().strip())
    except (OSError, ValueError):
        scope = 0  # no Yama: ptrace follows uids and capabilities alone
    armed = "start such jobs armed (gputrace env)"
    if scope >= 3:
        return Check(name, INFO, "kernel.yama.ptrace_scope = 3: ptrace is disabled, no process can take the agent "
                     "by injection", armed)
    if scope >= 1:
        return Check(name, INFO, f"kernel.yama.ptrace_scope = {scope}: only interpreters that only root can change "
                     "(e.g. /usr/bin/python3.14) take the agent; not a container's, nor a copy in a venv",
                     f"{armed}, or sysctl kernel.yama.ptrace_scope=0")
    return Check(name, OK, "running unarmed Python >= 3.14 processes take the agent (sys.remote_exec)")


# ------------------------------------------------------------------------------------------ sockets ---


def check_socket_dir(directory: str | None = None) -> Check:
    """The capture session puts its agent socket in a temporary directory: bind a real one there."""
    d = directory or tempfile.gettempdir()
    name = "unix socket dir"
    try:
        with tempfile.TemporaryDirectory(prefix="gputrace-doctor-", dir=d) as tmp, \
                socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.bind(os.path.join(tmp, "s.sock"))
    except OSError as e:
        return Check(name, FAIL, f"cannot bind a unix socket in {d}: {e.strerror}",
                     "set TMPDIR to a writable local directory", True)
    return Check(name, OK, f"{d} writable, unix sockets bind", required=True)

