"""A hostile registry (a team chooses `fromImage`) cannot point the node's registry client at
addresses of the node's own network: redirects, bearer realms and the registry host itself
are refused on loopback, link-local and private addresses unless the operator allowed that
registry by name (AENV_REGISTRY_ALLOW_PRIVATE), and the target is never contacted. Error
bodies come back only as a short, sanitized line.

Both servers are on loopback: the hostile registry (the one allowed host:port) and a target
that records whether anything reached it."""

from __future__ import annotations

import base64
import ipaddress
import json
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from agentenv.registry.errors import PullError
from agentenv.template.pull import pull_image
from tests.template import helpers
from tests.template.conftest import Registry

pytestmark = pytest.mark.timeout(120)


@dataclass
class Server:
    server: ThreadingHTTPServer
    hits: list[str] = field(default_factory=list)

    @property
    def port(self) -> int:
        return self.server.server_address[1]


def serve(answer: object) -> Server:
    """An HTTP server on loopback answering GETs and POSTs with `answer(path)`."""
    holder: list[Server] = []

    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            holder[0].hits.append(self.path)
            status, headers, body = answer(self.path)  # type: ignore[operator]
            self.send_response(status)
            for name, value in headers.items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        do_POST = do_GET

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    holder.append(Server(server))
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return holder[0]


@pytest.fixture
def target() -> Iterator[Server]:
    """Stands for whatever is on the node's network (a metadata service, an admin port)."""
    made = serve(lambda path: (200, {"Content-Type": "application/json"},
                                b'{"token": "internal-secret", "errors": []}'))
    yield made
    made.server.shutdown()


@pytest.fixture
def hostile(target: Server, monkeypatch: pytest.MonkeyPatch) -> Iterator[Server]:
    inside = f"http://127.0.0.1:{target.port}"

    def answer(path: str) -> tuple[int, dict[str, str], bytes]:
        if path == "/v2/":
            return 200, {}, b"{}"
        if path.startswith("/v2/redirect/"):
            return 307, {"Location": f"{inside}/latest/meta-data/iam"}, b""
        if path.startswith("/v2/realm/"):
            return 401, {"WWW-Authenticate": f'Bearer realm="{inside}/token",service="x"'}, b""
        if path.startswith("/v2/noisy/"):
            message = "\x1b[31mdenied\x1b[0m\r\nSet-Cookie: x=1 " + "A" * 150
            return 403, {"Content-Type": "application/json"}, json.dumps(
                {"errors": [{"code": "DENIED", "message": message}]}).encode()
        return 404, {}, b""

    made = serve(answer)
    # only the hostile registry itself is allowed (as an operator would list theirs)
    monkeypatch.setenv("AENV_REGISTRY_ALLOW_PRIVATE", f"127.0.0.1:{made.port}")
    yield made
    made.server.shutdown()


def _pull(ref: str, tmp_path: Path) -> PullError:
    with pytest.raises(PullError) as caught:
        pull_image(ref, state_dir=tmp_path / "state", docker_config=tmp_path / "none.json")
    return caught.value


def test_a_redirect_into_the_node_network_is_refused(hostile: Server, target: Server,
                                                    tmp_path: Path) -> None:
    error = _pull(f"127.0.0.1:{hostile.port}/redirect/img:latest", tmp_path)
    assert f"refused to connect to 127.0.0.1:{target.port}" in str(error)
    assert "loopback" in str(error) and "AENV_REGISTRY_ALLOW_PRIVATE" in str(error)
    assert "internal-secret" not in str(error)
    assert any(h.startswith("/v2/redirect/") for h in hostile.hits)
    assert target.hits == []


def test_a_bearer_realm_in_the_node_network_is_refused(hostile: Server, target: Server,
                                                      tmp_path: Path) -> None:
    error = _pull(f"127.0.0.1:{hostile.port}/realm/img:latest", tmp_path)
    assert f"refused to connect to 127.0.0.1:{target.port}" in str(error)
    assert target.hits == []


def test_a_registry_on_a_private_address_needs_the_operator(target: Server, tmp_path: Path,
                                                            monkeypatch: pytest.MonkeyPatch
                                                            ) -> None:
    monkeypatch.setenv("AENV_REGISTRY_ALLOW_PRIVATE", "")
    error = _pull(f"127.0.0.1:{target.port}/img:latest", tmp_path)
    assert "refused to connect" in str(error)
    assert target.hits == []


def test_error_bodies_come_back_short_and_sanitized(hostile: Server, tmp_path: Path) -> None:
    text = str(_pull(f"127.0.0.1:{hostile.port}/noisy/img:latest", tmp_path))
    assert "DENIED: " in text and "denied" in text
    assert "\x1b" not in text and "\r" not in text and "\n" not in text
    assert len(text) < 300


@pytest.mark.parametrize("address", [
    "169.254.169.254", "fe80::1", "10.0.0.1", "172.16.5.4", "192.168.1.1", "100.64.0.1",
    "127.0.0.2", "::1", "fd00::1", "::ffff:127.0.0.1", "::ffff:169.254.169.254", "0.0.0.0",
    "224.0.0.1", "192.0.2.1", "198.18.0.1", "240.0.0.1",
])
def test_special_addresses_are_refused(address: str) -> None:
    from agentenv.registry.client import address_problem

    assert address_problem(ipaddress.ip_address(address)) is not None


@pytest.mark.parametrize("address", ["8.8.8.8", "2606:4700::1111", "151.101.1.1"])
def test_public_addresses_are_allowed(address: str) -> None:
    from agentenv.registry.client import address_problem

    assert address_problem(ipaddress.ip_address(address)) is None


def test_a_team_pull_does_not_use_the_node_docker_config(auth_registry: Registry, tmp_path: Path,
                                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The node's docker config holds credentials (the operator's, for another team's private
    registry): a team's build pulls only with what its request carries."""
    from agentenv.registry.auth import Credentials
    from agentenv.registry.client import RegistryClient
    from agentenv.registry.errors import AuthError
    from agentenv.registry.reference import parse_reference

    image = helpers.build_image([helpers.TarBuilder().file("f", b"x").bytes()])
    auth_registry.push("private/img", "v1", image)
    ref = parse_reference(f"{auth_registry.host}/private/img:v1")
    config = {"auths": {auth_registry.host: {
        "auth": base64.b64encode(b"aenv:s3cret-pw").decode()}}}
    (tmp_path / "config.json").write_text(json.dumps(config))
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path))
    with RegistryClient(auth_registry.host) as operator:  # the operator's own pull works
        assert operator.resolve_manifest(ref).digest == image.digest
    with RegistryClient(auth_registry.host, use_docker_config=False) as team, \
            pytest.raises(AuthError, match="needs credentials"):
        team.resolve_manifest(ref)
    given = Credentials("aenv", "s3cret-pw")  # the request's own (fromImageRegistry)
    with RegistryClient(auth_registry.host, use_docker_config=False, credentials=given) as team:
        assert team.resolve_manifest(ref).digest == image.digest


@pytest.mark.parametrize("address", ["64:ff9b::a9fe:a9fe", "64:ff9b::a00:1", "2002:a00:1::1",
                                     "2001:0:4136:e378:8000:63bf:f5ff:fffe", "64:ff9b:1::1",
                                     "fec0::1"])
def test_ipv6_forms_of_private_ipv4_are_refused(address: str) -> None:
    """NAT64, 6to4 and Teredo carry an IPv4 address a translator delivers to (red team of
    2026-12-06); site-local is a private range."""
    from agentenv.registry.client import address_problem

    assert address_problem(ipaddress.ip_address(address)) is not None

