"""`aenv` commands of the envd subsystem."""

from __future__ import annotations

import click

COMMANDS: list[click.Command] = []
