"""The HTTP/1.1 protocol of the node and the gateway: uvicorn's h11 protocol with limits on
the request head, the connection bounds and send timeout of relay/connections.py (it tells them
each connection's state), and TLS set up by the protocol itself (`_HardenedBase`).

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
its own address picks its own rate limit bucket. The bounds on request bodies arriving
(relay/connections.py) name the client so too, or as a proxy the server authenticates some
other way names it (`vouch`: a node of a cluster, its gateway).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import ipaddress
import json
import logging
import re
import socket
import ssl
import struct
import termios
from collections.abc import Mapping
from pathlib import Path
from typing import Any
from urllib.parse import unquote_to_bytes

import h11
import uvicorn
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.utils import get_remote_addr

from agentenv.errors import AgentEnvError
from agentenv.logs import Sampled
from agentenv.relay.connections import BODY_TIMEOUT_SETTING, ConnectionLimits, State
from agentenv.relay.tls import NodeTls
from agentenv.relay.websocket import FragmentingWebSocketProtocol
from agentenv.settings import setting_text

log = logging.getLogger("agentenv.relay.server")
#: connections that sent no request head in time, process-wide (logged sampled)
HEAD_TIMEOUTS = Sampled()

TRUSTED_PROXIES_ENV = "AENV_TRUSTED_PROXIES"


def trusted_proxies(env: Mapping[str, str] | None = None) -> list[str]:
    """The proxies whose X-Forwarded-For names the client (AENV_TRUSTED_PROXIES: addresses or
    CIDRs, comma-separated; empty: none, the peer is the client)."""
    raw = setting_text(TRUSTED_PROXIES_ENV, env)
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


def request_has_body(scope: dict[str, Any]) -> bool:
    """Whether a request announces a body: chunks (Transfer-Encoding wins, RFC 9112 6.3) or a
    Content-Length other than 0."""
    lengths = []
    for name, value in scope["headers"]:
        if name == b"transfer-encoding":
            return True
        if name == b"content-length":
            lengths.append(value)
    return bool(lengths) and lengths[0].strip() != b"0"


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


def hardened_protocol(max_head_bytes: int, head_timeout: float, connections: ConnectionLimits,
                      tls: ssl.SSLContext | None = None) -> type[H11Protocol]:
    """The protocol class for uvicorn's `http=` with these limits (`connections`: the bounds
    on open connections of relay/connections.py, shared by every connection of the server;
    `tls`: the server's TLS, set up by the protocol itself, see `_HardenedBase`)."""

    class HardenedH11Protocol(_HardenedBase):
        pass

    HardenedH11Protocol.max_head_bytes = max_head_bytes
    HardenedH11Protocol.head_timeout = head_timeout
    HardenedH11Protocol.connection_limits = connections
    HardenedH11Protocol.tls = tls
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
    tls = NodeTls(cert=tls_files[0], key=tls_files[1]).server_context() if tls_files else None
    return uvicorn.Config(
        app,
        host=host,
        port=port,
        http=hardened_protocol(max_head_bytes, head_timeout, connections, tls),
        h11_max_incomplete_event_size=max_head_bytes + 1,
        log_config=None,
        access_log=False,
        lifespan="on",
        loop="asyncio",  # as the node's and the gateway's asyncio.run; TLS relies on it
        timeout_graceful_shutdown=graceful_seconds,
        timeout_keep_alive=30,
        server_header=False,
        ws=FragmentingWebSocketProtocol,
        ws_max_size=ws_max_bytes,
        ws_per_message_deflate=False,  # frames are relayed as they come: relay/websocket.py
        backlog=backlog,
        proxy_headers=bool(proxies),
        forwarded_allow_ips=proxies or None,
    )


class _HardenedBase(H11Protocol):
    """uvicorn's h11 protocol with the head limits, the connection bounds and the send timeout
    of relay/connections.py, and TLS.

    TLS is set up here (`loop.start_tls` once the TCP connection is made), not by the listening
    socket (uvicorn's `ssl_certfile`): there asyncio runs the handshake before this protocol
    sees the connection, so a client that connects and never sends a ClientHello held a
    descriptor for asyncio's fixed 60 s, uncounted by the connection bounds (uvicorn exposes no
    handshake timeout, and a failed handshake never reaches the protocol at all). Here the
    connection is admitted at its TCP accept, idle (evictable like any idle one) until its
    request head, and its handshake has its own deadline."""

    max_head_bytes = 64 << 10
    head_timeout = 30.0
    connection_limits: ConnectionLimits
    tls: ssl.SSLContext | None = None

    _head_timer: asyncio.TimerHandle | None = None
    _send_timer: asyncio.TimerHandle | None = None
    _send_left = 0  # bytes queued when the send timer was armed
    _handshake: asyncio.Transport | None = None  # the TCP transport while TLS is set up
    _early = b""  # what came with the end of the handshake, before this protocol was told
    _upgraded = False
    _tls_task: asyncio.Task[None] | None = None
    _receiving = False  # a request body is arriving (connections.py's body bounds)
    _body_timer: asyncio.TimerHandle | None = None
    _body_last = 0.0  # loop time of the body's last byte, or of the server's last ask

    # uvicorn reads `self.app` once per request, as soon as the request head is parsed and
    # before any of its body: where a request with a body is counted (or refused), against the
    # client its headers name when a proxy that may name it relays it
    @property
    def app(self) -> Any:
        if not request_has_body(self.scope):
            return self._app
        refused = self.connection_limits.begin_body(self, self.scope["headers"])
        if refused is not None:
            return _refusal(429, refused)
        self._receiving = True
        self._body_last = self.loop.time()
        if self.connection_limits.body_timeout > 0:
            self._arm_body_timer(self.connection_limits.body_timeout)
        return self._app

    @app.setter
    def app(self, app: Any) -> None:
        self._app = app

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        self._bound_unacknowledged(transport)
        if self.tls is None:
            self._serve(transport)
            return
        peer = get_remote_addr(transport)
        if self.connection_limits.admit(self, peer[0] if peer else ""):
            transport.abort()  # refused: nothing can be said to it before TLS is up
            return
        transport.pause_reading()  # not one byte to this protocol before TLS is up
        self._handshake = transport
        self._arm_head_timer()  # the head deadline counts from the accept
        self._tls_task = self.loop.create_task(self._accept_tls(transport))

    async def _accept_tls(self, raw: asyncio.Transport) -> None:
        assert self.tls is not None
        limits = self.connection_limits
        try:
            secured = await self.loop.start_tls(
                raw, self, self.tls, server_side=True,
                ssl_handshake_timeout=limits.handshake_timeout or None)
            if secured is None:  # closed with no error (our abort: room, the head deadline):
                raise ConnectionAbortedError("closed during the handshake")  # done, no transport
        except BaseException as exc:  # start_tls closed it; connection_lost is not called
            self._handshake = None
            self._stop_head_timer()
            failed = limits.state(self) is not None  # else closed to make room
            limits.release(self)
            if not isinstance(exc, Exception):
                raise
            if failed and limits.handshake_failures.tick():
                log.info("TLS handshake failed or not done in time",
                         extra={"client": str(get_remote_addr(raw)), "error": str(exc),
                                "count": limits.handshake_failures.count})
            return
        self._handshake = None
        if secured.is_closing():  # lost as soon as made (connection_lost releases it)
            return
        self._serve(secured, admitted=True)
        if self._early:
            early, self._early = self._early, b""
            self.data_received(early)

    def _serve(self, transport: asyncio.Transport, admitted: bool = False) -> None:
        super().connection_made(transport)
        self.flow = _AskingFlow(transport, self._body_asked)
        if not admitted:
            refused = self.connection_limits.admit(self, str(self.client[0]) if self.client
                                                   else "")
            if refused:
                self._reply(503, refused)
                return
        self._arm_head_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_head_timer()
        self._stop_send_timer()
        self._stop_body_timer()
        if isinstance(exc, TimeoutError):  # the kernel's send timeout (TCP_USER_TIMEOUT)
            self._count_send_timeout(None)
        self.connection_limits.release(self)
        if self.transport is not None:  # else lost before _accept_tls saw TLS up
            super().connection_lost(exc)

    def close_idle(self) -> None:
        """Close this idle connection to make room (as its keep-alive timeout would)."""
        self._stop_head_timer()
        if self._handshake is not None:
            self._handshake.abort()  # _accept_tls ends
            return
        self._unset_keepalive_if_required()
        with contextlib.suppress(h11.LocalProtocolError):
            self.conn.send(h11.ConnectionClosed())
        self.transport.close()
        self._update()  # what its client has not taken yet is still bounded in time

    def abort(self) -> None:
        """Drop this stalled connection (its client does not read what it asked for)."""
        (self._handshake or self.transport).abort()

    def handle_events(self) -> None:
        super().handle_events()
        self._update()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        self._update()

    def pause_writing(self) -> None:
        super().pause_writing()
        self._update()

    def resume_writing(self) -> None:
        super().resume_writing()
        self._update()

    def handle_websocket_upgrade(self, event: h11.Request) -> None:
        self._upgraded = True  # the WebSocket protocol has the transport now
        self._stop_send_timer()
        self.connection_limits.release(self)  # a session now, counted by the request cap
        super().handle_websocket_upgrade(event)

    def _update(self) -> None:
        """Tell the limits this connection's state, and run the send timer while bytes are
        queued for the client and nothing is added to them (writes paused, or no request
        writing): a client that takes none of them for the send timeout is cut."""
        if self.transport is None or self._handshake is not None or self._upgraded:
            return
        serving = self.cycle is not None and not self.cycle.response_complete
        body_done = self.conn.their_state is not h11.SEND_BODY
        if body_done:
            self._stop_body_timer()
        if self._receiving and (body_done or not serving):
            # answered early, what comes of the body is discarded (within its timeout): an
            # idle connection, no longer one of its client's bodies arriving
            self._receiving = False
            self.connection_limits.end_body(self)
        paused = self.flow.write_paused
        queued = self.transport.get_write_buffer_size()
        closing = self.transport.is_closing()
        # closing with bytes queued: an answer still being delivered, not a connection to reuse
        self.connection_limits.set_state(
            self, State.STALLED if paused else State.BUSY if serving or (closing and queued)
            else State.IDLE)
        writing = serving and not paused and not closing
        if writing or not queued:
            self._stop_send_timer()
        elif self._send_timer is None and self.connection_limits.send_timeout > 0:
            self._arm_send_timer()

    def _arm_send_timer(self) -> None:
        self._send_left = self._unacknowledged()
        self._send_timer = self.loop.call_later(self.connection_limits.send_timeout,
                                                self._send_timed_out)

    def _stop_send_timer(self) -> None:
        if self._send_timer is not None:
            self._send_timer.cancel()
            self._send_timer = None

    def _unacknowledged(self) -> int:
        """Bytes for the client it has not acknowledged: the transport's and the kernel's. The
        kernel's matter: it holds megabytes (autotuned send buffer) and takes more from the
        transport only once a third of them is gone, so a slow reader may leave the transport's
        alone for a long time while it reads."""
        queued = self.transport.get_write_buffer_size()
        sock = self.transport.get_extra_info("socket")
        if sock is not None:
            with contextlib.suppress(OSError, ValueError):
                raw = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0\0\0\0")
                queued += struct.unpack("i", raw)[0]
        return queued

    def _send_timed_out(self) -> None:
        self._send_timer = None
        if not self.transport.get_write_buffer_size():  # the kernel has the rest
            return
        left = self._unacknowledged()
        if left < self._send_left:  # it took some: a slow reader, given another period
            self._arm_send_timer()
            return
        self._count_send_timeout(left)
        self.abort()

    def _count_send_timeout(self, queued: int | None) -> None:
        timeouts = self.connection_limits.send_timeouts
        if timeouts.tick():  # anyone can ask for answers and never read them
            log.info("connection cut: its client took nothing of its answers in time",
                     extra={"client": str(self.client), "queued": queued,
                            "seconds": self.connection_limits.send_timeout,
                            "count": timeouts.count})

    def _bound_unacknowledged(self, transport: asyncio.Transport) -> None:
        """The kernel's own send timeout on the socket (TCP_USER_TIMEOUT: data unacknowledged,
        or a zero window, for that long ends the connection; Linux 5.11 and later count a zero
        window right). It covers what this protocol no longer sees: a WebSocket after its
        upgrade, and a connection closed with bytes still queued (asyncio waits for ever to
        flush them), whichever protocol closed it."""
        sock = transport.get_extra_info("socket")
        timeout = self.connection_limits.send_timeout
        if sock is not None and timeout > 0:
            with contextlib.suppress(OSError):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT,
                                int(timeout * 1000))

    def _body_asked(self) -> None:
        """The app asked for more of the body (or the server resumed reading): the client's
        period starts again."""
        self._body_last = self.loop.time()

    def _arm_body_timer(self, delay: float) -> None:
        self._stop_body_timer()
        self._body_timer = self.loop.call_later(delay, self._body_check)

    def _stop_body_timer(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _body_check(self) -> None:
        self._body_timer = None
        if self.conn.their_state is not h11.SEND_BODY or self.transport.is_closing():
            return
        timeout = self.connection_limits.body_timeout
        cycle = self.cycle
        if self.flow.read_paused or (cycle is not None and cycle.waiting_for_100_continue):
            self._arm_body_timer(timeout)  # the server is not waiting for the client
            return
        waited = self.loop.time() - self._body_last
        if waited < timeout:
            self._arm_body_timer(timeout - waited)
            return
        limits = self.connection_limits
        if limits.body_timeouts.tick():  # anyone can send a body slowly
            log.info("request body cut: nothing of it came in time",
                     extra={"client": str(self.client), "seconds": timeout,
                            "count": limits.body_timeouts.count})
        if cycle is None or cycle.response_started:
            self.abort()
            return
        cycle.disconnected = True  # what the app sends now is dropped: the 408 is the answer
        cycle.message_event.set()
        self._reply(408, f"request body: nothing of it came for {timeout:g} s "
                         f"({BODY_TIMEOUT_SETTING})")

    def _arm_head_timer(self) -> None:
        if self._head_timer is None and self.head_timeout > 0:
            self._head_timer = self.loop.call_later(self.head_timeout, self._head_timed_out)

    def _stop_head_timer(self) -> None:
        if self._head_timer is not None:
            self._head_timer.cancel()
            self._head_timer = None

    def _head_timed_out(self) -> None:
        self._head_timer = None
        if self._handshake is not None:  # the head deadline covers the handshake too
            self._handshake.abort()
            return
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
        self._body_last = self.loop.time()  # what the body's timer counts from (_body_check)
        if self.transport is None:
            raw = self._handshake
            if raw is not None and raw.get_protocol() is self:
                # TLS bytes before start_tls took the transport: a loop that starts reading
                # despite the pause in connection_made (uvloop does)
                log.error("TLS needs asyncio's event loop (the read before the handshake)")
                raw.abort()
                return
            self._early += data  # decrypted: TLS is up, _accept_tls not yet resumed
            return
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


class _AskingFlow(FlowControl):
    """uvicorn's read flow control that also tells when reading resumes: the server asks for
    more of a body (each app `receive`, or a pause ending)."""

    def __init__(self, transport: asyncio.Transport, asked: Any) -> None:
        super().__init__(transport)
        self._asked = asked

    def resume_reading(self) -> None:
        self._asked()
        super().resume_reading()


def _refusal(status: int, message: str) -> Any:
    """An ASGI app that answers `status` with `message` and closes the connection (its
    request's body is never read)."""
    payload = json.dumps({"code": status, "message": message}).encode()

    async def refuse(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await send({"type": "http.response.start", "status": status, "headers": [
            (b"content-type", b"application/json; charset=utf-8"),
            (b"content-length", str(len(payload)).encode()), (b"connection", b"close")]})
        await send({"type": "http.response.body", "body": payload})

    return refuse
