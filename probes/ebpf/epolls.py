"""What each epoll instance of a traced process has registered, replayed at read time, so that the data word of
a ready event (the caller's choice: the fd for asyncio, libuv and libev; a token for mio/tokio; a pointer
elsewhere) names the fd registered with it, and nothing when no registration had it.

Pure Python. Fed by probes/ebpf/events.py's KernelDecoder: ``epoll_create*`` and the /proc snapshot's eventpoll fds
start an instance, ``epoll_ctl`` events and the snapshot's ``EpollEntry`` records add, change and remove its
registrations, and the fd-table changes (close, dup, fork, exit) follow the instance and its fds.

Registrations are kept by fd number, as the kernel keys them (with the file): one per fd of an instance. Each
remembers the process that made it and what its fd held then, so that it still names that file after its
process exited (a child inherited the instance and waits on it).
"""

from __future__ import annotations

from typing import NamedTuple

EPOLL_CTL_ADD, EPOLL_CTL_DEL, EPOLL_CTL_MOD = 1, 2, 3
EVENTPOLL = "anon_inode:[eventpoll]"  # what /proc/PID/fd/N shows for an epoll fd


class Registration(NamedTuple):
    pid: int  # the process whose fd table ``fd`` is in; 0 once it exited
    data: int  # the 64-bit data word, as ready events report it
    obj: str  # what the fd held when it was registered


class Ready(NamedTuple):
    """The registration a ready event's data word names."""

    pid: int
    fd: int
    obj: str


class EpollSet:
    """One epoll instance: registrations by fd, and the fds registered with each data word."""

    def __init__(self) -> None:
        self.regs: dict[int, Registration] = {}
        self.by_data: dict[int, set[int]] = {}
        self.refs = 0  # epoll fds (of any process) that name it: at 0 the kernel frees it

    def put(self, fd: int, reg: Registration) -> None:
        self.drop(fd)
        self.regs[fd] = reg
        self.by_data.setdefault(reg.data, set()).add(fd)

    def drop(self, fd: int) -> None:
        old = self.regs.pop(fd, None)
        if old is not None:
            fds = self.by_data[old.data]
            fds.discard(fd)
            if not fds:
                del self.by_data[old.data]

    def find(self, data: int) -> Ready | None:
        """The one registration with this data word; None for none, or several (which one fired is unknown)."""
        fds = self.by_data.get(data)
        if not fds or len(fds) > 1:
            return None
        (fd,) = fds
        reg = self.regs[fd]
        return Ready(reg.pid, fd, reg.obj)


class EpollTables:
    """Every traced process's epoll fds (several fds and processes may share an instance: dup, fork)."""

    def __init__(self) -> None:
        self._open: dict[int, dict[int, EpollSet]] = {}  # pid -> epoll fd -> instance
        self._made: dict[int, dict[int, EpollSet]] = {}  # pid -> live instances holding registrations it made

    def created(self, pid: int, epfd: int) -> None:
        """A new instance at ``epfd`` (epoll_create), or one whose registrations follow (the /proc snapshot)."""
        self._hold(pid, epfd, EpollSet())

    def ctl(self, pid: int, epfd: int, op: int, fd: int, data: int | None, obj: str) -> None:
        """A successful epoll_ctl (``data`` None: the event could not be read, so the fd's registration is
        forgotten rather than kept with a stale word). An epoll fd not seen before gets an instance whose
        earlier registrations are unknown."""
        ep = self._open.get(pid, {}).get(epfd)
        if ep is None:
            ep = self._hold(pid, epfd, EpollSet())
        if op in (EPOLL_CTL_ADD, EPOLL_CTL_MOD) and data is not None:
            ep.put(fd, Registration(pid, data, obj))
            self._made.setdefault(pid, {})[id(ep)] = ep
        else:
            ep.drop(fd)

    def ready(self, pid: int, epfd: int, data: int) -> Ready | None:
        ep = self._open.get(pid, {}).get(epfd)
        return ep.find(data) if ep is not None else None

    def fd_gone(self, pid: int, fd: int) -> None:
        """``pid`` closed ``fd`` (or dup2 replaced it): an epoll fd stops naming its instance, and a registration
        it made of that fd goes, as the kernel's does when the file is released (kept by a copy elsewhere, the
        kernel's stays and ours is gone: its events then name no fd)."""
        ep = self._open.get(pid, {}).pop(fd, None)
        if ep is not None:
            self._release(ep)
        made = self._made.get(pid, {})
        for key, ep in list(made.items()):
            reg = ep.regs.get(fd)
            if ep.refs <= 0:
                del made[key]  # freed: nothing will be looked up in it again
            elif reg is not None and reg.pid == pid:
                ep.drop(fd)

    def dup(self, pid: int, old: int, new: int) -> None:
        """``new`` is a copy of ``old``: of the same instance when ``old`` is an epoll fd."""
        self.fd_gone(pid, new)
        ep = self._open.get(pid, {}).get(old)
        if ep is not None:
            self._hold(pid, new, ep)

    def fork(self, parent: int, child: int) -> None:
        """A child process shares its parent's instances under the same fds."""
        for epfd, ep in self._open.get(parent, {}).items():
            self._hold(child, epfd, ep)

    def exit(self, pid: int) -> None:
        """``pid`` is gone (its number may be reused): its registrations in instances others still hold keep the
        files they named, no longer looked up in its fd table."""
        for ep in self._open.pop(pid, {}).values():
            self._release(ep)
        for ep in self._made.pop(pid, {}).values():
            for fd, reg in list(ep.regs.items()):
                if reg.pid == pid:
                    ep.regs[fd] = reg._replace(pid=0)

    def _hold(self, pid: int, epfd: int, ep: EpollSet) -> EpollSet:
        sets = self._open.setdefault(pid, {})
        old = sets.get(epfd)
        if old is not ep:
            if old is not None:
                self._release(old)
            sets[epfd] = ep
            ep.refs += 1
        return ep

    @staticmethod
    def _release(ep: EpollSet) -> None:
        ep.refs -= 1
        if ep.refs <= 0:  # the kernel frees the instance with its registrations
            ep.regs.clear()
            ep.by_data.clear()
