"""Static peers' per-node keys (blockd/remote/identity.py, docs/security.md §5): without a
scheduler, each blockd has its own Ed25519 key pair and serves the nodes of its trust file on
credentials they sign, naming themselves, the target peer, the time and a nonce. Real chunk servers
(PeerServer) and stores on loopback, a real registry: a node signs for itself and is served
(and counted as itself); a credential for another peer, an expired or far-future one, a forged
signature, an untrusted node's, one naming another node, the unbound (s1) and nonce-less
(s2) forms of before and the removed shared key are 401;
a node removed from the trust file is refused within a second; the old settings stop blockd
with a message naming the new ones."""

from __future__ import annotations

import io
import logging
import os
import stat
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentenv.blockd.remote import identity as ident
from agentenv.blockd.remote.chunkdigests import PROOF_HEADER, ChunkDigests, proof
from agentenv.blockd.remote.identity import (
    IDENTITY_FILE,
    NodeIdentity,
    PeerKeyError,
    TrustedPeers,
    check_signed_credential,
    load_identity,
    parse_trust,
)
from agentenv.blockd.remote.p2p import PeerServer
from agentenv.blockd.remote.service import config_from_env
from agentenv.blockd.remote.store import RemoteConfig, RemoteStore
from agentenv.cluster_keys import (
    MAX_SKEW_S,
    PEER_SCHEME,
    new_nonce,
    node_key,
    peer_credential,
    peer_request,
    peer_request_credential,
    peer_serve_key,
)
from tests.remote.peerids import identities, signed, trust_text
from tests.remote.test_chunk_cache import CHUNK, _ref, hello  # noqa: F401 (fixture)
from tests.template.conftest import Registry

SECRET = "a-cluster-secret-of-at-least-32-chars"


@pytest.fixture
def mesh(tmp_path: Path, registry: Registry,
         hello: tuple[str, bytes]) -> Iterator[dict[str, Any]]:  # noqa: F811
    """Chunk servers p1 and p2, each holding the whole `hello` blob, trusting nodes p1, p2, x
    and y (a trust file on disk, as blockd reads it). Node z has a key pair, but no line."""
    digest, data = hello
    nodes = identities(tmp_path, "p1", "p2", "x", "y", "z")
    trusted = {k: v for k, v in nodes.items() if k != "z"}
    trust_file = tmp_path / "peers.trust"
    trust_file.write_text(trust_text(trusted))
    servers, stores = {}, []
    try:
        for name in ("p1", "p2"):
            store = RemoteStore(RemoteConfig(tmp_path / name, capacity=64 * CHUNK,
                                             chunk_size=CHUNK, background_bw=0, timeout=5))
            stores.append(store)
            trust = TrustedPeers(trust_file)
            trust.RECHECK_S = 0.2  # type: ignore[misc]
            server = PeerServer(store, "127.0.0.1:0", node_id=name, trust=trust, max_per_node=2)
            server.start()
            servers[name] = server
            source = store.open_blob(_ref(registry, digest, len(data), data))
            assert source.pread(len(data), 0) == data
            source.close()
        table = ChunkDigests.compute(io.BytesIO(data).read, len(data), CHUNK)[0]
        yield {"servers": servers, "nodes": nodes, "digest": digest, "data": data,
               "trust_file": trust_file, "trusted": trusted, "registry": registry,
               "table": table,
               # what `get` asks, for credentials made for it
               "request": peer_request("GET", f"/blobs/{digest}", f"bytes=0-{CHUNK - 1}",
                                       proof(table, 0, CHUNK))}
    finally:
        for server in servers.values():
            server.stop()
        for store in stores:
            store.close()


def get(mesh: dict[str, Any], name: str, authorization: str,
        client: httpx.Client | None = None) -> httpx.Response:
    """Chunk 0 of the blob from peer `name`, with a right claim."""
    url = f"http://{mesh['servers'][name].address}/blobs/{mesh['digest']}"
    headers = {"Authorization": authorization, "Range": f"bytes=0-{CHUNK - 1}",
               PROOF_HEADER: proof(mesh["table"], 0, CHUNK)}
    if client is not None:
        return client.get(url, headers=headers)
    with httpx.Client(timeout=30) as one:
        return one.get(url, headers=headers)


def made_by(key_of: NodeIdentity, node_id: str, target: str, made: int,
            request: bytes) -> str:
    """A credential naming `node_id`, made at `made` with a fresh nonce, signed with the key
    of `key_of`."""
    return f"{PEER_SCHEME} " + NodeIdentity(node_id, key_of.private_key).sign(
        target, made, request, new_nonce())


def test_a_node_signs_for_itself_and_is_served_as_itself(
        mesh: dict[str, Any], caplog: pytest.LogCaptureFixture) -> None:
    x, y, R = mesh["nodes"]["x"], mesh["nodes"]["y"], mesh["request"]
    reply = get(mesh, "p1", signed(x, "p1", R))
    assert reply.status_code == 206 and reply.content == mesh["data"][:CHUNK]
    assert get(mesh, "p2", signed(x, "p2", R)).status_code == 206
    # per node: x's two kept-alive connections hold its share (max_per_node 2), y still gets in
    clients = [httpx.Client(timeout=30) for _ in range(4)]
    try:
        for client in clients[:2]:
            assert get(mesh, "p1", signed(x, "p1", R), client).status_code == 206
        with caplog.at_level(logging.WARNING, "agentenv.blockd.remote.p2p"):
            assert get(mesh, "p1", signed(x, "p1", R), clients[2]).status_code == 503
        assert get(mesh, "p1", signed(y, "p1", R), clients[3]).status_code == 206
        server = mesh["servers"]["p1"].server
        assert sorted(server.keyed.values()) == ["static/x", "static/x", "static/y"]
    finally:
        for client in clients:
            client.close()
    # the refusal names the node (its log line), not only an address
    assert any("(static/x)" in str(getattr(r, "peer", "")) for r in caplog.records), \
        caplog.records


def test_credentials_not_made_by_the_named_node_for_this_peer_are_refused(
        mesh: dict[str, Any]) -> None:
    nodes = mesh["nodes"]
    x, y, z, R = nodes["x"], nodes["y"], nodes["z"], mesh["request"]
    now = int(time.time())
    # for another peer: good at p2, refused at p1
    for_p2 = signed(x, "p2", R)
    assert get(mesh, "p2", for_p2).status_code == 206
    assert get(mesh, "p1", for_p2).status_code == 401
    # made too long ago, or too far ahead of the peer's clock (MAX_SKEW_S either way; a peer
    # started long ago: one takes nothing made before it started)
    mesh["servers"]["p1"].server.not_before = 0
    assert get(mesh, "p1", made_by(x, "x", "p1", now - MAX_SKEW_S - 5, R)).status_code == 401
    assert get(mesh, "p1", made_by(x, "x", "p1", now + MAX_SKEW_S + 5, R)).status_code == 401
    assert get(mesh, "p1", made_by(x, "x", "p1", now - MAX_SKEW_S + 5, R)).status_code == 206
    assert get(mesh, "p1", made_by(x, "x", "p1", now + MAX_SKEW_S - 5, R)).status_code == 206
    # forged: the signature altered, or moved to another time, nonce, target or node
    good = x.sign("p1", now, R, new_nonce())
    made, nonce, sig = good.split("/")[3:]
    flipped = sig[:10] + ("A" if sig[10] != "A" else "B") + sig[11:]
    other = ("A" if nonce[0] != "A" else "B") + nonce[1:]
    for forged in (f"s3/x/p1/{made}/{nonce}/{flipped}", f"s3/x/p1/{int(made) + 1}/{nonce}/{sig}",
                   f"s3/x/p1/{made}/{other}/{sig}",
                   f"s3/x/p2/{made}/{nonce}/{sig}", f"s3/y/p1/{made}/{nonce}/{sig}",
                   f"s3/x/p1/{made}/{nonce}/{'A' * 86}", f"s3/x/p1/{made}/{nonce}",
                   good + "A", f"s2/x/p1/{made}/{sig}", f"s1/x/p1/{made}/{sig}"):
        assert get(mesh, "p1", f"{PEER_SCHEME} {forged}").status_code == 401, forged
    # (none of those burnt the nonce: the good one is still taken, once)
    assert get(mesh, "p1", f"{PEER_SCHEME} {good}").status_code == 206
    assert get(mesh, "p1", f"{PEER_SCHEME} {good}").status_code == 401
    # a node cannot act as another node id: x's key naming y (both trusted), z's naming x
    assert get(mesh, "p1", made_by(x, "y", "p1", now, R)).status_code == 401
    assert get(mesh, "p1", made_by(z, "x", "p1", now, R)).status_code == 401
    # an untrusted node's own credential
    assert get(mesh, "p1", signed(z, "p1", R)).status_code == 401
    # the removed shared key of static peers, and no credential at all
    assert get(mesh, "p1", f"Bearer {'ab' * 32}").status_code == 401
    assert get(mesh, "p1", "").status_code == 401
    # the scheduler's per-node credential (HMAC, r1/... made from the v1/... it issued) is not
    # taken without a serving key, and a signed one is never checked as one
    hmac_key = peer_serve_key(node_key(SECRET, "p1"))
    issued = peer_credential(hmac_key, "x", now + 60)
    assert get(mesh, "p1", f"{PEER_SCHEME} {peer_request_credential(issued, R)}"
               ).status_code == 401
    mesh["servers"]["p1"].set_serve_key(hmac_key)
    assert get(mesh, "p1", f"{PEER_SCHEME} {peer_request_credential(issued, R)}"
               ).status_code == 206
    assert get(mesh, "p1", signed(y, "p1", R)).status_code == 206  # both kinds, each checked
    assert get(mesh, "p1", signed(z, "p1", R)).status_code == 401


def test_check_says_why(mesh: dict[str, Any]) -> None:
    x, z, R = mesh["nodes"]["x"], mesh["nodes"]["z"], mesh["request"]
    trust = TrustedPeers(text=trust_text(mesh["trusted"]))
    now = time.time()
    nonce = new_nonce()
    checked, why = check_signed_credential(trust, "p1", x.sign("p1", int(now), R, nonce), now,
                                           R)
    assert checked is not None and (checked.node, checked.nonce, why) == ("x", nonce, "")
    assert checked.until == int(now) + MAX_SKEW_S  # (the record keeps it until then)
    assert check_signed_credential(trust, "p1", x.sign("p2", int(now), R, nonce), now, R)[1] \
        == "made for another peer"
    assert "more than 60 s ago" in check_signed_credential(
        trust, "p1", x.sign("p1", int(now) - 61, R, nonce), now, R)[1]
    assert "ahead of this peer's clock" in check_signed_credential(
        trust, "p1", x.sign("p1", int(now) + 62, R, nonce), now, R)[1]
    assert "not in the peer trust file" in check_signed_credential(
        trust, "p1", z.sign("p1", int(now), R, nonce), now, R)[1]
    assert check_signed_credential(
        trust, "p1", NodeIdentity("y", x.private_key).sign("p1", int(now), R, nonce), now,
        R)[1] == "not signed with node y's key for this request"


def test_a_node_removed_from_the_trust_file_is_refused(mesh: dict[str, Any]) -> None:
    x, R = mesh["nodes"]["x"], mesh["request"]
    assert get(mesh, "p1", signed(x, "p1", R)).status_code == 206
    others = {k: v for k, v in mesh["trusted"].items() if k != "x"}
    path: Path = mesh["trust_file"]
    tmp = path.with_name("peers.new")
    tmp.write_text(trust_text(others))
    os.replace(tmp, path)
    deadline = time.monotonic() + 10
    while get(mesh, "p1", signed(x, "p1", R)).status_code != 401:
        assert time.monotonic() < deadline, "x is still served"
        time.sleep(0.1)
    assert get(mesh, "p1", signed(mesh["nodes"]["y"], "p1", R)).status_code == 206
    # Revocation fails closed: a broken file, then a removed one, trust nobody; the file
    # written right again trusts its nodes again.
    y = mesh["nodes"]["y"]
    for spoil in (lambda: path.write_text("not a trust line\n"), path.unlink):
        spoil()
        deadline = time.monotonic() + 10
        while get(mesh, "p1", signed(y, "p1", R)).status_code != 401:
            assert time.monotonic() < deadline, "y is still served from a spoilt trust file"
            time.sleep(0.1)
    tmp.write_text(trust_text(others))
    os.replace(tmp, path)
    deadline = time.monotonic() + 10
    while get(mesh, "p1", signed(y, "p1", R)).status_code != 206:
        assert time.monotonic() < deadline, "y is not served again from a good trust file"
        time.sleep(0.1)


def test_a_store_reads_from_its_trusted_static_peers_and_an_untrusted_one_is_refused(
        tmp_path: Path, mesh: dict[str, Any]) -> None:
    """Nodes read through their stores: x, listed in p1's trust file (and p1 with its
    address in x's), reads every chunk from its static peer p1, signed; z, whose key p1 does
    not trust, is refused and reads from the registry."""
    digest, data, registry = mesh["digest"], mesh["data"], mesh["registry"]
    addresses = {"p1": mesh["servers"]["p1"].address}
    mesh["servers"]["p1"].server.max_per_node = 16  # (2 in the fixture; a store asks in 8)
    counts = {}
    for name in ("x", "z"):
        store = RemoteStore(RemoteConfig(
            tmp_path / f"{name}-cache", capacity=64 * CHUNK, chunk_size=CHUNK, background_bw=0,
            timeout=5, identity=mesh["nodes"][name], peers=[f"http://{addresses['p1']}"],
            trust=TrustedPeers(text=trust_text({"p1": mesh["nodes"]["p1"]}, addresses))))
        try:
            source = store.open_blob(_ref(registry, digest, len(data), data))
            assert source.pread(len(data), 0) == data
            source.close()
            counts[name] = (store.stats.fetched.get("peer", 0),
                            store.stats.fetched.get("registry", 0))
        finally:
            store.close()
    assert counts["x"][0] > 0 and counts["x"][1] == 0, counts
    assert counts["z"][0] == 0 and counts["z"][1] > 0, counts


def test_the_key_pair_is_made_once_private_and_printed_as_a_trust_line(tmp_path: Path) -> None:
    state = tmp_path / "state"
    env = {k: v for k, v in os.environ.items() if not k.startswith("AENV_PEER")}

    def aenv(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "agentenv.cli.main", *args],
                              capture_output=True, text=True, timeout=60, env=env)

    first = aenv("peer-key", "--state-dir", str(state), "--peer-node-id", "n1")
    assert first.returncode == 0, first.stderr
    line = first.stdout.strip()
    assert line.startswith("n1 ed25519:") and len(line.split()) == 2
    key_file = state / IDENTITY_FILE
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    again = aenv("peer-key", "--state-dir", str(state), "--peer-node-id", "n1",
                 "--address", "10.0.0.1:9400")
    assert again.stdout.strip() == f"{line} http://10.0.0.1:9400"
    # the line is a trust file's, and what blockd loads signs for it
    entry = parse_trust(again.stdout, "printed")["n1"]
    assert entry.address == "http://10.0.0.1:9400"
    identity = load_identity(state, "n1")
    trust = TrustedPeers(text=again.stdout)
    now = time.time()
    request = peer_request("GET", "/blobs", None, None)
    checked, _ = check_signed_credential(trust, "p", identity.credential_for("p", request, now),
                                         now, request)
    assert checked is not None and checked.node == "n1"
    # the private key is refused once others may read it
    key_file.chmod(0o644)
    with pytest.raises(PeerKeyError, match="chmod 600"):
        load_identity(state, "n1")
    key_file.chmod(0o600)
    # ...and when it is another user's, or a symlink (to another node's key, say)
    if os.geteuid() == 0:
        os.chown(key_file, 4321, 4321)
        with pytest.raises(PeerKeyError, match="belongs to uid 4321"):
            load_identity(state, "n1")
        os.chown(key_file, 0, 0)
    other = tmp_path / "elsewhere"
    other.mkdir()
    moved = other / key_file.name
    key_file.rename(moved)
    key_file.symlink_to(moved)
    with pytest.raises(PeerKeyError, match="cannot read the peer key"):
        load_identity(state, "n1")


def test_the_removed_shared_key_stops_blockd_naming_the_new_settings(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    key = tmp_path / "peer-key"
    key.write_text("ab" * 32)
    env = {k: v for k, v in os.environ.items() if not k.startswith("AENV_PEER")}
    for args, extra in (((("--peer-key-file", str(key)),), {}),
                        ((), {"AENV_PEER_KEY_FILE": str(key)}),
                        ((), {"AENV_PEER_KEY": "ab" * 32})):
        done = subprocess.run(
            [sys.executable, "-m", "agentenv.cli.main", "blockd", "--no-fuse",
             "--state-dir", str(tmp_path / "state"), "--socket", str(tmp_path / "b.sock"),
             *[a for pair in args for a in pair]],
            capture_output=True, text=True, timeout=60, env={**env, **extra})
        assert done.returncode != 0
        assert "the shared peer key was removed" in done.stderr, done.stderr
        assert "--peer-trust-file" in done.stderr and "aenv peer-key" in done.stderr
        assert not (tmp_path / "b.sock").exists()
    # in process: the same, and a static peer not in the trust file is an error too
    monkeypatch.setenv("AENV_PEER_KEY", "ab" * 32)
    with pytest.raises(ValueError, match="AENV_PEER_TRUST_FILE"):
        config_from_env(tmp_path / "s1")
    monkeypatch.delenv("AENV_PEER_KEY")
    monkeypatch.setenv("AENV_PEERS", "http://127.0.0.1:9")
    with pytest.raises(ValueError, match=r"static peer http://127\.0\.0\.1:9 is "
                                         r"not in the peer trust file"):
        config_from_env(tmp_path / "s1")
    nodes = identities(tmp_path, "other")
    trust = tmp_path / "t"
    trust.write_text(trust_text(nodes, {"other": "127.0.0.1:9"}))
    monkeypatch.setenv("AENV_PEER_TRUST_FILE", str(trust))
    monkeypatch.setenv("AENV_PEER_NODE_ID", "me")
    config = config_from_env(tmp_path / "s1")
    assert config.identity is not None and config.identity.node_id == "me"
    assert config.trust is not None and config.trust.node_at("127.0.0.1:9") == "other"


def test_a_trust_file_that_is_wrong_names_the_line() -> None:
    with pytest.raises(PeerKeyError, match="f:2: want"):
        parse_trust("# c\nn1\n", "f")
    with pytest.raises(PeerKeyError, match=r"f:1: .*not a peer public key"):
        parse_trust("n1 ssh-ed25519:AAAA\n", "f")
    with pytest.raises(PeerKeyError, match=r"f:1: .*not a peer public key"):
        parse_trust("n1 ed25519:AAAA\n", "f")
    with pytest.raises(PeerKeyError, match="f:1: peer node id"):
        parse_trust("-n ed25519:AAAA\n", "f")
    assert ident.normalise_address("h:1/") == "http://h:1"


def test_one_key_names_one_node(tmp_path: Path) -> None:
    """Two ids of one key would give the node behind it two shares of a peer's connections
    (red team of 2026-12-07)."""
    key = identities(tmp_path, "n1")["n1"].trust_line().split()[1]
    with pytest.raises(PeerKeyError, match="f:2: node n2 has the key of node n1"):
        parse_trust(f"n1 {key}\nn2 {key}\n", "f")
