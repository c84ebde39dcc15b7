"""A real registry (Debian's docker-registry) on loopback, and helpers to push images to it."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentenv.template.convert import private_blockd, start_private
from tests.template.registry_server import Registry, running_registry, self_signed_cert
from tests.template.tokenserver import TokenServer


@pytest.fixture(scope="session")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    with running_registry(tmp_path_factory.mktemp("registry")) as reg:
        yield reg


@pytest.fixture(scope="session")
def auth_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    with running_registry(tmp_path_factory.mktemp("auth-registry"), ("aenv", "s3cret-pw")) as reg:
        yield reg


@pytest.fixture(scope="session")
def tls_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    with running_registry(tmp_path_factory.mktemp("tls-registry"), tls=True) as reg:
        yield reg


@pytest.fixture(scope="session")
def token_registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Registry]:
    """A registry behind the Docker token flow: bearer tokens from a token server that wants
    basic auth (user aenv, password tok-pw)."""
    tmp = tmp_path_factory.mktemp("token-registry")
    cert, key = self_signed_cert(tmp)
    tokens = TokenServer(cert, key, "aenv", "tok-pw")
    with running_registry(tmp, extra=tokens.registry_config()) as reg:
        reg.auth = ("aenv", "tok-pw")
        reg.token_server = tokens
        yield reg
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
