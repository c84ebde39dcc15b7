"""The gateway's spill-over of a fork through the snapshot repository (control/gateway/batch.py),
in process: snapshots move between nodes with the VM backend only, so the cluster tests
(test_gateway_batch.py) reach the push and stop there. Here the nodes are fakes answering as
nodes do (per-child 429s, a whole 429 naming the resource, push, lazy pull, a fork of the
pulled copy), the scheduler and Redis too: the order of the children, one push per snapshot,
one pull per node, a paused sandbox's fork placed elsewhere whole, a running one's left."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from agentenv.control.gateway import batch as batch_module
from agentenv.control.gateway.batch import Batches
from agentenv.control.gateway.limits import NewItems
from agentenv.control.gateway.metrics import GatewayMetrics
from agentenv.control.gateway.nodes import GatewayError
from agentenv.control.gateway.placement import Node, Placed, PlacementFailure
from agentenv.node.admission import REFUSED_HEADER

NODES = [Node(f"n{i}", f"10.0.0.{i}:1") for i in range(3)]


class FakeNode:
    def __init__(self, node: Node, room: int, paused: set[str] | None = None) -> None:
        self.node = node
        self.room = room
        self.paused = paused or set()
        self.made: list[str] = []
        self.pushed: list[str] = []
        self.pulled: list[str] = []
        self.deleted: list[str] = []
        self.refs_deleted: list[str] = []
        #: how the node answers a delete of a repository reference (the registry's answer)
        self.delete_answer: httpx.Response = httpx.Response(200, json={"deleted": True})

    def children(self, count: int, whole: bool) -> httpx.Response:
        if (whole and count > self.room) or self.room == 0:
            return httpx.Response(429, headers={REFUSED_HEADER: "sandboxes"}, json={
                "code": 429, "message": "sandbox limit reached (AENV_MAX_SANDBOXES)"})
        out = []
        for _ in range(count):
            if self.room:
                self.room -= 1
                sid = f"{self.node.node_id}-c{len(self.made)}"
                self.made.append(sid)
                out.append({"sandbox": {"sandboxID": sid, "domain": None}})
            else:
                out.append({"error": {"code": 429, "message": "sandbox limit reached"}})
        return httpx.Response(201, json=out)

    def handle(self, method: str, path: str, body: dict[str, Any]) -> httpx.Response:
        if method == "GET" and path.startswith("/sandboxes/"):
            sid = path.rsplit("/", 1)[1]
            return httpx.Response(200, json={"sandboxID": sid, "templateID": "base",
                                             "state": "paused" if sid in self.paused
                                             else "running"})
        if path == "/aenv/snapshots/push":
            self.pushed.append(body["ref"])
            return httpx.Response(200, json={"ref": body["ref"]})
        if method == "DELETE" and path.startswith("/templates/"):
            self.deleted.append(path.rsplit("/", 1)[1])
            return httpx.Response(204)
        if path == "/aenv/snapshots/delete":
            self.refs_deleted.append(body["ref"])
            return self.delete_answer
        if path == "/aenv/snapshots/pull":
            self.pulled.append(body["ref"])
            return httpx.Response(201, json={"templateID": f"copy-{self.node.node_id}"})
        if path.startswith("/sandboxes/") and path.endswith("/fork"):  # admitted whole
            return self.children(body.get("count", 1), whole=True)
        if path.endswith("/fork"):  # a snapshot's: per child
            return self.children(body.get("count", 1), whole=False)
        return httpx.Response(404, json={"code": 404, "message": path})


class Cluster:
    def __init__(self, rooms: list[int], paused: set[str] | None = None) -> None:
        self.nodes = {n.node_id: FakeNode(n, r, paused) for n, r in zip(NODES, rooms,
                                                                          strict=False)}
        self.recorded: dict[str, str] = {}
        self.scheduled: list[str] = []
        self.hashes: dict[str, dict[str, str]] = {}
        self.down: set[str] = set()
        self.expiring: list[str] = []
        self.http = httpx.AsyncClient(transport=httpx.MockTransport(self._transport))

    def _transport(self, request: httpx.Request) -> httpx.Response:
        node = next(n for n in self.nodes.values() if n.node.address == request.url.netloc
                    .decode())
        body = json.loads(request.content or b"{}")
        return node.handle(request.method, request.url.path, body)

    # the NodeLink the batches use
    async def call(self, node: Node, request: Any, team: str, body: bytes | None = None
                   ) -> httpx.Response:
        return self.nodes[node.node_id].handle("POST", request.url.path,
                                               json.loads(body or b"{}"))

    def node_headers(self, node: Node, team: str | None) -> dict[str, str]:
        return {}

    async def node_by_id(self, node_id: str) -> Node:
        if node_id not in self.nodes or node_id in self.down:
            raise GatewayError(503, f"node unavailable: {node_id}")
        return self.nodes[node_id].node

    async def up_nodes(self) -> list[Node]:
        return [f.node for i, f in self.nodes.items() if i not in self.down]

    async def get(self, node: Node, path: str, team: str | None) -> httpx.Response:
        return self.nodes[node.node_id].handle("GET", path, {})

    # the SchedulerLink
    async def schedule(self, *, template: str = "", team: str = "",
                       exclude: tuple[str, ...] = ()) -> Placed:
        self.scheduled.append(template)
        for node_id, fake in self.nodes.items():
            if node_id not in exclude and fake.room:
                return Placed(fake.node, f"r-{node_id}")
        raise PlacementFailure("no node has room")

    async def record(self, sandbox_id: str, node: Node, team: str, reservation: str = ""
                     ) -> None:
        self.recorded[sandbox_id] = node.node_id

    async def cancel(self, reservation: str) -> None:
        pass

    # the GatewayStore (and its Redis: the few hash commands used)
    @property
    def redis(self) -> Cluster:
        return self

    async def _call(self, value: Any) -> Any:
        return await value

    async def hget(self, key: str, field: str) -> str | None:
        return self.hashes.get(key, {}).get(field)

    async def hset(self, key: str, field: str, value: str) -> None:
        self.hashes.setdefault(key, {})[field] = value

    async def hdel(self, key: str, field: str) -> None:
        self.hashes.get(key, {}).pop(field, None)

    async def expire(self, key: str, seconds: int) -> None:
        self.expiring.append(key)

    async def hgetall(self, key: str) -> dict[str, str]:
        return dict(self.hashes.get(key, {}))

    async def delete(self, key: str) -> None:
        self.hashes.pop(key, None)

    async def own_sandboxes(self, team: str, ids: list[str]) -> None:
        pass

    # the GatewayQuotas
    @contextlib.asynccontextmanager
    async def new_sandboxes(self, team: str, count: int) -> AsyncIterator[NewItems]:
        yield NewItems()


class FakeRequest:
    def __init__(self, path: str) -> None:
        self.url = httpx.URL("http://gateway" + path)


def batches(cluster: Cluster) -> Batches:
    made = Batches(cluster, cluster, cluster, cluster, GatewayMetrics())  # type: ignore[arg-type]
    return made


def run(coro: Any) -> Any:
    return asyncio.run(coro)


def test_snapshot_fork_spills_through_the_repository_once(monkeypatch: pytest.MonkeyPatch
                                                          ) -> None:
    monkeypatch.setenv(batch_module.REPOSITORY_ENV, "registry.local/aenv/")
    cluster = Cluster([2, 1, 5])
    home = NODES[0]
    raw = json.dumps({"count": 6, "timeout": 30}).encode()

    async def both() -> tuple[Any, Any]:
        b = batches(cluster)
        first = await b.from_snapshot(FakeRequest("/snapshots/snap1/fork"), "alpha", home,
                                      "snap1", raw)
        cluster.nodes["n1"].room = 1  # room again: the second batch reuses push and pull
        second = await b.from_snapshot(FakeRequest("/snapshots/snap1/fork"), "alpha", home,
                                       "snap1", json.dumps({"count": 2}).encode())
        return first, second

    first, second = run(both())
    ids = [r["sandbox"]["sandboxID"] for r in first]
    assert ids == ["n0-c0", "n0-c1", "n1-c0", "n2-c0", "n2-c1", "n2-c2"]
    assert {cluster.recorded[i] for i in ids[2:]} == {"n1", "n2"}
    ref = "registry.local/aenv/alpha/spill:snap1"
    assert cluster.nodes["n0"].pushed == [ref]
    assert cluster.nodes["n1"].pulled == [ref] and cluster.nodes["n2"].pulled == [ref]
    assert [r["sandbox"]["sandboxID"] for r in second] == ["n1-c1", "n2-c3"]

    # the team deletes the snapshot: the nodes' copies go, the pushing node deletes the tag
    # from the repository, and the gateway's memory of them goes (a node that cannot be
    # asked keeps its copy)
    assert cluster.hashes["aenv:spill:alpha:snap1"][batch_module.PUSHED_BY] == "n0"
    # remembered as long as the snapshot: a memory that expired would leave the tag behind
    assert cluster.expiring == []
    cluster.down.add("n2")
    run(batches(cluster).drop_copies("alpha", "snap1"))
    assert cluster.nodes["n1"].deleted == ["copy-n1"] and cluster.nodes["n2"].deleted == []
    assert cluster.nodes["n0"].refs_deleted == [ref]
    assert not cluster.nodes["n1"].refs_deleted and not cluster.nodes["n2"].refs_deleted
    assert not cluster.hashes


def test_a_spill_tag_is_deleted_by_another_node_when_its_pusher_is_down(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(batch_module.REPOSITORY_ENV, "registry.local/aenv")
    cluster = Cluster([1, 5])
    run(batches(cluster).from_snapshot(FakeRequest("/snapshots/snap1/fork"), "alpha",
                                       NODES[0], "snap1", json.dumps({"count": 2}).encode()))
    ref = "registry.local/aenv/alpha/spill:snap1"
    assert cluster.nodes["n0"].pushed == [ref]
    cluster.down.add("n0")
    run(batches(cluster).drop_copies("alpha", "snap1"))
    assert cluster.nodes["n1"].refs_deleted == [ref] and not cluster.nodes["n0"].refs_deleted
    assert not cluster.hashes


def test_a_spill_tag_the_registry_keeps_is_logged_and_forgotten(
        monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    """A registry that refuses deletes: the node says so, the gateway logs a warning naming
    the ref, and forgets it (the snapshot's delete itself has succeeded)."""
    monkeypatch.setenv(batch_module.REPOSITORY_ENV, "registry.local/aenv")
    cluster = Cluster([1, 5])
    run(batches(cluster).from_snapshot(FakeRequest("/snapshots/snap1/fork"), "alpha",
                                       NODES[0], "snap1", json.dumps({"count": 2}).encode()))
    ref = "registry.local/aenv/alpha/spill:snap1"
    for fake in cluster.nodes.values():
        fake.delete_answer = httpx.Response(400, json={
            "code": 400, "message": "the registry refuses deletes"})
    with caplog.at_level("WARNING", logger="agentenv.control.gateway.batch"):
        run(batches(cluster).drop_copies("alpha", "snap1"))
    warned = [r for r in caplog.records if ref in r.getMessage()]
    assert warned and "refuses deletes" in warned[0].__dict__["error"]
    # the pusher, then one other node
    assert cluster.nodes["n0"].refs_deleted == [ref] and cluster.nodes["n1"].refs_deleted == [ref]
    assert not cluster.hashes


def test_without_room_anywhere_the_refused_children_keep_their_429(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(batch_module.REPOSITORY_ENV, "registry.local/aenv")
    cluster = Cluster([1, 1, 0])
    results = run(batches(cluster).from_snapshot(
        FakeRequest("/snapshots/snap1/fork"), "alpha", NODES[0], "snap1",
        json.dumps({"count": 4}).encode()))
    assert [bool(r.get("sandbox")) for r in results] == [True, True, False, False]
    assert [r["error"]["code"] for r in results[2:]] == [429, 429]


def test_without_repository_the_refused_children_name_the_setting(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(batch_module.REPOSITORY_ENV, raising=False)
    cluster = Cluster([1, 5, 5])
    results = run(batches(cluster).from_snapshot(
        FakeRequest("/snapshots/snap1/fork"), "alpha", NODES[0], "snap1",
        json.dumps({"count": 3}).encode()))
    assert results[0]["sandbox"]["sandboxID"] == "n0-c0"
    for r in results[1:]:
        assert r["error"]["code"] == 429
        assert batch_module.REPOSITORY_ENV in r["error"]["message"]
    assert not cluster.nodes["n1"].made and not cluster.nodes["n0"].pushed


def test_a_fork_of_a_paused_or_running_sandbox_does_not_spill(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy's children are made with a count and a timeout only: a paused parent's network
    policy, traffic token and settings would not reach them (found by the red team)."""
    monkeypatch.setenv(batch_module.REPOSITORY_ENV, "registry.local/aenv")
    cluster = Cluster([1, 2, 2], paused={"ipaused"})
    raw = json.dumps({"count": 3}).encode()
    for sid in ("ipaused", "irunning"):
        refused = run(batches(cluster).fork(FakeRequest(f"/sandboxes/{sid}/fork"), "alpha",
                                            NODES[0], sid, raw))
        assert isinstance(refused, httpx.Response) and refused.status_code == 429
        assert refused.headers[REFUSED_HEADER] == "sandboxes"
    assert "network policy" in refused_message(cluster, "ipaused", raw)
    assert not cluster.nodes["n0"].pushed
    assert not cluster.nodes["n1"].made and not cluster.nodes["n2"].made


def refused_message(cluster: Cluster, sid: str, raw: bytes) -> str:
    refused = run(batches(cluster).fork(FakeRequest(f"/sandboxes/{sid}/fork"), "alpha",
                                        NODES[0], sid, raw))
    return str(refused.json()["message"])


def test_a_batch_from_a_snapshot_with_settings_of_its_own_does_not_spill(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(batch_module.REPOSITORY_ENV, "registry.local/aenv")
    cluster = Cluster([1, 5, 5])
    raw = json.dumps({"count": 3, "templateID": "snap1", "envVars": {"A": "1"},
                      "network": {"allowPublicTraffic": False}}).encode()
    results = run(batches(cluster).from_snapshot(
        FakeRequest("/snapshots/snap1/fork"), "alpha", NODES[0], "snap1", raw))
    assert results[0]["sandbox"]["sandboxID"] == "n0-c0"
    for r in results[1:]:
        assert r["error"]["code"] == 429
        assert "not spilled over" in r["error"]["message"]
        assert "envVars, network" in r["error"]["message"]
    assert not cluster.nodes["n0"].pushed and not cluster.nodes["n1"].made
