"""Fixtures for the control plane: a real Debian redis-server (unix socket, AOF on) and helpers
that run a scheduler in-process or as a separate process."""

from __future__ import annotations

import asyncio
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from agentenv.control.redis_auth import RedisAuth
from tests.control.helpers import SECRET

REDIS_SERVER = shutil.which("redis-server") or "/usr/bin/redis-server"
REPO = Path(__file__).resolve().parents[2]


class RedisServer:
    """redis-server on a unix socket in a private directory, AOF fsynced on every write, so a
    kill -9 of Redis loses nothing that was acknowledged."""

    def __init__(self, root: Path, *extra_args: str) -> None:
        self.root = root
        self.socket = root / "redis.sock"
        self.extra_args = extra_args
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"unix://{self.socket}"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [REDIS_SERVER, "--port", "0", "--unixsocket", str(self.socket),
             "--unixsocketperm", "700", "--dir", str(self.root), "--appendonly", "yes",
             "--appendfsync", "always", "--save", "", "--daemonize", "no",
             "--logfile", str(self.root / "redis.log"), *self.extra_args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited: {(self.root / 'redis.log').read_text()}")
            try:
                with socket.socket(socket.AF_UNIX) as probe:
                    probe.connect(str(self.socket))
                    probe.sendall(b"PING\r\n")
                    # NOAUTH: up, and wants a password (an ACL file without `default`)
                    if probe.recv(64).startswith((b"+PONG", b"-NOAUTH")):
                        return
            except OSError:
                pass
            time.sleep(0.02)
        raise RuntimeError("redis-server did not answer within 10 s")

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()


class AclRedis(RedisServer):
    """redis-server as `make cluster-up` runs it: the ACL of scripts/redis-acl.sh (no access
    without a password), a user and a password file each for the gateway and the scheduler."""

    def __init__(self, root: Path) -> None:
        self.passwords: dict[str, Path] = {}
        for user in ("gateway", "scheduler"):  # as cluster-up makes them
            path = self.passwords[user] = root / f"redis-{user}.password"
            path.write_text(secrets.token_hex(32))
            path.chmod(0o600)
        acl = root / "users.acl"
        made = subprocess.run(["bash", str(REPO / "scripts/redis-acl.sh"),
                               str(self.passwords["gateway"]), str(self.passwords["scheduler"])],
                              check=True, capture_output=True, text=True)
        acl.write_text(made.stdout)
        super().__init__(root, "--aclfile", str(acl))

    def auth(self, user: str) -> RedisAuth:
        return RedisAuth.load(user, self.passwords[user])

    def env(self, user: str) -> dict[str, str]:
        """How `aenv gateway`/`team`/`scheduler` are told to log in as `user`."""
        return {"AENV_REDIS_USER": user, "AENV_REDIS_PASSWORD_FILE": str(self.passwords[user])}

    def args(self, user: str) -> tuple[str, ...]:
        return ("--redis-user", user, "--redis-password-file", str(self.passwords[user]))

    def raw(self, user: str | None = None, password: str | None = None) -> redis.Redis:
        if user is not None and password is None:
            password = self.passwords[user].read_text()
        # no retries: redis-py retries a refused login (a ConnectionError) with back-off
        return redis.Redis(unix_socket_path=str(self.socket), username=user, password=password,
                           socket_timeout=10, retry=Retry(NoBackoff(), 0))


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisServer]:
    if not os.access(REDIS_SERVER, os.X_OK):
        pytest.fail("redis-server is missing: `apt-get install redis-server` "
                    "(scripts/system-packages.txt)")
    server = RedisServer(tmp_path_factory.mktemp("redis"))
    server.start()
    yield server
    server.stop()


@pytest.fixture
def prefix() -> str:
    """A key prefix of the test's own: tests share one Redis without seeing each other's keys."""
    return f"t{uuid.uuid4().hex[:10]}:"


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class SchedulerProcess:
    """`aenv scheduler` as its own process (for kill -9), with the tests' cluster secret
    (helpers.SECRET) in `secret_file`, beside its log."""

    def __init__(self, redis_url: str, prefix: str, log: Path, *args: str) -> None:
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.secret_file = log.with_name(log.stem + ".cluster-secret")
        self.secret_file.write_text(SECRET + "\n")
        self.secret_file.chmod(0o600)
        self.argv = [sys.executable, "-m", "agentenv.cli.main", "scheduler",
                     "--listen", self.address, "--redis", redis_url, "--redis-prefix", prefix,
                     "--cluster-secret-file", str(self.secret_file), *args]
        self.log = log
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.spawn()
        self.wait_ready()

    def spawn(self) -> None:
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(self.argv, stdout=out, stderr=out)

    def wait_ready(self) -> None:
        assert self.proc is not None, "spawn() first"
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"scheduler exited: {self.log.read_text()[-2000:]}")
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.2).close()
                return
            except OSError:
                time.sleep(0.05)
        raise RuntimeError("scheduler did not listen within 30 s")

    def kill9(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill9()


def run(coro: object) -> object:
    return asyncio.run(coro)  # type: ignore[arg-type]
