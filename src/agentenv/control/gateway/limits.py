"""The limits a shared cluster needs at its gateway: per-team quotas, and a rate limit on the
signed file URL owner lookup.

Quotas (node/admission.py's settings, `AENV_TEAM_MAX_SANDBOXES`, `_TEMPLATES`, `_SNAPSHOTS`;
0 = no limit) are counted over the whole cluster, so the gateway holds them (a cluster's nodes
leave them alone). A refused request is a 429 that names the limit, before any node is asked.

Redis keeps, per team and kind, the sorted set `aenv:quota:{sandboxes|templates|snapshots}:
{team}` of what the team has (sandboxes it created or forked, templates and snapshots it owns;
scored +inf) and of creates under way (`pending:…`, scored by when they started: a gateway that
dies mid-create leaves one that lapses after PENDING_SECONDS). A create is reserved in one
Redis script (_RESERVE: count and add together) before the node is asked, so concurrent creates
through any gateway get exactly the free places; what the node made replaces the reservation,
a failed create gives it back, a deleted template or snapshot leaves the set (store.disown).
The set is pruned only when a create would pass the limit: a sandbox the scheduler no longer
binds (ended by kill, timeout or its node) and a template or snapshot without an ownership
record leave it. A paused sandbox keeps its binding and counts.

Places at once (TeamShares): the gateway serves at most AENV_MAX_CONCURRENT_REQUESTS requests
at once (relay/concurrency.py), and one team may hold at most AENV_TEAM_MAX_CONCURRENT_REQUESTS
of them (default a quarter; 0 = no share): its control requests once its key is known and its
upload URLs. The traffic to its sandboxes and its signed file URLs, which need no key, hold a
second share of the same size per client address (`traffic_holder`), so a stranger who knows
a sandbox id takes neither the places of the team's control requests nor those of the team's
own traffic. Past its share a team gets 429 (a WebSocket 1013) naming the
setting, so slow bodies of one team cannot deny every other team the gateway.

The signed-URL lookup (`/files?signature=…` with no cached owner) asks every node: each client
address (the peer, or what a trusted proxy forwarded for: relay/server.py; an IPv6 client's
/64) gets a token bucket (`AENV_SIGNED_LOOKUP_RATE` per second, bursts of
`AENV_SIGNED_LOOKUP_BURST`; 0 = no limit). A URL whose owner is cached is not limited.

Sandbox traffic needs no key either, and an id the gateway has not cached costs a scheduler
call: a client's lookups that find no sandbox get a bucket of their own
(`AENV_UNKNOWN_SANDBOX_RATE`, `AENV_UNKNOWN_SANDBOX_BURST`; the red team's finding 5). Past it,
an uncached id is a 429 without asking the scheduler; a lookup that finds a sandbox costs no
token, and a cached sandbox is never limited.
"""

from __future__ import annotations

import contextlib
import json
import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client import Counter

from agentenv.control.gateway.nodes import GatewayError
from agentenv.control.gateway.placement import SchedulerLink
from agentenv.control.gateway.store import PREFIX, GatewayStore, quota_key
from agentenv.logs import Sampled
from agentenv.node.admission import QuotaExceeded, TeamQuotas, env_number
from agentenv.relay.answers import RETRY_SHORTLY, send_json
from agentenv.relay.concurrency import max_concurrent
from agentenv.relay.connections import client_key

log = logging.getLogger("agentenv.control.gateway.limits")

#: a create under way counts this long at most (a create that takes longer still succeeds)
PENDING_SECONDS = 600.0
_PENDING = "pending:"
MAX_BUCKETS = 100_000
#: KEYS[1] a team's quota set; ARGV: lapse-before, limit, now, marks. Drops lapsed creates
#: (pending marks scored by when they started; what exists scores +inf), then adds the marks
#: only when they fit: -1; else the count held. One step, so concurrent creates through any
#: gateway get exactly the free places.
_RESERVE = """
redis.call('zremrangebyscore', KEYS[1], '-inf', ARGV[1])
local have = redis.call('zcard', KEYS[1])
if have + #ARGV - 3 > tonumber(ARGV[2]) then return have end
for i = 4, #ARGV do redis.call('zadd', KEYS[1], ARGV[3], ARGV[i]) end
return -1
"""


def _api_error(exc: QuotaExceeded, refusals: Counter | None) -> Exception:
    if refusals is not None:
        refusals.labels(exc.limit).inc()
    return GatewayError(429, exc.message)


@dataclass
class NewItems:
    """What a create, fork, snapshot or new template made: the ids that keep their places."""

    ids: list[str] = field(default_factory=list)

    def answer(self, response: httpx.Response) -> None:
        if response.status_code != 201:
            return
        body = response.json()
        if isinstance(body, dict) and isinstance(body.get("sandboxID"), str):
            self.ids.append(body["sandboxID"])
        elif isinstance(body, list):  # a fork: one result per child
            self.ids += [r["sandbox"]["sandboxID"] for r in body
                         if isinstance(r, dict) and isinstance(r.get("sandbox"), dict)]


def fork_count(raw: bytes) -> int:
    """The children a fork request asks for (the node names what is wrong with a bad body)."""
    try:
        count = json.loads(raw or b"{}").get("count", 1)
    except (ValueError, AttributeError):
        return 1
    return count if isinstance(count, int) and 1 <= count <= 1000 else 1


class GatewayQuotas:
    def __init__(self, store: GatewayStore, scheduler: SchedulerLink,
                 refusals: Counter | None = None, quotas: TeamQuotas | None = None) -> None:
        self.store = store
        self.scheduler = scheduler
        self.refusals = refusals
        self.quotas = quotas if quotas is not None else TeamQuotas.from_env()

    @contextlib.asynccontextmanager
    async def new_sandboxes(self, team: str, count: int) -> AsyncIterator[NewItems]:
        """Hold `count` places of `team`'s sandbox quota for a create or fork (429 when they
        are not free); the sandboxes its answer names keep them."""
        async with self._reserved(team, "sandboxes", count) as made:
            yield made

    @contextlib.asynccontextmanager
    async def new_item(self, team: str, kind: str) -> AsyncIterator[NewItems]:
        """Hold a place of `team`'s template or snapshot quota (`kind`: "templates",
        "snapshots") while the node makes one; the id it names (`made.ids`) keeps it, until
        the ownership record goes (GatewayStore.disown)."""
        async with self._reserved(team, kind, 1) as made:
            yield made

    @contextlib.asynccontextmanager
    async def _reserved(self, team: str, kind: str, count: int) -> AsyncIterator[NewItems]:
        limit = getattr(self.quotas, kind)
        made = NewItems()
        if not limit:
            yield made
            return
        key = quota_key(kind, team)
        if kind != "sandboxes":
            await self._seed(key, team, kind)
        marks = [f"{_PENDING}{secrets.token_hex(8)}" for _ in range(count)]
        have = await self._reserve(key, limit, marks)
        if have is not None:  # the set may name things that are gone: prune, then again
            await self._prune(key, kind)
            have = await self._reserve(key, limit, marks)
        if have is not None:
            try:
                self.quotas.check(kind, team, have, count)
            except QuotaExceeded as exc:
                raise _api_error(exc, self.refusals) from None
        try:
            yield made
        finally:
            pipe = self.store.redis.pipeline()
            pipe.zrem(key, *marks)
            if made.ids:  # kept until they are gone: never lapse
                pipe.zadd(key, dict.fromkeys(made.ids, "+inf"))
            await self.store._call(pipe.execute())

    async def _reserve(self, key: str, limit: int, marks: list[str]) -> int | None:
        """Add `marks` to the set in one step when they fit under `limit` (None); else the
        count the set holds."""
        have = await self.store._call(self.store.redis.eval(
            _RESERVE, 1, key, time.time() - PENDING_SECONDS, limit, time.time(), *marks))
        return None if have < 0 else int(have)

    async def _prune(self, key: str, kind: str) -> None:
        """Drop what no longer exists: sandboxes the scheduler no longer binds, templates and
        snapshots whose ownership record is gone."""
        members = [m for m in await self.store._call(self.store.redis.zrange(key, 0, -1))
                   if not m.startswith(_PENDING)]
        if kind == "sandboxes":
            gone = [m for m in members if await self.scheduler.lookup(m) is None]
        else:
            owned = await self.store.owned_ids(kind.removesuffix("s"), members)
            gone = [m for m in members if m not in owned]
        if gone:
            await self.store._call(self.store.redis.zrem(key, *gone))

    async def _seed(self, key: str, team: str, kind: str) -> None:
        """A team's set starts with what it owns already (a cluster that kept ownership
        records before the sets existed); a set that exists is not scanned again."""
        redis = self.store.redis
        if await self.store._call(redis.exists(key)):
            return
        keys = [k async for k in redis.scan_iter(match=PREFIX + f"own:{kind.removesuffix('s')}:*",
                                                 count=1000)]
        if not keys:
            return
        pipe = redis.pipeline()
        for k in keys:
            pipe.hget(k, "team")
        owners = await self.store._call(pipe.execute())
        mine = [k.rsplit(":", 1)[1] for k, owner in zip(keys, owners, strict=True)
                if owner == team]
        if mine:
            await self.store._call(redis.zadd(key, dict.fromkeys(mine, "+inf")))


@dataclass(frozen=True)
class LookupKind:
    """What a LookupLimiter limits: its words, settings (with defaults) and metrics label."""

    what: str
    logged: str
    rate_setting: str
    burst_setting: str
    label: str
    rate: float = 20.0
    burst: float = 40.0


SIGNED_LOOKUPS = LookupKind("signed URL lookups", "signed URL lookup rate limited",
                            "AENV_SIGNED_LOOKUP_RATE",
                            "AENV_SIGNED_LOOKUP_BURST", "signed_lookup")
UNKNOWN_SANDBOXES = LookupKind("lookups of unknown sandboxes",
                               "unknown sandbox lookup rate limited", "AENV_UNKNOWN_SANDBOX_RATE",
                               "AENV_UNKNOWN_SANDBOX_BURST", "unknown_sandbox")


class LookupLimiter:
    """A token bucket per client address for a lookup a stranger may cause: the signed-URL
    owner lookup (`allow`: each takes a token), the scheduler's lookup of a sandbox id it
    does not know (`allow` before it, `refund` when it found a sandbox: only misses cost, and
    concurrent lookups of one client never pass its burst)."""

    def __init__(self, rate: float, burst: float, refusals: Counter | None = None,
                 kind: LookupKind = SIGNED_LOOKUPS) -> None:
        self.rate = rate
        self.burst = max(burst, 1.0)
        self.kind = kind
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # tokens, at
        self.refusals = refusals
        self.refused = Sampled()

    @classmethod
    def from_env(cls, refusals: Counter | None = None, env: Mapping[str, str] | None = None,
                 kind: LookupKind = SIGNED_LOOKUPS) -> LookupLimiter:
        return cls(env_number(env, kind.rate_setting, kind.rate, float) or 0.0,
                   env_number(env, kind.burst_setting, kind.burst, float) or 0.0, refusals,
                   kind)

    def _take(self, address: str, cost: float, floor: float) -> bool:
        """Refill `address`'s bucket, then take `cost` from it (a negative cost gives back; the
        bucket holds at most `burst`) when that leaves at least `floor`; whether it did."""
        now = time.monotonic()
        address = client_key(address)
        tokens, at = self._buckets.pop(address, (self.burst, now))
        tokens = min(self.burst, tokens + (now - at) * self.rate)
        allowed = tokens - cost >= floor
        self._buckets[address] = (min(self.burst, tokens - cost) if allowed else tokens, now)
        while len(self._buckets) > MAX_BUCKETS:  # the least recently seen go first
            self._buckets.popitem(last=False)
        return allowed

    def allow(self, address: str) -> bool:
        """Take a token for a lookup about to be made; False when there is none."""
        return not self.rate or self._take(address, 1.0, 0.0)

    def refund(self, address: str) -> None:
        """Give back the token `allow` took, for a lookup that found what it looked for."""
        if self.rate:
            self._take(address, -1.0, float("-inf"))

    def refusal(self, address: str) -> str:
        """Count a refused lookup; what the client is told."""
        if self.refusals is not None:
            self.refusals.labels(self.kind.label).inc()
        if self.refused.tick():  # a stranger's flood of refusals is counted, not logged
            log.info(self.kind.logged,
                     extra={"client": address, "refused": self.refused.count})
        return (f"too many {self.kind.what} from this address ({self.kind.rate_setting} "
                f"{self.rate:g}/s, {self.kind.burst_setting} {self.burst:g}); retry shortly")

    async def refused_lookup(self, scope: Mapping[str, Any], send: Any) -> bool:
        """Answer 429 (and True) when the client is over its rate of uncached lookups."""
        address = client_address(scope)
        if self.allow(address):
            return False
        await send_json(send, 429, {"code": 429, "message": self.refusal(address)},
                        RETRY_SHORTLY)
        return True


def client_address(scope: Mapping[str, Any]) -> str:
    """The client's address: the peer's, or what a trusted proxy forwarded for (relay/server.py
    has uvicorn put it in the scope)."""
    client = scope.get("client")
    return str(client[0]) if client else ""


def traffic_holder(team: str, scope: Mapping[str, Any]) -> str:
    """Whose traffic share a request to a team's sandbox (or signed file URL) takes: the team's
    from this client address (an IPv6 client's /64). Such traffic needs no key, so a stranger
    holding slow requests to one public sandbox port must fill only its own share, not the
    team's SDK traffic to every other sandbox (found by the red team)."""
    return f"{team} from {client_key(client_address(scope))}"


TEAM_SHARE_SETTING = "AENV_TEAM_MAX_CONCURRENT_REQUESTS"


class TeamBusy(Exception):
    """A team holds its share of the gateway's places (429)."""

    def __init__(self, limit: int) -> None:
        super().__init__(
            f"this team has {limit} requests in progress at the gateway, its share "
            f"({TEAM_SHARE_SETTING}); retry when some have finished")


class TeamShares:
    """How many requests each team has in progress; `hold(team)` is one more of them for as
    long as the `with` lasts, or TeamBusy past the team's share."""

    def __init__(self, limit: int, refusals: Counter | None = None) -> None:
        self.limit = limit
        self.active: dict[str, int] = {}
        self.refusals = refusals
        self.refused = Sampled()

    @classmethod
    def from_env(cls, refusals: Counter | None = None,
                 env: Mapping[str, str] | None = None) -> TeamShares:
        default = max_concurrent(env) // 4
        return cls(int(env_number(env, TEAM_SHARE_SETTING, default, int) or 0), refusals)

    @contextlib.contextmanager
    def hold(self, team: str) -> Iterator[None]:
        if not self.limit or not team:
            yield
            return
        held = self.active.get(team, 0)
        if held >= self.limit:
            if self.refusals is not None:
                self.refusals.labels("team_concurrency").inc()
            if self.refused.tick():
                log.warning("a team reached its share of the gateway",
                            extra={"team": team, "limit": self.limit,
                                   "refused": self.refused.count})
            raise TeamBusy(self.limit)
        self.active[team] = held + 1
        try:
            yield
        finally:
            left = self.active[team] - 1
            if left:
                self.active[team] = left
            else:
                del self.active[team]
