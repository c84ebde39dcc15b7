"""TLS on the gateway -> node hop where configured (relay/tls.py, docs/security.md §2): the
node speaks TLS only, the gateway checks the node's certificate against the cluster's CA, and
a gateway that trusts another CA reaches no node at all (it never falls back to plaintext).
Control requests (create, kill) and a sandbox's WebSocket both cross it; the node's own blockd
resolver is told the CA. One process-backend node; certificates from a throwaway CA."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from agentenv.errors import AgentEnvError
from agentenv.relay.tls import NodeTls
from tests.control.cluster import GatewayProcess, LocalCluster, running
from tests.control.pki import Authority
from tests.node.conftest import free_host_port

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("nodepki")
    ca, stranger = Authority(root, "nodes"), Authority(root, "stranger")
    cert, key = ca.issue("node0", "IP:127.0.0.1")
    return {"ca": ca.cert, "cert": cert, "key": key, "stranger_ca": stranger.cert}


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, pki: dict[str, Path]) -> Iterator[LocalCluster]:
    made = LocalCluster(Path(tmp_path_factory.mktemp("tlscluster")), nodes=1, node_env={
        "AENV_NODE_TLS_CERT": str(pki["cert"]), "AENV_NODE_TLS_KEY": str(pki["key"]),
        "AENV_NODE_TLS_CA": str(pki["ca"])})
    made.gateway.env = {**made.gateway.env, "AENV_NODE_TLS_CA": str(pki["ca"])}
    with running(made, "alpha") as started:
        yield started


def test_the_node_speaks_tls_only(cluster: LocalCluster) -> None:
    node = cluster.nodes[0]
    assert node.url.startswith("https://")
    with pytest.raises(httpx.HTTPError):  # a plaintext client gets no answer
        httpx.get(f"http://127.0.0.1:{node.port}/health", timeout=5)
    with pytest.raises(httpx.ConnectError):  # nor one that does not trust the cluster's CA
        httpx.get(f"https://127.0.0.1:{node.port}/health", timeout=5)
    assert httpx.get(node.url + "/health", verify=node.verify, timeout=5).status_code == 200


def test_sandboxes_and_their_websockets_cross_tls(cluster: LocalCluster) -> None:
    from websockets.sync.client import connect
    from websockets.sync.server import serve

    def echo(ws: Any) -> None:
        for message in ws:
            ws.send(message)

    port = free_host_port()  # opened to process sandboxes (tests/node/conftest.py)
    key = {"X-API-KEY": cluster.keys["alpha"]}
    with serve(echo, "127.0.0.1", port) as server:
        threading.Thread(target=server.serve_forever, daemon=True).start()
        created = httpx.post(f"{cluster.url}/v2/sandboxes", headers=key, timeout=60,
                             json={"templateID": "base", "timeout": 120})
        assert created.status_code == 201, created.text
        sid = created.json()["sandboxID"]
        try:
            ws_url = cluster.url.replace("http://", "ws://") + "/ws"
            with connect(ws_url, additional_headers={
                    "E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": str(port)}) as ws:
                ws.send("through tls")
                assert ws.recv(timeout=30) == "through tls"
            listed = httpx.get(f"{cluster.url}/sandboxes", headers=key, timeout=30)
            assert sid in {s["sandboxID"] for s in listed.json()}
        finally:
            assert httpx.delete(f"{cluster.url}/sandboxes/{sid}", headers=key,
                                timeout=60).status_code == 204
            server.shutdown()


def test_a_gateway_trusting_another_ca_reaches_no_node(cluster: LocalCluster,
                                                       pki: dict[str, Path]) -> None:
    other = GatewayProcess(cluster.scheduler.address, cluster.redis.url, cluster.secret_file,
                           cluster.root / "gateway-stranger.log",
                           env={**cluster.redis.env("gateway"),
                                "AENV_NODE_TLS_CA": str(pki["stranger_ca"])})
    other.start()
    try:
        created = httpx.post(f"{other.url}/v2/sandboxes", timeout=60,
                             headers={"X-API-KEY": cluster.keys["alpha"]},
                             json={"templateID": "base", "timeout": 120})
        assert created.status_code in (502, 503), created.text
        assert "sandboxID" not in created.json()
    finally:
        other.stop()


def test_settings_are_checked_at_start(tmp_path: Path, pki: dict[str, Path]) -> None:
    with pytest.raises(AgentEnvError, match="go together"):
        NodeTls.from_env({"AENV_NODE_TLS_CERT": str(pki["cert"])})
    (tmp_path / "empty.pem").write_text("nothing\n")
    with pytest.raises(AgentEnvError, match="holds no PEM"):
        NodeTls.from_env({"AENV_NODE_TLS_CA": str(tmp_path / "empty.pem")})
    with pytest.raises(AgentEnvError, match="AENV_NODE_TLS_CERT/AENV_NODE_TLS_KEY"):
        NodeTls.from_env({"AENV_NODE_TLS_CERT": str(pki["cert"]),
                          "AENV_NODE_TLS_KEY": str(pki["ca"])})  # a certificate, not its key
    tls = NodeTls.from_env({"AENV_NODE_TLS_CA": str(pki["ca"])})
    assert (tls.serves, tls.scheme) == (False, "https")
