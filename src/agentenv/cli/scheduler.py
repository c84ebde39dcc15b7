"""`aenv scheduler`: the control plane's placement and binding service (gRPC, default
127.0.0.1:9090)."""

from __future__ import annotations

from pathlib import Path

import click

from agentenv import logs
from agentenv.cli.redis_options import redis_auth_options
from agentenv.errors import AgentEnvError
from agentenv.settings import get_settings, warn_unknown


@click.command("scheduler")
@click.option("--listen", default="127.0.0.1:9090", show_default=True,
              help="gRPC address, HOST:PORT (or unix:PATH); a cluster names the address its "
              "nodes and gateways reach.")
@click.option("--cluster-secret-file", type=click.Path(dir_okay=False, path_type=Path),
              default=None, help="The cluster secret: every caller's token is derived from it "
              "(default: $AENV_CLUSTER_SECRET; required).")
@click.option("--tls-cert", default=lambda: get_settings().scheduler_tls_cert or None,
              type=click.Path(dir_okay=False),
              help="Serve TLS with this certificate (PEM; with --tls-key). Default: "
              "$AENV_SCHEDULER_TLS_CERT, else plaintext.")
@click.option("--tls-key", default=lambda: get_settings().scheduler_tls_key or None,
              type=click.Path(dir_okay=False),
              help="The key of --tls-cert (PEM). Default: $AENV_SCHEDULER_TLS_KEY.")
@click.option("--tls-client-ca", default=lambda: get_settings().scheduler_tls_client_ca or None,
              type=click.Path(dir_okay=False),
              help="mTLS: every client must show a certificate this CA signed (PEM). Default: "
              "$AENV_SCHEDULER_TLS_CLIENT_CA, else none.")
@click.option("--redis", "redis_url",
              default=lambda: get_settings().redis_url or "redis://127.0.0.1:6379/0", show_default="$AENV_REDIS_URL or "
              "redis://127.0.0.1:6379/0",
              help="Where bindings and the node registry live (redis:// or unix://PATH).")
@redis_auth_options
@click.option("--redis-prefix", default="aenv:sched:", show_default=True,
              help="Key prefix (several clusters can share one Redis).")
@click.option("--strategy", type=click.Choice(
    ["cache-aware", "least-loaded", "round-robin", "random"]), default="cache-aware",
    show_default=True, help="Default placement strategy (a request may name another).")
@click.option("--nodes", "static_nodes", multiple=True,
              help="Static nodes, ID=HOST:PORT or HOST:PORT (repeatable or comma-separated).")
@click.option("--nodes-file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="File of static nodes, one ID=HOST:PORT per line; re-read when it changes.")
@click.option("--k8s-service", default=None, metavar="NAMESPACE/NAME",
              help="Discover nodes from the EndpointSlices of this headless Service.")
@click.option("--heartbeat-interval", type=click.FloatRange(0.05, 3600), default=2.0,
              show_default=True, help="Seconds between node heartbeats (told to the nodes).")
@click.option("--missed-heartbeats", type=click.IntRange(1, 100), default=3, show_default=True,
              help="A node that missed this many heartbeats is down.")
@click.option("--self-registration/--no-self-registration", default=True, show_default=True,
              help="Accept heartbeats from nodes no discovery source listed.")
@click.option("--min-disk-free-mib", type=click.IntRange(0), default=512, show_default=True,
              help="Never place on a node with less free disk.")
@click.option("--reconcile-grace", type=click.FloatRange(0, 600), default=5.0, show_default=True,
              help="Seconds a new binding is safe from a heartbeat that does not list it yet "
              "(and a released one from a heartbeat that still does).")
@click.option("--peer-credential-ttl", type=click.FloatRange(1, 86400), default=120.0,
              show_default=True, help="Seconds a node's credential for a layer peer (given "
              "with each Holders answer) is good for: how long a node no longer up can still "
              "fetch chunks from its peers.")
@click.option("--metrics-port", type=click.IntRange(0, 65535), default=None,
              help="Serve Prometheus metrics on this port.")
@click.option("--metrics-bind", default=lambda: get_settings().scheduler_metrics_bind or "127.0.0.1",
              show_default="$AENV_SCHEDULER_METRICS_BIND or 127.0.0.1",
              help="Address of the metrics port (loopback: call counts are the operator's).")
@click.option("--log-level", default="info", show_default=True)
def scheduler_command(
    listen: str, cluster_secret_file: Path | None, tls_cert: str | None, tls_key: str | None,
    tls_client_ca: str | None, redis_url: str, redis_user: str | None,
    redis_password_file: Path | None, redis_prefix: str, strategy: str,
    static_nodes: tuple[str, ...], nodes_file: Path | None, k8s_service: str | None,
    heartbeat_interval: float, missed_heartbeats: int, self_registration: bool,
    min_disk_free_mib: int, reconcile_grace: float, peer_credential_ttl: float,
    metrics_port: int | None,
    metrics_bind: str, log_level: str,
) -> None:
    """Run the scheduler: placement, the sandbox -> node bindings, node heartbeats."""
    # lazy: keeps `aenv --help` fast (cli/main.py imports every command module)
    from agentenv.cluster_keys import load_cluster_secret
    from agentenv.control.redis_auth import RedisAuth  # lazy: as above
    from agentenv.control.scheduler.server import SchedulerOptions, ServerTls, run  # lazy: as above
    from agentenv.control.scheduler.service import SchedulerConfig  # lazy: as above

    logs.setup(log_level)
    warn_unknown("scheduler")  # a mistyped AENV_ name would be ignored silently
    if not redis_url.startswith(("redis://", "rediss://", "unix://")):
        raise AgentEnvError(f"--redis {redis_url!r}: expected redis://HOST:PORT/DB or unix://PATH")
    options = SchedulerOptions(
        cluster_secret=load_cluster_secret(cluster_secret_file) or "",  # required: the server says so
        listen=listen,
        redis_url=redis_url,
        redis_auth=RedisAuth.load(redis_user, redis_password_file),
        prefix=redis_prefix,
        config=SchedulerConfig(
            strategy=strategy,
            heartbeat_interval_s=heartbeat_interval,
            missed_heartbeats=missed_heartbeats,
            self_registration=self_registration,
            min_disk_free_mib=min_disk_free_mib,
            reconcile_grace_s=reconcile_grace,
            peer_credential_ttl_s=peer_credential_ttl,
        ),
        static_nodes=list(static_nodes),
        nodes_file=nodes_file,
        k8s_service=k8s_service or get_settings().k8s_service or None,
        tls=ServerTls.load(tls_cert, tls_key, tls_client_ca),
        metrics_port=metrics_port,
        metrics_bind=metrics_bind,
    )

    def ready(server: object) -> None:
        click.echo(f"scheduler listening on {listen}", err=True)

    run(options, on_ready=ready)


COMMANDS = [scheduler_command]
