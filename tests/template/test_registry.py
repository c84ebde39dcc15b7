"""The registry client against a real docker-registry on loopback."""

from __future__ import annotations

import base64
import json
from pathlib import Path

import pytest

from agentenv.registry.auth import credentials_for
from agentenv.registry.client import Platform, RegistryClient
from agentenv.registry.errors import (
    AuthError,
    DigestMismatchError,
    NotFoundError,
    ReferenceFormatError,
    RegistryError,
    UnsupportedImageError,
)
from agentenv.registry.reference import parse_reference
from tests.template import helpers
from tests.template.conftest import Registry


def test_parse_reference_forms() -> None:
    r = parse_reference("debian")
    assert (r.registry, r.repository, r.tag, r.digest) == ("docker.io", "library/debian", "latest", None)
    assert r.api_host == "registry-1.docker.io"
    r = parse_reference("127.0.0.1:5000/a/b-c:v1.2")
    assert (r.registry, r.repository, r.tag) == ("127.0.0.1:5000", "a/b-c", "v1.2")
    digest = "sha256:" + "a" * 64
    r = parse_reference(f"localhost/x@{digest}")
    assert (r.registry, r.repository, r.tag, r.digest, r.selector) == ("localhost", "x", None, digest, digest)
    r = parse_reference("ghcr.io/org/img:tag@" + digest)
    assert r.selector == digest and r.tag == "tag"
    for bad in ("", "UPPER/case", "a::b", "x@sha256:123", "x:bad tag", "reg:5000/", " a"):
        with pytest.raises(ReferenceFormatError):
            parse_reference(bad)


def test_docker_config_credentials(tmp_path: Path) -> None:
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"auths": {
        "https://index.docker.io/v1/": {"auth": base64.b64encode(b"hub:pw1").decode()},
        "127.0.0.1:5000": {"auth": base64.b64encode(b"me:p:w").decode()},
        "http://reg.example:8080/v2/": {"username": "u2", "password": "p2"},
    }}))
    assert credentials_for("docker.io", config) == credentials_for("index.docker.io", config)
    assert credentials_for("docker.io", config).username == "hub"  # type: ignore[union-attr]
    creds = credentials_for("127.0.0.1:5000", config)
    assert creds is not None and (creds.username, creds.password) == ("me", "p:w")
    assert "p:w" not in repr(creds)
    assert credentials_for("reg.example:8080", config).password == "p2"  # type: ignore[union-attr]
    assert credentials_for("other:1", config) is None
    assert credentials_for("x", tmp_path / "absent.json") is None
    config.write_text(json.dumps({"auths": {"x": {"auth": "!!notbase64"}}}))
    with pytest.raises(AuthError, match="base64"):
        credentials_for("x", config)


@pytest.fixture(scope="module")
def hello_pushed(registry: Registry) -> dict[str, str]:
    """Every hello-world manifest pushed by digest, the docker list and the amd64 images by tag."""
    index = json.loads((helpers.FIXTURE / "index.json").read_text())
    digests = {}
    for entry in index["manifests"]:
        if entry["mediaType"].endswith("list.v2+json"):
            continue
        tag = entry.get("annotations", {}).get("org.opencontainers.image.ref.name")
        image = _fixture_by_digest(entry["digest"], entry["mediaType"])
        digests[tag or entry["digest"]] = registry.push("hello-world", tag or entry["digest"].replace(":", "-"), image)
    docker_list = _fixture_by_digest(
        "sha256:726023f73a8fc5103fa6776d48090539042cb822531c6b751b1f6dd18cb5705d",
        "application/vnd.docker.distribution.manifest.list.v2+json")
    docker_list.blobs = {}
    digests["docker-list"] = registry.push("hello-world", "latest", docker_list)
    return digests


def _fixture_by_digest(digest: str, media_type: str) -> helpers.BuiltImage:
    read = lambda d: (helpers.FIXTURE / "blobs" / "sha256" / d.split(":")[1]).read_bytes()  # noqa: E731
    manifest = read(digest)
    image = helpers.BuiltImage(manifest, media_type)
    body = json.loads(manifest)
    for desc in ([body["config"], *body["layers"]] if "layers" in body else []):
        image.blobs[desc["digest"]] = read(desc["digest"])
    return image


def test_manifest_list_platform_selection(registry: Registry, hello_pushed: dict[str, str],
                                          no_docker_config: Path) -> None:
    with RegistryClient(registry.host) as client:
        ref = parse_reference(f"{registry.host}/hello-world:latest")
        manifest = client.resolve_manifest(ref)
        assert manifest.digest == hello_pushed["amd64"]
        assert manifest.layers[0].media_type == "application/vnd.docker.image.rootfs.diff.tar.gzip"
        arm = client.resolve_manifest(ref, Platform.parse("linux/arm/v7"))
        assert arm.digest != manifest.digest
        with pytest.raises(UnsupportedImageError, match="no image for platform linux/sparc"):
            client.resolve_manifest(ref, Platform("linux", "sparc"))
        converted = client.resolve_manifest(parse_reference(f"{registry.host}/hello-world:amd64-converted"))
        assert converted.media_type == "application/vnd.oci.image.manifest.v1+json"
        pinned = client.resolve_manifest(parse_reference(f"{registry.host}/hello-world@{hello_pushed['amd64']}"))
        assert pinned.digest == hello_pushed["amd64"]


def test_blob_download_verified(registry: Registry, hello_pushed: dict[str, str], tmp_path: Path,
                                no_docker_config: Path) -> None:
    with RegistryClient(registry.host) as client:
        manifest = client.resolve_manifest(parse_reference(f"{registry.host}/hello-world:amd64"))
        seen: list[int] = []
        out = client.download_blob("hello-world", manifest.layers[0], tmp_path / "layer", seen.append)
        assert helpers.digest_of(out.read_bytes()) == manifest.layers[0].digest
        assert sum(seen) == manifest.layers[0].size
        assert [p.name for p in tmp_path.iterdir()] == ["layer"]


def test_missing_tag_and_repository(registry: Registry, hello_pushed: dict[str, str],
                                    no_docker_config: Path) -> None:
    with RegistryClient(registry.host) as client:
        with pytest.raises(NotFoundError, match="hello-world:nope"):
            client.resolve_manifest(parse_reference(f"{registry.host}/hello-world:nope"))
        with pytest.raises(NotFoundError):
            client.resolve_manifest(parse_reference(f"{registry.host}/no/such:1"))


def test_corrupt_blob_in_registry_storage(registry: Registry, tmp_path: Path, no_docker_config: Path) -> None:
    """Flip bytes of a blob inside the registry's own storage: the client must refuse it."""
    layer = helpers.TarBuilder().file("x", b"hello" * 1000).bytes()
    image = helpers.build_image([layer])
    registry.push("corrupt", "v1", image)
    body = json.loads(image.manifest)
    digest = body["layers"][0]["digest"]
    hexd = digest.split(":")[1]
    data_file = registry.log.parent / "data/docker/registry/v2/blobs/sha256" / hexd[:2] / hexd / "data"
    data = bytearray(data_file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    data_file.write_bytes(bytes(data))
    with RegistryClient(registry.host) as client:
        manifest = client.resolve_manifest(parse_reference(f"{registry.host}/corrupt:v1"))
        with pytest.raises(DigestMismatchError, match=digest):
            client.download_blob("corrupt", manifest.layers[0], tmp_path / "blob")
    assert list(tmp_path.iterdir()) == []


def test_tampered_manifest_and_config_in_registry_storage(registry: Registry,
                                                          no_docker_config: Path) -> None:
    """The manifest (by tag: against the registry's digest header; by digest: against the
    digest asked for) and the image config are verified too, not only layer blobs."""
    image = helpers.build_image([helpers.TarBuilder().file("tampered", b"t" * 777).bytes()])
    registry.push("tampered", "v1", image)
    store = registry.log.parent / "data/docker/registry/v2/blobs/sha256"

    def tamper(digest: str, old: bytes, new: bytes) -> None:
        hexd = digest.split(":")[1]
        path = store / hexd[:2] / hexd / "data"
        data = path.read_bytes()
        assert old in data and len(old) == len(new)
        path.write_bytes(data.replace(old, new, 1))

    config_digest = json.loads(image.manifest)["config"]["digest"]
    tamper(config_digest, b'"amd64"', b'"arm64"')
    by_tag = parse_reference(f"{registry.host}/tampered:v1")
    by_digest = parse_reference(f"{registry.host}/tampered@{image.digest}")
    with RegistryClient(registry.host) as client:
        manifest = client.resolve_manifest(by_tag)
        with pytest.raises(DigestMismatchError, match=config_digest):
            client.get_blob_bytes("tampered", manifest.config)
        tamper(image.digest, b'"schemaVersion": 2', b'"schemaVersion":2 ')  # still valid JSON
        with pytest.raises(DigestMismatchError, match="registry says digest"):
            client.resolve_manifest(by_tag)
        with pytest.raises(DigestMismatchError, match="content has digest"):
            client.resolve_manifest(by_digest)


def test_basic_auth_from_docker_config(auth_registry: Registry, tmp_path: Path,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    image = helpers.build_image([helpers.TarBuilder().file("f", b"x").bytes()])
    auth_registry.push("private/img", "v1", image)
    ref = parse_reference(f"{auth_registry.host}/private/img:v1")
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path))
    with RegistryClient(auth_registry.host) as client, pytest.raises(AuthError, match="needs credentials"):
        client.resolve_manifest(ref)
    config = {"auths": {auth_registry.host: {"auth": base64.b64encode(b"aenv:wrong").decode()}}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with RegistryClient(auth_registry.host) as client, pytest.raises(AuthError, match="rejected"):
        client.resolve_manifest(ref)
    config = {"auths": {f"http://{auth_registry.host}": {"auth": base64.b64encode(b"aenv:s3cret-pw").decode()}}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    with RegistryClient(auth_registry.host) as client:
        manifest = client.resolve_manifest(ref)
        assert manifest.digest == image.digest
        client.download_blob("private/img", manifest.layers[0], tmp_path / "blob")


def test_https_registry_verified_with_ca_file(tls_registry: Registry, tmp_path: Path,
                                              no_docker_config: Path) -> None:
    image = helpers.build_image([helpers.TarBuilder().file("tls", b"t").bytes()])
    tls_registry.push("secure/img", "v1", image)
    ref = parse_reference(f"{tls_registry.host}/secure/img:v1")
    with RegistryClient(tls_registry.host, insecure=False, ca_file=tls_registry.cert) as client:
        manifest = client.resolve_manifest(ref)
        assert manifest.digest == image.digest
        client.download_blob("secure/img", manifest.layers[0], tmp_path / "blob")
    # Without the CA the certificate is refused (no silent fallback to plain http).
    with RegistryClient(tls_registry.host, insecure=False) as client, \
            pytest.raises(RegistryError, match="cannot reach registry"):
        client.resolve_manifest(ref)
    # Loopback registries may be https with any certificate, like Docker's insecure registries.
    with RegistryClient(tls_registry.host) as client:
        assert client.resolve_manifest(ref).digest == image.digest


def test_bearer_token_flow(token_registry: Registry, tmp_path: Path,
                           monkeypatch: pytest.MonkeyPatch) -> None:
    image = helpers.build_image([helpers.TarBuilder().file("tok", b"t").bytes()])
    token_registry.push("team/app", "v1", image)
    ref = parse_reference(f"{token_registry.host}/team/app:v1")
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path))
    with RegistryClient(token_registry.host) as client, pytest.raises(AuthError, match="refused"):
        client.resolve_manifest(ref)  # anonymous: the token server wants credentials
    (tmp_path / "config.json").write_text(json.dumps({"auths": {token_registry.host: {
        "auth": base64.b64encode(b"aenv:tok-pw").decode()}}}))
    assert token_registry.token_server is not None
    issued = token_registry.token_server.issued
    with RegistryClient(token_registry.host) as client:
        manifest = client.resolve_manifest(ref)
        assert manifest.digest == image.digest
        client.download_blob("team/app", manifest.layers[0], tmp_path / "blob")
    assert token_registry.token_server.issued == issued + 1  # one token, reused for the blob

