"""The gateway's ASGI app: the E2B API of a whole cluster on one address.

Sandbox traffic (E2b-Sandbox-Id / X-Agentenv-Sandbox-Id header, or a `{port}-{id}.{domain}`
Host) is relayed to the node holding the sandbox (agentenv.relay, the node proxy's relay), which
relays it on to the sandbox. Everything else is the control API: the caller's X-API-KEY names
its team; each route goes to the node the scheduler chose (create, template builds) or the node
holding what it names (per-sandbox routes, snapshots, a team's templates); listings merge every
node's. A team sees only its own sandboxes, templates and snapshots (404 for the rest); templates
no team built (a node's built-in `base`) are everybody's.

Every request to a node carries that node's key (agentenv.cluster_keys, derived from the cluster
secret: nodes of a cluster serve nothing else, and a node's key is good for that node only), the
team it is for (TEAM_HEADER, node/tenancy.py: the node applies that team's scope itself) and no
client API key. Paths are checked before routing (relay/server.py path_problem: no dot, empty
or encoded-separator segments) and what a node is sent is built from what was routed, never
the client's raw target. Node down (missed heartbeats, or it does not answer): 503 "node
unavailable".
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import dataclasses
import hashlib
import json
import logging
import os
import re
import secrets
import ssl
import time
from collections.abc import Awaitable, Callable, Mapping
from datetime import datetime
from typing import Any
from urllib.parse import parse_qs, quote

import httpx
from starlette.requests import Request

from agentenv import __version__, boundedjson
from agentenv.cluster_keys import node_key
from agentenv.control.gateway.limits import (
    GatewayQuotas,
    LookupLimiter,
    NewItems,
    TeamBusy,
    TeamShares,
    fork_count,
)
from agentenv.control.gateway.metrics import GatewayMetrics
from agentenv.control.gateway.placement import (
    BadPlacementRequest,
    Binding,
    Node,
    NoPlacement,
    SchedulerLink,
    SchedulerUnavailable,
)
from agentenv.control.gateway.signed import SANDBOX_GONE, SignatureOwners, signature_key
from agentenv.control.gateway.store import PENDING, GatewayStore, StoreUnavailable
from agentenv.errors import AgentEnvError
from agentenv.node.security import NODE_KEY_HEADER, SIGNATURE_OWNER_PATH, bearer_is, metrics_token
from agentenv.node.template_models import UPLOAD_PREFIX
from agentenv.node.tenancy import TEAM_HEADER
from agentenv.relay.server import path_problem, request_target, target_problem
from agentenv.relay.stream import (
    Exchange,
    Relay,
    RelayLimits,
    Send,
    forward_headers,
    header_values,
    send_json,
)

log = logging.getLogger("agentenv.control.gateway")

Scope = dict[str, Any]
#: node keys remembered (then forgotten and derived again): clusters have hundreds of nodes
MAX_NODE_KEYS = 10_000
ENVD_PORT = 49983
MAX_BODY = 1 << 20
MAX_PAGE = 100
FILES_PATH = "/files"
#: how long a retry waits for a create under way with its Idempotency-Key (a create on a
#: loaded host with the VM backend takes up to a minute or two) before it answers 409
CREATE_PENDING_SECONDS = 300.0
#: the lease of a create on its Idempotency-Key: renewed every third of it while the create is
#: in flight, so a retry takes the key over this long after its gateway died (kill -9)
CREATE_LEASE_SECONDS = 15.0
CREATE_LEASE_ENV = "AENV_GATEWAY_CREATE_LEASE"
_HOST_ROUTE = re.compile(r"^(\d{1,5})-([a-z0-9]{1,63})\.[^:]+(:\d+)?$")
_PORT = re.compile(r"^\d{1,5}$")
_ID = re.compile(r"^[a-z0-9]{1,63}$")
#: what a path keeps unencoded when the gateway writes it again for a node (RFC 3986 pchar)
_PATH_SAFE = "/!$&'()*+,;=:@~-._"
#: never sent to a node: the client's team key, a node key and team (the gateway sets
#: its own) and the routing headers (the gateway sets the sandbox's own)
_DROP_TO_NODE = frozenset(
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


class ApiError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def _node_unavailable(what: str) -> ApiError:
    return ApiError(503, f"node unavailable: {what}")


def _sandbox_missing(sandbox_id: str) -> ApiError:
    return ApiError(404, f"sandbox {sandbox_id!r} not found")


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
        if not _ID.match(sandbox_id):
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


def is_signed_file_request(scope: Scope) -> bool:
    """A signed file URL as the SDK's download_url/upload_url build it on a shared
    E2B_SANDBOX_URL: `GET|POST /files?path=…&signature=…`, no sandbox id, no access token."""
    if scope["path"] != FILES_PATH or scope["method"] not in ("GET", "POST"):
        return False
    if header_values(scope, b"x-access-token"):
        return False
    query = parse_qs(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
    return bool((query.get("signature") or [""])[0])


def routed_target(scope: Scope, path: str | None = None) -> str:
    """What a node is sent: the path the gateway routed (`path`, else the request's decoded
    path, checked by path_problem) encoded again, and the query as received."""
    target = quote(scope["path"] if path is None else path, safe=_PATH_SAFE)
    query = scope.get("query_string", b"")
    return target + ("?" + query.decode("latin-1") if query else "")


def encode_cursor(key: tuple[float, str]) -> str:
    return base64.urlsafe_b64encode(json.dumps(list(key)).encode()).decode()


def decode_cursor(token: str) -> tuple[float, str]:
    try:
        ts, item_id = boundedjson.loads(base64.urlsafe_b64decode(token.encode()))
        return float(ts), str(item_id)
    except (ValueError, TypeError, binascii.Error) as exc:
        raise ApiError(400, f"invalid next token: {token!r}") from exc


def _ts(value: Any) -> float:
    try:
        return datetime.fromisoformat(str(value).replace("Z", "+00:00")).timestamp()
    except ValueError:
        return 0.0


def merged_page(items: list[dict[str, Any]], time_field: str, id_field: str,
                token: str | None, limit: int, descending: bool
                ) -> tuple[list[dict[str, Any]], str | None]:
    """One page of items from all nodes, ordered by (time, id) across them; after `token`."""

    def key(item: dict[str, Any]) -> tuple[float, str]:
        return _ts(item.get(time_field)), str(item.get(id_field))

    ordered = sorted(items, key=key, reverse=descending)
    if token:
        cursor = decode_cursor(token)
        ordered = [i for i in ordered if (key(i) < cursor if descending else key(i) > cursor)]
    chunk = ordered[:limit]
    more = len(ordered) > limit
    return chunk, (encode_cursor(key(chunk[-1])) if more and chunk else None)


def _limit(request: Request) -> int:
    raw = request.query_params.get("limit")
    if raw is None:
        return MAX_PAGE
    try:
        value = int(raw)
    except ValueError as exc:
        raise ApiError(400, f"limit must be an integer, got {raw!r}") from exc
    if not 1 <= value <= MAX_PAGE:
        raise ApiError(400, f"limit must be between 1 and {MAX_PAGE}, got {value}")
    return value


BODY_SECONDS_SETTING = "AENV_CONTROL_BODY_SECONDS"


def control_body_seconds(env: Mapping[str, str] | None = None) -> float:
    """How long the body of a control request may take to arrive (default 60 s)."""
    raw = (os.environ if env is None else env).get(BODY_SECONDS_SETTING, "").strip()
    try:
        value = float(raw) if raw else 60.0
    except ValueError:
        value = 0.0
    if not 0.1 <= value <= 3600:
        raise AgentEnvError(f"{BODY_SECONDS_SETTING} must be 0.1-3600 seconds, got {raw!r}")
    return value


def create_lease_seconds(env: Mapping[str, str] | None = None) -> float:
    raw = (os.environ if env is None else env).get(CREATE_LEASE_ENV, "")
    if not raw:
        return CREATE_LEASE_SECONDS
    try:
        value = float(raw)
    except ValueError:
        value = 0.0
    if not 1 <= value <= 300:
        raise AgentEnvError(f"{CREATE_LEASE_ENV} must be 1-300 seconds, got {raw!r}")
    return value


class GatewayApp:
    """ASGI app of `aenv gateway`."""

    def __init__(self, scheduler: SchedulerLink, store: GatewayStore, cluster_secret: str,
                 domain: str | None = None, limits: RelayLimits | None = None,
                 public_metrics: bool = False, node_tls: ssl.SSLContext | None = None) -> None:
        """`node_tls`: what the nodes' certificates are checked with where they serve TLS
        (relay/tls.py; the scheduler link's node scheme is then https)."""
        self.scheduler = scheduler
        self.store = store
        self.secret = cluster_secret
        self._node_keys: dict[str, bytes] = {}  # node id -> its key (derived once)
        # /metrics: for a scraper with the cluster's metrics token, or anyone when public
        self.metrics_token = None if public_metrics else metrics_token(cluster_secret)
        self.domain = domain
        self.limits = limits or RelayLimits.from_env()
        self.create_lease = create_lease_seconds()
        self.metrics = GatewayMetrics()
        self.signature_owners = SignatureOwners()
        # control/gateway/limits.py
        self.quotas = GatewayQuotas(store, scheduler, self.metrics.limit_refusals)
        self.lookup_limiter = LookupLimiter.from_env(self.metrics.limit_refusals)
        self.team_shares = TeamShares.from_env(self.metrics.limit_refusals)
        self.body_seconds = control_body_seconds()
        self.relay = Relay(self.limits, self._answer_gone, self._answer_unreachable,
                           limit_name="the gateway's", tls=node_tls)
        self.http = self.relay.client
        self._routes = self._route_table()

    async def close(self) -> None:
        await self.relay.close()
        await self.scheduler.close()
        await self.store.close()

    # --- ASGI --------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Any, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        problem = target_problem(request_target(scope))
        if problem is not None:  # never a forward proxy: only origin-form targets
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008})
            else:
                await send_json(send, 400, {"code": 400, "message": problem})
            return
        route = sandbox_route(scope)
        # sandbox traffic may end in '/' (an app's directory); the control API never does
        problem = path_problem(request_target(scope), trailing_slash=isinstance(route, tuple))
        if problem is not None:
            if scope["type"] == "websocket":
                await send({"type": "websocket.close", "code": 1008})
            else:
                await send_json(send, 400, {"code": 400, "message": problem})
            return
        if scope["type"] == "websocket":
            if route is None or isinstance(route, str):
                await send({"type": "websocket.close", "code": 1008})
                return
            await self._sandbox_websocket(scope, receive, send, *route)
            return
        if isinstance(route, str):
            await send_json(send, 400, {"code": 400, "message": route})
            return
        if route is not None:
            await self._sandbox_http(scope, receive, send, *route)
            return
        if is_signed_file_request(scope):
            await self._signed_file(scope, receive, send)
            return
        request = Request(scope, receive)
        try:
            await self._control(request, send)
        except ApiError as exc:
            await send_json(send, exc.status, {"code": exc.status, "message": exc.message})
        except TeamBusy as exc:
            await send_json(send, 429, {"code": 429, "message": str(exc)})
        except SchedulerUnavailable as exc:
            log.warning("control plane dependency unavailable: %s", exc.detail)
            await send_json(send, 503, {"code": 503, "message": str(exc)})
        except StoreUnavailable as exc:
            # its text names Redis's address: the log's, not the team's
            log.warning("control plane dependency unavailable: %s", exc)
            await send_json(send, 503, {"code": 503,
                                        "message": "the cluster's store is unavailable"})
        except NoPlacement as exc:
            log.info("no placement: %s", exc.detail, extra={"path": scope["path"]})
            await send_json(send, 503, {"code": 503, "message": f"no node available: {exc}"})
        except BadPlacementRequest as exc:
            await send_json(send, 400, {"code": 400, "message": str(exc)})
        except Exception as exc:
            log.error("unexpected error", exc_info=exc, extra={"path": scope["path"]})
            await send_json(send, 500, {"code": 500,
                                        "message": f"internal error: {type(exc).__name__}"})

    async def _lifespan(self, receive: Any, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.close()
                await send({"type": "lifespan.shutdown.complete"})
                return

    # --- sandbox traffic ---------------------------------------------------------------------

    def _node_headers(self, node: Node, team: str | None) -> list[tuple[bytes, bytes]]:
        """The gateway's own headers on a request to a node: that node's key, and the team the
        request is for (None: one of the few team-less routes, node/tenancy.py)."""
        key = self._node_keys.get(node.node_id)
        if key is None:
            if len(self._node_keys) >= MAX_NODE_KEYS:
                self._node_keys.clear()
            key = self._node_keys[node.node_id] = node_key(self.secret, node.node_id).encode()
        headers = [(NODE_KEY_HEADER, key)]
        if team is not None:
            headers.append((TEAM_HEADER, team.encode()))
        return headers

    def _to_node_headers(self, scope: Scope, node: Node, sandbox_id: str, port: int, team: str
                         ) -> list[tuple[bytes, bytes]]:
        headers = forward_headers(scope, _DROP_TO_NODE | {b"host"})
        headers += [
            (b"e2b-sandbox-id", sandbox_id.encode()),
            (b"e2b-sandbox-port", str(port).encode()),
            *self._node_headers(node, team),
        ]
        return headers

    def _node_url(self, node: Node, scope: Scope, path: str | None = None) -> httpx.URL:
        return httpx.URL(node.url + "/").copy_with(
            raw_path=routed_target(scope, path).encode("latin-1"))

    async def _traffic_lookup(self, sandbox_id: str) -> Binding | None:
        """The binding of a sandbox whose traffic is relayed, with its team: a binding the
        scheduler re-added from a node's heartbeat may lack it, and then the ownership record
        names it (no team at all: not found, never relayed team-less)."""
        binding = await self.scheduler.lookup(sandbox_id)
        if binding is None or binding.team:
            return binding
        team = await self.store.sandbox_team(sandbox_id)
        return dataclasses.replace(binding, team=team) if team else None

    async def _binding_for_traffic(self, sandbox_id: str) -> tuple[Binding | None, int, str]:
        try:
            binding = await self._traffic_lookup(sandbox_id)
        except SchedulerUnavailable as exc:
            return None, 503, str(exc)
        if binding is None:
            return None, 502, "The sandbox was not found"
        if not binding.node.up:
            return None, 503, "node unavailable"
        return binding, 0, ""

    async def _sandbox_http(self, scope: Scope, receive: Any, send: Send,
                            sandbox_id: str, port: int) -> None:
        binding, status, message = await self._binding_for_traffic(sandbox_id)
        if binding is None:
            await send_json(send, status, {"sandboxId": sandbox_id, "message": message,
                                           "code": status})
            return
        try:
            with self.team_shares.hold(binding.team):
                await self.relay.http(scope, receive, send, self._node_url(binding.node, scope),
                                      self._to_node_headers(scope, binding.node, sandbox_id,
                                                            port, binding.team),
                                      Exchange(sandbox_id))
        except TeamBusy as exc:
            await send_json(send, 429, {"sandboxId": sandbox_id, "message": str(exc),
                                        "code": 429})

    async def _sandbox_websocket(self, scope: Scope, receive: Any, send: Send,
                                 sandbox_id: str, port: int) -> None:
        if (await receive())["type"] != "websocket.connect":
            return
        binding, status, _ = await self._binding_for_traffic(sandbox_id)
        if binding is None:
            await send({"type": "websocket.close", "code": 1011 if status >= 503 else 1008})
            return
        try:
            with self.team_shares.hold(binding.team):
                await self.relay.websocket(
                    scope, receive, send, self._node_url(binding.node, scope),
                    self._to_node_headers(scope, binding.node, sandbox_id, port, binding.team),
                    Exchange(sandbox_id))
        except TeamBusy:
            await send({"type": "websocket.close", "code": 1013})  # try again later

    async def _signature_owner(self, scope: Scope) -> tuple[Node, str, str] | str:
        """The node, sandbox and team whose envd token made a signed file URL, else why not. The
        URL
        names no sandbox and nothing in it may be trusted before the signature is checked:
        every node that is up checks it against its own sandboxes' tokens
        (SIGNATURE_OWNER_PATH) and names the one that made it."""
        nodes = await self._up_nodes()
        payload = {"method": scope["method"],
                   "query": scope.get("query_string", b"").decode("latin-1")}

        async def ask(node: Node) -> tuple[str, str] | None:
            self.metrics.owner_queries.inc()
            # team-less: the URL names no team, the node answers the sandbox's
            answer = await self.http.post(node.url + SIGNATURE_OWNER_PATH, json=payload,
                                          headers=self._node_headers(node, None), timeout=10)
            if answer.status_code == 200:
                return str(answer.json()["sandboxID"]), str(answer.json()["team"])
            return None

        found = await asyncio.gather(*(ask(n) for n in nodes), return_exceptions=True)
        silent = []
        for node, owner in zip(nodes, found, strict=True):
            if isinstance(owner, tuple) and _ID.match(owner[0]):
                return node, *owner
            if isinstance(owner, BaseException):
                silent.append(node.node_id)
                log.info("signature lookup skipped a node",
                         extra={"node": node.node_id, "error": str(owner)})
        # the sandbox may be on a node that did not answer: not (yet) an invalid signature
        return f"node unavailable: {', '.join(silent)} did not answer" if silent else ""

    async def _signed_file(self, scope: Scope, receive: Any, send: Send) -> None:
        key, expiration = signature_key(scope)
        remembered = self.signature_owners.get(key)
        if remembered is not None:
            # the sandbox must still be bound to that node (a kill releases it at once)
            try:
                binding = await self._traffic_lookup(remembered.sandbox_id)
            except (SchedulerUnavailable, NoPlacement):
                binding = None
            if binding is None or binding.node.node_id != remembered.node_id:
                self.signature_owners.drop(key)
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
                status = await self._relay_signed(scope, receive, send, binding.node,
                                                  remembered.sandbox_id, binding.team, again)
                if status not in SANDBOX_GONE:
                    return
                self.signature_owners.drop(key)
                if not again:
                    return
        if await self.lookup_limiter.refused_lookup(scope, send):
            return
        self.metrics.signed_files.labels("lookup").inc()
        try:
            owner = await self._signature_owner(scope)
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
        self.signature_owners.put(key, node.node_id, sandbox_id, expiration)
        if await self._relay_signed(scope, receive, send, node, sandbox_id, team,
                                    False) in SANDBOX_GONE:
            self.signature_owners.drop(key)

    async def _relay_signed(self, scope: Scope, receive: Any, send: Send, node: Node,
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
        try:
            with self.team_shares.hold(team):
                return await self.relay.http(
                    scope, receive, to_client if hold_gone else send,
                    self._node_url(node, scope),
                    self._to_node_headers(scope, node, sandbox_id, ENVD_PORT, team),
                    Exchange(sandbox_id))
        except TeamBusy as exc:
            await send_json(send, 429, {"sandboxId": sandbox_id, "message": str(exc),
                                        "code": 429})
            return 429

    async def _answer_gone(self, send: Send, exchange: Exchange) -> int:
        await send_json(send, 503, {"sandboxId": exchange.name, "message": "node unavailable",
                                    "code": 503})
        return 503

    async def _answer_unreachable(self, send: Send, exchange: Exchange, exc: Exception) -> int:
        # the node holding the sandbox does not answer: it may be down before the scheduler
        # noticed; the next lookup asks the scheduler again
        self.scheduler.forget(exchange.name)
        log.info("node unreachable", extra={"sandbox_id": exchange.name, "error": str(exc)})
        return await self._answer_gone(send, exchange)

    # --- control API: plumbing ---------------------------------------------------------------

    async def _control(self, request: Request, send: Send) -> None:
        path = request.url.path
        if path == "/health":
            await send_json(send, 200, {"status": "ok", "version": __version__})
            return
        if path == "/metrics" and request.method == "GET":
            from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

            if self.metrics_token and not bearer_is(request.scope["headers"], self.metrics_token):
                raise ApiError(401, "/metrics needs Authorization: Bearer with the cluster's "
                               "metrics token (aenv metrics-token)")

            payload = generate_latest(self.metrics.registry)
            await send({"type": "http.response.start", "status": 200, "headers": [
                (b"content-type", CONTENT_TYPE_LATEST.encode()),
                (b"content-length", str(len(payload)).encode())]})
            await send({"type": "http.response.body", "body": payload})
            return
        if path == "/openapi.json":
            from agentenv.node.openapi import openapi_document

            await send_json(send, 200, openapi_document())
            return
        keys = request.headers.getlist("x-api-key")
        team = None
        if len(keys) == 1:
            team = await self.store.team_of_key(keys[0])
        if team is None and not path.startswith(UPLOAD_PREFIX):
            message = "missing X-API-KEY header" if not keys else "invalid API key"
            raise ApiError(401, message)
        for method, pattern, handler in self._routes:
            match = pattern.fullmatch(path)
            if match:
                if request.method != method:
                    continue
                with self.team_shares.hold(team or ""):  # an upload: its template's team
                    await handler(request, send, team or "", *match.groups())
                return
        if any(p.fullmatch(path) for _, p, _ in self._routes):
            raise ApiError(405, f"method {request.method} not allowed on {path}")
        raise ApiError(404, f"route not found: {request.method} {path}")

    def _route_table(self) -> list[tuple[str, re.Pattern[str], Any]]:
        sid = r"([^/]+)"
        rest = r"(.+)"
        # a build file upload: exactly what the node's signed URL names (template id, hash)
        upload = UPLOAD_PREFIX + r"([a-z0-9]{1,63})/([A-Za-z0-9_-]{1,128})"
        table = [
            ("POST", "/sandboxes", self.create),
            ("GET", "/sandboxes", self.list_v1),
            ("POST", "/v2/sandboxes", self.create),
            ("GET", "/v2/sandboxes", self.list_v2),
            ("GET", f"/sandboxes/{sid}", self.sandbox_forward),
            ("DELETE", f"/sandboxes/{sid}", self.kill),
            ("POST", f"/sandboxes/{sid}/timeout", self.sandbox_forward),
            ("POST", f"/sandboxes/{sid}/refreshes", self.sandbox_forward),
            ("POST", f"/sandboxes/{sid}/pause", self.sandbox_forward),
            ("POST", f"/sandboxes/{sid}/resume", self.sandbox_forward),
            ("POST", f"/sandboxes/{sid}/connect", self.sandbox_forward),
            ("POST", f"/v2/sandboxes/{sid}/connect", self.sandbox_forward),
            ("GET", f"/sandboxes/{sid}/metrics", self.sandbox_forward),
            ("POST", f"/sandboxes/{sid}/snapshots", self.snapshot),
            ("POST", f"/sandboxes/{sid}/fork", self.fork),
            ("POST", f"/sandboxes/{sid}/rollback", self.sandbox_forward),
            ("GET", f"/sandboxes/{sid}/children", self.sandbox_forward),
            ("PUT", f"/sandboxes/{sid}/network", self.sandbox_forward),
            ("GET", "/snapshots", self.list_snapshots),
            ("POST", f"/snapshots/{rest}/fork", self.snapshot_fork),
            ("GET", f"/snapshots/{rest}/children", self.snapshot_forward),
            ("GET", f"/snapshots/{rest}", self.snapshot_forward),
            ("POST", "/v3/templates", self.build_template),
            ("POST", "/templates/tags", self.tags_change),
            ("DELETE", "/templates/tags", self.tags_change),
            ("GET", "/templates", self.list_templates),
            ("GET", "/v2/templates", self.list_templates),
            ("GET", f"/templates/aliases/{rest}", self.template_alias),
            ("GET", f"/templates/{sid}/files/{sid}", self.template_forward),
            ("POST", f"/v2/templates/{sid}/builds/{sid}", self.build_start),
            ("GET", f"/templates/{sid}/builds/{sid}/status", self.template_forward),
            ("GET", f"/templates/{sid}/tags", self.template_forward),
            ("GET", f"/templates/{rest}", self.template_forward),
            ("DELETE", f"/templates/{rest}", self.delete_template),
            ("PUT", upload, self.template_files),
            ("GET", "/nodes", self.list_nodes),
            ("GET", f"/nodes/{sid}", self.node_detail),
        ]
        return [(m, re.compile(p), h) for m, p, h in table]

    def _headers(self, request: Request, node: Node, team: str) -> list[tuple[bytes, bytes]]:
        # the client's Idempotency-Key is the gateway's to keep (create sends one of its own)
        headers = forward_headers(request.scope,
                                  _DROP_TO_NODE | {b"content-length", b"idempotency-key"})
        return headers + self._node_headers(node, team)

    async def _body(self, request: Request) -> bytes:
        """The whole body of a control request (small JSON), within its time: uvicorn bounds
        only the head, and a body that never ends would hold a place for ever."""
        chunks, size = [], 0
        try:
            async with asyncio.timeout(self.body_seconds):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > MAX_BODY:
                        raise ApiError(413, f"request body over {MAX_BODY} bytes")
                    chunks.append(chunk)
        except TimeoutError:
            raise ApiError(408, f"request body not received within {self.body_seconds:g} s "
                           f"({BODY_SECONDS_SETTING})") from None
        return b"".join(chunks)

    async def _call(self, node: Node, request: Request, team: str, body: bytes | None = None,
                    headers: list[tuple[bytes, bytes]] | None = None) -> httpx.Response:
        """One buffered exchange with a node (bodies of the control API are small), for
        `team`, to the path the gateway routed."""
        try:
            return await self.http.request(
                request.method, self._node_url(node, request.scope),
                headers=self._headers(request, node, team) + (headers or []),
                content=body, timeout=600,
            )
        except httpx.HTTPError as exc:
            raise _node_unavailable(f"{node.node_id} at {node.address}: {exc}") from exc

    async def _get(self, node: Node, path: str, team: str | None, params: Any = None
                   ) -> httpx.Response:
        """A GET of the gateway's own making, for `team` (None: a team-less route)."""
        try:
            return await self.http.get(node.url + path, params=params, timeout=30,
                                       headers=self._node_headers(node, team))
        except httpx.HTTPError as exc:
            raise _node_unavailable(f"{node.node_id} at {node.address}: {exc}") from exc

    async def _send(self, send: Send, answer: httpx.Response,
                    content: bytes | None = None) -> None:
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

    async def _send_json(self, send: Send, status: int, body: Any,
                         headers: dict[str, str] | None = None) -> None:
        payload = json.dumps(body).encode()
        raw = [(b"content-type", b"application/json"),
               (b"content-length", str(len(payload)).encode())]
        raw += [(k.lower().encode(), v.encode()) for k, v in (headers or {}).items()]
        await send({"type": "http.response.start", "status": status, "headers": raw})
        await send({"type": "http.response.body", "body": payload})

    def _with_domain(self, sandbox: dict[str, Any]) -> dict[str, Any]:
        if isinstance(sandbox, dict) and "domain" in sandbox:
            sandbox["domain"] = self.domain
        return sandbox

    async def _up_nodes(self) -> list[Node]:
        return [n for n in await self.scheduler.nodes() if n.up]

    async def _own_binding(self, sandbox_id: str, team: str) -> Binding:
        """The node of a sandbox of `team`: 404 for another team's or an unknown sandbox, 503
        when its node is down."""
        owner = await self.store.sandbox_team(sandbox_id)
        if owner != team:
            raise _sandbox_missing(sandbox_id)
        binding = await self.scheduler.lookup(sandbox_id)
        if binding is None:
            raise _sandbox_missing(sandbox_id)
        if not binding.node.up:
            raise _node_unavailable(f"sandbox {sandbox_id} is on node {binding.node.node_id}, "
                                    "which missed its heartbeats")
        return binding

    # --- sandboxes ---------------------------------------------------------------------------

    async def create(self, request: Request, send: Send, team: str) -> None:
        raw = await self._body(request)
        keys = request.headers.getlist("idempotency-key")
        if not keys:
            await self._create(request, send, team, raw, None)
            return
        if len(keys) > 1 or not 1 <= len(keys[0]) <= 255:
            raise ApiError(400, "Idempotency-Key must appear once, 1-255 characters")
        key = keys[0]
        # A retry of a create (same team, same key) gets the first one's sandbox wherever the
        # scheduler would place the retry: the key is claimed in Redis, so concurrent duplicates
        # through any gateway make one sandbox and the others wait for its answer.
        mark = secrets.token_hex(8)
        deadline = time.monotonic() + CREATE_PENDING_SECONDS
        while True:
            found = await self.store.claim_create(team, key, mark, self.create_lease)
            if found is None:
                break
            if not found.startswith(PENDING):
                await self._send_json(send, 201, self._with_domain(json.loads(found)))
                return
            if time.monotonic() > deadline:
                raise ApiError(409, "a create with this Idempotency-Key is still under way")
            await asyncio.sleep(0.05)
        # the claim is a lease: a gateway that dies mid-create holds the key only until it
        # lapses, then a retry takes it over (and goes to the same node: _create)
        renewer = asyncio.create_task(self._renew_lease(team, key, mark))
        done = False
        try:
            done = await self._create(request, send, team, raw, key, mark)
        finally:
            renewer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renewer
            if not done:  # failed: nothing was made, a retry may try again
                await self.store.unclaim_create(team, key, mark)

    async def _renew_lease(self, team: str, key: str, mark: str) -> None:
        while True:
            await asyncio.sleep(self.create_lease / 3)
            try:
                if not await self.store.renew_create(team, key, mark, self.create_lease):
                    log.warning("create lost its Idempotency-Key lease (the gateway stalled "
                                "longer than the lease)", extra={"team": team})
                    return
            except Exception as exc:  # the next renewal may get through in time
                log.warning("cannot renew a create's lease: %s", exc)

    async def _settled(self, team: str, key: str, mark: str, node: Node,
                       created: dict[str, Any]) -> dict[str, Any]:
        """The answer of a keyed create that made `created`: its own, unless its lease lapsed
        and another create's answer holds the key (then ours is a duplicate: removed)."""
        deadline = time.monotonic() + CREATE_PENDING_SECONDS
        while True:
            held = await self.store.finish_create(team, key, mark, json.dumps(created))
            if held is None:
                return created
            if not held.startswith(PENDING):
                theirs: dict[str, Any] = json.loads(held)
                mine = created["sandboxID"]
                if theirs.get("sandboxID") != mine:
                    log.warning("removing a duplicate of a keyed create", extra={
                        "sandbox_id": mine, "node": node.node_id})
                    with contextlib.suppress(httpx.HTTPError):
                        await self.http.delete(f"{node.url}/sandboxes/{mine}", timeout=60,
                                               headers=self._node_headers(node, team))
                    await self.scheduler.release(mine)
                    await self.store.forget_sandbox(mine)
                return theirs
            # a retry took the key over and is creating: it went to our node, whose memory of
            # the key gives it our sandbox; wait for its answer
            if time.monotonic() > deadline:
                return created
            await asyncio.sleep(0.05)

    async def _create(self, request: Request, send: Send, team: str, raw: bytes,
                      key: str | None, mark: str = "") -> bool:
        """Place and create; True once a sandbox was made (and recorded under `key`)."""
        try:
            body = boundedjson.loads(raw or b"{}", "the request body")
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"request body is not valid JSON: {exc}") from exc
        template = body.get("templateID") if isinstance(body, dict) else None
        if not isinstance(template, str) or not template:
            # the node names what is wrong with the body
            node = (await self._up_nodes() or [None])[0]
            if node is None:
                raise NoPlacement("no node is up")
            await self._send(send, await self._call(node, request, team, raw))
            return False
        bare = template.split(":")[0]
        owned = (await self.store.owned("snapshot", bare, team)
                 or await self.store.owned("template", bare, team))
        if owned is not None and owned.team != team:
            raise ApiError(404, f"template '{template}' not found")
        # else a built-in template, or nothing of this team's: the node resolves the name in
        # the team's scope (another team's of that name is not found)
        node = None
        if owned is not None:
            node = await self._node_by_id(owned.node)
        elif key is not None:
            # a create that took over a lapsed lease goes where the dead gateway's went: that
            # node's memory of the key answers with its sandbox, even one still being made
            before = await self.store.create_node(team, key)
            node = next((n for n in await self._up_nodes() if n.node_id == before), None)
        if node is None:
            node = await self.scheduler.schedule(template=template, team=team)
        if isinstance(body, dict) and body.get("count") is not None:  # a batch (an extension)
            if key is not None:
                raise ApiError(400, "a batch create (count) takes no Idempotency-Key")
            await self._batch(request, send, team, node, raw)
            return True
        headers = None
        if key is not None:
            # the node's own Idempotency-Key memory has no teams: a key of the team's own
            digest = hashlib.sha256(f"{team}\0{key}".encode()).hexdigest()
            headers = [(b"idempotency-key", digest.encode())]
            await self.store.create_sent_to(team, key, node.node_id)
        async with self.quotas.new_sandboxes(team, 1) as made:
            answer = await self._call(node, request, team, raw, headers=headers)
            made.answer(answer)
        if answer.status_code != 201:
            await self._send(send, answer)
            return False
        created = answer.json()
        sandbox_id = created["sandboxID"]
        await self.store.own_sandboxes(team, [sandbox_id])
        await self.scheduler.record(sandbox_id, node, team)
        if key is not None:
            created = await self._settled(team, key, mark, node, created)
        await self._send_json(send, 201, self._with_domain(created))
        return True

    async def _node_by_id(self, node_id: str) -> Node:
        for node in await self.scheduler.nodes():
            if node.node_id == node_id:
                if not node.up:
                    raise _node_unavailable(f"{node_id} missed its heartbeats")
                return node
        raise _node_unavailable(f"{node_id} is not registered")

    async def _all_pages(self, node: Node, path: str, team: str, params: list[tuple[str, str]]
                         ) -> list[dict[str, Any]]:
        items: list[dict[str, Any]] = []
        token = None
        while True:
            query = [*params, ("limit", str(MAX_PAGE))]
            if token:
                query.append(("nextToken", token))
            answer = await self._get(node, path, team, query)
            if answer.status_code != 200:
                raise ApiError(answer.status_code if answer.status_code < 500 else 502,
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
        nodes = await self._up_nodes()

        async def fetch(node: Node) -> list[Any]:
            if paged:
                return await self._all_pages(node, path, team, params)
            answer = await self._get(node, path, team, params)
            if answer.status_code != 200:
                raise ApiError(answer.status_code, answer.text)
            return list(answer.json())

        items = await self._gather(nodes, fetch)
        teams = await self.store.sandbox_teams([i["sandboxID"] for i in items])
        return [i for i, t in zip(items, teams, strict=True) if t == team]

    async def list_v1(self, request: Request, send: Send, team: str) -> None:
        await self._send_json(send, 200,
                              await self._team_sandboxes(request, "/sandboxes", team, False))

    async def list_v2(self, request: Request, send: Send, team: str) -> None:
        order = request.query_params.get("order", "desc")
        if order not in ("asc", "desc"):
            raise ApiError(400, f"order must be asc or desc, got {order!r}")
        limit = _limit(request)
        token = request.query_params.get("nextToken")
        if token:
            decode_cursor(token)
        found = await self._team_sandboxes(request, "/v2/sandboxes", team, True)
        items, next_token = merged_page(found, "startedAt", "sandboxID", token, limit,
                                        order == "desc")
        headers = {"X-Total-Running": str(sum(i.get("state") == "running" for i in found))}
        if next_token:
            headers["X-Next-Token"] = next_token
        await self._send_json(send, 200, items, headers)

    async def sandbox_forward(self, request: Request, send: Send, team: str,
                              sandbox_id: str) -> None:
        binding = await self._own_binding(sandbox_id, team)
        answer = await self._call(binding.node, request, team, await self._body(request))
        if answer.status_code in (200, 201) and request.method == "POST" and (
            request.url.path.endswith(("/connect", "/resume", "/rollback"))
        ):
            await self._send_json(send, answer.status_code, self._with_domain(answer.json()))
            return
        if answer.status_code == 200 and request.method == "GET" and request.url.path.count(
            "/"
        ) == 2:
            await self._send_json(send, 200, self._with_domain(answer.json()))
            return
        await self._send(send, answer)

    async def kill(self, request: Request, send: Send, team: str, sandbox_id: str) -> None:
        binding = await self._own_binding(sandbox_id, team)
        answer = await self._call(binding.node, request, team)
        if answer.status_code in (204, 404):
            await self.scheduler.release(sandbox_id)
            await self.store.forget_sandbox(sandbox_id)
        await self._send(send, answer)

    async def fork(self, request: Request, send: Send, team: str, sandbox_id: str) -> None:
        # a fork stays on its source's node (its memory and disk are there), running or paused
        binding = await self._own_binding(sandbox_id, team)
        await self._batch(request, send, team, binding.node, await self._body(request))

    async def snapshot_fork(self, request: Request, send: Send, team: str, ref: str) -> None:
        """A batch create from a snapshot, on the node that holds it (its layers are there)."""
        await self._batch(request, send, team, await self._snapshot_node(ref, team),
                          await self._body(request))

    async def _batch(self, request: Request, send: Send, team: str, node: Node,
                     raw: bytes) -> None:
        """Forward a request that makes `count` sandboxes on `node` (a fork, a batch create),
        answered with a SandboxForkResult each: the team's quota holds their places, and every
        child made is the team's, bound to `node`."""
        async with self.quotas.new_sandboxes(team, fork_count(raw)) as made:
            answer = await self._call(node, request, team, raw)
            made.answer(answer)
        if answer.status_code != 201:
            await self._send(send, answer)
            return
        results = answer.json()
        children = [r["sandbox"]["sandboxID"] for r in results if r.get("sandbox")]
        await self.store.own_sandboxes(team, children)
        for child in children:
            await self.scheduler.record(child, node, team)
        for r in results:
            if r.get("sandbox"):
                self._with_domain(r["sandbox"])
        await self._send_json(send, 201, results)

    async def snapshot(self, request: Request, send: Send, team: str, sandbox_id: str) -> None:
        binding = await self._own_binding(sandbox_id, team)
        raw = await self._body(request)
        async with self.quotas.new_item(team, "snapshots") as made:
            answer = await self._call(binding.node, request, team, raw)
            if answer.status_code == 201:
                snap = answer.json()
                names = [n.split("/")[-1].split(":")[0] for n in snap.get("names", [])]
                await self.store.own("snapshot", snap["snapshotID"], team,
                                     binding.node.node_id, names)
                made.ids.append(snap["snapshotID"])
        await self._send(send, answer)

    # --- snapshots ---------------------------------------------------------------------------

    async def list_snapshots(self, request: Request, send: Send, team: str) -> None:
        limit = _limit(request)
        token = request.query_params.get("nextToken")
        if token:
            decode_cursor(token)
        params = [(k, v) for k, v in request.query_params.multi_items()
                  if k not in ("limit", "nextToken")]
        items = await self._gather(await self._up_nodes(),
                                   lambda n: self._all_pages(n, "/snapshots", team, params))
        owners = await self.store.owned_ids("snapshot", [i["snapshotID"] for i in items])
        mine = [i for i in items if owners.get(i["snapshotID"]) == team]
        page_items, next_token = merged_page(mine, "createdAt", "snapshotID", token, limit, True)
        headers = {"X-Next-Token": next_token} if next_token else None
        await self._send_json(send, 200, page_items, headers)

    async def _snapshot_node(self, ref: str, team: str) -> Node:
        """The node holding a snapshot of `team` (404 for another team's or an unknown one)."""
        owned = await self.store.owned("snapshot", ref.split("/")[-1].split(":")[0], team)
        if owned is None or owned.team != team:
            raise ApiError(404, f"snapshot '{ref}' not found")
        return await self._node_by_id(owned.node)

    async def snapshot_forward(self, request: Request, send: Send, team: str, ref: str) -> None:
        """A snapshot, or the sandboxes made from it, as the node holding it knows them."""
        await self._send(send, await self._call(await self._snapshot_node(ref, team), request,
                                                team))

    # --- templates ---------------------------------------------------------------------------

    async def _template_node(self, ref: str, team: str, own_only: bool = False) -> Node:
        """The node of a template `team` may see: its own (where it was built), or a shared one
        (no team built it: any node that is up has it), unless `own_only`."""
        bare = ref.split("/")[-1].split(":")[0]
        owned = await self.store.owned("template", bare, team)
        if owned is not None:
            if owned.team != team:
                raise ApiError(404, f"template '{ref}' not found")
            return await self._node_by_id(owned.node)
        if own_only:
            raise ApiError(404, f"template '{ref}' not found")
        # a built-in template's name, or nothing: the node resolves it in the team's scope
        nodes = await self._up_nodes()
        if not nodes:
            raise NoPlacement("no node is up")
        return nodes[0]

    async def build_template(self, request: Request, send: Send, team: str) -> None:
        raw = await self._body(request)
        try:
            body = boundedjson.loads(raw or b"{}", "the request body")
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"request body is not valid JSON: {exc}") from exc
        name = ""
        if isinstance(body, dict):
            name = str(body.get("name") or body.get("alias") or "").split(":")[0]
        owned = await self.store.owned("template", name, team) if name else None
        new_template = False
        if owned is not None and owned.team == team:
            node = await self._node_by_id(owned.node)  # a rebuild: where the template is
        elif name:
            # names are per team (the nodes keep them so): only a built-in's is no team's
            await self._refuse_shared_name(name, team)
            node = await self._new_build_node(name, team, body)
            new_template = True
        else:  # the node names what is wrong with the body
            node = (await self._up_nodes() or [None])[0]
            if node is None:
                raise NoPlacement("no node is up")
        # a new template holds a place of the team's quota from before the node is asked
        async with (self.quotas.new_item(team, "templates") if new_template
                    else contextlib.nullcontext(NewItems())) as made:
            answer = await self._call(node, request, team, raw)
            if answer.status_code in (200, 201, 202):
                template_id = answer.json().get("templateID")
                if template_id:
                    await self.store.own("template", template_id, team, node.node_id,
                                         [name] if name else [])
                    await self.store.note_build_node(team, node.node_id)
                    made.ids.append(template_id)
        await self._send(send, answer)

    async def _new_build_node(self, name: str, team: str, body: dict[str, Any]) -> Node:
        """Where a new template of `team` is built: next to the team's templates (the node it
        last built one on that is up and has room), as the build's base (`fromTemplate`, sent
        only later, in build_start) is most likely one of them; else the scheduler's choice."""
        vcpus, memory = body.get("cpuCount") or 2, body.get("memoryMB") or 1024  # node defaults
        if not isinstance(vcpus, int) or not isinstance(memory, int):
            vcpus, memory = 2, 1024  # the node names what is wrong with them
        homes = await self.store.build_nodes(team)
        if homes:
            nodes = {n.node_id: n for n in await self.scheduler.nodes()}
            for node_id in homes:
                node = nodes.get(node_id)
                if node is not None and node.up and not self.scheduler.misfit(node_id, vcpus,
                                                                                memory):
                    return node
        return await self.scheduler.schedule(template=name, team=team)

    async def build_start(self, request: Request, send: Send, team: str, template_id: str,
                          build_id: str) -> None:
        """The trigger of a build (after the file uploads): its body names the base."""
        node = await self._template_node(template_id, team)
        raw = await self._body(request)
        await self._check_build_base(raw, node, team)
        await self._send(send, await self._call(node, request, team, raw))

    async def _check_build_base(self, raw: bytes, node: Node, team: str) -> None:
        """Refuse, before the node starts anything, a base (`fromTemplate`) the node building
        the template cannot have: another team's template (400 as the node's "not found"), or
        one of the team's own that sits on another node (409: a template's builds stay on the
        node the build was placed on when the base was not known yet)."""
        try:
            body = boundedjson.loads(raw or b"{}", "the request body")
        except (json.JSONDecodeError, UnicodeDecodeError):
            return  # the node names what is wrong with the body
        base = body.get("fromTemplate") if isinstance(body, dict) else None
        if not isinstance(base, str) or not base:
            return
        bare = base.split("/")[-1].split(":")[0]
        for kind in ("template", "snapshot"):
            owned = await self.store.owned(kind, bare, team)
            if owned is None:
                continue
            if owned.team != team:
                raise ApiError(400, f"template '{base}' not found")
            if owned.node != node.node_id:
                # the team's next new template goes next to this base (build it again there)
                await self.store.note_build_node(team, owned.node)
                raise ApiError(409, (
                    f"the base template '{base}' is on node {owned.node}, but this build was "
                    f"placed on node {node.node_id} (a build is placed before its base is "
                    f"known: node {owned.node} was down or full then) and a node builds only "
                    f"from the templates it holds. Delete this template and build it again "
                    f"once node {owned.node} is up with room (a new template of the team goes "
                    f"to it), or build from a template on node {node.node_id}"))
            return
        # else a built-in, or not the team's: the node resolves it in the team's scope

    async def _refuse_shared_name(self, name: str, team: str) -> None:
        """400 for the name of a template no team built (a node's `base`): no team may claim it,
        not even for the moment the node takes to refuse the build."""
        node = (await self._up_nodes() or [None])[0]
        if node is None:
            raise NoPlacement("no node is up")
        probe = await self._get(node, f"/templates/aliases/{quote(name, safe='')}", team)
        if probe.status_code == 200:
            template_id = str(probe.json().get("templateID", ""))
            if not await self.store.owned_ids("template", [template_id]):
                raise ApiError(400, f"the template name {name!r} is a built-in template's")

    async def template_forward(self, request: Request, send: Send, team: str, ref: str,
                               *_: str) -> None:
        node = await self._template_node(ref, team)
        await self._send(send, await self._call(node, request, team, await self._body(request)))

    async def template_files(self, request: Request, send: Send, team: str, template_id: str,
                             files_hash: str) -> None:
        """A signed upload URL (no API key: the node checks the signature; the file may be
        large), relayed as exactly the `/template-files/{templateID}/{hash}` it was matched
        as, for the team whose template it is."""
        owned = await self.store.owned("template", template_id)
        if owned is None:
            raise ApiError(404, f"template '{template_id}' not found")
        node = await self._node_by_id(owned.node)
        url = self._node_url(node, request.scope, f"{UPLOAD_PREFIX}{template_id}/{files_hash}")
        headers = forward_headers(request.scope, _DROP_TO_NODE | {b"host"})
        with self.team_shares.hold(owned.team):
            await self.relay.http(request.scope, request.receive, send, url,
                                  headers + self._node_headers(node, owned.team),
                                  Exchange(template_id))

    async def tags_change(self, request: Request, send: Send, team: str) -> None:
        raw = await self._body(request)
        try:
            body = boundedjson.loads(raw or b"{}", "the request body")
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ApiError(400, f"request body is not valid JSON: {exc}") from exc
        target = ""
        if isinstance(body, dict):
            target = str(body.get("target") or body.get("name") or "")
        # tags of shared templates are no team's to change
        node = await self._template_node(target, team, own_only=True) if target else (
            (await self._up_nodes() or [None])[0])
        if node is None:
            raise NoPlacement("no node is up")
        await self._send(send, await self._call(node, request, team, raw))

    async def template_alias(self, request: Request, send: Send, team: str, alias: str) -> None:
        node = await self._template_node(alias, team)
        await self._send(send, await self._call(node, request, team))

    async def delete_template(self, request: Request, send: Send, team: str, ref: str) -> None:
        bare = ref.split("/")[-1].split(":")[0]
        owned = await self.store.owned("template", bare, team)
        if owned is None:
            owned = await self.store.owned("snapshot", bare, team)
        if owned is None or owned.team != team:
            # shared templates are not any team's to delete
            raise ApiError(404, f"template '{ref}' not found")
        node = await self._node_by_id(owned.node)
        answer = await self._call(node, request, team)
        if answer.status_code == 204:
            await self.store.disown(owned.kind, owned.id, team, [bare])
        await self._send(send, answer)

    async def list_templates(self, request: Request, send: Send, team: str) -> None:
        v2 = request.url.path.startswith("/v2/")
        nodes = await self._up_nodes()

        async def fetch(node: Node) -> list[Any]:
            answer = await self._get(node, "/templates", team)
            if answer.status_code != 200:
                raise ApiError(answer.status_code, answer.text)
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
            visible.sort(key=lambda i: (_ts(i.get("createdAt")), i["templateID"]))
            await self._send_json(send, 200, visible)
            return
        limit = _limit(request)
        token = request.query_params.get("nextToken")
        page_items, next_token = merged_page(visible, "createdAt", "templateID", token, limit,
                                             True)
        await self._send_json(send, 200, page_items,
                              {"X-Next-Token": next_token} if next_token else None)

    # --- nodes -------------------------------------------------------------------------------

    async def list_nodes(self, request: Request, send: Send, team: str) -> None:
        """Every node of the cluster, with the figures of `team`'s own sandboxes on it (the
        node answers for the team the gateway names: no other team's load)."""
        nodes = await self.scheduler.nodes()

        async def fetch(node: Node) -> list[Any]:
            answer = await self._get(node, "/nodes", team)
            found = list(answer.json()) if answer.status_code == 200 else []
            for item in found:  # the scheduler's name of the node, not its host name
                item.update({"id": node.node_id, "nodeID": node.node_id})
            return found

        up = [n for n in nodes if n.up]
        found = await self._gather(up, fetch)
        found += [{"id": n.node_id, "nodeID": n.node_id, "status": "unhealthy"}
                  for n in nodes if not n.up]
        await self._send_json(send, 200, found)

    async def node_detail(self, request: Request, send: Send, team: str, node_id: str) -> None:
        for node in await self.scheduler.nodes():
            if node.node_id == node_id:
                if not node.up:
                    raise _node_unavailable(f"{node_id} missed its heartbeats")
                answer = await self._get(node, "/nodes", team)
                if answer.status_code == 200 and answer.json():
                    body = answer.json()[0]
                    body.update({"id": node_id, "nodeID": node_id, "cachedBuilds": []})
                    await self._send_json(send, 200, body)
                    return
        raise ApiError(404, f"node {node_id!r} not found")
