"""Volumes through the gateway (E2B's Volume API and its content API; docs/volumes.md).

Placement: all of a team's volumes live on one node, its volume home (`volumehome:{team}` in
Redis, control/gateway/store.py): the node the scheduler chose for the team's first volume. A
sandbox mounts only volumes of its own node, so a create that mounts volumes goes to the home
(create.py), and a team's volume names stay unique, as one node keeps them. While the home is
down, the team's volume routes answer 503 (its volumes are there).

The volume routes (API key) go to the home, for the team; each volume made is recorded as the
team's (`own:volume:{id}`), so another team's is not found. The content API (the volume's
bearer token, no API key) is relayed, streamed, to the node of the volume named by its path,
which checks the token; a volume no team owns answers as a wrong token does (401: ids are not
probed).
"""

from __future__ import annotations

from starlette.requests import Request

from agentenv.api.volume_models import TOKEN_NEEDED
from agentenv.control.gateway.limits import TeamShares
from agentenv.control.gateway.nodes import (
    GatewayError,
    NodeLink,
    send_answer,
)
from agentenv.control.gateway.placement import Node, SchedulerLink
from agentenv.control.gateway.store import GatewayStore
from agentenv.relay.answers import send_json
from agentenv.relay.stream import Send

#: what the scheduler is asked to place a team's first volume as (every node has it)
BUILTIN_TEMPLATE = "base"


class Volumes:
    def __init__(self, link: NodeLink, scheduler: SchedulerLink, store: GatewayStore,
                 team_shares: TeamShares) -> None:
        self.link = link
        self.scheduler = scheduler
        self.store = store
        self.team_shares = team_shares

    async def _new_home(self, team: str) -> Node:
        """The team's volume home, chosen now by the scheduler if it has none."""
        home = await self.link.volume_home(team)
        if home is not None:
            return home
        # placed as a sandbox of the built-in template would be: where there is room
        placed = await self.scheduler.schedule(template=BUILTIN_TEMPLATE, team=team)
        # a volume is no sandbox: the placement's room is given back at once
        await self.scheduler.cancel(placed.reservation)
        chosen = await self.store.volume_home(team, placed.node.node_id)
        return placed.node if chosen == placed.node.node_id else await self.link.node_by_id(
            str(chosen))

    async def list_volumes(self, request: Request, send: Send, team: str) -> None:
        home = await self.link.volume_home(team)
        if home is None:  # the team made none
            await send_json(send, 200, [])
            return
        await self.link.forward(home, request, send, team, read_body=False)

    async def create_volume(self, request: Request, send: Send, team: str) -> None:
        raw = await self.link.body(request)
        node = await self._new_home(team)
        answer = await self.link.call(node, request, team, raw)
        if answer.status_code == 201:
            made = answer.json()
            await self.store.own("volume", made["volumeID"], team, node.node_id,
                                 [made["name"]])
        await send_answer(send, answer)

    async def _volume_node(self, volume_id: str, team: str) -> Node:
        owned = await self.store.owned("volume", volume_id, team)
        if owned is None or owned.team != team:
            raise GatewayError(404, f"volume {volume_id!r} not found")
        return await self.link.node_by_id(owned.node)

    async def volume_forward(self, request: Request, send: Send, team: str,
                             volume_id: str) -> None:
        """One volume (get, commit) on its node."""
        await self.link.forward(await self._volume_node(volume_id, team), request, send, team)

    async def delete_volume(self, request: Request, send: Send, team: str,
                            volume_id: str) -> None:
        answer = await self.link.call(await self._volume_node(volume_id, team), request, team)
        if answer.status_code in (204, 404):  # gone: on the node, so here too
            owned = await self.store.owned("volume", volume_id, team)
            if owned is not None:
                await self.store.disown("volume", owned.id, team, [])
        await send_answer(send, answer)

    async def content(self, request: Request, send: Send, team: str, volume_id: str) -> None:
        """The content API (no API key, `team` is empty): relayed to the volume's node for
        the volume's team, streamed both ways (files may be large)."""
        owned = await self.store.owned("volume", volume_id)
        if owned is None:
            raise GatewayError(401, TOKEN_NEEDED)
        node = await self.link.node_by_id(owned.node)
        with self.team_shares.hold(owned.team):
            await self.link.relay_to(node, request, send, owned.team, volume_id)
