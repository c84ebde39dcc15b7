"""Destinations: where a redirected connection was going (SO_ORIGINAL_DST), and whether that is
behind the walls (private ranges, loopback, link-local, multicast, an address of this host)."""

from __future__ import annotations

import contextlib
import socket
import struct
import time
from ipaddress import IPv4Address, IPv4Network

from agentenv.network.egress.limits import SO_ORIGINAL_DST
from agentenv.network.walls import WALL_NETS, extra_walls


def original_destination(sock: socket.socket) -> tuple[IPv4Address, int]:
    raw = sock.getsockopt(socket.SOL_IP, SO_ORIGINAL_DST, 16)
    port, packed = struct.unpack_from("!2xH4s", raw)
    return IPv4Address(packed), port


class LocalAddresses:
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


class Walls:
    """The walls the slot's own ruleset holds (network/walls.py), checked here again because
    the proxy connects from the host, where they would not apply; `open_ranges` open walled
    ranges anyway (a lab's private network)."""

    def __init__(self, open_ranges: tuple[IPv4Network, ...] = ()) -> None:
        self.open_ranges = open_ranges
        self.nets = (*WALL_NETS, *extra_walls())
        self.local = LocalAddresses()

    def __contains__(self, ip: IPv4Address) -> bool:
        if any(ip in net for net in self.open_ranges):
            return False
        return any(ip in net for net in self.nets) or ip in self.local
