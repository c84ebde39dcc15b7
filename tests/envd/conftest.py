"""envd under test: a real envd subprocess serving a busybox root, driven by the official e2b SDK.

The root stands in for a guest image with no /bin/bash (like a minimal image): commands the SDK
sends as `/bin/bash -l -c CMD` run through the configured fallback shell, chrooted into the root.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from e2b import ConnectionConfig, Sandbox
from packaging.version import Version

REPO = Path(__file__).resolve().parents[2]
BUSYBOX = shutil.which("busybox") or "/bin/busybox"
TEST_TOKEN = "tok-envd-test"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def make_busybox_root(root: Path) -> Path:
    """A minimal guest root: static busybox and its applets (no bash), root in /etc/passwd."""
    (root / "bin").mkdir(parents=True)
    shutil.copy2(BUSYBOX, root / "bin" / "busybox")
    applets = subprocess.run([BUSYBOX, "--list"], check=True, capture_output=True, text=True).stdout
    for applet in applets.split():
        if applet not in ("busybox", "bash") and "/" not in applet:
            (root / "bin" / applet).symlink_to("busybox")
    (root / "etc").mkdir()
    (root / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    (root / "etc" / "group").write_text("root:x:0:\n")
    for directory in ("root", "tmp", "home", "data"):
        (root / directory).mkdir()
    (root / "tmp").chmod(0o1777)
    return root


@dataclass
class EnvdProcess:
    url: str
    root: Path
    process: subprocess.Popen[bytes]
    log_path: Path

    def sandbox(self, token: str | None = None, envd_version: str = "0.6.4") -> Sandbox:
        """A Sandbox object wired the way Sandbox.create() wires one, pointed at this envd."""
        headers = {"E2b-Sandbox-Id": "debug_sandbox_id", "E2b-Sandbox-Port": "49983"}
        if token is not None:
            headers["X-Access-Token"] = token
        config = ConnectionConfig(debug=True, sandbox_url=self.url, extra_sandbox_headers=headers)
        return Sandbox(
            sandbox_id="debug_sandbox_id",
            sandbox_domain=None,
            envd_version=Version(envd_version),
            envd_access_token=token,
            traffic_access_token=None,
            connection_config=config,
        )

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def start_envd(root: Path, log_dir: Path, extra_env: dict[str, str] | None = None) -> EnvdProcess:
    port = free_port()
    env = {
        **os.environ,
        "PYTHONPATH": str(REPO / "src"),
        "AENV_ENVD_SHELL_FALLBACK": "/bin/sh",
        **(extra_env or {}),
    }
    log_path = log_dir / f"envd-{port}.log"
    with open(log_path, "wb") as log_file:
        process = subprocess.Popen(
            [sys.executable, "-m", "agentenv.guest.envd", "--host", "127.0.0.1", "--port", str(port),
             "--root", str(root), "--log-level", "debug"],
            env=env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while True:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 204:
                break
        except httpx.TransportError:
            pass
        if process.poll() is not None or time.monotonic() > deadline:
            process.kill()
            raise RuntimeError(f"envd did not start:\n{log_path.read_text()[-3000:]}")
        time.sleep(0.05)
    return EnvdProcess(url, root, process, log_path)


@pytest.fixture(scope="session")
def needs_root() -> None:
    if os.geteuid() != 0:
        pytest.skip("envd tests chroot into a busybox root and switch users: run as root")


@pytest.fixture(scope="session")
def envd(tmp_path_factory: pytest.TempPathFactory, needs_root: None) -> Iterator[EnvdProcess]:
    root = make_busybox_root(tmp_path_factory.mktemp("guest") / "root")
    server = start_envd(root, tmp_path_factory.mktemp("logs"))
    yield server
    server.stop()
    assert server.process.returncode == 0, server.log_path.read_text()[-3000:]


@pytest.fixture()
def fresh_envd(tmp_path: Path, needs_root: None) -> Iterator[Callable[..., EnvdProcess]]:
    """A private envd (for tests that change global state such as the access token)."""
    started: list[EnvdProcess] = []

    def factory(**extra_env: str) -> EnvdProcess:
        root = make_busybox_root(tmp_path / f"root{len(started)}")
        server = start_envd(root, tmp_path, extra_env)
        started.append(server)
        return server

    yield factory
    for server in started:
        server.stop()


@pytest.fixture()
def sbx(envd: EnvdProcess) -> Sandbox:
    """The SDK in debug mode, exactly as a user gets it from Sandbox.create()."""
    return Sandbox.create(debug=True, sandbox_url=envd.url)
