"""The node's layer caches are shared by digest, but a team uses a cached layer only once it
showed it may read it (template/layeraccess.py): team B's own registry (which answers HEAD 200
for any blob, as a hostile one would) serving a manifest that names team A's private layer
digests gets an error naming the layer, never A's bytes; team A's second pull asks its
registry for no layer; a third team reading A's repository gets the layer after one HEAD.

Team A's registry is a real docker-registry on loopback; team B's is a small server of the
test's own (a real registry refuses a manifest naming blobs its repository lacks)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentenv.template.layeraccess import LayerAccessError
from agentenv.template.pull import pull_image
from tests.template import helpers
from tests.template.conftest import Registry
from tests.template.helpers import TeamRegistry, start_team_registry

pytestmark = pytest.mark.timeout(300)


@pytest.fixture
def team_b_registry(registry: Registry, monkeypatch: pytest.MonkeyPatch) -> Iterator[TeamRegistry]:
    made = start_team_registry()
    monkeypatch.setenv("AENV_REGISTRY_ALLOW_PRIVATE", f"{registry.host},{made.host}")
    yield made
    made.server.shutdown()


def _naming(image: helpers.BuiltImage, layers_of: helpers.BuiltImage,
            diff_ids_of: helpers.BuiltImage | None = None) -> tuple[bytes, dict[str, bytes]]:
    """Team B's manifest: its own config (with the diff_ids of `diff_ids_of`, if given) and
    the layer list of `layers_of`. Returns (manifest, the blobs B has)."""
    manifest = json.loads(image.manifest)
    config_desc = manifest["config"]
    config = json.loads(image.blobs[config_desc["digest"]])
    if diff_ids_of is not None:
        other = json.loads(diff_ids_of.blobs[json.loads(diff_ids_of.manifest)["config"]["digest"]])
        config["rootfs"]["diff_ids"] = other["rootfs"]["diff_ids"]
    config_bytes = json.dumps(config).encode()
    blobs = {d: b for d, b in image.blobs.items() if d != config_desc["digest"]}
    blobs[helpers.digest_of(config_bytes)] = config_bytes
    manifest["config"] = {**config_desc, "digest": helpers.digest_of(config_bytes),
                          "size": len(config_bytes)}
    manifest["layers"] = json.loads(layers_of.manifest)["layers"]
    return json.dumps(manifest).encode(), blobs


def _layer_requests(registry: Registry, mark: int, image: helpers.BuiltImage) -> list[str]:
    layers = [d["digest"] for d in json.loads(image.manifest)["layers"]]
    return [r for r in registry.requests_since(mark) if any(d in r for d in layers)]


@pytest.mark.parametrize("lazy", [True, False], ids=["remote-layer", "whole-blob"])
def test_a_team_naming_another_teams_overlaybd_layer_gets_an_error(
        registry: Registry, team_b_registry: TeamRegistry, tmp_path: Path, no_docker_config: Path,
        lazy: bool) -> None:
    state = tmp_path / "state"
    image = helpers.fixture_image("amd64-converted")
    [layer] = [d["digest"] for d in json.loads(image.manifest)["layers"]]
    repo = f"team-a-{'lazy' if lazy else 'whole'}/app"
    registry.push(repo, "v1", image)
    ref_a = f"{registry.host}/{repo}:v1"
    pull_image(ref_a, state_dir=state, team="team-a", lazy=lazy, use_docker_config=False)

    team_b_registry.manifests["v1"], team_b_registry.blobs = _naming(image, image)
    team_b_registry.blobs.pop(layer)  # B does not have A's layer: it only names it
    with pytest.raises(LayerAccessError) as caught:
        pull_image(f"{team_b_registry.host}/team-b/app:v1", state_dir=state, team="team-b",
                   lazy=lazy, use_docker_config=False)
    assert layer in str(caught.value)
    assert f"GET /v2/team-b/app/blobs/{layer}" in team_b_registry.hits  # asked to show the bytes
    images = [p.name for p in (state / "images").iterdir() if not p.name.startswith(".")]
    assert images == [image.digest.replace(":", "-")]  # A's only

    # Team A's second pull uses the cache: its registry is not asked for the layer.
    mark = registry.log_mark()
    again = pull_image(ref_a, state_dir=state, team="team-a", lazy=lazy, use_docker_config=False)
    assert again.layers_cached == 1
    assert _layer_requests(registry, mark, image) == []

    # A team that can read A's repository (this registry lets anyone read) is shown the layer
    # by one HEAD, in a repository the node got it from; nothing is downloaded again.
    mark = registry.log_mark()
    third = pull_image(ref_a, state_dir=state, team="team-c", lazy=lazy, use_docker_config=False)
    assert third.layers_cached == 1
    assert _layer_requests(registry, mark, image) == [f"HEAD /v2/{repo}/blobs/{layer}"]


def test_a_team_first_to_describe_a_layer_does_not_choose_what_others_read(
        registry: Registry, team_b_registry: TeamRegistry, tmp_path: Path,
        no_docker_config: Path) -> None:
    """Team B records a remote layer under the digest of A's layer first, from its own
    registry, with a chunk table of its choosing (so blockd would check chunks against B's
    table). Team A, showing it may read the layer by downloading it, uses that download, a
    whole blob checked against the digest, never B's descriptor."""
    state = tmp_path / "state"
    image = helpers.fixture_image("amd64-converted")
    [layer] = json.loads(image.manifest)["layers"]
    manifest, blobs = _naming(image, image)
    forged = json.loads(manifest)
    forged["layers"][0].setdefault("annotations", {})["io.agentenv.chunk-sha256"] = \
        "1048576:" + "A" * 44 * (1 + layer["size"] // (1 << 20))
    team_b_registry.manifests["first"] = json.dumps(forged).encode()
    team_b_registry.blobs = blobs
    pull_image(f"{team_b_registry.host}/team-b/app:first", state_dir=state, team="team-b",
               use_docker_config=False)

    registry.push("team-a/app", "v1", image)
    pulled = pull_image(f"{registry.host}/team-a/app:v1", state_dir=state, team="team-a",
                        use_docker_config=False)
    [lower] = pulled.lowers
    assert lower.parent.parent.name == "overlaybd"  # the whole blob, not a remote descriptor
    assert lower.read_bytes() == image.blobs[layer["digest"]]


@pytest.mark.root
@pytest.mark.slow
def test_a_team_naming_another_teams_converted_layers_gets_an_error(
        registry: Registry, team_b_registry: TeamRegistry, tmp_path: Path, no_docker_config: Path,
        blockd: Path) -> None:
    state = tmp_path / "state"
    secret = helpers.build_image([helpers.TarBuilder().file("secret.txt", b"team A only\n").bytes()])
    [secret_layer] = [d["digest"] for d in json.loads(secret.manifest)["layers"]]
    registry.push("team-a/private", "v1", secret)
    pull_image(f"{registry.host}/team-a/private:v1", state_dir=state, team="team-a",
               blockd=blockd, use_docker_config=False)

    # B names A's layer blob and diff_id: the converted layer is cached under that chain.
    manifest, blobs = _naming(secret, secret)
    blobs.pop(secret_layer)
    team_b_registry.manifests["same"], team_b_registry.blobs = manifest, blobs
    with pytest.raises(LayerAccessError) as caught:
        pull_image(f"{team_b_registry.host}/team-b/app:same", state_dir=state, team="team-b",
                   blockd=blockd, use_docker_config=False)
    assert secret_layer in str(caught.value)

    # B names a blob of its own with A's diff_id in its config: B's blob must decompress to it.
    own = helpers.build_image([helpers.TarBuilder().file("mine.txt", b"team B\n").bytes()])
    [own_layer] = [d["digest"] for d in json.loads(own.manifest)["layers"]]
    manifest, blobs = _naming(own, own, diff_ids_of=secret)
    team_b_registry.manifests["diff"] = manifest
    team_b_registry.blobs.update(blobs)
    with pytest.raises(LayerAccessError) as caught:
        pull_image(f"{team_b_registry.host}/team-b/app:diff", state_dir=state, team="team-b",
                   blockd=blockd, use_docker_config=False)
    assert own_layer in str(caught.value) and "image config says" in str(caught.value)

    # A team with the same content in another compression shows it by downloading its own
    # blob (its diff_id checked), then uses the converted layer; its next pull asks nothing.
    tar = helpers.TarBuilder().file("secret.txt", b"team A only\n").bytes()
    zstd = helpers.build_image([tar], ["zstd"])
    [zstd_layer] = json.loads(zstd.manifest)["layers"]
    registry.push("team-c/same", "v1", zstd)
    for downloaded in (zstd_layer["size"], 0):
        mark = registry.log_mark()
        got = pull_image(f"{registry.host}/team-c/same:v1", state_dir=state, team="team-c",
                         blockd=blockd, use_docker_config=False)
        assert (got.layers_cached, got.layers_converted) == (1, 0)
        assert got.bytes_downloaded == downloaded
        assert len(_layer_requests(registry, mark, zstd)) == (1 if downloaded else 0)

    # Team A's own second pull converts and downloads nothing.
    mark = registry.log_mark()
    again = pull_image(f"{registry.host}/team-a/private:v1", state_dir=state, team="team-a",
                       blockd=blockd, use_docker_config=False)
    assert (again.layers_cached, again.layers_converted, again.bytes_downloaded) == (1, 0, 0)
    assert _layer_requests(registry, mark, secret) == []
