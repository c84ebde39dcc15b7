"""`aenv scheduler`: bad flags, an unreachable Redis and a taken port give one clear line."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.control.conftest import RedisServer, free_port


def aenv(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "agentenv.cli.main", *args],
                          capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize(("args", "text"), [
    (["--nodes", "not a node"], "--nodes: 'not a node' is not a node (ID=HOST:PORT or HOST:PORT)"),
    (["--k8s-service", "just-a-name"], "--k8s-service 'just-a-name' is not NAMESPACE/NAME"),
    (["--redis", "http://x"], "--redis 'http://x': expected redis://HOST:PORT/DB or unix://PATH"),
    (["--strategy", "fastest"], "Invalid value for '--strategy'"),
])
def test_bad_flags(args: list[str], text: str, tmp_path: Path) -> None:
    done = aenv("scheduler", "--redis", f"unix://{tmp_path}/none.sock", *args)
    assert done.returncode != 0
    assert text in done.stderr, done.stderr


def test_unreachable_redis(tmp_path: Path) -> None:
    done = aenv("scheduler", "--listen", f"127.0.0.1:{free_port()}",
                "--redis", f"unix://{tmp_path}/none.sock")
    assert done.returncode == 1
    assert f"cannot reach Redis at unix://{tmp_path}/none.sock" in done.stderr, done.stderr


def test_port_taken(redis_server: RedisServer, prefix: str) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        done = aenv("scheduler", "--listen", f"127.0.0.1:{port}", "--redis", redis_server.url,
                    "--redis-prefix", prefix)
    assert done.returncode == 1
    assert f"cannot listen on 127.0.0.1:{port}" in done.stderr, done.stderr
