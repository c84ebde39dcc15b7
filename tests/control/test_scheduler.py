"""The scheduler's RPCs against a real redis-server, in-process (on loopback)."""

from __future__ import annotations

import asyncio
import itertools
import threading
from collections.abc import Callable, Coroutine
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc
import pytest
import redis
import uvloop
from redis.exceptions import RedisError

from agentenv.control.redis_auth import RedisAuth
from agentenv.control.scheduler.holders import HolderIndex
from agentenv.control.scheduler.store import Binding, Store, _loop_target
from agentenv.scheduling.client import SchedulerError
from agentenv.scheduling.proto import scheduler_pb2 as pb
from tests.control.conftest import RedisServer
from tests.control.helpers import scheduler, status


def test_every_rpc(redis_server: RedisServer, prefix: str) -> None:
    async def body() -> None:
        async with scheduler(redis_server.url, prefix) as (_, client):
            assert await client.heartbeat(status("n1", templates=["base"])) == 2.0
            await client.heartbeat(status("n2"))
            placement = await client.schedule(template_id="base", vcpus=2, memory_mib=512)
            assert placement.node_id == "n1"
            assert placement.reason == "cache: holds the template"
            await client.record_assignment("sbx1", placement.node_id, team_id="team-a")
            where = await client.lookup("sbx1")
            assert where is not None
            assert (where.node_id, where.node_up, where.team_id) == ("n1", True, "team-a")
            assert where.node_address == placement.node_address
            nodes = await client.list_nodes()
            assert [n.node_id for n in nodes] == ["n1", "n2"]
            assert all(n.up and n.discovered_by == ("heartbeat",) for n in nodes)
            await client.release("sbx1")
            assert await client.lookup("sbx1") is None
            await client.release("sbx1")  # idempotent: a retried kill is not an error

    asyncio.run(body())


@pytest.mark.parametrize(
    ("call", "code", "text"),
    [
        ({"template_id": "a", "snapshot_id": "b"}, grpc.StatusCode.INVALID_ARGUMENT, "not both"),
        ({}, grpc.StatusCode.INVALID_ARGUMENT, "is required"),
        ({"template_id": "base", "strategy": "fastest"}, grpc.StatusCode.INVALID_ARGUMENT,
         "unknown strategy 'fastest'"),
        ({"template_id": "bad name!"}, grpc.StatusCode.INVALID_ARGUMENT, "not a template"),
        ({"template_id": "base", "vcpus": 100000}, grpc.StatusCode.INVALID_ARGUMENT, "vcpus"),
        ({"source_sandbox_id": "nope"}, grpc.StatusCode.NOT_FOUND, "has no binding"),
        ({"snapshot_id": "snap-x"}, grpc.StatusCode.NOT_FOUND, "no node holds snapshot"),
        ({"template_id": "base", "vcpus": 64}, grpc.StatusCode.RESOURCE_EXHAUSTED,
         "n1: cpu: 16 free vCPUs < 64"),
    ],
)
def test_schedule_errors(
    redis_server: RedisServer, prefix: str, call: dict[str, object], code: grpc.StatusCode,
    text: str,
) -> None:
    async def body() -> None:
        async with scheduler(redis_server.url, prefix) as (_, client):
            await client.heartbeat(status("n1"))
            with pytest.raises(SchedulerError) as caught:
                await client.schedule(**call)  # type: ignore[arg-type]
            assert caught.value.code == code
            assert text in caught.value.details

    asyncio.run(body())


def test_no_nodes_and_bad_ids(redis_server: RedisServer, prefix: str) -> None:
    async def body() -> None:
        async with scheduler(redis_server.url, prefix) as (_, client):
            with pytest.raises(SchedulerError) as caught:
                await client.schedule(template_id="base")
            assert caught.value.code == grpc.StatusCode.UNAVAILABLE
            assert "no nodes are registered" in caught.value.details
            for call, text in [
                (client.lookup(""), "sandbox_id is required"),
                (client.lookup("a b"), "is not an id"),
                (client.release("x" * 200), "is not an id"),
                (client.record_assignment("sbx", "ghost"), "unknown node 'ghost'"),
                (client.heartbeat(status("")), "node_id is required"),
                (client.heartbeat(status("n1", address="nowhere")), "is not host:port"),
                (client.heartbeat(status("n1", sandboxes=["a", "a"])), "listed twice"),
            ]:
                with pytest.raises(SchedulerError) as caught:
                    await call
                assert text in caught.value.details, caught.value

    asyncio.run(body())


def test_concurrent_records_share_round_trips(redis_server: RedisServer, prefix: str,
                                              tmp_path: Path) -> None:
    """RecordAssignment's group commit: writers from many threads at once each get their own
    previous binding, Redis holds every binding with its node's set consistent, fewer script
    calls than writes were sent, and a Redis that is away fails every writer (none hangs)."""
    store = Store(redis_server.url, prefix)
    raw = redis.Redis.from_url(redis_server.url)
    writers = 48
    try:
        for i in range(writers):
            store.record(Binding(f"s{i}", "n0", "", 1, 1, 1))
        before = raw.info("commandstats").get("cmdstat_evalsha", {}).get("calls", 0)
        start = threading.Barrier(writers)

        def move(i: int) -> Binding | None:
            start.wait()
            return store.record(Binding(f"s{i}", f"n{1 + i % 3}", f"t{i}", 2, 1, 1))

        with ThreadPoolExecutor(writers) as pool:
            olds = list(pool.map(move, range(writers)))
        calls = raw.info("commandstats")["cmdstat_evalsha"]["calls"] - before
        assert [o.node_id if o else None for o in olds] == ["n0"] * writers
        assert calls < writers, "no two writes shared a round trip"
        assert raw.smembers(f"{prefix}node:n0:sandboxes") == set()
        for i in range(writers):
            node = f"n{1 + i % 3}"
            assert Binding.decode(f"s{i}", raw.hget(f"{prefix}bindings", f"s{i}").decode()) \
                == Binding(f"s{i}", node, f"t{i}", 2, 1, 1)
            assert raw.sismember(f"{prefix}node:{node}:sandboxes", f"s{i}")
        # One sandbox moved by every writer at once: the callbacks that keep the in-memory copy
        # run in Redis's order (each sees the binding the previous one wrote; the last is Redis's).
        applied: list[tuple[Binding | None, Binding]] = []

        def race(i: int) -> None:
            binding = Binding("raced", f"n{i}", "", i, 1, 1)
            start.wait()
            store.record(binding, lambda old: applied.append((old, binding)))

        with ThreadPoolExecutor(writers) as pool:
            list(pool.map(race, range(writers)))
        assert len(applied) == writers and applied[0][0] is None
        for (_, before), (old, _) in itertools.pairwise(applied):
            assert old == before
        final = Binding.decode("raced", raw.hget(f"{prefix}bindings", "raced").decode())
        assert applied[-1][1] == final
    finally:
        store.close()
        raw.close()

    away = Store(f"unix://{tmp_path / 'no-redis.sock'}", prefix)
    try:
        def fail(i: int) -> str:
            with pytest.raises(RedisError) as caught:
                away.record(Binding(f"s{i}", "n1", "", 1, 1, 1))
            return type(caught.value).__name__

        with ThreadPoolExecutor(8) as pool:
            assert len(list(pool.map(fail, range(16), timeout=30))) == 16
    finally:
        away.close()
@pytest.mark.parametrize("run", [asyncio.run, uvloop.run], ids=["asyncio", "uvloop"])
def test_records_from_the_loop_share_round_trips_in_redis_order(
        redis_server: RedisServer, prefix: str, tmp_path: Path,
        run: Callable[[Coroutine[Any, Any, None]], None]) -> None:
    """record_async sends from the event loop on a connection of its own (no writer thread):
    the same group commit as from threads (each writer its previous binding, fewer script calls
    than writes, the callbacks in Redis's order), and it keeps working when Redis forgot the
    script or closed the connection; a Redis away or silent fails every writer, none hangs."""
    raw = redis.Redis.from_url(redis_server.url)

    def script_calls() -> int:
        stats = raw.info("commandstats")
        return sum(stats.get(f"cmdstat_{c}", {}).get("calls", 0) for c in ("evalsha", "eval"))

    async def body() -> None:
        store = Store(redis_server.url, prefix)
        writers = 48
        try:
            for i in range(writers):
                await store.record_async(Binding(f"l{i}", "n0", "", 1, 1, 1))
            before = script_calls()
            olds = await asyncio.gather(*(
                store.record_async(Binding(f"l{i}", f"n{1 + i % 3}", f"t{i}", 2, 1, 1))
                for i in range(writers)))
            assert [o.node_id if o else None for o in olds] == ["n0"] * writers
            assert script_calls() - before < writers, "no two writes shared a round trip"
            assert not raw.smembers(f"{prefix}node:n0:sandboxes") & {
                f"l{i}".encode() for i in range(writers)}
            for i in range(writers):
                node = f"n{1 + i % 3}"
                assert Binding.decode(f"l{i}", raw.hget(f"{prefix}bindings", f"l{i}").decode()) \
                    == Binding(f"l{i}", node, f"t{i}", 2, 1, 1)
                assert raw.sismember(f"{prefix}node:{node}:sandboxes", f"l{i}")
            applied: list[tuple[Binding | None, Binding]] = []

            async def race(i: int) -> None:
                binding = Binding("raced-on-loop", f"n{i}", "", i, 1, 1)
                await store.record_async(binding, lambda old: applied.append((old, binding)))

            await asyncio.gather(*(race(i) for i in range(writers)))
            assert len(applied) == writers and applied[0][0] is None
            for (_, before_binding), (old, _) in itertools.pairwise(applied):
                assert old == before_binding
            final = Binding.decode("raced-on-loop",
                                   raw.hget(f"{prefix}bindings", "raced-on-loop").decode())
            assert applied[-1][1] == final
            # Redis lost its scripts (a restart, SCRIPT FLUSH): the body goes again
            raw.script_flush()
            old = await store.record_async(Binding("l0", "n7", "", 3, 1, 1))
            assert old is not None and old.node_id == "n1"
            # Redis closed the writer's connection: the next write connects again
            for client in raw.client_list():
                if client["cmd"] in ("evalsha", "eval"):
                    raw.client_kill_filter(_id=client["id"])
            old = await store.record_async(Binding("l0", "n8", "", 4, 1, 1))
            assert old is not None and old.node_id == "n7"
            assert raw.sismember(f"{prefix}node:n8:sandboxes", "l0")
        finally:
            store.close()

        away = Store(f"unix://{tmp_path / 'no-redis.sock'}", prefix)
        try:
            outcomes = await asyncio.wait_for(asyncio.gather(*(
                away.record_async(Binding(f"l{i}", "n1", "", 1, 1, 1)) for i in range(16)),
                return_exceptions=True), 30)
            assert all(isinstance(o, RedisError) for o in outcomes), outcomes
        finally:
            away.close()

        # A Redis that takes the connection and never answers: the store's timeout, each time.
        async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            await reader.read(1 << 20)
            await asyncio.sleep(30)

        mute = await asyncio.start_unix_server(silent, str(tmp_path / "mute.sock"))
        stalled = Store(f"unix://{tmp_path / 'mute.sock'}", prefix, timeout=0.3)
        try:
            for _ in range(2):
                outcomes = await asyncio.wait_for(asyncio.gather(*(
                    stalled.record_async(Binding(f"l{i}", "n1", "", 1, 1, 1)) for i in range(4)),
                    return_exceptions=True), 10)
                assert all(isinstance(o, RedisError) for o in outcomes), outcomes
        finally:
            stalled.close()
            mute.close()

    try:
        run(body())
    finally:
        raw.close()


def test_the_loop_writer_connects_to_plain_urls_only() -> None:
    """A unix socket or plain TCP (with the login, the URL's winning as in redis-py); TLS or
    socket options in the URL: the writer thread and redis-py, which know them."""
    assert _loop_target("unix:///run/r.sock", RedisAuth("scheduler", "pw")) == {
        "path": "/run/r.sock", "username": "scheduler", "password": "pw"}
    assert _loop_target("redis://u:p@h:1/2", RedisAuth("scheduler", "pw")) == {
        "host": "h", "port": 1, "db": 2, "username": "u", "password": "p"}
    assert _loop_target("rediss://h:1/0", RedisAuth()) is None
    assert _loop_target("redis://h:1/0?socket_timeout=3", RedisAuth()) is None


def test_holders(redis_server: RedisServer, prefix: str) -> None:
    """Holders answers from the heartbeats' blob lists: up nodes with a layer address, the
    asker left out, whole holders first; a restarted scheduler knows them from Redis."""
    a, b, c = ("sha256:" + ch * 64 for ch in "abc")

    def blobs(node: str, whole: list[str], partial: list[str], p2p: str = "") -> pb.NodeStatus:
        msg = status(node)
        msg.layer_address = p2p or f"127.0.0.1:{9100 + int(node[1:])}"
        msg.blobs.extend(whole)
        msg.partial_blobs.extend(partial)
        return msg

    async def body() -> None:
        async with scheduler(redis_server.url, prefix, heartbeat_interval_s=0.2,
                             missed_heartbeats=1) as (_, client):
            await client.heartbeat(blobs("n1", [a], [b]))
            await client.heartbeat(blobs("n2", [], [a]))
            no_p2p = blobs("n3", [a, b], [])
            no_p2p.layer_address = ""
            await client.heartbeat(no_p2p)
            got = await client.holders([a, b, c], node_id="n3")
            assert [(h.node_id, h.complete) for h in got[a]] == [("n1", True), ("n2", False)]
            assert got[a][0].layer_address == "127.0.0.1:9101"
            assert [h.node_id for h in got[b]] == ["n1"] and got[c] == []
            assert [h.node_id for h in (await client.holders([a], node_id="n1"))[a]] == ["n2"]
            # a node the scheduler never heard from is told of no holder
            assert (await client.holders([a, b], node_id="n9")) == {a: [], b: []}
            # n1 now holds b whole and no longer a: the index follows the difference.
            await client.heartbeat(blobs("n1", [b], []))
            got = await client.holders([a, b], node_id="n3")
            assert [h.node_id for h in got[a]] == ["n2"]
            assert [(h.node_id, h.complete) for h in got[b]] == [("n1", True)]
            # n2 stops heartbeating: down after 1.5 intervals, and no longer offered.
            for _ in range(8):
                await asyncio.sleep(0.1)
                await client.heartbeat(blobs("n1", [b], []))
            assert (await client.holders([a], node_id="n1"))[a] == []
            with pytest.raises(SchedulerError) as caught:
                await client.holders(["sha256:xyz"])
            assert "is not sha256:<64 lowercase hex>" in caught.value.details
        async with scheduler(redis_server.url, prefix) as (_, client):
            await client.heartbeat(blobs("n3", [], []))
            got = await client.holders([b], node_id="n3")
            assert [(h.node_id, h.complete) for h in got[b]] == [("n1", True)]

    asyncio.run(body())


def test_holder_index_spreads_and_diffs() -> None:
    index = HolderIndex()
    for n in range(10):
        index.update(f"n{n}", ["sha256:x"] if n < 4 else [], ["sha256:x"] if n >= 4 else [])
    firsts = set()
    for _ in range(8):
        got = index.holders("sha256:x", limit=3)
        assert len(got) == 3 and all(complete for _, complete in got)
        firsts.add(got[0][0])
    assert len(firsts) == 4  # the askers start at different whole holders
    got = index.holders("sha256:x", limit=20)
    assert [c for _, c in got] == [True] * 4 + [False] * 6
    for n in range(10):
        index.forget(f"n{n}")
    assert len(index) == 0 and index.holders("sha256:x") == []
