"""Assemble and run the node server: store, backend, orchestrator, API, uvicorn.

SIGTERM/SIGINT stop it gracefully: uvicorn stops accepting, open requests get a few seconds, then
the orchestrator pauses every running sandbox and closes the database.
"""

from __future__ import annotations

import asyncio
import fcntl
import functools
import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import uvicorn
from starlette.routing import Route

from agentenv import cluster_keys
from agentenv.api.auth import NODE_KEY_HEADER, carries_node_key, metrics_token
from agentenv.blockd.remote import install_private_store
from agentenv.errors import AgentEnvError
from agentenv.node.admission import Admission, TeamQuotas, space_reserve
from agentenv.node.api import NodeApp
from agentenv.node.backend import Capabilities, SandboxBackend
from agentenv.node.events import EventLog, retention_from_env
from agentenv.node.events_api import EventsApi
from agentenv.node.gc import LayerCollector
from agentenv.node.metrics import NodeMetrics
from agentenv.node.observe_api import ObserveApi
from agentenv.node.observer import Observer, ObserverConfig
from agentenv.node.orchestrator import NodeConfig, Orchestrator
from agentenv.node.security import TokenIssuer, load_api_key, secure_state_dir
from agentenv.node.store import Store
from agentenv.node.volume_api import VolumeApi
from agentenv.node.volumes import VolumeLimits, Volumes
from agentenv.node.webhooks import DeliveryPolicy, Webhooks
from agentenv.relay.concurrency import ConcurrencyCap, max_concurrent
from agentenv.relay.connections import ConnectionLimits
from agentenv.relay.server import hardened_config, quiet_stream_aborts, trusted_proxies
from agentenv.relay.tls import CA_ENV, NodeTls
from agentenv.scheduling.client import Credentials
from agentenv.settings import get_settings

log = logging.getLogger("agentenv.node.server")



@dataclass
class ServeOptions:
    state_dir: Path = field(default_factory=lambda: get_settings().state_home)
    host: str = "127.0.0.1"
    port: int = 8000
    backend: str = "vm"  # the product; "process" is for development and tests
    config: NodeConfig = field(default_factory=NodeConfig)
    graceful_seconds: float = 5.0
    #: set when the node is part of a cluster: it then serves only its gateway, which sends
    #: this key (agentenv.cluster_keys.node_key), and calls the scheduler with it
    node_key: str | None = None
    #: the cluster's metrics token (`aenv metrics-token`), for scrapers of /metrics
    metrics_token: str | None = None
    #: /metrics without a credential (a scraper on a trusted network)
    public_metrics: bool = False
    # The control plane (node/heartbeat.py): heartbeats go to this scheduler when set.
    scheduler: str | None = None
    node_id: str = ""
    advertise: str = ""  # host:port the gateway reaches this node's API at


def make_backend(name: str, state_dir: Path,
                 on_sandbox_lost: Callable[[str, str], None] | None = None) -> SandboxBackend:
    """`on_sandbox_lost(sandbox_id, reason)`: for a backend that sees sandboxes end on their own.
    Each backend module is imported only when chosen: the VM backend's imports (runtime,
    blockd, guest build) add 0.4-0.6 s to a node's start (measured on a loaded 2-core host),
    and a process-backend node needs none of them."""
    if name == "process":
        from agentenv.node.process_backend import ProcessBackend

        return ProcessBackend(state_dir)
    if name == "vm":
        from agentenv.node.vm_backend import VmBackend

        return VmBackend(state_dir, on_sandbox_lost=on_sandbox_lost)
    raise AgentEnvError(f"unknown backend {name!r}: this build has 'process' and 'vm'")


def build_app(
    options: ServeOptions,
    backend: SandboxBackend | None = None,
    extra_routes: list[Route] | None = None,
) -> NodeApp:
    """The node's app. A `backend` given here is used as it is: one that reports lost sandboxes
    must have been made with a callback of its own (make_backend wires the orchestrator's)."""
    state = options.state_dir
    secure_state_dir(state)
    api_key = load_api_key(state)
    metrics = NodeMetrics()
    if backend is None:
        # Only called once the backend runs, so after the orchestrator below exists.
        backend = make_backend(options.backend, state,
                               on_sandbox_lost=lambda sid, why: orchestrator.sandbox_lost(sid, why))
    # The one place the backend's optional capabilities are looked at (node/backend.py).
    capabilities = Capabilities.of(backend)
    orchestrator = Orchestrator(
        Store(state / "node.db"),
        backend,
        TokenIssuer(state),
        options.config,
        on_op=metrics.record_op,
        capabilities=capabilities,
    )
    # The parts are made here and handed to the orchestrator; configured through the local
    # names, never through the orchestrator.
    gc = LayerCollector(orchestrator, state, metrics)
    orchestrator.gc = gc
    node_id = options.node_id or socket.gethostname()
    events = EventLog(orchestrator.store, node_id, retention_from_env())
    orchestrator.events = events
    webhooks = Webhooks(orchestrator.store, DeliveryPolicy.from_env(), allow_private=(
        not options.node_key or get_settings().webhook_allow_private))
    if not options.node_key:  # in a cluster the gateway delivers (control/gateway/events.py)
        events.sinks.append(webhooks)
    observer = Observer(orchestrator, ObserverConfig.from_env())
    orchestrator.add_companion(observer)
    admission = Admission.from_env(state)
    if not options.node_key:  # a cluster's gateway counts a team over every node
        admission.quotas = TeamQuotas.from_env()
    else:  # the node's figures are every team's load: not in a team's answers
        admission.shared = True
    orchestrator.admission = admission
    volumes = Volumes(orchestrator.store, state, orchestrator.tokens, VolumeLimits.from_env(),
                      lambda: space_reserve(orchestrator.admission),
                      sealed=gc.request,
                      writers=orchestrator.volume_writers,
                      sharers=orchestrator.volume_sharers)
    orchestrator.volumes = volumes
    if (pools := capabilities.pools) is not None:
        metrics.watch_ready_pools(lambda: pools.pool)
    metrics.watch_admission(lambda: orchestrator.admission, orchestrator.all_sandboxes,
                            observer.usage)
    from agentenv.node.snapshot_api import SnapshotMoveApi
    from agentenv.node.template_api import TemplateBuildApi

    builds = TemplateBuildApi(orchestrator, state, api_key)
    moves = SnapshotMoveApi(orchestrator, state)  # aenv snapshot push/pull (snapshot/repository.py)
    builds.runner.on_published = moves.publish_build
    app = NodeApp(
        orchestrator,
        api_key,
        metrics,
        node_id=node_id,
        extra_routes=extra_routes,
        handlers={**builds.handlers(), **moves.handlers(),
                  **VolumeApi(volumes, orchestrator).handlers(),
                  **EventsApi(events, webhooks,
                              cluster=bool(options.node_key)).handlers(),
                  **ObserveApi(observer).handlers()},
        node_key=options.node_key,
        metrics_token=options.metrics_token,
        public_metrics=options.public_metrics,
    )
    if app.unserved:  # every operation of the route table has its handler on a node
        raise AgentEnvError("the node serves no handler for "
                            + ", ".join(op.operation_id for op in app.unserved))
    return app


def cluster_credentials(node_id: str, node_key_file: Path | None, cluster_secret: str | None,
                        metrics_token_file: Path | None) -> tuple[str | None, str | None]:
    """The node key and metrics token of a node of a cluster, (None, None) for a standalone
    node. A node is given its own key (a file, or AENV_NODE_KEY); the cluster secret itself
    (a one-machine development cluster) derives both."""
    key = cluster_keys.load_key(node_key_file, "AENV_NODE_KEY", "node key")
    token = cluster_keys.load_key(metrics_token_file, "AENV_METRICS_TOKEN", "metrics token")
    if cluster_secret is None:
        return key, token
    if key is not None:
        raise AgentEnvError("give a node its key or the cluster secret, not both")
    return cluster_keys.node_key(cluster_secret, node_id), token or metrics_token(cluster_secret)


def lock_state_dir(state_dir: Path) -> int:
    """Hold an exclusive lock on the state directory for this process's lifetime: two nodes
    adopting and reaping the same sandboxes would fight over them."""
    state_dir.mkdir(parents=True, exist_ok=True)
    fd = os.open(state_dir / "node.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise AgentEnvError(f"another node is already running on {state_dir}") from None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def check_port_free(host: str, port: int) -> None:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise AgentEnvError(f"cannot listen on {host}:{port}: {exc.strerror}") from exc


async def _serve_with_heartbeat(
    server: uvicorn.Server, app: NodeApp, options: ServeOptions, tls: NodeTls
) -> None:
    sender = None
    if options.scheduler:
        from agentenv.node.heartbeat import HeartbeatSender
        from agentenv.node.layer_peers import LayerPeers, blockd_socket_of

        if not options.node_key:
            raise AgentEnvError("a node of a scheduler needs its node key")
        node_id = options.node_id or socket.gethostname()
        credentials = Credentials.node(options.node_key, node_id)
        advertise = options.advertise or f"{options.host}:{options.port}"
        # blockd asks this node's API which peers hold a blob: on loopback, with what passes.
        local = {"0.0.0.0": "127.0.0.1", "::": "[::1]", "": "127.0.0.1"}.get(
            options.host, f"[{options.host}]" if ":" in options.host else options.host)
        api_url = f"http://{local}:{options.port}"
        if tls.serves:  # by the advertised name: the one its certificate names
            if tls.ca is None:
                raise AgentEnvError(f"a node of a scheduler that serves TLS needs {CA_ENV} "
                                    "(the CA of the nodes' certificates) for its blockd")
            api_url = f"https://{advertise}"
        headers = {NODE_KEY_HEADER.decode(): options.node_key}
        backend = app.orchestrator.backend
        peers = LayerPeers(options.scheduler, credentials, node_id, api_url, headers,
                           lambda: blockd_socket_of(backend), advertise.rpartition(":")[0],
                           api_ca=tls.ca if tls.serves else None,
                           serve_key=cluster_keys.peer_serve_key(options.node_key))
        app.api.router.routes.insert(0, peers.route())
        sender = HeartbeatSender(
            app.orchestrator, options.state_dir, options.scheduler, credentials,
            node_id=node_id, advertise=advertise, ready=lambda: server.started, peers=peers,
        )
        sender.start()
    try:
        await server.serve()
    finally:
        if sender is not None:
            await sender.stop()


ALLOW_PROCESS_IN_CLUSTER_ENV = "AENV_ALLOW_PROCESS_BACKEND_IN_CLUSTER"


def check_backend_allowed(options: ServeOptions) -> None:
    """The process backend runs sandboxes as processes of the node's host, with no isolation
    between teams: a node of a cluster refuses it unless the operator says it is a
    development cluster."""
    in_cluster = bool(options.node_key or options.scheduler)
    if options.backend == "process" and in_cluster and \
            not get_settings().allow_process_backend_in_cluster:
        raise AgentEnvError(
            "the process backend (development only: sandboxes are processes of this host, "
            "not VMs) is refused on a node of a cluster (a scheduler or a node key is "
            f"set): use --backend vm, or set {ALLOW_PROCESS_IN_CLUSTER_ENV}=1 for a "
            "development cluster")


def connection_limits(node_key: str | None) -> ConnectionLimits:
    """The node's bounds on open connections (relay/connections.py, from the environment). A
    node of a cluster sees every request come from its gateway: one that carries the node's key
    is the gateway's, and its body counts against the client the gateway names
    (X-Forwarded-For, which the gateway writes itself), else one stranger's slow bodies
    through the gateway would have every team's refused on this node."""
    vouch = functools.partial(carries_node_key, node_key=node_key) if node_key else None
    return ConnectionLimits.from_env(trusted_proxies(), vouch=vouch)


def serve(options: ServeOptions) -> None:
    """Run the node until SIGTERM/SIGINT."""
    check_backend_allowed(options)
    install_private_store()  # a remote layer read in the node itself (not through blockd)
    lock_state_dir(options.state_dir)
    check_port_free(options.host, options.port)
    tls = NodeTls.from_env()  # read and checked before anything starts
    app = build_app(options)
    limits = app.proxy.limits
    quiet_stream_aborts()
    capped = ConcurrencyCap(app, max_concurrent(), "the node")
    config = hardened_config(capped, options.host, options.port, limits.max_head_bytes,
                             limits.head_timeout, options.graceful_seconds,
                             ws_max_bytes=limits.max_ws_message_bytes,
                             tls_files=(tls.cert, tls.key) if tls.serves else None,  # type: ignore[arg-type]
                             connections=connection_limits(options.node_key))
    server = uvicorn.Server(config)
    log.info(
        "node starting",
        extra={"host": options.host, "port": options.port, "state_dir": str(options.state_dir),
               "tls": tls.serves},  # uvicorn's own line says http: it does not see our TLS
    )
    asyncio.run(_serve_with_heartbeat(server, app, options, tls))
    if not server.started:
        raise AgentEnvError(
            f"node server did not start on {options.host}:{options.port} (see the log above)"
        )
