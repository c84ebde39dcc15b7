"""Routes of one sandbox or snapshot through the gateway: to the node holding it (the
scheduler's binding of a sandbox, the ownership record of a snapshot), for the team that owns
it (404 for another team's). A sandbox's answers name the gateway's domain; a kill releases the
binding; a snapshot made is recorded as the team's, on its node."""

from __future__ import annotations

from starlette.requests import Request

from agentenv.control.gateway.limits import GatewayQuotas
from agentenv.control.gateway.nodes import NodeLink, bare_name, send_answer
from agentenv.control.gateway.placement import SchedulerLink
from agentenv.control.gateway.store import GatewayStore
from agentenv.relay.answers import send_json
from agentenv.relay.stream import Send


class Sandboxes:
    def __init__(self, link: NodeLink, scheduler: SchedulerLink, store: GatewayStore,
                 quotas: GatewayQuotas) -> None:
        self.link = link
        self.scheduler = scheduler
        self.store = store
        self.quotas = quotas

    async def sandbox_forward(self, request: Request, send: Send, team: str,
                              sandbox_id: str) -> None:
        binding = await self.link.own_binding(sandbox_id, team)
        answer = await self.link.call(binding.node, request, team, await self.link.body(request))
        if answer.status_code in (200, 201) and request.method == "POST" and (
            request.url.path.endswith(("/connect", "/resume", "/rollback"))
        ):
            await send_json(send, answer.status_code, self.link.with_domain(answer.json()))
            return
        if answer.status_code == 200 and request.method == "GET" and request.url.path.count(
            "/"
        ) == 2:
            await send_json(send, 200, self.link.with_domain(answer.json()))
            return
        await send_answer(send, answer)

    async def kill(self, request: Request, send: Send, team: str, sandbox_id: str) -> None:
        binding = await self.link.own_binding(sandbox_id, team)
        answer = await self.link.call(binding.node, request, team)
        if answer.status_code in (204, 404):
            await self.scheduler.release(sandbox_id)
            await self.store.forget_sandbox(sandbox_id)
        await send_answer(send, answer)

    async def snapshot(self, request: Request, send: Send, team: str, sandbox_id: str) -> None:
        binding = await self.link.own_binding(sandbox_id, team)
        raw = await self.link.body(request)
        async with self.quotas.new_item(team, "snapshots") as made:
            answer = await self.link.call(binding.node, request, team, raw)
            if answer.status_code == 201:
                snap = answer.json()
                names = [bare_name(n) for n in snap.get("names", [])]
                await self.store.own("snapshot", snap["snapshotID"], team,
                                     binding.node.node_id, names)
                made.ids.append(snap["snapshotID"])
        await send_answer(send, answer)

    async def snapshot_forward(self, request: Request, send: Send, team: str, ref: str) -> None:
        """A snapshot, or the sandboxes made from it, as the node holding it knows them."""
        await self.link.forward(await self.link.snapshot_node(ref, team), request, send, team,
                                read_body=False)
