"""Snapshot pulls of a team use what the node holds only where the team may
(template/layeraccess.py): team B's own registry (answering HEAD 200 for anything) serving an
artifact that names team A's snapshot id, or A's memory and disk parts by digest, gets an
error naming them, never A's snapshot directory or a descriptor of A's blobs; a part that is
a remote layer's descriptor is refused. Team A pulls its own snapshot again without fetching.

Team A's registry is a real docker-registry on loopback; team B's is tests/template's
TeamRegistry."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentenv.snapshot.repository import PART_TYPES, TITLE, RepositoryError, fetch, push
from agentenv.storage.blob import RemoteLayerRef
from agentenv.template.layeraccess import LayerAccess, LayerAccessError
from tests.snapshot.test_repository import _snapshot
from tests.template import helpers
from tests.template.helpers import TeamRegistry, start_team_registry
from tests.template.registry_server import Registry, running_registry

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    with running_registry(tmp_path_factory.mktemp("registry")) as reg:
        yield reg


@pytest.fixture
def team_b(registry: Registry, monkeypatch: pytest.MonkeyPatch) -> Iterator[TeamRegistry]:
    made = start_team_registry()
    monkeypatch.setenv("AENV_REGISTRY_ALLOW_PRIVATE", f"{registry.host},{made.host}")
    yield made
    made.server.shutdown()


def _artifact(registry: Registry, repository: str, tag: str) -> tuple[dict, dict[str, bytes]]:
    """The manifest of a pushed artifact and its config blob (what B can copy: not the parts)."""
    import httpx

    base = f"http://{registry.host}/v2/{repository}"
    manifest = httpx.get(f"{base}/manifests/{tag}", headers={
        "Accept": "application/vnd.oci.image.manifest.v1+json"}).json()
    config = httpx.get(f"{base}/blobs/{manifest['config']['digest']}").content
    return manifest, {manifest["config"]["digest"]: config}


def _node(tmp_path: Path) -> tuple[Path, LayerAccess]:
    snapshots = tmp_path / "node" / "snapshots"
    return snapshots, LayerAccess(tmp_path / "node" / "layer-cache")


def test_another_teams_snapshot_id_is_not_reused(registry: Registry, team_b: TeamRegistry,
                                                 tmp_path: Path) -> None:
    snapshots, access = _node(tmp_path)
    source = _snapshot(tmp_path / "a", "one")
    ref_a = f"{registry.host}/team-a/snap:one"
    push(source, ref_a, {}, team="team-a", access=access)
    got = fetch(ref_a, snapshots, team="team-a", access=access)
    assert not got.existed

    # B serves A's artifact as it is (the record and the part digests), without A's parts.
    manifest, blobs = _artifact(registry, "team-a/snap", "one")
    team_b.manifests["copy"] = json.dumps(manifest).encode()
    team_b.blobs.update(blobs)
    with pytest.raises(LayerAccessError) as caught:
        fetch(f"{team_b.host}/team-b/snap:copy", snapshots, team="team-b", access=access)
    assert "snapshot part" in str(caught.value)
    assert any(d["digest"] in str(caught.value) for d in manifest["layers"])

    # Or with A's snapshot id and parts of its own: the directory is A's, not this artifact.
    other = json.loads(json.dumps(manifest))
    other["layers"][0]["digest"] = helpers.digest_of(b"B's own part")
    other["layers"][0]["size"] = len(b"B's own part")
    team_b.blobs[other["layers"][0]["digest"]] = b"B's own part"
    team_b.manifests["other"] = json.dumps(other).encode()
    with pytest.raises(RepositoryError, match="is on this node already, and not as this artifact"):
        fetch(f"{team_b.host}/team-b/snap:other", snapshots, team="team-b", access=access)

    # Team A's own pull again: the directory it has, no part fetched or asked for.
    mark = registry.log_mark()
    again = fetch(ref_a, snapshots, team="team-a", access=access)
    assert again.existed and again.bytes_fetched == 0
    assert not [r for r in registry.requests_since(mark) if "/blobs/" in r and "HEAD" in r]


def test_another_teams_lazy_parts_are_not_described(registry: Registry, team_b: TeamRegistry,
                                                    tmp_path: Path) -> None:
    snapshots, access = _node(tmp_path)
    source = _snapshot(tmp_path / "a", "one")
    ref_a = f"{registry.host}/team-a/lazy:one"
    push(source, ref_a, {}, team="team-a", access=access)
    fetch(ref_a, snapshots, team="team-a", access=access)  # lazy: descriptors of A's blobs

    # B's artifact: its own snapshot id, naming A's memory layer by digest.
    manifest, blobs = _artifact(registry, "team-a/lazy", "one")
    config_digest = manifest["config"]["digest"]
    config = json.loads(blobs[config_digest])
    config["record"]["id"] = "snap-of-b"
    config_bytes = json.dumps(config).encode()
    manifest["config"].update(digest=helpers.digest_of(config_bytes), size=len(config_bytes))
    team_b.blobs[helpers.digest_of(config_bytes)] = config_bytes
    memory = next(d for d in manifest["layers"] if d["mediaType"] == PART_TYPES["memory"])
    # Every other part is B's own (served), so only A's memory layer is in question.
    for desc in manifest["layers"]:
        if desc is not memory:
            data = _own_bytes(desc)
            desc.update(digest=helpers.digest_of(data))
            team_b.blobs[desc["digest"]] = data
    team_b.manifests["lazy"] = json.dumps(manifest).encode()
    with pytest.raises(LayerAccessError) as caught:
        fetch(f"{team_b.host}/team-b/lazy:lazy", snapshots, team="team-b", access=access)
    assert memory["digest"] in str(caught.value)
    assert not (snapshots / "snap-of-b").exists()


def test_a_part_that_is_a_remote_layer_descriptor_is_refused(
        registry: Registry, team_b: TeamRegistry, tmp_path: Path) -> None:
    snapshots, access = _node(tmp_path)
    manifest_a, blobs_a = _artifact_of_pushed(registry, tmp_path)
    victim = next(d for d in manifest_a["layers"] if d["mediaType"] == PART_TYPES["disk"])
    forged = json.dumps(RemoteLayerRef(victim["digest"], victim["size"], [],
                                       "application/octet-stream").to_json()).encode()
    manifest = json.loads(json.dumps(manifest_a))
    config = json.loads(blobs_a[manifest["config"]["digest"]])
    config["record"]["id"] = "snap-forged"
    config_bytes = json.dumps(config).encode()
    manifest["config"].update(digest=helpers.digest_of(config_bytes), size=len(config_bytes))
    team_b.blobs[helpers.digest_of(config_bytes)] = config_bytes
    for desc in manifest["layers"]:
        data = forged if desc["digest"] == victim["digest"] else _own_bytes(desc)
        desc.update(digest=helpers.digest_of(data), size=len(data))
        team_b.blobs[desc["digest"]] = data
    team_b.manifests["forged"] = json.dumps(manifest).encode()
    with pytest.raises(RepositoryError, match="is a remote layer descriptor"):
        fetch(f"{team_b.host}/team-b/forged:forged", snapshots, team="team-b", access=access,
              lazy=False)
    assert not (snapshots / "snap-forged").exists()


def _own_bytes(desc: dict) -> bytes:
    """Bytes of B's own for a part, of the size the record says (the part is B's to give)."""
    return (desc["annotations"][TITLE].encode() * desc["size"])[:desc["size"]]


def _artifact_of_pushed(registry: Registry, tmp_path: Path) -> tuple[dict, dict[str, bytes]]:
    push(_snapshot(tmp_path / "a", "one"), f"{registry.host}/team-a/forge:one", {})
    return _artifact(registry, "team-a/forge", "one")
