"""A real registry (Debian's docker-registry) on loopback, and helpers to push images to it."""

from __future__ import annotations

import contextlib
import os
import re
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from agentenv.template.convert import private_blockd, start_private
from tests.template import helpers
from tests.template.tokenserver import SERVICE, TokenServer


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Registry:
    host: str  # 127.0.0.1:PORT
    log: Path
    auth: tuple[str, str] | None
    process: subprocess.Popen[bytes]
    scheme: str = "http"
    token_server: TokenServer | None = None

    @property
    def cert(self) -> Path:
        return self.log.parent / "cert.pem"

    def push(self, repository: str, tag: str, image: helpers.BuiltImage) -> str:
        bearer = None
        if self.token_server is not None:
            bearer = self.token_server.token([f"repository:{repository}:push,pull"], SERVICE)
        return helpers.push_image(self.host, repository, tag, image,
                                  auth=None if bearer else self.auth, scheme=self.scheme,
                                  bearer=bearer)

    def log_mark(self) -> int:
        return self.log.stat().st_size

    def requests_since(self, mark: int) -> list[str]:
        """'METHOD URI' of every request the registry logged after `mark`."""
        text = self.log.read_bytes()[mark:].decode(errors="replace")
        return [f"{m.group(1)} {m.group(2)}" for m in
                re.finditer(r'http\.request\.method=(\w+) http\.request\.remoteaddr=\S+ '
                            r'http\.request\.uri="?([^"\s]+)"?', text)]


def _self_signed_cert(tmp: Path) -> tuple[Path, Path]:
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return cert, key


def _start_registry(tmp: Path, htpasswd: tuple[str, str] | None, tls: bool = False,
                    extra: str = "", delete: bool = True) -> Registry:
    """`delete`: whether the registry allows deleting manifests (storage.delete.enabled)."""
    port = _free_port()
    auth_block = extra
    tls_block = ""
    scheme = "http"
    if tls:
        cert, key = _self_signed_cert(tmp)
        tls_block = f"  tls:\n    certificate: {cert}\n    key: {key}\n"
        scheme = "https"
    if htpasswd:
        import warnings
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            import crypt
        user, password = htpasswd
        (tmp / "htpasswd").write_text(f"{user}:{crypt.crypt(password, crypt.mksalt(crypt.METHOD_BLOWFISH, rounds=16))}\n")
        auth_block = f"auth:\n  htpasswd:\n    realm: aenv-test\n    path: {tmp / 'htpasswd'}\n"
    (tmp / "config.yml").write_text(
        "version: 0.1\n"
        "log:\n  level: info\n  accesslog:\n    disabled: true\n"
        f"storage:\n  filesystem:\n    rootdirectory: {tmp / 'data'}\n  delete:\n"
        f"    enabled: {'true' if delete else 'false'}\n"
        f"http:\n  addr: 127.0.0.1:{port}\n" + tls_block
        + auth_block
    )
    log = tmp / "registry.log"
    with open(log, "wb") as out:
        process = subprocess.Popen(["docker-registry", "serve", str(tmp / "config.yml")],
                                   stdout=out, stderr=out, stdin=subprocess.DEVNULL)
    deadline = time.monotonic() + 15
    while True:
        with contextlib.suppress(httpx.TransportError):
            if httpx.get(f"{scheme}://127.0.0.1:{port}/v2/", timeout=1,
                         verify=False).status_code in (200, 401):
                break
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            pytest.fail(f"docker-registry did not start: {log.read_text()[-500:]}")
        time.sleep(0.05)
    return Registry(f"127.0.0.1:{port}", log, htpasswd, process, scheme)


def _stop(registry: Registry) -> None:
    registry.process.terminate()
    try:
        registry.process.wait(10)
    except subprocess.TimeoutExpired:
        registry.process.kill()
        registry.process.wait()


@pytest.fixture(scope="session")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    reg = _start_registry(tmp_path_factory.mktemp("registry"), None)
    yield reg
    _stop(reg)


@pytest.fixture(scope="session")
def auth_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    reg = _start_registry(tmp_path_factory.mktemp("auth-registry"), ("aenv", "s3cret-pw"))
    yield reg
    _stop(reg)


@pytest.fixture(scope="session")
def tls_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    reg = _start_registry(tmp_path_factory.mktemp("tls-registry"), None, tls=True)
    yield reg
    _stop(reg)


@pytest.fixture(scope="session")
def token_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    """A registry behind the Docker token flow: bearer tokens from a token server that wants
    basic auth (user aenv, password tok-pw)."""
    tmp = tmp_path_factory.mktemp("token-registry")
    cert, key = _self_signed_cert(tmp)
    tokens = TokenServer(cert, key, "aenv", "tok-pw")
    reg = _start_registry(tmp, None, extra=tokens.registry_config())
    reg.auth = ("aenv", "tok-pw")
    reg.token_server = tokens
    yield reg
    _stop(reg)
    tokens.stop()


@pytest.fixture
def no_docker_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """DOCKER_CONFIG pointed at an empty directory: the host's credentials never leak in."""
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "docker"))
    return tmp_path / "docker"


def needs_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root (loop devices, mounts)")


@pytest.fixture(scope="module")
def blockd(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A private blockd of the test module (layer conversion needs one); needs root."""
    needs_root()
    daemon = private_blockd(tmp_path_factory.mktemp("blockd"))
    yield start_private(daemon)
    daemon.stop()
