"""The sandbox proxy: E2B SDK traffic for envd (and any other sandbox port) on the node's port.

A request is for a sandbox when it carries `E2b-Sandbox-Id` (port from `E2b-Sandbox-Port`,
default 49983) or when its Host is `{port}-{sandboxID}.{domain}`. Bodies stream both ways
without buffering: request chunks go upstream as they arrive, response chunks go back as they
arrive (Connect server streams, chunked and gzip uploads, large downloads). Answers the SDKs
rely on (spec/e2b-compat.md 2.3): a sandbox that is unknown, killed or paused without
autoResume gives 502 "The sandbox was not found"; a running sandbox whose port does not answer
gives 502 "The sandbox is running but port is not open".
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from collections.abc import AsyncIterator
from typing import Any

import httpx
from websockets.asyncio.client import ClientConnection, connect
from websockets.exceptions import ConnectionClosed, InvalidHandshake, InvalidURI

from agentenv.node.backend import ENVD_PORT
from agentenv.node.metrics import NodeMetrics
from agentenv.node.orchestrator import Orchestrator
from agentenv.node.security import same_secret

log = logging.getLogger("agentenv.node.proxy")

Scope = dict[str, Any]

_HOST_ROUTE = re.compile(r"^(\d{1,5})-([a-z0-9]{1,63})\.[^:]+(:\d+)?$")
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


class _ClientGone(Exception):
    pass


def route_of(scope: Scope) -> tuple[str, int] | None:
    """(sandbox id, port) if this request is for a sandbox, else None."""
    sandbox_id = port = host = None
    for name, value in scope["headers"]:
        if name == b"e2b-sandbox-id":
            sandbox_id = value.decode("latin-1").strip()
        elif name == b"e2b-sandbox-port":
            port = value.decode("latin-1").strip()
        elif name == b"host":
            host = value.decode("latin-1").strip().lower().rstrip(".")
    if sandbox_id:
        try:
            return sandbox_id, int(port) if port else ENVD_PORT
        except ValueError:
            return sandbox_id, -1
    if host:
        match = _HOST_ROUTE.match(host)
        if match:
            return match.group(2), int(match.group(1))
    return None


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
    def __init__(self, orchestrator: Orchestrator, api_key: str, metrics: NodeMetrics) -> None:
        self.orchestrator = orchestrator
        self.api_key = api_key
        self.metrics = metrics
        self.client = httpx.AsyncClient(
            timeout=httpx.Timeout(None, connect=5.0),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=200),
            trust_env=False,
            follow_redirects=False,
        )

    async def close(self) -> None:
        await self.client.aclose()

    async def _admit(
        self, scope: Scope, sandbox_id: str, port: int
    ) -> tuple[str | None, int, dict[str, Any]]:
        """(upstream base URL, 0, {}) when the request may go through, else (None, status, body)."""
        if not 0 < port < 65536:
            return None, 400, {"code": 400, "message": "invalid E2b-Sandbox-Port"}
        placement = await self.orchestrator.running_placement(sandbox_id)
        rec = self.orchestrator.sandboxes.get(sandbox_id)
        if placement is None or rec is None:
            return (
                None,
                502,
                {"sandboxId": sandbox_id, "message": "The sandbox was not found", "code": 502},
            )
        if port == ENVD_PORT and scope["path"] == "/init":
            # envd takes its token and env vars from /init; only the node may call it
            return None, 403, {"code": 403, "message": "/init is reserved to the node"}
        if port != ENVD_PORT and rec.traffic_access_token:
            headers = dict(scope["headers"])
            given = headers.get(b"e2b-traffic-access-token", b"").decode("latin-1")
            if not same_secret(given, rec.traffic_access_token):
                return (
                    None,
                    403,
                    {"code": 403, "message": "missing or invalid traffic access token"},
                )
        return placement.upstream(port), 0, {}

    async def __call__(
        self, scope: Scope, receive: Any, send: Any, sandbox_id: str, port: int
    ) -> int:
        """Relay one HTTP request; returns the status sent."""
        base, status, body = await self._admit(scope, sandbox_id, port)
        if base is None:
            await send_json(send, status, body)
            return status
        return await self._relay(scope, receive, send, base, sandbox_id)

    async def websocket(
        self, scope: Scope, receive: Any, send: Any, sandbox_id: str, port: int
    ) -> None:
        """Bridge a WebSocket to the sandbox port, message by message, until either side closes."""
        if (await receive())["type"] != "websocket.connect":
            return
        base, status, _ = await self._admit(scope, sandbox_id, port)
        if base is None:
            await send({"type": "websocket.close", "code": 1008 if status == 403 else 1011})
            return
        url = (
            "ws"
            + base[len("http") :]
            + (scope.get("raw_path") or scope["path"].encode()).decode("latin-1")
        )
        if scope.get("query_string"):
            url += "?" + scope["query_string"].decode("latin-1")
        headers = [
            (n.decode("latin-1"), v.decode("latin-1"))
            for n, v in self._upstream_headers(scope)
            if n not in _WS_HANDSHAKE
        ]
        try:
            upstream = await connect(
                url,
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
                "websocket upstream refused", extra={"sandbox_id": sandbox_id, "error": str(exc)}
            )
            await send({"type": "websocket.close", "code": 1011})
            return
        await send({"type": "websocket.accept", "subprotocol": upstream.subprotocol})
        to_sandbox = asyncio.create_task(self._ws_client_to_upstream(receive, upstream))
        to_client = asyncio.create_task(self._ws_upstream_to_client(upstream, send))
        try:
            await asyncio.wait({to_sandbox, to_client}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in (to_sandbox, to_client):
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
        host = dict(scope["headers"]).get(b"host", b"")
        out.append((b"x-forwarded-host", host))
        out.append((b"x-forwarded-proto", scope.get("scheme", "http").encode()))
        return out

    async def _relay(
        self, scope: Scope, receive: Any, send: Any, base: str, sandbox_id: str
    ) -> int:
        raw_path = scope.get("raw_path") or scope["path"].encode()
        url = base + raw_path.decode("latin-1")
        if scope.get("query_string"):
            url += "?" + scope["query_string"].decode("latin-1")
        headers = self._upstream_headers(scope)
        has_body = any(n in (b"content-length", b"transfer-encoding") for n, _ in scope["headers"])
        if any(n == b"content-length" and v.strip() == b"0" for n, v in scope["headers"]):
            has_body = False
        body_done = asyncio.Event()
        upload = self.metrics.proxy_bytes.labels("upload")

        async def request_body() -> AsyncIterator[bytes]:
            while True:
                message = await receive()
                if message["type"] == "http.disconnect":
                    raise _ClientGone
                chunk = message.get("body", b"")
                if chunk:
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
        relay = asyncio.create_task(self._exchange(request, send, sandbox_id, body_done))
        watcher = asyncio.create_task(self._watch_disconnect(receive, body_done))
        try:
            done, _ = await asyncio.wait({relay, watcher}, return_when=asyncio.FIRST_COMPLETED)
            if relay in done:
                return relay.result()
            relay.cancel()  # the client went away: stop reading the sandbox's stream
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await relay
            return 499
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher

    @staticmethod
    async def _watch_disconnect(receive: Any, body_done: asyncio.Event) -> None:
        await body_done.wait()
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return

    async def _exchange(
        self, request: httpx.Request, send: Any, sandbox_id: str, body_done: asyncio.Event
    ) -> int:
        try:
            response = await self.client.send(request, stream=True)
        except _ClientGone:
            return 499
        except httpx.HTTPError as exc:
            log.info(
                "sandbox port not answering", extra={"sandbox_id": sandbox_id, "error": str(exc)}
            )
            await send_json(
                send,
                502,
                {
                    "sandboxId": sandbox_id,
                    "message": "The sandbox is running but port is not open",
                    "code": 502,
                },
            )
            return 502
        download = self.metrics.proxy_bytes.labels("download")
        try:
            out_headers = [
                (name, value)
                for name, value in response.headers.raw
                if name.lower() not in _HOP_BY_HOP
            ]
            await send(
                {
                    "type": "http.response.start",
                    "status": response.status_code,
                    "headers": out_headers,
                }
            )
            async for chunk in response.aiter_raw():
                download.inc(len(chunk))
                await send({"type": "http.response.body", "body": chunk, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
            return response.status_code
        finally:
            await response.aclose()
