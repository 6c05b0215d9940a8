"""The `gputrace` command line. Each command is a module in this package (see ``_commands``)."""

from __future__ import annotations

import argparse
import contextlib
import errno
import importlib
import os
import pkgutil
import signal
import stat
import sys
from collections.abc import Sequence
from types import ModuleType

from gputrace import __version__
from gputrace.errors import PermissionDenied, UserError

DESCRIPTION = """\
gputrace explains GPU idle time: it traces a job's syscalls, block I/O and scheduling with eBPF and its
GPU work with CUPTI (or the simulated device), finds every GPU stall and names what it waited for.

  gputrace capture -- python train.py          trace a command, write a capture and a Perfetto trace
  gputrace capture -p 4242 -d 30               trace a running job for 30 s
  gputrace report gputrace-python.4242.gputrace   stall budget by cause and culprit
  gputrace compare before.gputrace after.gputrace  what a change did to the stalls
  gputrace view gputrace-python.4242.pftrace      open the trace in the Perfetto UI
  gputrace doctor                              what works on this host
"""


def _commands() -> list[ModuleType]:
    """Every module of this package that defines prepare_parser() and run(), by its ORDER."""
    mods = []
    for info in pkgutil.iter_modules(__path__):
        if info.name.startswith("_") or info.name == "common":
            continue
        mod = importlib.import_module(f"{__name__}.{info.name}")
        if hasattr(mod, "prepare_parser") and hasattr(mod, "run"):
            mods.append(mod)
    return sorted(mods, key=lambda m: (getattr(m, "ORDER", 100), m.__name__))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="gputrace", description=DESCRIPTION, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--version", action="version", version=f"gputrace {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for mod in _commands():
        name = mod.__name__.rsplit(".", 1)[1].replace("_", "-")
        p = sub.add_parser(
            getattr(mod, "NAME", name),
            help=mod.HELP,
            description=mod.HELP + ("\n\nexamples:\n" + mod.EXAMPLES if getattr(mod, "EXAMPLES", "") else ""),
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        mod.prepare_parser(p)
        p.set_defaults(_run=mod.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "_run", None):
        parser.print_help()
        return 2
    from gputrace.cli.common import Terminated, catch_termination

    restore = catch_termination()
    try:
        rc = int(args._run(args) or 0)
        sys.stdout.flush()  # a full disk under `report --json > r.json` shows here, not at exit
        return rc
    except UserError as e:
        print(f"gputrace: error: {e}", file=sys.stderr)
        return e.exit_code
    except PermissionError as e:  # a root-only file or directory met outside the checks that name it
        what = f"{e.filename}: " if e.filename else ""
        print(f"gputrace: error: {what}{e.strerror or e} (run as root, e.g. with sudo)", file=sys.stderr)
        return PermissionDenied.exit_code
    except Terminated as e:
        print(f"gputrace: stopped by {signal.Signals(e.signum).name}", file=sys.stderr)
        return 128 + e.signum
    except KeyboardInterrupt:
        print("gputrace: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        _drop_stdout()
        return 1
    except OSError as e:
        if e.errno not in _OUTPUT_ERRNOS:
            raise
        if e.filename is not None:  # an output the command opened by name, met outside the checks that name it
            print(f"gputrace: error: writing {e.filename}: {e.strerror}", file=sys.stderr)
            return 1
        where = _stdout_name()  # write() errors carry no name: stdout's is what failed (the commands name theirs)
        _drop_stdout()
        print(f"gputrace: error: writing the output{where}: {e.strerror}; it is incomplete", file=sys.stderr)
        return 1
    finally:
        restore()


_OUTPUT_ERRNOS = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO}  # stdout's file or device failed


def _stdout_name() -> str:
    """ " (PATH)" when stdout is a file (`report --json > r.json`), so the error names it; "" for a pipe or a
    terminal, which have no name worth giving."""
    try:
        if not stat.S_ISREG(os.fstat(sys.stdout.fileno()).st_mode):
            return ""
        return f" ({os.readlink(f'/proc/self/fd/{sys.stdout.fileno()}')})"
    except (OSError, ValueError):
        return ""


def _drop_stdout() -> None:
    """Point stdout at /dev/null so the interpreter's final flush does not fail a second time."""
    with contextlib.suppress(OSError, ValueError):
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        os.close(devnull)


if __name__ == "__main__":
    sys.exit(main())
