"""Bounds on the connections one server (a node, the gateway) holds open.

A connection costs a descriptor and memory, and a client may open as many as it likes. Each is,
at any moment, in one of three states (relay/server.py tells which, as it changes):

- idle: serving no request (it sent nothing yet, it is kept alive between requests, a request
  head is arriving, or a TLS handshake is under way). It would last until its idle or head
  timeout (30 s), and a cheap request renews it.
- busy: serving a request whose answer flows (or is not due yet: a long poll, a stream).
- stalled: its writes are paused: the transport holds more than its high-water mark (64 KiB)
  that the client does not take. A client that pipelines requests and never reads the answers
  holds such connections "serving a request" for ever otherwise.

Bounds, nginx's `limit_conn` and `send_timeout` and Go's idle-connection eviction in spirit:

- `AENV_IDLE_CONNECTIONS_PER_CLIENT` (default 256; 0 = none): a client address (an IPv6
  client's /64) that opens a connection while holding this many idle ones loses its least
  recently active idle one. Busy connections are not counted: one trainer may stream thousands
  of commands at once.
- `AENV_STALLED_CONNECTIONS_PER_CLIENT` (default 256; 0 = none): a client with more stalled
  connections loses its longest stalled one (aborted). Only paused writes count: streams a
  client reads are never stalled for long, and the longest stalled goes first.
- `AENV_SEND_TIMEOUT` (seconds, default 60 as nginx's; 0 = none): a connection with bytes
  queued for its client (stalled, or done writing, even closed, with some left) whose client
  took nothing of them for that long is aborted; one that took some is given another period (a
  slow reader, not a dead one). It is also every socket's TCP_USER_TIMEOUT, for what the
  protocol no longer sees (a WebSocket after its upgrade).
- `AENV_MAX_CONNECTIONS` (default: half the open-file limit, at most 16384; 0 = none): with this
  many open, a new connection takes the place of the least recently active idle connection of
  the client holding the most idle ones (a flood evicts its own first), else of the longest
  stalled one anywhere; only when every connection is busy is it answered 503 naming the
  setting and closed.
- `AENV_TLS_HANDSHAKE_TIMEOUT` (seconds, default 10; 0 = asyncio's 60): where the server
  speaks TLS, a handshake not done by then ends the connection. A handshaking connection is
  counted (as idle) from its TCP accept.
- `AENV_BODY_TIMEOUT` (seconds, default 60 as nginx's `client_body_timeout`; 0 = none): a
  request body that brings no byte for that long while the server waits for it is cut: 408
  naming the setting when no answer has started, else the connection is aborted. The server
  does not wait while it has stopped reading (the app has not taken what came: an upstream
  that reads slowly) or before it asked for a body announced with `Expect: 100-continue`; the
  period counts from the last byte or the server's last ask, whichever is later. Streams a
  client keeps open on purpose send something more often (the E2B SDK's stdin stream a
  keepalive every 50 s).
- `AENV_BODY_CONNECTIONS_PER_CLIENT` (default 256; 0 = none): connections whose request body
  is still arriving, per client. A request with a body past it is answered 429 naming the
  setting before its body is read, and its connection closed. A body sent slowly on purpose
  is busy, not stalled or idle: without this bound one client held a place of the sandbox (and
  of its team's share at the gateway) per connection for as long as it kept a body coming.

A proxy the operator trusts (AENV_TRUSTED_PROXIES) speaks for many clients and has no
per-client bound of its own. The connection bounds apply at the TCP accept, before any header,
so they know only the peer; a request body is counted once its head is read, against the
client a proxy relays it for: the address in X-Forwarded-For (the right-most no trusted proxy
added, as uvicorn names the client to the app) when the peer is a trusted proxy or the request
is vouched for (`vouch`: a node of a cluster takes a request carrying its node key as its
gateway's, which writes that header itself and drops the client's). Else, and for a proxy's
own requests (no such header), the peer: a trusted proxy's unbounded. Without this every
request reached a node of a cluster from its gateway, one client to the node, and a stranger
sending slow bodies through the gateway had every team's requests with a body on that node
refused. What anyone else writes in X-Forwarded-For counts for nothing.

An idle connection closed so is what a client already handles: the server closing a
kept-alive connection (HTTP clients open a new one). WebSocket connections leave this
accounting when they upgrade (they serve a session; the concurrent request cap counts them, and
relay/websocket.py bounds what one holds).

Idle and stalled connections are kept in their own ordered structures, per client and
server-wide, with the clients ranked by how many idle connections they hold: admitting a
connection never walks the others.
"""

from __future__ import annotations

import enum
import ipaddress
import logging
import resource
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

from agentenv.logs import Sampled
from agentenv.relay.concurrency import whole_number_setting

log = logging.getLogger("agentenv.relay.connections")

PER_CLIENT_SETTING = "AENV_IDLE_CONNECTIONS_PER_CLIENT"
STALLED_SETTING = "AENV_STALLED_CONNECTIONS_PER_CLIENT"
TOTAL_SETTING = "AENV_MAX_CONNECTIONS"
SEND_TIMEOUT_SETTING = "AENV_SEND_TIMEOUT"
HANDSHAKE_SETTING = "AENV_TLS_HANDSHAKE_TIMEOUT"
BODY_TIMEOUT_SETTING = "AENV_BODY_TIMEOUT"
BODY_PER_CLIENT_SETTING = "AENV_BODY_CONNECTIONS_PER_CLIENT"
DEFAULT_IDLE_PER_CLIENT = 256
DEFAULT_STALLED_PER_CLIENT = 256
MAX_DEFAULT_TOTAL = 16384
DEFAULT_SEND_TIMEOUT = 60
DEFAULT_HANDSHAKE_TIMEOUT = 10
DEFAULT_BODY_TIMEOUT = 60
DEFAULT_BODY_PER_CLIENT = 256
FORWARDED_FOR = b"x-forwarded-for"

#: whether a request's headers show it comes from a proxy that names its client (a node of a
#: cluster: its gateway's node key)
Vouch = Callable[[Sequence[tuple[bytes, bytes]]], bool]


class State(enum.Enum):
    IDLE = "idle"
    BUSY = "busy"
    STALLED = "stalled"


class Connection(Protocol):
    """What the limits need of a server connection (relay/server.py's protocol)."""

    def close_idle(self) -> None:
        """Close it, idle: as its keep-alive timeout would."""

    def abort(self) -> None:
        """Drop it, stalled: what is queued for the client is discarded."""


def client_key(address: str) -> str:
    """Whose bound a client address counts against: an IPv6 client's /64 (a host holds a whole
    /64 and could take a fresh address per connection), an IPv4 one's own address."""
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return str(ip.ipv4_mapped)
        return str(ipaddress.IPv6Network((ip, 64), strict=False))
    return address


def raise_open_files() -> int:
    """Raise this process's soft open-file limit to its hard one (systemd's default soft limit
    is 1024, which a few hundred sandboxes' streams reach); return the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 1 << 20)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        except (ValueError, OSError):
            pass
    return soft


def _forwarded_host(item: str) -> str:
    """The address of one X-Forwarded-For item: `host`, `ipv4:port` or `[ipv6]:port`."""
    if item.startswith("["):
        return item[1:item.find("]")] if "]" in item else item
    if item.count(":") == 1:
        return item.rsplit(":", 1)[0]
    return item


class _Client:
    """One client's idle connections (least recently active first) and stalled ones (longest
    stalled first), and how many it has in all."""

    __slots__ = ("count", "idle", "stalled")

    def __init__(self) -> None:
        self.idle: OrderedDict[Connection, None] = OrderedDict()
        self.stalled: OrderedDict[Connection, None] = OrderedDict()
        self.count = 0


class _Ranking:
    """Clients by how many idle connections each holds, the most found at once: a count moves
    by one at a time, so the top moves by at most one."""

    def __init__(self) -> None:
        self._by_count: dict[int, dict[str, None]] = {}  # in each, first to reach it first
        self._top = 0

    def moved(self, key: str, old: int, new: int) -> None:
        if old:
            holders = self._by_count[old]
            del holders[key]
            if not holders:
                del self._by_count[old]
        if new:
            self._by_count.setdefault(new, {})[key] = None
        if new > self._top or (old == self._top and old not in self._by_count):
            self._top = new

    def top(self) -> str | None:
        holders = self._by_count.get(self._top)
        return next(iter(holders)) if holders else None


class _Entry:
    __slots__ = ("body", "key", "state", "trusted")

    def __init__(self, key: str, trusted: bool) -> None:
        self.key = key
        self.state = State.IDLE
        self.trusted = trusted
        self.body: str | None = None  # whose body it is receiving (a client key), if any


class ConnectionLimits:
    """The open connections of one server, by client and state, with the bounds above."""

    def __init__(self, idle_per_client: int, total: int, trusted: list[str] | None = None, *,
                 stalled_per_client: int = DEFAULT_STALLED_PER_CLIENT,
                 send_timeout: float = DEFAULT_SEND_TIMEOUT,
                 handshake_timeout: float = DEFAULT_HANDSHAKE_TIMEOUT,
                 body_timeout: float = DEFAULT_BODY_TIMEOUT,
                 body_per_client: int = DEFAULT_BODY_PER_CLIENT,
                 vouch: Vouch | None = None) -> None:
        self.idle_per_client = idle_per_client
        self.stalled_per_client = stalled_per_client
        self.total = total
        self.send_timeout = send_timeout
        self.handshake_timeout = handshake_timeout
        self.body_timeout = body_timeout
        self.body_per_client = body_per_client
        self._trusted = [ipaddress.ip_network(t, strict=False) for t in trusted or []]
        self.vouch = vouch
        self._bodies: dict[str, int] = {}  # client key -> its bodies arriving
        self._open: dict[Connection, _Entry] = {}
        self._clients: dict[str, _Client] = {}
        self._stalled: OrderedDict[Connection, None] = OrderedDict()  # longest stalled first
        self._ranking = _Ranking()
        self._idle = 0
        self._receiving = 0
        self.reclaimed = Sampled()  # idle connections closed to make room
        self.aborted = Sampled()  # stalled connections aborted to make room
        self.refused = Sampled()  # connections refused: the total reached, all busy
        self.send_timeouts = Sampled()  # connections cut by the send timeout (or the kernel's)
        self.handshake_failures = Sampled()  # TLS handshakes failed or not done in time
        self.body_timeouts = Sampled()  # request bodies that stopped coming
        self.body_refused = Sampled()  # requests refused: their client's bodies at the bound

    @classmethod
    def from_env(cls, trusted: list[str] | None = None,
                 env: Mapping[str, str] | None = None,
                 vouch: Vouch | None = None) -> ConnectionLimits:
        return cls(
            whole_number_setting(env, PER_CLIENT_SETTING, DEFAULT_IDLE_PER_CLIENT),
            whole_number_setting(env, TOTAL_SETTING,
                                 min(raise_open_files() // 2, MAX_DEFAULT_TOTAL)),
            trusted,
            stalled_per_client=whole_number_setting(env, STALLED_SETTING,
                                                    DEFAULT_STALLED_PER_CLIENT),
            send_timeout=whole_number_setting(env, SEND_TIMEOUT_SETTING, DEFAULT_SEND_TIMEOUT),
            handshake_timeout=whole_number_setting(env, HANDSHAKE_SETTING,
                                                   DEFAULT_HANDSHAKE_TIMEOUT),
            body_timeout=whole_number_setting(env, BODY_TIMEOUT_SETTING, DEFAULT_BODY_TIMEOUT),
            body_per_client=whole_number_setting(env, BODY_PER_CLIENT_SETTING,
                                                 DEFAULT_BODY_PER_CLIENT),
            vouch=vouch)

    def __len__(self) -> int:
        return len(self._open)

    @property
    def idle(self) -> int:
        return self._idle

    @property
    def stalled(self) -> int:
        return len(self._stalled)

    @property
    def receiving(self) -> int:
        """Connections whose request body is arriving."""
        return self._receiving

    def state(self, conn: Connection) -> State | None:
        entry = self._open.get(conn)
        return entry.state if entry is not None else None

    def _is_trusted(self, address: str) -> bool:
        if not self._trusted:
            return False
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return False
        return any(ip in net for net in self._trusted)

    def forwarded_client(self, headers: Sequence[tuple[bytes, bytes]]) -> str | None:
        """The client X-Forwarded-For names (its items in order, every such header joined):
        the right-most address no trusted proxy added, else the first; None when there is none
        or that item is empty. Only for a request from a proxy that may name it."""
        values = [value for name, value in headers if name == FORWARDED_FOR]
        if not values:
            return None
        items = [i.strip() for i in b",".join(values).decode("latin-1").split(",")]
        for item in reversed(items):
            host = _forwarded_host(item)
            if not self._is_trusted(host):
                return host or None
        return _forwarded_host(items[0]) or None

    def _body_client(self, entry: _Entry, headers: Sequence[tuple[bytes, bytes]]
                     ) -> tuple[str, bool]:
        """Whose bound a request body on `entry` counts against, and whether it is bounded."""
        if entry.trusted or (self.vouch is not None and self.vouch(headers)):
            forwarded = self.forwarded_client(headers)
            if forwarded is not None:
                return client_key(forwarded), True
        return entry.key, not entry.trusted

    def admit(self, conn: Connection, address: str) -> str | None:
        """Track a new connection from `address` (idle), making room by closing idle or
        stalled ones; the reason it is refused (the caller answers 503 and closes it), or
        None."""
        if self.total and len(self._open) >= self.total:
            most = self._ranking.top()
            if most is not None:
                self._reclaim(next(iter(self._clients[most].idle)),
                              "the server's connection limit", address)
            elif self._stalled:
                self._abort(next(iter(self._stalled)), "the server's connection limit", address)
            else:
                if self.refused.tick():
                    log.warning("connection refused: the server holds its connection limit",
                                extra={"limit": self.total, "refused": self.refused.count})
                return (f"the server holds its limit of {self.total} open connections, all "
                        f"of them serving a request ({TOTAL_SETTING}); try again shortly")
        key = client_key(address)
        trusted = self._is_trusted(address)
        client = self._clients.get(key)
        if client is None:
            client = self._clients[key] = _Client()
        elif (self.idle_per_client and len(client.idle) >= self.idle_per_client
              and not trusted):
            self._reclaim(next(iter(client.idle)), "the client's idle connection limit", address)
        self._open[conn] = _Entry(key, trusted)
        client.count += 1
        self._enter(conn, client, key, State.IDLE)
        return None

    def set_state(self, conn: Connection, state: State) -> None:
        """`conn` is now `state` (untracked ones are ignored). Becoming idle makes it its
        client's most recently active; becoming stalled, its client's most recently stalled,
        which may abort the client's longest stalled one."""
        entry = self._open.get(conn)
        if entry is None or entry.state is state:
            return
        client = self._clients[entry.key]
        self._leave(conn, client, entry)
        entry.state = state
        self._enter(conn, client, entry.key, state)
        if (state is State.STALLED and self.stalled_per_client and not entry.trusted
                and len(client.stalled) > self.stalled_per_client):
            self._abort(next(iter(client.stalled)), "the client's stalled connection limit",
                        entry.key)

    def begin_body(self, conn: Connection,
                   headers: Sequence[tuple[bytes, bytes]] = ()) -> str | None:
        """`conn` starts receiving the body of a request with these `headers`; the reason it
        may not (the caller answers 429 and closes it), or None."""
        entry = self._open.get(conn)
        if entry is None or entry.body is not None:
            return None
        key, bounded = self._body_client(entry, headers)
        arriving = self._bodies.get(key, 0)
        if self.body_per_client and bounded and arriving >= self.body_per_client:
            if self.body_refused.tick():
                log.info("request refused: its client has its bound of bodies arriving",
                         extra={"client": key, "peer": entry.key,
                                "limit": self.body_per_client,
                                "refused": self.body_refused.count})
            return (f"this client has {self.body_per_client} requests whose bodies are still "
                    f"arriving, the server's bound ({BODY_PER_CLIENT_SETTING}); finish one "
                    "first")
        entry.body = key
        self._bodies[key] = arriving + 1
        self._receiving += 1
        return None

    def end_body(self, conn: Connection) -> None:
        """`conn` has received its request body (or will not); idempotent."""
        entry = self._open.get(conn)
        if entry is not None and entry.body is not None:
            key, entry.body = entry.body, None
            left = self._bodies[key] - 1
            if left:
                self._bodies[key] = left
            else:
                del self._bodies[key]
            self._receiving -= 1

    def release(self, conn: Connection) -> None:
        """`conn` closed or left this accounting (a WebSocket upgrade); idempotent."""
        self.end_body(conn)
        entry = self._open.pop(conn, None)
        if entry is None:
            return
        client = self._clients[entry.key]
        self._leave(conn, client, entry)
        client.count -= 1
        if not client.count:
            del self._clients[entry.key]

    def _enter(self, conn: Connection, client: _Client, key: str, state: State) -> None:
        if state is State.IDLE:
            client.idle[conn] = None
            self._idle += 1
            self._ranking.moved(key, len(client.idle) - 1, len(client.idle))
        elif state is State.STALLED:
            client.stalled[conn] = None
            self._stalled[conn] = None

    def _leave(self, conn: Connection, client: _Client, entry: _Entry) -> None:
        if entry.state is State.IDLE:
            del client.idle[conn]
            self._idle -= 1
            self._ranking.moved(entry.key, len(client.idle) + 1, len(client.idle))
        elif entry.state is State.STALLED:
            del client.stalled[conn]
            del self._stalled[conn]

    def _reclaim(self, victim: Connection, why: str, address: str) -> None:
        owner = self._open[victim].key
        self.release(victim)
        victim.close_idle()
        if self.reclaimed.tick():
            log.info("idle connection closed to make room",
                     extra={"why": why, "client": address, "owner": owner,
                            "reclaimed": self.reclaimed.count})

    def _abort(self, victim: Connection, why: str, address: str) -> None:
        owner = self._open[victim].key
        self.release(victim)
        victim.abort()
        if self.aborted.tick():
            log.info("stalled connection aborted: its client does not read what it asked for",
                     extra={"why": why, "client": address, "owner": owner,
                            "aborted": self.aborted.count})
