"""The limits a shared cluster needs at its gateway: per-team quotas, and a rate limit on the
signed file URL owner lookup.

Quotas (node/admission.py's settings, `AENV_TEAM_MAX_SANDBOXES`, `_TEMPLATES`, `_SNAPSHOTS`;
0 = no limit) are counted over the whole cluster, so the gateway holds them (a cluster's nodes
leave them alone). A refused request is a 429 that names the limit, before any node is asked.

- Sandboxes: Redis keeps, per team, the sorted set `aenv:quota:sandboxes:{team}` of the
  sandboxes it created (create and fork) and of creates under way (`pending:…`, scored by when
  they started: a gateway that dies mid-create leaves one that lapses after PENDING_SECONDS).
  A pending entry is added before the node is asked and counted at once, so concurrent
  creates through any gateway cannot all pass the last free place. The set is pruned only
  when a create would pass the limit: a sandbox the scheduler no longer binds (ended by kill,
  timeout or its node) leaves it. A paused sandbox keeps its binding and counts.
- Templates and snapshots: counted from the ownership records (`aenv:own:{kind}:*`) when a
  team asks for a new one (rare next to creates).

The signed-URL lookup (`/files?signature=…` with no cached owner) asks every node: each client
address gets a token bucket (`AENV_SIGNED_LOOKUP_RATE` per second, bursts of
`AENV_SIGNED_LOOKUP_BURST`; 0 = no limit). A URL whose owner is cached is not limited.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import httpx
from prometheus_client import Counter

from agentenv.control.gateway.placement import SchedulerLink
from agentenv.control.gateway.store import PREFIX, GatewayStore
from agentenv.node.admission import QuotaExceeded, TeamQuotas, env_number

log = logging.getLogger("agentenv.control.gateway.limits")

#: a create under way counts this long at most (a create that takes longer still succeeds)
PENDING_SECONDS = 600.0
_PENDING = "pending:"
MAX_BUCKETS = 100_000


def _api_error(exc: QuotaExceeded, refusals: Counter | None) -> Exception:
    from agentenv.control.gateway.app import ApiError  # the app imports this module

    if refusals is not None:
        refusals.labels(exc.limit).inc()
    return ApiError(429, exc.message)


@dataclass
class NewSandboxes:
    """What a create or fork made: the ids its node's answer names."""

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
    async def new_sandboxes(self, team: str, count: int) -> AsyncIterator[NewSandboxes]:
        """Hold `count` places of `team`'s sandbox quota for a create or fork (429 when they
        are not free); the sandboxes its answer names keep them."""
        if not self.quotas.sandboxes:
            yield NewSandboxes()
            return
        key = PREFIX + f"quota:sandboxes:{team}"
        marks = [f"{_PENDING}{secrets.token_hex(8)}" for _ in range(count)]
        now = time.time()
        redis = self.store.redis
        await self.store._call(redis.zremrangebyscore(key, "-inf", now - PENDING_SECONDS))
        await self.store._call(redis.zadd(key, dict.fromkeys(marks, now)))
        made = NewSandboxes()
        try:
            have = await self.store._call(redis.zcard(key)) - count
            if have + count > self.quotas.sandboxes:
                have = await self._prune(key) - count
            try:
                self.quotas.check("sandboxes", team, have, count)
            except QuotaExceeded as exc:
                raise _api_error(exc, self.refusals) from None
            yield made
        finally:
            pipe = redis.pipeline()
            pipe.zrem(key, *marks)
            if made.ids:
                pipe.zadd(key, dict.fromkeys(made.ids, time.time()))
            await self.store._call(pipe.execute())

    async def _prune(self, key: str) -> int:
        """Drop the sandboxes the scheduler no longer binds; the count left."""
        members = await self.store._call(self.store.redis.zrange(key, 0, -1))
        gone = [m for m in members if not m.startswith(_PENDING)
                and await self.scheduler.lookup(m) is None]
        if gone:
            await self.store._call(self.store.redis.zrem(key, *gone))
        return len(members) - len(gone)

    async def check_new(self, team: str, kind: str) -> None:
        """429 when `team` may not get one more template or snapshot."""
        if not getattr(self.quotas, kind):
            return
        have = 0
        redis = self.store.redis
        singular = kind.removesuffix("s")
        keys = await self.store._call(self._keys(PREFIX + f"own:{singular}:*"))
        if keys:
            pipe = redis.pipeline()
            for k in keys:
                pipe.hget(k, "team")
            have = sum(1 for owner in await self.store._call(pipe.execute()) if owner == team)
        try:
            self.quotas.check(kind, team, have)
        except QuotaExceeded as exc:
            raise _api_error(exc, self.refusals) from None


    async def _keys(self, pattern: str) -> list[str]:
        return [k async for k in self.store.redis.scan_iter(match=pattern, count=1000)]


class LookupLimiter:
    """A token bucket per client address for the signed-URL owner lookup."""

    def __init__(self, rate: float, burst: float, refusals: Counter | None = None) -> None:
        self.rate = rate
        self.burst = max(burst, 1.0)
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # tokens, at
        self.refusals = refusals

    @classmethod
    def from_env(cls, refusals: Counter | None = None,
                 env: Mapping[str, str] | None = None) -> LookupLimiter:
        env = os.environ if env is None else env
        return cls(env_number(env, "AENV_SIGNED_LOOKUP_RATE", 20.0, float) or 0.0,
                   env_number(env, "AENV_SIGNED_LOOKUP_BURST", 40.0, float) or 0.0, refusals)

    def allow(self, address: str) -> bool:
        if not self.rate:
            return True
        now = time.monotonic()
        tokens, at = self._buckets.pop(address, (self.burst, now))
        tokens = min(self.burst, tokens + (now - at) * self.rate)
        allowed = tokens >= 1.0
        self._buckets[address] = (tokens - 1.0 if allowed else tokens, now)
        while len(self._buckets) > MAX_BUCKETS:  # the least recently seen go first
            self._buckets.popitem(last=False)
        return allowed

    async def refused_lookup(self, scope: Mapping[str, Any], send: Any) -> bool:
        """Answer 429 (and True) when the client is over its rate of uncached lookups."""
        client = scope.get("client")
        address = client[0] if client else ""
        if self.allow(address):
            return False
        if self.refusals is not None:
            self.refusals.labels("signed_lookup").inc()
        log.info("signed URL lookup rate limited", extra={"client": address})
        payload = json.dumps({
            "code": 429, "message": "too many signed URL lookups from this address "
            f"(AENV_SIGNED_LOOKUP_RATE {self.rate:g}/s, AENV_SIGNED_LOOKUP_BURST "
            f"{self.burst:g}); retry shortly"}).encode()
        await send({"type": "http.response.start", "status": 429, "headers": [
            (b"content-type", b"application/json; charset=utf-8"),
            (b"content-length", str(len(payload)).encode()), (b"retry-after", b"1")]})
        await send({"type": "http.response.body", "body": payload})
        return True
