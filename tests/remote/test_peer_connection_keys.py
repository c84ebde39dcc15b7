"""A keyed P2P connection serves only the node it was admitted for (found by the red team of
2026-12-07: a node at its share went on asking on connections admitted with another node's
replayed credential)."""

from __future__ import annotations

import re
import socket
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentenv.blockd.remote.p2p import PeerServer
from agentenv.blockd.remote.store import RemoteConfig, RemoteStore
from tests.remote.peerids import identities, request_of, signed, trusting


@pytest.fixture
def store(tmp_path: Path) -> Iterator[RemoteStore]:
    s = RemoteStore(RemoteConfig(tmp_path / "cache", capacity=1 << 24, background_bw=0))
    yield s
    s.close()


def _ask(sock: socket.socket, authorization: str) -> bytes:
    """The status line of the answer to one request on `sock` (the whole answer is read: the
    connection may ask again)."""
    sock.sendall(f"GET /blobs HTTP/1.1\r\nHost: p\r\nAuthorization: {authorization}\r\n"
                 "\r\n".encode())
    data = b""
    while b"\r\n\r\n" not in data:
        data += sock.recv(65536)
    head, _, body = data.partition(b"\r\n\r\n")
    length = int(re.search(rb"Content-Length: (\d+)", head).group(1))  # type: ignore[union-attr]
    while len(body) < length:
        body += sock.recv(65536)
    return head[:12]


def test_a_connection_serves_only_the_node_it_was_admitted_for(store: RemoteStore,
                                                                  tmp_path: Path) -> None:
    """A keyed connection "stays its first node's" (admit): a later request on it with another
    node's credential is served beyond that node's own max_per_node. So node "taker" (taken
    over) at its limit goes on asking on connections opened with credentials of node "victim"
    (replayed copies seen on the wire), taking the victim's share besides its own."""
    nodes = identities(tmp_path, "victim", "taker")
    server = PeerServer(store, "127.0.0.1:0", node_id="server", trust=trusting(nodes),
                        max_per_node=2, idle_timeout=60.0)
    server.start()
    address = ("127.0.0.1", int(server.address.rpartition(":")[2]))

    def header(name: str) -> str:
        return signed(nodes[name], "server", request_of("/blobs"))

    held: list[socket.socket] = []
    try:
        for _ in range(2):  # the taker at its own limit
            sock = socket.create_connection(address, timeout=10)
            held.append(sock)
            assert _ask(sock, header("taker")) == b"HTTP/1.1 404"
        sniffed = header("victim")
        sock = socket.create_connection(address, timeout=10)
        held.append(sock)
        assert _ask(sock, sniffed) == b"HTTP/1.1 404"  # admitted as the victim's
        answer = _ask(sock, header("taker"))
        assert answer != b"HTTP/1.1 404", (
            "node taker, at its limit, was served on a connection admitted as node victim's")
    finally:
        for s in held:
            s.close()
        server.stop()
