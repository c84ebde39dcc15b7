"""A node deletes a repository reference for a team (`POST /aenv/snapshots/delete`,
node/snapshot_api.py): the gateway's way to remove a spill-over's tag
(PREFIX/<team>/spill:<id>) once the team deleted the snapshot. A node of a cluster (the gateway
names the team), in process, and real registries on loopback (Debian's docker-registry, one
with deletes enabled and one without): a team deletes only under its own part of a
repository, a ref gone already is no error, and a registry refusing deletes says so."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from agentenv.node.server import ServeOptions, build_app
from agentenv.snapshot.repository import push
from tests.snapshot.test_repository import _snapshot
from tests.template.registry_server import Registry, running_registry

with warnings.catch_warnings():  # starlette 1.x nags about httpx here; TestClient still works
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient

SECRET = "5e" * 32  # the node key of a cluster node
ALPHA = {"x-agentenv-team": "alpha"}
BETA = {"x-agentenv-team": "beta"}


@pytest.fixture(scope="module")
def strict_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    """A registry whose operator did not enable deletes (storage.delete.enabled: false)."""
    with running_registry(tmp_path_factory.mktemp("strict-registry"), delete=False) as reg:
        yield reg


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, registry: Registry
         ) -> Iterator[TestClient]:
    monkeypatch.setenv("AENV_SNAPSHOT_REPOSITORY", f"{registry.host}/spill")
    app = build_app(ServeOptions(state_dir=tmp_path / "state", backend="process",
                                 node_key=SECRET))
    with TestClient(app, headers={"x-agentenv-node-key": SECRET}) as client:
        yield client


def _tag_status(registry: Registry, repository: str, tag: str) -> int:
    return httpx.get(f"http://{registry.host}/v2/{repository}/manifests/{tag}", timeout=10,
                     headers={"Accept": "application/vnd.oci.image.manifest.v1+json"}
                     ).status_code


def test_a_team_deletes_its_spill_tag_and_only_its_own(node: TestClient, registry: Registry,
                                                       tmp_path: Path) -> None:
    ref = f"{registry.host}/spill/alpha/spill:s-one"
    pushed = push(_snapshot(tmp_path / "a", "one"), ref, {})
    # elsewhere in the registry, a repository under another team's name
    other = f"{registry.host}/elsewhere/alpha/kept:one"
    push(_snapshot(tmp_path / "a", "two"), other, {})
    mark = registry.log_mark()
    for target, where in ((ref, "spill/beta/"), (other, "PREFIX/beta/NAME"),
                          (f"oci://{registry.host}/spill/alpha/spill:s-one", "spill/beta/")):
        refused = node.post("/aenv/snapshots/delete", json={"ref": target}, headers=BETA)
        assert refused.status_code == 403, refused.text
        assert "not this team's" in refused.json()["message"], refused.text
        assert where in refused.json()["message"], refused.text
    assert registry.requests_since(mark) == []  # the registry was never asked
    assert _tag_status(registry, "spill/alpha/spill", "s-one") == 200
    assert _tag_status(registry, "elsewhere/alpha/kept", "one") == 200

    deleted = node.post("/aenv/snapshots/delete", json={"ref": ref}, headers=ALPHA)
    assert deleted.status_code == 200, deleted.text
    assert deleted.json() == {"ref": ref, "digest": pushed["digest"], "deleted": True}
    assert _tag_status(registry, "spill/alpha/spill", "s-one") == 404
    again = node.post("/aenv/snapshots/delete", json={"ref": ref}, headers=ALPHA)
    assert again.status_code == 200, again.text
    assert again.json()["deleted"] is False

    # a shared directory is no cluster team's, as for a push; a body without a ref is a 400
    shared = node.post("/aenv/snapshots/delete", json={"ref": f"dir://{tmp_path}/alpha/x"},
                       headers=ALPHA)
    assert shared.status_code == 400 and "shared-directory" in shared.json()["message"]
    assert node.post("/aenv/snapshots/delete", json={}, headers=ALPHA).status_code == 400


def test_a_registry_refusing_deletes_is_a_clear_error(node: TestClient,
                                                      strict_registry: Registry,
                                                      tmp_path: Path) -> None:
    ref = f"{strict_registry.host}/spill/alpha/spill:s-kept"
    push(_snapshot(tmp_path / "a", "one"), ref, {})
    refused = node.post("/aenv/snapshots/delete", json={"ref": ref}, headers=ALPHA)
    assert refused.status_code == 400, refused.text
    message = refused.json()["message"]
    assert "refuses deletes" in message and "storage.delete.enabled" in message, message
    assert _tag_status(strict_registry, "spill/alpha/spill", "s-kept") == 200
