"""The HTTP/1.1 protocol of the node and the gateway: uvicorn's h11 protocol with limits on
the request head.

uvicorn's h11 protocol sets no deadline for receiving a request head (a client that sends one
byte a minute holds its connection forever, and so does one that connects and sends nothing)
and answers an oversized head with a bare 400. This protocol answers 408 when a head is not
complete within `head_timeout` seconds and 431 when it is larger than `max_head_bytes`, then
closes the connection. h11 passes any request target on, including absolute-form
(`GET http://host/x`), authority-form (`CONNECT host:443`) and `@127.0.0.1:8000/x`:
`target_problem` is what the node and the gateway check every request against; neither is
ever a forward proxy, so only origin-form (`/path?query`) is served.

`path_problem` refuses what makes one path mean two things to two parsers (the gateway routes
one form, a node or envd would resolve another): dot segments (`.`, `..`, percent-encoded or
not), empty segments (`//`) and encoded separators (`%2f`, `%5c`, a backslash), each decoded as
often as a chain of servers might.

The client's address (rate limits, logs) is the peer's, unless the peer is a proxy the operator
trusts (`AENV_TRUSTED_PROXIES`, addresses and CIDRs): then it is what that proxy put in
`X-Forwarded-For` (uvicorn's proxy-headers middleware: the right-most address no trusted proxy
added). Nothing else is trusted, not even loopback (uvicorn's default): a client that may name
its own address picks its own rate limit bucket.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import json
import logging
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import unquote_to_bytes

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from agentenv.errors import AgentEnvError
from agentenv.logs import Sampled
from agentenv.relay.connections import ConnectionLimits
from agentenv.relay.websocket import FragmentingWebSocketProtocol

log = logging.getLogger("agentenv.relay.server")
#: connections that sent no request head in time, process-wide (logged sampled)
HEAD_TIMEOUTS = Sampled()

TRUSTED_PROXIES_ENV = "AENV_TRUSTED_PROXIES"


def trusted_proxies(env: Mapping[str, str] | None = None) -> list[str]:
    """The proxies whose X-Forwarded-For names the client (AENV_TRUSTED_PROXIES: addresses or
    CIDRs, comma-separated; empty: none, the peer is the client)."""
    raw = (os.environ if env is None else env).get(TRUSTED_PROXIES_ENV, "")
    found = []
    for item in (i.strip() for i in raw.split(",")):
        if not item:
            continue
        try:  # uvicorn would take a malformed entry as a host name: refuse it here
            found.append(str(ipaddress.ip_network(item, strict=False)) if "/" in item
                         else str(ipaddress.ip_address(item)))
        except ValueError:
            raise AgentEnvError(f"{TRUSTED_PROXIES_ENV}: {item!r} is not an IP address or "
                                "CIDR (e.g. 10.0.0.0/8,192.0.2.7)") from None
    return found

#: origin-form (RFC 9112 3.2.1): an absolute path and an optional query. Only printable ASCII
#: other than '#': llhttp already refuses spaces and control bytes, this also refuses a fragment,
#: and a leading "//" that URL parsers would read as an authority.
_ORIGIN_FORM = re.compile(rb"/(?!/)[\x21\x22\x24-\x7e]*")


def target_problem(target: bytes) -> str | None:
    """Why `target` (request-target bytes, path and query) is not relayed, or None if it is."""
    if _ORIGIN_FORM.fullmatch(target):
        return None
    shown = target[:80].decode("latin-1").encode("unicode_escape").decode("ascii")
    if target.startswith(b"//"):
        kind = "a path starting with '//'"
    elif b"://" in target[:16]:
        kind = "absolute-form"
    elif target == b"*":
        kind = "asterisk-form"
    elif not target.startswith(b"/"):
        kind = "not origin-form"
    else:
        kind = "a byte outside printable ASCII or a '#'"
    return f"request target {shown!r} is {kind}: only '/path?query' is accepted"


#: how many rounds of percent-decoding a segment is checked through (`%252e` is `.` after two)
_DECODE_ROUNDS = 3


def path_problem(target: bytes, trailing_slash: bool = False) -> str | None:
    """Why the path of `target` (origin-form, see target_problem) is refused, or None: a dot
    segment, an empty segment (a trailing '/' only with `trailing_slash`: sandbox traffic to
    an app, which serves directories so), or an encoded '/' or '\\' in a segment."""
    path = target.split(b"?", 1)[0]
    if path == b"/":
        return None
    segments = path[1:].split(b"/")
    if trailing_slash and len(segments) > 1 and segments[-1] == b"":
        segments.pop()
    shown = path[:80].decode("latin-1").encode("unicode_escape").decode("ascii")
    for segment in segments:
        if not segment:
            return f"path {shown!r} has an empty segment ('//' or a trailing '/')"
        decoded = segment
        for _ in range(_DECODE_ROUNDS + 1):
            if decoded in (b".", b".."):
                return f"path {shown!r} has a dot segment ('.' or '..', maybe encoded)"
            if b"/" in decoded or b"\\" in decoded or b"\0" in decoded:
                return f"path {shown!r} has an encoded '/', a '\\' or a NUL in a segment"
            if b"%" not in decoded:
                break
            decoded = unquote_to_bytes(decoded)
    return None


def request_target(scope: dict[str, Any]) -> bytes:
    """The request target of an ASGI scope as the client sent it (path and query)."""
    target: bytes = scope.get("raw_path") or scope["path"].encode()
    if scope.get("query_string"):
        target += b"?" + scope["query_string"]
    return target


class StreamAborted(Exception):
    """Raised by the proxy to cut a client's connection mid-response (the sandbox went away,
    a timeout): the client sees the transfer end early, as it would on E2B. Not an error."""


class _QuietAborts(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not isinstance(exc, StreamAborted)


def quiet_stream_aborts() -> None:
    """uvicorn logs every exception out of the app with a traceback; an aborted stream is an
    expected end, already logged by the proxy."""
    logging.getLogger("uvicorn.error").addFilter(_QuietAborts())


def hardened_protocol(max_head_bytes: int, head_timeout: float,
                      connections: ConnectionLimits | None = None) -> type[H11Protocol]:
    """The protocol class for uvicorn's `http=` with these limits (`connections`: the bounds
    on open connections of relay/connections.py, shared by every connection of the server)."""

    class HardenedH11Protocol(_HardenedBase):
        pass

    HardenedH11Protocol.max_head_bytes = max_head_bytes
    HardenedH11Protocol.head_timeout = head_timeout
    HardenedH11Protocol.connection_limits = connections
    return HardenedH11Protocol


def hardened_config(app: Any, host: str, port: int, max_head_bytes: int, head_timeout: float,
                    graceful_seconds: float, backlog: int = 2048, *,
                    ws_max_bytes: int = 16 << 20,
                    tls_files: tuple[Path, Path] | None = None,
                    connections: ConnectionLimits | None = None) -> uvicorn.Config:
    """The uvicorn settings of every server that relays sandbox traffic (the node, the
    gateway): the hardened HTTP/1.1 protocol, our own logs, WebSockets (messages of at most
    `ws_max_bytes`; fragments relayed as they come, relay/websocket.py), no server header, the
    client's address as AENV_TRUSTED_PROXIES says, bounded open connections (`connections`,
    else from the environment: relay/connections.py); TLS only where `tls_files` (certificate,
    key) are given (relay/tls.py)."""
    proxies = trusted_proxies()
    if connections is None:
        connections = ConnectionLimits.from_env(proxies)
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http=hardened_protocol(max_head_bytes, head_timeout, connections),
        h11_max_incomplete_event_size=max_head_bytes + 1,
        log_config=None,
        access_log=False,
        lifespan="on",
        timeout_graceful_shutdown=graceful_seconds,
        timeout_keep_alive=30,
        server_header=False,
        ws=FragmentingWebSocketProtocol,
        ws_max_size=ws_max_bytes,
        backlog=backlog,
        proxy_headers=bool(proxies),
        forwarded_allow_ips=proxies or None,
        ssl_certfile=tls_files[0] if tls_files else None,
        ssl_keyfile=tls_files[1] if tls_files else None,
    )


class _HardenedBase(H11Protocol):
    max_head_bytes = 64 << 10
    head_timeout = 30.0
    connection_limits: ConnectionLimits | None = None

    _head_timer: asyncio.TimerHandle | None = None

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        if self.connection_limits is not None:
            refused = self.connection_limits.admit(self, str(self.client[0]) if self.client else "")
            if refused:
                self._reply(503, refused)
                return
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        if self.connection_limits is not None:
            self.connection_limits.release(self)
        super().connection_lost(exc)

    def is_idle(self) -> bool:
        """Serving no request: none received yet, kept alive after one, or a head arriving."""
        return ((self.cycle is None or self.cycle.response_complete)
                and not self.transport.is_closing())

    def close_idle(self) -> None:
        """Close this idle connection to make room (as its keep-alive timeout would)."""
        self._stop_head_timer()
        self._unset_keepalive_if_required()
        with contextlib.suppress(h11.LocalProtocolError):
            self.conn.send(h11.ConnectionClosed())
        self.transport.close()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        if self.connection_limits is not None:
            self.connection_limits.active(self)

    def handle_websocket_upgrade(self, event: h11.Request) -> None:
        if self.connection_limits is not None:  # a session now, counted by the request cap
            self.connection_limits.release(self)
        super().handle_websocket_upgrade(event)

    def _arm_head_timer(self) -> None:
        if self._head_timer is None and self.head_timeout > 0:
            self._head_timer = self.loop.call_later(self.head_timeout, self._head_timed_out)

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self.conn.their_state is h11.IDLE and not self.transport.is_closing():
            if HEAD_TIMEOUTS.tick():  # anyone can open connections and send nothing
                log.info("request head not received in time",
                         extra={"client": str(self.client), "count": HEAD_TIMEOUTS.count})
            self._reply(408, f"request head not received within {self.head_timeout:g} s")

    def _reply(self, status: int, message: str) -> None:
        body = json.dumps({"code": status, "message": message}).encode()
        reason = {408: b"Request Timeout", 431: b"Request Header Fields Too Large",
                  503: b"Service Unavailable"}
        self.transport.write(
            b"HTTP/1.1 %d %s\r\ncontent-type: application/json; charset=utf-8\r\n"
            b"content-length: %d\r\nconnection: close\r\n\r\n%s"
            % (status, reason.get(status, b"Error"), len(body), body)
        )
        self.transport.close()

    def data_received(self, data: bytes) -> None:
        if self.conn.their_state is not h11.IDLE:
            super().data_received(data)
            return
        # a request head is being received: bounded in size and in time
        self._unset_keepalive_if_required()
        self.conn.receive_data(data)
        buffered = self.conn.trailing_data[0]
        limit = self.max_head_bytes
        # the buffer may hold the start of the body too: only an unfinished head counts
        if (
            len(buffered) > limit
            and buffered.find(b"\n\r\n", 0, limit + 3) < 0
            and (buffered.find(b"\n\n", 0, limit + 2) < 0)
        ):
            self._reply(431, f"request line and headers over {self.max_head_bytes} bytes")
            return
        self._arm_head_timer()
        self.handle_events()
        if self.conn.their_state is not h11.IDLE:
            self._stop_head_timer()
