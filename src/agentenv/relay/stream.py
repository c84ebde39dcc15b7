"""The relay: one client exchange (ASGI) streamed to an upstream URL and back, no buffering.

Request bodies (chunked, gzip, large uploads) go up as they arrive; responses (Connect server
streams, large downloads) come back chunk by chunk. The caller decides where the exchange goes
(an origin-form target on a host it chose: the target is never read from the request) and which
request headers go along (`forward_headers`). An `Exchange` carries what the caller may change
while the relay runs: `gone` ends it at once (the sandbox stopped, the node went down).

Limits (`RelayLimits`, AENV_PROXY_* variables): request body size, idle time either way, total
time of one exchange, size of one WebSocket message either way (messages are relayed by
fragments of a small window both ways, relay/websocket.py, and one over the limit is refused
with close code 1009, never gathered); a streaming response that must end early is cut
(`StreamAborted`), an exchange that has not answered yet gets a JSON error (`answer_gone` for
the gone case).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar

import httpx
from websockets.frames import CloseCode

from agentenv.errors import AgentEnvError
from agentenv.logs import PerKeyLimit
from agentenv.relay.answers import Send, send_json
from agentenv.relay.server import StreamAborted, request_has_body
from agentenv.relay.websocket import (
    FRAGMENTS,
    RECEIVED_FRAGMENT,
    Closed,
    FrameViolation,
    Piece,
    UpstreamRefused,
    UpstreamWebSocket,
    wire_close_code,
)
from agentenv.settings import setting_text

log = logging.getLogger("agentenv.relay")
#: what a client or a sandbox's server causes at will, logged per sandbox within limits
EVENTS = PerKeyLimit(log)

Scope = dict[str, Any]

#: RFC 9110 7.6.1: hop-by-hop fields, plus the ones a `Connection` header names
#: who the client is and how it came, as the client tells it: replaced by the relay's own
CLIENT_CLAIMS = frozenset({b"x-forwarded-for", b"x-forwarded-host", b"x-forwarded-proto",
                           b"forwarded", b"x-real-ip"})
HOP_BY_HOP = frozenset(
    {
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
)
#: seconds an upstream WebSocket gets to answer its opening handshake
WS_OPEN_TIMEOUT = 10.0
#: handshake headers the upstream WebSocket client makes itself
WS_HANDSHAKE = frozenset(
    {
        b"sec-websocket-key",
        b"sec-websocket-version",
        b"sec-websocket-extensions",
        b"sec-websocket-protocol",
        b"sec-websocket-accept",
    }
)


@dataclass(frozen=True)
class RelayLimits:
    """What one client may hold; every figure can be set by its AENV_PROXY_* variable."""

    #: request line plus headers (HTTP protocol, every request of the server)
    max_head_bytes: int = 64 << 10
    #: seconds to receive a request head (slowloris)
    head_timeout: float = 30.0
    #: request body of one relayed request (large uploads go through)
    max_body_bytes: int = 16 << 30
    #: seconds without a byte in either direction of one exchange; Connect streams get a
    #: keepalive at least every 50 s (the SDK's Keepalive-Ping-Interval), so they stay open
    idle_timeout: float = 600.0
    #: seconds one exchange may last at all (0: no limit)
    total_timeout: float = 24 * 3600.0
    #: concurrent relayed requests and WebSockets per sandbox
    max_connections: int = 512
    #: concurrent WebSockets per sandbox (each holds a window of its bytes, relay/websocket.py)
    max_websockets: int = 128
    connect_timeout: float = 5.0
    #: bytes of one WebSocket message, either way (the client's side: uvicorn's ws_max_size)
    max_ws_message_bytes: int = 16 << 20

    ENV: ClassVar[dict[str, str]] = {
        "max_head_bytes": "AENV_PROXY_MAX_HEAD_BYTES",
        "head_timeout": "AENV_PROXY_HEAD_TIMEOUT",
        "max_body_bytes": "AENV_PROXY_MAX_BODY_BYTES",
        "idle_timeout": "AENV_PROXY_IDLE_TIMEOUT",
        "total_timeout": "AENV_PROXY_TOTAL_TIMEOUT",
        "max_connections": "AENV_PROXY_MAX_CONNECTIONS",
        "max_websockets": "AENV_PROXY_MAX_WEBSOCKETS",
        "connect_timeout": "AENV_PROXY_CONNECT_TIMEOUT",
        "max_ws_message_bytes": "AENV_PROXY_MAX_WS_MESSAGE_BYTES",
    }

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> RelayLimits:
        values: dict[str, Any] = {}
        for name, var in cls.ENV.items():
            raw = setting_text(var, env)
            if not raw:
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


@dataclass(eq=False)
class Exchange:
    """One relayed exchange, as its owner sees it."""

    #: the sandbox (or other upstream) this exchange talks to, for logs
    name: str
    websocket: bool = False
    #: set when the upstream goes away while this exchange talks to it
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


def header_values(scope: Scope, name: bytes) -> list[bytes]:
    return [v for n, v in scope["headers"] if n == name]


def forward_headers(
    scope: Scope,
    drop: frozenset[bytes] | set[bytes],
    keep: Callable[[bytes, bytes], bool] | None = None,
) -> list[tuple[bytes, bytes]]:
    """The request's headers without hop-by-hop ones, those named by `Connection`, `drop`, and
    those `keep(name, value)` refuses; plus X-Forwarded-For/-Host/-Proto of this server's own
    (the client's address as relay/server.py determined it): never what the client claims."""
    connection_named = set()
    for name, value in scope["headers"]:
        if name == b"connection":
            connection_named.update(v.strip().lower() for v in value.split(b","))
    out = []
    for name, value in scope["headers"]:
        if (name in HOP_BY_HOP or name in drop or name in connection_named
                or name in CLIENT_CLAIMS):
            continue
        if keep is not None and not keep(name, value):
            continue
        out.append((name, value))
    client = scope.get("client")
    if client:
        out.append((b"x-forwarded-for", str(client[0]).encode("latin-1")))
    hosts = header_values(scope, b"host")
    out.append((b"x-forwarded-host", hosts[0] if hosts else b""))
    out.append((b"x-forwarded-proto", scope.get("scheme", "http").encode()))
    return out


async def refuse_websocket(send: Send, status: int, body: dict[str, Any]) -> None:
    """Answer a WebSocket request with an HTTP status and a JSON body instead of the upgrade
    (ASGI's websocket.http.response), so the client learns why."""
    payload = json.dumps(body).encode()
    await send({"type": "websocket.http.response.start", "status": status, "headers": [
        (b"content-type", b"application/json; charset=utf-8")]})
    await send({"type": "websocket.http.response.body", "body": payload})


class Relay:
    """Streams exchanges to upstream URLs; one per server (it holds the connection pool).

    `answer_gone(send, exchange)` answers an exchange whose upstream went away before any
    response byte; `answer_unreachable(send, exchange, exc)` one whose upstream did not accept
    the request; `count(direction, nbytes)` sees every body chunk ("upload"/"download")."""

    def __init__(
        self,
        limits: RelayLimits,
        answer_gone: Callable[[Send, Exchange], Awaitable[int]],
        answer_unreachable: Callable[[Send, Exchange, Exception], Awaitable[int]],
        count: Callable[[str, int], None] | None = None,
        on_aborted: Callable[[Scope], None] | None = None,
        limit_name: str = "the node's",
        tls: ssl.SSLContext | None = None,
    ) -> None:
        """`tls`: what an https:// or wss:// upstream is verified with (relay/tls.py)."""
        self.limits = limits
        self.tls = tls
        self._answer_gone = answer_gone
        self._answer_unreachable = answer_unreachable
        self._count = count or (lambda direction, n: None)
        self._on_aborted = on_aborted or (lambda scope: None)
        self._whose = limit_name
        # No read/write timeouts here: the exchange's guard (_guard) enforces the idle limit
        # from a timestamp, cheaper than a cancel scope around every read of a large download.
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=limits.connect_timeout),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=200),
            trust_env=False,
            follow_redirects=False,
            verify=tls if tls is not None else True,
        )

    async def close(self) -> None:
        await self.client.aclose()

    def body_limit_body(self) -> dict[str, Any]:
        message = (
            f"request body over {self._whose} limit of {self.limits.max_body_bytes} bytes "
            "(AENV_PROXY_MAX_BODY_BYTES)"
        )
        return {"code": 413, "message": message}

    # --- HTTP --------------------------------------------------------------------------------

    async def http(
        self,
        scope: Scope,
        receive: Any,
        send: Send,
        url: httpx.URL,
        headers: list[tuple[bytes, bytes]],
        exchange: Exchange,
    ) -> int:
        """Relay one HTTP request to `url` with `headers`; returns the status sent (raises
        StreamAborted when a response under way was cut)."""
        name = exchange.name
        limits = self.limits
        lengths = header_values(scope, b"content-length")
        has_body = request_has_body(scope)
        if header_values(scope, b"transfer-encoding"):
            # RFC 9112 6.3: Transfer-Encoding wins, a proxy must drop Content-Length
            headers = [(n, v) for n, v in headers if n != b"content-length"]
            lengths = []
        if lengths and lengths[0].strip().isdigit() and int(lengths[0]) > limits.max_body_bytes:
            await send_json(send, 413, self.body_limit_body())
            return 413
        body_done = asyncio.Event()
        count = self._count
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
                        raise _ClientError(413, self.body_limit_body()["message"])
                    count("upload", len(chunk))
                    yield chunk
                if not message.get("more_body", False):
                    break
            body_done.set()

        if not has_body:
            body_done.set()
        request = self.client.build_request(
            scope["method"], url, headers=headers, content=request_body() if has_body else None
        )
        # httpx adds its own defaults; the upstream must see only what the client sent
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
                return 499  # the client went away: stop reading the upstream's stream
            if guard in done and guard.result() == "gone":
                if not exchange.started:
                    return await self._answer_gone(send, exchange)
                self._on_aborted(scope)
                raise StreamAborted(f"{name} went away")
            if guard in done:
                EVENTS.log(name, "idle_limit", logging.INFO, "relay idle time limit",
                           {"sandbox_id": name})
                if exchange.started:
                    raise StreamAborted(f"exchange with {name} idle {limits.idle_timeout:g} s")
                if not body_done.is_set():
                    message = f"request body idle for {limits.idle_timeout:g} s"
                    await send_json(send, 408, {"code": 408, "message": message})
                    return 408
                message = (
                    f"sandbox {name} did not answer within {limits.idle_timeout:g} s "
                    "(AENV_PROXY_IDLE_TIMEOUT)"
                )
                await send_json(send, 504, {"code": 504, "message": message})
                return 504
            EVENTS.log(name, "total_limit", logging.INFO, "relay total time limit",
                       {"sandbox_id": name})
            if not exchange.started:
                message = (
                    f"the exchange with sandbox {name} went over {self._whose} limit of "
                    f"{limits.total_timeout:g} s (AENV_PROXY_TOTAL_TIMEOUT)"
                )
                await send_json(send, 504, {"code": 504, "message": message})
                return 504
            raise StreamAborted(f"exchange with {name} over {limits.total_timeout:g} s")
        finally:
            for task in tasks:
                task.cancel()
            for task in (watcher, guard):
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    async def _guard(self, exchange: Exchange) -> str:
        """Returns "gone" when the upstream goes away, "idle" when no byte moved either way
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

    @staticmethod
    async def _watch_disconnect(receive: Any, body_done: asyncio.Event) -> None:
        await body_done.wait()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return

    async def _exchange(self, request: httpx.Request, send: Send, exchange: Exchange) -> int:
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
            return await self._answer_unreachable(send, exchange, exc)
        count = self._count
        try:
            connection_named = set()
            for value in response.headers.get_list("connection"):
                connection_named.update(v.strip().lower() for v in value.encode().split(b","))
            out_headers = [
                (name, value)
                for name, value in response.headers.raw
                if name.lower() not in HOP_BY_HOP and name.lower() not in connection_named
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
                    count("download", len(chunk))
                    await send({"type": "http.response.body", "body": chunk, "more_body": True})
            except httpx.HTTPError as exc:
                # the upstream's side ended early (idle limit, connection reset): so does ours
                raise StreamAborted(f"upstream of {exchange.name} failed: {exc}") from exc
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return response.status_code
        finally:
            await response.aclose()

    # --- WebSocket ---------------------------------------------------------------------------

    async def websocket(
        self,
        scope: Scope,
        receive: Any,
        send: Send,
        url: httpx.URL,
        headers: list[tuple[bytes, bytes]],
        exchange: Exchange,
    ) -> None:
        """Bridge an accepted-for-relay WebSocket (its websocket.connect already received) to
        `url` until either side closes, the exchange is gone or the total time limit is
        reached: the messages of both by fragments, each side read only as fast as the other
        takes what was read (relay/websocket.py)."""
        extensions = scope.get("extensions", {})
        if FRAGMENTS not in extensions or RECEIVED_FRAGMENT not in extensions:
            raise RuntimeError("the server's WebSocket protocol must be "
                               "relay.websocket.FragmentingWebSocketProtocol")
        upstream_headers = [(n, v) for n, v in headers if n not in WS_HANDSHAKE]
        try:
            upstream = await UpstreamWebSocket.open(
                url, upstream_headers, scope.get("subprotocols") or (),
                self.limits.connect_timeout, WS_OPEN_TIMEOUT, self.tls)
        except UpstreamRefused as exc:
            EVENTS.log(exchange.name, "ws_refused", logging.INFO,
                       "websocket upstream refused",
                       {"sandbox_id": exchange.name, "error": str(exc)})
            await send({"type": "websocket.close", "code": 1011})
            return
        await send({"type": "websocket.accept", "subprotocol": upstream.subprotocol,
                    "fragments": True})
        to_upstream = asyncio.create_task(self._ws_client_to_upstream(receive, upstream))
        to_client = asyncio.create_task(self._ws_upstream_to_client(upstream, send, exchange))
        gone = asyncio.create_task(exchange.gone.wait())
        try:
            done, _ = await asyncio.wait(
                {to_upstream, to_client, gone},
                timeout=self.limits.total_timeout or None,
                return_when=asyncio.FIRST_COMPLETED,
            )
            if to_upstream not in done and to_client not in done:
                # 1001 "going away": the upstream went away, or the time limit
                with contextlib.suppress(Exception):
                    await send({"type": "websocket.close", "code": 1001})
        finally:
            for task in (to_upstream, to_client, gone):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
            await upstream.close(CloseCode.GOING_AWAY)

    @staticmethod
    async def _ws_client_to_upstream(receive: Any, upstream: UpstreamWebSocket) -> None:
        while True:
            message = await receive()
            if message["type"] == "websocket.disconnect":
                await upstream.close(wire_close_code(message.get("code")))
                return
            if message["type"] == RECEIVED_FRAGMENT:
                await upstream.send_piece(Piece(message["data"], message["text"],
                                                message["first"], message["fin"]))

    async def _ws_upstream_to_client(
        self, upstream: UpstreamWebSocket, send: Send, exchange: Exchange
    ) -> None:
        limit = self.limits.max_ws_message_bytes
        try:
            async for item in upstream.receive(limit):
                if isinstance(item, Closed):
                    await upstream.close(wire_close_code(item.code))
                    await send({"type": "websocket.close", "code": wire_close_code(item.code),
                                "reason": item.reason})
                    return
                await send({"type": FRAGMENTS, "data": item.data, "text": item.text,
                            "first": item.first, "fin": item.fin})
        except FrameViolation as exc:
            EVENTS.log(exchange.name, "ws_violation", logging.INFO,
                       "websocket upstream broke the protocol or a limit",
                       {"sandbox_id": exchange.name, "error": exc.reason, "limit": limit})
            await upstream.close(exc.code, exc.reason)
            reason = (f"a message from {exchange.name} is over {limit} bytes"
                      if exc.code == CloseCode.MESSAGE_TOO_BIG
                      else f"{exchange.name} broke the WebSocket protocol: {exc.reason}")
            await send({"type": "websocket.close", "code": exc.code, "reason": reason[:120]})
            return
        except (asyncio.IncompleteReadError, OSError):
            pass
        # the upstream's connection ended without a close frame
        await send({"type": "websocket.close", "code": CloseCode.INTERNAL_ERROR,
                    "reason": f"{exchange.name} ended the connection without closing"[:120]})
