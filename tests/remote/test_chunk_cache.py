"""The chunk cache and the remote store in process: a real docker-registry on loopback for the
hello-world overlaybd image (a real containerd conversion), small caches to force eviction."""

from __future__ import annotations

import hashlib
import io
import itertools
import json
import os
import socketserver
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, urlsplit

import httpx
import pytest

from agentenv.blockd.remote.cache import VERIFIED, ChunkCache
from agentenv.blockd.remote.chunkdigests import PROOF_HEADER, ChunkDigests, proof
from agentenv.blockd.remote.layout import _MASK, _SALT_INV, _std_crc32c, parse
from agentenv.blockd.remote.p2p import ByteBudget, PeerServer
from agentenv.blockd.remote.store import RemoteConfig, RemoteStore, Resolver
from agentenv.cluster_keys import peer_credential
from agentenv.storage import blob as blobmod
from agentenv.storage.blob import BlobLocation, RemoteLayerRef
from agentenv.storage.image import Image
from agentenv.storage.layer import inspect_layer
from agentenv.template.pull import pull_image
from tests.remote.peerids import ASKER_TRUST, asker
from tests.template import helpers
from tests.template.conftest import Registry

KiB = 1 << 10
CHUNK = 64 * KiB


@pytest.fixture(scope="module")
def hello(registry: Registry) -> tuple[str, bytes]:
    image = helpers.fixture_image("amd64-converted")
    registry.push("hello-world", "amd64-converted", image)
    digest = next(d for d in image.blobs if d.startswith("sha256:0222"))
    return digest, image.blobs[digest]


@pytest.fixture
def store(tmp_path: Path, registry: Registry) -> Iterator[RemoteStore]:
    s = RemoteStore(RemoteConfig(tmp_path / "cache", capacity=8 * CHUNK, chunk_size=CHUNK,
                                 background_bw=0, timeout=5))
    yield s
    s.close()


def _ref(registry: Registry, digest: str, size: int, data: bytes | None = None) -> RemoteLayerRef:
    """The blob's descriptor; with `data`, carrying its chunk table (what a manifest with the
    chunkdigests annotation gives), so that peers may be asked for it."""
    table = None if data is None else \
        ChunkDigests.compute(io.BytesIO(data).read, len(data), CHUNK)[0].encode()
    return RemoteLayerRef(digest, size, [BlobLocation(registry.host, "hello-world")],
                          chunk_sha256=table)


def test_lazy_pull_records_a_remote_layer(registry: Registry, hello: tuple[str, bytes],
                                          tmp_path: Path, no_docker_config: Path) -> None:
    digest, data = hello
    pulled = pull_image(f"{registry.host}/hello-world:amd64-converted", state_dir=tmp_path / "s")
    assert pulled.format == "overlaybd" and pulled.layers_fetched == 1
    # Only metadata: tar and ZFile headers, the jump table (17,463 blocks x 4 bytes), trailers.
    assert pulled.bytes_downloaded < len(data) // 6
    [lower] = json.loads(pulled.image_json.read_text())["lowers"]
    assert lower["remote"] and lower["digest"] == digest and lower["size"] == len(data)
    local = tmp_path / "blob"
    local.write_bytes(data)
    facts = inspect_layer(Path(lower["file"]))
    expected = inspect_layer(local)
    assert {k: v for k, v in facts.items() if k not in ("path", "remote")} == \
        {k: v for k, v in expected.items() if k != "path"}
    assert facts["remote"]["digest"] == digest
    # Read through this process's private store: the same disk as the local blob.
    with Image.open(pulled.image_json, writable=False) as remote, \
            Image.open(local, writable=False) as whole:
        for offset, _length, has_data in whole.extents():
            if has_data:
                n = min(_length, 1 << 20)
                assert remote.read(offset, n) == whole.read(offset, n)


def test_chunks_are_checked_and_tampering_is_refused(store: RemoteStore, registry: Registry,
                                                     hello: tuple[str, bytes]) -> None:
    digest, data = hello
    source = store.open_blob(_ref(registry, digest, len(data)))
    try:
        layout = source.info.layout
        assert layout.kind == "zfile"
        for idx in (1, 4, 7):
            start = idx * CHUNK
            lo, hi = layout.fetch_range(start, start + CHUNK)
            assert lo <= start and hi >= start + CHUNK
            good = data[lo:hi]
            assert layout.check(start, start + CHUNK, good, lo) is None
            bad = bytearray(good)
            bad[start - lo + 1000] ^= 1
            assert "CRC mismatch" in (layout.check(start, start + CHUNK, bytes(bad), lo) or "")
        assert source.pread(len(data), 0) == data  # every chunk, fetched and checked
    finally:
        source.close()


def test_capacity_is_never_exceeded_and_hot_chunks_stay(tmp_path: Path) -> None:
    cache = ChunkCache(tmp_path / "c", 8 * CHUNK, chunk_size=CHUNK)
    try:
        state = cache.blob("ab" * 32, 40 * CHUNK)
        payload = os.urandom(CHUNK)
        hot = 0
        cache.insert(state, hot, payload, VERIFIED)
        buf = memoryview(bytearray(100))
        for idx in range(1, 40):
            assert cache.read(state, hot, 0, buf)  # keep chunk 0 hot
            cache.insert(state, idx, payload, VERIFIED)
            assert cache.size <= cache.capacity
            used = os.stat(cache.root / "blobs" / f"{state.hex}.data").st_blocks * 512
            assert used <= cache.capacity + CHUNK
        assert state.present[hot] and cache.stats.evictions > 0
        assert sum(1 for m in state.present if m) * CHUNK <= cache.capacity
    finally:
        cache.close()


def test_one_fetch_for_many_readers(store: RemoteStore, registry: Registry,
                                    hello: tuple[str, bytes]) -> None:
    digest, data = hello
    source = store.open_blob(_ref(registry, digest, len(data)))
    try:
        results: list[bytes] = []
        barrier = threading.Barrier(6)

        def read() -> None:
            barrier.wait()
            results.append(source.pread(CHUNK, 3 * CHUNK))

        threads = [threading.Thread(target=read) for _ in range(6)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert results == [data[3 * CHUNK : 4 * CHUNK]] * 6
        assert store.stats.requests["registry"] <= 6  # layout reads + one chunk fetch
        assert store.stats.coalesced >= 1
    finally:
        source.close()


def test_unreachable_sources_give_eio_within_the_timeout(tmp_path: Path, registry: Registry,
                                                         hello: tuple[str, bytes]) -> None:
    digest, data = hello
    s = RemoteStore(RemoteConfig(tmp_path / "cache", capacity=8 * CHUNK, chunk_size=CHUNK,
                                 background_bw=0, timeout=1.5, request_timeout=0.5))
    try:
        source = s.open_blob(_ref(registry, digest, len(data)))
        # The registry goes away (here: the blob is named in a repository nobody serves).
        source.info.ref.sources[:] = [BlobLocation("127.0.0.1:9", "nothing")]
        import time

        t0 = time.monotonic()
        with pytest.raises(OSError) as raised:
            source.pread(4096, 5 * CHUNK)
        assert raised.value.errno == 5 and time.monotonic() - t0 < 4
        assert s.stats.eio == 1
        source.close()
    finally:
        s.close()


def test_a_reader_never_waits_behind_queued_fetches(tmp_path: Path, registry: Registry,
                                                    hello: tuple[str, bytes]) -> None:
    """Readahead can fill the fetch pool's queue; a guest read's own chunk is then fetched by
    the reader, not failed with EIO when the queue does not drain within the timeout."""
    digest, data = hello
    s = RemoteStore(RemoteConfig(tmp_path / "cache", capacity=8 * CHUNK, chunk_size=CHUNK,
                                 background_bw=0, timeout=30, fetch_threads=1))
    gate = threading.Event()
    try:
        source = s.open_blob(_ref(registry, digest, len(data)))
        s._pool.submit(gate.wait)  # the only fetch thread is busy until the read is done
        assert source.pread(CHUNK, 5 * CHUNK) == data[5 * CHUNK : 6 * CHUNK]
        assert s.stats.eio == 0
        gate.set()
        source.close()
    finally:
        gate.set()
        s.close()


def test_layout_parse_rejects_a_bad_jump_table(hello: tuple[str, bytes]) -> None:
    digest, data = hello
    bad = bytearray(data)
    layout = parse(lambda n, off: bytes(data[off : off + n]), len(data), digest)
    assert layout.offsets is not None
    table_at = int(layout.offsets[-1])
    bad[table_at + 8] ^= 0xFF
    with pytest.raises(blobmod.LayerFormatError, match="jump table"):
        parse(lambda n, off: bytes(bad[off : off + n]), len(bad), digest)
    assert hashlib.sha256(data).hexdigest() == digest.split(":")[1]


def test_prometheus_metrics(store: RemoteStore, registry: Registry,
                            hello: tuple[str, bytes]) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from agentenv.blockd.remote.service import _Collector

    digest, data = hello
    source = store.open_blob(_ref(registry, digest, len(data)))
    try:
        source.pread(len(data), 0)  # 10 chunks through an 8-chunk cache
    finally:
        source.close()
    reg = CollectorRegistry()
    reg.register(_Collector(store))
    text = generate_latest(reg).decode()
    values = {line.split(" ")[0]: float(line.split(" ")[1])
              for line in text.splitlines() if line and not line.startswith("#")}
    assert values['aenv_remote_fetched_bytes_total{source="registry"}'] >= len(data)
    assert values["aenv_chunk_cache_misses_total"] >= 10
    assert values["aenv_chunk_cache_evictions_total"] >= 2
    assert 0 < values["aenv_chunk_cache_bytes"] <= 8 * CHUNK


def test_background_completion_fetches_a_blob_in_use_and_checks_its_digest(
        tmp_path: Path, registry: Registry, hello: tuple[str, bytes]) -> None:
    import time

    digest, data = hello
    s = RemoteStore(RemoteConfig(tmp_path / "cache", capacity=64 * CHUNK, chunk_size=CHUNK,
                                 background_bw=4 << 20, timeout=5))
    try:
        source = s.open_blob(_ref(registry, digest, len(data)))
        state = source.info.state
        deadline = time.monotonic() + 30
        while not state.complete and time.monotonic() < deadline:
            time.sleep(0.1)
        assert state.complete and s.stats.background_bytes >= len(data) - 2 * CHUNK
        assert (tmp_path / "cache" / "blobs" / f"{state.hex}.ok").exists()
        # Complete: a peer may be given any range of it.
        assert s.serve_range(state.hex, 100, 200_000) == data[100:200_000]
        source.close()
    finally:
        s.close()


class _LoopbackServer(ThreadingHTTPServer):
    daemon_threads = True

    def server_bind(self) -> None:  # no reverse DNS lookup (docs/network.md)
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = "127.0.0.1", self.server_address[1]


def _serve(handler: type[BaseHTTPRequestHandler]) -> _LoopbackServer:
    """`handler` served on a loopback port from a thread of its own."""
    server = _LoopbackServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


class _Resolver:
    """What a node's /cluster/holders answers (node/layer_peers.py), from a list the test sets;
    counts the questions."""

    def __init__(self) -> None:
        self.holders: list[dict[str, object]] = []
        self.asked: list[str] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                query = parse_qs(urlsplit(self.path).query)
                outer.asked.append(query["digest"][0])
                body = json.dumps({"holders": outer.holders}).encode()
                self.send_response(200)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = _serve(Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/cluster/holders"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_peers_from_a_resolver_spread_skip_self_and_fall_back(
        tmp_path: Path, registry: Registry, hello: tuple[str, bytes]) -> None:
    digest, data = hello
    ref = _ref(registry, digest, len(data), data)
    resolver = _Resolver()
    made: list[tuple[RemoteStore, PeerServer | None]] = []
    # the scheduler's per-node credentials: the resolver's answer carries them
    serve_keys = {name: hashlib.sha256(name.encode()).hexdigest() for name in ("h1", "h2")}

    def node(name: str, serve: bool) -> RemoteStore:
        s = RemoteStore(RemoteConfig(tmp_path / name, capacity=64 * CHUNK, chunk_size=CHUNK,
                                     background_bw=0, timeout=3, request_timeout=1))
        server = PeerServer(s, "127.0.0.1:0", serve_key=serve_keys[name]) if serve else None
        if server is not None:
            server.start()
        made.append((s, server))
        return s

    try:
        holders = [node("h1", True), node("h2", True)]
        for h in holders:  # each holds the whole blob, checked chunk by chunk
            source = h.open_blob(_ref(registry, digest, len(data), data))
            assert source.pread(len(data), 0) == data
            source.close()
        addresses = [f"http://{server.address}" for _, server in made if server]
        dead = "http://127.0.0.1:9"
        me = node("me", False)
        me.own_addresses.add("http://127.0.0.1:1")
        resolver.holders = [{"address": "127.0.0.1:1", "complete": True},
                            {"address": dead, "complete": True}] + \
            [{"address": a, "complete": True,
              "credential": peer_credential(key, "me", int(time.time()) + 600)}
             for a, key in zip(addresses, serve_keys.values(), strict=True)]
        me.set_resolver(Resolver(resolver.url))
        hex_ = digest.split(":", 1)[1]
        # Requests spread: each chunk starts at a holder picked by hashing (blob, chunk).
        firsts = {me._peer_order(hex_, idx)[0] for idx in range(10)}
        assert firsts == {dead, *addresses}
        assert all("http://127.0.0.1:1" not in me._peer_order(hex_, i) for i in range(10))
        source = me.open_blob(ref)
        assert source.pread(len(data), 0) == data
        source.close()
        assert me.stats.fetched.get("registry", 0) == 0 and me.stats.fetched["peer"] > 0
        assert me.stats.failures.get("peer", 0) >= 1  # the dead one, then skipped for 5 s
        assert resolver.asked == [digest]  # one question, the answer cached for the reads
        # Only a dead peer known: everything comes from the registry.
        resolver.holders = [{"address": dead, "complete": False}]
        other = node("other", False)
        other.set_resolver(Resolver(resolver.url))
        source = other.open_blob(ref)
        assert source.pread(len(data), 0) == data
        source.close()
        assert other.stats.fetched["registry"] > 0 and other.stats.fetched.get("peer", 0) == 0
        # A resolver that cannot be reached is a registry read too, counted.
        resolver.stop()
        last = node("last", False)
        last.set_resolver(Resolver(resolver.url))
        source = last.open_blob(ref)
        assert source.pread(CHUNK, 2 * CHUNK) == data[2 * CHUNK : 3 * CHUNK]
        source.close()
        assert last.stats.failures["resolver"] >= 1 and last.stats.fetched["registry"] > 0
    finally:
        resolver.stop()
        for s, server in made:
            if server is not None:
                server.stop()
            s.close()


def test_a_peer_serves_only_a_node_that_holds_the_chunk_table(
        tmp_path: Path, registry: Registry, hello: tuple[str, bytes]) -> None:
    """A peer credential names no team: a node taken over (it has its credentials) that knows
    a blob's digest but not its chunk table gets nothing, nor a piece short enough to guess."""
    digest, data = hello
    holder = RemoteStore(RemoteConfig(tmp_path / "holder", capacity=64 * CHUNK, chunk_size=CHUNK,
                                      background_bw=0, timeout=5))
    server = PeerServer(holder, "127.0.0.1:0", node_id="server", trust=ASKER_TRUST)
    server.start()
    try:
        source = holder.open_blob(_ref(registry, digest, len(data), data))
        assert source.pread(len(data), 0) == data
        source.close()
        table = ChunkDigests.compute(io.BytesIO(data).read, len(data), CHUNK)[0]
        url = f"http://{server.address}/blobs/{digest}"

        def get(start: int, end: int, claimed: str | None) -> int:
            headers = {"Range": f"bytes={start}-{end - 1}"}
            if claimed is not None:
                headers[PROOF_HEADER] = claimed
            headers["Authorization"] = asker(f"/blobs/{digest}", headers)
            with httpx.Client() as client:
                reply = client.get(url, headers=headers)
            if reply.status_code == 206:
                assert reply.content == data[start:end]
            return reply.status_code

        whole = (2 * CHUNK, 4 * CHUNK)
        assert get(*whole, proof(table, *whole)) == 206  # a node with the table
        assert get(*whole, None) == 400  # the digest alone
        assert get(*whole, ",".join(["0" * 64] * 2)) == 404  # a guess: as if not held
        wrong = proof(table, 3 * CHUNK, 4 * CHUNK) + "," + proof(table, 2 * CHUNK, 3 * CHUNK)
        assert get(*whole, wrong) == 404  # right digests in the wrong places
        # a piece of a chunk, its hash known (one byte: 256 guesses), is never served
        one = hashlib.sha256(data[2 * CHUNK : 2 * CHUNK + 1]).hexdigest()
        assert get(2 * CHUNK, 2 * CHUNK + 1, one) == 404
        # the blob's last chunk ends at the blob's end
        last = (len(data) - 1) // CHUNK * CHUNK
        assert get(last, len(data), proof(table, last, len(data))) == 206
    finally:
        server.stop()
        holder.close()


def test_what_peers_are_served_at_once_is_bounded_in_bytes(
        tmp_path: Path, registry: Registry, hello: tuple[str, bytes]) -> None:
    """Each answer's range is read whole into memory before its claim is checked: the bytes
    read for answers at once are bounded (MAX_BYTES_IN_FLIGHT), and a range over what is free
    waits for it, then is refused with 503."""
    digest, data = hello
    holder = RemoteStore(RemoteConfig(tmp_path / "holder", capacity=64 * CHUNK, chunk_size=CHUNK,
                                      background_bw=0, timeout=5))
    server = PeerServer(holder, "127.0.0.1:0", node_id="server", trust=ASKER_TRUST,
                        idle_timeout=2,
                        max_bytes_in_flight=2 * CHUNK)
    server.start()
    try:
        source = holder.open_blob(_ref(registry, digest, len(data), data))
        assert source.pread(len(data), 0) == data
        source.close()
        table = ChunkDigests.compute(io.BytesIO(data).read, len(data), CHUNK)[0]

        def get(start: int, end: int) -> int:
            with httpx.Client() as client:
                headers = {"Range": f"bytes={start}-{end - 1}",
                           PROOF_HEADER: proof(table, start, end)}
                headers["Authorization"] = asker(f"/blobs/{digest}", headers)
                return client.get(f"http://{server.address}/blobs/{digest}",
                                  headers=headers).status_code

        assert get(0, 2 * CHUNK) == 206
        assert get(0, 3 * CHUNK) == 503  # more than the whole budget
        budget = server.server.budget
        assert budget.take(2 * CHUNK, 0)  # as if two chunks were being answered
        assert get(0, CHUNK) == 503  # waited for the idle timeout: nothing came free
        budget.give(2 * CHUNK)
        assert get(0, CHUNK) == 206
        # (the server gives its share back after the answer went out)
        deadline = time.monotonic() + 30
        while budget.used and time.monotonic() < deadline:
            time.sleep(0.01)
        assert budget.used == 0
    finally:
        server.stop()
        holder.close()


def test_a_byte_budget_lets_a_waiter_in_when_bytes_come_back() -> None:
    budget = ByteBudget(10)
    assert budget.take(7, 0) and not budget.take(4, 0)
    got: list[bool] = []
    waiter = threading.Thread(target=lambda: got.append(budget.take(4, 30)))
    waiter.start()
    budget.give(7)
    waiter.join(30)
    assert got == [True] and budget.used == 4
    assert not budget.take(11, 30)  # never fits: refused at once


class _ForgingPeer:
    """A hostile peer (it has the cluster secret): it serves the blob with every ZFile block
    changed and its CRC-32C recomputed, so each block passes the CRC check with other content."""

    def __init__(self, digest: str, data: bytes, offsets: list[int]) -> None:
        forged = bytearray(data)
        for a, z in itertools.pairwise(offsets):
            forged[a + (z - a) // 2] ^= 0x5A
            crc = (~_std_crc32c(memoryview(forged)[a : z - 4], _SALT_INV)) & _MASK
            forged[z - 4 : z] = crc.to_bytes(4, "little")
        self.data = bytes(forged)
        self.served = 0
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                if self.path != f"/blobs/{digest}":
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                a, b = self.headers["Range"].removeprefix("bytes=").split("-")
                body = outer.data[int(a) : int(b) + 1]
                outer.served += len(body)
                self.send_response(206)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.server = _serve(Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_a_peer_cannot_forge_chunks_with_valid_crcs(tmp_path: Path, registry: Registry,
                                                     hello: tuple[str, bytes]) -> None:
    """Crafted blocks with valid CRCs from a peer never reach the reader: each chunk is checked
    against the blob's chunk table (SHA-256) and fetched from the registry instead."""
    digest, data = hello
    layout = parse(lambda n, off: data[off : off + n], len(data), "hello")
    assert layout.offsets is not None
    peer = _ForgingPeer(digest, data, [int(o) for o in layout.offsets])
    # The attack is real: the forged chunks pass the CRC check.
    lo, hi = layout.fetch_range(4 * CHUNK, 5 * CHUNK)
    assert peer.data[lo:hi] != data[lo:hi] and layout.check(4 * CHUNK, 5 * CHUNK,
                                                             peer.data[lo:hi], lo) is None
    s = RemoteStore(RemoteConfig(tmp_path / "me", capacity=64 * CHUNK, chunk_size=CHUNK,
                                 background_bw=0, timeout=5, request_timeout=2,
                                 peers=[peer.url]))
    try:
        source = s.open_blob(_ref(registry, digest, len(data), data))
        assert source.pread(len(data), 0) == data
        source.close()
        assert peer.served > 0  # it was asked, and every answer refused
        assert s.stats.corrupt.get("peer", 0) >= 1 and s.stats.fetched["registry"] > 0
        # What was stored (and is served onward) is the registry's.
        hex_ = digest.split(":", 1)[1]
        assert s.serve_range(hex_, 4 * CHUNK, 5 * CHUNK) == data[4 * CHUNK : 5 * CHUNK]
    finally:
        s.close()
        peer.stop()


def test_blobs_without_a_chunk_table_are_not_asked_from_peers(
        tmp_path: Path, registry: Registry, hello: tuple[str, bytes]) -> None:
    digest, data = hello
    layout = parse(lambda n, off: data[off : off + n], len(data), "hello")
    assert layout.offsets is not None
    peer = _ForgingPeer(digest, data, [int(o) for o in layout.offsets])
    s = RemoteStore(RemoteConfig(tmp_path / "me", capacity=64 * CHUNK, chunk_size=CHUNK,
                                 background_bw=0, timeout=5, peers=[peer.url]))
    try:
        source = s.open_blob(_ref(registry, digest, len(data)))
        assert source.pread(len(data), 0) == data
        source.close()
        assert peer.served == 0 and s.stats.fetched.get("peer", 0) == 0
    finally:
        s.close()
        peer.stop()
