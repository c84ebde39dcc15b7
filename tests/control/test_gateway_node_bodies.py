"""The red team's finding, through the real gateway, scheduler, Redis and a process-backend
node: a node bounded request bodies arriving per TCP peer, and every request of a cluster
reaches its node from the gateway. A stranger that sent slow bodies to its own sandbox through
the gateway used up "the gateway's" bound at the node, and every other team's create on that
node got 429. The node now counts a body the gateway relays against the client the gateway
names (relay/connections.py); here its bound is 2 to reach it with few connections. Clients
are told apart by their loopback address (Linux answers the whole 127/8 on lo)."""

from __future__ import annotations

import contextlib
import json
import socket
from collections.abc import Iterator

import httpx
import pytest

from tests.control.cluster import ROOMY_NODES, LocalCluster, running
from tests.control.helpers import wait_for

pytestmark = pytest.mark.timeout(300)

STRANGER, VICTIM = "127.0.0.2", "127.0.0.3"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    made = LocalCluster(tmp_path_factory.mktemp("bodies"), nodes=1,
                        node_env={**ROOMY_NODES, "AENV_BODY_CONNECTIONS_PER_CLIENT": "2"})
    with running(made, "stranger", "victim") as started:
        yield started


def api(cluster: LocalCluster, team: str, address: str) -> httpx.Client:
    return httpx.Client(base_url=cluster.url, headers={"X-API-KEY": cluster.keys[team]},
                        timeout=60, trust_env=False,
                        transport=httpx.HTTPTransport(local_address=address))


def _slow_upload(cluster: LocalCluster, sandbox_id: str, token: str) -> socket.socket:
    """An upload to the sandbox's envd from the stranger's address, one byte of its body sent:
    envd waits for the rest, and so does the node (reading it from the gateway)."""
    sock = socket.socket()
    sock.bind((STRANGER, 0))
    sock.settimeout(30)
    sock.connect(("127.0.0.1", httpx.URL(cluster.url).port or 80))
    sock.sendall(f"POST /files?path=/tmp/slow HTTP/1.1\r\nhost: x\r\n"
                 f"e2b-sandbox-id: {sandbox_id}\r\nx-access-token: {token}\r\n"
                 "content-type: multipart/form-data; boundary=b\r\n"
                 "content-length: 1000\r\n\r\n-".encode())
    return sock


def _refusals(cluster: LocalCluster) -> list[dict[str, object]]:
    """The node's log lines of bodies refused at its bound (the first is logged, then sampled)."""
    lines = cluster.nodes[0].log_path.read_text().splitlines()
    return [json.loads(line) for line in lines if "its bound of bodies arriving" in line]


def test_a_strangers_slow_bodies_through_the_gateway_leave_other_teams_served(
        cluster: LocalCluster) -> None:
    with api(cluster, "stranger", STRANGER) as stranger:
        made = stranger.post("/sandboxes", json={"templateID": "base", "timeout": 120})
        assert made.status_code == 201, made.text
    sandbox_id, token = made.json()["sandboxID"], made.json()["envdAccessToken"]
    slow: list[socket.socket] = []
    try:
        # more slow uploads than the node's bound: it refuses the third (the gateway, still
        # sending the body, does not read that answer before the body ends)
        slow = [_slow_upload(cluster, sandbox_id, token) for _ in range(3)]
        wait_for("the node refusing the stranger's third body", lambda: _refusals(cluster),
                 timeout=30)

        # another team, from another address, through the same gateway: served
        with api(cluster, "victim", VICTIM) as victim:
            theirs = victim.post("/sandboxes", json={"templateID": "base", "timeout": 60})
            assert theirs.status_code == 201, theirs.text
            victim.delete(f"/sandboxes/{theirs.json()['sandboxID']}")
        assert _refusals(cluster)[0]["client"] == STRANGER  # not the gateway's address
    finally:
        for sock in slow:
            sock.close()
        with api(cluster, "stranger", STRANGER) as stranger, contextlib.suppress(httpx.HTTPError):
            stranger.delete(f"/sandboxes/{sandbox_id}")
