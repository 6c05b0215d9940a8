"""`gputrace env`: the environment that arms a long-running Python service for gputrace."""

from __future__ import annotations

import argparse
import re
import shlex

from gputrace.agent import arming, wire
from gputrace.errors import UserError

HELP = "print the environment that arms a Python service, so a later capture can attach to it"
ORDER = 60
EXAMPLES = """\
  gputrace env                          shell lines: eval "$(gputrace env)" before starting the job
  gputrace env --systemd                a drop-in for a systemd unit (Environment= lines)
  gputrace env --systemd --unit trainer.service > /etc/systemd/system/trainer.service.d/gputrace.conf

An armed process runs exactly as before and stays dormant (one stat() a second) until
`gputrace capture -p PID` offers it a session; then its GPU agent connects, and it goes
dormant again when the capture ends.
"""

_UNIT_RE = re.compile(r"^[A-Za-z0-9:_.@-]+$")


def prepare_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--systemd", action="store_true", help="print a systemd drop-in instead of shell lines")
    p.add_argument("--unit", metavar="NAME.service", help="name the unit in the drop-in's path comment")


def shell_lines(env: dict[str, str]) -> list[str]:
    """export lines; PYTHONPATH keeps whatever the shell has at the time they are evaluated."""
    lines = []
    for key, value in env.items():
        if key == "PYTHONPATH":
            lines.append(f'export PYTHONPATH={shlex.quote(arming.boot_dir())}"${{PYTHONPATH:+:$PYTHONPATH}}"')
        else:
            lines.append(f"export {key}={shlex.quote(value)}")
    return lines


def systemd_lines(env: dict[str, str], unit: str) -> list[str]:
    where = f"/etc/systemd/system/{unit or 'UNIT.service'}.d/gputrace.conf"
    lines = [
        f"# {where}",
        "# then: systemctl daemon-reload && systemctl restart " + (unit or "UNIT"),
        "# If the unit already sets PYTHONPATH, append its value to the PYTHONPATH line below.",
        "[Service]",
    ]
    lines += [f'Environment="{k}={v}"' for k, v in env.items()]
    lines.append(f"# the session offers itself at {arming.attach_dir()}/<pid>.sock; keep that path visible")
    return lines


def run(args: argparse.Namespace) -> int:
    unit = args.unit or ""
    if unit and not _UNIT_RE.match(unit):
        raise UserError(f"{unit!r} is not a systemd unit name")
    env = arming.environment(None, base={})
    env = {wire.ENV_ARMED: env.pop(wire.ENV_ARMED), **env}
    print("\n".join(systemd_lines(env, unit) if args.systemd else shell_lines(env)))
    return 0
