"""The cluster's Redis as `make cluster-up` runs it (the ACL file of scripts/redis-acl.sh, one
password per component, read from files): a client without the password can do nothing (no
minting API keys, no reading idempotency records), and each component reaches only its keys."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis
import redis.exceptions

from agentenv.control.gateway.store import GatewayStore, StoreUnavailable
from agentenv.control.redis_auth import RedisAuth
from agentenv.control.scheduler.server import SchedulerOptions, SchedulerServer
from agentenv.control.scheduler.store import Store, StoreError
from agentenv.errors import AgentEnvError
from tests.control.conftest import AclRedis
from tests.control.helpers import SECRET, ClusterClient, status


@pytest.fixture(scope="module")
def acl_redis(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AclRedis]:
    server = AclRedis(tmp_path_factory.mktemp("acl-redis"))
    server.start()
    yield server
    server.stop()


def test_redis_refuses_a_client_without_the_password(acl_redis: AclRedis) -> None:
    for anonymous in (acl_redis.raw(), acl_redis.raw("gateway", "not-the-password"),
                      acl_redis.raw("default", "")):
        with pytest.raises(redis.exceptions.AuthenticationError):
            anonymous.set("aenv:apikey:" + "0" * 64, "victim")  # minting an API key
        with pytest.raises(redis.exceptions.AuthenticationError):
            anonymous.keys("aenv:idem:*")  # the idempotency records hold envd tokens
    with pytest.raises(StoreUnavailable, match=r"is unavailable: .*authenticated"):
        asyncio.run(_create_team(GatewayStore(acl_redis.url), "intruders"))
    with pytest.raises(StoreError):
        Store(acl_redis.url).ping()
    # `aenv team` too: no password, no team
    aenv = [sys.executable, "-m", "agentenv.cli.main", "team", "--redis", acl_redis.url]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    env.pop("AENV_REDIS_PASSWORD_FILE", None)
    refused = subprocess.run([*aenv, "create", "intruders"], capture_output=True, text=True,
                             env=env)
    assert refused.returncode != 0
    assert "unavailable: HELLO must be called with the client already authenticated" in refused.stderr
    done = subprocess.run([*aenv, "--redis-user", "gateway", "--redis-password-file",
                           str(acl_redis.passwords["gateway"]), "create", "operators"],
                          capture_output=True, text=True, env=env)
    assert done.returncode == 0, done.stderr
    assert acl_redis.raw("gateway").sismember("aenv:teams", "operators")


async def _create_team(store: GatewayStore, name: str) -> None:
    try:
        await store.create_team(name)
    finally:
        await store.close()


def test_each_component_reaches_only_its_keys(acl_redis: AclRedis) -> None:
    async def gateway() -> str:
        store = GatewayStore(acl_redis.url, acl_redis.auth("gateway"))
        try:
            await store.create_team("team-a")
            return await store.new_key("team-a")
        finally:
            await store.close()

    key = asyncio.run(gateway())
    assert key.startswith("e2b_")

    async def scheduler() -> None:
        server = SchedulerServer(SchedulerOptions(
            cluster_secret=SECRET, listen="127.0.0.1:0", redis_url=acl_redis.url,
            redis_auth=acl_redis.auth("scheduler")))
        await server.start()
        try:
            async with ClusterClient(f"127.0.0.1:{server.port}") as client:
                await client.heartbeat(status("n1", sandboxes=["s1"]))
                await client.record_assignment("s2", "n1")
                assert (await client.lookup("s2")) is not None
        finally:
            await server.stop(grace=0)

    asyncio.run(scheduler())
    assert acl_redis.raw("scheduler").hexists("aenv:sched:bindings", "s2")
    # the gateway reads and writes its own keys, not the scheduler's bindings or node addresses
    gate = acl_redis.raw("gateway")
    with pytest.raises(redis.exceptions.NoPermissionError):
        gate.hget("aenv:sched:bindings", "s2")
    with pytest.raises(redis.exceptions.NoPermissionError):
        gate.hset("aenv:sched:nodes", "n1", b"forged")
    sched = acl_redis.raw("scheduler")
    with pytest.raises(redis.exceptions.NoPermissionError):
        sched.get("aenv:apikey:" + "0" * 64)
    with pytest.raises(redis.exceptions.NoPermissionError):
        sched.set("aenv:apikey:" + "0" * 64, "team-a")
    for user in ("gateway", "scheduler"):
        with pytest.raises(redis.exceptions.NoPermissionError):
            acl_redis.raw(user).config_get("requirepass")
        with pytest.raises(redis.exceptions.NoPermissionError):
            acl_redis.raw(user).flushall()


def test_bad_password_files_are_named(tmp_path: Path) -> None:
    with pytest.raises(AgentEnvError, match="cannot read the Redis password file"):
        RedisAuth.load("gateway", tmp_path / "missing")
    (tmp_path / "two").write_text("a b\n")
    with pytest.raises(AgentEnvError, match="must hold one word"):
        RedisAuth.load("gateway", tmp_path / "two")
    with pytest.raises(AgentEnvError, match="without a password file"):
        RedisAuth.load("gateway", None)


def test_a_password_in_the_url_is_never_shown(tmp_path: Path) -> None:
    """Whoever puts the password in the URL after all: the gateway's 503 answers and the
    scheduler's errors name Redis without it."""
    url = f"unix://gateway:hunter2@{tmp_path}/none.sock"
    with pytest.raises(StoreUnavailable) as caught:
        asyncio.run(_create_team(GatewayStore(url), "team-a"))
    assert "hunter2" not in str(caught.value) and "gateway:***@" in str(caught.value)
    with pytest.raises(StoreError) as failed:
        Store(url).ping()
    assert "hunter2" not in str(failed.value) and "gateway:***@" in str(failed.value)
