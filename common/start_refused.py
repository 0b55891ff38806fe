"""How trainerd's daemons (`trainerd start`, `trainerd-agent`) refuse to start."""

from __future__ import annotations

import click


class StartRefused(click.ClickException):
    """The daemon's file (the cluster file, the agent file), a flag or a file they name is wrong, or the agent
    found no devices: one line, exit code 2, and nothing started."""

    exit_code = 2
