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

Limits (`ProxyLimits`, AENV_PROXY_* variables): request head size and time (node/http_server.py),
request body size, idle time either way, total time of one exchange, concurrent exchanges per
sandbox. A paused sandbox with autoResume is resumed by traffic only when the request carries
what the running sandbox would ask for: the traffic token on a non-public sandbox's ports, the
envd access token (or a valid file signature) on the envd port of a secure sandbox.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import json
import logging
import os
import re
import time
from base64 import b64encode
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar
from urllib.parse import parse_qs

import httpx
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI

from agentenv.errors import AgentEnvError
from agentenv.node.backend import ENVD_PORT
from agentenv.node.http_server import StreamAborted, request_target, target_problem
from agentenv.node.metrics import NodeMetrics
from agentenv.node.orchestrator import Orchestrator
from agentenv.node.records import SandboxRecord, State
from agentenv.node.security import same_secret

log = logging.getLogger("agentenv.node.proxy")

Scope = dict[str, Any]

_HOST_ROUTE = re.compile(r"^(\d{1,5})-([a-z0-9]{1,63})\.[^:]+(:\d+)?$")
_PORT = re.compile(r"^\d{1,5}$")
#: RFC 9110 7.6.1: hop-by-hop fields, plus the ones a `Connection` header names
_HOP_BY_HOP = {
    b"connection",
    b"keep-alive",
    b"proxy-authenticate",
    b"proxy-authorization",
    b"proxy-connection",
    b"te",
    b"trailer",
    b"transfer-encoding",
    b"upgrade",
}
#: routing headers are the node's business; `expect: 100-continue` was answered by the node's
#: HTTP server already, and the upstream client does not wait for a second 100.
_ROUTING = {
    b"e2b-sandbox-id",
    b"e2b-sandbox-port",
    b"e2b-traffic-access-token",
    b"host",
    b"expect",
}
#: handshake headers the upstream WebSocket client makes itself
_WS_HANDSHAKE = {
    b"sec-websocket-key",
    b"sec-websocket-version",
    b"sec-websocket-extensions",
    b"sec-websocket-protocol",
    b"sec-websocket-accept",
}
FILES_PATH = "/files"


@dataclass(frozen=True)
class ProxyLimits:
    """What one client may hold; every figure can be set by its AENV_PROXY_* variable."""

    #: request line plus headers (HTTP protocol, every request of the node)
    max_head_bytes: int = 64 << 10
    #: seconds to receive a request head (slowloris)
    head_timeout: float = 30.0
    #: request body of one proxied request (large uploads go through)
    max_body_bytes: int = 16 << 30
    #: seconds without a byte in either direction of one exchange; Connect streams get a
    #: keepalive at least every 50 s (the SDK's Keepalive-Ping-Interval), so they stay open
    idle_timeout: float = 600.0
    #: seconds one exchange may last at all (0: no limit)
    total_timeout: float = 24 * 3600.0
    #: concurrent proxied requests and WebSockets per sandbox
    max_connections: int = 512
    connect_timeout: float = 5.0

    ENV: ClassVar[dict[str, str]] = {
        "max_head_bytes": "AENV_PROXY_MAX_HEAD_BYTES",
        "head_timeout": "AENV_PROXY_HEAD_TIMEOUT",
        "max_body_bytes": "AENV_PROXY_MAX_BODY_BYTES",
        "idle_timeout": "AENV_PROXY_IDLE_TIMEOUT",
        "total_timeout": "AENV_PROXY_TOTAL_TIMEOUT",
        "max_connections": "AENV_PROXY_MAX_CONNECTIONS",
        "connect_timeout": "AENV_PROXY_CONNECT_TIMEOUT",
    }

    @classmethod
    def from_env(cls, env: Mapping[str, str] = os.environ) -> ProxyLimits:
        values: dict[str, Any] = {}
        for name, var in cls.ENV.items():
            raw = env.get(var)
            if raw is None or raw == "":
                continue
            kind = type(getattr(cls, name))
            try:
                value = kind(raw)
            except ValueError:
                raise AgentEnvError(f"{var}={raw!r} is not a number") from None
            if value < 0 or (value == 0 and name not in ("total_timeout", "head_timeout")):
                raise AgentEnvError(f"{var}={raw!r} must be positive")
            values[name] = value
        return cls(**values)


@dataclass
class ProxyRoute:
    """Which sandbox and port a request is for; `problem` when the routing headers are bad."""

    sandbox_id: str
    port: int
    problem: str | None = None
    #: found by its file signature (no id or host named the sandbox)
    by_signature: bool = False


@dataclass(eq=False)
class _Exchange:
    sandbox_id: str
    #: set when the sandbox stops running while this exchange talks to it
    gone: asyncio.Event = field(default_factory=asyncio.Event)
    started: bool = False
    #: loop time of the last byte moved either way (the idle limit counts from it)
    progress: float = 0.0


class _ClientGone(Exception):
    pass


class _ClientError(Exception):
    """The client broke a limit while sending its body: answer `status` if nothing was sent."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


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


def _not_found(sandbox_id: str) -> dict[str, Any]:
    return {"sandboxId": sandbox_id, "message": "The sandbox was not found", "code": 502}


async def send_json(send: Any, status: int, body: dict[str, Any]) -> None:
    payload = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json; charset=utf-8"),
                (b"content-length", str(len(payload)).encode()),
            ],
        }
    )
    await send({"type": "http.response.body", "body": payload})


class SandboxProxy:
    def __init__(
        self,
        orchestrator: Orchestrator,
        api_key: str,
        metrics: NodeMetrics,
        limits: ProxyLimits | None = None,
    ) -> None:
        self.orchestrator = orchestrator
        self.api_key = api_key
        self.metrics = metrics
        self.limits = limits or ProxyLimits.from_env()
        # No read/write timeouts here: the exchange's guard (_guard) enforces the idle limit
        # from a timestamp, cheaper than a cancel scope around every read of a large download.
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=self.limits.connect_timeout),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=200),
            trust_env=False,
            follow_redirects=False,
        )
        self._exchanges: dict[str, set[_Exchange]] = {}
        orchestrator.on_leave_running(self._sandbox_left)

    async def close(self) -> None:
        await self.client.aclose()

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
        for rec in list(self.orchestrator.sandboxes.values()):
            if rec.envd_access_token and signed.matches(rec.envd_access_token):
                return ProxyRoute(rec.sandbox_id, ENVD_PORT, by_signature=True)
        return ProxyRoute("", ENVD_PORT, "invalid signature")

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

    @contextlib.contextmanager
    def _registered(self, sandbox_id: str) -> Any:
        exchange = _Exchange(sandbox_id)
        self._exchanges.setdefault(sandbox_id, set()).add(exchange)
        try:
            yield exchange
        finally:
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
        if rec is None or rec.state == State.KILLING:
            return 502, _not_found(sandbox_id)
        if port == ENVD_PORT and scope["path"] == "/init":
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
        if (
            rec.state != State.RUNNING
            and rec.auto_resume
            and port == ENVD_PORT
            and rec.envd_access_token
            and signed is None
        ):
            tokens = _header(scope, b"x-access-token")
            if len(tokens) != 1 or not same_secret(
                tokens[0].decode("latin-1"), rec.envd_access_token
            ):
                return 401, {
                    "code": 401,
                    "message": f"sandbox {sandbox_id} is paused: traffic resumes it only with its "
                    "access token (X-Access-Token) or a signed file URL",
                }
        if self.connections(sandbox_id) > self.limits.max_connections:
            return 429, {
                "code": 429,
                "message": f"sandbox {sandbox_id} has {self.limits.max_connections} proxied "
                "connections open already, the node's limit (AENV_PROXY_MAX_CONNECTIONS)",
            }
        return None

    async def _admit(
        self, scope: Scope, route: ProxyRoute, exchange: _Exchange
    ) -> tuple[httpx.URL | None, int, dict[str, Any]]:
        """(upstream URL, 0, {}) when the request may go through, else (None, status, body)."""
        rec = self.orchestrator.sandboxes.get(route.sandbox_id)
        refused = self._refusal(scope, route, rec)
        if refused is not None:
            return None, *refused
        placement = await self.orchestrator.running_placement(route.sandbox_id)
        if placement is None:
            return None, 502, _not_found(route.sandbox_id)
        exchange.gone.clear()  # running now: only a departure from here on ends the exchange
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
                if status == 429:
                    log.warning("proxy connection limit", extra={"sandbox_id": route.sandbox_id})
                await send_json(send, status, body)
                return status
            return await self._relay(scope, receive, send, url, exchange)

    def _upstream_headers(self, scope: Scope) -> list[tuple[bytes, bytes]]:
        connection_named = set()
        for name, value in scope["headers"]:
            if name == b"connection":
                connection_named.update(v.strip().lower() for v in value.split(b","))
        out = []
        for name, value in scope["headers"]:
            if name in _HOP_BY_HOP or name in _ROUTING or name in connection_named:
                continue
            if name == b"x-api-key" and same_secret(value.decode("latin-1"), self.api_key):
                continue  # the node's key is not the sandbox's business
            out.append((name, value))
        hosts = _header(scope, b"host")
        out.append((b"x-forwarded-host", hosts[0] if hosts else b""))
        out.append((b"x-forwarded-proto", scope.get("scheme", "http").encode()))
        return out

    async def _relay(
        self, scope: Scope, receive: Any, send: Any, url: httpx.URL, exchange: _Exchange
    ) -> int:
        sandbox_id = exchange.sandbox_id
        limits = self.limits
        headers = self._upstream_headers(scope)
        lengths = _header(scope, b"content-length")
        if _header(scope, b"transfer-encoding"):
            # RFC 9112 6.3: Transfer-Encoding wins, a proxy must drop Content-Length
            headers = [(n, v) for n, v in headers if n != b"content-length"]
            lengths = []
            has_body = True
        else:
            has_body = bool(lengths)
        if lengths and lengths[0].strip() == b"0":
            has_body = False
        if lengths and lengths[0].strip().isdigit() and int(lengths[0]) > limits.max_body_bytes:
            await send_json(send, 413, self._body_limit_body())
            return 413
        body_done = asyncio.Event()
        upload = self.metrics.proxy_bytes.labels("upload")
        loop = asyncio.get_running_loop()
        exchange.progress = loop.time()

        async def request_body() -> AsyncIterator[bytes]:
            size = 0
            while True:
                message = await receive()
                exchange.progress = loop.time()
                if message["type"] == "http.disconnect":
                    raise _ClientGone
                chunk = message.get("body", b"")
                if chunk:
                    size += len(chunk)
                    if size > limits.max_body_bytes:
                        raise _ClientError(413, self._body_limit_body()["message"])
                    upload.inc(len(chunk))
                    yield chunk
                if not message.get("more_body", False):
                    break
            body_done.set()

        if not has_body:
            body_done.set()
        request = self.client.build_request(
            scope["method"], url, headers=headers, content=request_body() if has_body else None
        )
        # httpx adds its own defaults; the sandbox must see only what the client sent
        sent = {n for n, _ in scope["headers"]}
        for default in (b"accept", b"accept-encoding", b"user-agent"):
            if default not in sent:
                del request.headers[default.decode()]

        async def client_send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                exchange.started = True
            await send(message)
            exchange.progress = loop.time()

        relay = asyncio.create_task(self._exchange(request, client_send, exchange))
        watcher = asyncio.create_task(self._watch_disconnect(receive, body_done))
        guard = asyncio.create_task(self._guard(exchange))
        tasks = {relay, watcher, guard}
        try:
            done, _ = await asyncio.wait(
                tasks, timeout=limits.total_timeout or None, return_when=asyncio.FIRST_COMPLETED
            )
            if relay in done:
                return relay.result()
            relay.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await relay
            if watcher in done:
                return 499  # the client went away: stop reading the sandbox's stream
            if guard in done and guard.result() == "gone":
                if not exchange.started:
                    await send_json(send, 502, _not_found(sandbox_id))
                    return 502
                self.metrics.requests.labels("proxy", scope["method"], "aborted").inc()
                raise StreamAborted(f"sandbox {sandbox_id} stopped running")
            if guard in done:
                log.info("proxy idle time limit", extra={"sandbox_id": sandbox_id})
                if exchange.started:
                    raise StreamAborted(
                        f"exchange with {sandbox_id} idle {limits.idle_timeout:g} s"
                    )
                if not body_done.is_set():
                    message = f"request body idle for {limits.idle_timeout:g} s"
                    await send_json(send, 408, {"code": 408, "message": message})
                    return 408
                message = (
                    f"sandbox {sandbox_id} did not answer within {limits.idle_timeout:g} s "
                    "(AENV_PROXY_IDLE_TIMEOUT)"
                )
                await send_json(send, 504, {"code": 504, "message": message})
                return 504
            log.info("proxy total time limit", extra={"sandbox_id": sandbox_id})
            if not exchange.started:
                message = (
                    f"the exchange with sandbox {sandbox_id} went over the node's limit of "
                    f"{limits.total_timeout:g} s (AENV_PROXY_TOTAL_TIMEOUT)"
                )
                await send_json(send, 504, {"code": 504, "message": message})
                return 504
            raise StreamAborted(f"exchange with {sandbox_id} over {limits.total_timeout:g} s")
        finally:
            for task in tasks:
                task.cancel()
            for task in (watcher, guard):
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def _guard(self, exchange: _Exchange) -> str:
        """Returns "gone" when the sandbox stops running, "idle" when no byte moved either way
        for the idle limit."""
        loop = asyncio.get_running_loop()
        idle = self.limits.idle_timeout
        while True:
            remaining = exchange.progress + idle - loop.time()
            if remaining <= 0:
                return "idle"
            try:
                async with asyncio.timeout(remaining):
                    await exchange.gone.wait()
                return "gone"
            except TimeoutError:
                continue

    def _body_limit_body(self) -> dict[str, Any]:
        message = (
            f"request body over the node's limit of {self.limits.max_body_bytes} bytes "
            "(AENV_PROXY_MAX_BODY_BYTES)"
        )
        return {"code": 413, "message": message}

    @staticmethod
    async def _watch_disconnect(receive: Any, body_done: asyncio.Event) -> None:
        await body_done.wait()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return

    async def _exchange(self, request: httpx.Request, send: Any, exchange: _Exchange) -> int:
        sandbox_id = exchange.sandbox_id
        try:
            response = await self.client.send(request, stream=True)
        except _ClientGone:
            return 499
        except _ClientError as exc:
            await send_json(send, exc.status, {"code": exc.status, "message": exc.message})
            return exc.status
        except httpx.LocalProtocolError as exc:
            message = f"the request cannot be relayed to the sandbox: {exc}"
            await send_json(send, 400, {"code": 400, "message": message})
            return 400
        except httpx.HTTPError as exc:
            return await self._port_not_open(send, sandbox_id, exc)
        download = self.metrics.proxy_bytes.labels("download")
        try:
            connection_named = set()
            for value in response.headers.get_list("connection"):
                connection_named.update(v.strip().lower() for v in value.encode().split(b","))
            out_headers = [
                (name, value)
                for name, value in response.headers.raw
                if name.lower() not in _HOP_BY_HOP and name.lower() not in connection_named
            ]
            await send(
                {
                    "type": "http.response.start",
                    "status": response.status_code,
                    "headers": out_headers,
                }
            )
            try:
                loop = asyncio.get_running_loop()
                async for chunk in response.aiter_raw():
                    exchange.progress = loop.time()
                    download.inc(len(chunk))
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except httpx.HTTPError as exc:
                # the sandbox's side ended early (idle limit, connection reset): so does ours
                raise StreamAborted(f"upstream of {sandbox_id} failed: {exc}") from exc
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return response.status_code
        finally:
            await response.aclose()

    @staticmethod
    async def _port_not_open(send: Any, sandbox_id: str, exc: Exception) -> int:
        log.info("sandbox port not answering", extra={"sandbox_id": sandbox_id, "error": str(exc)})
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
        with self._registered(route.sandbox_id) as exchange:
            url, status, _ = await self._admit(scope, route, exchange)
            if url is None:
                await send({"type": "websocket.close", "code": 1008 if status < 500 else 1011})
                return
            headers = [
                (n.decode("latin-1"), v.decode("latin-1"))
                for n, v in self._upstream_headers(scope)
                if n not in _WS_HANDSHAKE
            ]
            try:
                upstream = await connect(
                    str(url.copy_with(scheme="ws")),
                    additional_headers=headers,
                    subprotocols=scope.get("subprotocols") or None,
                    user_agent_header=None,
                    compression=None,
                    max_size=None,
                    ping_interval=None,
                    proxy=None,
                    open_timeout=10,
                )
            except (OSError, InvalidHandshake, InvalidURI, TimeoutError) as exc:
                log.info(
                    "websocket upstream refused",
                    extra={"sandbox_id": route.sandbox_id, "error": str(exc)},
                )
                await send({"type": "websocket.close", "code": 1011})
                return
            await send({"type": "websocket.accept", "subprotocol": upstream.subprotocol})
            to_sandbox = asyncio.create_task(self._ws_client_to_upstream(receive, upstream))
            to_client = asyncio.create_task(self._ws_upstream_to_client(upstream, send))
            gone = asyncio.create_task(exchange.gone.wait())
            try:
                done, _ = await asyncio.wait(
                    {to_sandbox, to_client, gone},
                    timeout=self.limits.total_timeout or None,
                    return_when=asyncio.FIRST_COMPLETED,
                )
                if to_sandbox not in done and to_client not in done:
                    # 1001 "going away": the sandbox stopped, or the time limit
                    with contextlib.suppress(Exception):
                        await send({"type": "websocket.close", "code": 1001})
            finally:
                for task in (to_sandbox, to_client, gone):
                    task.cancel()
                    with contextlib.suppress(asyncio.CancelledError, Exception):
                        await task
                await upstream.close()

    @staticmethod
    async def _ws_client_to_upstream(receive: Any, upstream: ClientConnection) -> None:
        while True:
            message = await receive()
            if message["type"] == "websocket.disconnect":
                await upstream.close(message.get("code") or 1000)
                return
            if message["type"] == "websocket.receive":
                data = message.get("bytes")
                await upstream.send(data if data is not None else message.get("text", ""))

    @staticmethod
    async def _ws_upstream_to_client(upstream: ClientConnection, send: Any) -> None:
        with contextlib.suppress(ConnectionClosed):
            async for message in upstream:
                key = "bytes" if isinstance(message, bytes) else "text"
                await send({"type": "websocket.send", key: message})
        await send(
            {
                "type": "websocket.close",
                "code": upstream.close_code or 1000,
                "reason": upstream.close_reason or "",
            }
        )
