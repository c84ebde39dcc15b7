"""`aenv gateway` runs the cluster's HTTP entry point; `aenv team ...` manages teams and keys."""

from __future__ import annotations

import asyncio
import re
from pathlib import Path
from typing import Any

import click

from agentenv import logs
from agentenv.cli.redis_options import redis_auth_options
from agentenv.errors import AgentEnvError
from agentenv.settings import get_settings, warn_unknown

DEFAULT_REDIS = "redis://127.0.0.1:6379/0"


def _check_domain(ctx: Any, param: Any, value: str | None) -> str | None:
    from agentenv.cli.node import _check_domain as check

    return check(value)


@click.command("gateway")
@click.option("--host", default="0.0.0.0", show_default=True, help="Address to listen on.")
@click.option("--port", type=int, default=8080, show_default=True)
@click.option("--listen", default=None, metavar="HOST:PORT",
              help="Address and port in one (as `aenv scheduler --listen`); overrides "
              "--host/--port.")
@click.option("--scheduler", "scheduler",
              default=lambda: get_settings().scheduler or "127.0.0.1:9090",
              show_default="$AENV_SCHEDULER or 127.0.0.1:9090", help="host:port of `aenv scheduler` (gRPC).")
@click.option("--redis", "redis_url", default=lambda: get_settings().redis_url or DEFAULT_REDIS,
              show_default=f"$AENV_REDIS_URL or {DEFAULT_REDIS}", help="Redis with the teams, keys and ownership records.")
@redis_auth_options
@click.option("--cluster-secret-file", type=click.Path(dir_okay=False, path_type=Path),
              default=None,
              help="The secret every node of the cluster requires (default: "
              "$AENV_CLUSTER_SECRET).")
@click.option("--domain", default=lambda: get_settings().domain or None, callback=_check_domain,
              help="Sandbox domain given to SDKs ({port}-{id}.DOMAIN reaches that sandbox port "
              "through the gateway), e.g. localhost:8080.")
@click.option("--public-metrics/--no-public-metrics",
              default=lambda: get_settings().public_metrics, show_default="$AENV_PUBLIC_METRICS",
              help="Serve /metrics without a credential (default: "
              "`Authorization: Bearer $(aenv metrics-token)`).")
@click.option("--log-level", default="info", show_default=True)
def gateway_command(host: str, port: int, listen: str | None, scheduler: str, redis_url: str,
                    redis_user: str | None, redis_password_file: Path | None,
                    cluster_secret_file: Path | None, domain: str | None,
                    public_metrics: bool, log_level: str) -> None:
    """Run the gateway: the E2B API of a whole cluster, and its sandbox traffic."""
    # lazy: keeps `aenv --help` fast (cli/main.py imports every command module)
    from agentenv.control.gateway.server import GatewayOptions, serve
    from agentenv.control.redis_auth import RedisAuth  # lazy: as above

    logs.setup(log_level)
    warn_unknown("gateway")  # a mistyped AENV_ name would be ignored silently
    if listen is not None:
        found = re.fullmatch(r"\[?([0-9A-Za-z.:_-]+?)\]?:(\d{1,5})", listen)
        if not found:
            raise click.BadParameter(f"{listen!r} is not HOST:PORT", param_hint="--listen")
        host, port = found.group(1), int(found.group(2))
    serve(GatewayOptions(host=host, port=port, scheduler=scheduler, redis=redis_url,
                         redis_auth=RedisAuth.load(redis_user, redis_password_file),
                         cluster_secret_file=cluster_secret_file, domain=domain,
                         public_metrics=public_metrics))


def _run(work: Any) -> Any:
    # lazy: keeps `aenv --help` fast (cli/main.py imports every command module)
    from agentenv.control.gateway.store import GatewayStore

    url, auth = _REDIS[0]

    async def main() -> Any:
        store = GatewayStore(url, auth)
        try:
            return await work(store)
        finally:
            await store.close()

    return asyncio.run(main())


_REDIS: list[Any] = [(DEFAULT_REDIS, None)]


@click.group("team")
@click.option("--redis", "redis_url", default=None,
              help=f"Redis of the cluster (default: $AENV_REDIS_URL or {DEFAULT_REDIS}).")
@redis_auth_options
def team_group(redis_url: str | None, redis_user: str | None,
               redis_password_file: Path | None) -> None:
    """Teams of a cluster: each has API keys and sees only its own sandboxes."""
    # lazy: `aenv --help` loads only what every command needs (cli/main.py imports this)
    from agentenv.control.redis_auth import RedisAuth

    _REDIS[0] = (redis_url or get_settings().redis_url or DEFAULT_REDIS,
                 RedisAuth.load(redis_user, redis_password_file))


@team_group.command("create")
@click.argument("name")
def team_create(name: str) -> None:
    """Create team NAME (1-40 lowercase letters, digits, '-')."""
    _run(lambda store: store.create_team(name))
    click.echo(f"team {name} created; `aenv team key {name}` makes its API key")


@team_group.command("key")
@click.argument("name")
def team_key(name: str) -> None:
    """Print a new API key of team NAME (shown once; only its hash is stored)."""
    click.echo(_run(lambda store: store.new_key(name)))


@team_group.command("ls")
def team_ls() -> None:
    """List the teams and how many keys each has."""
    for team in _run(lambda store: store.teams()):
        click.echo(f"{team['name']}\tkeys={team['keys']}")


@click.command("metrics-token")
@click.option("--cluster-secret-file", type=click.Path(dir_okay=False, path_type=Path),
              default=None, help="The cluster secret (default: $AENV_CLUSTER_SECRET).")
def metrics_token_command(cluster_secret_file: Path | None) -> None:
    """Print the token a Prometheus scraper of the cluster sends (`Authorization: Bearer`) to
    the gateways' and nodes' /metrics: derived from the cluster secret, good for nothing else."""
    # lazy: `aenv --help` loads only what every command needs (cli/main.py imports this)
    from agentenv.api.auth import metrics_token

    click.echo(metrics_token(_cluster_secret(cluster_secret_file)))


def _cluster_secret(path: Path | None) -> str:
    # lazy: `aenv --help` loads only what every command needs (cli/main.py imports this)
    from agentenv.cluster_keys import load_cluster_secret

    secret = load_cluster_secret(path)
    if secret is None:
        raise AgentEnvError("no cluster secret: --cluster-secret-file or AENV_CLUSTER_SECRET")
    return secret


@click.command("node-key")
@click.option("--node-id", required=True, help="The node's id (its --node-id).")
@click.option("--cluster-secret-file", type=click.Path(dir_okay=False, path_type=Path),
              default=None, help="The cluster secret (default: $AENV_CLUSTER_SECRET).")
def node_key_command(node_id: str, cluster_secret_file: Path | None) -> None:
    """Print the key of node NODE_ID (its --node-key-file): derived from the cluster secret,
    good for that node only (the gateway's requests to it, its calls to the scheduler)."""
    # lazy: `aenv --help` loads only what every command needs (cli/main.py imports this)
    from agentenv.cluster_keys import node_key

    click.echo(node_key(_cluster_secret(cluster_secret_file), node_id))


COMMANDS = [gateway_command, team_group, metrics_token_command, node_key_command]
