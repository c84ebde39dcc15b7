"""What the gateway keeps in Redis: teams and their API keys, and which team owns each sandbox,
template, snapshot and volume (and on which node a template, snapshot or volume lives).

The gateway holds nothing else: every gateway process of a cluster reads the same keys, so any
of them serves any request. API keys are stored as their SHA-256 only.

Keys (prefix `aenv:`): `teams` (set of names), `team:{name}` (hash: name, created),
`apikey:{sha256}` -> team name, `own:sandbox` (hash: sandbox id -> team),
`own:template:{id}` / `own:snapshot:{id}` (hash: team, node, id), `name:template:{team}:{name}`
and `name:snapshot:{team}:{name}` -> id (names are per team, as on the nodes: the same name in
two teams names two things), `idem:{team}:{sha256(key)}` -> a create under way (`pending:…`, a
lease its gateway renews) or its answer, for IDEMPOTENCY_SECONDS, and `idem-node:{team}:{sha256}`
-> the node that create was sent to. That answer holds the sandbox's envd token, as the node's
memory does: whoever reads this Redis holds the cluster anyway (API keys).
`buildnodes:{team}` (sorted set: node id, scored by when the team last built a template there):
where the team's next new template is built, so a chain of templates stays on one node.
`quota:{sandboxes|templates|snapshots}:{team}` (sorted sets): what counts for the team's quotas
(control/gateway/limits.py). Volumes: `own:volume:{id}` and `name:volume:{team}:{name}` as
templates', and `volumehome:{team}` -> the node that holds all the team's volumes
(control/gateway/volumes.py).
"""

from __future__ import annotations

import hashlib
import secrets
import time
from dataclasses import dataclass

import redis.asyncio as aioredis
import redis.exceptions

from agentenv.api.tenancy import LOCAL_TEAM, TEAM_NAME
from agentenv.control.redis_auth import RedisAuth, shown_url
from agentenv.errors import AgentEnvError

PREFIX = "aenv:"
#: how long a create's Idempotency-Key names its sandbox (the node keeps its own as long)
IDEMPOTENCY_SECONDS = 600
PENDING = "pending:"
#: extend a lease (ARGV[2] ms) only while the key still holds this caller's mark
_RENEW_IF = ("if redis.call('get', KEYS[1]) == ARGV[1] then "
             "return redis.call('pexpire', KEYS[1], ARGV[2]) end return 0")
#: a create's answer replaces its own pending mark, or a lapsed (absent) one; otherwise (another
#: create claimed the key after this one's lease lapsed) the key's value is returned untouched
_FINISH_IF = ("local held = redis.call('get', KEYS[1]) "
              "if held == ARGV[1] or not held then "
              "redis.call('set', KEYS[1], ARGV[2], 'EX', ARGV[3]) return false end return held")
#: a failed create gives back its key and forgets its node (the retry is placed anew)
_UNCLAIM_IF = ("if redis.call('get', KEYS[1]) == ARGV[1] then redis.call('del', KEYS[2]) "
               "return redis.call('del', KEYS[1]) end return 0")


def quota_key(kind: str, team: str) -> str:
    """The set of what counts for `team`'s quota of `kind` ("sandboxes", "templates",
    "snapshots"; control/gateway/limits.py)."""
    return PREFIX + f"quota:{kind}:{team}"


class StoreUnavailable(AgentEnvError):
    """Redis did not answer (the gateway answers 503)."""


def key_digest(api_key: str) -> str:
    return hashlib.sha256(api_key.encode()).hexdigest()


def new_api_key() -> str:
    # `e2b_` + 40 hex digits: the form the Python SDK checks before sending anything
    return "e2b_" + secrets.token_hex(20)


@dataclass(frozen=True)
class Owned:
    """A template or snapshot a team made, and the node that holds it."""

    kind: str  # "template" | "snapshot"
    id: str
    team: str
    node: str


class GatewayStore:
    def __init__(self, url: str, auth: RedisAuth | None = None) -> None:
        self.url = shown_url(url)  # for messages (the log, the CLI): no password
        self.redis = aioredis.Redis.from_url(
            url, decode_responses=True, socket_connect_timeout=5, socket_timeout=20,
            **(auth or RedisAuth()).connect_kwargs(),
        )

    async def close(self) -> None:
        await self.redis.aclose()

    async def _call(self, coro):  # type: ignore[no-untyped-def]
        try:
            return await coro
        except (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError) as exc:
            raise StoreUnavailable(f"Redis at {self.url} is unavailable: {exc}") from exc

    # --- teams -------------------------------------------------------------------------------

    async def create_team(self, name: str) -> None:
        if not TEAM_NAME.match(name):
            raise AgentEnvError(
                f"invalid team name {name!r}: 1-40 lowercase letters, digits and '-'"
            )
        if name == LOCAL_TEAM:  # what a node records for its API key's holder (api/tenancy.py)
            raise AgentEnvError(f"the team name {name!r} is reserved")
        created = await self._call(self.redis.sadd(PREFIX + "teams", name))
        if not created:
            raise AgentEnvError(f"team {name!r} exists already")
        await self._call(
            self.redis.hset(PREFIX + f"team:{name}", mapping={"name": name,
                                                              "created": str(time.time())})
        )

    async def new_key(self, team: str) -> str:
        if not await self._call(self.redis.sismember(PREFIX + "teams", team)):
            raise AgentEnvError(f"no team {team!r} (aenv team create {team})")
        key = new_api_key()
        await self._call(self.redis.set(PREFIX + f"apikey:{key_digest(key)}", team))
        await self._call(self.redis.hincrby(PREFIX + f"team:{team}", "keys", 1))
        return key

    async def teams(self) -> list[dict[str, str]]:
        names = sorted(await self._call(self.redis.smembers(PREFIX + "teams")))
        out = []
        for name in names:
            info = await self._call(self.redis.hgetall(PREFIX + f"team:{name}"))
            out.append({"name": name, "keys": info.get("keys", "0"),
                        "created": info.get("created", "")})
        return out

    async def team_of_key(self, api_key: str) -> str | None:
        found: str | None = await self._call(
            self.redis.get(PREFIX + f"apikey:{key_digest(api_key)}")
        )
        return found

    # --- ownership ---------------------------------------------------------------------------

    async def own_sandboxes(self, team: str, sandbox_ids: list[str]) -> None:
        if sandbox_ids:
            await self._call(
                self.redis.hset(PREFIX + "own:sandbox", mapping=dict.fromkeys(sandbox_ids, team))
            )

    async def sandbox_team(self, sandbox_id: str) -> str | None:
        found: str | None = await self._call(self.redis.hget(PREFIX + "own:sandbox", sandbox_id))
        return found

    async def sandbox_teams(self, sandbox_ids: list[str]) -> list[str | None]:
        if not sandbox_ids:
            return []
        found: list[str | None] = await self._call(
            self.redis.hmget(PREFIX + "own:sandbox", sandbox_ids)
        )
        return found

    async def forget_sandbox(self, sandbox_id: str) -> None:
        await self._call(self.redis.hdel(PREFIX + "own:sandbox", sandbox_id))

    async def own(self, kind: str, item_id: str, team: str, node: str, names: list[str]) -> None:
        pipe = self.redis.pipeline()
        key = PREFIX + f"own:{kind}:{item_id}"
        pipe.hset(key, mapping={"team": team, "node": node, "id": item_id})
        for name in names:
            pipe.set(PREFIX + f"name:{kind}:{team}:{name}", item_id)
            pipe.hset(key, f"name:{name}", "1")
        await self._call(pipe.execute())

    async def owned(self, kind: str, ref: str, team: str | None = None) -> Owned | None:
        """The template or snapshot `ref` (an id, or a name of `team`'s), whoever owns it."""
        item_id = ref
        if team is not None:
            named = await self._call(self.redis.get(PREFIX + f"name:{kind}:{team}:{ref}"))
            if named:
                item_id = named
        info = await self._call(self.redis.hgetall(PREFIX + f"own:{kind}:{item_id}"))
        if not info:
            return None
        return Owned(kind, info["id"], info["team"], info["node"])

    async def owned_ids(self, kind: str, ids: list[str]) -> dict[str, str]:
        """id -> owning team, for the ids some team owns."""
        if not ids:
            return {}
        pipe = self.redis.pipeline()
        for item_id in ids:
            pipe.hget(PREFIX + f"own:{kind}:{item_id}", "team")
        teams = await self._call(pipe.execute())
        return {i: t for i, t in zip(ids, teams, strict=True) if t}

    async def disown(self, kind: str, item_id: str, team: str, names: list[str]) -> None:
        """Forget an item and every name it was recorded with (and `names`)."""
        key = PREFIX + f"own:{kind}:{item_id}"
        fields = await self._call(self.redis.hkeys(key))
        names = [*names, *(f.removeprefix("name:") for f in fields if f.startswith("name:"))]
        pipe = self.redis.pipeline()
        pipe.delete(key)
        pipe.zrem(quota_key(f"{kind}s", team), item_id)  # its place in the team's quota
        for name in set(names):
            pipe.delete(PREFIX + f"name:{kind}:{team}:{name}")
        await self._call(pipe.execute())

    # --- volumes -------------------------------------------------------------------------------

    async def volume_home(self, team: str, node: str | None = None) -> str | None:
        """The node that holds `team`'s volumes; with `node`, made that node unless the team
        has one already (the first create's placement wins a race): the one it has."""
        key = PREFIX + f"volumehome:{team}"
        if node is not None:
            await self._call(self.redis.set(key, node, nx=True))
        found: str | None = await self._call(self.redis.get(key))
        return found

    # --- build affinity ----------------------------------------------------------------------

    async def note_build_node(self, team: str, node: str) -> None:
        """`team` built (or wants to build) a template on `node`: its next new one goes there."""
        await self._call(self.redis.zadd(PREFIX + f"buildnodes:{team}", {node: time.time()}))

    async def build_nodes(self, team: str, limit: int = 16) -> list[str]:
        """The nodes where `team` built templates, the latest first."""
        found: list[str] = await self._call(
            self.redis.zrevrange(PREFIX + f"buildnodes:{team}", 0, limit - 1)
        )
        return found

    # --- idempotent creates ------------------------------------------------------------------

    @staticmethod
    def _idem_key(team: str, key: str) -> str:
        return PREFIX + f"idem:{team}:{hashlib.sha256(key.encode()).hexdigest()}"

    @staticmethod
    def _idem_node_key(team: str, key: str) -> str:
        return PREFIX + f"idem-node:{team}:{hashlib.sha256(key.encode()).hexdigest()}"

    async def claim_create(self, team: str, key: str, mark: str, lease_seconds: float
                           ) -> str | None:
        """Claim `team`'s Idempotency-Key `key` for a create (the pending `mark`, a lease of
        `lease_seconds` that renew_create extends): None when claimed, else what the key holds
        (another caller's pending mark, or the answer of the create that claimed it)."""
        name = self._idem_key(team, key)
        while True:
            claimed = await self._call(self.redis.set(name, PENDING + mark, nx=True,
                                                      px=int(lease_seconds * 1000)))
            if claimed:
                return None
            found: str | None = await self._call(self.redis.get(name))
            if found is not None:  # else it lapsed or was given back just now: claim again
                return found

    async def renew_create(self, team: str, key: str, mark: str, lease_seconds: float) -> bool:
        """Extend this caller's lease; False when the key no longer holds its mark (the lease
        lapsed, and maybe another create claimed the key)."""
        renewed = await self._call(self.redis.eval(_RENEW_IF, 1, self._idem_key(team, key),
                                                   PENDING + mark, int(lease_seconds * 1000)))
        return bool(renewed)

    async def create_sent_to(self, team: str, key: str, node_id: str) -> None:
        """Remember the node a keyed create went to: a create that takes over a lapsed lease
        goes there too, where the node's own idempotency memory has the first one's sandbox."""
        await self._call(self.redis.set(self._idem_node_key(team, key), node_id,
                                        ex=IDEMPOTENCY_SECONDS))

    async def create_node(self, team: str, key: str) -> str | None:
        found: str | None = await self._call(self.redis.get(self._idem_node_key(team, key)))
        return found

    async def finish_create(self, team: str, key: str, mark: str, answer: str) -> str | None:
        """Record a create's answer under its key: None when recorded (the key held this
        caller's mark, or nothing once it lapsed), else what the key holds instead."""
        held: str | None = await self._call(self.redis.eval(
            _FINISH_IF, 1, self._idem_key(team, key), PENDING + mark, answer,
            IDEMPOTENCY_SECONDS))
        return held

    async def unclaim_create(self, team: str, key: str, mark: str) -> None:
        """A create that failed gives its key back (a retry may try again)."""
        await self._call(self.redis.eval(_UNCLAIM_IF, 2, self._idem_key(team, key),
                                         self._idem_node_key(team, key), PENDING + mark))
