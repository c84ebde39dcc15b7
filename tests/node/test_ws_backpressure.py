"""WebSockets through the node's sandbox proxy hold a small window per connection, not messages.

A guest's WebSocket server sends large messages without end to clients that opened WebSockets
to it through the node and never read. A relay of whole messages holds several messages per
such client (main held ~48 MiB each: 48 of them took 6 GiB); the fragment relay stops reading
the guest once its client's socket is full, so the node's RSS stays within RSS_BOUND for K
readers, while the guest, blocked, sends nothing more. The guest stand-in is a server on
loopback: with the process backend a sandbox port P is 127.0.0.1:P. The per-sandbox cap on
WebSockets answers 429 naming its setting; a client that reads gets every byte, in order.
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import os
import socket
import socketserver
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest

from tests.node.conftest import WS_CLIENTS, NodeProcess, free_host_port
from tests.node.test_hostile_guest import RssWatchdog

K = WS_CLIENTS  # the node's WebSocket limit (conftest.ws_node)
RSS_BOUND = 100 << 20
MESSAGE = 8 << 20  # under the node's 16 MiB message limit
#: the guest counts as blocked once no connection moved a byte for this many polls of 1 s
QUIET_POLLS = 3
GUID = b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11"


def _accept(key: bytes) -> bytes:
    return base64.b64encode(hashlib.sha1(key + GUID).digest())


def _read_head(sock: socket.socket) -> bytes:
    head = b""
    while b"\r\n\r\n" not in head:
        chunk = sock.recv(1)
        if not chunk:
            raise ConnectionError(f"connection closed in the head: {head!r}")
        head += chunk
    return head


def _answer_upgrade(sock: socket.socket) -> None:
    """A guest's side of the WebSocket handshake: read the request, answer 101."""
    head = _read_head(sock)
    key = next(line.split(b":", 1)[1].strip() for line in head.split(b"\r\n")
               if line.lower().startswith(b"sec-websocket-key:"))
    sock.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\n"
                 b"Connection: Upgrade\r\nSec-WebSocket-Accept: " + _accept(key) + b"\r\n\r\n")


class _EndlessGuest(socketserver.ThreadingTCPServer):
    """The guest's WebSocket server: after the handshake, one MESSAGE-byte binary message after
    another (the same bytes, `payload`), counting what each connection got out."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self) -> None:
        self.payload = os.urandom(1 << 20) * (MESSAGE >> 20)
        self.frame = b"\x82\x7f" + MESSAGE.to_bytes(8, "big") + self.payload
        self.sent: dict[int, int] = {}
        self.endless = True
        super().__init__(("127.0.0.1", free_host_port()), _EndlessGuestHandler)


class _EndlessGuestHandler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        server: _EndlessGuest = self.server  # type: ignore[assignment]
        sock: socket.socket = self.request
        _answer_upgrade(sock)
        me = id(self)
        server.sent[me] = 0
        view = memoryview(server.frame)
        with contextlib.suppress(OSError):
            while True:
                for start in range(0, len(view), 1 << 20):
                    piece = view[start:start + (1 << 20)]
                    sock.sendall(piece)
                    server.sent[me] += len(piece)
                if not server.endless:
                    sock.sendall(b"\x88\x02\x03\xe8")  # close 1000
                    sock.recv(100)
                    return


@pytest.fixture(scope="module")
def guest() -> Iterator[_EndlessGuest]:
    server = _EndlessGuest()
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield server
    server.shutdown()
    server.server_close()


def open_non_reader(node: NodeProcess, sid: str, port: int) -> tuple[socket.socket, bytes]:
    """A WebSocket through the node that is never read (small receive buffer); returns the
    socket and the node's answer head."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.settimeout(30)
    sock.connect(("127.0.0.1", node.port))
    key = base64.b64encode(os.urandom(16))
    sock.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
                 b"Connection: Upgrade\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: " + key
                 + f"\r\nE2b-Sandbox-Id: {sid}\r\nE2b-Sandbox-Port: {port}\r\n\r\n".encode())
    return sock, _read_head(sock)


def test_clients_that_never_read_hold_a_window_each(ws_node: NodeProcess, ws_sandbox_id: str,
                                                     guest: _EndlessGuest) -> None:
    dog = RssWatchdog(ws_node, RSS_BOUND)
    sockets: list[socket.socket] = []
    try:
        port = guest.server_address[1]
        for _ in range(K):
            try:
                sock, head = open_non_reader(ws_node, ws_sandbox_id, port)
            except OSError:
                dog.check()  # the watchdog killed the node: say so
                raise
            sockets.append(sock)
            assert head.startswith(b"HTTP/1.1 101"), head
        # one more is over the sandbox's cap: 429, naming the setting
        extra, head = open_non_reader(ws_node, ws_sandbox_id, port)
        with extra:
            extra.settimeout(10)
            body = b""
            with contextlib.suppress(OSError):
                while chunk := extra.recv(65536):
                    body += chunk
        assert head.startswith(b"HTTP/1.1 429"), head
        assert b"AENV_PROXY_MAX_WEBSOCKETS" in body, body
        # the guest is blocked once no connection moves a byte any more: a relay that reads
        # ahead of its clients grows the node past the bound first (the watchdog kills it)
        deadline = time.monotonic() + 300
        last: dict[int, int] = {}
        quiet = 0
        while quiet < QUIET_POLLS:
            dog.check()
            assert time.monotonic() < deadline, f"the guest never blocked: {guest.sent}"
            time.sleep(1)
            now = dict(guest.sent)
            quiet = quiet + 1 if len(now) == K and now == last else 0
            last = now
        dog.check()
        assert all(sent > 0 for sent in last.values()), last
        growth = dog.peak - dog.start
        assert growth < RSS_BOUND, f"the node grew by {growth >> 20} MiB"
        # the node still answers
        assert httpx.get(ws_node.url + "/health", timeout=30).status_code == 200
    finally:
        for sock in sockets:
            sock.close()
        dog.stop()
    dog.check()


def test_a_reading_client_gets_every_byte_in_order(ws_node: NodeProcess, ws_sandbox_id: str,
                                                   guest: _EndlessGuest) -> None:
    from websockets.sync.client import connect

    guest.endless = False
    url = ws_node.url.replace("http://", "ws://") + "/"
    headers: dict[str, Any] = {"E2b-Sandbox-Id": ws_sandbox_id,
                               "E2b-Sandbox-Port": str(guest.server_address[1])}
    with connect(url, additional_headers=headers, max_size=None, open_timeout=30) as ws:
        message = ws.recv(timeout=120)
        assert isinstance(message, bytes) and len(message) == MESSAGE
        assert message == guest.payload
