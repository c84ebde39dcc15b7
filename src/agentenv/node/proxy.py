"""The sandbox proxy: E2B SDK traffic for envd (and any other sandbox port) on the node's port.

A request is for a sandbox when it carries `E2b-Sandbox-Id` (port from `E2b-Sandbox-Port`,
default 49983), when its Host is `{port}-{sandboxID}.{domain}`, or when it is a signed file URL
(`/files?...&signature=...`, what the SDK's `download_url`/`upload_url` build on a shared
`E2B_SANDBOX_URL`): the signature names the sandbox whose envd token made it. Bodies stream both
ways without buffering (Connect server streams, chunked and gzip uploads, large downloads).

Where a request goes is never taken from the request text: only origin-form targets
(`/path?query`) are relayed, to the (host, port) of the sandbox's placement. Answers the SDKs
rely on (docs/e2b-api.md §2.3): a sandbox that is unknown, killed or paused without
autoResume gives 502 "The sandbox was not found"; a running sandbox whose port does not answer
gives 502 "The sandbox is running but port is not open". When a sandbox stops running (kill,
pause, timeout, its VM dying) every exchange the proxy holds with it ends at once: one that has
not answered yet gets that 502, one that is streaming has its connection cut (the SDK then
probes /health, gets the 502 and raises "The sandbox was killed or reached its end of life").

Limits (`ProxyLimits`, AENV_PROXY_* variables): request head size and time (relay/server.py),
request body size, idle time either way, total time of one exchange, concurrent exchanges per
sandbox. A paused sandbox with autoResume (or paused by the node for idleness, node/idle.py: every
exchange is counted there) is resumed by traffic only when the request carries
what the running sandbox would ask for: the traffic token on a non-public sandbox's ports, the
envd access token (or a valid file signature) on the envd port of a secure sandbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import re
import time
from base64 import b64encode
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import parse_qs

import httpx

from agentenv.api.auth import NODE_KEY_HEADER, same_secret
from agentenv.api.errors import ApiError
from agentenv.api.tenancy import TEAM_HEADER, scope_team
from agentenv.logs import PerKeyLimit
from agentenv.node.backend import CODE_INTERPRETER_PORT, ENVD_PORT
from agentenv.node.metrics import NodeMetrics
from agentenv.node.orchestrator import Orchestrator
from agentenv.node.records import SandboxRecord, State
from agentenv.relay.answers import send_json
from agentenv.relay.server import request_has_body, request_target, target_problem
from agentenv.relay.stream import (
    Exchange,
    Relay,
    RelayLimits,
    Send,
    forward_headers,
    refuse_websocket,
)

log = logging.getLogger("agentenv.node.proxy")
#: what a client causes at will (a request to a closed port, over a cap), per sandbox
EVENTS = PerKeyLimit(log)

Scope = dict[str, Any]

_HOST_ROUTE = re.compile(r"^(\d{1,5})-([a-z0-9]{1,63})\.[^:]+(:\d+)?$")
_PORT = re.compile(r"^\d{1,5}$")
#: routing headers are the node's business; `expect: 100-continue` was answered by the node's
#: HTTP server already, and the upstream client does not wait for a second 100.
_ROUTING = {
    b"e2b-sandbox-id",
    b"e2b-sandbox-port",
    b"e2b-traffic-access-token",
    b"host",
    b"expect",
    NODE_KEY_HEADER,
    TEAM_HEADER,
}
FILES_PATH = "/files"
#: what runs code on the code-interpreter server, which takes envd's token there
#: (guest/codeint/app.py; its context routes do not require it: the SDKs send none with them)
CODE_RUN_ROUTES = {("POST", "/execute"), ("POST", "/aenv/warm")}


#: the proxy's limits are the relay's (AENV_PROXY_* variables)
ProxyLimits = RelayLimits


@dataclass(eq=False)
class SandboxExchange(Exchange):
    #: let through to the sandbox: its end is the sandbox's activity (node/idle.py)
    admitted: bool = field(default=False)


@dataclass
class ProxyRoute:
    """Which sandbox and port a request is for; `problem` when the routing headers are bad."""

    sandbox_id: str
    port: int
    problem: str | None = None
    #: found by its file signature (no id or host named the sandbox)
    by_signature: bool = False



def _envd_token_given(scope: Scope, rec: SandboxRecord) -> bool:
    """Whether the request carries the sandbox's envd token (X-Access-Token) or a valid signed
    file URL of it."""
    signed = _signed_request(scope)
    if signed is not None:
        return bool(rec.envd_access_token) and signed.problem(rec.envd_access_token) is None
    return _access_token_given(scope, rec)


def _access_token_given(scope: Scope, rec: SandboxRecord) -> bool:
    """Whether the request carries the sandbox's envd token in X-Access-Token, once."""
    tokens = _header(scope, b"x-access-token")
    return len(tokens) == 1 and bool(rec.envd_access_token) and same_secret(
        tokens[0].decode("latin-1"), rec.envd_access_token)


def _header(scope: Scope, name: bytes) -> list[bytes]:
    return [v for n, v in scope["headers"] if n == name]


def route_of(scope: Scope) -> ProxyRoute | None:
    """The route named by headers or Host, or None (no signature lookup: SandboxProxy.route)."""
    ids = _header(scope, b"e2b-sandbox-id")
    ports = _header(scope, b"e2b-sandbox-port")
    if ids:
        sandbox_id = ids[0].decode("latin-1").strip()
        if len(ids) > 1 or len(ports) > 1:
            return ProxyRoute(sandbox_id, 0, "E2b-Sandbox-Id and E2b-Sandbox-Port may appear once")
        raw_port = ports[0].decode("latin-1").strip() if ports else str(ENVD_PORT)
        if not _PORT.match(raw_port) or not 0 < int(raw_port) < 65536:
            return ProxyRoute(sandbox_id, 0, f"invalid E2b-Sandbox-Port {raw_port[:20]!r}")
        if not sandbox_id:
            return ProxyRoute(sandbox_id, 0, "empty E2b-Sandbox-Id")
        return ProxyRoute(sandbox_id, int(raw_port))
    hosts = _header(scope, b"host")
    if len(hosts) == 1:
        match = _HOST_ROUTE.match(hosts[0].decode("latin-1").strip().lower().rstrip("."))
        if match:
            port = int(match.group(1))
            if not 0 < port < 65536:
                return ProxyRoute(match.group(2), 0, f"invalid port {port} in Host")
            return ProxyRoute(match.group(2), port)
    return None


def file_signature(path: str, operation: str, user: str, token: str, expiration: int | None) -> str:
    """E2B's v1 file signature (the SDK's get_signature, envd's check)."""
    raw = f"{path}:{operation}:{user}:{token}"
    if expiration is not None:
        raw += f":{expiration}"
    return "v1_" + b64encode(hashlib.sha256(raw.encode()).digest()).rstrip(b"=").decode("ascii")


@dataclass
class _SignedRequest:
    signature: str
    path: str
    operation: str
    user: str
    expiration_raw: str | None

    def matches(self, token: str) -> bool:
        expiration = None
        if self.expiration_raw is not None:
            try:
                expiration = int(self.expiration_raw)
            except ValueError:
                return False
        expected = file_signature(self.path, self.operation, self.user, token, expiration)
        return same_secret(self.signature, expected)

    def problem(self, token: str) -> str | None:
        """E2B's 401 message, or None when the signature is valid now."""
        if not self.matches(token):
            return "invalid signature"
        if self.expiration_raw is not None and int(self.expiration_raw) < time.time():
            return "signature is already expired"
        return None


def _signed_request(scope: Scope) -> _SignedRequest | None:
    """The file signature of a `GET/POST /files` without an access token, if it has one."""
    operation = {"GET": "read", "POST": "write"}.get(scope.get("method", ""))
    if operation is None or scope.get("path") != FILES_PATH or _header(scope, b"x-access-token"):
        return None
    query = parse_qs(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)
    signature = (query.get("signature") or [""])[0]
    if not signature:
        return None
    expiration = query.get("signature_expiration")
    return _SignedRequest(
        signature=signature,
        path=(query.get("path") or [""])[0],
        operation=operation,
        user=(query.get("username") or [""])[0],
        expiration_raw=expiration[0] if expiration and expiration[0] else None,
    )


#: A signed file URL is served on the API's own origin (E2B_SANDBOX_URL is the node's or the
#: gateway's address), the web console's: a file of the sandbox (an .html envd calls text/html)
#: opened there must be no document of that origin, or its script reads the key the console
#: keeps in the tab's sessionStorage, or registers a service worker over the whole origin.
#: `sandbox` gives it an opaque origin and no script; the bytes are unchanged.
INERT_HEADERS = [(b"content-security-policy", b"sandbox"),
                 (b"x-content-type-options", b"nosniff")]


def _inert(send: Send) -> Send:
    """`send` with INERT_HEADERS added to the response's head."""
    async def inert(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            message = {**message, "headers": [*message.get("headers", []), *INERT_HEADERS]}
        await send(message)
    return inert


def _not_found(sandbox_id: str) -> dict[str, Any]:
    return {"sandboxId": sandbox_id, "message": "The sandbox was not found", "code": 502}


class SandboxProxy:
    def __init__(
        self,
        orchestrator: Orchestrator,
        api_key: str,
        metrics: NodeMetrics,
        limits: ProxyLimits | None = None,
    ) -> None:
        self.orchestrator = orchestrator
        #: the backend's optional capabilities, resolved once at assembly (node/server.py)
        self.capabilities = orchestrator.capabilities
        self.api_key = api_key
        self.metrics = metrics
        self.limits = limits or ProxyLimits.from_env()
        downloads = metrics.proxy_bytes.labels("download")
        uploads = metrics.proxy_bytes.labels("upload")

        def count(direction: str, nbytes: int) -> None:
            (downloads if direction == "download" else uploads).inc(nbytes)

        def aborted(scope: Scope) -> None:
            metrics.requests.labels("proxy", scope["method"], "aborted").inc()

        self.relay = Relay(
            self.limits, self._answer_gone, self._port_not_open, count, aborted
        )
        self._exchanges: dict[str, set[Exchange]] = {}
        orchestrator.on_leave_running(self._sandbox_left)

    @property
    def client(self) -> httpx.AsyncClient:
        return self.relay.client

    async def close(self) -> None:
        await self.relay.close()

    # --- routing and admission -----------------------------------------------------------------

    def route(self, scope: Scope) -> ProxyRoute | None:
        """The sandbox route of this request, or None when it is for the control plane."""
        found = route_of(scope)
        if found is not None:
            return found
        signed = _signed_request(scope)
        if signed is None:
            return None
        # A signed URL on a shared E2B_SANDBOX_URL names no sandbox: the envd token that made
        # the signature does. Only tokens of this node's sandboxes can match.
        for rec in self.orchestrator.all_sandboxes():
            if rec.envd_access_token and signed.matches(rec.envd_access_token):
                return ProxyRoute(rec.sandbox_id, ENVD_PORT, by_signature=True)
        return ProxyRoute("", ENVD_PORT, "invalid signature")

    def signature_owner(self, method: str, query: str) -> str | None:
        """The sandbox of this node whose envd token made the file signature of a
        `{method} /files?{query}`, or None. The gateway asks its nodes this (a signed URL on the
        gateway's E2B_SANDBOX_URL names no sandbox); the expiry is checked when the request
        itself comes (_refusal)."""
        found = self.route({"type": "http", "method": method, "path": FILES_PATH,
                            "query_string": query.encode("latin-1"), "headers": []})
        return found.sandbox_id if found is not None and found.by_signature else None

    def _sandbox_left(self, sandbox_id: str, why: str) -> None:
        exchanges = self._exchanges.get(sandbox_id, ())
        if exchanges:
            log.info(
                "closing proxied streams",
                extra={"sandbox_id": sandbox_id, "reason": why, "count": len(exchanges)},
            )
        for exchange in exchanges:
            exchange.gone.set()

    def connections(self, sandbox_id: str) -> int:
        return len(self._exchanges.get(sandbox_id, ()))

    def websockets(self, sandbox_id: str) -> int:
        return sum(exchange.websocket for exchange in self._exchanges.get(sandbox_id, ()))

    @contextlib.contextmanager
    def _registered(self, sandbox_id: str, websocket: bool = False) -> Any:
        exchange = SandboxExchange(sandbox_id, websocket=websocket)
        self._exchanges.setdefault(sandbox_id, set()).add(exchange)
        # Busy from its first byte to its last (a command stream, a WebSocket): no idle pause
        # can come between its admission and its relay.
        activity = self.orchestrator.activity
        activity.opened(sandbox_id)
        try:
            yield exchange
        finally:
            activity.closed(sandbox_id, active=exchange.admitted)
            held = self._exchanges.get(sandbox_id)
            if held is not None:
                held.discard(exchange)
                if not held:
                    del self._exchanges[sandbox_id]

    def _refusal(
        self, scope: Scope, route: ProxyRoute, rec: SandboxRecord | None
    ) -> tuple[int, dict[str, Any]] | None:
        """(status, body) when the request may not go to the sandbox; checked before any
        resume, so a refused request never wakes a paused sandbox."""
        sandbox_id, port = route.sandbox_id, route.port
        if route.problem is not None:
            status = 401 if route.problem == "invalid signature" else 400
            return status, {"code": status, "message": route.problem}
        problem = target_problem(request_target(scope))
        if problem is not None:
            return 400, {"code": 400, "message": problem}
        if rec is None or rec.state == State.KILLING or rec.team != scope_team(scope):
            return 502, _not_found(sandbox_id)  # another team's sandbox is not found either
        if port == ENVD_PORT and scope["path"].rstrip("/") == "/init":
            # envd takes its token and env vars from /init; only the node may call it
            return 403, {"code": 403, "message": "/init is reserved to the node"}
        if port != ENVD_PORT and rec.traffic_access_token:
            given = _header(scope, b"e2b-traffic-access-token")
            if len(given) != 1 or not same_secret(
                given[0].decode("latin-1"), rec.traffic_access_token
            ):
                return 403, {"code": 403, "message": "missing or invalid traffic access token"}
        signed = _signed_request(scope) if port == ENVD_PORT else None
        if signed is not None and rec.envd_access_token:
            message = signed.problem(rec.envd_access_token)
            if message is not None:
                return 401, {"code": 401, "message": message}
        # envd checks the token itself, but a request it would refuse must neither hold one
        # of the sandbox's proxied connections (a stranger who knew the id filled them with
        # bodies that never end) nor resume it. Only a body-less /health goes without.
        if port == ENVD_PORT and rec.envd_access_token and signed is None \
                and not _envd_token_given(scope, rec):
            if rec.state != State.RUNNING and rec.resumes_on_traffic:
                return 401, {
                    "code": 401,
                    "message": f"sandbox {sandbox_id} is paused: traffic resumes it only "
                    "with its access token (X-Access-Token) or a signed file URL",
                }
            if rec.secure and (scope["path"].rstrip("/") != "/health" or request_has_body(scope)):
                return 401, {"code": 401, "message": "missing or invalid X-Access-Token "
                             "(envd of a secure sandbox)"}
        # The same for a cell on the code-interpreter server, which checks it too: refused
        # here, a stranger's run_code neither holds a proxied connection nor resumes the sandbox.
        if port == CODE_INTERPRETER_PORT and rec.secure and rec.envd_access_token \
                and (scope["method"], scope["path"].rstrip("/")) in CODE_RUN_ROUTES \
                and not _access_token_given(scope, rec):
            return 401, {"code": 401, "message": "missing or invalid X-Access-Token "
                         "(the code interpreter of a secure sandbox)"}
        if self.connections(sandbox_id) > self.limits.max_connections:
            EVENTS.log(sandbox_id, "connection_limit", logging.WARNING,
                       "proxy connection limit", {"sandbox_id": sandbox_id})
            return 429, {
                "code": 429,
                "message": f"sandbox {sandbox_id} has {self.limits.max_connections} proxied "
                "connections open already, the node's limit (AENV_PROXY_MAX_CONNECTIONS)",
            }
        if scope["type"] == "websocket" and self.websockets(sandbox_id) > self.limits.max_websockets:
            EVENTS.log(sandbox_id, "connection_limit", logging.WARNING,
                       "proxy connection limit", {"sandbox_id": sandbox_id})
            return 429, {
                "code": 429,
                "message": f"sandbox {sandbox_id} has {self.limits.max_websockets} proxied "
                "WebSockets open already, the node's limit (AENV_PROXY_MAX_WEBSOCKETS)",
            }
        return None

    async def _admit(
        self, scope: Scope, route: ProxyRoute, exchange: SandboxExchange
    ) -> tuple[httpx.URL | None, int, dict[str, Any]]:
        """(upstream URL, 0, {}) when the request may go through, else (None, status, body)."""
        rec = self.orchestrator.sandbox(route.sandbox_id)
        refused = self._refusal(scope, route, rec)
        if refused is not None:
            return None, *refused
        try:
            placement = await self.orchestrator.running_placement(route.sandbox_id)
        except ApiError as exc:  # its resume cannot be taken on now (429, 503)
            return None, exc.status, {"sandboxId": route.sandbox_id, "code": exc.status,
                                      "message": exc.message}
        if placement is None:
            return None, 502, _not_found(route.sandbox_id)
        host_ports = self.capabilities.host_ports
        if host_ports is not None:
            problem = await asyncio.to_thread(host_ports.port_problem, route.sandbox_id,
                                              placement, route.port)
            if problem is not None:
                EVENTS.log(route.sandbox_id, "port_refused", logging.WARNING,
                           "proxy port refused", {"sandbox_id": route.sandbox_id,
                                                  "port": route.port, "reason": problem})
                return None, 502, {"sandboxId": route.sandbox_id, "code": 502,
                                   "message": f"The sandbox is running but port is not open "
                                   f"({problem})"}
        exchange.gone.clear()  # running now: only a departure from here on ends the exchange
        # a secure sandbox's token-less /health (let through: _refusal), or the code
        # interpreter's token-less /health and context calls, are anyone's, not the sandbox's
        # activity: a stranger polling them would keep it from ever idling out
        exchange.admitted = not (rec is not None and rec.secure and (
            (route.port == ENVD_PORT and not _envd_token_given(scope, rec))
            or (route.port == CODE_INTERPRETER_PORT and not _access_token_given(scope, rec))))
        host, port = placement.address(route.port)
        url = httpx.URL(scheme="http", host=host, port=port, raw_path=request_target(scope))
        return url, 0, {}

    # --- HTTP --------------------------------------------------------------------------------

    async def __call__(self, scope: Scope, receive: Any, send: Any, route: ProxyRoute) -> int:
        """Relay one HTTP request; returns the status sent (raises StreamAborted when a
        response under way was cut)."""
        with self._registered(route.sandbox_id) as exchange:
            url, status, body = await self._admit(scope, route, exchange)
            if url is None:
                await send_json(send, status, body)
                return status
            return await self._relay(scope, receive, send, url, exchange)

    def _upstream_headers(self, scope: Scope) -> list[tuple[bytes, bytes]]:
        api_key = self.api_key

        def keep(name: bytes, value: bytes) -> bool:
            # the node's key is not the sandbox's business
            return name != b"x-api-key" or not same_secret(value.decode("latin-1"), api_key)

        return forward_headers(scope, _ROUTING, keep)

    async def _relay(
        self, scope: Scope, receive: Any, send: Any, url: httpx.URL, exchange: Exchange
    ) -> int:
        if _signed_request(scope) is not None:
            send = _inert(send)
        return await self.relay.http(
            scope, receive, send, url, self._upstream_headers(scope), exchange
        )

    @staticmethod
    async def _answer_gone(send: Send, exchange: Exchange) -> int:
        await send_json(send, 502, _not_found(exchange.name))
        return 502

    @staticmethod
    async def _port_not_open(send: Send, exchange: Exchange, exc: Exception) -> int:
        sandbox_id = exchange.name
        EVENTS.log(sandbox_id, "port_not_answering", logging.INFO,
                   "sandbox port not answering", {"sandbox_id": sandbox_id, "error": str(exc)})
        body = {
            "sandboxId": sandbox_id,
            "message": "The sandbox is running but port is not open",
            "code": 502,
        }
        await send_json(send, 502, body)
        return 502

    # --- WebSocket ---------------------------------------------------------------------------

    async def websocket(self, scope: Scope, receive: Any, send: Any, route: ProxyRoute) -> None:
        """Bridge a WebSocket to the sandbox port, message by message, until either side
        closes, the sandbox stops running or the total time limit is reached."""
        if (await receive())["type"] != "websocket.connect":
            return
        with self._registered(route.sandbox_id, websocket=True) as exchange:
            url, status, body = await self._admit(scope, route, exchange)
            if url is None:
                await refuse_websocket(send, status, body)
                return
            await self.relay.websocket(
                scope, receive, send, url, self._upstream_headers(scope), exchange
            )
