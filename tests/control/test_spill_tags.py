"""A spilled snapshot's tag leaves the cluster's snapshot repository with the snapshot
(control/gateway/batch.py `drop_copies`): when a batch from a snapshot spills over, the holding
node pushes it to AENV_SNAPSHOT_REPOSITORY as PREFIX/<team>/spill:<id> and the gateway
remembers the ref and the node that pushed it (Redis aenv:spill:{team}:{snapshot}); when the
team deletes the snapshot, that node deletes the tag (`POST /aenv/snapshots/delete`).

Real parts: redis-server, `aenv scheduler`, `aenv gateway`, two process-backend nodes and
Debian's docker-registry on loopback (one with deletes enabled, one without). Process nodes
cannot push a snapshot (snapshots move with the VM backend only: test_gateway_batch.py stops
at the push), so the spill-over's push is done here as the holding node does it: a snapshot
artifact pushed to PREFIX/<team>/spill:<id> (snapshot/repository.py) and the gateway's memory
of it written as `_pushed` writes it."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from agentenv.snapshot.repository import push
from tests.control.cluster import ROOMY_NODES, LocalCluster, running
from tests.control.helpers import sandbox_and_snapshot, team_api
from tests.snapshot.test_repository import _snapshot
from tests.template.registry_server import Registry, running_registry

pytestmark = pytest.mark.timeout(300)

TEAM = "alpha"
OCI_MANIFEST = "application/vnd.oci.image.manifest.v1+json"


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    with running_registry(tmp_path_factory.mktemp("registry")) as reg:
        yield reg


@pytest.fixture(scope="module")
def strict_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    """A registry whose operator did not enable deletes (storage.delete.enabled: false)."""
    with running_registry(tmp_path_factory.mktemp("strict-registry"), delete=False) as reg:
        yield reg


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory, registry: Registry
            ) -> Iterator[LocalCluster]:
    prefix = f"{registry.host}/spill"
    made = LocalCluster(tmp_path_factory.mktemp("cluster"), nodes=2, strategy="round-robin",
                        node_env={**ROOMY_NODES, "AENV_SNAPSHOT_REPOSITORY": prefix})
    made.gateway.env["AENV_SNAPSHOT_REPOSITORY"] = prefix
    with running(made, TEAM, "beta") as started:
        yield started


@pytest.fixture
def api(cluster: LocalCluster) -> Iterator[httpx.Client]:
    with team_api(cluster, TEAM, timeout=120) as client:
        yield client


def _tag_status(registry: Registry, repository: str, tag: str) -> int:
    return httpx.get(f"http://{registry.host}/v2/{repository}/manifests/{tag}", timeout=10,
                     trust_env=False, headers={"Accept": OCI_MANIFEST}).status_code


def _spilled_snapshot(cluster: LocalCluster, api: httpx.Client, registry: Registry,
                      tmp_path: Path) -> tuple[str, str, int]:
    """A snapshot of the team, spilled as a batch spills it: (its id, its ref, the index of
    the node holding it, which pushed it)."""
    source_id, snapshot = sandbox_and_snapshot(api)
    home = next(i for i, node in enumerate(cluster.nodes) if httpx.get(
        f"{node.url}/sandboxes/{source_id}", timeout=30, trust_env=False,
        headers=cluster.node_headers(node, TEAM)).status_code == 200)
    ref = f"{registry.host}/spill/{TEAM}/spill:{snapshot}"
    push(_snapshot(tmp_path / "pushed", snapshot), ref, {"names": []})
    cluster.redis.raw("gateway").hset(f"aenv:spill:{TEAM}:{snapshot}",
                                      mapping={"ref": ref, "pushed_by": f"node{home}"})
    api.delete(f"/sandboxes/{source_id}")
    return snapshot, ref, home


def test_a_deleted_snapshot_s_spill_tag_leaves_the_registry(
        cluster: LocalCluster, api: httpx.Client, registry: Registry, tmp_path: Path) -> None:
    snapshot, ref, _home = _spilled_snapshot(cluster, api, registry, tmp_path)
    assert _tag_status(registry, f"spill/{TEAM}/spill", snapshot) == 200
    assert api.delete(f"/templates/{snapshot}").status_code == 204
    assert _tag_status(registry, f"spill/{TEAM}/spill", snapshot) == 404
    assert not cluster.redis.raw("gateway").exists(f"aenv:spill:{TEAM}:{snapshot}")
    assert ref.encode() in cluster.gateway.log.read_bytes()


def test_another_team_cannot_delete_the_team_s_spill_tag(
        cluster: LocalCluster, api: httpx.Client, registry: Registry, tmp_path: Path) -> None:
    snapshot, ref, home = _spilled_snapshot(cluster, api, registry, tmp_path)
    # not a route of the gateway: a team cannot name a ref to delete at all
    through = httpx.post(f"{cluster.url}/aenv/snapshots/delete", json={"ref": ref},
                         timeout=30, trust_env=False,
                         headers={"X-API-KEY": cluster.keys["beta"]})
    assert through.status_code == 404, through.text
    # and a node asked for another team (as a gateway would ask it) refuses
    node = cluster.nodes[home]
    refused = httpx.post(f"{node.url}/aenv/snapshots/delete", json={"ref": ref}, timeout=30,
                         trust_env=False, headers=cluster.node_headers(node, "beta"))
    assert refused.status_code == 403, refused.text
    assert "not this team's" in refused.json()["message"], refused.text
    assert "spill/beta/" in refused.json()["message"], refused.text
    assert _tag_status(registry, f"spill/{TEAM}/spill", snapshot) == 200
    # the team's own delete of the snapshot takes it
    assert api.delete(f"/templates/{snapshot}").status_code == 204
    assert _tag_status(registry, f"spill/{TEAM}/spill", snapshot) == 404


def test_a_registry_refusing_deletes_leaves_the_tag_and_the_delete_succeeds(
        cluster: LocalCluster, api: httpx.Client, strict_registry: Registry,
        tmp_path: Path) -> None:
    snapshot, ref, _home = _spilled_snapshot(cluster, api, strict_registry, tmp_path)
    mark = cluster.gateway.log.stat().st_size
    assert api.delete(f"/templates/{snapshot}").status_code == 204
    assert api.get(f"/templates/{snapshot}").status_code == 404
    assert _tag_status(strict_registry, f"spill/{TEAM}/spill", snapshot) == 200
    logged = cluster.gateway.log.read_bytes()[mark:].decode(errors="replace")
    warning = next((line for line in logged.splitlines() if ref in line), "")
    assert "not deleted from the snapshot repository" in warning, logged[-3000:]
    assert "refuses deletes" in warning, logged[-3000:]
    assert not cluster.redis.raw("gateway").exists(f"aenv:spill:{TEAM}:{snapshot}")
