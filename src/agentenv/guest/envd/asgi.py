"""envd's ASGI plumbing: the request as its handlers see it and the plain responses."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from agentenv.guest.envd.rpc import RpcError

Scope = dict[str, Any]
Receive = Callable[[], Awaitable[dict[str, Any]]]
Send = Callable[[dict[str, Any]], Awaitable[None]]


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    receive: Receive

    def param(self, name: str) -> str | None:
        values = self.query.get(name)
        return values[0] if values else None

    async def body_chunks(self) -> AsyncIterator[bytes]:
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                raise ConnectionError("client disconnected")
            chunk = message.get("body", b"")
            if chunk:
                yield chunk
            if not message.get("more_body", False):
                return

    async def body(self, limit: int) -> bytes:
        # A plain loop rather than body_chunks(): /init reads its body this way on every
        # restore, when each code path taken for the first time costs (see httpserver.py).
        data = bytearray()
        while True:
            message = await self.receive()
            if message["type"] == "http.disconnect":
                raise ConnectionError("client disconnected")
            data += message.get("body", b"")
            if len(data) > limit:
                raise RpcError("resource_exhausted", f"request body larger than {limit} bytes")
            if not message.get("more_body", False):
                return bytes(data)


async def send_json(send: Send, status: int, body: Any, extra: list[tuple[bytes, bytes]] | None = None) -> None:
    payload = json.dumps(body, separators=(",", ":")).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
                *(extra or []),
            ],
        }
    )
    await send({"type": "http.response.body", "body": payload})


async def send_empty(send: Send, status: int, extra: list[tuple[bytes, bytes]] | None = None) -> None:
    await send({"type": "http.response.start", "status": status, "headers": extra or []})
    await send({"type": "http.response.body", "body": b""})


async def send_http_error(send: Send, status: int, message: str) -> None:
    """The plain-HTTP error body of envd: {"code": <status>, "message": ...}."""
    await send_json(send, status, {"code": status, "message": message})


async def wait_disconnect(receive: Receive) -> None:
    """Returns when the client has gone (the request body must have been read already)."""
    while (await receive())["type"] != "http.disconnect":
        pass
