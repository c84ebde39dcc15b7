"""One redirected guest connection (Conn), from accept to close, and a slot's table entry
(Slot): its entry from the node and the connections it holds."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import socket
import struct
from dataclasses import dataclass, field
from ipaddress import IPv4Address
from typing import Any, Protocol

from agentenv.logs import PerKeyLimit
from agentenv.network.control import SlotEntry
from agentenv.network.egress.metrics import Counters
from agentenv.network.policy import EgressProxy


class ConnOwner(Protocol):
    """What a connection (and its pumps) use of the proxy that accepted it."""

    loop: asyncio.AbstractEventLoop
    counters: Counters
    events: PerKeyLimit
    buffer: bytearray  # the copy pumps' shared read buffer, and a view of it
    view: memoryview

    def unregister(self, conn: Conn) -> None: ...


class Pump(Protocol):
    """One direction of a connection's bytes (pumps.py)."""

    def start(self) -> None: ...

    def stop(self) -> None: ...

    @property
    def done(self) -> bool: ...


def close_with_reset(sock: socket.socket) -> None:
    """Close with a reset (SO_LINGER 0), so the peer sees a refusal, not a hang or a clean end."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


@dataclass
class Slot:
    """A slot of the table: the node's entry for it and the connections it holds."""

    entry: SlotEntry
    conns: set[Conn] = field(default_factory=set)  # egress connections
    metadata: set[Conn] = field(default_factory=set)  # metadata and resolver connections
    dns_inflight: int = 0  # UDP queries being forwarded
    lookups: int = 0  # name lookups (NameAnswers) its connections wait for


@dataclass
class Tunnel:
    """A TLS connection to the slot's SOCKS5 proxy (streams own its socket)."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter


class Conn:
    """One redirected guest connection, from accept to close."""

    __slots__ = ("closed", "decided", "dst_ip", "dst_port", "guest", "last_active", "name", "proxy",
                 "pumps", "slot", "source", "started", "task", "transports", "tunnel",
                 "upstream", "via")

    def __init__(self, proxy: ConnOwner, guest: socket.socket, source: str,
                 dst_ip: IPv4Address, dst_port: int) -> None:
        self.proxy, self.guest, self.source = proxy, guest, source
        self.dst_ip, self.dst_port = dst_ip, dst_port
        self.name: str | None = None
        self.via: EgressProxy | None = None
        self.upstream: socket.socket | None = None
        self.pumps: tuple[Pump, Pump] | None = None
        self.tunnel: Tunnel | None = None  # a TLS connection to the SOCKS5 proxy
        self.transports: list[asyncio.BaseTransport] = []  # when streams own the sockets
        self.task: asyncio.Task[None] | None = None
        self.closed = False
        self.decided = False  # allowed and connected: a policy update re-decides it
        self.started = self.last_active = proxy.loop.time()
        self.slot: Slot | None = None

    def describe(self) -> dict[str, Any]:
        return {"source": self.source, "dst": f"{self.dst_ip}:{self.dst_port}", "host": self.name}

    def _stop(self) -> None:
        self.closed = True
        if self.pumps is not None:
            for pump in self.pumps:
                pump.stop()
        # A sock_recv/sock_connect of the task may still watch these fds: unwatch them before
        # they are closed, so a new socket given the same number is not unwatched later.
        loop = self.proxy.loop
        for sock in (self.guest, self.upstream):
            if sock is not None and sock.fileno() >= 0:
                with contextlib.suppress(RuntimeError):  # owned by a transport: it unwatches
                    loop.remove_reader(sock.fileno())
                    loop.remove_writer(sock.fileno())
        if self.task is not None and self.task is not asyncio.current_task():
            self.task.cancel()
        self.proxy.unregister(self)

    def reset(self) -> None:
        """Cut both sides with a reset."""
        if self.closed:
            return
        self._stop()
        for transport in self.transports:
            sock = transport.get_extra_info("socket")
            if sock is not None:
                with contextlib.suppress(OSError):
                    sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
            transport.abort()
        close_with_reset(self.guest)
        if self.upstream is not None:
            close_with_reset(self.upstream)

    def refuse(self, reason: str, kind: str | None = None,
               fields: dict[str, Any] | None = None) -> None:
        """Denied (now or by a later request head or policy): reset, log, count."""
        if self.closed:
            return
        counters = self.proxy.counters
        counters.denied += 1
        if kind is not None:
            setattr(counters, kind, getattr(counters, kind) + 1)
        self.proxy.events.log(self.source, kind or "denied", logging.INFO, "egress denied", {
            "event": "denied", "reason": reason, **(fields or {}), **self.describe()})
        self.reset()

    def close(self) -> None:
        if self.closed:
            return
        self._stop()
        for transport in self.transports:
            transport.close()
        self.guest.close()
        if self.upstream is not None:
            self.upstream.close()

    def broken(self, exc: OSError, side: str) -> None:
        """A side failed (usually a reset by its peer): pass it on as a reset."""
        if exc.errno not in (errno.ECONNRESET, errno.EPIPE, errno.ETIMEDOUT):
            self.proxy.events.log(self.source, "broken", logging.INFO,
                                  "egress connection failed", {
                                      "event": "broken", "side": side, "error": str(exc),
                                      **self.describe()})
        self.reset()

    def half_closed(self) -> None:
        if self.pumps is not None and all(p.done for p in self.pumps):
            self.close()
