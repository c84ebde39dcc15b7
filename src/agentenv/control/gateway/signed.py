"""Which node and sandbox made a signed file URL, remembered for a while by each gateway.

A signed URL on the gateway's E2B_SANDBOX_URL names no sandbox, so the gateway asks every node
whose envd token made it (POST /cluster/file-signature-owner). The answer holds as long as the
signature does (its `signature_expiration`), or OWNER_TTL for a signature without one; a relay
that the node answers as a stale owner would (SANDBOX_GONE) drops it. The cache only picks
where to send a request: the node checks the signature of every request again.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs

#: how long the owner of a signature without expiration is remembered
OWNER_TTL = 60.0
#: entries kept per gateway (the oldest go first)
MAX_OWNERS = 10_000
#: a relay's answers that say the remembered owner may be wrong: the signature does not match
#: (401: the sandbox's token changed), the sandbox is not on that node (502, the node's
#: "sandbox was not found"), the node is gone (503), nothing there (404)
SANDBOX_GONE = frozenset({401, 404, 502, 503})

SignatureKey = tuple[str, str, str, str, str]


def signature_key(scope: dict[str, Any]) -> tuple[SignatureKey, float | None]:
    """What a file signature covers (method, signature, path, user, expiration): equal keys
    are the same signed request wherever the query's parameters sit; and the expiration as a
    time, if the URL has a valid one."""
    query = parse_qs(scope.get("query_string", b"").decode("latin-1"), keep_blank_values=True)

    def first(name: str) -> str:
        return (query.get(name) or [""])[0]

    expiration = first("signature_expiration")
    key = (scope["method"], first("signature"), first("path"), first("username"), expiration)
    try:
        return key, float(int(expiration)) if expiration else None
    except ValueError:
        return key, None


@dataclass(frozen=True)
class Owner:
    node_id: str
    sandbox_id: str
    until: float  # wall clock


class SignatureOwners:
    """A bounded LRU map of signed requests to their owner."""

    def __init__(self, max_entries: int = MAX_OWNERS, ttl: float = OWNER_TTL) -> None:
        self.max_entries = max_entries
        self.ttl = ttl
        self._owners: OrderedDict[SignatureKey, Owner] = OrderedDict()

    def __len__(self) -> int:
        return len(self._owners)

    def get(self, key: SignatureKey) -> Owner | None:
        owner = self._owners.get(key)
        if owner is None:
            return None
        if owner.until <= time.time():
            del self._owners[key]
            return None
        self._owners.move_to_end(key)
        return owner

    def put(self, key: SignatureKey, node_id: str, sandbox_id: str,
            expiration: float | None) -> None:
        until = expiration if expiration is not None else time.time() + self.ttl
        if until <= time.time():
            return  # expired already: the node answers 401, nothing worth remembering
        self._owners[key] = Owner(node_id, sandbox_id, until)
        self._owners.move_to_end(key)
        while len(self._owners) > self.max_entries:
            self._owners.popitem(last=False)

    def drop(self, key: SignatureKey) -> None:
        self._owners.pop(key, None)
