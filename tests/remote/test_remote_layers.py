"""Remote layers end to end: a real docker-registry on loopback, real blockd processes (the
nodes), a 1 GiB overlaybd image made by our converter (tests/remote/bigimage.py).

Reading 1 GiB through a VM under TCG is slow, so the whole-disk checks read blockd's NBD
export on the host; the files are read from the device's FUSE file with debugfs (what a
guest's ext4 would read)."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import socket
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import httpx
import pytest

from agentenv.blockd.remote.identity import NodeIdentity, load_identity
from agentenv.cluster_keys import PEER_SCHEME, peer_request
from agentenv.storage.blob import load_descriptor
from agentenv.template.pull import pull_image
from tests.blockd.conftest import Daemon
from tests.blockd.nbdclient import NbdClient
from tests.remote import bigimage
from tests.template.registry_server import Registry, start_registry, stop_registry

pytestmark = [pytest.mark.root, pytest.mark.slow]
MiB = 1 << 20


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Node:
    name: str
    daemon: Daemon
    state: Path  # the node's aenv state (pulled images)
    p2p: str | None

    def stats(self) -> dict:  # type: ignore[type-arg]
        with self.daemon.client() as client:
            return client.call("remote_stats")  # type: ignore[no-any-return]

    def device(self, image_json: Path) -> dict:  # type: ignore[type-arg]
        with self.daemon.client() as client:
            return client.call("create", image=str(image_json), readonly=True)  # type: ignore[no-any-return]


@dataclass
class World:
    root: Path
    registry: Registry
    image: bigimage.BigImage
    trust_file: Path  # every node's line (`aenv peer-key`), with its chunk server's address
    nodes: list[Node]

    def trust(self, name: str, state_dir: Path, address: str | None) -> None:
        """Node `name`'s key pair (blockd's, made under its state now) goes into the trust
        file every node reads (again when it changes)."""
        line = load_identity(state_dir, name).trust_line()
        with self.trust_file.open("a") as f:
            f.write(line + (f" http://{address}" if address else "") + "\n")

    @property
    def ref(self) -> str:
        return f"{self.registry.host}/big:v1"

    def node(self, name: str, *, peers: list[Node] = (), cache: str = "2G",  # type: ignore[assignment]
             timeout: float = 30, serve: bool = True) -> Node:
        root = Path(tempfile.mkdtemp(prefix=f"rl{name}", dir="/tmp"))
        daemon = Daemon(root)
        p2p = f"127.0.0.1:{_port()}" if serve else None
        self.trust(name, daemon.state_dir, p2p)
        daemon.extra_args = ["--chunk-cache-size", cache, "--remote-timeout", str(timeout),
                             "--remote-background-bw", "0", "--peer-node-id", name,
                             "--peer-trust-file", str(self.trust_file)]
        for peer in peers:
            daemon.extra_args += ["--peer", f"http://{peer.p2p}"]
        if p2p:
            daemon.extra_args += ["--p2p-listen", p2p]
        daemon.start()
        node = Node(name, daemon, root / "aenv", p2p)
        self.nodes.append(node)
        return node

    def pull(self, node: Node) -> Path:
        pulled = pull_image(self.ref, state_dir=node.state)
        assert pulled.format == "overlaybd" and pulled.layers_fetched == 1
        # Only metadata came over the wire: the jump table (1 MiB for 4 KiB blocks), the
        # ZFile header and trailer, the LSMT header, index and trailer.
        assert pulled.bytes_downloaded < 3 * MiB
        return pulled.image_json


@pytest.fixture(scope="module")
def world() -> Iterator[World]:
    if os.geteuid() != 0:
        pytest.skip("needs root (blockd's FUSE mount)")
    image = bigimage.build()
    root = Path(tempfile.mkdtemp(prefix="remote-layers-"))
    (root / "registry").mkdir()
    registry = start_registry(root / "registry")
    trust_file = root / "peers.trust"
    trust_file.write_text("# <node id> ed25519:<key> [http://host:port]: `aenv peer-key`\n")
    w = World(root, registry, image, trust_file, [])
    old_docker = os.environ.get("DOCKER_CONFIG")
    os.environ["DOCKER_CONFIG"] = str(root / "docker")  # the host's credentials never leak in
    try:
        bigimage.push(image, registry.host, "big", "v1")
        yield w
    finally:
        for node in w.nodes:
            node.daemon.stop()
            log = node.daemon.root / "blockd.log"  # shown by pytest only when a test failed
            if log.exists():
                print(f"--- {node.name}: {log}\n" + "\n".join(log.read_text().splitlines()[-60:]))
            subprocess.run(["fusermount3", "-u", "-z", "-q", str(node.daemon.state_dir / "fuse")],
                           stderr=subprocess.DEVNULL, check=False)
            shutil.rmtree(node.daemon.root, ignore_errors=True)
        if registry.process.poll() is None:
            stop_registry(registry)
        shutil.rmtree(root, ignore_errors=True)
        if old_docker is None:
            os.environ.pop("DOCKER_CONFIG", None)
        else:
            os.environ["DOCKER_CONFIG"] = old_docker


def _disk_sha256(info: dict, size: int, passes: int = 1) -> list[str]:  # type: ignore[type-arg]
    client = NbdClient(info["nbd"], info["export"], timeout=120)
    digests = []
    try:
        for _ in range(passes):
            hasher = hashlib.sha256()
            for off in range(0, size, 8 * MiB):
                hasher.update(client.read(off, min(8 * MiB, size - off)))
            digests.append(hasher.hexdigest())
    finally:
        client.close()
    return digests


def _debugfs_cat(device_file: str, path: str, out: Path) -> bytes:
    subprocess.run(["debugfs", "-R", f"dump {path} {out}", device_file], check=True,
                   capture_output=True, timeout=120)
    return out.read_bytes()


def _fetched(stats: dict, source: str) -> int:  # type: ignore[type-arg]
    return int(stats["fetched_bytes"].get(source, 0))


def test_cold_start_fetches_little_and_reads_right(world: World, tmp_path: Path) -> None:
    a = world.node("a")
    image_json = world.pull(a)
    lower = json.loads(image_json.read_text())["lowers"][0]
    assert lower["remote"] is True and load_descriptor(Path(lower["file"])).size == world.image.blob_size
    info = a.device(image_json)
    assert info["size"] == world.image.virtual_size
    # A few files, as a booting guest would read them.
    assert _debugfs_cat(info["file"], "/hello.txt", tmp_path / "h") == bigimage.SMALL_FILES["hello.txt"]
    assert _debugfs_cat(info["file"], "/etc/hostname", tmp_path / "n") == bigimage.SMALL_FILES["etc/hostname"]
    medium = _debugfs_cat(info["file"], "/data/medium.bin", tmp_path / "m")
    assert hashlib.sha256(medium).hexdigest() == world.image.medium_sha256
    stats = a.stats()
    fetched = _fetched(stats, "registry")
    assert 0 < fetched < world.image.blob_size // 10, stats
    assert stats["misses"] > 0 and stats["eio"] == 0
    # Then everything: every byte of the disk is the converter's.
    [digest] = _disk_sha256(info, world.image.virtual_size)
    assert digest == world.image.disk_sha256
    stats = a.stats()
    assert stats["cache_bytes"] <= stats["capacity"]
    blob = next(b for b in stats["blobs"] if b["digest"] == world.image.blob_digest)
    deadline = time.monotonic() + 60
    while not blob["complete"] and time.monotonic() < deadline:  # its digest is being checked
        time.sleep(0.5)
        blob = next(b for b in a.stats()["blobs"] if b["digest"] == world.image.blob_digest)
    assert blob["complete"], blob


def test_cache_smaller_than_the_image(world: World) -> None:
    small = world.node("small", cache="256M", serve=False)
    image_json = world.pull(small)
    info = small.device(image_json)
    cache_dir = small.daemon.state_dir / "chunk-cache" / "blobs"
    high = 0
    stop = threading.Event()

    def watch() -> None:
        nonlocal high
        while not stop.wait(0.05):
            used = sum(p.stat().st_blocks * 512 for p in cache_dir.glob("*.data"))
            high = max(high, used)

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        digests = _disk_sha256(info, world.image.virtual_size, passes=2)
    finally:
        stop.set()
        watcher.join()
    assert digests == [world.image.disk_sha256] * 2
    stats = small.stats()
    assert stats["evictions"] > 0 and stats["cache_bytes"] <= 256 * MiB, stats
    assert high <= 256 * MiB + MiB, f"the cache held {high} bytes"
    # Read twice: the second pass fetched the image again (it cannot fit), not more.
    assert _fetched(stats, "registry") < 2.2 * world.image.blob_size


class _Tamper:
    """A tiny HTTP server that serves the image's blob with one byte flipped in every MiB,
    as a peer (with the cluster secret) and as a registry (/v2/.../blobs/...)."""

    def __init__(self, blob: Path, digest: str) -> None:
        data = bytearray(blob.read_bytes())
        for off in range(700_000, len(data), MiB):
            data[off] ^= 0x5A
        body = bytes(data)
        served = self.served = [0]

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def do_GET(self) -> None:
                if self.path == "/v2/":
                    self.send_response(200)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                if not self.path.endswith(digest):
                    self.send_response(404)
                    self.send_header("Content-Length", "0")
                    self.end_headers()
                    return
                a, b = self.headers["Range"].removeprefix("bytes=").split("-")
                chunk = body[int(a) : int(b) + 1]
                served[0] += len(chunk)
                self.send_response(206)
                self.send_header("Content-Length", str(len(chunk)))
                self.end_headers()
                self.wfile.write(chunk)

        class Server(ThreadingHTTPServer):
            daemon_threads = True

            def server_bind(self) -> None:  # no reverse DNS lookup (see docs/network.md)
                import socketserver

                socketserver.TCPServer.server_bind(self)
                self.server_name, self.server_port = "127.0.0.1", self.server_address[1]

        self.server = Server(("127.0.0.1", 0), Handler)
        self.address = f"127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_corrupt_chunks_from_a_peer_or_a_registry_never_reach_the_reader(world: World) -> None:
    tamper = _Tamper(world.image.blob, world.image.blob_digest)
    a = next(n for n in world.nodes if n.name == "a")
    try:
        # A bad peer first, then a good one (A).
        bad_peer = Node("tamper", a.daemon, a.state, tamper.address)
        # a node taken over: trusted, with a key of its own (it ignores credentials)
        world.trust("tamper", world.root / "tamper", tamper.address)
        d = world.node("d", peers=[bad_peer, a], serve=False)
        info = d.device(world.pull(d))
        client = NbdClient(info["nbd"], info["export"], timeout=60)
        try:
            for off in (0, 300 * MiB, 900 * MiB):
                got = client.read(off, 4 * MiB)
                assert got == _disk_range(world, off, 4 * MiB)
        finally:
            client.close()
        stats = d.stats()
        assert stats["corrupt"].get("peer", 0) >= 1, stats
        assert tamper.served[0] > 0
        # A bad registry first (recorded as the blob's first source), then the real one.
        e = world.node("e", serve=False)
        image_json = world.pull(e)
        desc_path = Path(json.loads(image_json.read_text())["lowers"][0]["file"])
        ref = load_descriptor(desc_path)
        from agentenv.storage.blob import BlobLocation

        ref.sources.insert(0, BlobLocation(tamper.address, "big", None, True))
        ref.save(desc_path)
        info = e.device(image_json)
        client = NbdClient(info["nbd"], info["export"], timeout=60)
        try:
            for off in (100 * MiB, 600 * MiB):
                assert client.read(off, 4 * MiB) == _disk_range(world, off, 4 * MiB)
        finally:
            client.close()
        stats = e.stats()
        assert stats["corrupt"].get("registry", 0) >= 1, stats
    finally:
        tamper.stop()


def _disk_range(world: World, off: int, n: int) -> bytes:
    """The converter's bytes for a disk range, read from node A (which has it all, verified
    against the disk's sha256 by the first test)."""
    a = next(node for node in world.nodes if node.name == "a")
    with a.daemon.client() as client:
        devices = client.call("list")
    dev = next(d for d in devices if d["kind"] == "shared")
    c = NbdClient(dev["nbd"], dev["export"], timeout=60)
    try:
        return c.read(off, n)
    finally:
        c.close()


def test_registry_down_peer_serves_then_eio(world: World) -> None:
    a = next(n for n in world.nodes if n.name == "a")
    b = world.node("b", peers=[a], serve=False)
    c = world.node("c", peers=[a], serve=False, timeout=3)
    image_b, image_c = world.pull(b), world.pull(c)
    info_c = c.device(image_c)  # opened (its metadata read) while everything is up
    stop_registry(world.registry)
    info_b = b.device(image_b)
    # Spread over the disk (A read all of it against the converter's sha256 above).
    client = NbdClient(info_b["nbd"], info_b["export"], timeout=120)
    try:
        for off in (0, 200 * MiB, 700 * MiB, world.image.virtual_size - 32 * MiB):
            assert client.read(off, 32 * MiB) == _disk_range(world, off, 32 * MiB), off
    finally:
        client.close()
    stats = b.stats()
    # ZFile chunks are compressed and readahead varies: well over half the logical bytes read.
    assert _fetched(stats, "registry") == 0 and _fetched(stats, "peer") >= 64 * MiB, stats
    # A goes too: C's guest gets EIO within the timeout, and C says why.
    a.daemon.stop()
    client = NbdClient(info_c["nbd"], info_c["export"], timeout=60)
    try:
        t0 = time.monotonic()
        with pytest.raises(OSError) as raised:
            client.read(500 * MiB, 4096)
        waited = time.monotonic() - t0
    finally:
        client.close()
    assert raised.value.errno == 5 and waited < 3 + 2, waited
    assert c.stats()["eio"] >= 1
    log = c.daemon.log_file.read_text()
    assert "remote read failed" in log and world.image.blob_digest in log


def test_p2p_needs_a_trusted_nodes_credential(world: World) -> None:
    """A fresh serving blockd (static peers): without a credential, with a bearer key (the
    shared peer key of old) or with one an untrusted key signed it answers 401; a trusted
    node's credential for it gets in, and it lists nothing it holds (404)."""
    f = world.node("f")
    url = f"http://{f.p2p}/blobs"
    assert httpx.get(url).status_code == 401
    assert httpx.get(url, headers={"Authorization": f"Bearer {'ab' * 32}"}).status_code == 401
    # node a of the module's earlier tests (its own when this test runs alone)
    a = next((n for n in world.nodes if n.name == "a"), None) or world.node("a", serve=False)
    signer = load_identity(a.daemon.state_dir, "a")  # blockd a's own key pair
    request = peer_request("GET", "/blobs", None, None)  # what httpx.get(url) asks
    assert httpx.get(url, headers={
        "Authorization": f"{PEER_SCHEME} {signer.credential_for('f', request)}"}
    ).status_code == 404
    stranger = load_identity(world.root / "stranger", "a")  # a key of its own, a's name
    assert httpx.get(url, headers={
        "Authorization": f"{PEER_SCHEME} {stranger.credential_for('f', request)}"}
    ).status_code == 401
    assert isinstance(signer, NodeIdentity)
