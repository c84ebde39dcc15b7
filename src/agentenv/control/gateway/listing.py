"""Listings through the gateway: every node that is up is asked (all pages), the answers merged
and filtered to the team's own (the ownership records in Redis), and paged across the nodes
with the cursors a node's paging uses (agentenv.api.paging). A node that does not answer is
left out of the listing; the rest is served."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from starlette.requests import Request

from agentenv.api.errors import ApiError
from agentenv.api.event_models import MAX_METRICS_BATCH
from agentenv.api.paging import MAX_PAGE, decode_cursor, iso_ts, merged_page, page_limit
from agentenv.control.gateway.nodes import GatewayError, NodeLink, node_unavailable
from agentenv.control.gateway.placement import Node, SchedulerLink
from agentenv.control.gateway.store import GatewayStore
from agentenv.relay.answers import send_json
from agentenv.relay.stream import Send

log = logging.getLogger("agentenv.control.gateway")


class Listings:
    def __init__(self, link: NodeLink, scheduler: SchedulerLink, store: GatewayStore) -> None:
        self.link = link
        self.scheduler = scheduler
        self.store = store

    async def _all_pages(self, node: Node, path: str, team: str, params: list[tuple[str, str]]
                         ) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        token = None
        while True:
            query = [*params, ("limit", str(MAX_PAGE))]
            if token:
                query.append(("nextToken", token))
            answer = await self.link.get(node, path, team, query)
            if answer.status_code != 200:
                raise GatewayError(answer.status_code if answer.status_code < 500 else 502,
                               answer.json().get("message", answer.text)
                               if answer.headers.get("content-type", "").startswith(
                                   "application/json") else answer.text)
            items += answer.json()
            token = answer.headers.get("x-next-token")
            if not token:
                return items

    async def _gather(self, nodes: list[Node], fetch: Callable[[Node], Awaitable[list[Any]]]
                      ) -> list[Any]:
        results = await asyncio.gather(*(fetch(n) for n in nodes), return_exceptions=True)
        merged: list[Any] = []
        for node, result in zip(nodes, results, strict=True):
            if isinstance(result, ApiError) and result.status == 400:
                raise result
            if isinstance(result, BaseException):
                # a node that dropped out since ListNodes: its items are missing from this
                # listing (as they are unreachable), the rest is served
                log.info("listing skipped a node", extra={"node": node.node_id,
                                                          "error": str(result)})
                continue
            merged += result
        return merged

    async def _team_sandboxes(self, request: Request, path: str, team: str,
                              paged: bool) -> list[dict[str, Any]]:
        params = [(k, v) for k, v in request.query_params.multi_items()
                  if k not in ("limit", "nextToken", "order")]
        nodes = await self.link.up_nodes()

        async def fetch(node: Node) -> list[Any]:
            if paged:
                return await self._all_pages(node, path, team, params)
            answer = await self.link.get(node, path, team, params)
            if answer.status_code != 200:
                raise GatewayError(answer.status_code, answer.text)
            return list(answer.json())

        items = await self._gather(nodes, fetch)
        teams = await self.store.sandbox_teams([i["sandboxID"] for i in items])
        return [i for i, t in zip(items, teams, strict=True) if t == team]

    async def list_v1(self, request: Request, send: Send, team: str) -> None:
        await send_json(send, 200,
                              await self._team_sandboxes(request, "/sandboxes", team, False))

    async def list_v2(self, request: Request, send: Send, team: str) -> None:
        order = request.query_params.get("order", "desc")
        if order not in ("asc", "desc"):
            raise GatewayError(400, f"order must be asc or desc, got {order!r}")
        limit = page_limit(request.query_params)
        token = request.query_params.get("nextToken")
        if token:
            decode_cursor(token)
        found = await self._team_sandboxes(request, "/v2/sandboxes", team, True)
        items, next_token = merged_page(found, "startedAt", "sandboxID", token, limit,
                                        order == "desc")
        headers = {"X-Total-Running": str(sum(i.get("state") == "running" for i in found))}
        if next_token:
            headers["X-Next-Token"] = next_token
        await send_json(send, 200, items, headers)

    async def list_snapshots(self, request: Request, send: Send, team: str) -> None:
        limit = page_limit(request.query_params)
        token = request.query_params.get("nextToken")
        if token:
            decode_cursor(token)
        params = [(k, v) for k, v in request.query_params.multi_items()
                  if k not in ("limit", "nextToken")]
        items = await self._gather(await self.link.up_nodes(),
                                   lambda n: self._all_pages(n, "/snapshots", team, params))
        owners = await self.store.owned_ids("snapshot", [i["snapshotID"] for i in items])
        mine = [i for i in items if owners.get(i["snapshotID"]) == team]
        page_items, next_token = merged_page(mine, "createdAt", "snapshotID", token, limit, True)
        headers = {"X-Next-Token": next_token} if next_token else None
        await send_json(send, 200, page_items, headers)

    async def list_templates(self, request: Request, send: Send, team: str) -> None:
        v2 = request.url.path.startswith("/v2/")
        nodes = await self.link.up_nodes()

        async def fetch(node: Node) -> list[Any]:
            answer = await self.link.get(node, "/templates", team)
            if answer.status_code != 200:
                raise GatewayError(answer.status_code, answer.text)
            return list(answer.json())

        items = await self._gather(nodes, fetch)
        owners = await self.store.owned_ids("template", [i["templateID"] for i in items])
        seen: set[str] = set()
        visible = []
        for item in items:
            tid = item["templateID"]
            if tid in seen or owners.get(tid, team) != team:
                continue
            seen.add(tid)
            visible.append(item)
        if not v2:
            visible.sort(key=lambda i: (iso_ts(i.get("createdAt")), i["templateID"]))
            await send_json(send, 200, visible)
            return
        limit = page_limit(request.query_params)
        token = request.query_params.get("nextToken")
        page_items, next_token = merged_page(visible, "createdAt", "templateID", token, limit,
                                             True)
        await send_json(send, 200, page_items,
                              {"X-Next-Token": next_token} if next_token else None)

    async def list_nodes(self, request: Request, send: Send, team: str) -> None:
        """Every node of the cluster, with the figures of `team`'s own sandboxes on it (the
        node answers for the team the gateway names: no other team's load)."""
        nodes = await self.scheduler.nodes()

        async def fetch(node: Node) -> list[Any]:
            answer = await self.link.get(node, "/nodes", team)
            found = list(answer.json()) if answer.status_code == 200 else []
            for item in found:  # the scheduler's name of the node, not its host name
                item.update({"id": node.node_id, "nodeID": node.node_id})
            return found

        up = [n for n in nodes if n.up]
        found = await self._gather(up, fetch)
        found += [{"id": n.node_id, "nodeID": n.node_id, "status": "unhealthy"}
                  for n in nodes if not n.up]
        await send_json(send, 200, found)

    async def node_detail(self, request: Request, send: Send, team: str, node_id: str) -> None:
        for node in await self.scheduler.nodes():
            if node.node_id == node_id:
                if not node.up:
                    raise node_unavailable(f"{node_id} missed its heartbeats")
                answer = await self.link.get(node, "/nodes", team)
                if answer.status_code == 200 and answer.json():
                    body = answer.json()[0]
                    body.update({"id": node_id, "nodeID": node_id, "cachedBuilds": []})
                    await send_json(send, 200, body)
                    return
        raise GatewayError(404, f"node {node_id!r} not found")

    async def batch_metrics(self, request: Request, send: Send, team: str) -> None:
        """The latest sample of each named sandbox of the team, asked of the nodes holding
        them; ids without one (unknown, another team's, on a node that is down or does not
        answer) are left out, as a node leaves them out."""
        raw = request.query_params.get("sandbox_ids") or ""
        ids = list(dict.fromkeys(i.strip() for i in raw.split(",") if i.strip()))
        if not ids or len(ids) > MAX_METRICS_BATCH:  # the node names what is wrong
            await self.link.forward(await self.link.any_node(), request, send, team,
                                    read_body=False)
            return
        held: dict[str, tuple[Node, list[str]]] = {}
        for sandbox_id, owner in zip(ids, await self.store.sandbox_teams(ids), strict=True):
            binding = await self.scheduler.lookup(sandbox_id) if owner == team else None
            if binding is not None and binding.node.up:
                held.setdefault(binding.node.node_id, (binding.node, []))[1].append(sandbox_id)

        async def fetch(node: Node) -> list[Any]:
            wanted = ",".join(held[node.node_id][1])
            answer = await self.link.get(node, "/sandboxes/metrics", team,
                                         {"sandbox_ids": wanted})
            if answer.status_code != 200:
                raise GatewayError(answer.status_code, answer.text)
            return list(answer.json()["sandboxes"].items())

        found = await self._gather([node for node, _ in held.values()], fetch)
        await send_json(send, 200, {"sandboxes": dict(found)})
