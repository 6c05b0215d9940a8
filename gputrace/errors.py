"""Errors a user can act on. The CLI turns them into one line on stderr and an exit code, never a traceback."""


class UserError(Exception):
    """Bad input or an unusable host: the message says what is wrong and how to fix it."""

    exit_code = 2


class CorruptCapture(UserError):
    """A capture file that cannot be read at all (not a capture, bad header)."""

    exit_code = 3


class PermissionDenied(UserError):
    """The caller lacks a privilege the operation needs; the message names it."""

    exit_code = 4


class CaptureCutOff(UserError):
    """Writing the capture failed (a full disk) after some of it was written: ``path`` holds what was, a
    capture cut off at a frame boundary that readers read up to the cut."""

    def __init__(self, message: str, path: object) -> None:
        super().__init__(message)
        self.path = path


class OutputError(UserError):
    """Writing a named output failed (a full disk, a failing device): the message names the file, since the
    OSError of a write() carries no file name; ``errno`` keeps why, for callers that advise on it."""

    def __init__(self, path: object, err: OSError, consequence: str = "nothing was written under that name") -> None:
        super().__init__(f"writing {path}: {err.strerror or err}" + (f"; {consequence}" if consequence else ""))
        self.path, self.errno = path, err.errno


class JobEnded(UserError):
    """A process forked to share out work (``gputrace report --jobs``) ended without its results: killed, as
    the kernel's OOM killer does. The message says how it ended and how to do without it."""

    exit_code = 1
