"""A cap on the requests one server (a node, the gateway) serves at once.

`AENV_MAX_CONCURRENT_REQUESTS` (default 4096; 0 = no cap): HTTP requests and WebSockets in
progress, a long stream counting for as long as it lasts. One past the cap is answered at once
with 503 and a JSON body that names the setting (a WebSocket is closed with 1013, "try again
later"), instead of piling up until the process runs out of memory or file descriptors. Per
connection the cap is one: the server speaks HTTP/1.1 (h11), which serves a connection's
requests one after another (a pipelined request waits for the one before it).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

from agentenv.logs import Sampled
from agentenv.relay.answers import RETRY_SHORTLY, send_json
from agentenv.settings import setting_text

log = logging.getLogger("agentenv.relay.concurrency")

SETTING = "AENV_MAX_CONCURRENT_REQUESTS"
DEFAULT_MAX = 4096


def whole_number_setting(env: Mapping[str, str] | None, name: str, default: int) -> int:
    """A setting of `env` (None: the process's) that is a whole number, 0 or more (unset:
    `default`); a clear error else."""
    raw = setting_text(name, env).strip()
    try:
        value = int(raw) if raw else default
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not a whole number") from None
    if value < 0:
        raise ValueError(f"{name}={raw!r} must not be negative")
    return value


def max_concurrent(env: Mapping[str, str] | None = None) -> int:
    return whole_number_setting(env, SETTING, DEFAULT_MAX)


class ConcurrencyCap:
    """ASGI middleware: at most `limit` HTTP requests and WebSockets in progress."""

    def __init__(self, app: Any, limit: int, server: str) -> None:
        self.app = app
        self.limit = limit
        self.server = server
        self.active = 0
        self.refused = Sampled()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] not in ("http", "websocket") or not self.limit:
            await self.app(scope, receive, send)
            return
        if self.active >= self.limit:
            if self.refused.tick():
                log.warning("concurrent request cap reached",
                            extra={"limit": self.limit, "refused": self.refused.count})
            await self._refuse(scope, send)
            return
        self.active += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.active -= 1

    async def _refuse(self, scope: dict[str, Any], send: Any) -> None:
        if scope["type"] == "websocket":
            await send({"type": "websocket.close", "code": 1013})
            return
        await send_json(send, 503, {"code": 503, "message": (
            f"{self.server} is serving its limit of {self.limit} concurrent requests "
            f"({SETTING}); retry shortly")}, RETRY_SHORTLY)
