"""Run the gateway: uvicorn with the node's hardened HTTP/1.1 protocol around GatewayApp."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from pathlib import Path

import uvicorn

from agentenv.cluster_keys import load_cluster_secret
from agentenv.control.gateway.app import GatewayApp
from agentenv.control.gateway.placement import SchedulerLink
from agentenv.control.gateway.store import GatewayStore
from agentenv.control.redis_auth import RedisAuth
from agentenv.errors import AgentEnvError
from agentenv.relay.concurrency import ConcurrencyCap, max_concurrent
from agentenv.relay.server import hardened_config, quiet_stream_aborts
from agentenv.relay.stream import RelayLimits
from agentenv.relay.tls import NodeTls
from agentenv.scheduling.client import ClientTls, Credentials

log = logging.getLogger("agentenv.control.gateway.server")


@dataclass
class GatewayOptions:
    host: str = "0.0.0.0"
    port: int = 8080
    scheduler: str = "127.0.0.1:9090"
    redis: str = "redis://127.0.0.1:6379/0"
    redis_auth: RedisAuth = field(default_factory=RedisAuth)
    cluster_secret_file: Path | None = None
    domain: str | None = None
    public_metrics: bool = False


def read_cluster_secret(path: Path | None) -> str:
    secret = load_cluster_secret(path)
    if secret is None:
        raise AgentEnvError(
            "the gateway needs the cluster secret: --cluster-secret-file or AENV_CLUSTER_SECRET"
        )
    return secret


def build_app(options: GatewayOptions) -> GatewayApp:
    secret = read_cluster_secret(options.cluster_secret_file)
    # TLS settings read (and checked) at start: a bad file fails the gateway, not a request
    nodes_tls = NodeTls.from_env()
    return GatewayApp(
        SchedulerLink(options.scheduler, Credentials.gateway(secret), ClientTls.from_env(),
                      node_scheme=nodes_tls.scheme),
        GatewayStore(options.redis, options.redis_auth),
        secret,
        domain=options.domain,
        public_metrics=options.public_metrics,
        node_tls=nodes_tls.client_context(),
    )


def serve(options: GatewayOptions) -> None:
    app = build_app(options)
    limits: RelayLimits = app.limits
    quiet_stream_aborts()
    capped = ConcurrencyCap(app, max_concurrent(), "the gateway")
    config = hardened_config(capped, options.host, options.port, limits.max_head_bytes,
                             limits.head_timeout, 5, backlog=4096,
                             ws_max_bytes=limits.max_ws_message_bytes)
    server = uvicorn.Server(config)
    log.info("gateway starting", extra={"host": options.host, "port": options.port,
                                        "scheduler": options.scheduler})
    asyncio.run(server.serve())
    if not server.started:
        raise AgentEnvError(f"gateway did not start on {options.host}:{options.port}")
