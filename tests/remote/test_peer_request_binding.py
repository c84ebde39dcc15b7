"""Peer credentials after the review of 2026-12-07 (docs/security.md §5, docs/remote-layers.md
§4), each against real chunk servers (PeerServer) and stores on loopback:

- a credential is bound to its request: what someone on the path between two nodes sees (a
  TCP relay here, recording what the asking node sends) opens no other request: with another
  chunk, blob, claim or method it is 401 (and the very request it came with is refused too:
  each is taken once, tests/remote/test_peer_replay.py). So for static peers' signed
  credentials (s3) and for the scheduler's (r2, made per request from the issued v1, which is
  never sent); the forms of before get 401 naming why;
- the trust file is refused (trust nobody, a log line naming why) when others than blockd's
  user or root may write it, when it is a symlink or not a regular file;
- static and scheduler-issued node ids are apart: a static peer named like a cluster node has
  a share of the connections of its own, and the log names which;
- a node's default id is derived from its own public key (not the host name), and
  `aenv peer-key` prints it.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import socket
import stat
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from agentenv.blockd.remote.chunkdigests import PROOF_HEADER, ChunkDigests, proof
from agentenv.blockd.remote.identity import (
    IDENTITY_FILE,
    PeerKeyError,
    TrustedPeers,
    check_signed_credential,
    derived_node_id,
    load_identity,
)
from agentenv.blockd.remote.p2p import PeerServer
from agentenv.blockd.remote.service import config_from_env
from agentenv.blockd.remote.store import RemoteConfig, RemoteStore, Resolver
from agentenv.cluster_keys import (
    PEER_SCHEME,
    peer_credential,
    peer_request,
    peer_request_credential,
)
from tests.remote.peerids import identities, request_of, signed, trust_text, trusting
from tests.remote.test_chunk_cache import CHUNK, _ref, _Resolver, hello  # noqa: F401 (fixture)
from tests.template.conftest import Registry

SERVE_KEY = "5e" * 32  # a peer serving key (what a node derives from its node key)


class Sniffer:
    """A TCP relay on the path from a node to a peer: it passes everything on and keeps what
    the node sends (request heads: the peer protocol's requests have no bodies)."""

    def __init__(self, upstream: str) -> None:
        host, _, port = upstream.rpartition(":")
        self.upstream = (host, int(port))
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self.listener.getsockname()[1]}"
        self.sent: list[bytearray] = []  # per connection
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            server = socket.create_connection(self.upstream)
            record = bytearray()
            with self.lock:
                self.sent.append(record)
            threading.Thread(target=self._pump, args=(client, server, record), daemon=True).start()
            threading.Thread(target=self._pump, args=(server, client, None), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, record: bytearray | None) -> None:
        try:
            while data := src.recv(65536):
                if record is not None:
                    record += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for sock in (src, dst):
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_RDWR)

    def wire(self) -> bytes:
        with self.lock:
            return b"".join(bytes(r) for r in self.sent)

    def requests(self) -> list[tuple[str, str, dict[str, str]]]:
        """(method, path, headers with lower-case names) of every request seen."""
        seen = []
        for head in self.wire().split(b"\r\n\r\n"):
            lines = head.decode("latin-1").split("\r\n")
            if not lines[0]:
                continue
            method, path, _ = lines[0].split(" ", 2)
            headers = {}
            for line in lines[1:]:
                name, _, value = line.partition(":")
                headers[name.strip().lower()] = value.strip()
            seen.append((method, path, headers))
        return seen

    def close(self) -> None:
        self.listener.close()


@pytest.fixture
def holder(tmp_path: Path, registry: Registry,
           hello: tuple[str, bytes]) -> Iterator[tuple[RemoteStore, bytes, str]]:  # noqa: F811
    """A store (node p1's) that holds the whole `hello` blob, checked."""
    digest, data = hello
    store = RemoteStore(RemoteConfig(tmp_path / "p1", capacity=64 * CHUNK, chunk_size=CHUNK,
                                     background_bw=0, timeout=5))
    try:
        source = store.open_blob(_ref(registry, digest, len(data), data))
        assert source.pread(len(data), 0) == data
        source.close()
        yield store, data, digest
    finally:
        store.close()


def replays(server: PeerServer, sniffer: Sniffer, data: bytes, digest: str) -> str:
    """Replays what the sniffer saw at the peer: the credential with any other request is 401,
    and so is the exact request (taken before). Returns the credential replayed."""
    seen = [r for r in sniffer.requests() if r[1].startswith("/blobs/")]
    ranges = {h["range"] for _, _, h in seen}
    assert len(ranges) >= 2, ranges
    method, path, headers = seen[0]
    credential = headers["authorization"]
    url = f"http://{server.address}"
    table = ChunkDigests.compute(io.BytesIO(data).read, len(data), CHUNK)[0]
    with httpx.Client(timeout=30) as client:
        def ask(path: str, byte_range: str | None, claim: str | None,
                method: str = "GET") -> httpx.Response:
            out = {"Authorization": credential}
            if byte_range is not None:
                out["Range"] = byte_range
            if claim is not None:
                out[PROOF_HEADER] = claim
            return client.request(method, url + path, headers=out)

        again = ask(path, headers["range"], headers[PROOF_HEADER.lower()])
        start, end = (int(v) for v in re.fullmatch(r"bytes=(\d+)-(\d+)",
                                                    headers["range"]).groups())
        assert again.status_code == 401 and "taken before" in again.text, again.text
        # another chunk, with its right claim: what a bearer token would have opened
        other = next(i for i in range(len(data) // CHUNK)
                     if f"bytes={i * CHUNK}-{(i + 1) * CHUNK - 1}" != headers["range"])
        lo, hi = other * CHUNK, (other + 1) * CHUNK
        assert ask(path, f"bytes={lo}-{hi - 1}", proof(table, lo, hi)).status_code == 401
        # the same range as part of a longer one, another blob, no claim, another method
        longer = f"bytes={start}-{end + CHUNK}"
        assert ask(path, longer, proof(table, start, end + 1 + CHUNK)).status_code == 401
        assert ask("/blobs/sha256:" + "0" * 64, headers["range"],
                   headers[PROOF_HEADER.lower()]).status_code == 401
        assert ask(path, headers["range"], None).status_code == 401
        assert ask(path, headers["range"], headers[PROOF_HEADER.lower()],
                   "HEAD").status_code == 401
        assert method == "GET"
    return credential


def test_a_static_credential_seen_on_the_wire_repeats_only_its_own_request(
        tmp_path: Path, registry: Registry,
        holder: tuple[RemoteStore, bytes, str]) -> None:
    p1_store, data, digest = holder
    nodes = identities(tmp_path, "p1", "x")
    server = PeerServer(p1_store, "127.0.0.1:0", node_id="p1", trust=trusting({"x": nodes["x"]}))
    server.start()
    sniffer = Sniffer(server.address)
    x = RemoteStore(RemoteConfig(
        tmp_path / "x", capacity=64 * CHUNK, chunk_size=CHUNK, background_bw=0, timeout=5,
        identity=nodes["x"], peers=[f"http://{sniffer.address}"],
        trust=TrustedPeers(text=trust_text({"p1": nodes["p1"]}, {"p1": sniffer.address}))))
    try:
        source = x.open_blob(_ref(registry, digest, len(data), data))
        assert source.pread(len(data), 0) == data
        source.close()
        assert x.stats.fetched.get("peer", 0) > 0 and x.stats.fetched.get("registry", 0) == 0
        credential = replays(server, sniffer, data, digest)
        assert credential.startswith(f"{PEER_SCHEME} s3/x/p1/"), credential
        # the forms of before get 401 saying why: s1 (the node, target and expiry signed,
        # nothing of the request), s2 (bound to its request, no nonce)
        sig = credential.rsplit("/", 1)[1]
        made = credential.split("/")[3]
        with httpx.Client(timeout=30) as client:
            old = client.get(f"http://{server.address}/blobs/{digest}", headers={
                "Authorization": f"{PEER_SCHEME} s1/x/p1/{made}/{sig}"})
            assert old.status_code == 401 and "not bound to its request" in old.text, old.text
            old = client.get(f"http://{server.address}/blobs/{digest}", headers={
                "Authorization": f"{PEER_SCHEME} s2/x/p1/{made}/{sig}"})
            assert old.status_code == 401 and "without a nonce (s2" in old.text, old.text
    finally:
        x.close()
        sniffer.close()
        server.stop()


def test_a_scheduler_credential_is_never_sent_and_what_is_repeats_only_its_request(
        tmp_path: Path, registry: Registry,
        holder: tuple[RemoteStore, bytes, str]) -> None:
    p1_store, data, digest = holder
    server = PeerServer(p1_store, "127.0.0.1:0", serve_key=SERVE_KEY)
    server.start()
    sniffer = Sniffer(server.address)
    resolver = _Resolver()
    issued = peer_credential(SERVE_KEY, "x", int(time.time()) + 600)
    resolver.holders = [{"address": sniffer.address, "complete": True, "credential": issued}]
    x = RemoteStore(RemoteConfig(tmp_path / "x", capacity=64 * CHUNK, chunk_size=CHUNK,
                                 background_bw=0, timeout=5))
    try:
        x.set_resolver(Resolver(resolver.url))
        source = x.open_blob(_ref(registry, digest, len(data), data))
        assert source.pread(len(data), 0) == data
        source.close()
        assert x.stats.fetched.get("peer", 0) > 0 and x.stats.fetched.get("registry", 0) == 0
        # what the scheduler issued (its MAC is the key of every request's) never crossed
        assert issued.rsplit("/", 1)[1].encode() not in sniffer.wire()
        credential = replays(server, sniffer, data, digest)
        assert credential.startswith(f"{PEER_SCHEME} r2/x/"), credential
        # the issued credential sent as it is (as nodes did before): 401 saying why
        with httpx.Client(timeout=30) as client:
            old = client.get(f"http://{server.address}/blobs/{digest}", headers={
                "Authorization": f"{PEER_SCHEME} {issued}"})
        assert old.status_code == 401 and "bearer token" in old.text, old.text
    finally:
        x.close()
        sniffer.close()
        resolver.stop()
        server.stop()


def test_static_and_cluster_nodes_of_one_name_each_have_their_own_share(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A static peer "x" (trust file) and the cluster's node "x" (the scheduler's credential):
    each holds up to max_per_node (2) connections of its own; a third of one is refused, the
    log naming which x."""
    store = RemoteStore(RemoteConfig(tmp_path / "p1", capacity=8 * CHUNK, chunk_size=CHUNK,
                                     background_bw=0, timeout=5))
    nodes = identities(tmp_path, "x")
    server = PeerServer(store, "127.0.0.1:0", node_id="p1", trust=trusting(nodes),
                        serve_key=SERVE_KEY, max_per_node=2)
    server.start()
    path = "/blobs/sha256:" + "ab" * 32  # not held: a keyed request is answered 404
    headers = {"Range": f"bytes=0-{CHUNK - 1}", PROOF_HEADER: "cd" * 32}
    request = request_of(path, headers)

    def static() -> str:  # (a credential per request: each is taken once)
        return signed(nodes["x"], "p1", request)

    def cluster() -> str:
        return f"{PEER_SCHEME} " + peer_request_credential(
            peer_credential(SERVE_KEY, "x", int(time.time()) + 60), request)

    clients = [httpx.Client(timeout=30) for _ in range(5)]
    try:
        for client, auth in zip(clients, (static, static, cluster, cluster), strict=False):
            reply = client.get(f"http://{server.address}{path}",
                               headers={**headers, "Authorization": auth()})
            assert reply.status_code == 404, reply.text
        assert sorted(server.server.keyed.values()) == \
            ["cluster/x", "cluster/x", "static/x", "static/x"]
        with caplog.at_level(logging.WARNING, "agentenv.blockd.remote.p2p"):
            assert clients[4].get(f"http://{server.address}{path}",
                                  headers={**headers, "Authorization": static()}
                                  ).status_code == 503
        assert any("(static/x)" in str(getattr(r, "peer", "")) for r in caplog.records)
    finally:
        for client in clients:
            client.close()
        server.stop()
        store.close()


def test_a_trust_file_in_a_directory_others_may_write_trusts_nobody(tmp_path: Path) -> None:
    """Whoever may write a directory on the trust file's path may rename another file into
    its place (one they made is theirs and refused, but not an older root-owned one)."""
    nodes = identities(tmp_path, "x")
    outer = tmp_path / "outer"
    inner = outer / "inner"
    inner.mkdir(parents=True)
    good = inner / "peers.trust"
    good.write_text(trust_text(nodes))
    good.chmod(0o644)
    assert set(TrustedPeers(good).entries) == {"x"}
    for directory in (inner, outer):
        directory.chmod(0o777)
        with pytest.raises(PeerKeyError, match=rf"is in {directory}, which others than its "
                                               r"owner may write .*chmod go-w"):
            TrustedPeers(good)
        directory.chmod(0o1777)  # sticky, as /tmp: others may not replace what is not theirs
        assert set(TrustedPeers(good).entries) == {"x"}
        directory.chmod(0o755)
    if os.geteuid() == 0:
        os.chown(inner, 4321, 4321)
        with pytest.raises(PeerKeyError, match=rf"is in {inner}, which belongs to uid 4321"):
            TrustedPeers(good)
        os.chown(inner, 0, 0)
    # through a symlinked directory: the directories checked are the real ones
    (tmp_path / "via").symlink_to(inner)
    assert set(TrustedPeers(tmp_path / "via" / "peers.trust").entries) == {"x"}
    outer.chmod(0o777)
    with pytest.raises(PeerKeyError, match="which others than its owner may write"):
        TrustedPeers(tmp_path / "via" / "peers.trust")
    outer.chmod(0o755)


def test_a_trust_file_others_may_write_or_a_symlink_trusts_nobody(
        tmp_path: Path, caplog: pytest.LogCaptureFixture,
        monkeypatch: pytest.MonkeyPatch) -> None:
    nodes = identities(tmp_path, "x")
    good = tmp_path / "peers.trust"
    good.write_text(trust_text(nodes))
    good.chmod(0o644)
    assert set(TrustedPeers(good).entries) == {"x"}
    # at start: refused, naming why (blockd does not start: config_from_env)
    for mode in (0o666, 0o664, 0o646):
        good.chmod(mode)
        with pytest.raises(PeerKeyError, match=r"may be written by others .*chmod go-w"):
            TrustedPeers(good)
    good.chmod(0o644)
    link = tmp_path / "link.trust"
    link.symlink_to(good)
    with pytest.raises(PeerKeyError, match="is a symlink"):
        TrustedPeers(link)
    fifo = tmp_path / "fifo.trust"
    os.mkfifo(fifo)
    with pytest.raises(PeerKeyError, match="not a regular file"):
        TrustedPeers(fifo)  # (and not waited on)
    if os.geteuid() == 0:
        other = tmp_path / "other.trust"
        other.write_text(trust_text(nodes))
        os.chown(other, 4321, 4321)
        with pytest.raises(PeerKeyError, match="belongs to uid 4321"):
            TrustedPeers(other)
    good.chmod(0o666)
    monkeypatch.setenv("AENV_PEER_TRUST_FILE", str(good))
    with pytest.raises(ValueError, match="chmod go-w"):
        config_from_env(tmp_path / "state")
    good.chmod(0o644)
    # read again: made writable by others (a chmod alone: the content is the same), then
    # replaced by a symlink to a good file: nobody is trusted, a log line says why
    trust = TrustedPeers(good)
    trust.RECHECK_S = 0.05  # type: ignore[misc]

    def settles(want: set[str]) -> None:
        deadline = time.monotonic() + 5
        while set(trust.current()) != want:
            assert time.monotonic() < deadline, (want, trust.current())
            time.sleep(0.06)

    with caplog.at_level(logging.ERROR, "agentenv.blockd.remote"):
        good.chmod(0o646)
        settles(set())
        assert any("chmod go-w" in str(getattr(r, "error", "")) for r in caplog.records)
        good.chmod(0o644)
        settles({"x"})
        caplog.clear()
        kept = tmp_path / "kept.trust"
        kept.write_text(trust_text(nodes))
        good.unlink()
        good.symlink_to(kept)
        settles(set())
        assert any("symlink" in str(getattr(r, "error", "")) for r in caplog.records)
        good.unlink()
        kept.rename(good)
        settles({"x"})


def test_the_default_node_id_is_the_nodes_own_and_peer_key_prints_it(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = load_identity(tmp_path / "a")
    assert first.node_id == derived_node_id(first.private_key.public_key())
    assert re.fullmatch(r"node-[0-9a-f]{20}", first.node_id)
    assert load_identity(tmp_path / "a").node_id == first.node_id  # stable
    # another node (a host cloned from the same image makes its own key on first start)
    assert load_identity(tmp_path / "b").node_id != first.node_id
    assert os.uname().nodename not in first.node_id
    # the override still names it
    assert load_identity(tmp_path / "a", "n1").node_id == "n1"
    # blockd's default is the same, and `aenv peer-key` prints that line
    for name in ("AENV_PEER_NODE_ID", "AENV_PEER_TRUST_FILE", "AENV_PEERS"):
        monkeypatch.delenv(name, raising=False)
    config = config_from_env(tmp_path / "a")
    assert config.identity is not None and config.identity.node_id == first.node_id
    env = {k: v for k, v in os.environ.items() if not k.startswith("AENV_PEER")}
    done = subprocess.run([sys.executable, "-m", "agentenv.cli.main", "peer-key",
                           "--state-dir", str(tmp_path / "a")],
                          capture_output=True, text=True, timeout=60, env=env)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == first.trust_line()
    assert done.stdout.startswith(first.node_id + " ed25519:")
    assert stat.S_IMODE((tmp_path / "a" / IDENTITY_FILE).stat().st_mode) == 0o600
    # and what it signs for is checked against the key that line names
    trust = TrustedPeers(text=done.stdout)
    request = peer_request("GET", "/blobs", None, None)
    now = time.time()
    checked, why = check_signed_credential(trust, "p", first.credential_for("p", request, now),
                                           now, request)
    assert checked is not None and (checked.node, why) == (first.node_id, "")
