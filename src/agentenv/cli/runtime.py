"""`aenv` commands of the runtime subsystem."""

from __future__ import annotations

import click

COMMANDS: list[click.Command] = []
