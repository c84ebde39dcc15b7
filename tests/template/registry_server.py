"""A real registry (Debian's docker-registry) on loopback for tests and benches: start_registry
and stop_registry, or running_registry for a block; tests/template/conftest.py's fixtures and
every other test or bench that needs one use these."""

from __future__ import annotations

import contextlib
import re
import socket
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.template import helpers
from tests.template.tokenserver import SERVICE, TokenServer


def free_port() -> int:
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


def self_signed_cert(tmp: Path) -> tuple[Path, Path]:
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2",
                    "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
                    "-keyout", str(key), "-out", str(cert)], check=True, capture_output=True)
    return cert, key


def start_registry(tmp: Path, htpasswd: tuple[str, str] | None = None, tls: bool = False,
                   extra: str = "", delete: bool = True) -> Registry:
    """`delete`: whether the registry allows deleting manifests (storage.delete.enabled)."""
    port = free_port()
    auth_block = extra
    tls_block = ""
    scheme = "http"
    if tls:
        cert, key = self_signed_cert(tmp)
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


def stop_registry(registry: Registry) -> None:
    registry.process.terminate()
    try:
        registry.process.wait(10)
    except subprocess.TimeoutExpired:
        registry.process.kill()
        registry.process.wait()


@contextlib.contextmanager
def running_registry(tmp: Path, htpasswd: tuple[str, str] | None = None, *, tls: bool = False,
                     extra: str = "", delete: bool = True) -> Iterator[Registry]:
    """A docker-registry in `tmp` for the block (start_registry), stopped after it."""
    registry = start_registry(tmp, htpasswd, tls, extra, delete)
    try:
        yield registry
    finally:
        stop_registry(registry)
