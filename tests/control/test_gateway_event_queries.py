"""The cluster's event store (control/gateway/events.py) on a real Debian redis-server: each
filter of `GET /events/sandboxes` reads the stream that holds just what it lists (a type's, a
sandbox's), pages by offset and by cursor as a plain filter of every event would, and events
stored before the type streams existed are still found; one gateway's wake reaches another's
webhook workers through Redis."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis

from agentenv.control.gateway.events import ClusterEvents, team_stream
from agentenv.control.gateway.metrics import GatewayMetrics
from agentenv.node.events import Event
from agentenv.node.events_api import EventQuery
from tests.control.conftest import AclRedis, RedisServer
from tests.node.test_events import Receiver

pytestmark = pytest.mark.timeout(120)

CREATED, KILLED, FAILED, BUILD = ("sandbox.lifecycle.created", "sandbox.lifecycle.killed",
                                  "sandbox.lifecycle.failed", "template.build.started")


def kind_of(i: int) -> str:
    return FAILED if i % 101 == 0 else BUILD if i % 53 == 0 else (CREATED, KILLED)[i % 2]


def doc(team: str, i: int) -> dict[str, Any]:
    event = Event(type=kind_of(i), team=team, sandbox_id=f"sb{i % 25}", node_id="node0",
                  timestamp=time.time())
    event.seq = i + 1
    return event.to_json() | {"ts": event.timestamp}


class Counting:
    """The gateway's Redis, counting the stream entries its XRANGE/XREVRANGE calls return."""

    def __init__(self, redis: aioredis.Redis) -> None:
        self.redis = redis
        self.read = 0

    def __getattr__(self, name: str) -> Any:
        return getattr(self.redis, name)

    def _counted(self, call: Callable[..., Awaitable[list[Any]]]) -> Callable[..., Any]:
        async def counted(*args: Any, **kwargs: Any) -> list[Any]:
            found = await call(*args, **kwargs)
            self.read += len(found)
            return found
        return counted

    @property
    def xrange(self) -> Callable[..., Any]:
        return self._counted(self.redis.xrange)

    @property
    def xrevrange(self) -> Callable[..., Any]:
        return self._counted(self.redis.xrevrange)


def run(redis_server: RedisServer,
        body: Callable[[ClusterEvents, Counting], Awaitable[None]]) -> None:
    """`body` with a gateway's event store on the test Redis (and no node)."""
    async def main() -> None:
        redis = aioredis.Redis.from_url(redis_server.url, decode_responses=True)
        counting = Counting(redis)

        async def no_nodes() -> list[Any]:
            return []

        try:
            async with httpx.AsyncClient() as http:
                events = ClusterEvents(counting, no_nodes, http,  # type: ignore[arg-type]
                                       lambda node: [], lambda request: asyncio.sleep(0, b""),
                                       GatewayMetrics())
                await body(events, counting)
        finally:
            await redis.aclose()

    asyncio.run(main())


async def fill(events: ClusterEvents, team: str, count: int, node: str | None = None) -> None:
    """`count` events of `team` appended as the collector appends a node's pages."""
    node = node or f"node-{uuid.uuid4().hex[:8]}"
    assert await events._leased(f"aenv:events:lease:{node}")
    for first in range(0, count, 500):
        page = [doc(team, i) for i in range(first, min(first + 500, count))]
        assert await events.append(node, first, page) == len(page)


def q(**kw: Any) -> EventQuery:
    return EventQuery(**{"types": [], "after": 0, "offset": 0, "limit": 100,
                         "ascending": False, "before": 0, **kw})


async def everything(events: ClusterEvents, team: str) -> list[Event]:
    found: list[Event] = []
    while True:
        page = await events.query(team, None, q(types=[CREATED, KILLED, FAILED, BUILD],
                                                ascending=True, after=found[-1].seq
                                                if found else 0))
        found += page
        if len(page) < 100:
            return found


def test_a_type_filter_reads_only_that_types_events(redis_server: RedisServer) -> None:
    run(redis_server, _a_type_filter_reads_only_that_types_events)


async def _a_type_filter_reads_only_that_types_events(events: ClusterEvents, counting: Counting) -> None:
    """Before the type streams, `types=` walked the team's whole stream: for a type that is
    1 event in 100, a page of 10 read 1000 entries. Now it reads the type's stream."""
    team = f"t{uuid.uuid4().hex[:8]}"
    await fill(events, team, 2000)
    counting.read = 0
    found = await events.query(team, None, q(types=[FAILED], limit=10))
    assert [e.type for e in found] == [FAILED] * 10
    assert counting.read <= 10, counting.read
    counting.read = 0
    found = await events.query(team, None, q(types=[FAILED, BUILD], limit=30))
    assert {e.type for e in found} == {FAILED, BUILD} and len(found) == 30
    assert counting.read <= 2 * 30, counting.read
    counting.read = 0
    found = await events.query(team, "sb3", q(limit=100))
    assert {e.sandbox_id for e in found} == {"sb3"} and len(found) == 2000 // 25 - 2
    assert counting.read <= 2000 // 25, counting.read


def test_filters_and_cursor_paging_answer_what_a_scan_would(redis_server: RedisServer) -> None:
    run(redis_server, _filters_and_cursor_paging_answer_what_a_scan_would)


async def _filters_and_cursor_paging_answer_what_a_scan_would(events: ClusterEvents, counting: Counting) -> None:
    team = f"t{uuid.uuid4().hex[:8]}"
    await fill(events, team, 1200)
    every = await everything(events, team)
    assert len(every) == 1200 and [e.seq for e in every] == sorted(e.seq for e in every)
    for types in ([], [FAILED], [KILLED, FAILED], [CREATED, BUILD, FAILED]):
        for sandbox in (None, "sb4"):
            want = [e for e in every
                    if (e.type in types if types else not e.type.startswith("template."))
                    and (sandbox is None or e.sandbox_id == sandbox)]
            for ascending in (True, False):
                ordered = [e.id for e in (want if ascending else want[::-1])]
                for offset, limit in ((0, 100), (7, 13), (max(len(want) - 3, 0), 10)):
                    got = await events.query(team, sandbox, q(
                        types=types, ascending=ascending, offset=offset, limit=limit))
                    assert [e.id for e in got] == ordered[offset:offset + limit]
                walked: list[Event] = []
                while True:  # by cursor: after (ascending), before (descending)
                    last = walked[-1].seq if walked else 0
                    page = await events.query(team, sandbox, q(
                        types=types, ascending=ascending, limit=17,
                        after=last if ascending else 0, before=0 if ascending else last))
                    walked += page
                    if len(page) < 17:
                        break
                assert [e.id for e in walked] == ordered, (types, sandbox, ascending)


def test_events_stored_before_the_type_streams_are_still_found(redis_server: RedisServer) -> None:
    run(redis_server, _events_stored_before_the_type_streams_are_still_found)


async def _events_stored_before_the_type_streams_are_still_found(events: ClusterEvents, counting: Counting) -> None:
    """A cluster upgraded with events in Redis: those are only in the team's stream (no type
    stream, no `typed` mark); a type filter finds them, then the newer ones, in order."""
    team = f"t{uuid.uuid4().hex[:8]}"
    base = int(time.time() * 1000) * 1000 - 10_000_000
    for i in range(300):  # as the old collector wrote them
        body = doc(team, i)
        seq = base + i * 1000
        await events.redis.xadd(team_stream(team), {"e": json.dumps(body), "n": i + 1},
                                id=f"{seq // 1000}-{seq % 1000}")
    await events.redis.hset("aenv:events:seq", team, str(base + 299_000))
    await events.redis.hset("aenv:events:count", team, "300")
    old_failed = [i for i in range(300) if kind_of(i) == FAILED]
    assert len(await events.query(team, None, q(types=[FAILED]))) == len(old_failed)
    await fill(events, team, 600)
    want = old_failed + [i for i in range(600) if kind_of(i) == FAILED]
    for ascending in (True, False):
        for limit in (1, 2, 100):
            got = await events.query(team, None, q(types=[FAILED], ascending=ascending,
                                                   limit=limit))
            assert len(got) == min(limit, len(want))
        got = await events.query(team, None, q(types=[FAILED, KILLED], ascending=ascending))
        seqs = [e.seq for e in got]
        assert seqs == sorted(seqs, reverse=not ascending) and len(set(seqs)) == len(seqs)
    every = await events.query(team, None, q(types=[FAILED], ascending=True))
    assert len(every) == len(want)
    assert every[len(old_failed) - 1].seq < every[len(old_failed)].seq


def test_one_gateways_announcement_wakes_anothers_workers(tmp_path: Path) -> None:
    """Two gateways on a Redis with cluster-up's ACL (the gateway's user may use the wake
    channel, scripts/redis-acl.sh): the one that appended a team's events wakes the other's
    idle workers of that team, and only those, within moments (its poll is 60 s)."""
    server = AclRedis(tmp_path)
    server.start()

    async def main() -> None:
        clients = [aioredis.Redis.from_url(server.url, decode_responses=True,
                                           **server.auth("gateway").connect_kwargs())
                   for _ in range(2)]

        async def no_nodes() -> list[Any]:
            return []

        async with httpx.AsyncClient() as http:
            one, other = (ClusterEvents(c, no_nodes, http, lambda node: [],
                                        lambda request: asyncio.sleep(0, b""), GatewayMetrics())
                          for c in clients)
            assert other.poll == 60
            listening = asyncio.create_task(other._listen_forever())
            try:
                mine, theirs = other._signal("alpha"), other._signal("beta")
                # subscribed: the listener wakes everything once as it (re)subscribes
                await asyncio.wait_for(mine.wait(), 10)
                mine, theirs = other._signal("alpha"), other._signal("beta")
                assert not mine.is_set()
                began = time.monotonic()
                await one._announce(["alpha"])
                await asyncio.wait_for(mine.wait(), 10)
                assert time.monotonic() - began < 10 and not theirs.is_set()
                hooks = other._hooks_changed
                hooks.clear()
                await one._announce(hooks=True)
                await asyncio.wait_for(hooks.wait(), 10)
            finally:
                listening.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await listening
                for client in clients:
                    await client.aclose()

    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("AENV_GATEWAY_EVENTS_POLL", "60")
            asyncio.run(main())
    finally:
        server.stop()


def test_a_webhook_of_a_rare_type_reads_only_that_types_events(
        redis_server: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    """A webhook's worker reads the streams of the types it wants: a webhook of `failed`
    events posts the team's 19 among 2000 (to a real receiver) having read about those 19
    entries, where it walked all 2000 before."""
    monkeypatch.setenv("AENV_WEBHOOK_ALLOW_PRIVATE", "1")
    monkeypatch.setenv("AENV_WEBHOOK_QUEUE", "5000")  # not behind: nothing skipped
    receiver = Receiver()

    async def body(events: ClusterEvents, counting: Counting) -> None:
        team, hook_id = f"t{uuid.uuid4().hex[:8]}", str(uuid.uuid4())
        await fill(events, team, 10)  # the team's streams exist before the webhook
        seq = int(await events.redis.hget("aenv:events:seq", team))
        await events.redis.hset(f"aenv:events:hook:{hook_id}", mapping={
            "team": team, "cursor": seq, "cursor_n": 10, "queued": 0, "dropped": 0,
            "doc": json.dumps({"id": hook_id, "team": team, "name": "", "url": receiver.url,
                               "events": [FAILED], "enabled": True, "secret": "s",
                               "created_at": time.time()})})
        assert await events._leased(f"aenv:events:hooklease:{hook_id}")
        await fill(events, team, 2000)
        want = [i for i in range(2000) if kind_of(i) == FAILED]
        counting.read = 0
        async with httpx.AsyncClient() as client:
            while await events._deliver_batch(client, hook_id):
                pass
        got = [json.loads(b) for _, b in receiver.requests]
        assert [b["type"] for b in got] == [FAILED] * len(want) and len(want) == 20
        assert counting.read <= len(want) + 1, counting.read

    try:
        run(redis_server, body)
    finally:
        receiver.close()
