"""Signed file URLs through the gateway: which node and sandbox made one, remembered for a
while by each gateway, and the relay of the request there.

A signed URL on the gateway's E2B_SANDBOX_URL names no sandbox, so the gateway asks every node
whose envd token made it (POST /cluster/file-signature-owner). The answer holds as long as the
signature does (its `signature_expiration`), or OWNER_TTL for a signature without one; a relay
that the node answers as a stale owner would (SANDBOX_GONE) drops it. The cache only picks
where to send a request: the node checks the signature of every request again.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs

from agentenv.api.auth import SIGNATURE_OWNER_PATH
from agentenv.control.gateway.limits import LookupLimiter, TeamBusy, TeamShares, traffic_holder
from agentenv.control.gateway.metrics import GatewayMetrics
from agentenv.control.gateway.nodes import ENVD_PORT, NodeLink, Scope
from agentenv.control.gateway.placement import Node, NoPlacement, SchedulerUnavailable
from agentenv.control.gateway.sandbox_relay import SANDBOX_ID
from agentenv.relay.answers import send_json
from agentenv.relay.stream import Exchange, Send, header_values

log = logging.getLogger("agentenv.control.gateway")
FILES_PATH = "/files"

#: how long the owner of a signature without expiration is remembered
OWNER_TTL = 60.0
#: entries kept per gateway (the oldest go first)
MAX_OWNERS = 10_000
#: a relay's answers that say the remembered owner may be wrong: the signature does not match
#: (401: the sandbox's token changed), the sandbox is not on that node (502, the node's
#: "sandbox was not found"), the node is gone (503), nothing there (404)
SANDBOX_GONE = frozenset({401, 404, 502, 503})

SignatureKey = tuple[str, str, str, str, str]


def signature_key(scope: dict[str, Any]) -> tuple[SignatureKey, float | None]:
    """What a file signature covers (method, signature, path, user, expiration): equal keys
    are the same signed request wherever the query's parameters sit; and the expiration as a
    time, if the URL has a valid one."""
    query = parse_qs(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)

    def first(name: str) -> str:
        return (query.get(name) or [""])[0]

    expiration = first("signature_expiration")
    key = (scope["method"], first("signature"), first("path"), first("username"), expiration)
    try:
        return key, float(int(expiration)) if expiration else None
    except ValueError:
        return key, None


@dataclass(frozen=True)
class Owner:
    node_id: str
    sandbox_id: str
    until: float  # wall clock


class SignatureOwners:
    """A bounded LRU map of signed requests to their owner."""

    def __init__(self, max_entries: int = MAX_OWNERS, ttl: float = OWNER_TTL) -> None:
        self.max_entries = max_entries
        self.ttl = ttl
        self._owners: OrderedDict[SignatureKey, Owner] = OrderedDict()

    def __len__(self) -> int:
        return len(self._owners)

    def get(self, key: SignatureKey) -> Owner | None:
        owner = self._owners.get(key)
        if owner is None:
            return None
        if owner.until <= time.time():
            del self._owners[key]
            return None
        self._owners.move_to_end(key)
        return owner

    def put(self, key: SignatureKey, node_id: str, sandbox_id: str,
            expiration: float | None) -> None:
        until = expiration if expiration is not None else time.time() + self.ttl
        if until <= time.time():
            return  # expired already: the node answers 401, nothing worth remembering
        self._owners[key] = Owner(node_id, sandbox_id, until)
        self._owners.move_to_end(key)
        while len(self._owners) > self.max_entries:
            self._owners.popitem(last=False)

    def drop(self, key: SignatureKey) -> None:
        self._owners.pop(key, None)


def is_signed_file_request(scope: Scope) -> bool:
    """A signed file URL as the SDK's download_url/upload_url build it on a shared
    E2B_SANDBOX_URL: `GET|POST /files?path=…&signature=…`, no sandbox id, no access token."""
    if scope["path"] != FILES_PATH or scope["method"] not in ("GET", "POST"):
        return False
    if header_values(scope, b"x-access-token"):
        return False
    query = parse_qs(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
    return bool((query.get("signature") or [""])[0])


class SignedFiles:
    """Serves the signed file URLs (is_signed_file_request) of every sandbox of the cluster."""

    def __init__(self, link: NodeLink, metrics: GatewayMetrics, lookup_limiter: LookupLimiter,
                 team_shares: TeamShares) -> None:
        self.link = link
        self.metrics = metrics
        self.lookup_limiter = lookup_limiter
        self.team_shares = team_shares
        self.owners = SignatureOwners()

    async def owner(self, scope: Scope) -> tuple[Node, str, str] | str:
        """The node, sandbox and team whose envd token made a signed file URL, else why not.
        The URL names no sandbox and nothing in it may be trusted before the signature is
        checked: every node that is up checks it against its own sandboxes' tokens
        (SIGNATURE_OWNER_PATH) and names the one that made it."""
        nodes = await self.link.up_nodes()
        payload = {"method": scope["method"],
                   "query": scope.get("query_string", b"").decode("latin-1")}

        async def ask(node: Node) -> tuple[str, str] | None:
            self.metrics.owner_queries.inc()
            # team-less: the URL names no team, the node answers the sandbox's
            answer = await self.link.http.post(node.url + SIGNATURE_OWNER_PATH, json=payload,
                                               headers=self.link.node_headers(node, None),
                                               timeout=10)
            if answer.status_code == 200:
                return str(answer.json()["sandboxID"]), str(answer.json()["team"])
            return None

        found = await asyncio.gather(*(ask(n) for n in nodes), return_exceptions=True)
        silent = []
        for node, owner in zip(nodes, found, strict=True):
            if isinstance(owner, tuple) and SANDBOX_ID.match(owner[0]):
                return node, *owner
            if isinstance(owner, BaseException):
                silent.append(node.node_id)
                log.info("signature lookup skipped a node",
                         extra={"node": node.node_id, "error": str(owner)})
        # the sandbox may be on a node that did not answer: not (yet) an invalid signature
        return f"node unavailable: {', '.join(silent)} did not answer" if silent else ""

    async def __call__(self, scope: Scope, receive: Any, send: Send) -> None:
        key, expiration = signature_key(scope)
        remembered = self.owners.get(key)
        if remembered is not None:
            # the sandbox must still be bound to that node (a kill releases it at once)
            try:
                binding = await self.link.traffic_lookup(remembered.sandbox_id)
            except (SchedulerUnavailable, NoPlacement):
                binding = None
            if binding is None or binding.node.node_id != remembered.node_id:
                self.owners.drop(key)
            elif not binding.node.up:
                await send_json(send, 503, {"sandboxId": remembered.sandbox_id, "code": 503,
                                            "message": "node unavailable"})
                return
            else:
                self.metrics.signed_files.labels("cache").inc()
                # a request without a body can go again: a stale owner's answer is not sent,
                # the nodes are asked instead
                again = not (header_values(scope, b"content-length")
                             or header_values(scope, b"transfer-encoding"))
                status = await self._relay(scope, receive, send, binding.node,
                                           remembered.sandbox_id, binding.team, again)
                if status not in SANDBOX_GONE:
                    return
                self.owners.drop(key)
                if not again:
                    return
        if await self.lookup_limiter.refused_lookup(scope, send):
            return
        self.metrics.signed_files.labels("lookup").inc()
        try:
            owner = await self.owner(scope)
        except SchedulerUnavailable as exc:
            await send_json(send, 503, {"code": 503, "message": str(exc)})
            return
        if isinstance(owner, str):
            if owner:
                await send_json(send, 503, {"code": 503, "message": owner})
            else:  # as the node and envd answer a signature no token made
                await send_json(send, 401, {"code": 401, "message": "invalid signature"})
            return
        node, sandbox_id, team = owner
        self.owners.put(key, node.node_id, sandbox_id, expiration)
        if await self._relay(scope, receive, send, node, sandbox_id, team,
                             False) in SANDBOX_GONE:
            self.owners.drop(key)

    async def _relay(self, scope: Scope, receive: Any, send: Send, node: Node,
                     sandbox_id: str, team: str, hold_gone: bool) -> int:
        """Relay a signed file request to its sandbox's node; returns the node's status. With
        `hold_gone`, an answer in SANDBOX_GONE is not sent (the caller asks the nodes)."""
        held = False

        async def to_client(message: dict[str, Any]) -> None:
            nonlocal held
            if message["type"] == "http.response.start":
                held = hold_gone and message["status"] in SANDBOX_GONE
            if not held:
                await send(message)

        # the node checks the signature (and its expiry) again before anything reaches envd
        link = self.link
        try:
            with self.team_shares.hold(traffic_holder(team, scope)):
                return await link.relay.http(
                    scope, receive, to_client if hold_gone else send,
                    link.node_url(node, scope),
                    link.to_sandbox_headers(scope, node, sandbox_id, ENVD_PORT, team),
                    Exchange(sandbox_id))
        except TeamBusy as exc:
            await send_json(send, 429, {"sandboxId": sandbox_id, "message": str(exc),
                                        "code": 429})
            return 429
