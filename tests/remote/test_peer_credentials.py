"""Per-node peer credentials (docs/security.md §5): a real scheduler (in process, real Redis)
issues node X, with each Holders answer, a credential for holder P that names X, is made with
P's serving key and expires; X makes from it one per request (r2); a real chunk server with
P's serving key serves X on it and refuses a credential for another peer or another id, an
expired or forged one, the issued one sent as it is, a bearer key, and, once X is removed, X
gets no new one and its last stops at its expiry."""

from __future__ import annotations

import asyncio
import io
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentenv.blockd.remote.chunkdigests import PROOF_HEADER, ChunkDigests, proof
from agentenv.blockd.remote.p2p import PeerServer
from agentenv.blockd.remote.store import RemoteConfig, RemoteStore
from agentenv.cluster_keys import (
    PEER_SCHEME,
    check_peer_credential,
    node_key,
    peer_credential,
    peer_request,
    peer_request_credential,
    peer_serve_key,
)
from tests.control.conftest import RedisServer, prefix, redis_server  # noqa: F401 (fixtures)
from tests.control.helpers import SECRET, scheduler, status
from tests.remote.test_chunk_cache import CHUNK, _ref, hello  # noqa: F401 (fixture)
from tests.template.conftest import Registry


def serve_key(node_id: str) -> str:
    return peer_serve_key(node_key(SECRET, node_id))


@pytest.fixture
def peers(tmp_path: Path, registry: Registry,
          hello: tuple[str, bytes]) -> Iterator[dict[str, Any]]:  # noqa: F811
    """Two chunk servers, nodes "p1" and "p2", each holding the whole `hello` blob, with the
    serving keys their nodes would give them."""
    digest, data = hello
    servers, stores = {}, []
    try:
        for name in ("p1", "p2"):
            store = RemoteStore(RemoteConfig(tmp_path / name, capacity=64 * CHUNK,
                                             chunk_size=CHUNK, background_bw=0, timeout=5))
            stores.append(store)
            server = PeerServer(store, "127.0.0.1:0", max_per_node=2)
            server.set_serve_key(serve_key(name))
            server.start()
            servers[name] = server
            source = store.open_blob(_ref(registry, digest, len(data), data))
            assert source.pread(len(data), 0) == data
            source.close()
        yield {"servers": servers, "digest": digest, "data": data,
               "table": ChunkDigests.compute(io.BytesIO(data).read, len(data), CHUNK)[0]}
    finally:
        for server in servers.values():
            server.stop()
        for store in stores:
            store.close()


def chunk0(peers: dict[str, Any]) -> tuple[str, dict[str, str]]:
    """The path and headers of a request for chunk 0 of the blob, with a right claim."""
    return (f"/blobs/{peers['digest']}",
            {"Range": f"bytes=0-{CHUNK - 1}", PROOF_HEADER: proof(peers["table"], 0, CHUNK)})


def get(peers: dict[str, Any], name: str, authorization: str) -> httpx.Response:
    """Chunk 0 of the blob from peer `name`, with a right claim."""
    path, headers = chunk0(peers)
    with httpx.Client(timeout=30) as client:
        return client.get(f"http://{peers['servers'][name].address}{path}",
                          headers={**headers, "Authorization": authorization})


def for_chunk0(peers: dict[str, Any]) -> bytes:
    path, headers = chunk0(peers)
    return peer_request("GET", path, headers["Range"], headers[PROOF_HEADER])


def as_peer(issued: str, request: bytes) -> str:
    """What the node holding `issued` sends for `request`."""
    return f"{PEER_SCHEME} {peer_request_credential(issued, request)}"


def test_a_credential_is_the_asking_nodes_for_one_peer_until_it_expires(
        peers: dict[str, Any]) -> None:
    now = int(time.time())
    R = for_chunk0(peers)
    good = peer_credential(serve_key("p1"), "x", now + 60)
    reply = get(peers, "p1", as_peer(good, R))
    assert reply.status_code == 206 and reply.content == peers["data"][:CHUNK]
    sent = peer_request_credential(good, R)
    checked, why = check_peer_credential(serve_key("p1"), sent, now, R)
    assert checked is not None and checked.node == "x" and why == ""
    # for another peer: refused there
    assert get(peers, "p2", as_peer(good, R)).status_code == 401
    # the same credential naming another node (or another expiry, time or nonce): its MAC no
    # longer fits
    expires = good.split("/")[2]
    _, _, _, made, nonce, request_mac = sent.split("/")
    other_nonce = ("A" if nonce[0] != "A" else "B") + nonce[1:]
    for forged in (f"r2/y/{expires}/{made}/{nonce}/{request_mac}",
                   f"r2/x/{int(expires) + 3600}/{made}/{nonce}/{request_mac}",
                   f"r2/x/{expires}/{int(made) + 1}/{nonce}/{request_mac}",
                   f"r2/x/{expires}/{made}/{other_nonce}/{request_mac}",
                   f"r2/x/{expires}/{made}/{nonce}/{'0' * 64}", "r2/x", sent + "0"):
        assert get(peers, "p1", f"{PEER_SCHEME} {forged}").status_code == 401, forged
    # made with a key that is not p1's serving key: another node's serving key, a node's own
    # key
    for key in (serve_key("p2"), node_key(SECRET, "p1")):
        assert get(peers, "p1", as_peer(peer_credential(key, "x", now + 60), R)
                   ).status_code == 401
    # expired
    expired = peer_request_credential(peer_credential(serve_key("p1"), "x", now - 1), R)
    assert get(peers, "p1", f"{PEER_SCHEME} {expired}").status_code == 401
    assert check_peer_credential(serve_key("p1"), expired, now, R)[1] == "expired"
    # the issued credential itself (a bearer token: the form of before) is refused, naming why
    bearer = get(peers, "p1", f"{PEER_SCHEME} {good}")
    assert bearer.status_code == 401 and "(v1, a bearer token)" in bearer.text, bearer.text
    # the bound form of before without a nonce (r1), refused naming why
    r1 = get(peers, "p1", f"{PEER_SCHEME} r1/x/{expires}/{request_mac}")
    assert r1.status_code == 401 and "without a nonce (r1" in r1.text, r1.text
    # a bearer key (the shared peer key of static peers, removed): not taken
    assert get(peers, "p1", f"Bearer {'ab' * 32}").status_code == 401


def test_one_node_holds_at_most_its_share_of_the_connections(peers: dict[str, Any]) -> None:
    """max_per_node (2 here) keyed connections per node: a third of x's is refused with 503
    while y still gets in."""
    server = peers["servers"]["p1"]
    now = int(time.time())
    path, headers = chunk0(peers)
    url = f"http://{server.address}{path}"
    clients = [httpx.Client(timeout=30) for _ in range(4)]
    try:
        def x() -> str:  # (a credential per request: each is taken once)
            return as_peer(peer_credential(serve_key("p1"), "x", now + 60), for_chunk0(peers))

        y = as_peer(peer_credential(serve_key("p1"), "y", now + 60), for_chunk0(peers))
        # two kept-alive connections of x hold its share
        for client in clients[:2]:
            assert client.get(url, headers={**headers, "Authorization": x()}).status_code == 206
        assert clients[2].get(url, headers={**headers, "Authorization": x()}).status_code == 503
        assert clients[3].get(url, headers={**headers, "Authorization": y}).status_code == 206
    finally:
        for client in clients:
            client.close()


def test_the_scheduler_issues_credentials_to_up_nodes_only(
        peers: dict[str, Any], redis_server: RedisServer, prefix: str) -> None:  # noqa: F811
    """Holders answers carry the asker's credential for each holder; the holder's chunk server
    serves on it. A node removed from discovery gets no holder and no credential, and the last
    credential it had stops working when it expires (a TTL of 5 s here)."""
    digest = peers["digest"]
    addresses = {name: server.address for name, server in peers["servers"].items()}

    def holding(node: str) -> Any:
        msg = status(node)
        msg.layer_address = addresses[node]
        msg.blobs.append(digest)
        return msg

    async def body() -> None:
        async with scheduler(redis_server.url, prefix, peer_credential_ttl_s=5,
                             self_registration=False,
                             static_nodes=["x=127.0.0.1:1", "p1=127.0.0.1:2",
                                           "p2=127.0.0.1:3"]) as (server, client):
            for node in ("p1", "p2"):
                await client.heartbeat(holding(node))
            await client.heartbeat(status("x"))
            got = (await client.holders([digest], node_id="x"))[digest]
            assert {h.node_id for h in got} == {"p1", "p2"}
            R = for_chunk0(peers)
            for holder in got:
                assert holder.credential.startswith("v1/x/")
                assert get(peers, holder.node_id, as_peer(holder.credential, R)
                           ).status_code == 206
            last = next(h.credential for h in got if h.node_id == "p1")
            # a credential for p1 opens p1 only
            assert get(peers, "p2", as_peer(last, R)).status_code == 401
            # x is removed from the cluster's node list: it is told of no holder any more
            server.service.set_discovered("static", {
                "p1": ("127.0.0.1:2", True), "p2": ("127.0.0.1:3", True)})
            await client.heartbeat(status("x"))
            assert (await client.holders([digest], node_id="x"))[digest] == []
            # and what it has stops at its expiry (read from the credential itself)
            expires = int(last.split("/")[2])
            assert get(peers, "p1", as_peer(last, R)).status_code == 206
            await asyncio.sleep(max(0.0, expires - time.time()) + 0.05)
            assert get(peers, "p1", as_peer(last, R)).status_code == 401

    asyncio.run(body())
