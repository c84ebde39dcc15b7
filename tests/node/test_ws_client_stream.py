"""A client's WebSocket messages go to the guest as they come, not gathered whole by the node.

uvicorn's WebSocket protocol gathers each client message whole (up to the 16 MiB message cap)
before the relay sees it, and the relay held it until the guest had taken it all: 32 clients
each sending one 16 MiB message to a guest that does not read took the node over 1 GiB. The
node now reads client frames itself and relays pieces of a small window as they arrive,
reading a client only as fast as its guest takes the bytes (relay/websocket.py). Here: the
start of one large frame reaches the guest before the client sent the rest, every byte
arrives in order; K clients sending 16 MiB messages to a guest that never reads grow the
node by less than RSS_BOUND (the watchdog kills a node past it). The guest stand-in is a
server on loopback (with the process backend a sandbox port P is 127.0.0.1:P).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import socket
import socketserver
import struct
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from websockets.frames import apply_mask

from tests.node.conftest import WS_CLIENTS, NodeProcess, free_host_port
from tests.node.test_hostile_guest import RssWatchdog
from tests.node.test_ws_backpressure import _answer_upgrade, _read_head

K = WS_CLIENTS  # the node's WebSocket limit (conftest.ws_node)
RSS_BOUND = 100 << 20
MESSAGE = (16 << 20) - 4096  # under the node's 16 MiB message limit
QUIET_POLLS = 3

pytestmark = pytest.mark.timeout(600)


def _recv_exact(sock: socket.socket, size: int) -> bytes:
    data = bytearray()
    while len(data) < size:
        chunk = sock.recv(min(size - len(data), 1 << 20))
        if not chunk:
            raise ConnectionError(f"closed after {len(data)} of {size} bytes")
        data += chunk
    return bytes(data)


class _Guest(socketserver.ThreadingTCPServer):
    """The guest's WebSocket server: reads client frames and records, per connection, the
    payload bytes received, their sha256 and whether a message ended; or, with `reading`
    unset, answers the handshake and never reads again (until `release`)."""

    daemon_threads = True
    allow_reuse_address = True

    def __init__(self, reading: bool) -> None:
        self.reading = reading
        self.release = threading.Event()
        self.received: dict[int, int] = {}
        self.digests: dict[int, str] = {}
        self.ended: dict[int, int] = {}  # connection: size of its first whole message
        super().__init__(("127.0.0.1", free_host_port()), _GuestHandler, bind_and_activate=False)
        if not reading:  # a small window: what the node sends waits in its own buffers
            self.socket.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.server_bind()
        self.server_activate()


class _GuestHandler(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        server: _Guest = self.server  # type: ignore[assignment]
        sock: socket.socket = self.request
        _answer_upgrade(sock)
        me = id(self)
        server.received[me] = 0
        if not server.reading:
            server.release.wait()
            return
        digest = hashlib.sha256()
        size = 0
        with contextlib.suppress(OSError):
            while True:
                b0, b1 = _recv_exact(sock, 2)
                length = b1 & 0x7F
                if length == 126:
                    (length,) = struct.unpack("!H", _recv_exact(sock, 2))
                elif length == 127:
                    (length,) = struct.unpack("!Q", _recv_exact(sock, 8))
                mask = _recv_exact(sock, 4) if b1 & 0x80 else b""
                payload = _recv_exact(sock, length)
                if mask:
                    payload = apply_mask(payload, mask)
                if b0 & 0x0F >= 8:  # control: a close ends the connection
                    if b0 & 0x0F == 8:
                        return
                    continue
                digest.update(payload)
                size += length
                server.received[me] += length
                server.digests[me] = digest.hexdigest()
                if b0 & 0x80:
                    server.ended.setdefault(me, size)


@contextlib.contextmanager
def _guest(reading: bool) -> Iterator[_Guest]:
    server = _Guest(reading)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server
    finally:
        server.release.set()
        server.shutdown()
        server.server_close()


def _open(node: NodeProcess, sid: str, port: int) -> socket.socket:
    """A WebSocket to the guest's `port` through the node (raw: frames are written here)."""
    sock = socket.socket()
    sock.settimeout(60)
    sock.connect(("127.0.0.1", node.port))
    key = os.urandom(16).hex()[:22].encode() + b"=="
    sock.sendall(b"GET / HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
                 b"Connection: Upgrade\r\nSec-WebSocket-Version: 13\r\nSec-WebSocket-Key: " + key
                 + f"\r\nE2b-Sandbox-Id: {sid}\r\nE2b-Sandbox-Port: {port}\r\n\r\n".encode())
    head = _read_head(sock)
    assert head.startswith(b"HTTP/1.1 101"), head
    return sock


def _frame_head(length: int, mask: bytes) -> bytes:
    """The head of one masked binary frame that ends its message."""
    return b"\x82\xff" + struct.pack("!Q", length) + mask


def _wait(what: str, condition: object, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, f"not in {timeout:g} s: {what}"
        time.sleep(0.2)


def test_a_clients_message_reaches_the_guest_as_it_comes(ws_node: NodeProcess,
                                                          ws_sandbox_id: str) -> None:
    payload = os.urandom(MESSAGE)
    mask = os.urandom(4)
    masked = apply_mask(payload, mask)
    with _guest(reading=True) as guest, _open(ws_node, ws_sandbox_id,
                                               guest.server_address[1]) as sock:
        sock.sendall(_frame_head(MESSAGE, mask) + masked[:1 << 20])
        # the first MiB of one frame is at the guest before the client sent the rest
        _wait("the start of the frame at the guest",
              lambda: sum(guest.received.values()) >= 1 << 20, timeout=60)
        assert not guest.ended
        sock.sendall(masked[1 << 20:])
        _wait("the whole message at the guest", lambda: bool(guest.ended), timeout=120)
        (conn,) = guest.ended
        assert guest.ended[conn] == MESSAGE
        assert guest.digests[conn] == hashlib.sha256(payload).hexdigest()


def test_clients_sending_to_a_guest_that_never_reads_hold_a_window_each(
        ws_node: NodeProcess, ws_sandbox_id: str) -> None:
    payload = memoryview(_frame_head(MESSAGE, b"\0\0\0\0") + bytes(MESSAGE))
    sent = [0] * K
    with _guest(reading=False) as guest:
        socks = [_open(ws_node, ws_sandbox_id, guest.server_address[1]) for _ in range(K)]
        dog = RssWatchdog(ws_node, RSS_BOUND)

        def send_all(i: int) -> None:
            with contextlib.suppress(OSError):
                for start in range(0, len(payload), 64 << 10):
                    socks[i].sendall(payload[start:start + (64 << 10)])
                    sent[i] = start + (64 << 10)

        for sock in socks:
            sock.settimeout(None)
        senders = [threading.Thread(target=send_all, args=(i,), daemon=True) for i in range(K)]
        try:
            for sender in senders:
                sender.start()
            # the clients are blocked once none moves a byte: a node that gathers messages
            # takes all of them first, and grows past the bound (the watchdog kills it)
            deadline = time.monotonic() + 300
            last: list[int] = []
            quiet = 0
            while quiet < QUIET_POLLS:
                dog.check()
                assert time.monotonic() < deadline, f"the clients never blocked: {sent}"
                time.sleep(1)
                now = list(sent)
                quiet = quiet + 1 if now == last and all(now) else 0
                last = now
            dog.check()
            growth = dog.peak - dog.start
            assert growth < RSS_BOUND, f"the node grew by {growth >> 20} MiB"
        finally:
            for sock in socks:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)
                sock.close()
            dog.stop()
        dog.check()


def test_messages_of_every_shape_are_relayed_and_the_limit_holds(ws_node: NodeProcess,
                                                                  ws_sandbox_id: str) -> None:
    """Text (UTF-8 split across fragments), binary, a message in fragments, a ping; a
    message over the limit is refused with 1009 at its head, a frame not masked with 1002."""
    from websockets.sync.client import connect

    from tests.node.conftest import ws_echo_server

    port = free_host_port()
    stop = ws_echo_server(port)
    url = ws_node.url.replace("http://", "ws://") + "/"
    headers = {"E2b-Sandbox-Id": ws_sandbox_id, "E2b-Sandbox-Port": str(port)}
    try:
        with connect(url, additional_headers=headers, max_size=None, open_timeout=30,
                     compression=None) as ws:
            ws.send("héllo wörld")
            assert ws.recv(timeout=30) == "héllo wörld"
            ws.send(b"\0\1\2")
            assert ws.recv(timeout=30) == b"\0\1\2"
            ws.send(iter(["h\xe9", "llo ", "w\xf6rld"]))  # text split over three frames
            assert ws.recv(timeout=30) == "héllo wörld"
            ws.ping(b"p").wait(30)
            ws.send(iter([b"a" * 70000, b"b" * 70000]))
            assert ws.recv(timeout=30) == b"a" * 70000 + b"b" * 70000
        with _open(ws_node, ws_sandbox_id, port) as sock:
            sock.sendall(_frame_head((16 << 20) + 1, b"\0\0\0\0"))
            close = _recv_exact(sock, 4)
            assert close[0] == 0x88 and struct.unpack("!H", close[2:4])[0] == 1009, close
        with _open(ws_node, ws_sandbox_id, port) as sock:
            sock.sendall(b"\x82\x01x")  # not masked
            close = _recv_exact(sock, 4)
            assert close[0] == 0x88 and struct.unpack("!H", close[2:4])[0] == 1002
    finally:
        stop()


class _WholeEcho:
    """An app that takes whole messages (it does not accept with fragments) and echoes them."""

    async def __call__(self, scope: dict[str, object], receive: Any, send: Any) -> None:
        if scope["type"] == "lifespan":
            while (await receive())["type"] != "lifespan.shutdown":
                await send({"type": "lifespan.startup.complete"})
            await send({"type": "lifespan.shutdown.complete"})
            return
        await receive()  # websocket.connect
        await send({"type": "websocket.accept"})
        while True:
            message = await receive()
            if message["type"] == "websocket.disconnect":
                return
            await send({"type": "websocket.send", "bytes": message.get("bytes"),
                        "text": message.get("text")})


def test_an_app_without_fragments_gets_whole_messages() -> None:
    """The protocol still serves apps that take whole messages (ASGI's websocket.receive),
    gathered within the message limit; text that is not UTF-8 closes with 1007."""
    import uvicorn
    from websockets.sync.client import connect

    from agentenv.relay.server import hardened_config
    from tests.control.helpers import wait_for
    from tests.node.conftest import free_port

    port = free_port()
    server = uvicorn.Server(hardened_config(_WholeEcho(), "127.0.0.1", port, 64 << 10, 30, 1,
                                            ws_max_bytes=1 << 20))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    try:
        wait_for("the server", lambda: server.started, timeout=30)
        with connect(f"ws://127.0.0.1:{port}/", max_size=None, open_timeout=30) as ws:
            ws.send(iter(["h\xe9", "llo"]))
            assert ws.recv(timeout=30) == "héllo"
            ws.send(b"x" * 300_000)
            assert ws.recv(timeout=30) == b"x" * 300_000
        sock = socket.create_connection(("127.0.0.1", port), timeout=30)
        with sock:
            sock.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\n"
                         b"Connection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
                         b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n\r\n")
            assert _read_head(sock).startswith(b"HTTP/1.1 101")
            sock.sendall(b"\x81\x82\0\0\0\0\xff\xfe")  # a text frame that is not UTF-8
            close = _recv_exact(sock, 4)
            assert close[0] == 0x88 and struct.unpack("!H", close[2:4])[0] == 1007, close
    finally:
        server.should_exit = True
        thread.join(30)
