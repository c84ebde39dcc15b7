"""Serving this node's verified chunks to its peers over HTTP (docs/remote-layers.md §4).

    GET /blobs/<digest>         with `Range: bytes=a-b` (whole chunks of this cache's chunk
                                size) and `X-Chunk-SHA256` (each chunk's SHA-256 from the
                                blob's table: chunkdigests.proof): 206 and exactly those bytes
                                when every one is held and verified here and the claim is the
                                blob's table's, else 404 (the same answer: no oracle for what
                                is held)

Who may ask: a node with the credential the scheduler issued it for this peer, made into one
for the request (`Authorization: AenvPeer r2/...`, agentenv.cluster_keys.peer_request_credential:
it names the asking node, comes from a credential made with this node's serving key, which the
node gives blockd with `remote_peers`, is good for this one request, and expires), or, for
static peers without a scheduler, a node of this blockd's peer trust file with a credential it
signed for this node and this request (`Authorization: AenvPeer s3/...`,
blockd/remote/identity.py: it names the node and this target). Both are bound to the request
(cluster_keys.peer_request: method, path, Range, chunk claim) and carry the time they were
made (within cluster_keys.MAX_SKEW_S of this node's clock) and a random nonce, and each is
taken once: after its credential verified, a request's (node, nonce) is recorded
(blockd/remote/nonces.py) before it takes a connection of its node's share or is served, and
a second use is 401 and the connection closed. The record lives in memory: a credential made
before the second the server started in is refused, so a restart does not reopen those taken by
the process before (but for those made within that second, before the start). So one seen on a plaintext network opens nothing,
not even the request it came with, and holds none of its node's connections. Anything
else gets 401 (the credentials of before, `v1/`, `s1/`, `r1/` and `s2/`, and the shared peer
key of old, `Bearer`, too), its log line naming why. The node a request came from is in its
log lines, and holds at most `max_per_node` of the keyed connections. Static and
scheduler-issued node ids are apart (`static/<id>` and `cluster/<id>`): a static peer named
like a cluster node, or the reverse, has a share of its own (of the connections and of the
nonce record).

The claim is compared with the blob's chunk table (kept by the store for every blob opened
here) before anything is read: a wrong claim, for a range held or not, is one compare of as
many bytes and a 404, and takes nothing of the byte budget; only a right claim is read. So a
node without a blob's table learns nothing, by answer or by time, of whether this node holds
it. A range is served only from chunks that passed their check (ZFile CRCs or the table),
from a blob whose sha256 matched, or from the metadata ranges checked when the blob was
opened.

A peer is not trusted with blockd's threads and descriptors, and a stranger (anyone on the
cluster network, no key) is trusted with less:

- a request head must arrive whole within `idle_timeout` of the server starting to wait for it
  (a deadline for the head, not for each read: a head sent one byte at a time is cut at it;
  an idle keep-alive connection is closed after it); a write waits at most `idle_timeout`;
- `max_connections` counts only connections that presented a credential (one thread each):
  while that many are served, one more connection is closed at once;
- a connection that has not yet presented one is one of at most `max_unkeyed`; one more
  closes the oldest of them (a peer sends its whole head at once, a stranger holding sockets
  does not), so strangers cannot keep a keyed peer out. A head without a credential gets 401
  and the connection is closed.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import TYPE_CHECKING, Any

from agentenv.blockd.remote.chunkdigests import PROOF_HEADER, claim_matches, claimed_digests
from agentenv.blockd.remote.identity import (
    REPLAYABLE_PREFIX,
    SIGNED_PREFIX,
    UNBOUND_PREFIX,
    TrustedPeers,
    check_signed_credential,
)
from agentenv.blockd.remote.nonces import MAX_PER_NODE as MAX_NONCES_PER_NODE
from agentenv.blockd.remote.nonces import MAX_TOTAL as MAX_NONCES
from agentenv.blockd.remote.nonces import Use, UsedNonces
from agentenv.cluster_keys import (
    MAX_SKEW_S,
    PEER_SCHEME,
    PeerRequestAuth,
    check_peer_credential,
    peer_request,
)
from agentenv.logs import Sampled

if TYPE_CHECKING:
    from agentenv.blockd.remote.store import RemoteStore

log = logging.getLogger("agentenv.blockd.remote.p2p")

_RANGE = re.compile(r"^bytes=(\d+)-(\d+)$")
_BLOB = re.compile(r"^/blobs/sha256:([0-9a-f]{64})$")
MAX_RANGE = 64 << 20
IDLE_TIMEOUT = 30.0
MAX_CONNECTIONS = 64
MAX_PER_NODE = 16  # of MAX_CONNECTIONS: one node cannot take them all
MAX_UNKEYED = 16
#: what the node a credential names is known as here (limits, logs): the two kinds of ids
#: come from different places (a trust file, the scheduler) and never share a budget
STATIC_KIND, CLUSTER_KIND = "static/", "cluster/"
#: the credentials of before: unbound (a scheduler's v1 sent as it is, a static s1), bound but
#: without a nonce (r1, s2)
_OLD_FORM = re.compile(rf"^{PEER_SCHEME} +(v1|s1|r1|s2)/")
#: bytes of ranges read for answers at once, over all connections: without it, 64 keyed
#: connections asking for 64 MiB each (with right claims: a wrong one reads nothing) would
#: hold 4 GiB of blockd's memory
MAX_BYTES_IN_FLIGHT = 256 << 20
# keyed requests whose claims were not the blob's table (a node without the table)
UNPROVEN = Sampled()


class ByteBudget:
    """Bytes that threads take before they read and give back after they answered; a taker
    waits at most `timeout` for its share."""

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._cond = threading.Condition()

    def take(self, amount: int, timeout: float) -> bool:
        if amount > self.limit:
            return False
        with self._cond:
            return self._cond.wait_for(lambda: self.used + amount <= self.limit, timeout) \
                and self._add(amount)

    def _add(self, amount: int) -> bool:
        self.used += amount
        return True

    def give(self, amount: int) -> None:
        with self._cond:
            self.used -= amount
            self._cond.notify_all()


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    store: RemoteStore
    node_id: str | None = None  # this node's id in its peers' trust files (static peers)
    trust: TrustedPeers | None = None  # the static peers served on their signed credentials
    serve_key: str | None = None  # what peers' credentials are checked with (set by the node)
    idle_timeout: float
    budget: ByteBudget
    max_skew: float = MAX_SKEW_S  # how far a credential's time may be from this clock
    #: credentials made before this (unix seconds: the second the server started in) are
    #: refused: the record of those taken before a restart is gone
    not_before = 0
    refused = 0  # connections closed: over max_connections
    evicted = 0  # connections without the key closed for a newer one (over max_unkeyed)

    def __init__(self, address: tuple[str, int], max_connections: int,
                 max_unkeyed: int, max_per_node: int, nonces: UsedNonces) -> None:
        self.max_connections, self.max_unkeyed = max_connections, max_unkeyed
        self.max_per_node = max_per_node
        self.nonces = nonces  # the credentials taken (each is taken once)
        self.replayed = Sampled()
        self.record_full = Sampled()
        self.lock = threading.Lock()
        self.unkeyed: dict[socket.socket, None] = {}  # oldest first
        self.keyed: dict[socket.socket, str] = {}  # each holds one of max_connections: its node
        self.per_node: dict[str, int] = {}  # keyed connections per node
        self.over_capacity = Sampled()
        self.unauthorised = Sampled()
        super().__init__(address, _Handler)

    def authenticate(self, header: str, request: bytes,
                     now: float) -> tuple[PeerRequestAuth | None, str]:
        """(what an Authorization header proves for `request` (peer_request) at `now`, its
        node as `static/<id>` or `cluster/<id>`, "") or (None, why not). Its nonce is not
        looked at here (parse_request: only after this)."""
        scheme, _, value = header.partition(" ")
        value = value.strip()
        if scheme == "Bearer":
            return None, ("the shared peer key is not taken: a node's own credential is "
                          "(the scheduler's, or one signed by a node of the peer trust file)")
        if scheme != PEER_SCHEME:
            return None, "no peer credential"
        if value.startswith((SIGNED_PREFIX, UNBOUND_PREFIX, REPLAYABLE_PREFIX)):
            if self.trust is None or self.node_id is None:
                return None, "no peer trust file here: signed credentials are not taken"
            auth, why = check_signed_credential(self.trust, self.node_id, value, now, request,
                                                 self.max_skew)
            kind = STATIC_KIND
        else:
            serve_key = self.serve_key
            if not serve_key:
                return None, "no serving key from the scheduler (yet)"
            auth, why = check_peer_credential(serve_key, value, now, request, self.max_skew)
            kind = CLUSTER_KIND
        if auth is None:
            return None, why
        if auth.made < self.not_before:
            # made before this server started: the record of credentials taken then is gone
            # (a restart), so it might have been taken already
            return None, ("made before this peer started (its record of credentials taken is "
                          "new; a node's next request is made after)")
        return PeerRequestAuth(kind + auth.node, auth.nonce, auth.until, auth.made), ""

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
            node = self.keyed.pop(request, None)
            if node is not None:
                left = self.per_node[node] - 1
                if left:
                    self.per_node[node] = left
                else:
                    del self.per_node[node]

    def admit(self, request: socket.socket, node: str) -> bool:
        """A connection presented `node`'s credential: it takes one of max_connections, and
        of its node's max_per_node (False: none is free, or it was closed for a newer one
        meanwhile, or it is another node's: a connection stays its first node's, so a node at
        its share is not served on connections admitted with another node's credential)."""
        with self.lock:
            if request in self.keyed:
                return self.keyed[request] == node
            if request not in self.unkeyed or len(self.keyed) >= self.max_connections \
                    or self.per_node.get(node, 0) >= self.max_per_node:
                return False
            del self.unkeyed[request]
            self.keyed[request] = node
            self.per_node[node] = self.per_node.get(node, 0) + 1
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
    node = ""  # who the request's credential names (parse_request)
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
        """The head is read: only a connection with a valid credential, not taken before,
        goes on (and takes a slot). In this order: the credential is verified (a forged one
        records nothing), its nonce is recorded (a second use is refused here, before it takes
        a connection of its node's share), then the connection is admitted."""
        if not super().parse_request():
            return False
        self.connection.settimeout(self.server.idle_timeout)  # for the writes
        server = self.server
        # what the credential must be made for: this request (the same header values as
        # do_GET reads)
        request = peer_request(self.command, self.path, self.headers.get("Range"),
                               self.headers.get(PROOF_HEADER))
        now = time.time()
        auth, why = server.authenticate(self.headers.get("Authorization", ""), request, now)
        if auth is None:
            self.close_connection = True
            if server.unauthorised.tick():
                log.warning("a peer request without a valid credential", extra={
                    "event": "unauthorised", "peer": self.client_address[0], "reason": why,
                    "count": server.unauthorised.count})
            body = (b"a peer credential is required (the scheduler's, or one signed by a node "
                    b"of this peer's trust file), made for this request\n")
            if _OLD_FORM.match(self.headers.get("Authorization", "")):
                # an asking blockd of before: its operator is told why (what other refusals
                # say, such as which nodes are trusted, is for this node's log only)
                body = f"{why}\n".encode()
            self._send(401, body)
            return False
        node = auth.node
        used = server.nonces.use(node, auth.nonce, auth.until, now)
        if used is not Use.FIRST:
            self.close_connection = True
            if used is Use.REPLAYED:
                if server.replayed.tick():
                    log.warning("a peer credential used again (a replay: each is taken once)",
                                extra={"event": "replayed", "peer": self.client_address[0],
                                       "node": node, "count": server.replayed.count})
                self._send(401, b"this peer credential was taken before (each is good for "
                                b"one request, once)\n")
            else:
                if server.record_full.tick():
                    log.warning("the record of peer credentials taken is full: refused",
                                extra={"event": "record_full", "peer": self.client_address[0],
                                       "node": node, "count": server.record_full.count})
                self._send(503, b"too many recent requests from this node (the record of "
                                b"credentials taken is full); try again\n")
            return False
        self.node = node
        if not server.admit(self.connection, node):
            self.close_connection = True
            server.refuse(f"{self.client_address[0]} ({node})")
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
        if self.close_connection:
            # said, so a keep-alive client does not send its next request into the close
            self.send_header("Connection", "close")
        self.end_headers()
        if body and self.command != "HEAD":
            self.wfile.write(body)

    def do_GET(self) -> None:  # (parse_request checked the credential)
        store = self.server.store
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
        claimed = self.headers.get(PROOF_HEADER)
        if claimed is None:
            self._send(400, f"the chunks' SHA-256 ({PROOF_HEADER}) are required\n".encode())
            return
        hex_ = match.group(1)
        chunk_size = store.cache.chunk_size
        # The claim against the blob's table before anything is read or looked up: the same
        # work whether the blob is known here, held, or neither (chunkdigests.claim_matches).
        digests = claimed_digests(claimed, start, end, chunk_size)
        if digests is None or not claim_matches(store.chunk_table(hex_), start, digests):
            if digests is not None and UNPROVEN.tick():
                log.warning("a peer asked for chunks without their digests",
                            extra={"peer": self.client_address[0], "node": self.node,
                                   "blob": hex_, "count": UNPROVEN.count})
            self._send(404, b"not held (or not verified) here\n")
            return
        size = store.blob_size(hex_)
        if end > size or (end % chunk_size and end != size):  # whole chunks only
            self._send(404, b"not held (or not verified) here\n")
            return
        budget = self.server.budget
        if not budget.take(end - start, self.server.idle_timeout):
            self._send(503, b"too many bytes being served; try again\n")
            return
        try:
            data = store.serve_range(hex_, start, end)
            if data is None:
                self._send(404, b"not held (or not verified) here\n")
                return
            self._send(206, data, "application/octet-stream",
                       {"Content-Range": f"bytes {start}-{end - 1}/{size}"})
        finally:
            budget.give(end - start)


class PeerServer:
    def __init__(self, store: RemoteStore, listen: str, *, node_id: str | None = None,
                 trust: TrustedPeers | None = None, serve_key: str | None = None,
                 idle_timeout: float = IDLE_TIMEOUT, max_connections: int = MAX_CONNECTIONS,
                 max_unkeyed: int = MAX_UNKEYED, max_per_node: int = MAX_PER_NODE,
                 max_bytes_in_flight: int = MAX_BYTES_IN_FLIGHT, max_skew: float = MAX_SKEW_S,
                 max_nonces_per_node: int = MAX_NONCES_PER_NODE,
                 max_nonces: int = MAX_NONCES) -> None:
        """`node_id` and `trust`: this node's id and the static peers whose signed credentials
        it takes (identity.py); `serve_key`: what the credentials the scheduler issues are
        checked with (set_serve_key: the node gives it). With neither, every request is 401
        until the node gives the serving key. `max_skew`: how far the time a credential was
        made may be from this clock; `max_nonces_per_node`, `max_nonces`: the record of
        credentials taken (nonces.py)."""
        host, _, port = listen.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"p2p listen address {listen!r} is not host:port")
        self.server = _Server((host.strip("[]"), int(port)), max_connections, max_unkeyed,
                              max_per_node, UsedNonces(max_nonces_per_node, max_nonces))
        self.server.max_skew = max_skew
        self.server.not_before = int(time.time())
        self.server.store = store
        self.server.node_id, self.server.trust = node_id, trust
        self.server.serve_key = serve_key
        self.server.idle_timeout = idle_timeout
        self.server.budget = ByteBudget(max_bytes_in_flight)
        self.address = f"{host}:{self.server.server_address[1]}"
        self._thread = threading.Thread(target=self.server.serve_forever, name="remote-p2p",
                                        daemon=True)

    def set_serve_key(self, key: str) -> None:
        if key != self.server.serve_key:
            self.server.serve_key = key
            log.info("peers are served on their nodes' credentials from the scheduler",
                     extra={"address": self.address})

    def start(self) -> None:
        self._thread.start()
        log.info("serving chunks to peers", extra={"address": self.address, "pid": os.getpid()})

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self._thread.join(5)
