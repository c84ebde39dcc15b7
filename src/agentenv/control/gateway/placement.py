"""The gateway's side of the scheduler (gRPC): where to create, which node holds a sandbox.

Lookups are cached for a moment (`LOOKUP_TTL`): a proxied request should not pay a gRPC round
trip each time. A cached entry is dropped when the node it names does not answer, and it is only
a cache: the binding table is the scheduler's (in Redis), so gateways stay stateless.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass

import grpc

from agentenv.control.proto import scheduler_pb2 as pb
from agentenv.control.proto import scheduler_pb2_grpc as pb_grpc

LOOKUP_TTL = 1.0
RPC_TIMEOUT = 5.0


class SchedulerUnavailable(Exception):
    """The scheduler did not answer (the gateway answers 503)."""


class NoPlacement(Exception):
    """The scheduler answered but found no node (every node full or down): 503 with its reason."""


@dataclass(frozen=True)
class Node:
    node_id: str
    address: str
    up: bool = True

    @property
    def url(self) -> str:
        return f"http://{self.address}"


@dataclass(frozen=True)
class Binding:
    sandbox_id: str
    node: Node
    team: str


class SchedulerLink:
    def __init__(self, address: str) -> None:
        self.address = address
        self.channel = grpc.aio.insecure_channel(
            address,
            options=[
                ("grpc.keepalive_time_ms", 10_000),
                ("grpc.enable_retries", 1),
                ("grpc.initial_reconnect_backoff_ms", 100),
                ("grpc.max_reconnect_backoff_ms", 1000),
            ],
        )
        self.stub = pb_grpc.SchedulerStub(self.channel)
        self._cache: dict[str, tuple[float, Binding | None]] = {}

    async def close(self) -> None:
        await self.channel.close()

    async def _rpc(self, method, request):  # type: ignore[no-untyped-def]
        try:
            return await method(request, timeout=RPC_TIMEOUT, wait_for_ready=False)
        except grpc.aio.AioRpcError as exc:
            if exc.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED,
                              grpc.StatusCode.FAILED_PRECONDITION):
                raise NoPlacement(exc.details() or "no node can take it") from exc
            if exc.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND):
                raise NoPlacement(exc.details() or "no node") from exc
            raise SchedulerUnavailable(
                f"scheduler at {self.address}: {exc.code().name} {exc.details()}"
            ) from exc

    async def schedule(self, *, template: str = "", snapshot: str = "", team: str = "",
                       source: str = "", vcpus: int = 0, memory_mib: int = 0) -> Node:
        answer = await self._rpc(
            self.stub.Schedule,
            pb.ScheduleRequest(template_id=template, snapshot_id=snapshot, team_id=team,
                               source_sandbox_id=source, vcpus=vcpus, memory_mib=memory_mib),
        )
        return Node(answer.node_id, answer.node_address)

    async def record(self, sandbox_id: str, node: Node, team: str) -> None:
        await self._rpc(
            self.stub.RecordAssignment,
            pb.Assignment(sandbox_id=sandbox_id, node_id=node.node_id, team_id=team),
        )
        self._cache[sandbox_id] = (time.monotonic() + LOOKUP_TTL, Binding(sandbox_id, node, team))

    async def release(self, sandbox_id: str) -> None:
        self._cache.pop(sandbox_id, None)
        await self._rpc(self.stub.Release, pb.ReleaseRequest(sandbox_id=sandbox_id))

    async def lookup(self, sandbox_id: str) -> Binding | None:
        now = time.monotonic()
        cached = self._cache.get(sandbox_id)
        if cached is not None and cached[0] > now:
            return cached[1]
        answer = await self._rpc(self.stub.Lookup, pb.LookupRequest(sandbox_id=sandbox_id))
        found = None
        if answer.found:
            found = Binding(sandbox_id, Node(answer.node_id, answer.node_address, answer.node_up),
                            answer.team_id)
        if len(self._cache) > 100_000:
            self._cache.clear()
        self._cache[sandbox_id] = (now + LOOKUP_TTL, found)
        return found

    def forget(self, sandbox_id: str) -> None:
        self._cache.pop(sandbox_id, None)

    async def nodes(self) -> list[Node]:
        answer = await self._rpc(self.stub.ListNodes, pb.Empty())
        return [Node(n.status.node_id, n.status.address, n.up) for n in answer.nodes]

    async def wait_ready(self, timeout: float) -> None:
        try:
            await asyncio.wait_for(self.channel.channel_ready(), timeout)
        except TimeoutError as exc:
            raise SchedulerUnavailable(f"no scheduler at {self.address}") from exc
