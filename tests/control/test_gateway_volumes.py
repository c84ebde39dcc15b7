"""Routes the node serves that the gateway once answered 404 to, through a real gateway: the
Volume API and its content API (the official SDK's `Volume`, control/gateway/volumes.py), a
sandbox's logs and the batch metrics; and every route of the SDK's generated client is served
or says it is not (the route table of agentenv.api is the gateway's too)."""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Iterator

import httpx
import pytest
from e2b import Volume
from e2b.exceptions import VolumeNotFoundException

from tests.control.cluster import ROOMY_NODES, LocalCluster, running
from tests.node.conftest import environ_set
from tests.node.test_sdk_routes import check_every_sdk_route

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    # round-robin: consecutive placements go to different nodes, so a route that reached the
    # wrong node would show
    made = LocalCluster(tmp_path_factory.mktemp("cluster"), nodes=2, strategy="round-robin",
                        node_env=ROOMY_NODES)
    with running(made, "alpha", "beta") as started:
        yield started


def _as(cluster: LocalCluster, team: str) -> contextlib.AbstractContextManager[None]:
    return environ_set({"E2B_API_URL": cluster.url, "E2B_SANDBOX_URL": cluster.url,
                        "E2B_VOLUME_API_URL": cluster.url, "E2B_API_KEY": cluster.keys[team]})


def _api(cluster: LocalCluster, team: str = "alpha") -> httpx.Client:
    return httpx.Client(base_url=cluster.url, headers={"X-API-KEY": cluster.keys[team]},
                        timeout=60, trust_env=False)


def _holders(cluster: LocalCluster, volume_id: str, team: str = "alpha") -> list[int]:
    """The nodes that have the volume of `team`, asked of every node directly."""
    found = []
    for i, node in enumerate(cluster.nodes):
        answer = httpx.get(f"{node.url}/volumes/{volume_id}", timeout=10,
                           headers=cluster.node_headers(node, team))
        if answer.status_code == 200:
            found.append(i)
    return found


def test_volumes_and_their_content_through_the_gateway(cluster: LocalCluster) -> None:
    names = [f"vol-{uuid.uuid4().hex[:8]}" for _ in range(3)]
    with _as(cluster, "alpha"):
        vols = [Volume.create(name) for name in names]
        try:
            # all of a team's volumes on one node (its volume home), whatever round-robin says
            homes = [_holders(cluster, v.volume_id) for v in vols]
            assert all(len(h) == 1 for h in homes) and len({h[0] for h in homes}) == 1, homes
            info = Volume.get_info(vols[0].volume_id)
            assert (info.name, info.token) == (names[0], vols[0].token)
            assert {v.volume_id for v in vols} <= {v.volume_id for v in Volume.list()}
            # the content API: the volume's token, no API key, streamed to its node
            assert vols[0].make_dir("/dir").path == "/dir"
            vols[0].write_file("/dir/hello.txt", "Hello through the gateway")
            assert vols[0].read_file("/dir/hello.txt") == "Hello through the gateway"
            big = bytes(range(256)) * 8000
            vols[1].write_file("/big.bin", big)
            assert vols[1].read_file("/big.bin", format="bytes") == big
            assert [e.name for e in vols[0].list("/dir")] == ["hello.txt"]
            assert Volume.connect(vols[0].volume_id).exists("/dir/hello.txt")
            with httpx.Client(base_url=cluster.url, timeout=30, trust_env=False) as raw:
                for volume_id, token in [(vols[0].volume_id, vols[1].token),
                                         ("v" + "0" * 20, vols[0].token)]:
                    answer = raw.get(f"/volumecontent/{volume_id}/file",
                                     params={"path": "/dir/hello.txt"},
                                     headers={"Authorization": f"Bearer {token}"})
                    # another volume's token, an unknown volume: alike (ids are not probed)
                    assert answer.status_code == 401, answer.text
                    assert "volume's token" in answer.json()["message"]
        except BaseException:
            for v in vols:
                Volume.destroy(v.volume_id)
            raise
    with _as(cluster, "beta"):  # another team's volume is not found, by id or by listing
        with pytest.raises(VolumeNotFoundException):
            Volume.get_info(vols[0].volume_id)
        assert not {v.volume_id for v in vols} & {v.volume_id for v in Volume.list()}
        assert Volume.destroy(vols[0].volume_id) is False
    with _as(cluster, "alpha"):
        for v in vols:
            assert Volume.destroy(v.volume_id) is True
        assert Volume.destroy(vols[0].volume_id) is False
        assert not {v.volume_id for v in vols} & {v.volume_id for v in Volume.list()}


def test_a_create_that_mounts_volumes_goes_to_their_node(cluster: LocalCluster) -> None:
    """The process backend mounts no volumes: the volume's node answers so (400), after its
    checks; any other node would not know the volume (404)."""
    with _api(cluster) as api:
        made = api.post("/volumes", json={"name": f"mnt-{uuid.uuid4().hex[:8]}"})
        assert made.status_code == 201, made.text
        try:
            for _ in range(3):  # round-robin would have sent one of these elsewhere
                answer = api.post("/v2/sandboxes", json={
                    "templateID": "base",
                    "volumeMounts": [{"name": made.json()["name"], "path": "/mnt/data"}]})
                assert answer.status_code == 400, answer.text
                assert "process backend does not mount" in answer.json()["message"]
        finally:
            assert api.delete(f"/volumes/{made.json()['volumeID']}").status_code == 204


def test_logs_and_batch_metrics_through_the_gateway(cluster: LocalCluster) -> None:
    with _api(cluster) as api, _api(cluster, "beta") as other:
        ids = [api.post("/v2/sandboxes", json={"templateID": "base"}).json()["sandboxID"]
               for _ in range(2)]
        theirs = other.post("/v2/sandboxes", json={"templateID": "base"}).json()["sandboxID"]
        try:
            for sid in ids:
                logs = api.get(f"/sandboxes/{sid}/logs")
                assert logs.status_code == 200 and "logs" in logs.json(), logs.text
                logs = api.get(f"/v2/sandboxes/{sid}/logs", params={"direction": "backward"})
                assert logs.status_code == 200 and "logs" in logs.json(), logs.text
                # a sample now (the node takes one when asked), so the batch has one too
                assert api.get(f"/sandboxes/{sid}/metrics").status_code == 200
            assert other.get(f"/sandboxes/{ids[0]}/logs").status_code == 404
            batch = api.get("/sandboxes/metrics",
                            params={"sandbox_ids": ",".join([*ids, theirs, "nosuchsandbox"])})
            assert batch.status_code == 200, batch.text
            # each from its own node (round-robin placed them apart); never another team's
            assert set(batch.json()["sandboxes"]) == set(ids), batch.json()
            assert batch.json()["sandboxes"][ids[0]]["memTotal"] > 0
            for bad in ({}, {"sandbox_ids": ",".join(f"s{i}" for i in range(101))}):
                answer = api.get("/sandboxes/metrics", params=bad)
                assert answer.status_code == 400 and answer.json()["code"] == 400, answer.text
        finally:
            for sid in ids:
                api.delete(f"/sandboxes/{sid}")
            other.delete(f"/sandboxes/{theirs}")


def test_every_sdk_route_is_served_or_says_it_is_not(cluster: LocalCluster) -> None:
    with _api(cluster) as api:
        check_every_sdk_route(api)
