"""`aenv layer ...` and `aenv image ...`: inspect, export, import and commit overlaybd layers."""

from __future__ import annotations

import click

COMMANDS: list[click.Command] = []
