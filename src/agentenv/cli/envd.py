"""`aenv` commands of the envd subsystem: run the in-guest agent on this host, for tests and debugging."""

from __future__ import annotations

import asyncio
import os

import click

from agentenv.errors import AgentEnvError
from agentenv.guest.envd import DEFAULT_PORT
from agentenv.guest.envd.log import setup
from agentenv.guest.envd.server import SHELL_FALLBACK_ENV, config_from_environment, serve


@click.command("envd")
@click.option(
    "--root",
    "root",
    type=click.Path(file_okay=False, path_type=str),
    required=True,
    help="Directory that plays the guest's root: paths resolve inside it, root's commands run chrooted there.",
)
@click.option("--port", type=int, default=DEFAULT_PORT, show_default=True)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to listen on.")
@click.option(
    "--shell-fallback",
    default=None,
    help=f"Shell used when the requested one (e.g. /bin/bash) is missing in the root [env {SHELL_FALLBACK_ENV}].",
)
@click.option("--log-level", default="info", show_default=True)
def envd_command(root: str, port: int, host: str, shell_fallback: str | None, log_level: str) -> None:
    """Serve the E2B envd protocol for a directory, as the VM's envd does."""
    if not os.path.isdir(root):
        raise AgentEnvError(f"--root {root!r} is not a directory")
    if not 0 < port < 65536:
        raise AgentEnvError(f"--port {port} is not a TCP port")
    setup(log_level)
    # On a host, /init must not set this machine's clock or hostname.
    config = config_from_environment(os.path.abspath(root), system_changes=False)
    if shell_fallback:
        config.shell_fallback = shell_fallback
    try:
        asyncio.run(serve(config, host, port))
    except OSError as exc:
        raise AgentEnvError(f"envd cannot listen on {host}:{port}: {exc.strerror or exc}") from None


COMMANDS: list[click.Command] = [envd_command]
