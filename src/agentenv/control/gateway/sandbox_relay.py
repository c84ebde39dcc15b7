"""Sandbox traffic through the gateway: a request or WebSocket naming a sandbox (E2b-Sandbox-Id
/ X-Agentenv-Sandbox-Id header, or a `{port}-{id}.{domain}` Host) is relayed to the node
holding the sandbox (agentenv.relay, the node proxy's relay), which relays it on to the
sandbox. Node down (missed heartbeats, or it does not answer): 503 "node unavailable".

An id the gateway has not cached costs a scheduler lookup, and the traffic needs no key: a
client's lookups that find nothing are limited (control/gateway/limits.py, UNKNOWN_SANDBOXES);
past its budget an uncached id is a 429 (a WebSocket 1013) without asking the scheduler."""

from __future__ import annotations

import logging
import re
from typing import Any

from agentenv.control.gateway.limits import (
    LookupLimiter,
    TeamBusy,
    TeamShares,
    client_address,
    traffic_holder,
)
from agentenv.control.gateway.nodes import ENVD_PORT, NodeLink, Scope
from agentenv.control.gateway.placement import Binding, SchedulerLink, SchedulerUnavailable
from agentenv.relay.answers import RETRY_SHORTLY, send_json
from agentenv.relay.stream import Exchange, Send, header_values

log = logging.getLogger("agentenv.control.gateway")

_HOST_ROUTE = re.compile(r"^(\d{1,5})-([a-z0-9]{1,63})\.[^:]+(:\d+)?$")
_PORT = re.compile(r"^\d{1,5}$")
SANDBOX_ID = re.compile(r"^[a-z0-9]{1,63}$")


def sandbox_route(scope: Scope) -> tuple[str, int] | str | None:
    """(sandbox id, port) named by headers or Host; a message when they are malformed; None
    when the request is for the control API."""
    ids = header_values(scope, b"e2b-sandbox-id") or header_values(scope, b"x-agentenv-sandbox-id")
    ports = header_values(scope, b"e2b-sandbox-port") or header_values(
        scope, b"x-agentenv-sandbox-port"
    )
    if ids:
        sandbox_id = ids[0].decode("latin-1").strip()
        if len(ids) > 1 or len(ports) > 1:
            return "the sandbox id and port headers may appear once"
        raw_port = ports[0].decode("latin-1").strip() if ports else str(ENVD_PORT)
        if not _PORT.match(raw_port) or not 0 < int(raw_port) < 65536:
            return f"invalid sandbox port {raw_port[:20]!r}"
        if not SANDBOX_ID.match(sandbox_id):
            return f"invalid sandbox id {sandbox_id[:70]!r}"
        return sandbox_id, int(raw_port)
    hosts = header_values(scope, b"host")
    if len(hosts) == 1:
        match = _HOST_ROUTE.match(hosts[0].decode("latin-1").strip().lower().rstrip("."))
        if match:
            port = int(match.group(1))
            if not 0 < port < 65536:
                return f"invalid port {port} in Host"
            return match.group(2), port
    return None


async def answer_gone(send: Send, exchange: Exchange) -> int:
    """What the client gets when the node holding its sandbox does not answer."""
    await send_json(send, 503, {"sandboxId": exchange.name, "message": "node unavailable",
                                "code": 503})
    return 503


def answer_unreachable(scheduler: SchedulerLink) -> Any:
    async def answer(send: Send, exchange: Exchange, exc: Exception) -> int:
        # the node holding the sandbox does not answer: it may be down before the scheduler
        # noticed; the next lookup asks the scheduler again
        scheduler.forget(exchange.name)
        log.info("node unreachable", extra={"sandbox_id": exchange.name, "error": str(exc)})
        return await answer_gone(send, exchange)

    return answer


class SandboxRelay:
    def __init__(self, link: NodeLink, team_shares: TeamShares,
                 misses: LookupLimiter | None = None) -> None:
        self.link = link
        self.team_shares = team_shares
        self.misses = misses or LookupLimiter(0.0, 0.0)  # 0: no limit

    async def _binding(self, scope: Scope, sandbox_id: str) -> tuple[Binding | None, int, str]:
        scheduler = self.link.scheduler
        address = client_address(scope)
        # An id neither cached nor seen bound lately costs a token before its lookup (so one
        # client's concurrent made-up ids stop at its burst), given back if it is a sandbox.
        # A sandbox seen lately is real: a stranger behind the same address (a NAT, a proxy)
        # spending the budget on made-up ids must not refuse its team's traffic.
        charged = not scheduler.cached(sandbox_id) and not scheduler.known(sandbox_id)
        if charged and not self.misses.allow(address):
            return None, 429, self.misses.refusal(address)
        try:
            binding = await self.link.traffic_lookup(sandbox_id)
        except SchedulerUnavailable as exc:
            if charged:
                self.misses.refund(address)
            return None, 503, str(exc)
        if binding is None:
            return None, 502, "The sandbox was not found"
        if charged:
            self.misses.refund(address)
        if not binding.node.up:
            return None, 503, "node unavailable"
        return binding, 0, ""

    async def http(self, scope: Scope, receive: Any, send: Send, sandbox_id: str,
                   port: int) -> None:
        binding, status, message = await self._binding(scope, sandbox_id)
        if binding is None:
            await send_json(send, status, {"sandboxId": sandbox_id, "message": message,
                                           "code": status},
                            RETRY_SHORTLY if status == 429 else ())
            return
        link = self.link
        try:
            with self.team_shares.hold(traffic_holder(binding.team, scope)):
                await link.relay.http(scope, receive, send, link.node_url(binding.node, scope),
                                      link.to_sandbox_headers(scope, binding.node, sandbox_id,
                                                              port, binding.team),
                                      Exchange(sandbox_id))
        except TeamBusy as exc:
            await send_json(send, 429, {"sandboxId": sandbox_id, "message": str(exc),
                                        "code": 429})

    async def websocket(self, scope: Scope, receive: Any, send: Send, sandbox_id: str,
                        port: int) -> None:
        if (await receive())["type"] != "websocket.connect":
            return
        binding, status, _ = await self._binding(scope, sandbox_id)
        if binding is None:
            # 1013: try again later
            code = 1013 if status == 429 else 1011 if status >= 503 else 1008
            await send({"type": "websocket.close", "code": code})
            return
        link = self.link
        try:
            with self.team_shares.hold(traffic_holder(binding.team, scope)):
                await link.relay.websocket(
                    scope, receive, send, link.node_url(binding.node, scope),
                    link.to_sandbox_headers(scope, binding.node, sandbox_id, port, binding.team),
                    Exchange(sandbox_id))
        except TeamBusy:
            await send({"type": "websocket.close", "code": 1013})  # try again later
