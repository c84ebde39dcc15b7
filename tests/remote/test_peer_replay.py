"""Each peer request credential is taken once (docs/security.md §5; red team of 2026-12-07,
issue 23): real chunk servers (PeerServer) and stores on loopback, a real registry, a TCP relay
on the path recording what the asking node sends, for static peers' signed credentials (s3)
and the scheduler's (r2):

- the exact request seen on the wire, replayed within its credential's window, headers and
  all (and re-encoded: the nonce's other base64 spellings, the time with leading zeros), is
  refused: 401 naming why, the connection closed, none of its node's share taken;
- the finding: replayed on 16 keep-alive connections, the captured requests no longer hold the
  node's share at that peer: the real node is still served by the peer, not the registry;
- a forged credential carrying a node's nonce (a bad signature or MAC, another key, another
  request) is refused before the record is looked at, so it burns nothing: the node's real
  request with that nonce is served;
- the record is bounded per node and in all (a clear 503 past it, other nodes still served),
  and its entries go when their credentials' time is past;
- a restarted peer (its record empty) refuses what was made before it started;
- a credential is taken only within MAX_SKEW_S of the peer's clock.
"""

from __future__ import annotations

import io
import logging
import re
import socket
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from agentenv.blockd.remote.chunkdigests import PROOF_HEADER, ChunkDigests, proof
from agentenv.blockd.remote.identity import NodeIdentity, TrustedPeers, check_signed_credential
from agentenv.blockd.remote.nonces import Use, UsedNonces
from agentenv.blockd.remote.p2p import MAX_PER_NODE, PeerServer
from agentenv.blockd.remote.store import RemoteConfig, RemoteStore, Resolver
from agentenv.cluster_keys import (
    MAX_SKEW_S,
    PEER_SCHEME,
    check_peer_credential,
    new_nonce,
    peer_credential,
    peer_request,
    peer_request_credential,
)
from tests.remote.peerids import identities, request_of, trust_text, trusting
from tests.remote.test_chunk_cache import CHUNK, _ref, _Resolver, hello  # noqa: F401 (fixture)
from tests.remote.test_peer_request_binding import Sniffer, holder  # noqa: F401 (fixture)
from tests.template.conftest import Registry

SERVE_KEY = "5e" * 32  # p1's peer serving key (what its node derives from its node key)
KINDS = ("static", "cluster")


class Mesh:
    """Chunk server p1 (holding the `hello` blob) taking `kind` credentials, and what node x
    (and a trusted node z) need to ask it."""

    def __init__(self, kind: str, tmp_path: Path, store: RemoteStore, **limits: float) -> None:
        self.kind, self.tmp_path = kind, tmp_path
        self.nodes = identities(tmp_path, "p1", "x", "z")
        self.server = self.serving(store, **limits)
        self.resolver = _Resolver()
        self.sniffer = Sniffer(self.server.address)
        self.stores: list[RemoteStore] = []

    def serving(self, store: RemoteStore, **limits: float) -> PeerServer:
        """Node p1's chunk server (started) for `store`."""
        if self.kind == "static":
            server = PeerServer(store, "127.0.0.1:0", node_id="p1",
                                trust=trusting({n: self.nodes[n] for n in ("x", "z")}),
                                **limits)  # type: ignore[arg-type]
        else:
            server = PeerServer(store, "127.0.0.1:0", serve_key=SERVE_KEY,
                                **limits)  # type: ignore[arg-type]
        server.start()
        return server

    @property
    def address(self) -> tuple[str, int]:
        return ("127.0.0.1", int(self.server.address.rpartition(":")[2]))

    def known_as(self, node: str) -> str:
        return f"{self.kind}/{node}"

    def credential(self, node: str, request: bytes, now: float | None = None,
                   nonce: bytes | None = None) -> str:
        """The Authorization header node `node` sends p1 for `request`."""
        if self.kind == "static":
            made = self.nodes[node].credential_for("p1", request, now, nonce)
        else:
            issued = peer_credential(SERVE_KEY, node, int(time.time()) + 120)
            made = peer_request_credential(issued, request, now, nonce)
        return f"{PEER_SCHEME} {made}"

    def node_x(self, name: str, via_sniffer: bool = True) -> RemoteStore:
        """Node x's store (a cache of its own under `name`), asking p1 (through the relay)."""
        address = self.sniffer.address if via_sniffer else self.server.address
        config = RemoteConfig(self.tmp_path / name, capacity=64 * CHUNK, chunk_size=CHUNK,
                              background_bw=0, timeout=5)
        if self.kind == "static":
            config.identity = self.nodes["x"]
            config.peers = [f"http://{address}"]
            config.trust = TrustedPeers(text=trust_text({"p1": self.nodes["p1"]},
                                                        {"p1": address}))
        store = RemoteStore(config)
        if self.kind == "cluster":
            self.resolver.holders = [{
                "address": address, "complete": True,
                "credential": peer_credential(SERVE_KEY, "x", int(time.time()) + 120)}]
            store.set_resolver(Resolver(self.resolver.url))
        self.stores.append(store)
        return store

    def close(self) -> None:
        for store in self.stores:
            store.close()
        self.sniffer.close()
        self.resolver.stop()
        self.server.stop()


@pytest.fixture(params=KINDS)
def mesh(request: pytest.FixtureRequest, tmp_path: Path,
         holder: tuple[RemoteStore, bytes, str]) -> Iterator[Mesh]:  # noqa: F811
    made = Mesh(request.param, tmp_path, holder[0])
    try:
        yield made
    finally:
        made.close()


def heads(sniffer: Sniffer) -> list[bytes]:
    """The request heads (exact bytes, the blank line included) the asking node sent for
    chunks."""
    found = []
    for record in list(sniffer.sent):
        for head in bytes(record).split(b"\r\n\r\n"):
            if head.startswith(b"GET /blobs/"):
                found.append(head + b"\r\n\r\n")
    return found


def exchange(sock: socket.socket, head: bytes) -> tuple[bytes, dict[str, str], bytes]:
    """Sends `head` on `sock` and reads one whole answer: (status line, headers with
    lower-case names, body)."""
    sock.sendall(head)
    data = b""
    while b"\r\n\r\n" not in data:
        more = sock.recv(65536)
        assert more, data
        data += more
    top, _, body = data.partition(b"\r\n\r\n")
    lines = top.decode("latin-1").split("\r\n")
    headers = {k.strip().lower(): v.strip()
               for k, _, v in (line.partition(":") for line in lines[1:])}
    while len(body) < int(headers["content-length"]):
        more = sock.recv(65536)
        assert more
        body += more
    return lines[0].encode(), headers, body


def closed_by_server(sock: socket.socket, within: float = 10) -> bool:
    sock.settimeout(within)
    try:
        return sock.recv(1) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def replay(address: tuple[str, int], head: bytes) -> tuple[bytes, dict[str, str], bytes, bool]:
    """`head` sent on a connection of its own: the answer, and whether the server closed it."""
    with socket.create_connection(address, timeout=10) as sock:
        status, headers, body = exchange(sock, head)
        return status, headers, body, closed_by_server(sock)


def with_authorization(head: bytes, authorization: str) -> bytes:
    return re.sub(rb"(?im)^authorization:[^\r\n]*", b"Authorization: " + authorization.encode(),
                  head)


def authorization_of(head: bytes) -> str:
    match = re.search(rb"(?im)^authorization: *([^\r\n]*)", head)
    assert match is not None, head
    return match.group(1).decode()


def reencodings(credential: str) -> list[str]:
    """Other spellings of the same (node, time, nonce) that verify as well: the nonce's last
    base64 character with its unused low bits set (16 bytes are 22 characters: the last
    carries 2 bits), the time with a leading zero, more spaces after the scheme."""
    scheme, _, value = credential.partition(" ")
    parts = value.split("/")
    time_at, nonce_at = 3, 4  # s3/<node>/<target>/TIME/NONCE/.., r2/<node>/<expiry>/TIME/NONCE/..
    alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_"
    nonce = parts[nonce_at]
    respelt = nonce[:-1] + alphabet[alphabet.index(nonce[-1]) ^ 0b0101]
    assert respelt != nonce
    out = []
    for index, text in ((nonce_at, respelt), (time_at, "0" + parts[time_at])):
        changed = list(parts)
        changed[index] = text
        out.append(f"{scheme} {'/'.join(changed)}")
    out.append(f"{scheme}    {value}")
    return out


def verifies(mesh: Mesh, credential: str, request: bytes) -> bool:
    """The credential (an Authorization value) verifies for `request` (before the record)."""
    value = credential.split(None, 1)[1].strip()
    if mesh.kind == "static":
        trust = trusting({"x": mesh.nodes["x"]})
        return check_signed_credential(trust, "p1", value, time.time(), request)[0] is not None
    return check_peer_credential(SERVE_KEY, value, time.time(), request)[0] is not None


def read_all(store: RemoteStore, registry: Registry, digest: str, data: bytes,
             length: int | None = None) -> None:
    source = store.open_blob(_ref(registry, digest, len(data), data))
    try:
        length = len(data) if length is None else length
        assert source.pread(length, 0) == data[:length]
    finally:
        source.close()


def test_an_exact_replay_of_a_captured_request_is_refused_within_its_window(
        mesh: Mesh, registry: Registry, holder: tuple[RemoteStore, bytes, str],  # noqa: F811
        caplog: pytest.LogCaptureFixture) -> None:
    _, data, digest = holder
    x = mesh.node_x("x")
    read_all(x, registry, digest, data)
    assert x.stats.fetched.get("peer", 0) > 0 and x.stats.fetched.get("registry", 0) == 0
    seen = heads(mesh.sniffer)
    assert len(seen) >= 2, seen
    head = seen[0]
    credential = authorization_of(head)
    lines = head.decode("latin-1").split("\r\n")
    path = lines[0].split(" ")[1]
    fields = {k.strip().lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:])}
    request = peer_request("GET", path, fields["range"], fields[PROOF_HEADER.lower()])
    # the exact bytes again, on a connection of their own
    status, headers, body, closed = replay(mesh.address, head)
    assert status == b"HTTP/1.1 401 Unauthorized", (status, body[:100])
    assert credential.startswith(f"{PEER_SCHEME} {'s3' if mesh.kind == 'static' else 'r2'}/x/")
    made = int(credential.split("/")[3])
    assert time.time() - made < MAX_SKEW_S  # within its window: its time alone would pass
    # each request had its own nonce (a credential is made per request)
    nonces = {authorization_of(h).split("/")[4] for h in seen}
    assert len(nonces) == len(seen), seen
    assert b"taken before" in body and headers.get("connection") == "close" and closed
    keyed_before = dict(mesh.server.server.per_node)
    with caplog.at_level(logging.WARNING, "agentenv.blockd.remote.p2p"):
        status, headers, body, closed = replay(mesh.address, head)  # and again
        assert status == b"HTTP/1.1 401 Unauthorized", (status, body)
        assert b"taken before" in body and headers.get("connection") == "close" and closed
        # the same credential spelt otherwise (each still verifies: the record is keyed on
        # the verified values, not the header's text)
        for respelt in reencodings(credential):
            assert verifies(mesh, respelt, request), respelt
            status, headers, body, closed = replay(mesh.address,
                                                   with_authorization(head, respelt))
            assert status.startswith(b"HTTP/1.1 401") and b"taken before" in body, respelt
            assert closed
    assert any(getattr(r, "event", "") == "replayed" and
               getattr(r, "node", "") == mesh.known_as("x") for r in caplog.records)
    # none of the refused took a connection of x's share
    assert dict(mesh.server.server.per_node) == keyed_before
    # through the relay too (the path the request came by)
    host, _, port = mesh.sniffer.address.rpartition(":")
    status, _, body, _ = replay((host, int(port)), head)
    assert status.startswith(b"HTTP/1.1 401") and b"taken before" in body


def test_replays_on_16_keep_alive_connections_do_not_hold_the_victims_share(
        mesh: Mesh, registry: Registry, holder: tuple[RemoteStore, bytes, str],  # noqa: F811
) -> None:
    """The red team's finding: what a sniffer saw of node x's requests, replayed on 16
    kept-alive connections (x's whole share at p1, MAX_PER_NODE), held that share until the
    credentials expired: x's next requests there got 503 and it read from the registry. Now
    each replay is refused and its connection closed, and x is served by its peer."""
    _, data, digest = holder
    assert MAX_PER_NODE == 16
    first = mesh.node_x("x-first")
    read_all(first, registry, digest, data, 2 * CHUNK)
    first.close()  # (x's own connections go: its share at p1 is free)
    deadline = time.monotonic() + 10
    while mesh.server.server.per_node:
        assert time.monotonic() < deadline, mesh.server.server.per_node
        time.sleep(0.05)
    seen = heads(mesh.sniffer)
    assert seen
    attack: list[socket.socket] = []
    answers = []
    try:
        for i in range(MAX_PER_NODE):
            sock = socket.create_connection(mesh.address, timeout=10)
            attack.append(sock)
            answers.append(exchange(sock, seen[i % len(seen)]))  # kept alive
        held = mesh.server.server.per_node.get(mesh.known_as("x"), 0)
        # x (a fresh cache: every chunk asked again) is served by p1 while the attack's
        # sockets are open (before: every request 503, all from the registry)
        again = mesh.node_x("x-again", via_sniffer=False)
        read_all(again, registry, digest, data)
        assert again.stats.fetched.get("registry", 0) == 0, (held, again.stats.fetched)
        assert again.stats.fetched.get("peer", 0) > 0, again.stats.fetched
        # each replay was refused, its connection closed, none of x's share taken
        for status, _, body in answers:
            assert status.startswith(b"HTTP/1.1 401") and b"taken before" in body, status
        assert all(closed_by_server(sock) for sock in attack)
        assert held == 0
    finally:
        for sock in attack:
            sock.close()


def test_a_restarted_peer_refuses_what_was_made_before_it_started(
        mesh: Mesh, registry: Registry, holder: tuple[RemoteStore, bytes, str],  # noqa: F811
        caplog: pytest.LogCaptureFixture) -> None:
    """The record is in memory: p1 restarted (a new server, its record empty) refuses the
    requests seen before it started, and serves x's next ones."""
    store, data, digest = holder
    x = mesh.node_x("x")
    read_all(x, registry, digest, data, 2 * CHUNK)
    seen = heads(mesh.sniffer)
    assert seen
    mesh.server.stop()
    while time.time() % 1 > 0.9 or int(time.time()) <= int(authorization_of(seen[-1])
                                                            .split("/")[3]):
        time.sleep(0.05)  # (a second later than the last request was made)
    mesh.server = mesh.serving(store)
    with caplog.at_level(logging.WARNING, "agentenv.blockd.remote.p2p"):
        for head in seen:
            status, _, _, closed = replay(mesh.address, head)
            assert status.startswith(b"HTTP/1.1 401") and closed, status
    assert any("made before this peer started" in str(getattr(r, "reason", ""))
               for r in caplog.records)
    again = mesh.node_x("x-again", via_sniffer=False)
    read_all(again, registry, digest, data)
    assert again.stats.fetched.get("registry", 0) == 0 and again.stats.fetched.get("peer", 0)


def test_a_forged_request_with_a_fresh_nonce_burns_nothing(
        mesh: Mesh, holder: tuple[RemoteStore, bytes, str]) -> None:  # noqa: F811
    """Anyone may send a credential naming node x with a nonce of their choosing (a nonce x
    will use, say): it is checked before the record is looked at, so it records nothing, and
    x's own request with that nonce is served. Another node's own credential with the same
    nonce is its own (the record is per node)."""
    _, data, digest = holder
    table = ChunkDigests.compute(io.BytesIO(data).read, len(data), CHUNK)[0]
    path = f"/blobs/{digest}"
    headers = {"Range": f"bytes=0-{CHUNK - 1}", PROOF_HEADER: proof(table, 0, CHUNK)}
    request = request_of(path, headers)
    nonce = new_nonce()
    genuine = mesh.credential("x", request, nonce=nonce)
    scheme, _, value = genuine.partition(" ")
    proof_part = value.rsplit("/", 1)[1]
    flipped = proof_part[:5] + ("A" if proof_part[5] != "A" else "B") + proof_part[6:]
    other = {"Range": f"bytes={CHUNK}-{2 * CHUNK - 1}",
             PROOF_HEADER: proof(table, CHUNK, 2 * CHUNK)}
    if mesh.kind == "static":  # z's key (trusted) signing as x
        other_key = f"{PEER_SCHEME} " + NodeIdentity("x", mesh.nodes["z"].private_key) \
            .credential_for("p1", request, nonce=nonce)
    else:  # made from a credential issued with another peer's serving key
        other_key = f"{PEER_SCHEME} " + peer_request_credential(
            peer_credential("7a" * 32, "x", int(time.time()) + 120), request, nonce=nonce)
    forged = [f"{scheme} {value.rsplit('/', 1)[0]}/{flipped}",  # the signature or MAC altered
              other_key,
              # x's genuine credential, with that nonce, for another chunk
              mesh.credential("x", request_of(path, other), nonce=nonce)]
    url = f"http://{mesh.server.address}{path}"
    with httpx.Client(timeout=30) as client:
        for authorization in forged:
            reply = client.get(url, headers={**headers, "Authorization": authorization})
            assert reply.status_code == 401 and b"taken before" not in reply.content, \
                authorization
        assert mesh.server.server.nonces.of(mesh.known_as("x")) == 0
        # node z's own credential, with x's nonce: z is served (as z), x's nonce is not burnt
        reply = client.get(url, headers={**headers, "Authorization": mesh.credential(
            "z", request, nonce=nonce)})
        assert reply.status_code == 206
        assert mesh.server.server.nonces.of(mesh.known_as("z")) == 1
        assert mesh.server.server.nonces.of(mesh.known_as("x")) == 0
    with httpx.Client(timeout=30) as client:
        reply = client.get(url, headers={**headers, "Authorization": genuine})
        assert reply.status_code == 206 and reply.content == data[:CHUNK]
        assert mesh.server.server.nonces.of(mesh.known_as("x")) == 1
    with httpx.Client(timeout=30) as client:  # and once only
        reply = client.get(url, headers={**headers, "Authorization": genuine})
        assert reply.status_code == 401 and b"taken before" in reply.content


def test_a_credential_is_taken_only_within_the_skew_of_the_peers_clock(
        mesh: Mesh, holder: tuple[RemoteStore, bytes, str]) -> None:  # noqa: F811
    _, data, digest = holder
    table = ChunkDigests.compute(io.BytesIO(data).read, len(data), CHUNK)[0]
    path = f"/blobs/{digest}"
    headers = {"Range": f"bytes=0-{CHUNK - 1}", PROOF_HEADER: proof(table, 0, CHUNK)}
    request = request_of(path, headers)
    url = f"http://{mesh.server.address}{path}"
    mesh.server.server.not_before = 0  # (a peer started long ago: not_before is tested above)
    now = time.time()
    with httpx.Client(timeout=30) as client:
        for offset, status in ((-MAX_SKEW_S - 5, 401), (MAX_SKEW_S + 5, 401),
                               (-MAX_SKEW_S + 5, 206), (MAX_SKEW_S - 5, 206)):
            reply = client.get(url, headers={**headers, "Authorization": mesh.credential(
                "x", request, now + offset)})
            assert reply.status_code == status, (offset, reply.text)


def test_the_record_is_bounded() -> None:
    """Per node and in all: past either a new credential is FULL (not recorded), other nodes
    still get theirs; entries go once their credentials' time is past, and then the node is
    taken again. A replay is REPLAYED until its entry goes (when its credential is refused by
    its time anyway)."""
    record = UsedNonces(per_node=3, total=5)
    t = 1_000_000.0
    a = [new_nonce() for _ in range(4)]
    for nonce in a[:3]:
        assert record.use("static/a", nonce, t + 60, t) is Use.FIRST
    assert record.use("static/a", a[0], t + 60, t) is Use.REPLAYED
    assert record.use("static/a", a[3], t + 60, t) is Use.FULL  # a's share
    assert record.use("cluster/a", a[3], t + 60, t) is Use.FIRST  # another node
    assert record.use("static/b", new_nonce(), t + 30, t + 1) is Use.FIRST
    assert record.use("static/c", new_nonce(), t + 60, t + 1) is Use.FULL  # the total
    assert record.size == 5
    # b's entry goes at its time: c gets in
    assert record.use("static/c", new_nonce(), t + 60, t + 31) is Use.FIRST
    assert record.of("static/b") == 0 and record.size == 5
    # a's go after t + 60 (and the others until then): a is taken again, and its old nonce
    # (refused by its time anyway from then on) is no longer held
    assert record.use("static/a", a[3], t + 120, t + 61) is Use.FIRST
    assert record.of("static/a") == 1 and record.size == 1
    assert record.use("static/a", a[0], t + 121, t + 61) is Use.FIRST
    # many entries over a long run: never more than the window holds
    record = UsedNonces(per_node=1000, total=1000)
    for i in range(20_000):
        assert record.use("static/a", new_nonce(), t + i / 100 + 5, t + i / 100) is Use.FIRST
        assert record.size <= 600


def test_a_peer_refuses_a_node_past_its_share_of_the_record(
        tmp_path: Path, holder: tuple[RemoteStore, bytes, str],  # noqa: F811
        caplog: pytest.LogCaptureFixture) -> None:
    """A real server with a record of 2 per node and 3 in all (credentials good for 1 s): x's
    third request within the window is 503 naming why, connection closed; z still gets in
    until the total is reached; once the entries' time is past, x is served again."""
    store, data, digest = holder
    mesh = Mesh("static", tmp_path, store, max_nonces_per_node=2, max_nonces=3, max_skew=1)
    table = ChunkDigests.compute(io.BytesIO(data).read, len(data), CHUNK)[0]
    path = f"/blobs/{digest}"
    headers = {"Range": f"bytes=0-{CHUNK - 1}", PROOF_HEADER: proof(table, 0, CHUNK)}
    request = request_of(path, headers)
    url = f"http://{mesh.server.address}{path}"

    def ask(node: str) -> httpx.Response:
        with httpx.Client(timeout=30) as client:
            return client.get(url, headers={**headers,
                                            "Authorization": mesh.credential(node, request)})

    try:
        while time.time() % 1 > 0.3:  # (start just after a second turns: made is whole)
            time.sleep(0.02)
        assert ask("x").status_code == 206 and ask("x").status_code == 206
        with caplog.at_level(logging.WARNING, "agentenv.blockd.remote.p2p"):
            full = ask("x")
        assert full.status_code == 503 and "record of credentials taken is full" in full.text
        assert full.headers.get("connection") == "close"
        assert any(getattr(r, "event", "") == "record_full" and
                   getattr(r, "node", "") == "static/x" for r in caplog.records)
        assert ask("z").status_code == 206
        assert ask("z").status_code == 503  # the total (3)
        assert mesh.server.server.nonces.size == 3
        deadline = time.monotonic() + 10
        while ask("x").status_code != 206:
            assert time.monotonic() < deadline, "the record's entries never went"
            time.sleep(0.2)
    finally:
        mesh.close()
