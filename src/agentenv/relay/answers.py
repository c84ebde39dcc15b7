"""JSON answers written straight to an ASGI `send`: the relays, their guards and the gateway's
dispatcher answer so before (or instead of) any framework seeing the request. One copy, so a
refusal looks the same whichever layer gives it."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable, Iterable, Mapping
from typing import Any

Send = Callable[[dict[str, Any]], Awaitable[None]]

#: what a refusal that should be retried soon adds to its answer
RETRY_SHORTLY = ((b"retry-after", b"1"),)


async def send_json(send: Send, status: int, body: Any,
                    headers: Mapping[str, str] | Iterable[tuple[bytes, bytes]] | None = None
                    ) -> None:
    """`body` as JSON with `status`; `headers` as raw pairs or a name -> value mapping."""
    payload = json.dumps(body).encode()
    raw = [(b"content-type", b"application/json; charset=utf-8"),
           (b"content-length", str(len(payload)).encode())]
    if isinstance(headers, Mapping):
        raw += [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    elif headers is not None:
        raw += list(headers)
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": payload})
