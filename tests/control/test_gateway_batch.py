"""Batches spilling over through the gateway (control/gateway/batch.py): a create with `count`
that one node has no room for is placed across the cluster in one answer, a result per child in
order; past the whole cluster's room the rest are per-child 429s and nothing else is made (the
team's quota keeps only what was made); a fork from a snapshot spills over only through the
snapshot repository (without it, its refused children say so); a keyed batch retried gets the
first answer. Real parts: redis-server, `aenv scheduler`, `aenv gateway` and two
process-backend nodes admitting PER_NODE sandboxes each (AENV_MAX_SANDBOXES)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.control.cluster import ROOMY_NODES, GatewayProcess, LocalCluster, running
from tests.control.helpers import call, sandbox_and_snapshot, team_api, wait_for
from tests.control.test_gateway import gateway_metrics

pytestmark = pytest.mark.timeout(300)

PER_NODE = 3
TEAM = "alpha"


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    made = LocalCluster(tmp_path_factory.mktemp("cluster"), nodes=2, strategy="round-robin",
                        node_env={**ROOMY_NODES, "AENV_MAX_SANDBOXES": str(PER_NODE)})
    with running(made, TEAM) as started:
        yield started


@pytest.fixture
def api(cluster: LocalCluster) -> Iterator[httpx.Client]:
    with team_api(cluster, TEAM, timeout=300) as client:
        yield client
    # every test starts from an empty cluster: the nodes' room back
    wait_for("the nodes to report their room back", lambda: all(
        n.status.running == 0 for n in call(cluster.scheduler.address, "list_nodes")))


def _on_node(cluster: LocalCluster, i: int) -> set[str]:
    """The team's sandboxes node `i` holds, asked of the node itself."""
    node = cluster.nodes[i]
    listed = httpx.get(f"{node.url}/v2/sandboxes", timeout=30, trust_env=False,
                       headers=cluster.node_headers(node, TEAM))
    assert listed.status_code == 200, listed.text
    return {s["sandboxID"] for s in listed.json()}


def _quota(cluster: LocalCluster) -> list[tuple[str, float]]:
    held = cluster.redis.raw("gateway").zrange(f"aenv:quota:sandboxes:{TEAM}", 0, -1,
                                               withscores=True)
    return [(m.decode() if isinstance(m, bytes) else m, score) for m, score in held]


def _made(results: list[dict[str, Any]]) -> list[str]:
    return [r["sandbox"]["sandboxID"] for r in results if r.get("sandbox")]


def test_a_batch_larger_than_a_node_is_placed_across_the_cluster(
        cluster: LocalCluster, api: httpx.Client) -> None:
    before = gateway_metrics(cluster.url).get(
        'aenv_gateway_batch_spilled_total{kind="template"}', 0.0)
    answer = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 120,
                                             "count": 2 * PER_NODE})
    assert answer.status_code == 201, answer.text
    results = answer.json()
    assert len(results) == 2 * PER_NODE
    assert all(r.get("sandbox") for r in results), results
    made = _made(results)
    assert len(set(made)) == 2 * PER_NODE
    # each node holds its room's worth: the first node's children come first, in order
    first, second = _on_node(cluster, 0), _on_node(cluster, 1)
    assert len(first) == len(second) == PER_NODE
    home = first if made[0] in first else second
    assert set(made[:PER_NODE]) == home
    for sandbox_id in made:  # every child is the team's, reachable through the gateway
        got = api.get(f"/sandboxes/{sandbox_id}")
        assert got.status_code == 200, got.text
    after = gateway_metrics(cluster.url)['aenv_gateway_batch_spilled_total{kind="template"}']
    assert after - before == PER_NODE
    assert b"batch spilled over" in cluster.gateway.log.read_bytes()


def test_a_batch_past_the_cluster_s_room_gets_a_429_per_child_and_nothing_half_made(
        cluster: LocalCluster, api: httpx.Client) -> None:
    asked = 2 * PER_NODE + 2
    answer = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 120,
                                             "count": asked})
    assert answer.status_code == 201, answer.text
    results = answer.json()
    assert len(results) == asked
    made = _made(results)
    assert len(made) == 2 * PER_NODE
    refused = [r for r in results if not r.get("sandbox")]
    assert len(refused) == 2
    for r in refused:
        assert r["error"]["code"] == 429, r
        assert "AENV_MAX_SANDBOXES" in r["error"]["message"], r
    # the made ones first (each node's answer in order), the refused ones last
    assert [bool(r.get("sandbox")) for r in results] == [True] * len(made) + [False] * 2
    # nothing the answer does not name, and the quota holds exactly what was made
    assert _on_node(cluster, 0) | _on_node(cluster, 1) == set(made)
    held = _quota(cluster)
    assert {m for m, _ in held} >= set(made)
    assert not [m for m, _ in held if m.startswith("pending:")], held
    assert all(score == float("inf") for _, score in held)

    # a full cluster: the whole batch is the refusal (as a node answers when it makes none)
    full = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 120, "count": 2})
    assert full.status_code == 429, full.text
    assert not [m for m, _ in _quota(cluster) if m.startswith("pending:")]


def test_a_snapshot_fork_without_repository_says_spill_over_needs_it(
        cluster: LocalCluster, api: httpx.Client) -> None:
    source_id, snapshot = sandbox_and_snapshot(api)
    answer = api.post(f"/snapshots/{snapshot}/fork", json={"count": PER_NODE + 1,
                                                           "timeout": 120})
    assert answer.status_code == 201, answer.text
    results = answer.json()
    assert len(results) == PER_NODE + 1
    made = _made(results)
    assert len(made) == PER_NODE - 1  # the source holds one place of its node
    home = 0 if source_id in _on_node(cluster, 0) else 1
    assert _on_node(cluster, home) == {source_id, *made}
    assert _on_node(cluster, 1 - home) == set()
    for r in results[len(made):]:
        assert r["error"]["code"] == 429
        assert "AENV_SNAPSHOT_REPOSITORY" in r["error"]["message"], r
    # a create with count from the snapshot is a fork of it: its node full, the whole 429
    # names the setting too
    full = api.post("/v2/sandboxes", json={"templateID": snapshot, "timeout": 120, "count": 2})
    assert full.status_code == 429, full.text
    assert "AENV_SNAPSHOT_REPOSITORY" in full.json()["message"], full.text
    assert full.headers["x-agentenv-refused"] == "sandboxes"


def test_a_snapshot_fork_whose_push_fails_keeps_its_refusals(
        cluster: LocalCluster, api: httpx.Client, tmp_path: Path) -> None:
    """With a repository set, the holding node is asked to push the snapshot; a process node
    cannot (snapshots move with the VM backend only): the refused children stay 429, saying
    why, and nothing is made elsewhere."""
    source = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 120}).json()
    snapshot = api.post(f"/sandboxes/{source['sandboxID']}/snapshots",
                        json={}).json()["snapshotID"]
    with another_gateway(cluster, tmp_path,
                         AENV_SNAPSHOT_REPOSITORY="127.0.0.1:1/spill") as url:
        answer = httpx.post(f"{url}/snapshots/{snapshot}/fork", timeout=120,
                            json={"count": PER_NODE + 1, "timeout": 120},
                            headers={"X-API-KEY": cluster.keys[TEAM]})
    assert answer.status_code == 201, answer.text
    results = answer.json()
    refused = [r for r in results if not r.get("sandbox")]
    assert len(refused) == 2
    for r in refused:
        assert r["error"]["code"] == 429
        assert "spill-over to other nodes failed" in r["error"]["message"], r
        assert "VM backend" in r["error"]["message"], r


def test_a_deleted_snapshots_spill_over_copies_go_with_it(
        cluster: LocalCluster, api: httpx.Client) -> None:
    """The gateway remembers the nodes' copies of a snapshot it spilled (Redis
    aenv:spill:{team}:{snapshot}, node:<id> -> the copy); when the team deletes the snapshot,
    the copies are deleted on their nodes and the memory goes. Process nodes cannot push, so
    the copy here is another snapshot of the team, recorded as one."""
    source = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 120}).json()
    snapshot, copy = (api.post(f"/sandboxes/{source['sandboxID']}/snapshots",
                               json={}).json()["snapshotID"] for _ in range(2))
    home = 0 if source["sandboxID"] in _on_node(cluster, 0) else 1
    node = cluster.nodes[home]
    redis = cluster.redis.raw("gateway")
    key = f"aenv:spill:{TEAM}:{snapshot}"
    redis.hset(key, mapping={"ref": "registry/x", f"node:node{home}": copy})
    api.delete(f"/sandboxes/{source['sandboxID']}")
    assert api.delete(f"/templates/{snapshot}").status_code == 204
    on_node = httpx.get(f"{node.url}/templates/{copy}", timeout=30, trust_env=False,
                        headers=cluster.node_headers(node, TEAM))
    assert on_node.status_code == 404, on_node.text
    assert not redis.exists(key)


def test_a_keyed_batch_retried_gets_the_first_answer(cluster: LocalCluster,
                                                     api: httpx.Client) -> None:
    body = {"templateID": "base", "timeout": 120, "count": 2}
    key = {"Idempotency-Key": "batch-one"}
    first = api.post("/v2/sandboxes", json=body, headers=key)
    assert first.status_code == 201, first.text
    again = api.post("/v2/sandboxes", json=body, headers=key)
    assert again.status_code == 201, again.text
    assert _made(again.json()) == _made(first.json())
    assert _on_node(cluster, 0) | _on_node(cluster, 1) == set(_made(first.json()))
    # another key is another batch
    other = api.post("/v2/sandboxes", json=body, headers={"Idempotency-Key": "batch-two"})
    assert other.status_code == 201, other.text
    assert not set(_made(other.json())) & set(_made(first.json()))
    # and a fork's key is a fork's: retried, the same children
    source = _made(first.json())[0]
    fork = api.post(f"/sandboxes/{source}/fork", json={"count": 1}, headers=key)
    assert fork.status_code == 201, fork.text
    assert _made(fork.json()) and _made(fork.json())[0] not in _made(first.json())
    assert api.post(f"/sandboxes/{source}/fork", json={"count": 1},
                    headers=key).json() == fork.json()


@contextlib.contextmanager
def another_gateway(cluster: LocalCluster, tmp_path: Path, **env: str) -> Iterator[str]:
    gateway = GatewayProcess(cluster.scheduler.address, cluster.redis.url, cluster.secret_file,
                             tmp_path / "gateway.log", env={**cluster.redis.env("gateway"), **env})
    gateway.start()
    try:
        yield gateway.url
    finally:
        gateway.stop()
