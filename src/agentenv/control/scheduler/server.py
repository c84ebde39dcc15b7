"""`aenv scheduler`: the gRPC server around SchedulerService, plus node discovery.

The gRPC server is grpcio's threaded one, not grpc.aio: a unary call costs it ~130 us of CPU on
this host against ~200-300 us under grpc.aio (bench/RESULTS.md), and the service's work is
in-memory or one blocking Redis round trip. Discovery (file polling, the Kubernetes watch) runs
on the asyncio loop of `run` and updates the service under its lock.
"""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Callable
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

import grpc
from redis.exceptions import RedisError

from agentenv.control.proto import scheduler_pb2 as pb
from agentenv.control.proto import scheduler_pb2_grpc as pb_grpc
from agentenv.control.scheduler.discovery import Discovery
from agentenv.control.scheduler.placement import PlacementError
from agentenv.control.scheduler.service import SchedulerConfig, SchedulerService
from agentenv.control.scheduler.store import DEFAULT_PREFIX, Store, StoreError
from agentenv.errors import AgentEnvError

log = logging.getLogger("agentenv.control.scheduler.server")


# Worker threads of the gRPC server: concurrent calls beyond this queue in grpcio. Python runs
# one at a time anyway; threads let Redis round trips overlap, and keep Lookup (memory only)
# answering while writes wait for a Redis that is slow or stalled (REDIS_TIMEOUT_S at most).
WORKERS = 32
EMPTY = pb.Empty()


def _abort(context: grpc.ServicerContext, exc: Exception) -> NoReturn:
    if isinstance(exc, PlacementError):
        context.abort(exc.code, exc.message)
    log.warning("binding store unavailable: %s", exc)
    context.abort(grpc.StatusCode.UNAVAILABLE, f"the scheduler's Redis is unavailable: {exc}")
    raise AssertionError("unreachable")  # context.abort raises


FAILURES = (PlacementError, RedisError, StoreError, OSError)


class _Servicer(pb_grpc.SchedulerServicer):
    def __init__(self, service: SchedulerService) -> None:
        self.service = service

    def Schedule(self, request: pb.ScheduleRequest, context: Any) -> pb.ScheduleResponse:
        try:
            return self.service.schedule(request)
        except FAILURES as exc:
            _abort(context, exc)

    def RecordAssignment(self, request: pb.Assignment, context: Any) -> pb.Empty:
        try:
            self.service.record(request)
        except FAILURES as exc:
            _abort(context, exc)
        return EMPTY

    def Release(self, request: pb.ReleaseRequest, context: Any) -> pb.Empty:
        try:
            self.service.release(request)
        except FAILURES as exc:
            _abort(context, exc)
        return EMPTY

    def Lookup(self, request: pb.LookupRequest, context: Any) -> pb.LookupResponse:
        try:
            return self.service.lookup(request)
        except FAILURES as exc:
            _abort(context, exc)

    def Heartbeat(self, request: pb.NodeStatus, context: Any) -> pb.HeartbeatResponse:
        try:
            return self.service.heartbeat(request)
        except FAILURES as exc:
            _abort(context, exc)

    def ListNodes(self, request: pb.Empty, context: Any) -> pb.NodeList:
        return self.service.list_nodes()

    def Holders(self, request: pb.HoldersRequest, context: Any) -> pb.HoldersResponse:
        try:
            return self.service.holders(request)
        except FAILURES as exc:
            _abort(context, exc)


@dataclass
class SchedulerOptions:
    listen: str = "0.0.0.0:9090"
    redis_url: str = "redis://127.0.0.1:6379/0"
    prefix: str = DEFAULT_PREFIX
    config: SchedulerConfig = field(default_factory=SchedulerConfig)
    static_nodes: list[str] = field(default_factory=list)
    nodes_file: Path | None = None
    k8s_service: str | None = None


class SchedulerServer:
    """Service + gRPC server + discovery, started and stopped together (tests use it in-process)."""

    def __init__(self, options: SchedulerOptions) -> None:
        self.options = options
        self.service = SchedulerService(Store(options.redis_url, options.prefix), options.config)
        self.discovery = Discovery(
            self.service,
            static=options.static_nodes,
            nodes_file=options.nodes_file,
            k8s_service=options.k8s_service,
        )
        self.server: grpc.Server | None = None
        self.port = 0

    async def start(self) -> None:
        await asyncio.to_thread(self.service.start)
        await self.discovery.start()
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=WORKERS, thread_name_prefix="scheduler-rpc"),
            options=[("grpc.so_reuseport", 0)],
        )
        pb_grpc.add_SchedulerServicer_to_server(_Servicer(self.service), server)
        try:
            self.port = server.add_insecure_port(self.options.listen)
        except RuntimeError as exc:
            await self.stop()
            raise AgentEnvError(f"cannot listen on {self.options.listen}: {exc}") from exc
        if self.port == 0 and not self.options.listen.startswith("unix:"):
            await self.stop()
            raise AgentEnvError(f"cannot listen on {self.options.listen} (in use?)")
        self.server = server
        server.start()
        log.info("scheduler listening", extra={"listen": self.options.listen, "port": self.port})

    async def stop(self, grace: float = 1.0) -> None:
        if self.server is not None:
            stopped = self.server.stop(grace)
            await asyncio.to_thread(stopped.wait)
            self.server = None
        await self.discovery.stop()
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

    asyncio.run(main())
