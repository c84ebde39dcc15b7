"""P2P peers found through the scheduler: two blockd + process-backend node pairs heartbeat to a
real scheduler (Debian's redis-server behind it), a real docker-registry on loopback serves the
hello-world overlaybd image. Node A reads the remote layer (and completes it), the registry is
stopped, and node B, with no static peer, reads the same layer from A: its blockd asked node B
(over TLS: B's API serves it, relay/tls.py), which asked the scheduler's Holders, which knew A's
blobs from A's heartbeats."""

from __future__ import annotations

import dataclasses
import io
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentenv.cluster_keys import node_key
from agentenv.storage.image import Image
from agentenv.template.pull import pull_image
from tests.blockd.conftest import Daemon
from tests.blockd.nbdclient import NbdClient
from tests.control.conftest import RedisServer, SchedulerProcess, free_port, prefix, redis_server
from tests.control.helpers import call, wait_for
from tests.control.pki import Authority
from tests.node.conftest import NodeProcess
from tests.remote import chunktables
from tests.template import helpers
from tests.template.registry_server import start_registry, stop_registry

__all__ = ["prefix", "redis_server"]  # fixtures, used by name

pytestmark = [pytest.mark.root, pytest.mark.slow]
KiB = 1 << 10


class Pair:
    """A node: its blockd (chunk cache, chunk server) and a process-backend node beside it."""

    def __init__(self, name: str, root: Path, scheduler: str, secret: str,
                 background_bw: str, tls: dict[str, str] | None = None) -> None:
        self.name = name
        root.mkdir(parents=True, exist_ok=True)
        # no shared peer key: its peers take the credentials the scheduler issues its node
        node_key_file = root / "node-key"
        node_key_file.write_text(node_key(secret, name))
        self.daemon = Daemon(root / "blockd", fuse=False)
        self.p2p = f"127.0.0.1:{free_port()}"
        self.daemon.extra_args = [
            "--chunk-cache-size", "64M", "--remote-timeout", "10",
            "--remote-background-bw", background_bw, "--p2p-listen", self.p2p,
        ]
        self.state = root / "aenv"  # the pulled image's descriptors
        self.node = NodeProcess(
            root / "node", root / "node.log",
            # a cluster's node: its API (and so blockd's resolver) wants its key, and the
            # scheduler takes its heartbeats only with a token derived from it
            extra_args=("--backend", "process", "--scheduler", scheduler, "--node-id", name,
                        "--node-key-file", str(node_key_file)),
            extra_env={"AENV_BLOCKD_SOCKET": str(self.daemon.socket), **(tls or {})},
        )
        if tls:  # its certificate names the address it advertises
            self.node.extra_args += ("--advertise", f"127.0.0.1:{self.node.port}")

    def start(self) -> None:
        self.daemon.root.mkdir(parents=True, exist_ok=True)
        self.daemon.start()
        self.node.start()

    def stats(self) -> dict[str, Any]:
        with self.daemon.client() as client:
            return dict(client.call("remote_stats"))

    def read(self, image_json: Path, extents: list[tuple[int, int]]) -> list[bytes]:
        with self.daemon.client() as client:
            info = client.call("create", image=str(image_json), readonly=True)
        nbd = NbdClient(info["nbd"], info["export"], timeout=60)
        try:
            return [nbd.read(off, n) for off, n in extents]
        finally:
            nbd.close()

    def stop(self) -> None:
        self.node.stop()
        self.daemon.stop()


@pytest.fixture
def cluster(redis_server: RedisServer, prefix: str,
            monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[Any, ...]]:
    root = Path(tempfile.mkdtemp(prefix="p2p-sched-", dir="/tmp"))
    monkeypatch.setenv("DOCKER_CONFIG", str(root / "docker"))  # no host credentials
    monkeypatch.setenv("AENV_CHUNK_SIZE", "64K")  # the 627 KiB blob in 10 chunks
    (root / "registry").mkdir()
    registry = start_registry(root / "registry")
    sched = SchedulerProcess(redis_server.url, prefix, root / "scheduler.log",
                             "--heartbeat-interval", "0.3")
    pairs: list[Pair] = []
    try:
        sched.start()
        secret = sched.secret_file.read_text().strip()
        # A completes the blobs it uses (so it holds it whole); B fetches only what it reads.
        # B's API serves TLS (relay/tls.py): its blockd asks it by https, checked with the CA.
        ca = Authority(root / "pki", "nodes")
        cert, key = ca.issue("node-b", "IP:127.0.0.1")
        tls = {"AENV_NODE_TLS_CERT": str(cert), "AENV_NODE_TLS_KEY": str(key),
               "AENV_NODE_TLS_CA": str(ca.cert)}
        pairs += [Pair("node-a", root / "a", sched.address, secret, "64M"),
                  Pair("node-b", root / "b", sched.address, secret, "0", tls)]
        for pair in pairs:
            pair.start()
        yield registry, sched, pairs[0], pairs[1], root
    finally:
        for pair in pairs:
            pair.stop()
        sched.stop()
        if registry.process.poll() is None:
            stop_registry(registry)
        subprocess.run(["sync"], check=False)
        shutil.rmtree(root, ignore_errors=True)


def test_node_b_reads_from_a_found_by_the_scheduler(cluster: tuple[Any, ...]) -> None:
    registry, sched, a, b, root = cluster
    image = helpers.fixture_image("amd64-converted")
    # Its layer's chunk table in the manifest (64 KiB chunks, as these nodes use): what lets
    # B take A's chunks.
    image = dataclasses.replace(image, manifest=chunktables.annotate(
        image.manifest, lambda digest: io.BytesIO(image.blobs[digest]), 64 * KiB))
    registry.push("hello-world", "amd64-converted", image)
    digest = next(d for d in image.blobs if d.startswith("sha256:0222"))
    local = root / "blob"
    local.write_bytes(image.blobs[digest])
    with Image.open(local, writable=False) as whole:
        extents = [(off, min(n, 256 * KiB)) for off, n, data in whole.extents() if data]
        expected = [whole.read(off, n) for off, n in extents]
    assert extents
    ref = f"{registry.host}/hello-world:amd64-converted"
    image_a = pull_image(ref, state_dir=a.state).image_json
    image_b = pull_image(ref, state_dir=b.state).image_json  # manifests only: no blob data

    assert a.read(image_a, extents) == expected
    assert a.stats()["fetched_bytes"].get("registry", 0) > 0
    # A's heartbeats report the blob, whole once its background completion checked the digest.
    holders = wait_for("the scheduler to know A holds the blob whole", lambda: [
        h for h in call(sched.address, "holders", [digest], node_id="node-b")[digest]
        if h.complete], timeout=60)
    assert [(h.node_id, h.layer_address) for h in holders] == [("node-a", a.p2p)]
    # B's node answers its blockd: B serves its gateway only, so blockd sends B's key.
    cluster = {"x-agentenv-node-key": node_key(sched.secret_file.read_text().strip(), "node-b")}
    reply = httpx.get(f"{b.node.url}/cluster/holders", params={"digest": digest},
                      headers=cluster, trust_env=False, verify=b.node.verify)
    assert reply.status_code == 200, reply.text
    [holder] = reply.json()["holders"]
    # with the credential the scheduler issued node-b for node-a's chunk server
    assert holder.pop("credential").startswith("v1/node-b/")
    assert holder == {"address": f"http://{a.p2p}", "complete": True, "node_id": "node-a"}
    assert httpx.get(f"{b.node.url}/cluster/holders", params={"digest": digest},
                     trust_env=False, verify=b.node.verify).status_code == 403
    assert httpx.get(f"{b.node.url}/cluster/holders", params={"digest": "sha256:x"},
                     headers=cluster, trust_env=False, verify=b.node.verify).status_code == 400
    # A's node answers for itself: it holds the blob, so no other holder.
    as_a = {"x-agentenv-node-key": node_key(sched.secret_file.read_text().strip(), "node-a")}
    # B's key is not A's: each node holds a key good for itself only
    assert httpx.get(f"{a.node.url}/cluster/holders", params={"digest": digest},
                     headers=cluster, trust_env=False).status_code == 403
    reply = httpx.get(f"{a.node.url}/cluster/holders", params={"digest": digest},
                      headers=as_a, trust_env=False)
    assert reply.status_code == 200 and reply.json()["holders"] == [], reply.text
    wait_for("node B's blockd to know its resolver", lambda: b.stats()["resolver"], timeout=30)
    assert b.stats()["peers"] == []  # no static peer

    stop_registry(registry)
    assert b.read(image_b, extents) == expected
    stats = b.stats()
    assert stats["fetched_bytes"].get("registry", 0) == 0, stats
    assert stats["fetched_bytes"].get("peer", 0) > 0, stats
    assert stats["eio"] == 0 and stats["source_failures"].get("resolver", 0) == 0, stats
    # B now serves what it read: its heartbeats make it a holder for A, never for itself.
    wait_for("B to be a holder", lambda: call(sched.address, "holders", [digest],
                                              node_id="node-a")[digest], timeout=30)
    assert [h.node_id for h in call(sched.address, "holders", [digest],
                                     node_id="node-b")[digest]] == ["node-a"]
