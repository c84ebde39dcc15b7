"""Serving this node's verified chunks to its peers over HTTP (docs/remote-layers.md §4).

    GET /blobs                  JSON: the blobs held ({digest, size, chunks, complete})
    GET /blobs/<digest>         with `Range: bytes=a-b`: 206 and exactly those bytes when every
                                one of them is held and verified here, else 404

Every request carries `Authorization: Bearer <peer key>` (agentenv.cluster_keys.peer_key, derived
from the cluster secret, which nodes do not hold); anything else gets 401. A
range is served only from chunks that passed their check (ZFile CRCs), from a blob whose
sha256 matched, or from the metadata ranges that were checked when the blob was opened.

A peer is not trusted with blockd's threads and descriptors: every socket read or write waits
at most `idle_timeout` (an idle keep-alive connection is closed after it), and at most
`max_connections` are served at once (one thread each); one more is closed at once.
"""

from __future__ import annotations

import hmac
import json
import logging
import os
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from agentenv.blockd.remote.store import RemoteStore

log = logging.getLogger("agentenv.blockd.remote.p2p")

_RANGE = re.compile(r"^bytes=(\d+)-(\d+)$")
_BLOB = re.compile(r"^/blobs/sha256:([0-9a-f]{64})$")
MAX_RANGE = 64 << 20
IDLE_TIMEOUT = 30.0
MAX_CONNECTIONS = 64


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    store: RemoteStore
    secret: bytes
    idle_timeout: float
    slots: threading.BoundedSemaphore  # max_connections
    refused = 0  # connections closed at once: over max_connections

    def process_request(self, request: Any, client_address: Any) -> None:
        if not self.slots.acquire(blocking=False):
            self.refused += 1
            log.warning("p2p connection cap reached", extra={
                "event": "over_capacity", "peer": str(client_address[0])})
            self.shutdown_request(request)
            return
        try:
            super().process_request(request, client_address)
        except BaseException:
            self.slots.release()
            raise

    def process_request_thread(self, request: Any, client_address: Any) -> None:
        try:
            super().process_request_thread(request, client_address)
        finally:
            self.slots.release()

    def server_bind(self) -> None:
        # HTTPServer.server_bind looks the host name up (getfqdn): with an unreachable DNS
        # resolver that blocks for minutes. The name is never used.
        import socketserver

        socketserver.TCPServer.server_bind(self)
        host, port = self.server_address[:2]
        self.server_name = str(host)
        self.server_port = int(port)


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"
    timeout = IDLE_TIMEOUT  # replaced per server (PeerServer); socket.settimeout in setup()

    def setup(self) -> None:
        self.timeout = self.server.idle_timeout
        super().setup()

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

    def do_GET(self) -> None:
        got = self.headers.get("Authorization", "")
        want = b"Bearer " + self.server.secret
        if not self.server.secret or not hmac.compare_digest(got.encode(), want):
            self._send(401, b"peer key required\n")
            return
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
                 idle_timeout: float = IDLE_TIMEOUT, max_connections: int = MAX_CONNECTIONS) -> None:
        host, _, port = listen.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"p2p listen address {listen!r} is not host:port")
        if not secret:
            raise ValueError("serving peers needs the peer key (AENV_PEER_KEY[_FILE])")
        self.server = _Server((host.strip("[]"), int(port)), _Handler)
        self.server.store = store
        self.server.secret = secret.encode()
        self.server.idle_timeout = idle_timeout
        self.server.slots = threading.BoundedSemaphore(max_connections)
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
