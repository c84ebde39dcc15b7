"""`aenv scheduler`: the gRPC server around SchedulerService, plus node discovery.

One grpc.aio server on one event loop (discovery runs there too). Schedule, Lookup, Holders and
ListNodes are answered from memory on the loop; RecordAssignment awaits its binding's write,
sent from the loop on the store's own connection (group commit, store.py `_LoopWriter`), and
Heartbeat and Release, which wait for Redis themselves, run in a pool of threads. So no call
holds the loop while Redis answers, and a stalled Redis delays writes only.
grpcio's threaded server costs less per call with a few workers (~105 us vs ~185 us here) but
then a handful of writes waiting for Redis hold every worker, Lookups queued behind them; with
enough workers to avoid that, the workers' contention for the GIL costs more than the loop
(bench/RESULTS.md).

Every method checks its caller first (ClusterAuth, control/scheduler/auth.py, wraps each when
the server is built): no credential derived from the cluster secret, no answer.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn, TypeVar

import grpc
import uvloop
from redis.exceptions import RedisError

from agentenv.control.redis_auth import RedisAuth
from agentenv.control.scheduler.auth import ClusterAuth
from agentenv.control.scheduler.discovery import Discovery
from agentenv.control.scheduler.metrics import LOOPBACK, SchedulerMetrics
from agentenv.control.scheduler.placement import PlacementError
from agentenv.control.scheduler.service import SchedulerConfig, SchedulerService
from agentenv.control.scheduler.store import DEFAULT_PREFIX, Store, StoreError
from agentenv.errors import AgentEnvError
from agentenv.fsutil import read_pem
from agentenv.scheduling.client import REFUSED_KEY, REQUEST_KEY
from agentenv.scheduling.proto import scheduler_pb2 as pb
from agentenv.scheduling.proto import scheduler_pb2_grpc as pb_grpc

log = logging.getLogger("agentenv.control.scheduler.server")

EMPTY = pb.Empty()
# Threads for Heartbeat and Release: while Redis stalls each holds one for up to the store's
# timeout, so 100 nodes' heartbeats queue here and not in front of anything else.
REDIS_CALL_THREADS = 16
#: The largest request the scheduler receives (grpc's default is 4 MiB). The largest message is
#: a node's heartbeat (NodeStatus); serialized, for a node far larger than any we run, with
#: 4,096 sandboxes (20-character ids, 40-character teams: 75 bytes each, 0.3 MB), 1,024
#: templates each under its id and two 128-character names with 8 layers per name (2.1 MB in
#: templates and template_layers), and 8,192 digests in each of layers, blobs and
#: partial_blobs (73 bytes each, 1.8 MB): 4.3 MB (tests/control/test_scheduler_auth.py builds
#: it). Twice that, rounded: 8 MiB. A request is parsed only after its caller's credential
#: passed (control/scheduler/auth.py); this bounds what a stranger makes grpc buffer.
MAX_MESSAGE_BYTES = 8 << 20
T = TypeVar("T")
R = TypeVar("R")
FAILURES = (PlacementError, RedisError, StoreError, OSError)


async def _abort(context: grpc.aio.ServicerContext[Any, Any], exc: Exception) -> NoReturn:
    if isinstance(exc, PlacementError):
        trailing: tuple[tuple[str, str], ...] = ()
        if exc.refused:
            trailing = ((REFUSED_KEY, ",".join(f"{r}={n}" for r, n in exc.refused.items())),
                        (REQUEST_KEY, exc.request))
        await context.abort(exc.code, exc.message, trailing_metadata=trailing)
    log.warning("binding store unavailable: %s", exc)
    await context.abort(grpc.StatusCode.UNAVAILABLE,
                        f"the scheduler's Redis is unavailable: {exc}")
    raise AssertionError("unreachable")  # context.abort raises


class _Servicer(pb_grpc.SchedulerServicer):
    def __init__(self, service: SchedulerService, pool: ThreadPoolExecutor) -> None:
        self.service = service
        self.pool = pool  # for the calls that wait for Redis themselves

    def _in_pool(self, fn: Callable[[T], R], request: T) -> asyncio.Future[R]:
        return asyncio.get_running_loop().run_in_executor(self.pool, fn, request)

    async def Schedule(self, request: pb.ScheduleRequest, context: Any) -> pb.ScheduleResponse:
        try:
            return self.service.schedule(request)
        except FAILURES as exc:
            await _abort(context, exc)

    async def RecordAssignment(self, request: pb.Assignment, context: Any) -> pb.Empty:
        try:
            await self.service.record(request)
        except FAILURES as exc:
            await _abort(context, exc)
        return EMPTY

    async def Release(self, request: pb.ReleaseRequest, context: Any) -> pb.Empty:
        try:
            await self._in_pool(self.service.release, request)
        except FAILURES as exc:
            await _abort(context, exc)
        return EMPTY

    async def Lookup(self, request: pb.LookupRequest, context: Any) -> pb.LookupResponse:
        try:
            return self.service.lookup(request)
        except FAILURES as exc:
            await _abort(context, exc)

    async def Heartbeat(self, request: pb.NodeStatus, context: Any) -> pb.HeartbeatResponse:
        try:
            return await self._in_pool(self.service.heartbeat, request)
        except FAILURES as exc:
            await _abort(context, exc)

    async def ListNodes(self, request: pb.Empty, context: Any) -> pb.NodeList:
        return self.service.list_nodes()

    async def Holders(self, request: pb.HoldersRequest, context: Any) -> pb.HoldersResponse:
        try:
            return self.service.holders(request)
        except FAILURES as exc:
            await _abort(context, exc)


DEFAULT_LISTEN = "127.0.0.1:9090"
TLS_CERT_ENV = "AENV_SCHEDULER_TLS_CERT"
TLS_KEY_ENV = "AENV_SCHEDULER_TLS_KEY"
TLS_CLIENT_CA_ENV = "AENV_SCHEDULER_TLS_CLIENT_CA"


@dataclass(frozen=True)
class ServerTls:
    """The scheduler's certificate and key (PEM); with `client_ca`, every client must show a
    certificate that CA signed (mTLS) before any call."""

    cert: bytes
    key: bytes
    client_ca: bytes | None = None

    @classmethod
    def load(cls, cert: str | None, key: str | None, client_ca: str | None) -> ServerTls | None:
        """From file paths (--tls-cert, --tls-key, --tls-client-ca); None without any: plaintext."""
        if not cert and not key:
            if client_ca:
                raise AgentEnvError(f"{TLS_CLIENT_CA_ENV} (--tls-client-ca) needs the server's "
                                    f"certificate and key ({TLS_CERT_ENV}, {TLS_KEY_ENV})")
            return None
        if not cert or not key:
            raise AgentEnvError(f"{TLS_CERT_ENV} (--tls-cert) and {TLS_KEY_ENV} (--tls-key) go "
                                "together")
        return cls(read_pem(cert, TLS_CERT_ENV), read_pem(key, TLS_KEY_ENV),
                   read_pem(client_ca, TLS_CLIENT_CA_ENV) if client_ca else None)

    def credentials(self) -> grpc.ServerCredentials:
        return grpc.ssl_server_credentials(
            [(self.key, self.cert)], root_certificates=self.client_ca,
            require_client_auth=self.client_ca is not None)


@dataclass
class SchedulerOptions:
    #: the cluster secret: every caller's token is derived from it (required)
    cluster_secret: str
    #: loopback unless told otherwise: a cluster names the address its nodes reach
    listen: str = DEFAULT_LISTEN
    redis_url: str = "redis://127.0.0.1:6379/0"
    redis_auth: RedisAuth = field(default_factory=RedisAuth)
    prefix: str = DEFAULT_PREFIX
    config: SchedulerConfig = field(default_factory=SchedulerConfig)
    static_nodes: list[str] = field(default_factory=list)
    nodes_file: Path | None = None
    k8s_service: str | None = None
    #: TLS (and mTLS with a client CA) when set; plaintext otherwise
    tls: ServerTls | None = None
    #: Prometheus metrics on this port (control/scheduler/metrics.py); None: not served
    metrics_port: int | None = None
    metrics_bind: str = LOOPBACK


class SchedulerServer:
    """Service + gRPC server + discovery, started and stopped together (tests use it in-process)."""

    def __init__(self, options: SchedulerOptions) -> None:
        if not options.cluster_secret:
            raise AgentEnvError("the scheduler needs the cluster secret (--cluster-secret-file "
                                "or AENV_CLUSTER_SECRET): every caller proves it holds it")
        self.options = options
        store = Store(options.redis_url, options.prefix, auth=options.redis_auth)
        self.service = SchedulerService(store, options.config, options.cluster_secret)
        self.discovery = Discovery(
            self.service,
            static=options.static_nodes,
            nodes_file=options.nodes_file,
            k8s_service=options.k8s_service,
        )
        self.metrics = SchedulerMetrics()
        self.metrics.watch(self.service)
        self.server: grpc.aio.Server | None = None
        self.pool: ThreadPoolExecutor | None = None
        self.port = 0

    async def start(self) -> None:
        await asyncio.to_thread(self.service.start)
        await self.discovery.start()
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0),
                                          ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)])
        self.pool = ThreadPoolExecutor(REDIS_CALL_THREADS, thread_name_prefix="scheduler-redis")
        auth = ClusterAuth(self.options.cluster_secret, self.metrics.observe)
        auth.install(server, _Servicer(self.service, self.pool))
        try:
            tls = self.options.tls
            if tls is None:
                self.port = server.add_insecure_port(self.options.listen)
            else:
                self.port = server.add_secure_port(self.options.listen, tls.credentials())
        except RuntimeError as exc:
            await self.stop()
            raise AgentEnvError(f"cannot listen on {self.options.listen}: {exc}") from exc
        if self.port == 0 and not self.options.listen.startswith("unix:"):
            await self.stop()
            raise AgentEnvError(f"cannot listen on {self.options.listen} (in use?)")
        self.server = server
        await server.start()
        if self.options.metrics_port is not None:
            self.metrics.serve(self.options.metrics_port, self.options.metrics_bind)
        log.info("scheduler listening", extra={
            "listen": self.options.listen, "port": self.port,
            "tls": "off" if tls is None else "mtls" if tls.client_ca else "on"})

    async def stop(self, grace: float = 1.0) -> None:
        if self.server is not None:
            await self.server.stop(grace)
            self.server = None
        if self.pool is not None:
            await asyncio.to_thread(self.pool.shutdown)
            self.pool = None
        await self.discovery.stop()
        await asyncio.to_thread(self.metrics.close)
        await asyncio.to_thread(self.service.close)


def run(options: SchedulerOptions, on_ready: Callable[[SchedulerServer], None] | None = None) -> None:
    """Serve until SIGTERM/SIGINT."""

    async def main() -> None:
        server = SchedulerServer(options)
        await server.start()
        if on_ready:
            on_ready(server)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        await server.stop()

    # uvloop: ~10% less CPU per call than asyncio's loop for grpc.aio here (bench/RESULTS.md).
    uvloop.run(main())
