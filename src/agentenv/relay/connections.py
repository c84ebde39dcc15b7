"""Bounds on the connections one server (a node, the gateway) holds open.

A connection that is not serving a request (it sent nothing yet, or it is kept alive between
requests, or part of a request head is in) costs a descriptor and memory and nothing else, and
a client may open as many as it likes: each would last until its idle or head timeout (30 s),
and a cheap request renews it. Two bounds, nginx's `limit_conn` and Go's idle-connection
eviction in spirit:

- `AENV_IDLE_CONNECTIONS_PER_CLIENT` (default 256; 0 = none): a client address (an IPv6
  client's /64) that opens a connection while holding this many idle ones loses its oldest idle
  one. Connections serving a request are not counted: one trainer may stream thousands of
  commands at once. A proxy the operator trusts (AENV_TRUSTED_PROXIES) speaks for many clients
  and has no per-client bound.
- `AENV_MAX_CONNECTIONS` (default: half the open-file limit, at most 16384; 0 = none): with this
  many open, a new connection takes the place of the oldest idle one anywhere; if none is idle
  it is answered 503 naming the setting and closed.

An idle connection closed so is what a client already handles: the server closing a kept-alive
connection (HTTP clients open a new one). WebSocket connections leave this accounting when they
upgrade (they serve a session; the concurrent request cap counts them).
"""

from __future__ import annotations

import ipaddress
import logging
import os
import resource
from collections import OrderedDict
from collections.abc import Mapping
from typing import Protocol

from agentenv.logs import Sampled
from agentenv.relay.concurrency import whole_number_setting

log = logging.getLogger("agentenv.relay.connections")

PER_CLIENT_SETTING = "AENV_IDLE_CONNECTIONS_PER_CLIENT"
TOTAL_SETTING = "AENV_MAX_CONNECTIONS"
DEFAULT_IDLE_PER_CLIENT = 256
MAX_DEFAULT_TOTAL = 16384


class Connection(Protocol):
    """What the limits need of a server connection (relay/server.py's protocol)."""

    def is_idle(self) -> bool: ...

    def close_idle(self) -> None: ...


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


class ConnectionLimits:
    """The open connections of one server, by client, with the two bounds above."""

    def __init__(self, idle_per_client: int, total: int,
                 trusted: list[str] | None = None) -> None:
        self.idle_per_client = idle_per_client
        self.total = total
        self._trusted = [ipaddress.ip_network(t, strict=False) for t in trusted or []]
        # every tracked connection -> its client key, least recently active first
        self._open: dict[Connection, str] = {}
        self._by_client: dict[str, OrderedDict[Connection, None]] = {}  # oldest first
        self.reclaimed = Sampled()  # idle connections closed to make room
        self.refused = Sampled()  # connections refused: the total reached, none idle

    @classmethod
    def from_env(cls, trusted: list[str] | None = None,
                 env: Mapping[str, str] | None = None) -> ConnectionLimits:
        env = os.environ if env is None else env
        per_client = whole_number_setting(env, PER_CLIENT_SETTING, DEFAULT_IDLE_PER_CLIENT)
        total = whole_number_setting(env, TOTAL_SETTING,
                              min(raise_open_files() // 2, MAX_DEFAULT_TOTAL))
        return cls(per_client, total, trusted)

    def __len__(self) -> int:
        return len(self._open)

    def _is_trusted(self, address: str) -> bool:
        try:
            ip = ipaddress.ip_address(address)
        except ValueError:
            return False
        return any(ip in net for net in self._trusted)

    def admit(self, conn: Connection, address: str) -> str | None:
        """Track a new connection from `address`, making room by closing idle ones; the
        reason it is refused (the caller answers 503 and closes it), or None."""
        if self.total and len(self._open) >= self.total:
            victim = next((c for c in self._open if c.is_idle()), None)
            if victim is None:
                if self.refused.tick():
                    log.warning("connection refused: the server holds its connection limit",
                                extra={"limit": self.total, "refused": self.refused.count})
                return (f"the server holds its limit of {self.total} open connections, none "
                        f"of them idle ({TOTAL_SETTING}); try again shortly")
            self._reclaim(victim, "the server's connection limit", address)
        key = client_key(address)
        own = self._by_client.setdefault(key, OrderedDict())
        # its idle ones are counted only when it holds enough connections to be over
        if (self.idle_per_client and len(own) >= self.idle_per_client
                and not self._is_trusted(address)):
            idle = [c for c in own if c.is_idle()]
            if len(idle) >= self.idle_per_client:
                self._reclaim(idle[0], "the client's idle connection limit", address)
        self._open[conn] = key
        own[conn] = None
        return None

    def active(self, conn: Connection) -> None:
        """`conn` served a request: it is now the newest of its client's (the last reclaimed)."""
        key = self._open.get(conn)
        if key is not None:
            self._open[conn] = self._open.pop(conn)
            self._by_client[key].move_to_end(conn)

    def release(self, conn: Connection) -> None:
        """`conn` closed or left this accounting (a WebSocket upgrade); idempotent."""
        key = self._open.pop(conn, None)
        if key is None:
            return
        own = self._by_client[key]
        own.pop(conn, None)
        if not own:
            del self._by_client[key]

    def _reclaim(self, victim: Connection, why: str, address: str) -> None:
        self.release(victim)
        victim.close_idle()
        if self.reclaimed.tick():
            log.info("idle connection closed to make room",
                     extra={"why": why, "client": address, "reclaimed": self.reclaimed.count})
