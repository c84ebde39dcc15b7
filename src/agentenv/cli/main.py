"""`aenv`: one command, a subcommand per subsystem.

Each subsystem's commands live in their own module here and are listed in SUBSYSTEMS; a module
exposes COMMANDS, the click commands or groups it adds at the top level.
"""

from __future__ import annotations

import importlib
import sys

import click

from agentenv import __version__
from agentenv.blockd.remote import install_private_store
from agentenv.errors import AgentEnvError
from agentenv.settings import SettingsError

SUBSYSTEMS = (
    "storage", "blockd", "envd", "guest", "runtime", "template", "node", "network", "scheduler",
    "gateway", "snapshot", "volume", "settings",
)


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="aenv")
def cli() -> None:
    """AgentENV: a VM per agent trajectory, E2B-compatible."""


for _name in SUBSYSTEMS:
    for _command in importlib.import_module(f"agentenv.cli.{_name}").COMMANDS:
        cli.add_command(_command)


def main() -> None:
    install_private_store()  # commands that read a remote layer without blockd (docs/remote-layers.md)
    try:
        code = cli(standalone_mode=False)
    except click.exceptions.Abort:
        click.echo("aborted", err=True)
        sys.exit(130)
    except click.ClickException as exc:
        exc.show()
        sys.exit(exc.exit_code)
    except (AgentEnvError, SettingsError) as exc:
        click.echo(f"aenv: error: {exc}", err=True)
        sys.exit(1)
    except OSError as exc:
        click.echo(f"aenv: error: {exc}", err=True)
        sys.exit(1)
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
