"""`aenv settings`: every AENV_* setting (agentenv/settings.py), and which ones this environment sets."""

from __future__ import annotations

import click

from agentenv import settings as declared


@click.command("settings")
@click.option("--markdown", is_flag=True,
              help="Print docs/settings.md, the table of every setting, generated from the module.")
def settings_command(markdown: bool) -> None:
    """List the AENV_* variables this environment sets, with their values as the components
    read them, and the unknown ones (a typo, or a setting that is gone)."""
    if markdown:
        click.echo(declared.markdown(), nl=False)
        return
    current = declared.get_settings()
    for name in sorted(current.model_fields_set - set(current._problems)):
        click.echo(f"{declared.env_name(name)}={getattr(current, name)}")
    for problem in current.problems():
        click.echo(f"{problem}", err=True)
    for name, closest in declared.unknown():
        hint = f" (did you mean {closest}?)" if closest else ""
        click.echo(f"{name}: unknown{hint}", err=True)


COMMANDS = [settings_command]
