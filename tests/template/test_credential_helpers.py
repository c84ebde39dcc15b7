"""Docker credential helpers (`credsStore`, `credHelpers`), run as real programs on PATH against
a real loopback registry that wants basic auth."""

from __future__ import annotations

import base64
import json
import os
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from agentenv.registry.auth import credentials_for, run_credential_helper
from agentenv.registry.client import RegistryClient
from agentenv.registry.errors import AuthError
from agentenv.registry.reference import parse_reference
from tests.template import helpers
from tests.template.conftest import Registry

# A real credential helper: answers `get` from a JSON table {server address: [user, secret]},
# logs each call (argv[1] and stdin) as a JSON line, and speaks the protocol's failure modes.
_HELPER_SOURCE = """\
import json, sys, time
from pathlib import Path
here = Path(__file__).with_suffix("")
table = json.loads(Path(str(here) + ".table.json").read_text())
address = sys.stdin.read()
with open(str(here) + ".calls", "a") as log:
    log.write(json.dumps([sys.argv[1:], address]) + "\\n")
mode = table.get("__mode__")
if mode == "crash":
    sys.stderr.write("keychain is locked\\n")
    sys.exit(3)
if mode == "sleep":
    time.sleep(30)
if sys.argv[1:] != ["get"] or address not in table:
    print("credentials not found in native keychain")
    sys.exit(1)
user, secret = table[address]
print(json.dumps({"ServerURL": address, "Username": user, "Secret": secret}))
"""


@dataclass
class HelperDir:
    bin: Path

    def install(self, name: str, table: dict[str, object]) -> Path:
        """Write the executable `docker-credential-<name>` answering from `table`."""
        program = self.bin / f"docker-credential-{name}"
        program.write_text(f"#!{sys.executable}\n" + _HELPER_SOURCE)
        program.chmod(0o755)
        Path(f"{program}.table.json").write_text(json.dumps(table))
        return program

    def calls(self, name: str) -> list[list[object]]:
        log = self.bin / f"docker-credential-{name}.calls"
        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


@pytest.fixture
def helper_dir(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[HelperDir]:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "docker"))
    (tmp_path / "docker").mkdir()
    yield HelperDir(bin_dir)


def _write_config(config: dict[str, object]) -> None:
    (Path(os.environ["DOCKER_CONFIG"]) / "config.json").write_text(json.dumps(config))


@pytest.fixture(scope="module")
def private_image(auth_registry: Registry) -> helpers.BuiltImage:
    image = helpers.build_image([helpers.TarBuilder().file("secret", b"from a helper").bytes()])
    auth_registry.push("helper/img", "v1", image)
    return image


def _pull(registry: Registry, image: helpers.BuiltImage, dest: Path,
          repository: str = "helper/img") -> None:
    ref = parse_reference(f"{registry.host}/{repository}:v1")
    with RegistryClient(registry.host) as client:
        manifest = client.resolve_manifest(ref)
        assert manifest.digest == image.digest
        out = client.download_blob(repository, manifest.layers[0], dest)
        assert helpers.digest_of(out.read_bytes()) == manifest.layers[0].digest


def _wrong_auth(host: str) -> dict[str, object]:
    return {host: {"auth": base64.b64encode(b"aenv:wrong").decode()}}


def test_creds_store_supplies_credentials(auth_registry: Registry, private_image: helpers.BuiltImage,
                                          helper_dir: HelperDir, tmp_path: Path) -> None:
    host = auth_registry.host
    helper_dir.install("teststore", {host: ["aenv", "s3cret-pw"]})
    # The helper wins over a (wrong) auths entry for the same registry, as in docker.
    _write_config({"credsStore": "teststore", "auths": _wrong_auth(host)})
    _pull(auth_registry, private_image, tmp_path / "blob")
    # Docker's protocol: `get`, the bare host:port on stdin; asked once per client.
    assert helper_dir.calls("teststore") == [[["get"], host]]


def test_cred_helpers_override_creds_store(auth_registry: Registry, private_image: helpers.BuiltImage,
                                           helper_dir: HelperDir, tmp_path: Path) -> None:
    host = auth_registry.host
    helper_dir.install("default", {host: ["aenv", "wrong"], "other.example:5000": ["o", "pw"]})
    helper_dir.install("special", {host: ["aenv", "s3cret-pw"]})
    _write_config({"credsStore": "default", "credHelpers": {host: "special"}})
    _pull(auth_registry, private_image, tmp_path / "blob")
    assert helper_dir.calls("default") == []
    assert helper_dir.calls("special") == [[["get"], host]]
    # Registries without their own helper still use credsStore.
    other = credentials_for("other.example:5000")
    assert other is not None and (other.username, other.password) == ("o", "pw")
    # With the registry's helper absent from credHelpers, the store's wrong password is sent.
    _write_config({"credsStore": "default", "credHelpers": {"elsewhere:1": "special"}})
    with RegistryClient(host) as client, pytest.raises(AuthError, match="rejected the credentials"):
        client.resolve_manifest(parse_reference(f"{host}/helper/img:v1"))


def test_helper_without_credentials_means_anonymous(auth_registry: Registry,
                                                    private_image: helpers.BuiltImage,
                                                    helper_dir: HelperDir) -> None:
    host = auth_registry.host
    helper_dir.install("empty", {})
    # Correct auths credentials are not consulted once a helper is configured (docker's rule).
    _write_config({"credsStore": "empty",
                   "auths": {host: {"auth": base64.b64encode(b"aenv:s3cret-pw").decode()}}})
    assert credentials_for(host) is None
    with RegistryClient(host) as client, pytest.raises(AuthError, match="needs credentials"):
        client.resolve_manifest(parse_reference(f"{host}/helper/img:v1"))
    assert helper_dir.calls("empty") == [[["get"], host]] * 2


def test_crashing_and_missing_helpers_are_clear_errors(auth_registry: Registry,
                                                       private_image: helpers.BuiltImage,
                                                       helper_dir: HelperDir) -> None:
    host = auth_registry.host
    ref = parse_reference(f"{host}/helper/img:v1")
    helper_dir.install("crashy", {"__mode__": "crash"})
    _write_config({"credHelpers": {host: "crashy"}})
    with RegistryClient(host) as client, pytest.raises(
            AuthError, match=r"docker-credential-crashy failed .*exit 3.*keychain is locked"):
        client.resolve_manifest(ref)
    _write_config({"credsStore": "nowhere-to-be-found"})
    with RegistryClient(host) as client, pytest.raises(
            AuthError, match=r"docker-credential-nowhere-to-be-found .* not on PATH"):
        client.resolve_manifest(ref)


def test_public_registry_never_runs_the_helper(registry: Registry, helper_dir: HelperDir) -> None:
    """Credentials are looked up only when a registry asks: a broken helper does not stop a pull
    that needs none."""
    image = helpers.build_image([helpers.TarBuilder().file("pub", b"p").bytes()])
    registry.push("public/img", "v1", image)
    helper_dir.install("crashy", {"__mode__": "crash"})
    _write_config({"credsStore": "crashy"})
    with RegistryClient(registry.host) as client:
        assert client.resolve_manifest(parse_reference(f"{registry.host}/public/img:v1")).digest \
            == image.digest
    assert helper_dir.calls("crashy") == []


def test_identity_token_is_refused_clearly_for_basic_auth(
        auth_registry: Registry, private_image: helpers.BuiltImage, helper_dir: HelperDir) -> None:
    """A registry that wants basic auth cannot take an OAuth refresh token: a clear refusal."""
    host = auth_registry.host
    helper_dir.install("oauth", {host: ["<token>", "refresh-abc"]})
    _write_config({"credsStore": "oauth"})
    creds = credentials_for(host)
    assert creds is not None and creds.identity_token == "refresh-abc" and not creds.username
    assert "refresh-abc" not in repr(creds)
    with RegistryClient(host) as client, pytest.raises(AuthError, match="identity token") as err:
        client.resolve_manifest(parse_reference(f"{host}/helper/img:v1"))
    assert "basic auth" in str(err.value) and "refresh-abc" not in str(err.value)


REFRESH_TOKEN = "rt-" + "9f3a" * 8  # what the test token server accepts


@pytest.fixture
def oauth_registry(token_registry: Registry) -> Iterator[Registry]:
    """The token registry whose token server also takes REFRESH_TOKEN in docker's OAuth POST."""
    server = token_registry.token_server
    assert server is not None
    server.refresh_token = REFRESH_TOKEN
    server.oauth_requests.clear()
    yield token_registry
    server.refresh_token = None
    server.rotate_refresh_token = False


@pytest.fixture(scope="module")
def oauth_image(token_registry: Registry) -> helpers.BuiltImage:
    image = helpers.build_image([helpers.TarBuilder().file("oauth", b"via a refresh token").bytes()])
    token_registry.push("oauth/img", "v1", image)
    return image


def _pull_oauth(registry: Registry, image: helpers.BuiltImage, dest: Path) -> None:
    _pull(registry, image, dest, repository="oauth/img")


def test_identity_token_in_auths_pulls_via_oauth(oauth_registry: Registry,
                                                 oauth_image: helpers.BuiltImage,
                                                 helper_dir: HelperDir, tmp_path: Path) -> None:
    host = oauth_registry.host
    _write_config({"auths": {host: {"identitytoken": REFRESH_TOKEN}}})
    _pull_oauth(oauth_registry, oauth_image, tmp_path / "blob")
    server = oauth_registry.token_server
    assert server is not None
    # One exchange, reused for the blob; the form is docker's refresh-token grant.
    assert server.oauth_requests == [{
        "grant_type": "refresh_token", "refresh_token": REFRESH_TOKEN, "client_id": "docker",
        "service": "aenv-test-registry", "scope": "repository:oauth/img:pull"}]


def test_identity_token_from_helper_pulls_via_oauth(oauth_registry: Registry,
                                                    oauth_image: helpers.BuiltImage,
                                                    helper_dir: HelperDir, tmp_path: Path) -> None:
    host = oauth_registry.host
    helper_dir.install("oauth", {host: ["<token>", REFRESH_TOKEN]})
    _write_config({"credHelpers": {host: "oauth"}})
    _pull_oauth(oauth_registry, oauth_image, tmp_path / "blob")
    assert helper_dir.calls("oauth") == [[["get"], host]]
    # Docker prefers the identity token even where a (here wrong) password sits beside it.
    _write_config({"auths": {host: {"auth": base64.b64encode(b"aenv:wrong").decode(),
                                    "identitytoken": REFRESH_TOKEN}}})
    _pull_oauth(oauth_registry, oauth_image, tmp_path / "blob2")


def test_wrong_identity_token_is_a_clear_error(oauth_registry: Registry,
                                               oauth_image: helpers.BuiltImage,
                                               helper_dir: HelperDir) -> None:
    host = oauth_registry.host
    wrong = "rt-stale-" + "c0ffee" * 4
    ref = parse_reference(f"{host}/oauth/img:v1")
    for config in ({"auths": {host: {"identitytoken": wrong}}}, {"credsStore": "stale"}):
        helper_dir.install("stale", {host: ["<token>", wrong]})
        _write_config(config)
        with RegistryClient(host) as client:
            assert wrong not in repr(client.credentials)
            with pytest.raises(AuthError, match=r"refused the identity token") as err:
                client.resolve_manifest(ref)
        message = str(err.value)
        assert host in message and "HTTP 401" in message
        assert wrong not in message and REFRESH_TOKEN not in message
        assert all(wrong not in repr(arg) for arg in err.value.args)
    server = oauth_registry.token_server
    assert server is not None and [r["refresh_token"] for r in server.oauth_requests] == [wrong] * 2


def test_rotated_refresh_token_is_used_next(oauth_registry: Registry,
                                            oauth_image: helpers.BuiltImage,
                                            helper_dir: HelperDir) -> None:
    """A token server that rotates refresh tokens: like docker, the client sends the new one in
    its next exchange (another repository's scope) instead of the spent one."""
    host = oauth_registry.host
    server = oauth_registry.token_server
    assert server is not None
    other = helpers.build_image([helpers.TarBuilder().file("other", b"second repo").bytes()])
    oauth_registry.push("oauth/other", "v1", other)
    server.rotate_refresh_token = True
    server.oauth_requests.clear()
    _write_config({"auths": {host: {"identitytoken": REFRESH_TOKEN}}})
    with RegistryClient(host) as client:
        assert client.resolve_manifest(parse_reference(f"{host}/oauth/img:v1")).digest \
            == oauth_image.digest
        assert client.resolve_manifest(parse_reference(f"{host}/oauth/other:v1")).digest \
            == other.digest
    sent = [r["refresh_token"] for r in server.oauth_requests]
    assert len(sent) == 2 and sent[0] == REFRESH_TOKEN and sent[1] != REFRESH_TOKEN


def test_token_server_without_oauth_is_a_clear_error(token_registry: Registry,
                                                     oauth_image: helpers.BuiltImage,
                                                     helper_dir: HelperDir) -> None:
    """Docker does not fall back to the GET flow with a refresh token; neither does aenv. A
    GET-only token server (405 to the POST) is a clear refusal that keeps the secret out."""
    host = token_registry.host
    _write_config({"auths": {host: {"identitytoken": REFRESH_TOKEN}}})
    with RegistryClient(host) as client, pytest.raises(
            AuthError, match=r"does not accept OAuth refresh tokens \(HTTP 405") as err:
        client.resolve_manifest(parse_reference(f"{host}/oauth/img:v1"))
    assert host in str(err.value) and REFRESH_TOKEN not in str(err.value)


def test_docker_hub_address_and_bad_answers(helper_dir: HelperDir) -> None:
    """Docker Hub is asked for as https://index.docker.io/v1/ under any of its names; bad
    configs and answers are errors that name what was wrong. No network: helpers only."""
    helper_dir.install("hub", {"https://index.docker.io/v1/": ["hubuser", "hubpw"]})
    for key in ("https://index.docker.io/v1/", "docker.io"):
        _write_config({"credHelpers": {key: "hub"}})
        for name in ("docker.io", "index.docker.io", "registry-1.docker.io"):
            creds = credentials_for(name)
            assert creds is not None and (creds.username, creds.password) == ("hubuser", "hubpw")
    assert {call[1] for call in helper_dir.calls("hub")} == {"https://index.docker.io/v1/"}
    garbage = helper_dir.bin / "docker-credential-garbage"
    garbage.write_text("#!/bin/sh\necho 'not json'\n")
    garbage.chmod(0o755)
    with pytest.raises(AuthError, match=r"docker-credential-garbage .* not JSON"):
        run_credential_helper("garbage", "x:1")
    helper_dir.install("slow", {"__mode__": "sleep"})
    with pytest.raises(AuthError, match=r"docker-credential-slow did not answer .* within 0\.5 s"):
        run_credential_helper("slow", "x:1", timeout=0.5)
    # An identity token in `auths` (what `docker login` stores for OAuth registries).
    _write_config({"auths": {"a:1": {"identitytoken": "rt"},
                             "b:1": {"auth": base64.b64encode(b"u:p").decode(), "identitytoken": "rt"}}})
    only_token, both = credentials_for("a:1"), credentials_for("b:1")
    assert only_token is not None and (only_token.username, only_token.identity_token) == ("", "rt")
    assert both is not None and (both.username, both.password, both.identity_token) == ("u", "p", "rt")
    _write_config({"credsStore": 7})
    with pytest.raises(AuthError, match="credsStore is not a helper name"):
        credentials_for("x:1")
