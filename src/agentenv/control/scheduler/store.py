"""The scheduler's durable state in Redis: the sandbox -> node binding table and the node registry.

Everything a restarted scheduler needs is here, so a scheduler killed with -9 answers Lookup for
every binding as soon as it is back. Keys (PREFIX defaults to ``aenv:sched:``):

| key | type | content |
|---|---|---|
| PREFIX bindings | hash | sandbox id -> node, team, recorded-at ms, vCPUs, MiB (unit-separated) |
| PREFIX node:ID:sandboxes | set | the sandbox ids bound to node ID (reconciliation reads it) |
| PREFIX nodes | hash | node id -> its last NodeStatus (protobuf, without the sandbox list) |
| PREFIX seen | hash | node id -> wall-clock ms of its last heartbeat |
| PREFIX released | sorted set | sandbox id -> ms of its Release (a late heartbeat must not revive it) |
| PREFIX alive | string | ms of the scheduler's last sweep (measures how long it was away) |

Bindings change in Lua scripts, so a binding and its node's set never disagree, whatever crashes.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import hiredis
import redis
from redis.connection import UnixDomainSocketConnection, parse_url
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from agentenv.control.redis_auth import RedisAuth, shown_url
from agentenv.errors import AgentEnvError
from agentenv.scheduling.proto import scheduler_pb2 as pb

SEP = "\x1f"
MAX_CONNECTIONS = 32
POOL_TIMEOUT_S = 10.0
# A Redis that stops answering (stalled, partitioned) fails a call after this long instead of
# holding its caller (and the writes queued behind it) forever.
REDIS_TIMEOUT_S = 5.0
DEFAULT_PREFIX = "aenv:sched:"


class StoreError(AgentEnvError):
    """Redis cannot be reached or refused a command."""


def now_ms() -> int:
    return int(time.time() * 1000)


@dataclass(frozen=True)
class Binding:
    sandbox_id: str
    node_id: str
    team_id: str
    recorded_ms: int
    vcpus: int
    memory_mib: int

    def encode(self) -> str:
        return SEP.join(
            (self.node_id, self.team_id, str(self.recorded_ms), str(self.vcpus),
             str(self.memory_mib))
        )

    @classmethod
    def decode(cls, sandbox_id: str, raw: str) -> Binding:
        node, team, recorded, vcpus, memory = [*raw.split(SEP), "0", "0", "0"][:5]
        return cls(sandbox_id, node, team, int(recorded or 0), int(vcpus or 0), int(memory or 0))


# Runs once Redis has a binding write, with the binding it replaced (None: there was none).
Apply = Callable[[Binding | None], None]


# KEYS: none (key names derive from the prefix; this is a single Redis, not a cluster).
# ARGV: prefix, then (sandbox, node, encoded binding) for each binding, in order.
# Returns the previous encoded binding of each ('' where there was none).
_RECORD = """
local p = ARGV[1]
local out = {}
for i = 2, #ARGV, 3 do
  local sid, node = ARGV[i], ARGV[i+1]
  local old = redis.call('HGET', p..'bindings', sid)
  if old then
    local oldnode = string.match(old, '^([^\\31]*)')
    if oldnode ~= node then redis.call('SREM', p..'node:'..oldnode..':sandboxes', sid) end
  else
    old = ''
  end
  redis.call('HSET', p..'bindings', sid, ARGV[i+2])
  redis.call('SADD', p..'node:'..node..':sandboxes', sid)
  redis.call('ZREM', p..'released', sid)
  out[#out+1] = old
end
return out
"""

# ARGV: prefix, sandbox, now ms. Returns the removed encoded binding (or nil).
_RELEASE = """
local p, sid = ARGV[1], ARGV[2]
local old = redis.call('HGET', p..'bindings', sid)
if old then
  local oldnode = string.match(old, '^([^\\31]*)')
  redis.call('HDEL', p..'bindings', sid)
  redis.call('SREM', p..'node:'..oldnode..':sandboxes', sid)
end
redis.call('ZADD', p..'released', tonumber(ARGV[3]), sid)
return old
"""

# Stores the node's status and reconciles its bindings both ways, atomically.
# ARGV: prefix, node, status bytes, now ms, grace ms, then sandbox/team pairs the node reports.
# A heartbeat never moves a binding from another node, up or down: only RecordAssignment (the
# gateway, which placed the sandbox there) does. A node's claim alone would draw another node's
# traffic and its users' envd tokens to the claimant once the other node is down.
# A binding younger than the grace is never dropped (the node's list may predate its creation),
# and a sandbox released within the grace is never re-added (the list may predate its kill).
# Returns {added ids, dropped ids}.
_HEARTBEAT = """
local p, node, now, grace = ARGV[1], ARGV[2], tonumber(ARGV[4]), tonumber(ARGV[5])
local function split(s)
  local out = {}
  for field in string.gmatch(s..'\\31', '([^\\31]*)\\31') do out[#out+1] = field end
  return out
end
redis.call('HSET', p..'nodes', node, ARGV[3])
redis.call('HSET', p..'seen', node, ARGV[4])
local setkey = p..'node:'..node..':sandboxes'
local reported, added, dropped = {}, {}, {}
for i = 6, #ARGV, 2 do
  local sid, team = ARGV[i], ARGV[i+1]
  reported[sid] = true
  local cur = redis.call('HGET', p..'bindings', sid)
  if not cur then
    local rel = redis.call('ZSCORE', p..'released', sid)
    if (not rel) or (now - tonumber(rel) > grace) then
      redis.call('HSET', p..'bindings', sid, node..'\\31'..team..'\\31'..ARGV[4]..'\\31'..'0\\31'..'0')
      redis.call('SADD', setkey, sid)
      added[#added+1] = sid
    end
  else
    -- Its own binding gets the team it lacked; another node's stays there (see above).
    local f = split(cur)
    if f[1] == node and f[2] == '' and team ~= '' then
      redis.call('HSET', p..'bindings', sid, node..'\\31'..team..'\\31'..f[3]..'\\31'..f[4]..'\\31'..f[5])
    end
  end
end
for _, sid in ipairs(redis.call('SMEMBERS', setkey)) do
  if not reported[sid] then
    local cur = redis.call('HGET', p..'bindings', sid)
    if not cur then
      redis.call('SREM', setkey, sid)
    else
      local f = split(cur)
      if f[1] ~= node then
        redis.call('SREM', setkey, sid)
      elseif now - tonumber(f[3]) > grace then
        redis.call('HDEL', p..'bindings', sid)
        redis.call('SREM', setkey, sid)
        dropped[#dropped+1] = sid
      end
    end
  end
end
return {added, dropped}
"""


def _slim(status: pb.NodeStatus) -> bytes:
    """The status as stored: without its sandbox list (the bindings hold that)."""
    slim = pb.NodeStatus()
    slim.CopyFrom(status)
    del slim.sandboxes[:]
    return slim.SerializeToString()


Waiter = Future[bytes] | asyncio.Future[bytes]


def _settle(outcomes: list[tuple[asyncio.Future[bytes], bytes | BaseException]]) -> None:
    for fut, outcome in outcomes:
        if fut.cancelled():
            continue
        if isinstance(outcome, BaseException):
            fut.set_exception(outcome)
        else:
            fut.set_result(outcome)


def _applied(batch: list[tuple[Binding, Apply | None, Any]], olds: list[bytes]
             ) -> list[bytes | BaseException]:
    """Each write's outcome once Redis took the batch: `apply` of each in Redis's order, before
    the next batch is sent (a copy of the table kept in memory sees the writes in the order
    Redis applied them); an `apply` that raised is that writer's outcome."""
    outcomes: list[bytes | BaseException] = list(olds)
    for i, ((binding, apply, _), old) in enumerate(zip(batch, olds, strict=True)):
        try:
            if apply is not None:
                apply(Binding.decode(binding.sandbox_id, old.decode()) if old else None)
        except Exception as exc:
            outcomes[i] = exc
    return outcomes


class _GroupCommit:
    """Binding writes from any thread or event loop, sent by one writer thread: each script
    call carries everything queued while the previous one was out (up to `limit`), so
    concurrent RecordAssignments share a Redis round trip. One script call costs redis-py the
    same ~30 us whether it carries 1 binding or 30, which is where the saving is under load.

    A write's waiter completes only once Redis has answered the call holding it (the same
    acknowledgement as a write of its own), with its previous encoded binding (b"") or the
    batch's error. An event loop's waiters are settled by one callback per batch, and an
    asyncio server awaits them without holding a thread, so a stalled Redis holds nothing but
    this writer.
    """

    def __init__(self, send: Callable[[list[Binding]], list[bytes]], limit: int = 256) -> None:
        self._send = send
        self._limit = limit
        self._cond = threading.Condition()
        self._queue: list[tuple[Binding, Apply | None, Waiter]] = []
        self._thread: threading.Thread | None = None
        self._closed = False

    def submit(self, binding: Binding, apply: Apply | None, waiter: Waiter) -> None:
        with self._cond:
            if self._closed:
                raise StoreError("the binding store is closed")
            self._queue.append((binding, apply, waiter))
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._run, name="scheduler-redis-writer", daemon=True
                )
                self._thread.start()
            self._cond.notify()

    def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
            thread = self._thread
        if thread is not None:
            thread.join()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._closed:
                    self._cond.wait()
                if not self._queue:
                    return
                batch, self._queue = self._queue[: self._limit], self._queue[self._limit :]
            outcomes: list[bytes | BaseException]
            try:
                olds = self._send([binding for binding, _, _ in batch])
            except BaseException as exc:  # every writer of the batch learns why
                outcomes = [exc] * len(batch)
            else:
                outcomes = _applied(batch, olds)
            self._deliver(batch, outcomes)

    @staticmethod
    def _deliver(batch: list[tuple[Binding, Apply | None, Waiter]],
                 outcomes: list[bytes | BaseException]) -> None:
        loops: dict[asyncio.AbstractEventLoop, list[tuple[asyncio.Future[bytes],
                                                          bytes | BaseException]]] = {}
        for (_, _, waiter), outcome in zip(batch, outcomes, strict=True):
            if isinstance(waiter, asyncio.Future):
                loops.setdefault(waiter.get_loop(), []).append((waiter, outcome))
            elif isinstance(outcome, BaseException):
                waiter.set_exception(outcome)
            else:
                waiter.set_result(outcome)
        for loop, settled in loops.items():
            with contextlib.suppress(RuntimeError):  # a closed loop: nobody waits any more
                loop.call_soon_threadsafe(_settle, settled)


class _Resp(asyncio.Protocol):
    """One Redis connection of an event loop: commands written as they come, each answer
    settling the oldest waiting command (Redis answers in order). hiredis parses."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._reader = hiredis.Reader(replyError=ResponseError)
        self._waiting: deque[asyncio.Future[Any]] = deque()
        self.transport: asyncio.Transport | None = None
        self.lost: RedisError | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # uvloop's are no subclasses

    def data_received(self, data: bytes) -> None:
        reader = self._reader
        try:
            reader.feed(data)
            while (reply := reader.gets()) is not False:
                waiter = self._waiting.popleft()
                if not waiter.done():
                    waiter.set_result(reply)
        except Exception as exc:  # not RESP, or an answer nobody asked for: give up on it
            self.fail(RedisConnectionError(f"bad answer from Redis: {exc}"))

    def connection_lost(self, exc: Exception | None) -> None:
        self.fail(RedisConnectionError(
            "Redis closed the connection" + (f": {exc}" if exc else "")))

    def fail(self, error: RedisError) -> None:
        """Close the connection; every command waiting (and any sent later) fails with `error`."""
        if self.lost is None:
            self.lost = error
        while self._waiting:
            waiter = self._waiting.popleft()
            if not waiter.done():
                waiter.set_exception(self.lost)
        if self.transport is not None:
            self.transport.close()

    def command(self, *args: str | bytes | int) -> asyncio.Future[Any]:
        """Send one command; its future gets the answer (a Redis error reply as ResponseError)."""
        if self.lost is not None:
            raise self.lost
        assert self.transport is not None
        waiter = self._loop.create_future()
        self._waiting.append(waiter)
        self.transport.write(hiredis.pack_command(args))
        return waiter


async def _answer(waiter: asyncio.Future[Any]) -> Any:
    reply = await waiter
    if isinstance(reply, ResponseError):
        raise reply
    return reply


class _LoopWriter:
    """Binding writes of one event loop, sent from that loop on a Redis connection of its own:
    the same group commit as _GroupCommit (one script call at a time, carrying everything
    queued while the previous one was out; `apply` of each in Redis's order before its waiter
    completes, once Redis answered the call holding it), without a thread between the RPC and
    Redis. Through the writer thread each batch cost two thread wake-ups (the writer's, then
    the loop's) and the GIL handed back and forth, which the scheduler paid in CPU on every
    RecordAssignment; here a batch is a socket write and a read on the loop it came from.
    A Redis that does not answer within the store's timeout fails the batch and the connection
    (the next batch connects again)."""

    def __init__(self, store: Store, loop: asyncio.AbstractEventLoop, target: dict[str, Any],
                 limit: int = 256) -> None:
        self._store = store
        self.loop = loop
        self._target = target
        self._limit = limit
        self._queue: list[tuple[Binding, Apply | None, asyncio.Future[bytes]]] = []
        self._draining: asyncio.Task[None] | None = None
        self._conn: _Resp | None = None
        self.closed = False

    def submit(self, binding: Binding, apply: Apply | None) -> asyncio.Future[bytes]:
        if self.closed:
            raise StoreError("the binding store is closed")
        waiter: asyncio.Future[bytes] = self.loop.create_future()
        self._queue.append((binding, apply, waiter))
        if self._draining is None:
            self._draining = self.loop.create_task(self._drain())
        return waiter

    async def _drain(self) -> None:
        try:
            while self._queue and not self.closed:
                batch, self._queue = self._queue[: self._limit], self._queue[self._limit :]
                outcomes: list[bytes | BaseException]
                try:
                    olds = await self._send([binding for binding, _, _ in batch])
                except Exception as exc:  # every writer of the batch learns why
                    outcomes = [exc] * len(batch)
                else:
                    outcomes = _applied(batch, olds)
                _settle([(waiter, outcome) for (_, _, waiter), outcome
                         in zip(batch, outcomes, strict=True)])
        finally:
            self._draining = None
            if self.closed:
                _settle([(waiter, StoreError("the binding store is closed"))
                          for _, _, waiter in self._queue])
                self._queue = []

    async def _connection(self) -> _Resp:
        conn = self._conn
        if conn is not None and conn.lost is None:
            return conn
        self._conn = None
        target, timeout = self._target, self._store.timeout
        fresh: _Resp | None = None

        def made() -> _Resp:
            nonlocal fresh
            fresh = _Resp(self.loop)
            return fresh

        try:
            async with asyncio.timeout(timeout):
                if "path" in target:
                    await self.loop.create_unix_connection(made, target["path"])
                else:
                    await self.loop.create_connection(made, target.get("host", "localhost"),
                                                      int(target.get("port", 6379)))
                assert fresh is not None
                if target.get("password"):
                    login = [target["password"]]
                    if target.get("username"):
                        login.insert(0, target["username"])
                    await _answer(fresh.command("AUTH", *login))
                if target.get("db"):
                    await _answer(fresh.command("SELECT", int(target["db"])))
        except BaseException as exc:
            if fresh is not None:
                fresh.fail(RedisConnectionError("not connected"))
            if isinstance(exc, TimeoutError):
                raise RedisTimeoutError(f"no answer from Redis at {self._store.url} within "
                                        f"{timeout:g} s") from None
            if isinstance(exc, OSError):
                raise RedisConnectionError(
                    f"cannot reach Redis at {self._store.url}: {exc}") from exc
            raise
        if self.closed:
            fresh.fail(RedisConnectionError("the binding store is closed"))
            raise StoreError("the binding store is closed")
        self._conn = fresh
        return fresh

    async def _send(self, bindings: list[Binding]) -> list[bytes]:
        """One script call for all (in order); the previous encoded binding of each, or b''.
        A connection found closed (Redis restarted, or closed it while idle) is opened again
        and the call sent once more, as redis-py retries (the script is idempotent)."""
        args: list[str | bytes | int] = [self._store.prefix]
        for b in bindings:
            args += (b.sandbox_id, b.node_id, b.encode())
        reused = self._conn is not None and self._conn.lost is None
        try:
            return await self._script(await self._connection(), args)
        except RedisConnectionError:
            if not reused:
                raise
        return await self._script(await self._connection(), args)

    async def _script(self, conn: _Resp, args: list[str | bytes | int]) -> list[bytes]:
        timer = self.loop.call_later(self._store.timeout, self._timed_out, conn)
        try:
            try:
                return list(await _answer(conn.command("EVALSHA", _RECORD_SHA, 0, *args)))
            except ResponseError as exc:
                if not str(exc).startswith("NOSCRIPT"):
                    raise
                # Redis restarted or its scripts were flushed: the body once, cached again.
                return list(await _answer(conn.command("EVAL", _RECORD, 0, *args)))
        finally:
            timer.cancel()

    def _timed_out(self, conn: _Resp) -> None:
        conn.fail(RedisTimeoutError(f"no answer from Redis at {self._store.url} within "
                                    f"{self._store.timeout:g} s"))

    def close(self) -> None:
        """From any thread: no more writes; the connection goes (on its loop)."""
        self.closed = True
        conn = self._conn
        if conn is None:
            return
        with contextlib.suppress(RuntimeError):  # its loop is closed: so is the connection
            self.loop.call_soon_threadsafe(
                conn.fail, RedisConnectionError("the binding store is closed"))


_RECORD_SHA = hashlib.sha1(_RECORD.encode()).hexdigest()
#: what a Redis URL may carry for _LoopWriter's own connections (anything else, e.g. TLS or
#: socket options: binding writes go through the writer thread and redis-py)
_LOOP_TARGET_KEYS = {"path", "host", "port", "db", "username", "password", "connection_class"}


def _loop_target(url: str, auth: RedisAuth) -> dict[str, Any] | None:
    """Where _LoopWriter connects (unix socket or plain TCP, with the login), or None."""
    try:
        options = parse_url(url)
    except ValueError:
        return None
    if not options.keys() <= _LOOP_TARGET_KEYS:
        return None
    kind = options.pop("connection_class", None)
    if kind not in (None, UnixDomainSocketConnection):
        return None
    # as redis-py's from_url: what the URL says wins over the keyword arguments
    return {**auth.connect_kwargs(), **options}


class Store:
    """Blocking access to the scheduler's keys, safe from many threads (the binding writer, the
    server's pool for heartbeats and releases, tests).
    One connection pool; every call is one round trip. Blocking redis-py (with hiredis when
    installed) costs ~30-50 us of CPU per call here against ~75 us for redis.asyncio."""

    def __init__(
        self, url: str, prefix: str = DEFAULT_PREFIX, timeout: float = REDIS_TIMEOUT_S,
        auth: RedisAuth | None = None,
    ) -> None:
        self.url = shown_url(url)  # for messages: no password
        self.prefix = prefix
        self.timeout = timeout
        try:
            # A bounded pool that queues: a burst of concurrent RPCs waits for a connection
            # instead of opening one each (and failing past the client's limit).
            pool = redis.BlockingConnectionPool.from_url(
                url, max_connections=MAX_CONNECTIONS, timeout=POOL_TIMEOUT_S,
                socket_timeout=timeout, socket_connect_timeout=timeout,
                **(auth or RedisAuth()).connect_kwargs(),
            )
            self.redis = redis.Redis(connection_pool=pool)
        except ValueError as exc:
            raise StoreError(f"bad Redis URL {self.url!r}: {exc}") from exc
        self._record = self.redis.register_script(_RECORD)
        self._release = self.redis.register_script(_RELEASE)
        self._heartbeat = self.redis.register_script(_HEARTBEAT)
        self._group = _GroupCommit(self.record_many)
        # record_async's writer on the loop (one at a time: the loop of the latest caller)
        self._loop_target = _loop_target(url, auth or RedisAuth())
        self._loop_writer: _LoopWriter | None = None
        self._closed = False

    def _key(self, name: str) -> str:
        return self.prefix + name

    def ping(self) -> None:
        try:
            self.redis.ping()
        except (RedisError, OSError) as exc:
            raise StoreError(f"cannot reach Redis at {self.url}: {exc}") from exc

    def close(self) -> None:
        self._closed = True
        if self._loop_writer is not None:
            self._loop_writer.close()
        self._group.close()
        self.redis.close()
        self.redis.connection_pool.disconnect()

    # --- bindings ---------------------------------------------------------------------------------

    def record(self, binding: Binding, apply: Apply | None = None) -> Binding | None:
        """Write a binding; returns the one it replaced. Batched with concurrent writers;
        `apply(replaced)` runs once Redis has it, in the order Redis applied the writes."""
        waiter: Future[bytes] = Future()
        self._group.submit(binding, apply, waiter)
        return self._decoded(binding, waiter.result())

    async def record_async(self, binding: Binding, apply: Apply | None = None) -> Binding | None:
        """`record` for an event loop: sent from the loop itself (_LoopWriter) where the URL
        allows, else through the writer thread; waits for Redis without holding a thread.
        Writes of one loop are applied in Redis's order; `record` (from threads) is a writer of
        its own beside it."""
        loop = asyncio.get_running_loop()
        writer = self._loop_writer
        if writer is None or writer.loop is not loop:
            writer = self._writer_for(loop)
        if writer is None:
            waiter: asyncio.Future[bytes] = loop.create_future()
            self._group.submit(binding, apply, waiter)
            return self._decoded(binding, await waiter)
        return self._decoded(binding, await writer.submit(binding, apply))

    def _writer_for(self, loop: asyncio.AbstractEventLoop) -> _LoopWriter | None:
        if self._loop_target is None:
            return None
        if self._closed:
            raise StoreError("the binding store is closed")
        if self._loop_writer is not None:  # a loop before this one (tests run several)
            self._loop_writer.close()
        self._loop_writer = _LoopWriter(self, loop, self._loop_target)
        return self._loop_writer

    @staticmethod
    def _decoded(binding: Binding, old: bytes) -> Binding | None:
        return Binding.decode(binding.sandbox_id, old.decode()) if old else None

    def record_many(self, bindings: list[Binding]) -> list[bytes]:
        """One script call for all (in order); the previous encoded binding of each, or b''."""
        args: list[str] = [self.prefix]
        for b in bindings:
            args += (b.sandbox_id, b.node_id, b.encode())
        return list(self._record(args=args))

    def release(self, sandbox_id: str) -> Binding | None:
        old = self._release(args=[self.prefix, sandbox_id, now_ms()])
        return Binding.decode(sandbox_id, old.decode()) if old else None

    def lookup(self, sandbox_id: str) -> Binding | None:
        raw = self.redis.hget(self._key("bindings"), sandbox_id)
        return Binding.decode(sandbox_id, raw.decode()) if raw else None

    def lookup_many(self, sandbox_ids: list[str]) -> dict[str, Binding]:
        if not sandbox_ids:
            return {}
        raws = self.redis.hmget(self._key("bindings"), sandbox_ids)
        return {
            sid: Binding.decode(sid, raw.decode())
            for sid, raw in zip(sandbox_ids, raws, strict=True)
            if raw
        }

    def all_bindings(self) -> dict[str, Binding]:
        out: dict[str, Binding] = {}
        for raw_id, raw in self.redis.hscan_iter(self._key("bindings"), count=5000):
            sid = raw_id.decode()
            out[sid] = Binding.decode(sid, raw.decode())
        return out

    def node_sandboxes(self, node_ids: Iterable[str]) -> dict[str, set[str]]:
        ids = list(node_ids)
        with self.redis.pipeline(transaction=False) as pipe:
            for node_id in ids:
                pipe.smembers(self._key(f"node:{node_id}:sandboxes"))
            answers = pipe.execute()
        return {n: {s.decode() for s in members} for n, members in zip(ids, answers, strict=True)}

    def binding_count(self) -> int:
        return int(self.redis.hlen(self._key("bindings")))

    # --- nodes ------------------------------------------------------------------------------------

    def heartbeat(
        self, status: pb.NodeStatus, grace_ms: int, at_ms: int | None = None
    ) -> tuple[list[str], list[str]]:
        """Store the status (without its sandbox list) and reconcile; returns (added, dropped).
        A sandbox bound to another node is never moved here (only RecordAssignment moves)."""
        args: list[str | bytes | int] = [
            self.prefix, status.node_id, _slim(status), at_ms or now_ms(), grace_ms,
        ]
        for sandbox in status.sandboxes:
            args += [sandbox.sandbox_id, sandbox.team_id]
        added, dropped = self._heartbeat(args=args)
        return [s.decode() for s in added], [s.decode() for s in dropped]

    def touch(self, status: pb.NodeStatus, at_ms: int) -> None:
        """Store the status and the heartbeat's time only (nothing to reconcile)."""
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.hset(self._key("nodes"), status.node_id, _slim(status))
            pipe.hset(self._key("seen"), status.node_id, at_ms)
            pipe.execute()

    def nodes(self) -> dict[str, tuple[pb.NodeStatus, int]]:
        """Every registered node's last status and last heartbeat (wall-clock ms)."""
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.hgetall(self._key("nodes"))
            pipe.hgetall(self._key("seen"))
            statuses, seen = pipe.execute()
        out: dict[str, tuple[pb.NodeStatus, int]] = {}
        for raw_id, raw in statuses.items():
            node_id = raw_id.decode()
            out[node_id] = (pb.NodeStatus.FromString(raw), int(seen.get(raw_id, b"0")))
        return out

    def seen(self) -> dict[str, int]:
        raw = self.redis.hgetall(self._key("seen"))
        return {k.decode(): int(v) for k, v in raw.items()}

    def forget_node(self, node_id: str) -> None:
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.hdel(self._key("nodes"), node_id)
            pipe.hdel(self._key("seen"), node_id)
            pipe.execute()

    # --- the scheduler's own clock ------------------------------------------------------------------

    def mark_alive(self, grace_ms: int) -> int | None:
        """Write this sweep's time, drop release markers older than the grace; returns the
        previous alive time (how long the scheduler was away, at start)."""
        at = now_ms()
        with self.redis.pipeline(transaction=True) as pipe:
            pipe.getset(self._key("alive"), at)
            pipe.zremrangebyscore(self._key("released"), "-inf", at - grace_ms)
            previous, _ = pipe.execute()
        return int(previous) if previous else None
