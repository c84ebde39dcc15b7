"""`aenv` commands of the network subsystem: the node-wide egress proxy."""

from __future__ import annotations

import asyncio
from ipaddress import IPv4Network

import click

from agentenv import logs
from agentenv.errors import AgentEnvError


@click.command("egress-proxy")
@click.option("--control", "control_path", required=True,
              help="Unix socket the node controls the proxy on (JSON lines).")
@click.option("--port", type=int, required=True, help="TCP port the slots' redirects go to.")
@click.option("--bind", default="0.0.0.0", show_default=True)
@click.option("--metrics-port", type=int, default=None, help="Serve Prometheus metrics here.")
@click.option("--metrics-bind", default="127.0.0.1", show_default=True)
@click.option("--open-range", multiple=True,
              help="A walled range (CIDR) to let through anyway, e.g. a lab's private network.")
@click.option("--max-connections", type=int, default=None, help="Connections at once, all slots.")
@click.option("--max-per-slot", type=int, default=None, help="Connections at once, per slot.")
@click.option("--idle-timeout", type=float, default=None, help="Seconds without a byte.")
@click.option("--peek-timeout", type=float, default=None,
              help="Seconds to wait for a TLS hello or an HTTP head on 80/443.")
@click.option("--log-level", default="info", show_default=True)
def egress_proxy_command(control_path: str, port: int, bind: str, metrics_port: int | None,
                         metrics_bind: str, open_range: tuple[str, ...],
                         max_connections: int | None, max_per_slot: int | None,
                         idle_timeout: float | None, peek_timeout: float | None,
                         log_level: str) -> None:
    """Run the node-wide egress proxy and metadata service in the foreground."""
    # lazy: keeps `aenv --help` fast (cli/main.py imports every command module)
    from agentenv.network import egress

    if not 0 <= port < 65536:
        raise AgentEnvError(f"--port {port} is not a TCP port")
    ranges: list[IPv4Network] = []
    for text in open_range:
        try:
            ranges.append(IPv4Network(text))
        except ValueError:
            raise AgentEnvError(f"--open-range {text!r} is not an IPv4 CIDR") from None
    server = egress.EgressProxyServer(
        control_path, port, bind, metrics_port=metrics_port, metrics_bind=metrics_bind,
        open_ranges=tuple(ranges),
        max_connections=max_connections or egress.MAX_CONNECTIONS,
        max_per_slot=max_per_slot or egress.MAX_CONNECTIONS_PER_SLOT,
        idle_timeout=idle_timeout or egress.IDLE_TIMEOUT,
        peek_timeout=peek_timeout or egress.PEEK_TIMEOUT)
    logs.setup(log_level)
    try:
        asyncio.run(egress.run(server))
    except OSError as exc:
        raise AgentEnvError(f"egress proxy cannot start: {exc.strerror or exc}") from None


COMMANDS: list[click.Command] = [egress_proxy_command]
