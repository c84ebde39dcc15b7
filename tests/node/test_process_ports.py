"""The process backend's sandboxes are processes of the node's host: the proxy relays a
sandbox port only to a socket one of the sandbox's own processes listens on (never to the
node's API or another service of the host), and a node of a cluster refuses the backend
unless the operator says the cluster is a development one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.node.conftest import NodeProcess, free_port
from tests.node.test_api import run

pytestmark = pytest.mark.timeout(180)

ALLOW = "AENV_ALLOW_PROCESS_BACKEND_IN_CLUSTER"


def test_a_cluster_node_refuses_the_process_backend(tmp_path: Path) -> None:
    secret = tmp_path / "cluster-secret"
    secret.write_text("s" * 40 + "\n")
    secret.chmod(0o600)
    env = {k: v for k, v in os.environ.items() if k not in (ALLOW, "AENV_API_KEY")}
    node = subprocess.Popen(
        [sys.executable, "-m", "agentenv.node", "--backend", "process", "--cluster-secret-file",
         str(secret), "--state-dir", str(tmp_path / "state"), "--port", str(free_port())],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        out, _ = node.communicate(timeout=60)
    except subprocess.TimeoutExpired:
        node.kill()
        node.communicate()
        pytest.fail("a cluster node started with the process backend")
    assert node.returncode != 0
    assert ALLOW.encode() in out and b"process backend" in out, out[-2000:]


@pytest.fixture
def process_node(tmp_path: Path) -> Iterator[NodeProcess]:
    node = NodeProcess(tmp_path / "state", tmp_path / "node.log")
    node.start()
    yield node
    node.cleanup()


def test_the_proxy_relays_only_ports_of_the_sandboxs_own_processes(
        process_node: NodeProcess) -> None:
    with process_node.client() as api:
        created = api.post("/v2/sandboxes", json={"timeout": 120})
        assert created.status_code == 201, created.text
        sid, token = created.json()["sandboxID"], created.json()["envdAccessToken"]
        try:
            with httpx.Client(base_url=process_node.url, timeout=30, trust_env=False) as client:
                # The node's own API, as a port of the sandbox: refused, never relayed.
                own = client.get("/health", headers={"E2b-Sandbox-Id": sid,
                                                     "E2b-Sandbox-Port": str(process_node.port)})
                assert own.status_code == 502, own.text
                assert "not listened on by a process of sandbox" in own.json()["message"]

                # envd's own port, named by its number: not a way around the envd port's
                # guards (/init is the node's only).
                run_json = process_node.state_dir / "process-backend" / "sandboxes" / sid / "run.json"
                envd_port = json.loads(run_json.read_text())["envd_port"]
                alias = client.post("/init", json={}, headers={"E2b-Sandbox-Id": sid,
                                                               "E2b-Sandbox-Port": str(envd_port)})
                assert alias.status_code == 502, alias.text
                assert "envd is reached as port 49983" in alias.json()["message"]

                # A server the sandbox runs is relayed.
                port = free_port()
                run(process_node, sid, token,
                    "mkdir -p /tmp/www && echo from-the-sandbox > /tmp/www/index.html && "
                    f"/agentenv/bin/busybox httpd -p 127.0.0.1:{port} -h /tmp/www")
                mine = client.get("/index.html", headers={"E2b-Sandbox-Id": sid,
                                                          "E2b-Sandbox-Port": str(port)})
                assert mine.status_code == 200 and mine.text == "from-the-sandbox\n", mine.text
        finally:
            api.delete(f"/sandboxes/{sid}")
