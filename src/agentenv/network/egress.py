"""The node-wide egress proxy: one process serves every slot's redirected TCP and the metadata
service (169.254.169.254:80).

How traffic reaches it: on the host, nftables redirects (prerouting, from the slots' host-side
veths) TCP to the metadata address, TCP 80/443 of slots whose policy reads names
(`proxied_ports == "web"`) and all TCP of slots with a SOCKS5 `egress_proxy` ("all") to this
process's port. A connection's source address is the slot's guest_address (the node says which
sandbox that is over the control socket, control.py); its original destination comes from
SO_ORIGINAL_DST.

Per connection:
- unknown source, over the connection caps, or a destination behind the walls (private ranges,
  loopback, link-local, multicast, an address of this host): reset at once;
- 169.254.169.254:80: the metadata service answers that slot's identity (metadata.py);
- else, on ports 80/443 only, the first bytes are read (at most PEEK_MAX, PEEK_TIMEOUT): a TLS
  ClientHello gives the SNI, an HTTP/1.x request head the Host; other ports are decided by
  address alone (a server-speaks-first protocol would wait forever for a client byte);
- `policy.decide(address, port, name)` decides; a name that decides it must resolve to the
  destination here (NameAnswers: the node's getaddrinfo), and on 80/443 a connection without
  a readable name follows the unnamed rule. Denied: reset (SO_LINGER 0), one log line with
  the reason, counted.
  Header `rules` are for plain HTTP only (a policy whose rules would cover HTTPS is refused
  by policy.py: the headers cannot be set without decrypting), so TLS is never transformed;
- allowed: a connection to the original destination, directly or through the slot's SOCKS5
  proxy (fail closed: no tunnel, no connection), the read bytes sent unchanged, then bytes are
  copied both ways unchanged. On plain HTTP every request head on the connection is checked
  again (a keep-alive connection may ask another Host) and gets the rules' headers.
A `set` that changes a slot's policy resets every live connection of that slot the new policy
denies (or whose SOCKS5 route changed); `remove` resets all of them.

With --dns-upstream it is also the filtering resolver at 169.254.169.254:53 (dns.py).

Run it as `python -m agentenv.network.egress --control SOCK --port PORT` (what process.py
does: it imports only this package, which keeps the process small) or `aenv egress-proxy`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import fcntl
import functools
import json
import logging
import os
import resource
import signal
import socket
import ssl
import stat
import struct
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from ipaddress import IPv4Address, IPv4Network
from pathlib import Path
from typing import Any

from agentenv import logs
from agentenv.logs import PerKeyLimit, trim_log
from agentenv.network import dns, httphead, metadata, sni, socks5
from agentenv.network.control import SlotEntry, SlotIdentity
from agentenv.network.policy import (
    WEB_PORTS,
    Decision,
    EgressPolicy,
    EgressProxy,
    PolicyError,
)
from agentenv.network.walls import WALL_NETS, extra_walls
from agentenv.settings import get_settings

log = logging.getLogger("agentenv.egress")

SO_ORIGINAL_DST = 80  # linux/netfilter_ipv4.h
PEEK_TIMEOUT = 10.0
PEEK_MAX = 64 << 10
CONNECT_TIMEOUT = 10.0
IDLE_TIMEOUT = 900.0
RESOLVE_TTL = 30.0
MAX_CONNECTIONS = 8192
MAX_CONNECTIONS_PER_SLOT = 1024
MIN_SLOT_SHARE = 8  # a slot's share of max_connections never falls below this
MAX_METADATA_PER_SLOT = 16
COPY_CHUNK = 256 << 10
CONTROL_LINE_MAX = 64 << 20
#: bytes of the log (this process's stderr, when a file) and its rotated tail kept on disk
LOG_MAX_BYTES = 16 << 20
LOG_CHECK_INTERVAL = 1.0
#: per slot: lines written whole in each window of seconds (the rest counted, summarized)
LOG_BURST, LOG_WINDOW = 20, 60.0

METADATA = (IPv4Address(metadata.METADATA_ADDRESS), metadata.METADATA_PORT)
RESOLVER = (IPv4Address(metadata.METADATA_ADDRESS), dns.DNS_PORT)  # the filtering resolver
NODE_SERVICES = (METADATA, RESOLVER)  # answered here, with caps apart from egress
MAX_DNS_INFLIGHT_PER_SLOT = 64
MAX_LOOKUPS_PER_SLOT = 8


class Refused(Exception):
    """A connection the proxy will not carry; the message is the logged reason, `kind` the
    Counters field that counts it besides `denied` (if any)."""

    def __init__(self, reason: str, kind: str | None = None,
                 fields: dict[str, Any] | None = None) -> None:
        super().__init__(reason)
        self.kind = kind
        self.fields = fields or {}


class _LocalAddresses:
    """This host's own addresses (and broadcast addresses), from /proc/net/fib_trie, re-read at
    most every REFRESH seconds: a destination among them would reach the host itself."""

    REFRESH = 2.0

    def __init__(self) -> None:
        self._addresses: frozenset[IPv4Address] = frozenset()
        self._read_at = -1e9

    def __contains__(self, address: IPv4Address) -> bool:
        now = time.monotonic()
        if now - self._read_at > self.REFRESH:
            with contextlib.suppress(OSError):  # out of descriptors: the last list holds
                self._addresses = self._read()
                self._read_at = now
        return address in self._addresses

    @staticmethod
    def _read() -> frozenset[IPv4Address]:
        found: set[IPv4Address] = set()
        last: str | None = None
        with open("/proc/net/fib_trie") as f:
            for line in f:
                text = line.strip()
                if text.startswith("|--"):
                    last = text[3:].strip()
                elif last and text.startswith("/32") and ("LOCAL" in text or "BROADCAST" in text):
                    found.add(IPv4Address(last))
        return frozenset(found)


class NameAnswers:
    """A name's IPv4 answers from the node's resolver (getaddrinfo: /etc/hosts, then DNS, as
    the node's nsswitch says), kept `ttl` seconds. getaddrinfo gives no record TTL, so the
    cache time is fixed (--resolve-ttl): short, so a name that moves is followed soon. One
    lookup per name at a time; a failed lookup is an empty answer, kept as long."""

    MAX_NAMES = 4096

    LOOKUP_THREADS = 64  # lookups block (getaddrinfo): threads of their own, not the loop's few

    def __init__(self, ttl: float, name_server: tuple[str, int] | None = None) -> None:
        self.ttl = ttl
        # Set: A queries to this server instead of getaddrinfo (the guests' resolver, so that
        # the proxy and the guests see the same answers).
        self.name_server = name_server
        self._threads = ThreadPoolExecutor(self.LOOKUP_THREADS, thread_name_prefix="lookup")
        self._answers: dict[str, tuple[float, frozenset[IPv4Address]]] = {}
        self._pending: dict[str, asyncio.Task[frozenset[IPv4Address]]] = {}

    def known(self, name: str) -> frozenset[IPv4Address] | None:
        """The last answers for `name` (however old), or None: for decisions that cannot wait
        (a keep-alive request head, a policy update over live connections)."""
        if (literal := _literal(name)) is not None:
            return literal
        entry = self._answers.get(name)
        return entry[1] if entry is not None else None

    def fresh(self, name: str) -> bool:
        if _literal(name) is not None:
            return True
        entry = self._answers.get(name)
        return entry is not None and entry[0] > asyncio.get_running_loop().time()

    async def answers(self, name: str) -> frozenset[IPv4Address]:
        if (literal := _literal(name)) is not None:
            return literal
        loop = asyncio.get_running_loop()
        entry = self._answers.get(name)
        if entry is not None and entry[0] > loop.time():
            return entry[1]
        task = self._pending.get(name)
        if task is None:
            task = self._pending[name] = loop.create_task(self._refresh(loop, name))
        return await asyncio.shield(task)  # a cancelled caller leaves the lookup to the others

    async def _refresh(self, loop: asyncio.AbstractEventLoop,
                       name: str) -> frozenset[IPv4Address]:
        try:
            found = await self._lookup(loop, name)
        finally:
            del self._pending[name]
        if len(self._answers) >= self.MAX_NAMES:
            now = loop.time()
            stale = [k for k, (until, _) in self._answers.items() if until <= now]
            for old in stale or list(self._answers)[: self.MAX_NAMES // 4]:
                del self._answers[old]
        self._answers[name] = (loop.time() + self.ttl, found)
        return found

    async def _lookup(self, loop: asyncio.AbstractEventLoop,
                      name: str) -> frozenset[IPv4Address]:
        if self.name_server is not None:
            qid = int.from_bytes(os.urandom(2), "big")
            try:
                answer = await dns.forward_udp(dns.a_query(name, qid), self.name_server)
                return frozenset(map(IPv4Address, dns.a_answers(answer, qid)))
            except (OSError, TimeoutError, UnicodeError, dns.DnsFormatError):
                return frozenset()
        try:
            infos = await loop.run_in_executor(self._threads, functools.partial(
                socket.getaddrinfo, name, None, socket.AF_INET, socket.SOCK_STREAM))
        except (socket.gaierror, UnicodeError):
            return frozenset()
        return frozenset(IPv4Address(info[4][0]) for info in infos)


def _literal(name: str) -> frozenset[IPv4Address] | None:
    """An address written as a name (`Host: 192.0.2.1`) is its own answer, as in getaddrinfo."""
    try:
        return frozenset((IPv4Address(name),))
    except ValueError:
        return None


@dataclass
class Counters:
    accepted: int = 0
    allowed: int = 0
    denied: int = 0
    denied_name_address: int = 0  # a name allowed, but the destination is not one of its addresses
    denied_unnamed: int = 0  # on a web port without a readable name (no SNI, no Host)
    unknown_source: int = 0
    over_capacity: int = 0
    upstream_failed: int = 0
    cut_by_update: int = 0
    idle_closed: int = 0
    evicted: int = 0  # closed because its slot held more than its share and another needed one
    metadata_requests: int = 0
    dns_answered: int = 0  # forwarded to the upstream resolver and answered
    dns_refused: int = 0  # a name the policy does not let the sandbox resolve
    dns_failed: int = 0  # malformed, over the slot's cap, or the upstream did not answer
    bytes_up: int = 0  # guest -> destination
    bytes_down: int = 0


@dataclass
class Slot:
    entry: SlotEntry
    conns: set[Conn] = field(default_factory=set)  # egress connections
    metadata: set[Conn] = field(default_factory=set)  # metadata and resolver connections
    dns_inflight: int = 0  # UDP queries being forwarded
    lookups: int = 0  # name lookups (NameAnswers) its connections wait for


def _rst(sock: socket.socket) -> None:
    """Close with a reset (SO_LINGER 0), so the peer sees a refusal, not a hang or a clean end."""
    with contextlib.suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    sock.close()


def original_destination(sock: socket.socket) -> tuple[IPv4Address, int]:
    raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    port, packed = struct.unpack_from("!2xH4s", raw)
    return IPv4Address(packed), port


class _Pump:
    """One direction of a connection between two non-blocking sockets, copied through this
    process (used where bytes must be read: the HTTP request direction), driven by the event
    loop's readiness callbacks (no task per connection). Reads go through one shared buffer;
    only what the destination does not take at once is kept (bounded: reading stops until it
    is sent)."""

    __slots__ = ("conn", "dst", "dst_fd", "eof", "loop", "pending", "src", "src_fd",
                 "transform", "up", "writing")

    def __init__(self, conn: Conn, src: socket.socket, dst: socket.socket, up: bool,
                 transform: Callable[[bytes], bytes] | None, initial: bytes) -> None:
        self.conn, self.src, self.dst, self.up = conn, src, dst, up
        self.src_fd, self.dst_fd = src.fileno(), dst.fileno()
        self.loop = conn.proxy.loop
        self.transform = transform
        self.pending = memoryview(initial) if initial else None
        self.eof = False
        self.writing = False

    def start(self) -> None:
        if self.pending is not None:
            self._want_write()
        else:
            self.loop.add_reader(self.src_fd, self._readable)

    def stop(self) -> None:
        if self.writing:
            self.loop.remove_writer(self.dst_fd)
            self.writing = False
        elif not self.eof:
            self.loop.remove_reader(self.src_fd)

    def _want_write(self) -> None:
        self.writing = True
        self.loop.add_writer(self.dst_fd, self._writable)

    def _readable(self) -> None:
        proxy = self.conn.proxy
        try:
            n = self.src.recv_into(proxy.buffer)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self.conn.broken(exc, "guest" if self.up else "destination")
            return
        if n == 0:
            self.loop.remove_reader(self.src_fd)
            self.eof = True
            self._finish()
            return
        self.conn.last_active = self.loop.time()
        data: bytes | memoryview = proxy.view[:n]
        if self.transform is not None:
            try:
                data = self.transform(bytes(data))
            except Refused as exc:
                self.conn.refuse(str(exc), exc.kind, exc.fields)
                return
            except httphead.HttpError as exc:
                self.conn.refuse(f"HTTP: {exc}")
                return
            if not data:
                return
        self._send(data, from_reader=True)

    def _send(self, data: bytes | memoryview, from_reader: bool) -> None:
        try:
            sent = self.dst.send(data)
        except (BlockingIOError, InterruptedError):
            sent = 0
        except OSError as exc:
            self.conn.broken(exc, "destination" if self.up else "guest")
            return
        if self.up:
            self.conn.proxy.counters.bytes_up += sent
        else:
            self.conn.proxy.counters.bytes_down += sent
        if sent < len(data):
            # Keep the rest (a copy: the shared buffer is reused) and stop reading until sent.
            self.pending = memoryview(bytes(data[sent:]))
            if from_reader:
                self.loop.remove_reader(self.src_fd)
                self._want_write()
        else:
            self.pending = None
            if not from_reader:
                self.loop.remove_writer(self.dst_fd)
                self.writing = False
                if self.eof:
                    self._finish()
                else:
                    self.loop.add_reader(self.src_fd, self._readable)

    def _writable(self) -> None:
        assert self.pending is not None
        self.conn.last_active = self.loop.time()
        self._send(self.pending, from_reader=False)

    def inject(self, data: bytes) -> None:
        """Send bytes read earlier that the transform held back until the other direction
        told what they are (httphead.RequestStream.release)."""
        if self.conn.closed:
            return
        if self.pending is not None:
            self.pending = memoryview(bytes(self.pending) + data)
            return
        self._send(data, from_reader=True)

    def _finish(self) -> None:
        """The source ended: pass the end on (half-close) once everything is sent."""
        if self.pending is not None:
            return
        with contextlib.suppress(OSError):
            self.dst.shutdown(socket.SHUT_WR)
        self.conn.half_closed()

    @property
    def done(self) -> bool:
        return self.eof and self.pending is None


_SPLICE_FLAGS = getattr(os, "SPLICE_F_MOVE", 1) | getattr(os, "SPLICE_F_NONBLOCK", 2)
_F_SETPIPE_SZ = 1031


class _SplicePump:
    """One direction moved by the kernel (splice(2) socket -> pipe -> socket): the bytes never
    enter this process. What the destination does not take at once stays in the pipe (at most
    PIPE_SIZE; reading stops until it is drained)."""

    PIPE_SIZE = 256 << 10

    __slots__ = ("conn", "dst", "dst_fd", "eof", "in_pipe", "loop", "pipe_r", "pipe_w", "src",
                 "src_fd", "up", "writing")

    def __init__(self, conn: Conn, src: socket.socket, dst: socket.socket, up: bool) -> None:
        self.conn, self.src, self.dst, self.up = conn, src, dst, up
        self.src_fd, self.dst_fd = src.fileno(), dst.fileno()
        self.loop = conn.proxy.loop
        self.pipe_r, self.pipe_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        with contextlib.suppress(OSError):  # a smaller pipe only means more wake-ups
            fcntl.fcntl(self.pipe_w, _F_SETPIPE_SZ, self.PIPE_SIZE)
        self.in_pipe = 0
        self.eof = False
        self.writing = False

    def start(self) -> None:
        self.loop.add_reader(self.src_fd, self._readable)

    def stop(self) -> None:
        if self.writing:
            self.loop.remove_writer(self.dst_fd)
            self.writing = False
        elif not self.eof:
            self.loop.remove_reader(self.src_fd)
        if self.pipe_r >= 0:
            os.close(self.pipe_r)
            os.close(self.pipe_w)
            self.pipe_r = self.pipe_w = -1

    @property
    def done(self) -> bool:
        return self.eof and self.in_pipe == 0

    def _readable(self) -> None:
        try:
            n = os.splice(self.src_fd, self.pipe_w, self.PIPE_SIZE, flags=_SPLICE_FLAGS)
        except (BlockingIOError, InterruptedError):
            return
        except OSError as exc:
            self.conn.broken(exc, "guest" if self.up else "destination")
            return
        if n == 0:
            self.loop.remove_reader(self.src_fd)
            self.eof = True
            self._finish()
            return
        self.conn.last_active = self.loop.time()
        self.in_pipe = n
        self._drain(from_reader=True)

    def _writable(self) -> None:
        self.conn.last_active = self.loop.time()
        self._drain(from_reader=False)

    def _drain(self, from_reader: bool) -> None:
        moved = 0
        while self.in_pipe:
            try:
                m = os.splice(self.pipe_r, self.dst_fd, self.in_pipe, flags=_SPLICE_FLAGS)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as exc:
                self.conn.broken(exc, "destination" if self.up else "guest")
                return
            self.in_pipe -= m
            moved += m
        if self.up:
            self.conn.proxy.counters.bytes_up += moved
        else:
            self.conn.proxy.counters.bytes_down += moved
        if self.in_pipe:
            if from_reader:
                self.loop.remove_reader(self.src_fd)
                self.writing = True
                self.loop.add_writer(self.dst_fd, self._writable)
        elif not from_reader:
            self.loop.remove_writer(self.dst_fd)
            self.writing = False
            self.loop.add_reader(self.src_fd, self._readable)

    def _finish(self) -> None:
        with contextlib.suppress(OSError):
            self.dst.shutdown(socket.SHUT_WR)
        self.conn.half_closed()


class Conn:
    """One redirected guest connection, from accept to close."""

    __slots__ = ("closed", "decided", "dst_ip", "dst_port", "guest", "last_active", "name", "proxy",
                 "pumps", "slot", "source", "started", "task", "transports", "tunnel",
                 "upstream", "via")

    def __init__(self, proxy: EgressProxyServer, guest: socket.socket, source: str,
                 dst_ip: IPv4Address, dst_port: int) -> None:
        self.proxy, self.guest, self.source = proxy, guest, source
        self.dst_ip, self.dst_port = dst_ip, dst_port
        self.name: str | None = None
        self.via: EgressProxy | None = None
        self.upstream: socket.socket | None = None
        self.pumps: tuple[_Pump | _SplicePump, _Pump | _SplicePump] | None = None
        self.tunnel: _Tunnel | None = None  # a TLS connection to the SOCKS5 proxy
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
        _rst(self.guest)
        if self.upstream is not None:
            _rst(self.upstream)

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


class EgressProxyServer:
    """The proxy: the listening socket, the slot table, the control socket, the metrics."""

    def __init__(self, control_path: str | Path, port: int, bind: str = "0.0.0.0", *,
                 metrics_port: int | None = None, metrics_bind: str = "127.0.0.1",
                 open_ranges: tuple[IPv4Network, ...] = (),
                 max_connections: int = MAX_CONNECTIONS,
                 max_per_slot: int = MAX_CONNECTIONS_PER_SLOT,
                 max_metadata_per_slot: int = MAX_METADATA_PER_SLOT,
                 idle_timeout: float = IDLE_TIMEOUT, peek_timeout: float = PEEK_TIMEOUT,
                 connect_timeout: float = CONNECT_TIMEOUT, splice: bool = True,
                 resolve_ttl: float = RESOLVE_TTL,
                 dns_upstream: tuple[str, int] | None = None,
                 name_server: tuple[str, int] | None = None,
                 log_max_bytes: int = LOG_MAX_BYTES, log_burst: int = LOG_BURST,
                 log_window: float = LOG_WINDOW) -> None:
        self.control_path = str(control_path)
        self.port, self.bind = port, bind
        self.metrics_port, self.metrics_bind = metrics_port, metrics_bind
        self.open_ranges = open_ranges
        self.max_connections, self.max_per_slot = max_connections, max_per_slot
        self.max_metadata_per_slot = max_metadata_per_slot
        self.idle_timeout, self.peek_timeout = idle_timeout, peek_timeout
        self.connect_timeout = connect_timeout
        self.splice = splice and hasattr(os, "splice")
        self.slots: dict[str, Slot] = {}
        self.conns: set[Conn] = set()  # every connection, metadata ones included
        self.metadata_connections = 0
        self.counters = Counters()
        # What a guest causes at will (refusals, DNS queries, failures) is logged per slot
        # within limits; the counters count every event.
        self.events = PerKeyLimit(log, log_burst, log_window)
        self.log_max_bytes = log_max_bytes
        self.buffer = bytearray(COPY_CHUNK)
        self.view = memoryview(self.buffer)
        self.local = _LocalAddresses()
        self.walls = (*WALL_NETS, *extra_walls())
        self.names = NameAnswers(resolve_ttl, name_server)
        self.dns_upstream = dns_upstream  # None: no filtering resolver
        self._dns_sock: socket.socket | None = None
        self._listener: socket.socket | None = None
        self._servers: list[asyncio.base_events.Server] = []
        self._tasks: set[asyncio.Task[Any]] = set()
        self._stopping: asyncio.Event | None = None
        self.loop: asyncio.AbstractEventLoop = None  # type: ignore[assignment]

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self._stopping = asyncio.Event()
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((self.bind, self.port))
        listener.listen(4096)
        listener.setblocking(False)
        self._listener = listener
        self.port = listener.getsockname()[1]
        self.loop.add_reader(listener.fileno(), self._on_accept)
        if self.dns_upstream is not None:
            # The filtering resolver's UDP side, on the same port number (the host redirects
            # the slots' UDP to 169.254.169.254:53 here).
            udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            udp.bind((self.bind, self.port))
            udp.setblocking(False)
            self._dns_sock = udp
            self.loop.add_reader(udp.fileno(), self._on_dns_datagram)
        path = Path(self.control_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        old_umask = os.umask(0o177)  # the socket is the node's alone
        try:
            self._servers.append(await asyncio.start_unix_server(
                self._control_client, self.control_path, limit=CONTROL_LINE_MAX))
        finally:
            os.umask(old_umask)
        if self.metrics_port is not None:
            self._servers.append(await asyncio.start_server(
                self._metrics_client, self.metrics_bind, self.metrics_port))
        self._spawn(self._sweep())
        if self.log_max_bytes:
            self._spawn(self._trim_log())
        log.info("egress proxy listening", extra={
            "event": "started", "port": self.port, "bind": self.bind,
            "control": self.control_path, "metrics_port": self.metrics_port})

    async def serve_until_stopped(self) -> None:
        assert self._stopping is not None
        await self._stopping.wait()

    def request_stop(self) -> None:
        if self._stopping is not None:
            self._stopping.set()

    async def stop(self) -> None:
        if self._listener is not None:
            self.loop.remove_reader(self._listener.fileno())
            self._listener.close()
            self._listener = None
        if self._dns_sock is not None:
            self.loop.remove_reader(self._dns_sock.fileno())
            self._dns_sock.close()
            self._dns_sock = None
        for server in self._servers:
            server.close()
        for conn in list(self.conns):
            conn.reset()
        for task in list(self._tasks):
            task.cancel()
        for server in self._servers:
            with contextlib.suppress(Exception):
                await server.wait_closed()
        self._servers.clear()
        with contextlib.suppress(FileNotFoundError):
            Path(self.control_path).unlink()
        self.events.flush(everything=True)  # (the counts of the last windows are not lost)

    def _spawn(self, coro: Any) -> asyncio.Task[Any]:
        task = self.loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    # -- connections -------------------------------------------------------------------------

    def _on_accept(self) -> None:
        assert self._listener is not None
        for _ in range(64):  # a burst per wake-up, then let the others run
            try:
                sock, (source, _) = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                # EMFILE and the like: the connection stays queued and the listener readable;
                # pause accepting a little instead of spinning on it.
                log.warning("egress accept failed", extra={"event": "accept_failed",
                                                           "error": str(exc)})
                listener = self._listener
                self.loop.remove_reader(listener.fileno())
                self.loop.call_later(0.1, self._resume_accept, listener)
                return
            self._accepted(sock, source)

    def _resume_accept(self, listener: socket.socket) -> None:
        if self._listener is listener:
            self.loop.add_reader(listener.fileno(), self._on_accept)

    def _accepted(self, sock: socket.socket, source: str) -> None:
        self.counters.accepted += 1
        sock.setblocking(False)
        slot = self.slots.get(source)
        if slot is None:
            self.counters.unknown_source += 1
            self.events.log(source, "unknown_source", logging.INFO,
                            "egress from an unknown source",
                            {"event": "unknown_source", "source": source})
            _rst(sock)
            return
        try:
            dst_ip, dst_port = original_destination(sock)
        except OSError as exc:
            self.events.log(source, "no_original_dst", logging.WARNING,
                            "egress: no original destination",
                            {"event": "no_original_dst", "source": source, "error": str(exc)})
            _rst(sock)
            return
        is_metadata = (dst_ip, dst_port) in NODE_SERVICES
        if is_metadata:
            # Metadata has caps of its own: a slot's egress connections never deny it.
            over = len(slot.metadata) >= self.max_metadata_per_slot
            held, limit = len(slot.metadata), self.max_metadata_per_slot
        else:
            limit = self.slot_share()
            held = len(slot.conns)
            over = held >= limit or (self.egress_connections >= self.max_connections
                                     and not self._evict_over_share(limit, source))
        if over:
            self.counters.over_capacity += 1
            self.events.log(source, "over_capacity", logging.WARNING,
                            "egress connection cap reached", {
                                "event": "over_capacity", "source": source,
                                "metadata": is_metadata, "total": self.egress_connections,
                                "slot_total": held, "slot_limit": limit})
            _rst(sock)
            return
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        conn = Conn(self, sock, source, dst_ip, dst_port)
        conn.slot = slot
        (slot.metadata if is_metadata else slot.conns).add(conn)
        self.conns.add(conn)
        if is_metadata:
            self.metadata_connections += 1
        conn.task = self.loop.create_task(self._handle(conn))

    def slot_share(self) -> int:
        """How many egress connections one slot may hold: an equal share of max_connections
        among the known slots (at least MIN_SLOT_SHARE), at most max_per_slot. So a few guests
        holding connections open cannot take the capacity every other slot needs."""
        share = max(MIN_SLOT_SHARE, self.max_connections // max(1, len(self.slots)))
        return min(self.max_per_slot, share)

    def _evict_over_share(self, share: int, wanted_by: str) -> bool:
        """All egress connections are taken and a slot under its share wants one: the slot
        holding the most beyond the share (it opened them while it had the proxy to itself)
        gives back its longest idle one. False when no slot is over its share."""
        hog = max(self.slots.values(), key=lambda s: len(s.conns), default=None)
        if hog is None or len(hog.conns) <= share:
            return False
        victim = min(hog.conns, key=lambda c: c.last_active)
        self.counters.evicted += 1
        self.events.log(wanted_by, "evicted", logging.INFO, "egress connection evicted", {
            "event": "evicted", "reason": "over its fair share while another slot needs one",
            "slot_total": len(hog.conns), "slot_share": share, "wanted_by": wanted_by,
            **victim.describe()})
        victim.reset()
        return True

    @property
    def egress_connections(self) -> int:
        return len(self.conns) - self.metadata_connections

    def unregister(self, conn: Conn) -> None:
        if conn in self.conns:
            self.conns.discard(conn)
            if (conn.dst_ip, conn.dst_port) in NODE_SERVICES:
                self.metadata_connections -= 1
        if conn.slot is not None:
            conn.slot.conns.discard(conn)
            conn.slot.metadata.discard(conn)

    def _current(self, conn: Conn) -> Slot:
        slot = self.slots.get(conn.source)
        if slot is None or slot is not conn.slot:
            raise Refused("the slot was removed")
        return slot

    async def _decide(self, conn: Conn, name: str | None) -> EgressPolicy:
        """Raises Refused unless the slot's current policy lets this connection out; a name
        that decides it must resolve to the destination here (NameAnswers)."""
        slot = self._current(conn)
        decision = self._decision(conn, slot.entry.policy, name)
        answers = None
        if decision.verdict == "bind" and name is not None:
            if not self.names.fresh(name) and slot.lookups >= MAX_LOOKUPS_PER_SLOT:
                # A guest spraying names (each a lookup that may wait seconds) must not take
                # the lookup threads every other slot's decisions need.
                raise Refused("too many name lookups in flight for this sandbox",
                              "over_capacity")
            slot.lookups += 1
            try:
                answers = await self.names.answers(name)
            finally:
                slot.lookups -= 1
        _judge(conn, decision, name, answers)
        return self._current(conn).entry.policy  # (the lookup may have waited)

    def _decide_now(self, conn: Conn, policy: EgressPolicy, name: str | None) -> None:
        """_decide for a decision that cannot wait for a lookup (a keep-alive request head, a
        policy update over live connections): a name is checked against its last answers."""
        decision = self._decision(conn, policy, name)
        answers = self.names.known(name) \
            if decision.verdict == "bind" and name is not None else None
        _judge(conn, decision, name, answers)

    @staticmethod
    def _decision(conn: Conn, policy: EgressPolicy, name: str | None) -> Decision:
        # On a web port a connection without a readable name could carry any name.
        return policy.decide(conn.dst_ip, conn.dst_port, name,
                             unnamed=name is None and conn.dst_port in WEB_PORTS)

    def _walled(self, ip: IPv4Address) -> bool:
        # the walls the slot's own ruleset holds (network/walls.py); here again because the
        # proxy connects from the host, where they would not apply
        if any(ip in net for net in self.open_ranges):
            return False
        return any(ip in net for net in self.walls) or ip in self.local

    async def _handle(self, conn: Conn) -> None:
        try:
            if (conn.dst_ip, conn.dst_port) == METADATA:
                await self._metadata(conn)
                return
            if (conn.dst_ip, conn.dst_port) == RESOLVER:
                await self._dns_tcp(conn)
                return
            if self._walled(conn.dst_ip):
                raise Refused("destination behind the walls")
            data, name, kind = b"", None, "opaque"
            if conn.dst_port in WEB_PORTS:
                data, name, kind = await self._peek(conn)
                if kind == "eof":
                    conn.close()
                    return
            conn.name = name
            await self._decide(conn, name)
            transform: Callable[[bytes], bytes] | None = None
            responses: Callable[[bytes], bytes] | None = None
            stream: httphead.RequestStream | None = None
            if kind == "http":
                stream = httphead.RequestStream(lambda head: self._on_http_head(conn, head))
                transform = stream.feed
                # The responses are read too (not spliced): an upgrade counts only if the
                # server agrees (httphead.RequestStream).
                responses = stream.responses().feed
                data = stream.feed(data)
            await self._connect(conn)
            # The policy may have changed while connecting: decide again with the current one.
            policy = await self._decide(conn, conn.name)
            if policy.egress_proxy != conn.via:
                raise Refused("the egress proxy changed while connecting")
            conn.decided = True
            self.counters.allowed += 1
            log.debug("egress allowed", extra={"event": "allowed", **conn.describe()})
            if conn.tunnel is None:
                assert conn.upstream is not None
                if data and transform is None:
                    await self.loop.sock_sendall(conn.upstream, data)  # the peeked bytes
                    self.counters.bytes_up += len(data)
                    data = b""
                    if conn.closed:  # cut by an update meanwhile
                        return
                up = self._pump(conn, True, transform, data)
                conn.pumps = (up, self._pump(conn, False, responses, b""))
                if stream is not None:
                    assert isinstance(up, _Pump)
                    stream.release = up.inject
                for pump in conn.pumps:
                    pump.start()
            else:
                await self._tls_tunnel_relay(conn, data, stream, transform, responses)
        except Refused as exc:
            conn.refuse(str(exc), exc.kind, exc.fields)
        except (httphead.HttpError, sni.NotClientHello) as exc:
            conn.refuse(f"malformed request: {exc}")
        except asyncio.CancelledError:
            conn.reset()
        except (OSError, socks5.SocksError, TimeoutError, ssl.SSLError) as exc:
            self.counters.upstream_failed += 1
            self.events.log(conn.source, "upstream_failed", logging.INFO,
                            "egress upstream failed", {
                                "event": "upstream_failed",
                                "error": str(exc) or type(exc).__name__,
                                "via": str(conn.via) if conn.via else None,
                                **conn.describe()})
            conn.reset()
        except Exception:
            log.exception("egress connection crashed", extra={"event": "crash", **conn.describe()})
            conn.reset()

    def _pump(self, conn: Conn, up: bool, transform: Callable[[bytes], bytes] | None,
              data: bytes) -> _Pump | _SplicePump:
        assert conn.upstream is not None
        src, dst = (conn.guest, conn.upstream) if up else (conn.upstream, conn.guest)
        if self.splice and transform is None and not data:
            try:
                return _SplicePump(conn, src, dst, up)
            except OSError:  # no pipe to be had (descriptor limits): copy instead
                pass
        return _Pump(conn, src, dst, up, transform, data)

    def _on_http_head(self, conn: Conn, head: httphead.RequestHead) -> bytes:
        name = head.host()
        conn.name = name
        policy = self._current(conn).entry.policy
        self._decide_now(conn, policy, name)
        return httphead.with_headers(httphead.without_h2c(head),
                                     policy.header_rules(name) if name else ())

    async def _peek(self, conn: Conn) -> tuple[bytes, str | None, str]:
        """The first bytes and what they say: (data, name, kind), kind one of tls, http,
        opaque (neither; decided by address) or eof (the client left without a byte)."""
        data = b""
        deadline = self.loop.time() + self.peek_timeout
        while True:
            remaining = deadline - self.loop.time()
            try:
                if remaining <= 0:
                    raise TimeoutError
                async with asyncio.timeout(remaining):
                    chunk = await self.loop.sock_recv(conn.guest, 16384)
            except TimeoutError:
                if data and (sni.looks_like_tls(data) or httphead.looks_like_http(data)):
                    raise Refused("an incomplete TLS hello or HTTP head at the peek timeout") \
                        from None
                return data, None, "opaque"
            if not chunk:
                return data, None, "eof" if not data else "opaque"
            data += chunk
            if sni.looks_like_tls(data):
                try:
                    return data, sni.server_name(data), "tls"
                except sni.Incomplete:
                    pass
            elif httphead.looks_like_http(data):
                try:
                    head = httphead.parse_request_head(data)
                except httphead.Incomplete:
                    pass
                except httphead.NotHttp:
                    return data, None, "opaque"
                else:
                    return data, head.host(), "http"
            else:
                return data, None, "opaque"
            if len(data) > PEEK_MAX:
                raise Refused(f"no complete TLS hello or HTTP head in {PEEK_MAX} bytes")

    async def _connect(self, conn: Conn) -> None:
        """Open the upstream: conn.upstream (a plain socket) or, through a TLS SOCKS5 proxy,
        conn.tunnel (streams)."""
        policy = self._current(conn).entry.policy
        via = conn.via = policy.egress_proxy
        async with asyncio.timeout(self.connect_timeout):
            if via is None:
                conn.upstream = await self._tcp_connect(str(conn.dst_ip), conn.dst_port)
                return
            proxy_ip = await self._resolve(via.host)
            if self._walled(proxy_ip):
                raise Refused(f"egress proxy address {proxy_ip} is behind the walls")
            if not via.tls:
                sock = conn.upstream = await self._tcp_connect(str(proxy_ip), via.port)

                async def read_exactly(n: int) -> bytes:
                    buf = b""
                    while len(buf) < n:
                        chunk = await self.loop.sock_recv(sock, n - len(buf))
                        if not chunk:
                            raise socks5.SocksError("the SOCKS proxy closed the connection")
                        buf += chunk
                    return buf

                async def write(data: bytes) -> None:
                    await self.loop.sock_sendall(sock, data)

                await socks5.connect(read_exactly, write, str(conn.dst_ip), conn.dst_port,
                                     via.username, via.password)
                return
            context = ssl.create_default_context(cadata=via.tls_ca_cert) \
                if via.tls_ca_cert else ssl.create_default_context()
            reader, writer = await asyncio.open_connection(
                str(proxy_ip), via.port, ssl=context,
                server_hostname=via.tls_server_name or via.host, limit=COPY_CHUNK)
            conn.transports.append(writer.transport)  # a reset aborts it
            await socks5.connect(reader.readexactly, _writer_write(writer), str(conn.dst_ip),
                                 conn.dst_port, via.username, via.password)
            conn.tunnel = _Tunnel(reader, writer)

    async def _resolve(self, host: str) -> IPv4Address:
        try:
            return IPv4Address(host)
        except ValueError:
            pass
        infos = await self.loop.getaddrinfo(host, None, family=socket.AF_INET,
                                            type=socket.SOCK_STREAM)
        if not infos:
            raise OSError(f"{host} has no IPv4 address")
        return IPv4Address(infos[0][4][0])

    async def _tcp_connect(self, host: str, port: int) -> socket.socket:
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            sock.setblocking(False)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            await self.loop.sock_connect(sock, (host, port))
        except BaseException:
            sock.close()
            raise
        return sock

    async def _tls_tunnel_relay(self, conn: Conn, data: bytes,
                                stream: httphead.RequestStream | None,
                                transform: Callable[[bytes], bytes] | None,
                                responses: Callable[[bytes], bytes] | None) -> None:
        """Relay through a TLS connection to the SOCKS5 proxy (streams; the rarer, slower path)."""
        tunnel = conn.tunnel
        assert tunnel is not None
        reader, writer = await asyncio.open_connection(sock=conn.guest, limit=COPY_CHUNK)
        conn.transports.append(writer.transport)
        if stream is not None:
            stream.release = tunnel.writer.write

        async def copy(src: asyncio.StreamReader, dst: asyncio.StreamWriter, up: bool) -> None:
            change = transform if up else responses
            while chunk := await src.read(COPY_CHUNK):
                conn.last_active = self.loop.time()
                if change is not None:
                    chunk = change(chunk)
                dst.write(chunk)
                await dst.drain()
                if up:
                    self.counters.bytes_up += len(chunk)
                else:
                    self.counters.bytes_down += len(chunk)
            if dst.can_write_eof():
                dst.write_eof()

        if data:
            tunnel.writer.write(data)
            self.counters.bytes_up += len(data)
        copies = {self.loop.create_task(copy(reader, tunnel.writer, True)),
                  self.loop.create_task(copy(tunnel.reader, writer, False))}
        try:
            # Both directions end (half-closes pass on), or the first failure ends both.
            done, _ = await asyncio.wait(copies, return_when=asyncio.FIRST_EXCEPTION)
            for task in done:
                if task.exception() is not None:
                    raise task.exception()  # type: ignore[misc]
        except Refused as exc:
            conn.refuse(str(exc), exc.kind, exc.fields)
        except httphead.HttpError as exc:
            conn.refuse(str(exc))
        except (OSError, asyncio.CancelledError):
            conn.reset()
        else:
            conn.close()
        finally:
            for task in copies:
                task.cancel()

    async def _metadata(self, conn: Conn) -> None:
        reader, writer = await asyncio.open_connection(sock=conn.guest)
        conn.transports.append(writer.transport)

        def lookup() -> SlotIdentity | None:
            slot = self.slots.get(conn.source)
            if slot is None or slot is not conn.slot:
                return None
            self.counters.metadata_requests += 1
            return slot.entry.identity

        try:
            await metadata.serve(reader, writer, lookup)
        except (OSError, asyncio.CancelledError):
            conn.reset()
            return
        conn.close()

    # -- the filtering resolver (dns.py) ------------------------------------------------------

    def _dns_decide(self, source: str, message: bytes) -> tuple[bytes | None, Slot | None]:
        """(an answer to send now, or None to forward; the slot) for one query from `source`."""
        slot = self.slots.get(source)
        try:
            question = dns.parse_query(message)
        except dns.DnsFormatError as exc:
            self.counters.dns_failed += 1
            self.events.log(source, "dns_malformed", logging.INFO, "dns query malformed",
                            {"event": "dns_malformed", "source": source, "error": str(exc)})
            return dns.error_response(message, dns.RCODE_FORMERR, None), slot
        if slot is None or not slot.entry.policy.resolves(question.name):
            self.counters.dns_refused += 1
            self.events.log(source, "dns_refused", logging.INFO, "dns query refused", {
                "event": "dns_refused", "source": source, "qname": question.name,
                "reason": "unknown source" if slot is None else "name not allowed by the policy"})
            return dns.error_response(message, dns.RCODE_REFUSED, question), slot
        return None, slot

    async def _dns_forward(self, message: bytes, source: str) -> bytes:
        assert self.dns_upstream is not None
        try:
            answer = await dns.forward_udp(message, self.dns_upstream)
        except (OSError, TimeoutError) as exc:
            self.counters.dns_failed += 1
            self.events.log(source, "dns_upstream_failed", logging.INFO,
                            "dns upstream failed", {"event": "dns_upstream_failed",
                                                    "source": source,
                                                    "error": str(exc) or type(exc).__name__})
            return dns.error_response(message, dns.RCODE_SERVFAIL, dns.parse_query(message))
        self.counters.dns_answered += 1
        return answer

    def _on_dns_datagram(self) -> None:
        assert self._dns_sock is not None
        for _ in range(64):  # a burst per wake-up, then let the others run
            try:
                message, (source, port) = self._dns_sock.recvfrom(dns.MAX_MESSAGE + 1)
            except OSError:  # (BlockingIOError: nothing more to read)
                return
            now, slot = self._dns_decide(source, message)
            if now is not None:
                self._dns_reply(now, (source, port))
            elif slot is not None and slot.dns_inflight < MAX_DNS_INFLIGHT_PER_SLOT:
                slot.dns_inflight += 1
                self._spawn(self._dns_udp(message, slot, (source, port)))
            else:
                self.counters.dns_failed += 1  # over the slot's cap: dropped, the stub retries

    async def _dns_udp(self, message: bytes, slot: Slot, to: tuple[str, int]) -> None:
        try:
            self._dns_reply(await self._dns_forward(message, to[0]), to)
        finally:
            slot.dns_inflight -= 1

    def _dns_reply(self, answer: bytes, to: tuple[str, int]) -> None:
        if self._dns_sock is not None:
            with contextlib.suppress(OSError):
                self._dns_sock.sendto(answer, to)

    async def _dns_tcp(self, conn: Conn) -> None:
        """DNS over TCP (two-byte length, then the message), one query at a time."""
        if self.dns_upstream is None:
            raise Refused("no filtering resolver on this node")
        reader, writer = await asyncio.open_connection(sock=conn.guest)
        conn.transports.append(writer.transport)
        try:
            while True:
                async with asyncio.timeout(metadata.IDLE_TIMEOUT):
                    try:
                        (length,) = struct.unpack("!H", await reader.readexactly(2))
                    except asyncio.IncompleteReadError:
                        break
                    message = await reader.readexactly(length)
                conn.last_active = self.loop.time()
                answer, _ = self._dns_decide(conn.source, message)
                if answer is None:
                    answer = await self._dns_forward(message, conn.source)
                writer.write(struct.pack("!H", len(answer)) + answer)
                await writer.drain()
        except (OSError, TimeoutError, asyncio.IncompleteReadError):
            conn.reset()
            return
        conn.close()

    async def _sweep(self) -> None:
        """Close connections idle (no byte either way) for longer than idle_timeout."""
        interval = max(0.5, min(30.0, self.idle_timeout / 4))
        while True:
            await asyncio.sleep(interval)
            cutoff = self.loop.time() - self.idle_timeout
            for conn in [c for c in self.conns if c.last_active < cutoff]:
                self.counters.idle_closed += 1
                self.events.log(conn.source, "idle", logging.INFO, "egress connection idle",
                                {"event": "idle", **conn.describe()})
                conn.reset()
            self.events.flush()

    async def _trim_log(self) -> None:
        """Keep this process's log (its stderr, when a file: the node's
        `<state>/logs/egress-proxy.log`) and its rotated tail within log_max_bytes, as the
        runtime keeps a VM's serial log (agentenv.logs.trim_log): the limits above bound what a
        guest makes it write, this bounds the file whatever writes it."""
        if not stat.S_ISREG(os.fstat(2).st_mode):
            return
        path = Path(os.readlink("/proc/self/fd/2"))
        while True:
            try:
                await asyncio.to_thread(trim_log, path, self.log_max_bytes)
            except OSError as exc:  # a full disk, say: tried again at the next look
                log.warning("log not trimmed", extra={"event": "log_not_trimmed",
                                                      "error": str(exc)})
            await asyncio.sleep(LOG_CHECK_INTERVAL)

    # -- slots (the control protocol, control.py) --------------------------------------------

    def set_slot(self, entry: SlotEntry) -> int:
        """Install or replace a slot; returns how many of its live connections were cut."""
        old = self.slots.get(entry.source)
        if old is not None and old.entry.identity.sandbox_id != entry.identity.sandbox_id:
            # Another sandbox in this slot (a pooled slot reused, a pool VM handed to a
            # create): nothing the previous one opened survives.
            cut = self.remove_slot(entry.source)
            self.counters.cut_by_update += cut
            self.slots[entry.source] = Slot(entry)
            return cut
        if old is None:
            self.slots[entry.source] = Slot(entry)
            return 0
        old.entry = entry
        cut = 0
        policy = entry.policy
        for conn in list(old.conns):  # (metadata answers the current identity at each request)
            if not conn.decided:
                continue  # decides with the current policy when it knows its name
            try:
                self._decide_now(conn, policy, conn.name)
            except Refused:
                allowed = False
            else:
                allowed = policy.egress_proxy == conn.via
            if not allowed:
                cut += 1
                self.counters.cut_by_update += 1
                log.info("egress connection cut by a policy update", extra={
                    "event": "cut", **conn.describe()})
                conn.reset()
        return cut

    def remove_slot(self, source: str) -> int:
        slot = self.slots.pop(source, None)
        if slot is None:
            return 0
        conns = [*slot.conns, *slot.metadata]
        for conn in conns:
            conn.reset()
        return len(conns)

    def sync(self, entries: list[SlotEntry]) -> None:
        wanted = {e.source: e for e in entries}
        for source in [s for s in self.slots if s not in wanted]:
            self.remove_slot(source)
        for entry in entries:
            self.set_slot(entry)

    def stats(self) -> dict[str, Any]:
        return {"slots": len(self.slots), "connections": len(self.conns),
                "metadata_connections": self.metadata_connections,
                "slot_share": self.slot_share(), "port": self.port,
                "pid": os.getpid(),
                "rss_bytes": rss_bytes(), **vars(self.counters)}

    def handle_request(self, request: Any) -> dict[str, Any]:
        if not isinstance(request, dict):
            raise ValueError("a request is a JSON object with an op")
        op = request.get("op")
        if op == "ping":
            return {"ok": True, **self.stats()}
        if op == "set":
            entry = _slot_entry(request.get("slot"))
            return {"ok": True, "cut": self.set_slot(entry)}
        if op == "remove":
            source = request.get("source")
            if not isinstance(source, str):
                raise ValueError("remove needs source (the slot's guest address)")
            _source(source)
            return {"ok": True, "cut": self.remove_slot(source)}
        if op == "sync":
            raw = request.get("slots")
            if not isinstance(raw, list):
                raise ValueError("sync needs slots, a list")
            entries = [_slot_entry(item, f"slots[{i}]") for i, item in enumerate(raw)]
            if len({e.source for e in entries}) != len(entries):
                raise ValueError("sync: a source appears twice")
            self.sync(entries)
            return {"ok": True}
        raise ValueError(f"unknown op {op!r} (ping, set, remove, sync)")

    async def _control_client(self, reader: asyncio.StreamReader,
                              writer: asyncio.StreamWriter) -> None:
        try:
            while True:
                try:
                    line = await reader.readline()
                except (ValueError, asyncio.LimitOverrunError):
                    writer.write(json.dumps({"ok": False, "error": "request line too long"})
                                 .encode() + b"\n")
                    await writer.drain()
                    return
                if not line:
                    return
                try:
                    answer = self.handle_request(json.loads(line))
                except (ValueError, TypeError, KeyError, PolicyError, OSError) as exc:
                    answer = {"ok": False, "error": str(exc) or type(exc).__name__}
                writer.write(json.dumps(answer).encode() + b"\n")
                await writer.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    # -- metrics -------------------------------------------------------------------------------

    def metrics_text(self) -> str:
        c = self.counters
        lines = [
            "# TYPE aenv_egress_slots gauge", f"aenv_egress_slots {len(self.slots)}",
            "# TYPE aenv_egress_connections gauge", f"aenv_egress_connections {len(self.conns)}",
            "# TYPE aenv_egress_metadata_connections gauge",
            f"aenv_egress_metadata_connections {self.metadata_connections}",
            "# TYPE aenv_egress_rss_bytes gauge", f"aenv_egress_rss_bytes {rss_bytes()}",
            "# TYPE aenv_egress_connections_total counter",
        ]
        for verdict in ("allowed", "denied", "denied_name_address", "denied_unnamed",
                        "unknown_source", "over_capacity",
                        "upstream_failed", "cut_by_update", "idle_closed", "evicted"):
            lines.append(f'aenv_egress_connections_total{{verdict="{verdict}"}} '
                         f"{getattr(c, verdict)}")
        lines.append("# TYPE aenv_egress_dns_queries_total counter")
        for verdict in ("answered", "refused", "failed"):
            lines.append(f'aenv_egress_dns_queries_total{{verdict="{verdict}"}} '
                         f"{getattr(c, 'dns_' + verdict)}")
        lines += [
            "# TYPE aenv_egress_metadata_requests_total counter",
            f"aenv_egress_metadata_requests_total {c.metadata_requests}",
            "# TYPE aenv_egress_bytes_total counter",
            f'aenv_egress_bytes_total{{direction="up"}} {c.bytes_up}',
            f'aenv_egress_bytes_total{{direction="down"}} {c.bytes_down}',
        ]
        return "\n".join(lines) + "\n"

    async def _metrics_client(self, reader: asyncio.StreamReader,
                              writer: asyncio.StreamWriter) -> None:
        try:
            async with asyncio.timeout(5):
                head = await reader.readuntil(b"\r\n\r\n")
            ok = head.startswith(b"GET /metrics ")
            body = self.metrics_text().encode() if ok else b"not found\n"
            status = "200 OK" if ok else "404 Not Found"
            writer.write(f"HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\n"
                         f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
                         + body)
            await writer.drain()
        except (OSError, TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
            pass
        finally:
            writer.close()


@dataclass
class _Tunnel:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter


def _writer_write(writer: asyncio.StreamWriter) -> Callable[[bytes], Any]:
    async def write(data: bytes) -> None:
        writer.write(data)
        await writer.drain()
    return write


def _judge(conn: Conn, decision: Decision, name: str | None,
           answers: frozenset[IPv4Address] | None) -> None:
    """Raises Refused (saying why) unless `decision` lets `conn` out; a "bind" decision only
    when the destination is among `answers`, the name's addresses here (None: not known)."""
    if decision.verdict == "allow":
        return
    if decision.verdict == "deny":
        kind = "denied_unnamed" if name is None and conn.dst_port in WEB_PORTS else None
        raise Refused(f"policy: {decision.reason}", kind)
    if answers is not None and conn.dst_ip in answers:
        return
    found = "is not resolved here yet" if answers is None else (
        f"resolves here to {', '.join(sorted(map(str, answers)))}" if answers
        else "does not resolve here")
    raise Refused(f"policy: {decision.reason}, but {name} {found}, not to {conn.dst_ip}",
                  "denied_name_address",
                  {"answers": sorted(map(str, answers)) if answers is not None else None})


def _source(text: str) -> str:
    try:
        return str(IPv4Address(text))
    except ValueError:
        raise ValueError(f"source {text!r} is not an IPv4 address") from None


def _slot_entry(raw: Any, where: str = "slot") -> SlotEntry:
    if not isinstance(raw, dict):
        raise ValueError(f"{where} must be an object with source, identity and policy")
    source = raw.get("source")
    if not isinstance(source, str):
        raise ValueError(f"{where}.source is required (the slot's guest address)")
    identity = raw.get("identity")
    if not isinstance(identity, dict):
        raise ValueError(f"{where}.identity is required")
    try:
        return SlotEntry(_source(source), SlotIdentity(**identity),
                         _policy(json.dumps(raw.get("policy") or {}, sort_keys=True)))
    except TypeError as exc:
        raise ValueError(f"{where}.identity: {exc}") from None
    except PolicyError as exc:
        raise ValueError(f"{where}.policy: {exc}") from None


def _dns_upstream(text: str | None) -> tuple[str, int] | None:
    if not text:
        return None
    return dns.system_upstream() if text == "system" else dns.parse_upstream(text)


_statm_fd = -1


@functools.lru_cache(maxsize=256)
def _policy(wire: str) -> EgressPolicy:
    """Parsed once per distinct policy: the sandboxes of one training run mostly share one, and
    a 1,000-entry policy takes tens of ms to parse (and its lookups to build)."""
    return EgressPolicy.from_wire(json.loads(wire))


def rss_bytes() -> int:
    """Resident set size, from a descriptor kept open (ping must answer when out of them)."""
    global _statm_fd
    if _statm_fd < 0:
        _statm_fd = os.open("/proc/self/statm", os.O_RDONLY | os.O_CLOEXEC)
    return int(os.pread(_statm_fd, 128, 0).split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


async def run(server: EgressProxyServer) -> None:
    _raise_fd_limit()
    rss_bytes()  # opens its descriptor now
    await server.start()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, server.request_stop)
    try:
        await server.serve_until_stopped()
    finally:
        await server.stop()
        log.info("egress proxy stopped", extra={"event": "stopped"})


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="aenv egress-proxy", description=__doc__.split("\n")[0])
    add_arguments(parser)
    return parser.parse_args(argv)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--control", required=True, help="unix socket the node controls it on")
    parser.add_argument("--port", type=int, required=True, help="TCP port the redirects go to")
    parser.add_argument("--bind", default="0.0.0.0")
    parser.add_argument("--metrics-port", type=int, default=None)
    parser.add_argument("--metrics-bind", default="127.0.0.1")
    parser.add_argument("--open-range", action="append", default=[], type=IPv4Network,
                        help="a walled range to open anyway (a lab's private network)")
    parser.add_argument("--max-connections", type=int, default=MAX_CONNECTIONS)
    parser.add_argument("--max-per-slot", type=int, default=MAX_CONNECTIONS_PER_SLOT,
                        help="a slot's egress connections at most (its fair share of "
                             "--max-connections may be less)")
    parser.add_argument("--max-metadata-per-slot", type=int, default=MAX_METADATA_PER_SLOT)
    parser.add_argument("--idle-timeout", type=float, default=IDLE_TIMEOUT)
    parser.add_argument("--peek-timeout", type=float, default=PEEK_TIMEOUT)
    parser.add_argument("--dns-upstream", default=get_settings().dns_filter_upstream or None,
                        help="serve the filtering resolver (169.254.169.254:53), forwarding "
                             "allowed names to this IPv4[:port], or 'system' (the node's "
                             "resolv.conf); default $AENV_DNS_FILTER_UPSTREAM, else off")
    parser.add_argument("--name-server", default=get_settings().egress_name_server or None,
                        help="IPv4[:port] of the DNS server names are bound with (A queries), "
                             "instead of the node's getaddrinfo; default "
                             "$AENV_EGRESS_NAME_SERVER")
    parser.add_argument("--resolve-ttl", type=float, default=RESOLVE_TTL,
                        help="seconds a name's addresses (getaddrinfo) are kept")
    parser.add_argument("--copy", action="store_true",
                        help="copy bytes through the process instead of splice(2) (to compare)")
    parser.add_argument("--log-level", default="info")
    parser.add_argument("--log-max-bytes", type=int, default=LOG_MAX_BYTES,
                        help="bytes of the log (stderr, when a file) and its rotated tail "
                             "<log>.1 kept on disk; 0: no bound")
    parser.add_argument("--log-burst", type=int, default=LOG_BURST,
                        help="lines a slot's refusals, DNS queries and failures write whole in "
                             "each --log-window; the rest are counted in a summary line")
    parser.add_argument("--log-window", type=float, default=LOG_WINDOW, help="seconds")


def server_from_args(args: argparse.Namespace) -> EgressProxyServer:
    return EgressProxyServer(
        args.control, args.port, args.bind, metrics_port=args.metrics_port,
        metrics_bind=args.metrics_bind, open_ranges=tuple(args.open_range),
        max_connections=args.max_connections, max_per_slot=args.max_per_slot,
        max_metadata_per_slot=args.max_metadata_per_slot,
        idle_timeout=args.idle_timeout, peek_timeout=args.peek_timeout, splice=not args.copy,
        resolve_ttl=args.resolve_ttl, dns_upstream=_dns_upstream(args.dns_upstream),
        name_server=dns.parse_upstream(args.name_server) if args.name_server else None,
        log_max_bytes=args.log_max_bytes, log_burst=args.log_burst,
        log_window=args.log_window)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logs.setup(args.log_level)
    asyncio.run(run(server_from_args(args)))


if __name__ == "__main__":
    main()

