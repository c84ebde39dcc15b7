"""Who reads /metrics, in-process: on a node of a cluster, its gateway (the node's key) or a
scraper with the cluster's metrics token (derived from the secret, good for /metrics only); on
a standalone node, the API key; anyone only when the node is told its metrics are public. The
gateway's /metrics takes the same metrics token."""

from __future__ import annotations

import secrets
import warnings
from pathlib import Path

from agentenv.api.auth import metrics_token
from agentenv.cluster_keys import node_key
from agentenv.control.gateway.app import GatewayApp
from agentenv.control.gateway.placement import SchedulerLink
from agentenv.control.gateway.store import GatewayStore
from agentenv.node.server import ServeOptions, build_app
from agentenv.scheduling.client import Credentials

with warnings.catch_warnings():  # starlette 1.x nags about httpx here; TestClient still works
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient

SECRET = secrets.token_urlsafe(32)
TOKEN = metrics_token(SECRET)
NODE_KEY = node_key(SECRET, "n1")


def test_cluster_node_metrics_need_the_node_key_or_the_metrics_token(tmp_path: Path) -> None:
    app = build_app(ServeOptions(state_dir=tmp_path / "state", backend="process",
                                 node_key=NODE_KEY, metrics_token=TOKEN))
    client = TestClient(app)
    for refused in ({}, {"Authorization": f"Bearer {SECRET}"}, {"Authorization": "Bearer x"},
                    {"Authorization": f"Bearer {NODE_KEY}"}, {"x-agentenv-node-key": SECRET},
                    {"Authorization": f"Basic {TOKEN}"},
                    [("Authorization", f"Bearer {TOKEN}")] * 2):
        assert client.get("/metrics", headers=refused).status_code == 403, refused
    for allowed in ({"Authorization": f"Bearer {TOKEN}"}, {"x-agentenv-node-key": NODE_KEY}):
        answer = client.get("/metrics", headers=allowed)
        assert answer.status_code == 200 and "aenv_node_sandboxes" in answer.text
    # the metrics token opens /metrics and nothing else
    assert client.get("/v2/sandboxes", headers={"Authorization": f"Bearer {TOKEN}"}
                      ).status_code == 403


def test_public_metrics_when_told(tmp_path: Path) -> None:
    for key in (None, NODE_KEY):
        app = build_app(ServeOptions(state_dir=tmp_path / f"state-{bool(key)}",
                                     backend="process", node_key=key,
                                     public_metrics=True))
        client = TestClient(app)
        assert client.get("/metrics").status_code == 200
        assert client.get("/v2/sandboxes").status_code in (401, 403)  # only /metrics opens


def test_gateway_metrics_need_the_metrics_token() -> None:
    def gateway(public: bool) -> TestClient:
        return TestClient(GatewayApp(
            SchedulerLink("127.0.0.1:9", Credentials.gateway(SECRET)),
            GatewayStore("redis://127.0.0.1:9/0"), SECRET, public_metrics=public))

    closed = gateway(False)
    for refused in ({}, {"Authorization": f"Bearer {SECRET}"}, {"Authorization": "Bearer x"}):
        answer = closed.get("/metrics", headers=refused)
        assert answer.status_code == 401 and "metrics token" in answer.json()["message"]
    answer = closed.get("/metrics", headers={"Authorization": f"Bearer {TOKEN}"})
    assert answer.status_code == 200 and "aenv_gateway_signed_file_requests" in answer.text
    assert gateway(True).get("/metrics").status_code == 200
