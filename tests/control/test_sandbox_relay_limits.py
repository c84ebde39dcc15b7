"""The gateway's sandbox traffic against a stranger who knows sandbox ids (found by the red
team on the first version of these bounds): made-up ids from an address a team shares (a NAT,
a proxy) must not refuse the team's real sandboxes; one client's concurrent made-up ids stop at
its burst; and a stranger holding requests to one public sandbox fills only its own traffic
share, not the team's. In process: the relay's bookkeeping, a fake scheduler and node."""

from __future__ import annotations

import asyncio
from typing import Any

from agentenv.control.gateway.limits import UNKNOWN_SANDBOXES, LookupLimiter, TeamShares
from agentenv.control.gateway.placement import Binding, Node
from agentenv.control.gateway.sandbox_relay import SandboxRelay

NODE = Node("n1", "10.0.0.1:1")
NAT = "198.51.100.7"
TEAM_CLIENT = "192.0.2.50"


class FakeScheduler:
    """Nothing cached (a binding lives LOOKUP_TTL, 1 s); what was found bound is known."""

    def __init__(self) -> None:
        self.lookups = 0
        self.seen: set[str] = set()

    def cached(self, sandbox_id: str) -> bool:
        return False

    def known(self, sandbox_id: str) -> bool:
        return sandbox_id in self.seen


class FakeLink:
    def __init__(self, delay: float = 0.0, real: frozenset[str] = frozenset({"real"})) -> None:
        self.scheduler = FakeScheduler()
        self.delay = delay
        self.real = real
        self.relay = HeldRelay()

    async def traffic_lookup(self, sandbox_id: str) -> Binding | None:
        self.scheduler.lookups += 1
        await asyncio.sleep(self.delay)
        if sandbox_id in self.real:
            self.scheduler.seen.add(sandbox_id)
            return Binding(sandbox_id, NODE, "victim")
        return None

    def node_url(self, node: Node, scope: Any) -> str:
        return "http://node/"

    def to_sandbox_headers(self, *args: Any) -> list[tuple[bytes, bytes]]:
        return []


class HeldRelay:
    """The relay to the node: a stranger's requests are held open (a body that never ends)."""

    def __init__(self) -> None:
        self.release = asyncio.Event()

    async def http(self, scope: Any, receive: Any, send: Any, url: Any, headers: Any,
                   exchange: Any) -> int:
        if scope["client"][0] != TEAM_CLIENT:
            await self.release.wait()
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b""})
        return 200


def scope(address: str) -> dict[str, Any]:
    return {"type": "http", "client": (address, 40000), "headers": []}


def test_a_strangers_made_up_ids_do_not_refuse_a_teams_real_sandbox() -> None:
    link = FakeLink()
    relay = SandboxRelay(link, TeamShares(8),  # type: ignore[arg-type]
                         LookupLimiter(0.001, 40.0, kind=UNKNOWN_SANDBOXES))

    async def body() -> tuple[int, int, int]:
        _, first, _ = await relay._binding(scope(NAT), "real")  # the team, before the flood
        for i in range(200):  # the stranger, from the same address
            await relay._binding(scope(NAT), f"madeup{i}")
        _, refused, _ = await relay._binding(scope(NAT), "madeup-more")
        _, again, _ = await relay._binding(scope(NAT), "real")
        return first, refused, again

    first, refused, again = asyncio.run(body())
    assert (first, refused, again) == (0, 429, 0)
    assert link.scheduler.lookups == 1 + 40 + 1  # the burst of misses, then none


def test_concurrent_misses_of_one_client_stop_at_its_burst() -> None:
    link = FakeLink(delay=0.05)
    relay = SandboxRelay(link, TeamShares(8),  # type: ignore[arg-type]
                         LookupLimiter(0.001, 40.0, kind=UNKNOWN_SANDBOXES))

    async def body() -> list[int]:
        answers = await asyncio.gather(*(relay._binding(scope("203.0.113.9"), f"x{i}")
                                         for i in range(1000)))
        return [status for _, status, _ in answers]

    statuses = asyncio.run(body())
    assert link.scheduler.lookups == 40
    assert statuses.count(502) == 40 and statuses.count(429) == 960


def test_a_stranger_holding_a_sandboxs_traffic_leaves_the_team_its_own() -> None:
    link = FakeLink(real=frozenset({"ipublicapp", "iprivateworker"}))
    relay = SandboxRelay(link, TeamShares(4), LookupLimiter(0.0, 0.0))  # type: ignore[arg-type]
    statuses: dict[str, list[int]] = {}

    async def request(address: str, sandbox_id: str) -> None:
        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                statuses.setdefault(address, []).append(message["status"])

        await relay.http(scope(address), receive, send, sandbox_id, 8080)

    async def body() -> None:
        held = [asyncio.create_task(request("203.0.113.1", "ipublicapp")) for _ in range(5)]
        while statuses.get("203.0.113.1") != [429]:  # the fifth: past the stranger's share
            await asyncio.sleep(0.01)
        await request(TEAM_CLIENT, "iprivateworker")  # the team's SDK, its other sandbox
        link.relay.release.set()
        await asyncio.gather(*held)

    asyncio.run(body())
    assert statuses[TEAM_CLIENT] == [200]
    assert sorted(statuses["203.0.113.1"]) == [200, 200, 200, 200, 429]
