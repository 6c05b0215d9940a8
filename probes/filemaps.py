"""Names of the files traced processes map, for the page faults that wait on them.

A fault event names its file by device and inode; the path is read from /proc/PID/maps while the mapping
exists, and a FileMap record goes into the capture before the first fault event that needs it. The kernel
announces each (process, file) at its first fault (the faulting thread holds the mapping then); a fault
event whose file was not announced yet is resolved when it arrives, as a fallback.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from gputrace import clock
from gputrace.probes import events, procfs
from gputrace.records import FileMap

Key = tuple[int, str, int]  # (pid, "MAJ:MIN", inode)


class MappedFiles:
    def __init__(self, emit: Callable[[list[Any]], None], forget: Callable[[Key], None]) -> None:
        """``emit`` writes records after everything read so far; ``forget`` drops a key from the kernel's
        announced set, so that the file is announced again at its next fault."""
        self._emit = emit
        self._forget = forget
        self._written: set[Key] = set()
        self.unresolved = 0

    def announced(self, raw: bytes) -> None:
        key = events.mapfile_key(raw)
        if key in self._written:
            return
        path = self._path(key)
        if path:
            self._write(key, path)
        else:  # not readable now: a later fault announces it again
            self._forget(key)

    def fault(self, raw: bytes) -> None:
        key = events.fault_key(raw)
        if key not in self._written:
            path = self._path(key)
            self.unresolved += not path
            self._write(key, path)

    def process_gone(self, pid: int) -> None:
        """Its pid may be reused: the next process of that pid has its files read again."""
        gone = [k for k in self._written if k[0] == pid]
        for key in gone:
            self._written.discard(key)
            self._forget(key)

    def _path(self, key: Key) -> str:
        pid, dev, ino = key
        return procfs.mapped_files(pid).get((dev, ino), "")

    def _write(self, key: Key, path: str) -> None:
        self._written.add(key)
        pid, dev, ino = key
        self._emit([FileMap(clock.monotonic_ns(), pid, dev, ino, path)])
