"""Serving this node's verified chunks to its peers over HTTP (docs/remote-layers.md §4).

    GET /blobs                  JSON: the blobs held ({digest, size, chunks, complete})
    GET /blobs/<digest>         with `Range: bytes=a-b`: 206 and exactly those bytes when every
                                one of them is held and verified here, else 404

Every request carries `Authorization: Bearer <peer key>` (agentenv.cluster_keys.peer_key, derived
from the cluster secret, which nodes do not hold); anything else gets 401. A
range is served only from chunks that passed their check (ZFile CRCs), from a blob whose
sha256 matched, or from the metadata ranges that were checked when the blob was opened.

A peer is not trusted with blockd's threads and descriptors, and a stranger (anyone on the
cluster network, no key) is trusted with less:

- a request head must arrive whole within `idle_timeout` of the server starting to wait for it
  (a deadline for the head, not for each read: a head sent one byte at a time is cut at it;
  an idle keep-alive connection is closed after it); a write waits at most `idle_timeout`;
- `max_connections` counts only connections that presented the peer key (one thread each):
  while that many are served, one more connection is closed at once;
- a connection that has not yet presented the key is one of at most `max_unkeyed`; one more
  closes the oldest of them (a peer sends its whole head at once, a stranger holding sockets
  does not), so strangers cannot keep a keyed peer out. A head without the key gets 401 and
  the connection is closed.
"""

from __future__ import annotations

import contextlib
import hmac
import io
import json
import logging
import os
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from agentenv.logs import Sampled

if TYPE_CHECKING:
    from agentenv.blockd.remote.store import RemoteStore

log = logging.getLogger("agentenv.blockd.remote.p2p")

_RANGE = re.compile(r"^bytes=(\d+)-(\d+)$")
_BLOB = re.compile(r"^/blobs/sha256:([0-9a-f]{64})$")
MAX_RANGE = 64 << 20
IDLE_TIMEOUT = 30.0
MAX_CONNECTIONS = 64
MAX_UNKEYED = 16


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    store: RemoteStore
    secret: bytes
    idle_timeout: float
    refused = 0  # connections closed: over max_connections
    evicted = 0  # connections without the key closed for a newer one (over max_unkeyed)

    def __init__(self, address: tuple[str, int], max_connections: int,
                 max_unkeyed: int) -> None:
        self.max_connections, self.max_unkeyed = max_connections, max_unkeyed
        self.lock = threading.Lock()
        self.unkeyed: dict[socket.socket, None] = {}  # oldest first
        self.keyed: set[socket.socket] = set()  # each holds one of max_connections
        self.over_capacity = Sampled()
        super().__init__(address, _Handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A peer or stranger that resets mid-answer: not a traceback on stderr per connection.
        log.debug("p2p connection failed", exc_info=True)

    def refuse(self, peer: str) -> None:
        self.refused += 1
        if self.over_capacity.tick():
            log.warning("p2p connection cap reached", extra={
                "event": "over_capacity", "peer": peer, "count": self.over_capacity.count})

    def process_request(self, request: Any, client_address: Any) -> None:
        with self.lock:
            full = len(self.keyed) >= self.max_connections
            if not full:
                if len(self.unkeyed) >= self.max_unkeyed:
                    oldest = next(iter(self.unkeyed))
                    del self.unkeyed[oldest]
                    self.evicted += 1
                    with contextlib.suppress(OSError):  # (closed by its thread meanwhile)
                        oldest.shutdown(socket.SHUT_RDWR)  # its read returns: its thread ends
                self.unkeyed[request] = None
        if full:
            self.refuse(str(client_address[0]))
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self._forget(request)
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self._forget(request)

    def _forget(self, request: socket.socket) -> None:
        with self.lock:
            self.unkeyed.pop(request, None)
            self.keyed.discard(request)

    def admit(self, request: socket.socket) -> bool:
        """A connection presented the key: it takes one of max_connections (False: none is
        free, or it was closed for a newer one meanwhile)."""
        with self.lock:
            if request in self.keyed:
                return True
            if request not in self.unkeyed or len(self.keyed) >= self.max_connections:
                return False
            del self.unkeyed[request]
            self.keyed.add(request)
            return True

    def server_bind(self) -> None:
        # HTTPServer.server_bind looks the host name up (getfqdn): with an unreachable DNS
        # resolver that blocks for minutes. The name is never used.
        import socketserver

        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name = str(host)
        self.server_port = int(port)


class _HeadReader(io.RawIOBase):
    """The connection's reads, each waiting at most until `deadline` (time.monotonic): a
    socket timeout alone is per read, and a head dripped a byte at a time never trips it."""

    def __init__(self, sock: socket.socket) -> None:
        super().__init__()
        self.sock = sock
        self.deadline = 0.0

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        remaining = self.deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError("request head deadline")
        self.sock.settimeout(remaining)
        return self.sock.recv_into(buffer)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"
    timeout = IDLE_TIMEOUT  # replaced per server (PeerServer); socket.settimeout in setup()

    def setup(self) -> None:
        self.timeout = self.server.idle_timeout
        super().setup()
        self.head_reader = _HeadReader(self.connection)
        self.rfile = io.BufferedReader(self.head_reader)

    def handle_one_request(self) -> None:
        self.head_reader.deadline = time.monotonic() + self.server.idle_timeout
        super().handle_one_request()

    def parse_request(self) -> bool:
        """The head is read: only a connection with the peer key goes on (and takes a slot)."""
        if not super().parse_request():
            return False
        self.connection.settimeout(self.server.idle_timeout)  # for the writes
        got = self.headers.get("Authorization", "")
        want = b"Bearer " + self.server.secret
        if not self.server.secret or not hmac.compare_digest(got.encode(), want):
            self.close_connection = True
            self._send(401, b"peer key required\n")
            return False
        if not self.server.admit(self.connection):
            self.close_connection = True
            self.server.refuse(str(self.client_address[0]))
            self._send(503, b"too many peer connections\n")
            return False
        return True

    def log_message(self, format: str, *args: object) -> None:
        log.debug("p2p " + format, *args)

    def _send(self, status: int, body: bytes = b"", ctype: str = "text/plain",
              headers: dict[str, str] | None = None) -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.end_headers()
        if body and self.command != "HEAD":
            self.wfile.write(body)

    def do_GET(self) -> None:  # (parse_request checked the key)
        store = self.server.store
        if self.path == "/blobs":
            self._send(200, json.dumps(store.held()).encode(), "application/json")
            return
        match = _BLOB.match(self.path)
        if match is None:
            self._send(404, b"no such path\n")
            return
        rng = _RANGE.match(self.headers.get("Range", ""))
        if rng is None:
            self._send(416, b"a Range: bytes=a-b header is required\n")
            return
        start, end = int(rng.group(1)), int(rng.group(2)) + 1
        if end <= start or end - start > MAX_RANGE:
            self._send(416, b"bad or too large range\n")
            return
        data = store.serve_range(match.group(1), start, end)
        if data is None:
            self._send(404, b"not held (or not verified) here\n")
            return
        self._send(206, data, "application/octet-stream",
                   {"Content-Range": f"bytes {start}-{end - 1}/{store.blob_size(match.group(1))}"})


class PeerServer:
    def __init__(self, store: RemoteStore, listen: str, secret: str, *,
                 idle_timeout: float = IDLE_TIMEOUT, max_connections: int = MAX_CONNECTIONS,
                 max_unkeyed: int = MAX_UNKEYED) -> None:
        host, _, port = listen.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"p2p listen address {listen!r} is not host:port")
        if not secret:
            raise ValueError("serving peers needs the peer key (AENV_PEER_KEY[_FILE])")
        self.server = _Server((host.strip("[]"), int(port)), max_connections, max_unkeyed)
        self.server.store = store
        self.server.secret = secret.encode()
        self.server.idle_timeout = idle_timeout
        self.address = f"{host}:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, name="remote-p2p",
                                        daemon=True)

    def start(self) -> None:
        self._thread.start()
        log.info("serving chunks to peers", extra={"address": self.address, "pid": os.getpid()})

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(5)
