"""Run a program as another process would: with its credentials, in its namespaces, under its root.

The agent's attach helper (``sys.remote_exec``, gputrace.daemon.attach.inject) must run the target's own interpreter,
a file that the target's owner, or a container, controls. Run as root with our privileges it would hand
them that file's author. So it runs here with the target's user, groups and capability sets (never more
than ours, and ``no_new_privs`` so executing cannot raise them), in the target's ipc, uts, net, cgroup, pid
and mount namespaces, and its user namespace when it has one of its own (a rootless container: entered
last, and the ids then given as that namespace names them), chrooted to its root: it can then do nothing
the target could not do itself, and it names the target by its pid there and reaches files by its paths.
Two things of the target's are not copied: its seccomp filter and its LSM profile; a helper with no
capabilities gains little from that.

Which namespaces are the target's own (a container's), to be entered, is ``container_namespace``: one that
differs from ours *and* from pid 1's (the init of our pid namespace, which we and the host's processes
descend from). A sandboxed caller (gputraced under its unit: a mount, network and UTS namespace of its own,
no CAP_SYS_ADMIN, setns forbidden) differs from every host process in those, but a host process's namespace
is the host's, not a container's: the helper then stays in ours. That gives it less, never more: in the
service's mount namespace it sees the host's files read-only, a private /tmp, no network, and it still has
only the target's ids and capabilities. What it needs there is only ptrace access to the target (the kernel
checks that against its credentials, not its namespaces), the target's pid, which is the same in our pid
namespace, and the target's interpreter and the libraries it maps, at the same paths (gputrace.daemon.attach.inject
checks the interpreter first). Where pid 1's namespaces cannot be read, any namespace unlike ours is a
container's, as before: the helper tries to enter it and needs CAP_SYS_ADMIN for that.

``main`` is run with ``PID [--ptrace] [--stay] -- ARGV...`` by a fresh interpreter of ours (``argv_for``)
(setns, chroot and fork have no place in a multi-threaded daemon). ARGV[0] ``@exe`` means the target's
executable itself, opened before entering anything. ``--ptrace`` adds CAP_SYS_PTRACE (for a Yama ptrace
scope >= 1), which the caller grants only to a root-owned program of the host (``trusted_binary``).
``--stay`` enters nothing: the program (our ptrace helper, gputrace.daemon.attach.pyattach) runs in our namespaces
and root with the target's credentials alone.
Exit status: the program's, or 125 with one line on stderr when it could not be started.
"""

from __future__ import annotations

import ctypes
import os
import stat
import sys
from dataclasses import dataclass
from pathlib import Path

import gputrace
from gputrace.caps import CAP_SYS_PTRACE

CAP_SETPCAP = 8
NAMESPACES = ("ipc", "uts", "net", "cgroup", "pid", "mnt")  # mnt last: the others are opened by /proc path
LAUNCH_FAILED = 125
_PR_SET_KEEPCAPS, _PR_CAPBSET_DROP, _PR_SET_NO_NEW_PRIVS = 8, 24, 38
_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_RAISE = 47, 2
_CAP_V3 = 0x20080522


@dataclass(frozen=True)
class Credentials:
    """A process's ids and capability sets, as /proc/PID/status shows them."""

    uids: tuple[int, int, int]
    gids: tuple[int, int, int]
    groups: tuple[int, ...]
    inheritable: int
    permitted: int
    effective: int
    bounding: int

    @classmethod
    def parse(cls, status: str) -> Credentials:
        f = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)

        def ids(key: str) -> tuple[int, int, int]:
            r, e, s, *_ = (int(x) for x in f[key].split())
            return r, e, s

        def caps(key: str) -> int:
            return int(f[key].strip(), 16)

        return cls(ids("Uid"), ids("Gid"), tuple(int(g) for g in f.get("Groups", "").split()),
                   caps("CapInh"), caps("CapPrm"), caps("CapEff"), caps("CapBnd"))

    def inside(self, uid_map: list[tuple[int, int, int]], gid_map: list[tuple[int, int, int]]) -> Credentials:
        """These credentials with ids as a user namespace with these maps names them."""

        def mapped(ids: tuple[int, ...], ranges: list[tuple[int, int, int]]) -> tuple[int, int, int]:
            out = []
            for i in ids:
                hit = next((inner + i - outer for inner, outer, n in ranges if outer <= i < outer + n), None)
                if hit is None:
                    raise OSError(0, f"id {i} has no name in its user namespace")
                out.append(hit)
            return out[0], out[1], out[2]

        return Credentials(mapped(self.uids, uid_map), mapped(self.gids, gid_map), self.groups,
                           self.inheritable, self.permitted, self.effective, self.bounding)

    def limited_to(self, ours: Credentials) -> Credentials:
        """These ids with capability sets no larger than ``ours``."""
        return Credentials(self.uids, self.gids, self.groups, self.inheritable & ours.permitted,
                           self.permitted & ours.permitted, self.effective & ours.permitted,
                           self.bounding & ours.bounding)


def credentials(proc_fd: int) -> Credentials:
    with open("status", errors="replace", opener=lambda name, flags: os.open(name, flags, dir_fd=proc_fd)) as f:
        return Credentials.parse(f.read())


def trusted_binary(path: str) -> bool:
    """Whether ``path`` and every directory above it are root's and writable by nobody else (as sudo asks of
    what it runs): an interpreter that only root could have put there."""
    p = Path(path)
    if not p.is_absolute():
        return False
    for part in (p, *p.parents):
        try:
            st = os.stat(part)
        except OSError:
            return False
        if st.st_uid != 0 or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
            return False
    return True


def argv_for(pid: int, argv: list[str], *, ptrace: bool = False, stay: bool = False) -> list[str]:
    """The command line that runs ``argv`` as ``pid`` would (see the module's docstring). ``stay``: with its
    credentials only, in our namespaces and root (a program of ours that needs none of the target's
    files and must find its own)."""
    home = gputrace.import_root()
    boot = (f"import sys; sys.path.insert(0, {home!r}); "
            "from gputrace.daemon.attach.nsexec import main; sys.exit(main())")
    flags = [*(["--ptrace"] if ptrace else []), *(["--stay"] if stay else [])]
    return [sys.executable, "-I", "-c", boot, str(int(pid)), *flags, "--", *argv]


# ---------------------------------------------------------------------------------- the launcher ---
def main(args: list[str] | None = None) -> int:
    args = sys.argv[1:] if args is None else args
    try:
        sep = args.index("--")
        pid, flags, argv = int(args[0]), args[1:sep], args[sep + 1:]
        if not argv or set(flags) - {"--ptrace", "--stay"}:
            raise ValueError
    except (ValueError, IndexError):
        print("usage: python -m gputrace.daemon.attach.nsexec PID [--ptrace] [--stay] -- ARGV...", file=sys.stderr)
        return 2
    try:
        return _launch(pid, argv, ptrace="--ptrace" in flags, stay="--stay" in flags)
    except OSError as e:
        print(f"gputrace: cannot run {_what(argv)} as pid {pid}: {e.strerror or e}", file=sys.stderr)
        return LAUNCH_FAILED


def _what(argv: list[str]) -> str:
    return "its interpreter" if argv[0] == "@exe" else argv[0]


def _launch(pid: int, argv: list[str], *, ptrace: bool, stay: bool = False) -> int:
    proc = os.open(f"/proc/{pid}", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC)  # this process, not a later one
    theirs = credentials(proc).limited_to(Credentials.parse(Path("/proc/self/status").read_text()))
    # Staying, its ids are the ones our namespace gives it (a rootless container's user as the host names it).
    names = [] if stay else [n for n in NAMESPACES if container_namespace(n, proc)]
    chroot = not stay and ("mnt" in names or container_root(proc))  # asked before anything is entered
    if not stay and container_namespace("user", proc):
        # A rootless container: its ids are given in its own terms once we are in its user namespace.
        theirs = theirs.inside(_id_map(proc, "uid_map"), _id_map(proc, "gid_map"))
        names.append("user")  # last: entering the others needs our own privileges
    ns = {n: os.open(f"ns/{n}", os.O_RDONLY | os.O_CLOEXEC, dir_fd=proc) for n in names}
    root = os.open("root", os.O_PATH | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=proc)
    exe = os.open("exe", os.O_RDONLY | os.O_CLOEXEC, dir_fd=proc) if argv[0] == "@exe" else -1
    os.setgroups(list(theirs.groups))  # the host's gids, while we may: a user namespace can forbid it
    libc = ctypes.CDLL(None, use_errno=True)
    for name, fd in ns.items():
        if libc.setns(fd, 0) != 0:  # os.setns is Python >= 3.12
            err = ctypes.get_errno()
            raise OSError(err, f"cannot enter its {name} namespace: {os.strerror(err)}")
    if chroot:
        os.fchdir(root)
        os.chroot(".")  # CAP_SYS_CHROOT: only where the target's root is not ours, nor the host's
    os.chdir("/")
    child = os.fork()  # a new pid namespace holds only children
    if child == 0:
        try:
            _become(libc, theirs, ptrace)
            env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LC_ALL": "C.UTF-8"}
            if exe >= 0:
                os.execve(exe, [_path_of(exe), *argv[1:]], env)
            os.execve(argv[0], argv, env)
        except OSError as e:
            print(f"gputrace: cannot run {_what(argv)} as pid {pid}: {e.strerror or e}", file=sys.stderr)
        os._exit(LAUNCH_FAILED)
    code = os.waitstatus_to_exitcode(os.waitpid(child, 0)[1])
    return code if code >= 0 else 128 - code


def _id_map(proc: int, name: str) -> list[tuple[int, int, int]]:
    """A user namespace's uid_map or gid_map as we read it: (id inside, id here, count) ranges."""
    with open(name, opener=lambda n, flags: os.open(n, flags, dir_fd=proc)) as f:
        return [(int(a), int(b), int(c)) for a, b, c in (line.split() for line in f if line.strip())]


def container_namespace(ns: str, proc: int) -> bool:
    """Whether the process whose /proc/PID directory is open as ``proc`` has a namespace ``ns`` of a
    container's: one that is not ours and not that of pid 1 of our pid namespace (the host's, where we
    run sandboxed in namespaces of our own). Where pid 1's cannot be read, any namespace unlike ours is one.
    A kernel without this namespace kind has none; any other error reading the target's is raised."""
    try:
        ours = _ns_id(f"/proc/self/ns/{ns}")
        theirs = _ns_id(f"ns/{ns}", proc)
    except FileNotFoundError:
        return False  # a kernel without this namespace kind
    if theirs == ours:
        return False
    try:
        return theirs != _ns_id(f"/proc/1/ns/{ns}")
    except OSError:
        return True  # pid 1 hides its namespaces (an LSM can): as before, a namespace not ours is entered


def container_root(proc: int) -> bool:
    """Whether the process's files are not those we see: its mount namespace is a container's, or its root
    is not the root of the mount namespace it shares, ours or the host's (pid 1's): a chroot."""
    if container_namespace("mnt", proc):
        return True
    theirs = _ns_id("root", proc)
    if theirs == _ns_id("/proc/self/root"):
        return False
    try:
        shares_ours = _ns_id("ns/mnt", proc) == _ns_id("/proc/self/ns/mnt")
    except FileNotFoundError:
        shares_ours = True
    if shares_ours:
        return True
    try:
        return theirs != _ns_id("/proc/1/root")
    except OSError:
        return True


def _ns_id(path: str, dir_fd: int | None = None) -> tuple[int, int]:
    """What identifies a namespace or a directory: the device and inode of ``path`` (followed)."""
    st = os.stat(path, dir_fd=dir_fd)
    return st.st_dev, st.st_ino


def _path_of(fd: int) -> str:
    """The executable's path as the target sees it (we are in its root now), for its interpreter to find
    its prefix by; "/proc/self/fd/N" where its /proc is not mounted."""
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return f"/proc/self/fd/{fd}"


def _become(libc: ctypes.CDLL, c: Credentials, ptrace: bool) -> None:
    """Take ``c``'s ids and capabilities for good (plus CAP_SYS_PTRACE when asked), then no_new_privs. (The
    groups were set before entering a user namespace, which may forbid setgroups.)"""

    def prctl(*a: int) -> None:
        args = (*a, 0, 0, 0, 0)[:5]  # the unused ones must be 0
        if libc.prctl(*(ctypes.c_ulong(x) for x in args)) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"prctl{a}: {os.strerror(err)}")

    extra = 1 << CAP_SYS_PTRACE if ptrace else 0
    ours = Credentials.parse(Path("/proc/self/status").read_text())
    if ours.effective >> CAP_SETPCAP & 1:  # without it (under gputraced) no_new_privs alone bounds the exec
        for cap in range(int(Path("/proc/sys/kernel/cap_last_cap").read_text()) + 1):
            if ours.bounding >> cap & 1 and not (c.bounding | extra) >> cap & 1:
                prctl(_PR_CAPBSET_DROP, cap)
    prctl(_PR_SET_KEEPCAPS, 1)
    os.setresgid(*c.gids)
    os.setresuid(*c.uids)
    _capset(libc, effective=c.effective | extra, permitted=c.permitted | extra, inheritable=c.inheritable | extra)
    if extra:
        prctl(_PR_CAP_AMBIENT, _PR_CAP_AMBIENT_RAISE, CAP_SYS_PTRACE)
    prctl(_PR_SET_NO_NEW_PRIVS, 1)


class _CapHeader(ctypes.Structure):
    _fields_ = [("version", ctypes.c_uint32), ("pid", ctypes.c_int)]


class _CapData(ctypes.Structure):
    _fields_ = [("effective", ctypes.c_uint32), ("permitted", ctypes.c_uint32), ("inheritable", ctypes.c_uint32)]


def _capset(libc: ctypes.CDLL, *, effective: int, permitted: int, inheritable: int) -> None:
    data = (_CapData * 2)(*(_CapData(effective >> s & 0xFFFFFFFF, permitted >> s & 0xFFFFFFFF,
                                     inheritable >> s & 0xFFFFFFFF) for s in (0, 32)))
    if libc.capset(ctypes.byref(_CapHeader(_CAP_V3, 0)), data) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"capset: {os.strerror(err)}")


if __name__ == "__main__":
    sys.exit(main())
