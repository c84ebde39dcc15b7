"""`aenv` commands of the template subsystem."""

from __future__ import annotations

import click

COMMANDS: list[click.Command] = []
