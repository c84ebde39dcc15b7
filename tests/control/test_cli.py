"""`aenv scheduler`: bad flags, an unreachable Redis, a taken port and a missing cluster secret
give one clear line."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from tests.control.conftest import RedisServer, free_port
from tests.control.helpers import SECRET


def aenv(*args: str, secret: str | None = SECRET) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "AENV_CLUSTER_SECRET"}
    if secret is not None:
        env["AENV_CLUSTER_SECRET"] = secret
    return subprocess.run([sys.executable, "-m", "agentenv.cli.main", *args],
                          capture_output=True, text=True, timeout=60, env=env)


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


def test_no_cluster_secret(tmp_path: Path) -> None:
    """No scheduler, and no node of a scheduler, without the cluster secret."""
    done = aenv("scheduler", "--redis", f"unix://{tmp_path}/none.sock", secret=None)
    assert done.returncode != 0
    assert "the scheduler needs the cluster secret" in done.stderr, done.stderr
    done = aenv("serve", "--backend", "process", "--state-dir", str(tmp_path / "node"),
                "--scheduler", "127.0.0.1:9", secret=None)
    assert done.returncode != 0
    assert "--scheduler needs the cluster secret" in done.stderr, done.stderr


def test_node_keys_are_printed_from_the_cluster_secret(tmp_path: Path) -> None:
    """`aenv node-key` prints what a node is given instead of the secret: one key per node id
    (the gateway and the scheduler derive the same); a node given its key file starts; one
    with a key that is not a key names the file. (`aenv peer-key` prints a static peer's own
    public key: tests/remote/test_static_peer_keys.py.)"""
    from agentenv.cluster_keys import node_key

    printed = {i: aenv("node-key", "--node-id", i).stdout.strip() for i in ("n1", "n2")}
    assert printed == {i: node_key(SECRET, i) for i in ("n1", "n2")}
    assert printed["n1"] != printed["n2"] and SECRET not in printed.values()
    done = aenv("node-key", "--node-id", "n1", secret=None)
    assert done.returncode != 0 and "no cluster secret" in done.stderr, done.stderr

    bad = tmp_path / "node-key"
    bad.write_text(SECRET)  # the cluster secret is no node key
    done = aenv("serve", "--backend", "process", "--state-dir", str(tmp_path / "node"),
                "--scheduler", "127.0.0.1:9", "--node-key-file", str(bad), secret=None)
    assert done.returncode != 0
    assert f"the node key from {bad} is not 64 hex digits" in done.stderr, done.stderr
    good = tmp_path / "good-key"
    good.write_text(printed["n1"])
    done = aenv("serve", "--backend", "process", "--state-dir", str(tmp_path / "node"),
                "--scheduler", "127.0.0.1:9", "--node-key-file", str(good))
    assert "its key or the cluster secret, not both" in done.stderr, done.stderr
