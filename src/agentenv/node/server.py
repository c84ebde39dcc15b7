"""Assemble and run the node server: store, backend, orchestrator, API, uvicorn.

SIGTERM/SIGINT stop it gracefully: uvicorn stops accepting, open requests get a few seconds, then
the orchestrator pauses every running sandbox and closes the database.
"""

from __future__ import annotations

import asyncio
import fcntl
import logging
import os
import socket
from dataclasses import dataclass, field
from pathlib import Path

import uvicorn
from starlette.routing import Route

from agentenv.errors import AgentEnvError
from agentenv.node.admission import Admission
from agentenv.node.api import NodeApp
from agentenv.node.backend import SandboxBackend
from agentenv.node.gc import LayerCollector
from agentenv.node.http_server import hardened_protocol, quiet_stream_aborts
from agentenv.node.metrics import NodeMetrics
from agentenv.node.orchestrator import NodeConfig, Orchestrator
from agentenv.node.security import TokenIssuer, load_api_key, secure_state_dir
from agentenv.node.store import Store

log = logging.getLogger("agentenv.node.server")

DEFAULT_STATE_DIR = Path(os.environ.get("AENV_HOME", "/var/lib/aenv"))


@dataclass
class ServeOptions:
    state_dir: Path = DEFAULT_STATE_DIR
    host: str = "127.0.0.1"
    port: int = 8000
    backend: str = "vm"  # the product; "process" is for development and tests
    config: NodeConfig = field(default_factory=NodeConfig)
    graceful_seconds: float = 5.0


def make_backend(name: str, state_dir: Path) -> SandboxBackend:
    if name == "process":
        from agentenv.node.process_backend import ProcessBackend

        return ProcessBackend(state_dir)
    if name == "vm":
        from agentenv.node.vm_backend import VmBackend

        return VmBackend(state_dir)
    raise AgentEnvError(f"unknown backend {name!r}: this build has 'process' and 'vm'")


def build_app(
    options: ServeOptions,
    backend: SandboxBackend | None = None,
    extra_routes: list[Route] | None = None,
) -> NodeApp:
    state = options.state_dir
    secure_state_dir(state)
    api_key = load_api_key(state)
    metrics = NodeMetrics()
    orchestrator = Orchestrator(
        Store(state / "node.db"),
        backend or make_backend(options.backend, state),
        TokenIssuer(state),
        options.config,
        on_op=metrics.record_op,
    )
    orchestrator.gc = LayerCollector(orchestrator, state, metrics)
    orchestrator.admission = Admission.from_env(state)
    metrics.watch_ready_pools(lambda: getattr(orchestrator.backend, "pool", None))
    from agentenv.node.snapshot_api import SnapshotMoveApi
    from agentenv.node.template_api import TemplateBuildApi

    builds = TemplateBuildApi(orchestrator, state, api_key)
    moves = SnapshotMoveApi(orchestrator)  # aenv snapshot push/pull (snapshot/repository.py)
    builds.on_published = moves.publish_build
    return NodeApp(
        orchestrator, api_key, metrics,
        extra_routes=[*(extra_routes or []), *builds.routes(), *moves.routes()],
    )


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


def serve(options: ServeOptions) -> None:
    """Run the node until SIGTERM/SIGINT."""
    lock_state_dir(options.state_dir)
    check_port_free(options.host, options.port)
    app = build_app(options)
    limits = app.proxy.limits
    quiet_stream_aborts()
    config = uvicorn.Config(
        app,
        host=options.host,
        port=options.port,
        http=hardened_protocol(limits.max_head_bytes, limits.head_timeout),
        h11_max_incomplete_event_size=limits.max_head_bytes + 1,
        log_config=None,
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=options.graceful_seconds,
        timeout_keep_alive=30,
        server_header=False,
        ws="websockets-sansio",
        ws_max_size=64 << 20,
    )
    server = uvicorn.Server(config)
    log.info(
        "node starting",
        extra={"host": options.host, "port": options.port, "state_dir": str(options.state_dir)},
    )
    asyncio.run(server.serve())
    if not server.started:
        raise AgentEnvError(
            f"node server did not start on {options.host}:{options.port} (see the log above)"
        )
