"""`aenv` commands of the blockd subsystem."""

from __future__ import annotations

import click

COMMANDS: list[click.Command] = []
