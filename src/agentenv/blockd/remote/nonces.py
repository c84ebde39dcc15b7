"""The record of the peer request credentials a chunk server took (docs/security.md §5): each
is taken once.

A request's credential (the scheduler's `r2`, a static peer's `s3`) carries a random nonce
and the time its node made it, both under its MAC or signature. The chunk server checks the
credential first (so a forged one, which anyone may send naming any node and nonce, records
nothing and cannot burn a node's nonce), then `use`s its (node, nonce): the first use is
recorded and served, a second is refused. The key is the verified values, the node as the
server knows it (`static/<id>`, `cluster/<id>`) and the nonce's bytes, never the header's
text (a nonce has several base64 spellings, a time can take leading zeros: all are one).

Bounded: an entry is dropped once its credential would be refused anyway (its time more than
cluster_keys.MAX_SKEW_S past, or its issued credential expired: `until`), and at most
`per_node` entries of one node and `total` of all are kept; past either, a new credential is
refused (not recorded, not served: "full") until entries expire. Dropping a live entry to make
room would let its credential be taken again, so none is.
"""

from __future__ import annotations

import heapq
import math
import sys
import threading
from enum import Enum

#: entries of one node, and of all: at 1 MiB chunks, 65536 requests within the 60 s an entry
#: lives (clocks agreeing) is ~1 GiB/s from this peer to that one node. An entry costs ~150
#: bytes (the nonce, a set slot, its place in its second's list): 262144 are ~40 MB
MAX_PER_NODE = 1 << 16
MAX_TOTAL = 1 << 18


class Use(Enum):
    FIRST = "first"  # recorded: serve it
    REPLAYED = "replayed"  # taken before and not yet expired
    FULL = "full"  # not recorded: the node's (or everyone's) share of the record is full


class UsedNonces:
    """(node, nonce) pairs taken, each until its credential's `until` (unix seconds)."""

    def __init__(self, per_node: int = MAX_PER_NODE, total: int = MAX_TOTAL) -> None:
        self.per_node, self.total = per_node, total
        self._lock = threading.Lock()
        self._used: dict[str, set[bytes]] = {}  # node -> its nonces still recorded
        self._expiring: dict[int, list[tuple[str, bytes]]] = {}  # second -> entries until then
        self._seconds: list[int] = []  # the keys of _expiring, a heap
        self.size = 0

    def use(self, node: str, nonce: bytes, until: float, now: float) -> Use:
        """Take `nonce` for `node` (verified) at `now`, recorded until `until`."""
        with self._lock:
            self._expire(now)
            used = self._used.get(node)
            if used is not None and nonce in used:
                return Use.REPLAYED
            if self.size >= self.total or (used is not None and len(used) >= self.per_node):
                return Use.FULL
            node = sys.intern(node)  # (one string per node, not one per entry)
            if used is None:
                used = self._used[node] = set()
            used.add(nonce)
            second = math.ceil(until)
            entries = self._expiring.get(second)
            if entries is None:
                entries = self._expiring[second] = []
                heapq.heappush(self._seconds, second)
            entries.append((node, nonce))
            self.size += 1
            return Use.FIRST

    def _expire(self, now: float) -> None:
        """Drops the entries whose `until` is before `now` (their credentials are refused by
        their time now)."""
        while self._seconds and self._seconds[0] < now:
            for node, nonce in self._expiring.pop(heapq.heappop(self._seconds)):
                used = self._used[node]
                used.discard(nonce)
                if not used:
                    del self._used[node]
                self.size -= 1

    def of(self, node: str) -> int:
        """How many of `node`'s nonces are recorded."""
        with self._lock:
            return len(self._used.get(node, ()))
