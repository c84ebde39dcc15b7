"""A cluster's lifecycle events and webhooks, in its Redis, answered and delivered by the gateway.

Nodes hold no Redis credential, so the gateways collect: each gateway runs a collector that,
for every node that is up, takes the node's lease in Redis (one collector per node at a time,
whatever the number of gateways), asks the node for every team's events after the node's
cursor (`GET /cluster/events?after=&wait=`, node/events_api.py, with the node's key and no
team; a long poll) and
appends them to the streams of their teams. One Lua script checks the lease and that the cursor
is still the one read, appends and advances the cursor: a batch is in Redis once, with its
cursor, or not at all, so a gateway killed at any point (or two gateways racing for a node)
neither loses nor repeats an event. A node whose store was made anew (its last seq below the
cursor) is read again from its start.

Each event gets a cluster-wide `seq` for its team: max(last + 1, now in ms x 1000), so it is
both increasing and a time (the stream entry id is `seq // 1000`-`seq % 1000`, which retention
trims by: XADD MINID), and stays below 2**53 (exact in JSON for JavaScript) until 2255.
`GET /events/sandboxes[/{id}]` answers from these streams the node's JSON, filters and paging
(EventQuery: `after` is this seq), for the caller's team only.

Events are pushed, not polled: the collector's request is a long poll (`wait=`) that the node
answers as soon as it stores an event, and the collector that appended a batch wakes the
workers of its teams' webhooks, its own at once and the other gateways' through a Redis
PUBLISH (WAKE_CHANNEL) that each gateway listens to. AENV_GATEWAY_EVENTS_POLL is only the
fallback of a worker that no wake reached, and (with a third of the lease, whichever is less)
how often the leases are renewed and the node list and webhook set read again.

Webhooks (`/events/webhooks`) are a team's, in Redis; the gateways deliver them (a node of a
cluster registers none: node/events_api.py). Each gateway's supervisor takes the lease of each
webhook it can (at once for a webhook just made: it is announced on the channel too) and runs
a worker per webhook held, which reads the streams of the types it wants after the webhook's
cursor, merged (the team's stream for events stored before there were type streams), and posts
each wanted event with the node's signing and retries (node/webhooks.py `deliver`), logging
every attempt (`/events/webhooks/{id}/deliveries`), then waits for its team's next wake. A
worker's cursor advances after each event, so a gateway that dies mid-delivery makes the next
one post that event again, with the same `e2b-delivery-id` (at least once). A slow or dead
receiver holds only its own worker; one more than AENV_WEBHOOK_QUEUE events of its team behind
skips to the newest ones (counted in `dropped`).

Keys (prefix `aenv:events:`; the gateway's ACL, scripts/redis-acl.sh): `team:{team}`,
`sandbox:{team}:{id}` and `type:{team}:{type}` (streams, entry fields `e` the event, `n` the
team's event count; each event is in its team's, its sandbox's and its type's, under the same
entry id, so each filter of the list reads only what it lists), `seq` and `count` (hashes:
team -> last seq, event count), `typed` (hash: team -> its first seq in the type streams;
older events are only in the team's), `cursor:{node}`, `lease:{node}`,
`hooks` (set of every webhook id), `hooks:{team}` (set), `hook:{id}` (hash: doc, cursor,
cursor_n, queued, dropped), `hooklease:{id}`, `attempts:{id}` (stream); the channel `wake`.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import secrets
import time
import uuid
from collections.abc import AsyncGenerator, Awaitable, Callable, Iterable
from typing import Any

import httpx
import redis.asyncio as aioredis
import redis.exceptions
from starlette.requests import Request

from agentenv import boundedjson
from agentenv.api import event_models as em
from agentenv.api.bodies import parse_model
from agentenv.api.errors import ApiError as NodeApiError
from agentenv.api.errors import BadRequest, NotFound
from agentenv.api.event_models import TEMPLATE_PREFIX, TYPES
from agentenv.api.models import iso
from agentenv.api.routes import CLUSTER_EVENTS_PATH
from agentenv.api.tenancy import TEAM_NAME
from agentenv.control.gateway.metrics import GatewayMetrics
from agentenv.control.gateway.placement import Node
from agentenv.control.gateway.store import StoreUnavailable
from agentenv.errors import AgentEnvError
from agentenv.node.events import Event, retention_from_env
from agentenv.node.events_api import (
    MAX_ATTEMPTS_PAGE,
    MAX_CLUSTER_WAIT,
    EventQuery,
    query_int,
)
from agentenv.node.webhooks import (
    MAX_WEBHOOKS_PER_TEAM,
    DeliveryPolicy,
    check_destination,
    deliver,
)
from agentenv.relay.stream import Send
from agentenv.settings import get_settings, setting_text

log = logging.getLogger("agentenv.control.gateway.events")

K = "aenv:events:"
POLL_ENV = "AENV_GATEWAY_EVENTS_POLL"
LEASE_ENV = "AENV_GATEWAY_EVENTS_LEASE"
#: a PUBLISH channel: {"teams": [...], "hooks": bool}, teams with new events, webhooks changed
WAKE_CHANNEL = f"{K}wake"
#: events asked of a node at once, and pages of one node per round
NODE_PAGE = 500
NODE_PAGES_PER_ROUND = 20
STREAM_CHUNK = 200
ATTEMPTS_KEPT = 1000

#: take or renew a lease (KEYS[1]) for ARGV[1] (ms ARGV[2]); 1 when held
_LEASE = """
local held = redis.call('get', KEYS[1])
if not held then redis.call('set', KEYS[1], ARGV[1], 'PX', ARGV[2]) return 1 end
if held == ARGV[1] then redis.call('pexpire', KEYS[1], ARGV[2]) return 1 end
return 0
"""
_RELEASE = "if redis.call('get', KEYS[1]) == ARGV[1] then return redis.call('del', KEYS[1]) end"
#: a webhook's new doc, unless it was deleted meanwhile (0)
_REPLACE = "if redis.call('exists', KEYS[1]) == 1 then redis.call('hset', KEYS[1], 'doc', " \
    "ARGV[1]) return 1 end return 0"
#: a new webhook's place in its team's set, while the team has fewer than ARGV[2] (0: full).
#: One script, so that creates sent at once cannot all pass the count
_RESERVE = "if redis.call('scard', KEYS[1]) >= tonumber(ARGV[2]) then return 0 end " \
    "return redis.call('sadd', KEYS[1], ARGV[1])"
#: append a node's batch. KEYS: lease, cursor, seq hash, count hash, typed hash, then per
#: event its team's stream, its sandbox's (or the team's again) and its type's. ARGV: mark,
#: cursor read, new cursor, retention ms, then per event team, '1' when it has a sandbox, doc.
#: -1: lease lost; -2: the cursor moved (another collector did this batch)
_APPEND = """
if redis.call('get', KEYS[1]) ~= ARGV[1] then return -1 end
if (redis.call('get', KEYS[2]) or '0') ~= ARGV[2] then return -2 end
local t = redis.call('time')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local minid = string.format('%.0f', math.max(now - tonumber(ARGV[4]), 0))
local n = (#ARGV - 4) / 3
for i = 0, n - 1 do
  local team, has, doc = ARGV[5 + 3 * i], ARGV[6 + 3 * i], ARGV[7 + 3 * i]
  local seq = math.max(tonumber(redis.call('hget', KEYS[3], team) or '0') + 1, now * 1000)
  redis.call('hset', KEYS[3], team, string.format('%.0f', seq))
  redis.call('hsetnx', KEYS[5], team, string.format('%.0f', seq))
  local count = redis.call('hincrby', KEYS[4], team, 1)
  local id = string.format('%.0f-%.0f', math.floor(seq / 1000), seq % 1000)
  redis.call('xadd', KEYS[6 + 3 * i], 'MINID', '~', minid, id, 'e', doc, 'n', count)
  if has == '1' then
    redis.call('xadd', KEYS[7 + 3 * i], 'MINID', '~', minid, id, 'e', doc, 'n', count)
    redis.call('pexpire', KEYS[7 + 3 * i], ARGV[4])
  end
  redis.call('xadd', KEYS[8 + 3 * i], 'MINID', '~', minid, id, 'e', doc, 'n', count)
  redis.call('pexpire', KEYS[8 + 3 * i], ARGV[4])
end
redis.call('set', KEYS[2], ARGV[3])
return n
"""
#: a webhook worker's progress (ARGV: mark, seq, the team's count at it, queued, dropped),
#: only while it holds the lease and the webhook exists
_ADVANCE = """
if redis.call('get', KEYS[1]) ~= ARGV[1] or redis.call('exists', KEYS[2]) == 0 then return 0 end
redis.call('hset', KEYS[2], 'cursor', ARGV[2], 'cursor_n', ARGV[3], 'queued', ARGV[4])
if ARGV[5] ~= '0' then redis.call('hincrby', KEYS[2], 'dropped', ARGV[5]) end
return 1
"""


def seconds_setting(name: str, default: float, low: float, high: float) -> float:
    raw = setting_text(name).strip()
    try:
        value = float(raw) if raw else default
    except ValueError:
        value = -1.0
    if not low <= value <= high:
        raise AgentEnvError(f"{name} must be {low:g}-{high:g} seconds, got {raw!r}")
    return value


def stream_id(seq: int) -> str:
    return f"{seq // 1000}-{seq % 1000}"


def seq_of(entry_id: str) -> int:
    ms, _, part = entry_id.partition("-")
    return int(ms) * 1000 + int(part)


def team_stream(team: str) -> str:
    return f"{K}team:{team}"


def sandbox_stream(team: str, sandbox_id: str) -> str:
    return f"{K}sandbox:{team}:{sandbox_id}"


def type_stream(team: str, kind: str) -> str:
    return f"{K}type:{team}:{kind}"


def _event(entry_id: str, fields: dict[str, str]) -> Event:
    return Event.from_doc(seq_of(entry_id), fields["e"])


class ClusterEvents:
    """The gateway's collector, events routes and webhook delivery (module doc)."""

    def __init__(self, redis: aioredis.Redis, nodes: Callable[[], Awaitable[list[Node]]],
                 http: httpx.AsyncClient,
                 node_headers: Callable[[Node], list[tuple[bytes, bytes]]],
                 read_body: Callable[[Request], Awaitable[bytes]],
                 metrics: GatewayMetrics) -> None:
        self.redis = redis
        self.metrics = metrics
        self.nodes = nodes
        self.http = http
        self.node_headers = node_headers
        self.read_body = read_body
        self.retention = retention_from_env()
        self.poll = seconds_setting(POLL_ENV, 1.0, 0.05, 60)
        self.lease = seconds_setting(LEASE_ENV, 15.0, 1, 300)
        self.policy = DeliveryPolicy.from_env()
        self.allow_private = get_settings().webhook_allow_private
        self.mark = secrets.token_hex(8)  # this gateway's name on its leases
        self._append = redis.register_script(_APPEND)
        self._take = redis.register_script(_LEASE)
        self._release = redis.register_script(_RELEASE)
        self._advance = redis.register_script(_ADVANCE)
        self._replace = redis.register_script(_REPLACE)
        self._reserve = redis.register_script(_RESERVE)
        #: how often leases are renewed (and the node list and webhook set read again)
        self.renew = min(self.poll, self.lease / 3)
        #: how long a long poll of a node's events waits for its next event
        self.wait = max(1, min(int(self.lease / 3), MAX_CLUSTER_WAIT))
        self._held: set[str] = set()  # lease keys this gateway holds
        self._workers: dict[str, asyncio.Task[None]] = {}
        self._tasks: list[asyncio.Task[None]] = []
        self._nodes: dict[str, Node] = {}  # the up nodes, by id, each with a collecting task
        self._collectors: dict[str, asyncio.Task[None]] = {}
        #: per team, what its idle webhook workers here wait on (wake() sets and drops it)
        self._signals: dict[str, asyncio.Event] = {}
        self._hooks_changed = asyncio.Event()

    # --- life ----------------------------------------------------------------------------

    async def start(self) -> None:
        if not self.retention:  # AENV_EVENTS_RETENTION_DAYS=0: none kept, none delivered
            return
        self._tasks = [asyncio.create_task(self._collect_forever(), name="events-collector"),
                       asyncio.create_task(self._supervise_forever(), name="webhooks"),
                       asyncio.create_task(self._listen_forever(), name="events-wakes")]

    async def stop(self) -> None:
        for task in [*self._tasks, *self._workers.values(), *self._collectors.values()]:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks, self._workers, self._collectors = [], {}, {}
        # another gateway takes over at once, not after the lease lapses (a Redis that does
        # not answer does not hold the gateway's exit: the leases lapse then)
        with contextlib.suppress(Exception):
            async with asyncio.timeout(2):
                for key in list(self._held):
                    await self._release(keys=[key], args=[self.mark])
        self._held.clear()

    async def _leased(self, key: str) -> bool:
        held = bool(await self._take(keys=[key], args=[self.mark, int(self.lease * 1000)]))
        (self._held.add if held else self._held.discard)(key)
        return held

    # --- wakes ---------------------------------------------------------------------------

    def _signal(self, team: str) -> asyncio.Event:
        """What a worker of `team`'s webhooks waits on once it found nothing to post; taken
        before it reads, so an event appended meanwhile is not slept through."""
        signal = self._signals.get(team)
        if signal is None:
            signal = self._signals[team] = asyncio.Event()
        return signal

    def _wake(self, teams: list[str]) -> None:
        for team in teams:
            signal = self._signals.pop(team, None)
            if signal is not None:
                signal.set()

    async def _announce(self, teams: Iterable[str] = (), hooks: bool = False) -> None:
        """Tell this gateway's workers and every other gateway's (Redis PUBLISH) that
        `teams` have new events, or that the webhooks changed (`hooks`). Best effort: a wake
        that is lost costs one `AENV_GATEWAY_EVENTS_POLL`, the workers' fallback."""
        self._wake(list(teams))
        if hooks:
            self._hooks_changed.set()
        with contextlib.suppress(redis.exceptions.RedisError, OSError):
            await self.redis.publish(WAKE_CHANNEL, json.dumps({"teams": sorted(teams),
                                                               "hooks": hooks}))

    async def _listen_forever(self) -> None:
        """Wake this gateway's workers on the other gateways' announcements."""
        while True:
            pubsub = self.redis.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(WAKE_CHANNEL)
                # whatever was announced while not subscribed: look now
                self._wake(list(self._signals))
                self._hooks_changed.set()
                while True:
                    message = await pubsub.get_message(timeout=5.0)
                    if message is None or message.get("type") != "message":
                        continue
                    try:
                        said = json.loads(message["data"])
                        teams = [t for t in said.get("teams", []) if isinstance(t, str)]
                    except (ValueError, TypeError, AttributeError):
                        continue
                    self._wake(teams)
                    if said.get("hooks"):
                        self._hooks_changed.set()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                # (a Redis whose ACL predates the channel: NOPERM, scripts/redis-acl.sh)
                log.warning("event wakes of other gateways not heard (their teams' workers "
                            "here look each AENV_GATEWAY_EVENTS_POLL s meanwhile): %s", exc)
                await asyncio.sleep(max(self.renew, 10))
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()

    # --- the collector -------------------------------------------------------------------

    async def _collect_forever(self) -> None:
        """One collecting task per node that is up (`_collect_node`); the node list is read
        again each `renew` seconds."""
        try:
            while True:
                try:
                    self._nodes = {n.node_id: n for n in await self.nodes() if n.up}
                    for node_id in set(self._collectors) - set(self._nodes):
                        self._collectors.pop(node_id).cancel()
                    for node_id in self._nodes:
                        task = self._collectors.get(node_id)
                        if task is None or task.done():
                            self._collectors[node_id] = asyncio.create_task(
                                self._collect_node(node_id), name=f"events:{node_id}")
                except Exception as exc:
                    log.warning("event collection failed: %s", exc)
                await asyncio.sleep(self.renew)
        finally:
            for task in self._collectors.values():
                task.cancel()

    async def _collect_node(self, node_id: str) -> None:
        """Collect a node's events for as long as it is up: a long poll (`wait`) that the node
        answers as soon as it stores an event, so an event is in Redis, and its team's workers
        woken, a moment after the node recorded it. Without the node's lease (another gateway
        collects it) the lease is tried again each `renew` seconds."""
        while node_id in self._nodes:
            node = self._nodes[node_id]
            began = time.monotonic()
            try:
                moved = await self.collect(node, wait=self.wait)
            except Exception as exc:
                log.info("events not collected from a node",
                         extra={"node": node_id, "error": str(exc)})
                await asyncio.sleep(self.renew)
                continue
            if f"{K}lease:{node_id}" not in self._held:
                await asyncio.sleep(self.renew)
            elif not moved and time.monotonic() - began < self.wait / 2:
                await asyncio.sleep(self.poll)  # a node that does not wait (an older one)

    async def collect(self, node: Node, wait: float = 0) -> int:
        """Move `node`'s new events into Redis, if this gateway holds its lease; how many.
        `wait`: when it has none, the node answers once it has (or after `wait` s)."""
        lease, cursor_key = f"{K}lease:{node.node_id}", f"{K}cursor:{node.node_id}"
        if not await self._leased(lease):
            return 0
        moved = 0
        for _ in range(NODE_PAGES_PER_ROUND):
            cursor = int(await self.redis.get(cursor_key) or 0)
            answer = await self.http.get(node.url + CLUSTER_EVENTS_PATH, timeout=30 + wait,
                                         params={"after": cursor, "limit": NODE_PAGE,
                                                 "wait": int(wait)},
                                         headers=self.node_headers(node))
            wait = 0  # the next pages are there already
            answer.raise_for_status()
            page = answer.json()
            events, last = page["events"], int(page["last"])
            if not events and last < cursor:
                log.warning("a node's events start again (its store was made anew)",
                            extra={"node": node.node_id, "cursor": cursor, "last": last})
                await self._append(keys=[lease, cursor_key, f"{K}seq", f"{K}count",
                                         f"{K}typed"],
                                   args=[self.mark, str(cursor), "0", self._retention_ms()])
                continue
            if not events:
                return moved
            if await self.append(node.node_id, cursor, events) < 0:
                return moved  # the lease lapsed, or another collector did this batch
            await self._announce(list({e["sandboxTeamId"] for e in events}))
            moved += len(events)
            self.metrics.events_collected.inc(len(events))
            if len(events) < NODE_PAGE:
                return moved
        return moved

    async def append(self, node_id: str, cursor: int, events: list[dict[str, Any]]) -> int:
        """Append a page of a node's events (its `/cluster/events` JSON, read after `cursor`)
        to their teams' streams and move the node's cursor past them, while this gateway
        holds the node's lease and the cursor is still `cursor`; how many (< 0: neither)."""
        lease, cursor_key = f"{K}lease:{node_id}", f"{K}cursor:{node_id}"
        keys, args = [lease, cursor_key, f"{K}seq", f"{K}count", f"{K}typed"], [
            self.mark, str(cursor), str(events[-1]["seq"]), self._retention_ms()]
        for doc in events:
            team, sandbox = doc["sandboxTeamId"], doc["sandboxId"]
            if not TEAM_NAME.match(team):  # no team of the cluster's: nobody's to see
                team = "-"
            doc = {**doc, "nodeId": node_id, "nodeSeq": doc["seq"]}
            keys += [team_stream(team),
                     sandbox_stream(team, sandbox) if sandbox else team_stream(team),
                     type_stream(team, doc["type"] if doc["type"] in TYPES else "-")]
            args += [team, "1" if sandbox else "0", json.dumps(doc)]
        return int(await self._append(keys=keys, args=args))

    def _retention_ms(self) -> str:
        return str(int(self.retention * 1000))

    # --- reading -------------------------------------------------------------------------

    async def query(self, team: str, sandbox_id: str | None, q: EventQuery) -> list[Event]:
        """The team's events as the node's EventLog.query answers them, read off the stream
        that holds just what the filter asks: a sandbox's own stream, a type's (several types:
        their streams merged in seq order), else the team's. Only events appended before the
        type streams existed (`typed`: the team's first seq that has them) are looked for in
        the team's stream with a type filter."""
        after, before = q.after, q.before or None
        wanted = set(q.types)
        if sandbox_id is not None:
            parts = [([sandbox_stream(team, sandbox_id)], after, before)]
        elif not q.types:
            parts = [([team_stream(team)], after, before)]
        else:
            typed = int(await self.redis.hget(f"{K}typed", team) or 0)
            kinds = [type_stream(team, kind) for kind in dict.fromkeys(q.types)]
            if typed:
                new = (kinds, max(after, typed - 1), before)
                old = ([team_stream(team)], after, typed if before is None else min(before,
                                                                                    typed))
                parts = [old, new] if q.ascending else [new, old]
            else:
                parts = [([team_stream(team)], after, before)]
        skip, found = q.offset, []
        part: tuple[list[str], int, int | None]
        for part in parts:
            keys, low, high = part
            if high is not None and high <= low + 1:
                continue
            async for entry_id, fields in self._merged(keys, low, high, q.ascending,
                                                       skip + q.limit - len(found)):
                event = _event(entry_id, fields)
                if (event.type not in wanted) if wanted else event.type.startswith(
                        TEMPLATE_PREFIX):
                    continue
                if skip:
                    skip -= 1
                    continue
                found.append(event)
                if len(found) == q.limit:
                    return found
        return found

    async def _merged(self, keys: list[str], low: int, high: int | None, ascending: bool,
                      want: int) -> AsyncGenerator[tuple[str, dict[str, str]], None]:
        """The entries of the streams `keys` with low < seq < high (None: no bound), merged
        in seq order (descending unless `ascending`), read STREAM_CHUNK at a time (`want`
        at first, if fewer: no stream gives more than that to a page of `want`)."""
        bound_low = f"({stream_id(low)}" if low else "-"
        bound_high = f"({stream_id(high)}" if high else "+"
        heads: dict[str, list[tuple[str, dict[str, str]]]] = {}
        marks: dict[str, str] = {}  # where each stream's next chunk starts (exclusive)
        done: set[str] = set()

        async def refill(key: str) -> None:
            count = STREAM_CHUNK if key in marks else max(min(STREAM_CHUNK, want), 1)
            if ascending:
                chunk = await self.redis.xrange(key, marks.get(key, bound_low), bound_high,
                                                count=count)
            else:
                chunk = await self.redis.xrevrange(key, marks.get(key, bound_high), bound_low,
                                                   count=count)
            heads[key] = list(chunk)
            if len(chunk) < count:
                done.add(key)
            if chunk:
                marks[key] = f"({chunk[-1][0]}"

        for key in keys:
            await refill(key)
        while True:
            live = [k for k in keys if heads[k]]
            if not live:
                return
            pick = (min if ascending else max)(live, key=lambda k: seq_of(heads[k][0][0]))
            yield heads[pick].pop(0)
            if not heads[pick] and pick not in done:
                await refill(pick)

    # --- routes --------------------------------------------------------------------------

    def handlers(self) -> dict[str, Any]:
        """The operations of the route table (agentenv.api.routes) this serves (app.py)."""
        return {
            "listSandboxEvents": self.list_events, "listSandboxEventsOfSandbox": self.list_events,
            "listWebhooks": self.list_webhooks, "createWebhook": self.create_webhook,
            "getWebhook": self.get_webhook, "updateWebhook": self.update_webhook,
            "deleteWebhook": self.delete_webhook, "listWebhookDeliveries": self.deliveries,
        }

    @staticmethod
    async def _json(send: Send, status: int, body: Any) -> None:
        payload = json.dumps(body).encode()
        await send({"type": "http.response.start", "status": status, "headers": [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload})

    async def _answer(self, send: Send, work: Awaitable[tuple[int, Any]]) -> None:
        """Send what `work` answers (None: an empty body); the node's errors (the shared
        validation) as the node sends them; Redis away as the gateway's store being away."""
        try:
            status, body = await work
        except NodeApiError as exc:
            status, body = exc.status, {"code": exc.status, "message": exc.message}
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
            raise StoreUnavailable(f"Redis is unavailable: {exc}") from exc
        if body is None:
            await send({"type": "http.response.start", "status": status,
                        "headers": [(b"content-length", b"0")]})
            await send({"type": "http.response.body", "body": b""})
            return
        await self._json(send, status, body)

    async def list_events(self, request: Request, send: Send, team: str,
                          sandbox_id: str | None = None) -> None:
        async def work() -> tuple[int, Any]:
            q = EventQuery.parse(request)
            found = await self.query(team, sandbox_id, q)
            return 200, [em.SandboxEvent(**e.to_json()).body() for e in found]

        await self._answer(send, work())

    # --- webhooks: registration ----------------------------------------------------------

    async def _hook(self, team: str, webhook_id: str) -> dict[str, Any]:
        raw = await self.redis.hgetall(f"{K}hook:{webhook_id}")
        if not raw or raw.get("team") != team:
            raise NotFound(f"webhook {webhook_id!r} not found")
        return {**json.loads(raw["doc"]), "queued": int(raw.get("queued", 0)),
                "dropped": int(raw.get("dropped", 0))}

    @staticmethod
    def _public(hook: dict[str, Any]) -> dict[str, Any]:
        """E2B's webhook answer: never the secret."""
        return em.Webhook(id=hook["id"], teamID=hook["team"], name=hook["name"],
                          createdAt=iso(hook["created_at"]), enabled=hook["enabled"],
                          url=hook["url"], events=hook["events"], queued=hook["queued"],
                          dropped=hook["dropped"]).body()

    async def _body(self, request: Request) -> Any:
        raw = await self.read_body(request)
        if not raw.strip():
            raise BadRequest("request body is required")
        try:
            return boundedjson.loads(raw, "the request body")
        except (ValueError, UnicodeDecodeError) as exc:
            raise BadRequest(f"request body is not valid JSON: {exc}") from exc

    async def list_webhooks(self, request: Request, send: Send, team: str) -> None:
        async def work() -> tuple[int, Any]:
            hooks = []
            for webhook_id in await self.redis.smembers(f"{K}hooks:{team}"):
                with contextlib.suppress(NotFound):  # deleted meanwhile
                    hooks.append(await self._hook(team, webhook_id))
            hooks.sort(key=lambda h: (h["created_at"], h["id"]))
            return 200, [self._public(h) for h in hooks]

        await self._answer(send, work())

    async def create_webhook(self, request: Request, send: Send, team: str) -> None:
        async def work() -> tuple[int, Any]:
            body = parse_model(em.NewWebhook, await self._body(request))
            await asyncio.to_thread(check_destination, body.url, self.allow_private)
            hook = {"id": str(uuid.uuid4()), "team": team, "name": body.name, "url": body.url,
                    "events": list(dict.fromkeys(body.events)), "enabled": body.enabled,
                    "secret": body.signatureSecret, "created_at": time.time()}
            team_set = f"{K}hooks:{team}"
            if not await self._reserve(keys=[team_set], args=[hook["id"],
                                                              MAX_WEBHOOKS_PER_TEAM]):
                raise BadRequest(f"a team has at most {MAX_WEBHOOKS_PER_TEAM} webhooks")
            try:
                # deliveries start with the team's next event
                seq, count = await self._team_position(team)
                pipe = self.redis.pipeline()
                pipe.hset(f"{K}hook:{hook['id']}", mapping={
                    "team": team, "doc": json.dumps(hook), "cursor": seq, "cursor_n": count,
                    "queued": 0, "dropped": 0})
                pipe.sadd(f"{K}hooks", hook["id"])
                await pipe.execute()
            except BaseException:
                with contextlib.suppress(Exception):  # its place goes back
                    await self.redis.srem(team_set, hook["id"])
                raise
            await self._announce(hooks=True)  # a gateway takes it up now
            return 201, self._public({**hook, "queued": 0, "dropped": 0})

        await self._answer(send, work())

    async def _team_position(self, team: str) -> tuple[int, int]:
        seq, count = await self.redis.hget(f"{K}seq", team), await self.redis.hget(
            f"{K}count", team)
        return int(seq or 0), int(count or 0)

    async def get_webhook(self, request: Request, send: Send, team: str,
                          webhook_id: str) -> None:
        async def work() -> tuple[int, Any]:
            return 200, self._public(await self._hook(team, webhook_id))

        await self._answer(send, work())

    async def update_webhook(self, request: Request, send: Send, team: str,
                             webhook_id: str) -> None:
        async def work() -> tuple[int, Any]:
            hook = await self._hook(team, webhook_id)
            changes = parse_model(em.WebhookUpdate, await self._body(request)).model_dump(
                exclude_none=True)
            if "url" in changes:
                await asyncio.to_thread(check_destination, changes["url"], self.allow_private)
            for key in ("name", "url", "events", "enabled"):
                if key in changes:
                    hook[key] = changes[key]
            if "signatureSecret" in changes:
                hook["secret"] = changes["signatureSecret"]
            doc = {k: hook[k] for k in ("id", "team", "name", "url", "events", "enabled",
                                        "secret", "created_at")}
            if not await self._replace(keys=[f"{K}hook:{webhook_id}"], args=[json.dumps(doc)]):
                raise NotFound(f"webhook {webhook_id!r} not found")
            await self._announce([team])  # re-enabled: its worker looks now
            return 200, self._public(hook)

        await self._answer(send, work())

    async def delete_webhook(self, request: Request, send: Send, team: str,
                             webhook_id: str) -> None:
        async def work() -> tuple[int, Any]:
            await self._hook(team, webhook_id)
            pipe = self.redis.pipeline()
            pipe.delete(f"{K}hook:{webhook_id}", f"{K}attempts:{webhook_id}",
                        f"{K}hooklease:{webhook_id}")
            pipe.srem(f"{K}hooks:{team}", webhook_id)
            pipe.srem(f"{K}hooks", webhook_id)
            await pipe.execute()
            await self._announce(hooks=True)
            return 200, None

        await self._answer(send, work())

    async def deliveries(self, request: Request, send: Send, team: str,
                         webhook_id: str) -> None:
        """The webhook's delivery log, newest attempt first."""
        async def work() -> tuple[int, Any]:
            await self._hook(team, webhook_id)
            limit = query_int(request, "limit", 100, 1, MAX_ATTEMPTS_PAGE)
            found = await self.redis.xrevrange(f"{K}attempts:{webhook_id}", count=limit)
            return 200, [em.WebhookAttempt(**json.loads(f["a"])).body() for _, f in found]

        await self._answer(send, work())

    # --- webhooks: delivery --------------------------------------------------------------

    async def _supervise_forever(self) -> None:
        """Hold the lease of every webhook this gateway can, and a worker for each held."""
        while True:
            self._hooks_changed.clear()
            try:
                ids = sorted(await self.redis.smembers(f"{K}hooks"))
                for webhook_id in set(self._workers) - set(ids):  # deleted
                    self._stop_worker(webhook_id)
                pipe = self.redis.pipeline(transaction=False)  # one round trip for them all
                for webhook_id in ids:
                    await self._take(keys=[f"{K}hooklease:{webhook_id}"],
                                     args=[self.mark, int(self.lease * 1000)], client=pipe)
                for webhook_id, held in zip(ids, await pipe.execute(), strict=True):
                    key = f"{K}hooklease:{webhook_id}"
                    (self._held.add if held else self._held.discard)(key)
                    if held:
                        worker = self._workers.get(webhook_id)
                        if worker is None or worker.done():
                            self._workers[webhook_id] = asyncio.create_task(
                                self._deliver_forever(webhook_id), name=f"webhook:{webhook_id}")
                    else:
                        self._stop_worker(webhook_id)
            except Exception as exc:
                log.warning("webhook supervision failed: %s", exc)
            # the leases are renewed each `renew` s; a webhook made or deleted anywhere
            # announces itself (`_announce`) and is taken up (or its worker stopped) at once
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._hooks_changed.wait(), self.renew)
            self._hooks_changed.clear()

    def _stop_worker(self, webhook_id: str) -> None:
        worker = self._workers.pop(webhook_id, None)
        if worker is not None:
            worker.cancel()

    async def _deliver_forever(self, webhook_id: str) -> None:
        """Post the webhook's events as they come: after a batch, look again at once; with
        none left, wait for the team's next event (`_announce`: the collector that appended
        it, here or at another gateway), or `AENV_GATEWAY_EVENTS_POLL` s if no wake comes."""
        team = await self.redis.hget(f"{K}hook:{webhook_id}", "team")
        if team is None:
            return  # deleted meanwhile
        async with httpx.AsyncClient(timeout=self.policy.timeout, trust_env=False,
                                     follow_redirects=False) as client:
            while True:
                signal = self._signal(team)
                try:
                    more = await self._deliver_batch(client, webhook_id)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    log.warning("webhook delivery failed: %s", exc,
                                extra={"webhook_id": webhook_id})
                    more = False
                if not more:
                    with contextlib.suppress(asyncio.TimeoutError):
                        await asyncio.wait_for(signal.wait(), self.poll)

    async def _deliver_batch(self, client: httpx.AsyncClient, webhook_id: str) -> bool:
        """Post the next events after the webhook's cursor; False when there were none (or
        the webhook went, or another gateway holds it now)."""
        key = f"{K}hook:{webhook_id}"
        raw = await self.redis.hgetall(key)
        if "doc" not in raw:
            return False
        hook = json.loads(raw["doc"])
        if not hook["enabled"]:
            return False
        stream = team_stream(hook["team"])
        cursor, cursor_n = int(raw.get("cursor", 0)), int(raw.get("cursor_n", 0))
        # the streams of the types it wants, merged: a webhook of a rare type reads only those
        # (the team's stream while its cursor is below the team's first typed event)
        typed = int(await self.redis.hget(f"{K}typed", hook["team"]) or 0)
        keys = [type_stream(hook["team"], kind) for kind in hook["events"]] \
            if typed and cursor >= typed - 1 else [stream]
        entries = []
        async with contextlib.aclosing(self._merged(keys, cursor, None, True,
                                                    STREAM_CHUNK)) as merged:
            async for entry in merged:
                entries.append(entry)
                if len(entries) == STREAM_CHUNK:
                    break
        passed = None  # the last entry gone over without a delivery
        for entry_id, fields in entries:
            event, n = _event(entry_id, fields), int(fields["n"])
            if event.type not in hook["events"]:
                passed = event.seq, n
                continue
            _, count = await self._team_position(hook["team"])
            if count - n + 1 > self.policy.queue_size:  # the receiver is behind
                return await self._skip_ahead(webhook_id, stream, cursor_n)
            await deliver(client, self.policy, self.allow_private, webhook_id, hook["url"],
                          hook["secret"], event, self._recorder(webhook_id))
            passed = None
            cursor_n = n
            if not await self._move(webhook_id, event.seq, n, count - n):
                return False
        if passed is not None:
            _, count = await self._team_position(hook["team"])
            return await self._move(webhook_id, *passed, count - passed[1])
        return bool(entries)

    async def _move(self, webhook_id: str, seq: int, n: int, queued: int,
                    dropped: int = 0) -> bool:
        """Move the webhook's cursor past the event (`seq`, the team's `n`th), while this
        gateway holds its lease and it exists."""
        return bool(await self._advance(
            keys=[f"{K}hooklease:{webhook_id}", f"{K}hook:{webhook_id}"],
            args=[self.mark, seq, n, max(queued, 0), dropped]))

    async def _skip_ahead(self, webhook_id: str, stream: str, cursor_n: int) -> bool:
        """Keep the newest AENV_WEBHOOK_QUEUE events of the team for the webhook, drop the
        rest (counted)."""
        newest = await self.redis.xrevrange(stream, count=self.policy.queue_size + 1)
        if len(newest) <= self.policy.queue_size:
            return True
        entry_id, fields = newest[-1]
        skipped = int(fields["n"]) - cursor_n
        log.warning("webhook behind: events dropped", extra={"webhook_id": webhook_id,
                                                             "dropped": skipped})
        self.metrics.webhook_dropped.inc(skipped)
        return await self._move(webhook_id, seq_of(entry_id), int(fields["n"]),
                                self.policy.queue_size, skipped)

    def _recorder(self, webhook_id: str) -> Callable[[float, dict[str, Any]], Awaitable[None]]:
        async def record(began: float, attempt: dict[str, Any]) -> None:
            self.metrics.webhook_attempts.labels(
                "delivered" if attempt["delivered"] else "failed").inc()
            key = f"{K}attempts:{webhook_id}"
            pipe = self.redis.pipeline(transaction=False)
            pipe.xadd(key, {"a": json.dumps(attempt)}, maxlen=ATTEMPTS_KEPT, approximate=True)
            pipe.xtrim(key, minid=int((time.time() - self.retention) * 1000), approximate=True)
            # the log of a webhook deleted during the attempt goes too
            pipe.pexpire(key, int(self.retention * 1000))
            await pipe.execute()

        return record

