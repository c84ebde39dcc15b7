"""`aenv scheduler`: the gRPC server (grpc.aio) around SchedulerService, plus node discovery."""

from __future__ import annotations

import asyncio
import logging
import signal
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

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
T = TypeVar("T")


class _Servicer(pb_grpc.SchedulerServicer):
    def __init__(self, service: SchedulerService) -> None:
        self.service = service

    async def _call(self, context: grpc.aio.ServicerContext, work: Awaitable[T]) -> T:
        try:
            return await work
        except PlacementError as exc:
            await context.abort(exc.code, exc.message)
        except (RedisError, StoreError, OSError) as exc:
            log.warning("binding store unavailable: %s", exc)
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, f"the scheduler's Redis is unavailable: {exc}"
            )
        raise AssertionError("unreachable")  # context.abort raises

    async def Schedule(self, request: pb.ScheduleRequest, context: Any) -> pb.ScheduleResponse:
        return await self._call(context, self.service.schedule(request))

    async def RecordAssignment(self, request: pb.Assignment, context: Any) -> pb.Empty:
        await self._call(context, self.service.record(request))
        return pb.Empty()

    async def Release(self, request: pb.ReleaseRequest, context: Any) -> pb.Empty:
        await self._call(context, self.service.release(request))
        return pb.Empty()

    async def Lookup(self, request: pb.LookupRequest, context: Any) -> pb.LookupResponse:
        return await self._call(context, self.service.lookup(request))

    async def Heartbeat(self, request: pb.NodeStatus, context: Any) -> pb.HeartbeatResponse:
        return await self._call(context, self.service.heartbeat(request))

    async def ListNodes(self, request: pb.Empty, context: Any) -> pb.NodeList:
        return self.service.list_nodes()

    async def Holders(self, request: pb.HoldersRequest, context: Any) -> pb.HoldersResponse:
        try:
            return self.service.holders(request)
        except PlacementError as exc:
            await context.abort(exc.code, exc.message)
        raise AssertionError("unreachable")  # context.abort raises


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
        self.server: grpc.aio.Server | None = None
        self.port = 0

    async def start(self) -> None:
        await self.service.start()
        await self.discovery.start()
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
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
        await server.start()
        log.info("scheduler listening", extra={"listen": self.options.listen, "port": self.port})

    async def stop(self, grace: float = 1.0) -> None:
        if self.server is not None:
            await self.server.stop(grace)
        await self.discovery.stop()
        await self.service.close()


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
