"""The gateway's link to the nodes: what every concern of the gateway sends a node and how.

Every request to a node carries that node's key (agentenv.cluster_keys, derived from the
cluster secret: nodes of a cluster serve nothing else, and a node's key is good for that node
only), the team it is for (TEAM_HEADER, api/tenancy.py: the node applies that team's scope
itself) and no client API key. What a node is sent is built from what was routed, never the
client's raw target. Also here: where a sandbox, snapshot or template of a team is (the
ownership records in Redis and the scheduler's bindings), and the answers' plumbing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Mapping
from typing import Any
from urllib.parse import quote

import httpx
from starlette.requests import Request

from agentenv import boundedjson
from agentenv.api.auth import NODE_KEY_HEADER
from agentenv.api.errors import ApiError
from agentenv.api.tenancy import TEAM_HEADER
from agentenv.cluster_keys import node_key
from agentenv.control.gateway.placement import Binding, Node, NoPlacement, SchedulerLink
from agentenv.control.gateway.store import GatewayStore
from agentenv.errors import AgentEnvError
from agentenv.relay.stream import Exchange, Relay, Send, forward_headers
from agentenv.settings import setting_text

Scope = dict[str, Any]
#: node keys remembered (then forgotten and derived again): clusters have hundreds of nodes
MAX_NODE_KEYS = 10_000
ENVD_PORT = 49983
MAX_BODY = 1 << 20
#: what a path keeps unencoded when the gateway writes it again for a node (RFC 3986 pchar)
_PATH_SAFE = "/!$&'()*+,;=:@~-._"
#: never sent to a node: the client's team key, a node key and team (the gateway sets
#: its own) and the routing headers (the gateway sets the sandbox's own)
DROP_TO_NODE = frozenset(
    {
        b"x-api-key",
        NODE_KEY_HEADER,
        TEAM_HEADER,
        b"e2b-sandbox-id",
        b"e2b-sandbox-port",
        b"x-agentenv-sandbox-id",
        b"x-agentenv-sandbox-port",
        b"expect",
    }
)
BODY_SECONDS_SETTING = "AENV_CONTROL_BODY_SECONDS"


class GatewayError(ApiError):
    """An answer of the gateway's own: `{"code": status, "message": message}`."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message, status=status)


def node_unavailable(what: str) -> GatewayError:
    return GatewayError(503, f"node unavailable: {what}")


def sandbox_missing(sandbox_id: str) -> GatewayError:
    return GatewayError(404, f"sandbox {sandbox_id!r} not found")


def bare_name(ref: str) -> str:
    """A template or snapshot reference's name: no namespace, no tag."""
    return ref.split("/")[-1].split(":")[0]


def json_body(raw: bytes) -> Any:
    """A control request's JSON body (`{}` when empty): 400 when it is not JSON."""
    try:
        return boundedjson.loads(raw or b"{}", "the request body")
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise GatewayError(400, f"request body is not valid JSON: {exc}") from exc


def control_body_seconds(env: Mapping[str, str] | None = None) -> float:
    """How long the body of a control request may take to arrive (default 60 s)."""
    raw = setting_text(BODY_SECONDS_SETTING, env).strip()
    try:
        value = float(raw) if raw else 60.0
    except ValueError:
        value = 0.0
    if not 0.1 <= value <= 3600:
        raise AgentEnvError(f"{BODY_SECONDS_SETTING} must be 0.1-3600 seconds, got {raw!r}")
    return value


def routed_target(scope: Scope, path: str | None = None) -> str:
    """What a node is sent: the path the gateway routed (`path`, else the request's decoded
    path, checked by path_problem) encoded again, and the query as received."""
    target = quote(scope["path"] if path is None else path, safe=_PATH_SAFE)
    query = scope.get("query_string", b"")
    return target + ("?" + query.decode("latin-1") if query else "")


async def send_answer(send: Send, answer: httpx.Response, content: bytes | None = None) -> None:
    """A node's buffered answer, as the client's."""
    body = answer.content if content is None else content
    headers = [
        (n, v) for n, v in answer.headers.raw
        if n.lower() not in (b"content-length", b"transfer-encoding", b"connection",
                             b"content-encoding", b"date", b"server")
    ]
    headers.append((b"content-length", str(len(body)).encode()))
    await send({"type": "http.response.start", "status": answer.status_code,
                "headers": headers})
    await send({"type": "http.response.body", "body": body})


class NodeLink:
    """Requests to the nodes, for a team, and where a team's things are."""

    def __init__(self, scheduler: SchedulerLink, store: GatewayStore, cluster_secret: str,
                 relay: Relay, domain: str | None, body_seconds: float) -> None:
        self.scheduler = scheduler
        self.store = store
        self.secret = cluster_secret
        self.relay = relay
        self.http = relay.client
        self.domain = domain
        self.body_seconds = body_seconds
        self._node_keys: dict[str, bytes] = {}  # node id -> its key (derived once)

    # --- what a node is sent -------------------------------------------------------------------

    def node_headers(self, node: Node, team: str | None) -> list[tuple[bytes, bytes]]:
        """The gateway's own headers on a request to a node: that node's key, and the team the
        request is for (None: one of the few team-less routes, api/tenancy.py)."""
        key = self._node_keys.get(node.node_id)
        if key is None:
            if len(self._node_keys) >= MAX_NODE_KEYS:
                self._node_keys.clear()
            key = self._node_keys[node.node_id] = node_key(self.secret, node.node_id).encode()
        headers = [(NODE_KEY_HEADER, key)]
        if team is not None:
            headers.append((TEAM_HEADER, team.encode()))
        return headers

    def to_sandbox_headers(self, scope: Scope, node: Node, sandbox_id: str, port: int,
                           team: str) -> list[tuple[bytes, bytes]]:
        """A relayed request's headers: the client's, routed to `sandbox_id`:`port`."""
        headers = forward_headers(scope, DROP_TO_NODE | {b"host"})
        headers += [
            (b"e2b-sandbox-id", sandbox_id.encode()),
            (b"e2b-sandbox-port", str(port).encode()),
            *self.node_headers(node, team),
        ]
        return headers

    def node_url(self, node: Node, scope: Scope, path: str | None = None) -> httpx.URL:
        return httpx.URL(node.url + "/").copy_with(
            raw_path=routed_target(scope, path).encode("latin-1"))

    def _headers(self, request: Request, node: Node, team: str) -> list[tuple[bytes, bytes]]:
        # the client's Idempotency-Key is the gateway's to keep (create sends one of its own)
        headers = forward_headers(request.scope,
                                  DROP_TO_NODE | {b"content-length", b"idempotency-key"})
        return headers + self.node_headers(node, team)

    async def body(self, request: Request) -> bytes:
        """The whole body of a control request (small JSON), within its time: uvicorn bounds
        only the head, and a body that never ends would hold a place for ever."""
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.body_seconds):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > MAX_BODY:
                        raise GatewayError(413, f"request body over {MAX_BODY} bytes")
                    chunks.append(chunk)
        except TimeoutError:
            raise GatewayError(408, f"request body not received within {self.body_seconds:g}"
                               f" s ({BODY_SECONDS_SETTING})") from None
        return b"".join(chunks)

    async def call(self, node: Node, request: Request, team: str, body: bytes | None = None,
                   headers: list[tuple[bytes, bytes]] | None = None) -> httpx.Response:
        """One buffered exchange with a node (bodies of the control API are small), for
        `team`, to the path the gateway routed."""
        try:
            return await self.http.request(
                request.method, self.node_url(node, request.scope),
                headers=self._headers(request, node, team) + (headers or []),
                content=body, timeout=600,
            )
        except httpx.HTTPError as exc:
            raise node_unavailable(f"{node.node_id} at {node.address}: {exc}") from exc

    async def get(self, node: Node, path: str, team: str | None, params: Any = None
                  ) -> httpx.Response:
        """A GET of the gateway's own making, for `team` (None: a team-less route)."""
        try:
            return await self.http.get(node.url + path, params=params, timeout=30,
                                       headers=self.node_headers(node, team))
        except httpx.HTTPError as exc:
            raise node_unavailable(f"{node.node_id} at {node.address}: {exc}") from exc

    async def forward(self, node: Node, request: Request, send: Send, team: str,
                      read_body: bool = True) -> None:
        """The request, for `team`, to `node`; its answer, to the client."""
        body = await self.body(request) if read_body else None
        await send_answer(send, await self.call(node, request, team, body))

    async def relay_to(self, node: Node, request: Request, send: Send, team: str,
                       name: str, path: str | None = None) -> None:
        """The request streamed both ways to `node` (the client's own credential with it: a
        signed URL, a volume's token), for `team`, to `path` or the path routed."""
        headers = forward_headers(request.scope, DROP_TO_NODE | {b"host"})
        await self.relay.http(request.scope, request.receive, send,
                              self.node_url(node, request.scope, path),
                              headers + self.node_headers(node, team), Exchange(name))

    def with_domain(self, sandbox: dict[str, Any]) -> dict[str, Any]:
        """A sandbox as the clients of this gateway reach it: through the gateway's domain."""
        if isinstance(sandbox, dict) and "domain" in sandbox:
            sandbox["domain"] = self.domain
        return sandbox

    # --- where things are ----------------------------------------------------------------------

    async def up_nodes(self) -> list[Node]:
        return [n for n in await self.scheduler.nodes() if n.up]

    async def any_node(self) -> Node:
        """A node that is up (the node names what is wrong with a body the gateway cannot
        route; a built-in template is on every node)."""
        node = (await self.up_nodes() or [None])[0]
        if node is None:
            raise NoPlacement("no node is up")
        return node

    async def node_by_id(self, node_id: str) -> Node:
        for node in await self.scheduler.nodes():
            if node.node_id == node_id:
                if not node.up:
                    raise node_unavailable(f"{node_id} missed its heartbeats")
                return node
        raise node_unavailable(f"{node_id} is not registered")

    async def own_binding(self, sandbox_id: str, team: str) -> Binding:
        """The node of a sandbox of `team`: 404 for another team's or an unknown sandbox, 503
        when its node is down."""
        owner = await self.store.sandbox_team(sandbox_id)
        if owner != team:
            raise sandbox_missing(sandbox_id)
        binding = await self.scheduler.lookup(sandbox_id)
        if binding is None:
            raise sandbox_missing(sandbox_id)
        if not binding.node.up:
            raise node_unavailable(f"sandbox {sandbox_id} is on node {binding.node.node_id}, "
                                   "which missed its heartbeats")
        return binding

    async def traffic_lookup(self, sandbox_id: str) -> Binding | None:
        """The binding of a sandbox whose traffic is relayed, with its team: a binding the
        scheduler re-added from a node's heartbeat may lack it, and then the ownership record
        names it (no team at all: not found, never relayed team-less)."""
        binding = await self.scheduler.lookup(sandbox_id)
        if binding is None or binding.team:
            return binding
        team = await self.store.sandbox_team(sandbox_id)
        return dataclasses.replace(binding, team=team) if team else None

    async def volume_home(self, team: str) -> Node | None:
        """The node holding `team`'s volumes (control/gateway/volumes.py), None before its
        first; 503 while it is down."""
        home = await self.store.volume_home(team)
        return None if home is None else await self.node_by_id(home)

    async def snapshot_node(self, ref: str, team: str) -> Node:
        """The node holding a snapshot of `team` (404 for another team's or an unknown one)."""
        owned = await self.store.owned("snapshot", bare_name(ref), team)
        if owned is None or owned.team != team:
            raise GatewayError(404, f"snapshot '{ref}' not found")
        return await self.node_by_id(owned.node)

    async def template_node(self, ref: str, team: str, own_only: bool = False) -> Node:
        """The node of a template `team` may see: its own (where it was built), or a shared one
        (no team built it: any node that is up has it), unless `own_only`."""
        owned = await self.store.owned("template", bare_name(ref), team)
        if owned is not None:
            if owned.team != team:
                raise GatewayError(404, f"template '{ref}' not found")
            return await self.node_by_id(owned.node)
        if own_only:
            raise GatewayError(404, f"template '{ref}' not found")
        # a built-in template's name, or nothing: the node resolves it in the team's scope
        return await self.any_node()
