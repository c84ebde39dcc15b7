"""The proxy server: its listening socket, the slot table, the per-connection path (peek,
decide, connect, pump), and its housekeeping (idle sweep, log trim). The concerns it wires
together live beside it: decisions.py, names.py, destinations.py, peek.py, upstream.py,
pumps.py, shares.py, resolver.py, commands.py, metrics.py."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import socket
import ssl
import stat
from collections.abc import Callable
from ipaddress import IPv4Network
from pathlib import Path
from typing import Any

from agentenv.logs import PerKeyLimit, trim_log
from agentenv.network import httphead, metadata, sni, socks5
from agentenv.network.control import SlotEntry, SlotIdentity
from agentenv.network.egress.commands import handle_request, serve_control_client
from agentenv.network.egress.conn import Conn, Slot, close_with_reset
from agentenv.network.egress.decisions import Refused, judge, policy_decision
from agentenv.network.egress.destinations import Walls, original_destination
from agentenv.network.egress.limits import (
    CONNECT_TIMEOUT,
    CONTROL_LINE_MAX,
    COPY_CHUNK,
    IDLE_TIMEOUT,
    LOG_BURST,
    LOG_CHECK_INTERVAL,
    LOG_MAX_BYTES,
    LOG_WINDOW,
    MAX_CONNECTIONS,
    MAX_CONNECTIONS_PER_SLOT,
    MAX_LOOKUPS_PER_SLOT,
    MAX_METADATA_PER_SLOT,
    METADATA,
    NODE_SERVICES,
    PEEK_TIMEOUT,
    RESOLVE_TTL,
    RESOLVER,
)
from agentenv.network.egress.metrics import (
    Counters,
    metrics_text,
    rss_bytes,
    serve_metrics_client,
)
from agentenv.network.egress.names import NameAnswers
from agentenv.network.egress.peek import peek
from agentenv.network.egress.pumps import CopyPump, SplicePump
from agentenv.network.egress.resolver import FilteringResolver
from agentenv.network.egress.shares import evict_over_share, slot_share
from agentenv.network.egress.upstream import connect, relay_through_tunnel
from agentenv.network.policy import WEB_PORTS, EgressPolicy

log = logging.getLogger("agentenv.egress")


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
        self.walls = Walls(open_ranges)
        self.names = NameAnswers(resolve_ttl, name_server)
        self.dns_upstream = dns_upstream
        self.resolver = FilteringResolver(dns_upstream, self.slots, self.counters, self.events,
                                          self.spawn) \
            if dns_upstream is not None else None  # None: no filtering resolver
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
        if self.resolver is not None:
            # The filtering resolver's UDP side, on the same port number (the host redirects
            # the slots' UDP to 169.254.169.254:53 here).
            self.resolver.open(self.loop, self.bind, self.port)
        path = Path(self.control_path)
        path.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):
            path.unlink()
        old_umask = os.umask(0o177)  # the socket is the node's alone
        try:
            self._servers.append(await asyncio.start_unix_server(
                functools.partial(serve_control_client, self), self.control_path,
                limit=CONTROL_LINE_MAX))
        finally:
            os.umask(old_umask)
        if self.metrics_port is not None:
            self._servers.append(await asyncio.start_server(
                functools.partial(serve_metrics_client, self.metrics_text), self.metrics_bind,
                self.metrics_port))
        self.spawn(self._sweep())
        if self.log_max_bytes:
            self.spawn(self._trim_log())
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
        if self.resolver is not None:
            self.resolver.close()
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

    def spawn(self, coro: Any) -> asyncio.Task[Any]:
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
            close_with_reset(sock)
            return
        try:
            dst_ip, dst_port = original_destination(sock)
        except OSError as exc:
            self.events.log(source, "no_original_dst", logging.WARNING,
                            "egress: no original destination",
                            {"event": "no_original_dst", "source": source, "error": str(exc)})
            close_with_reset(sock)
            return
        is_metadata = (dst_ip, dst_port) in NODE_SERVICES
        if is_metadata:
            # Metadata has caps of its own: a slot's egress connections never deny it.
            over = len(slot.metadata) >= self.max_metadata_per_slot
            held, limit = len(slot.metadata), self.max_metadata_per_slot
        else:
            limit = self.slot_share()
            held = len(slot.conns)
            over = held >= limit or (
                self.egress_connections >= self.max_connections
                and not evict_over_share(self.slots.values(), limit, source, self.counters,
                                         self.events))
        if over:
            self.counters.over_capacity += 1
            self.events.log(source, "over_capacity", logging.WARNING,
                            "egress connection cap reached", {
                                "event": "over_capacity", "source": source,
                                "metadata": is_metadata, "total": self.egress_connections,
                                "slot_total": held, "slot_limit": limit})
            close_with_reset(sock)
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
        return slot_share(self.max_connections, self.max_per_slot, len(self.slots))

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

    def current_slot(self, conn: Conn) -> Slot:
        slot = self.slots.get(conn.source)
        if slot is None or slot is not conn.slot:
            raise Refused("the slot was removed")
        return slot

    async def _decide(self, conn: Conn, name: str | None) -> EgressPolicy:
        """Raises Refused unless the slot's current policy lets this connection out; a name
        that decides it must resolve to the destination here (NameAnswers)."""
        slot = self.current_slot(conn)
        decision = policy_decision(conn, slot.entry.policy, name)
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
        judge(conn, decision, name, answers)
        return self.current_slot(conn).entry.policy  # (the lookup may have waited)

    def _decide_now(self, conn: Conn, policy: EgressPolicy, name: str | None) -> None:
        """_decide for a decision that cannot wait for a lookup (a keep-alive request head, a
        policy update over live connections): a name is checked against its last answers."""
        decision = policy_decision(conn, policy, name)
        answers = self.names.known(name) \
            if decision.verdict == "bind" and name is not None else None
        judge(conn, decision, name, answers)

    async def _handle(self, conn: Conn) -> None:
        try:
            if (conn.dst_ip, conn.dst_port) == METADATA:
                await self._metadata(conn)
                return
            if (conn.dst_ip, conn.dst_port) == RESOLVER:
                if self.resolver is None:
                    raise Refused("no filtering resolver on this node")
                await self.resolver.serve_tcp(conn)
                return
            if conn.dst_ip in self.walls:
                raise Refused("destination behind the walls")
            data, name, kind = b"", None, "opaque"
            if conn.dst_port in WEB_PORTS:
                data, name, kind = await peek(self.loop, conn.guest, self.peek_timeout)
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
            await connect(self.loop, conn, self.current_slot(conn).entry.policy.egress_proxy,
                          self.connect_timeout, self.walls)
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
                    assert isinstance(up, CopyPump)
                    stream.release = up.inject
                for pump in conn.pumps:
                    pump.start()
            else:
                await relay_through_tunnel(self.loop, self.counters, conn, data, stream,
                                           transform, responses)
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
              data: bytes) -> CopyPump | SplicePump:
        assert conn.upstream is not None
        src, dst = (conn.guest, conn.upstream) if up else (conn.upstream, conn.guest)
        if self.splice and transform is None and not data:
            try:
                return SplicePump(conn, src, dst, up)
            except OSError:  # no pipe to be had (descriptor limits): copy instead
                pass
        return CopyPump(conn, src, dst, up, transform, data)

    def _on_http_head(self, conn: Conn, head: httphead.RequestHead) -> bytes:
        name = head.host()
        conn.name = name
        policy = self.current_slot(conn).entry.policy
        self._decide_now(conn, policy, name)
        return httphead.with_headers(httphead.without_h2c(head),
                                     policy.header_rules(name) if name else ())

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
        return handle_request(self, request)

    # -- metrics -------------------------------------------------------------------------------

    def metrics_text(self) -> str:
        return metrics_text(self.counters, len(self.slots), len(self.conns),
                            self.metadata_connections)
