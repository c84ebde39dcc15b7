"""A name's addresses as the proxy sees them: what a name-bound policy decision is checked
against (the destination must be one of them)."""

from __future__ import annotations

import asyncio
import functools
import os
import socket
from concurrent.futures import ThreadPoolExecutor
from ipaddress import IPv4Address

from agentenv.network import dns


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

