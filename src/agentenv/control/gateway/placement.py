"""The gateway's side of the scheduler (agentenv.scheduling.client over gRPC): where to
create, which node holds a sandbox.

Lookups are cached for a moment (`LOOKUP_TTL`): a proxied request should not pay a gRPC round
trip each time. A cached entry is dropped when the node it names does not answer, and it is only
a cache: the binding table is the scheduler's (in Redis), so gateways stay stateless. While the
scheduler cannot be reached (restarting after kill -9), bindings seen in the last `STALE_TTL`
seconds keep routing. The node list is cached the same way (`NODES_TTL`).

A miss is cached too, for `MISS_TTL`, apart from the bindings and bounded (`MAX_MISSES`, the
oldest go first): a stranger sending traffic for made-up ids must not cost the scheduler a call
each (the red team's finding 5; how many uncached misses a client may cause: limits.py). A
sandbox this gateway creates replaces its miss at once (`record`); one created through another
gateway is routable here within `MISS_TTL` at worst, and only if its id was asked for before it
existed.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass

import grpc

from agentenv.scheduling.client import (
    ClientTls,
    Credentials,
    SchedulerClient,
    SchedulerError,
    pb,
)

log = logging.getLogger("agentenv.control.gateway.placement")

LOOKUP_TTL = 1.0
#: while the scheduler is unreachable, a binding seen this recently still routes (a sandbox
#: does not move without the gateway: create, fork and kill all go through it)
STALE_TTL = 600.0
NODES_TTL = 0.5
MISS_TTL = 1.0
#: misses cached at most (made-up ids never push out the bindings of real sandboxes)
MAX_MISSES = 10_000
RECONNECT_S = 0.5


class PlacementFailure(Exception):
    """A scheduler call failed. str() is what the team is told; `detail` (the scheduler's own
    words: every node's free vCPUs and memory, down reasons, Redis errors) is for the gateway's
    log only, since it describes other teams' load and the cluster's insides."""

    def __init__(self, public: str, detail: str = "") -> None:
        super().__init__(public)
        self.detail = detail or public


class SchedulerUnavailable(PlacementFailure):
    """The scheduler did not answer (the gateway answers 503)."""


class NoPlacement(PlacementFailure):
    """The scheduler answered but found no node up (or none holding what was asked): 503."""


class NoRoom(NoPlacement):
    """Every node up refused for room (cpu, memory, disk, sandboxes): 429 naming the
    resources. `refused`: resource -> how many nodes refused for it (no node named)."""

    def __init__(self, public: str, detail: str, refused: dict[str, int]) -> None:
        super().__init__(public, detail)
        self.refused = refused

    @property
    def resource(self) -> str:
        """The resource most nodes refused for (the X-Agentenv-Refused header)."""
        room = {r: n for r, n in self.refused.items() if r not in ("down", "tried")}
        return max(sorted(room), key=lambda r: room[r]) if room else "capacity"


class BadPlacementRequest(PlacementFailure):
    """The scheduler refused the request as invalid (400 with its reason)."""


@dataclass(frozen=True)
class Node:
    node_id: str
    address: str
    up: bool = True
    scheme: str = "http"  # https where nodes serve TLS (relay/tls.py)

    @property
    def url(self) -> str:
        return f"{self.scheme}://{self.address}"


@dataclass(frozen=True)
class Placed:
    """Where the scheduler placed a sandbox, and the room it holds there until the sandbox is
    recorded (SchedulerLink.record) or the placement given up (SchedulerLink.cancel)."""

    node: Node
    reservation: str = ""


@dataclass(frozen=True)
class Binding:
    sandbox_id: str
    node: Node
    team: str


def _translated(exc: SchedulerError) -> PlacementFailure:
    """The scheduler's refusal in words a team may read. INVALID_ARGUMENT and NOT_FOUND name
    only what the caller sent (an id, a size); "no room" and "no node up" name every node's
    free capacity or state, so the team gets a summary and the gateway's log the rest."""
    detail = str(exc)
    if exc.code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND):
        cls = BadPlacementRequest if exc.code == grpc.StatusCode.INVALID_ARGUMENT else NoPlacement
        return cls(exc.details or detail, detail)
    fork = exc.details.startswith("fork source")
    if exc.code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        # the resources and how many nodes refused for each, the size asked: never which
        # node or how full it is
        summary = ", ".join(f"{r}: {n} node{'s' if n > 1 else ''}"
                            for r, n in sorted(exc.refused.items()))
        summary = f" ({summary})" if summary else ""
        size = f" for {exc.request}" if exc.request else ""
        return NoRoom(f"the fork source's node has no room{size} now{summary}" if fork
                      else f"no node has room{size} now{summary}; try again later", detail,
                      exc.refused)
    if exc.code == grpc.StatusCode.UNAVAILABLE and (fork or exc.details.startswith("no node")):
        return NoPlacement("the fork source's node is down" if fork else "no node is up", detail)
    return SchedulerUnavailable("the scheduler is unavailable", detail)


class SchedulerLink:
    def __init__(self, address: str, credentials: Credentials,
                 tls: ClientTls | None = None, node_scheme: str = "http") -> None:
        """`tls`: to the scheduler; `node_scheme`: how the nodes it names are reached."""
        self.address = address
        self.node_scheme = node_scheme
        self.credentials = credentials  # the gateway's (scheduler auth, control/scheduler/auth.py)
        self.tls = tls
        self._client: SchedulerClient | None = None
        self._cache: dict[str, tuple[float, Binding]] = {}
        self._misses: OrderedDict[str, float] = OrderedDict()  # sandbox id -> until
        self._nodes: tuple[float, list[Node]] = (0.0, [])
        self._status: dict[str, pb.NodeStatus] = {}
        self._reconnected = 0.0
        self._closing: set[asyncio.Task[None]] = set()

    @property
    def client(self) -> SchedulerClient:
        # made on first use: a grpc.aio channel belongs to the event loop it was made in
        if self._client is None:
            self._client = SchedulerClient(self.address, self.credentials, tls=self.tls)
        return self._client

    def _reconnect_later(self, exc: SchedulerError) -> None:
        """After a failed connection, gRPC waits longer and longer (up to minutes) before it
        tries again: a scheduler back from a restart would stay unreachable. A new channel
        connects at once; at most one new channel every RECONNECT_S."""
        now = time.monotonic()
        if not exc.unavailable or self._client is None or now - self._reconnected < RECONNECT_S:
            return
        self._reconnected = now
        old, self._client = self._client, None
        task = asyncio.get_running_loop().create_task(old.close())
        self._closing.add(task)
        task.add_done_callback(self._closing.discard)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()

    async def schedule(self, *, template: str = "", snapshot: str = "", team: str = "",
                       source: str = "", exclude: tuple[str, ...] = ()) -> Placed:
        """A node for a new sandbox, none of `exclude` (nodes that refused it already)."""
        try:
            placed = await self.client.schedule(template_id=template, snapshot_id=snapshot,
                                                team_id=team, source_sandbox_id=source,
                                                exclude_nodes=exclude)
        except SchedulerError as exc:
            self._reconnect_later(exc)
            raise _translated(exc) from exc
        return Placed(Node(placed.node_id, placed.node_address, scheme=self.node_scheme),
                      placed.reservation)

    async def record(self, sandbox_id: str, node: Node, team: str,
                     reservation: str = "") -> None:
        try:
            await self.client.record_assignment(sandbox_id, node.node_id, team_id=team,
                                                reservation=reservation)
        except SchedulerError as exc:
            self._reconnect_later(exc)
            raise _translated(exc) from exc
        self._misses.pop(sandbox_id, None)
        self._cache[sandbox_id] = (time.monotonic() + LOOKUP_TTL, Binding(sandbox_id, node, team))

    async def cancel(self, reservation: str) -> None:
        """Give a placement's room back: no sandbox will use it (the create failed or the node
        refused it). Best effort: an unused reservation lapses after 60 s anyway."""
        if not reservation:
            return
        try:
            await self.client.release(reservation=reservation)
        except SchedulerError as exc:
            self._reconnect_later(exc)
            log.info("reservation not cancelled: %s", exc)

    async def release(self, sandbox_id: str) -> None:
        self._cache.pop(sandbox_id, None)
        try:
            await self.client.release(sandbox_id)
        except SchedulerError as exc:
            self._reconnect_later(exc)
            raise _translated(exc) from exc

    def cached(self, sandbox_id: str) -> bool:
        """Whether `lookup(sandbox_id)` answers without asking the scheduler (a binding or a
        miss seen within its TTL)."""
        now = time.monotonic()
        cached = self._cache.get(sandbox_id)
        if cached is not None and cached[0] > now:
            return True
        return self._misses.get(sandbox_id, 0.0) > now

    def known(self, sandbox_id: str) -> bool:
        """Whether a binding of `sandbox_id` was seen within STALE_TTL: a real sandbox, whose
        lookups no client's budget for unknown ids may refuse."""
        cached = self._cache.get(sandbox_id)
        return cached is not None and cached[0] + STALE_TTL > time.monotonic()

    async def lookup(self, sandbox_id: str) -> Binding | None:
        now = time.monotonic()
        cached = self._cache.get(sandbox_id)
        if cached is not None and cached[0] > now:
            return cached[1]
        if self._misses.get(sandbox_id, 0.0) > now:
            return None
        try:
            where = await self.client.lookup(sandbox_id)
        except SchedulerError as exc:
            self._reconnect_later(exc)
            if exc.unavailable and cached is not None and cached[0] + STALE_TTL > now:
                return cached[1]
            raise _translated(exc) from exc
        if where is None:
            self._cache.pop(sandbox_id, None)
            self._misses.pop(sandbox_id, None)
            self._misses[sandbox_id] = now + MISS_TTL
            while len(self._misses) > MAX_MISSES:
                self._misses.popitem(last=False)
            return None
        found = Binding(sandbox_id, Node(where.node_id, where.node_address, where.node_up,
                                         self.node_scheme),
                        where.team_id)
        if len(self._cache) > 100_000:
            self._cache.clear()
        self._cache[sandbox_id] = (now + LOOKUP_TTL, found)
        self._misses.pop(sandbox_id, None)
        return found

    def forget(self, sandbox_id: str) -> None:
        self._cache.pop(sandbox_id, None)
        self._misses.pop(sandbox_id, None)

    async def nodes(self) -> list[Node]:
        now = time.monotonic()
        if self._nodes[0] > now:
            return self._nodes[1]
        try:
            listed = await self.client.list_nodes()
        except SchedulerError as exc:
            self._reconnect_later(exc)
            raise _translated(exc) from exc
        nodes = [Node(n.node_id, n.address, n.up, self.node_scheme) for n in listed]
        self._nodes = (now + NODES_TTL, nodes)
        self._status = {n.node_id: n.status for n in listed}
        return nodes

    def misfit(self, node_id: str, vcpus: int, memory_mib: int) -> str:
        """Why `vcpus` and `memory_mib` more do not fit on a node by its last heartbeat as of the
        last `nodes()` ('' when they do). Only the node's own numbers: the scheduler's
        placements of the last moments are not in them (Schedule decides exactly)."""
        st = self._status.get(node_id)
        if st is None:
            return "not registered"
        if st.max_sandboxes and st.running >= st.max_sandboxes:
            return f"sandboxes: full ({st.max_sandboxes} sandboxes)"
        if st.cpu_total and st.cpu_free < vcpus:
            return f"cpu: {st.cpu_free} free vCPUs < {vcpus}"
        need = memory_mib + st.sandbox_overhead_mib + st.sandbox_overhead_per_vcpu_mib * vcpus
        if st.memory_total_mib and st.memory_free_mib < need:
            return f"memory: {st.memory_free_mib} MiB free < {need} MiB"
        return ""
