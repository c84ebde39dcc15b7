"""`aenv` commands of the guest subsystem."""

from __future__ import annotations

import click

COMMANDS: list[click.Command] = []
