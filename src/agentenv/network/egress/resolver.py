"""The filtering resolver at 169.254.169.254:53 (dns.py): a slot's query for a name its policy
lets it resolve is forwarded to the upstream resolver, any other is refused. UDP on the proxy's
port number (the host redirects the slots' UDP there), TCP through the proxy's listener."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import struct
from collections.abc import Callable, Coroutine
from typing import Any

from agentenv.logs import PerKeyLimit
from agentenv.network import dns, metadata
from agentenv.network.egress.conn import Conn, Slot
from agentenv.network.egress.limits import MAX_DNS_INFLIGHT_PER_SLOT
from agentenv.network.egress.metrics import Counters


class FilteringResolver:
    """The resolver of one proxy: its slot table (read), counters and event log; `spawn` runs
    a forwarded UDP query beside the others."""

    def __init__(self, upstream: tuple[str, int], slots: dict[str, Slot], counters: Counters,
                 events: PerKeyLimit, spawn: Callable[[Coroutine[Any, Any, None]], Any]) -> None:
        self.upstream = upstream
        self.slots, self.counters, self.events, self.spawn = slots, counters, events, spawn
        self._sock: socket.socket | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def open(self, loop: asyncio.AbstractEventLoop, bind: str, port: int) -> None:
        """The UDP side, on the same port number as the proxy's listener."""
        self._loop = loop
        udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        udp.bind((bind, port))
        udp.setblocking(False)
        self._sock = udp
        loop.add_reader(udp.fileno(), self._on_datagram)

    def close(self) -> None:
        if self._sock is not None and self._loop is not None:
            self._loop.remove_reader(self._sock.fileno())
            self._sock.close()
            self._sock = None

    def _decide(self, source: str, message: bytes) -> tuple[bytes | None, Slot | None]:
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

    async def _forward(self, message: bytes, source: str) -> bytes:
        try:
            answer = await dns.forward_udp(message, self.upstream)
        except (OSError, TimeoutError) as exc:
            self.counters.dns_failed += 1
            self.events.log(source, "dns_upstream_failed", logging.INFO,
                                  "dns upstream failed", {"event": "dns_upstream_failed",
                                                          "source": source,
                                                          "error": str(exc) or type(exc).__name__})
            return dns.error_response(message, dns.RCODE_SERVFAIL, dns.parse_query(message))
        self.counters.dns_answered += 1
        return answer

    def _on_datagram(self) -> None:
        assert self._sock is not None
        for _ in range(64):  # a burst per wake-up, then let the others run
            try:
                message, (source, port) = self._sock.recvfrom(dns.MAX_MESSAGE + 1)
            except OSError:  # (BlockingIOError: nothing more to read)
                return
            now, slot = self._decide(source, message)
            if now is not None:
                self._reply(now, (source, port))
            elif slot is not None and slot.dns_inflight < MAX_DNS_INFLIGHT_PER_SLOT:
                slot.dns_inflight += 1
                self.spawn(self._udp(message, slot, (source, port)))
            else:
                # over the slot's cap: dropped, the stub retries
                self.counters.dns_failed += 1

    async def _udp(self, message: bytes, slot: Slot, to: tuple[str, int]) -> None:
        try:
            self._reply(await self._forward(message, to[0]), to)
        finally:
            slot.dns_inflight -= 1

    def _reply(self, answer: bytes, to: tuple[str, int]) -> None:
        if self._sock is not None:
            with contextlib.suppress(OSError):
                self._sock.sendto(answer, to)

    async def serve_tcp(self, conn: Conn) -> None:
        """DNS over TCP (two-byte length, then the message), one query at a time."""
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
                conn.last_active = asyncio.get_running_loop().time()
                answer, _ = self._decide(conn.source, message)
                if answer is None:
                    answer = await self._forward(message, conn.source)
                writer.write(struct.pack("!H", len(answer)) + answer)
                await writer.drain()
        except (OSError, TimeoutError, asyncio.IncompleteReadError):
            conn.reset()
            return
        conn.close()
