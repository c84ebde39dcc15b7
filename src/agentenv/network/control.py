"""The node's side of the egress proxy's control socket.

One egress proxy process serves every slot of a node (TCP the kernel redirects to it, and the
metadata service at 169.254.169.254). It knows a connection's sandbox by its source address:
the slot's `guest_address` (the slot namespace SNATs guest traffic to it). The node tells it,
over a unix socket, which sandbox each source address is and what that sandbox may reach.

Protocol: one JSON object per line each way, one answer per request, in order.
  {"op": "ping"}                                  -> {"ok": true, "slots": N, "rss_bytes": N,
                                                      "port": N, "connections": N, counters...}
  {"op": "set", "slot": SLOT}                     -> {"ok": true, "cut": N}
      replaces the slot's identity and policy; live connections the new policy denies are cut
      (all of them when the sandbox id changes: another sandbox now owns the source)
  {"op": "remove", "source": "10.12.0.3"}         -> {"ok": true, "cut": N}  (unknown: still ok)
  {"op": "sync", "slots": [SLOT, ...]}            -> {"ok": true}
      replaces the whole table (after either side restarts)
  errors: {"ok": false, "error": "text naming what was wrong"}
SLOT = {"source": "10.12.0.3", "identity": IDENTITY, "policy": EgressPolicy.to_wire(secrets=True)}
IDENTITY = SlotIdentity's fields (what the metadata service answers the guest).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from agentenv.network.policy import EgressPolicy


class EgressControlError(RuntimeError):
    """The egress proxy could not be reached or refused a request."""


@dataclass(frozen=True)
class SlotIdentity:
    """Who a slot's guest is, as the metadata service tells it (and nothing more)."""

    sandbox_id: str
    template_id: str
    snapshot_id: str | None  # the snapshot it was restored from, if any
    envd_token_sha256: str | None  # hex digest of the envd access token (never the token)
    instance_token: str  # per-sandbox secret the guest can present to services


@dataclass(frozen=True)
class SlotEntry:
    source: str  # the slot's guest_address, as the host sees the guest's connections
    identity: SlotIdentity
    policy: EgressPolicy

    def to_wire(self) -> dict[str, Any]:
        return {"source": self.source, "identity": asdict(self.identity),
                "policy": self.policy.to_wire(secrets=True)}

    @classmethod
    def from_wire(cls, raw: dict[str, Any]) -> SlotEntry:
        return cls(str(raw["source"]), SlotIdentity(**raw["identity"]),
                   EgressPolicy.from_wire(raw.get("policy") or {}))


class EgressControlClient:
    """Requests to the egress proxy, one at a time; reconnects after a failure."""

    def __init__(self, socket_path: Path | str, timeout: float = 5.0) -> None:
        self.socket_path = str(socket_path)
        self.timeout = timeout
        self._lock = asyncio.Lock()
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def _call(self, request: dict[str, Any]) -> dict[str, Any]:
        async with self._lock:
            try:
                async with asyncio.timeout(self.timeout):
                    if self._writer is None:
                        self._reader, self._writer = await asyncio.open_unix_connection(
                            self.socket_path, limit=16 << 20)
                    assert self._reader is not None
                    self._writer.write(json.dumps(request).encode() + b"\n")
                    await self._writer.drain()
                    line = await self._reader.readline()
                if not line:
                    raise ConnectionResetError("the egress proxy closed the control connection")
                answer: dict[str, Any] = json.loads(line)
            except (OSError, TimeoutError, ValueError) as exc:
                await self._drop()
                raise EgressControlError(
                    f"egress proxy at {self.socket_path}: {request['op']} failed: {exc}") from exc
        if not answer.get("ok"):
            raise EgressControlError(f"egress proxy refused {request['op']}: {answer.get('error')}")
        return answer

    async def _drop(self) -> None:
        writer, self._reader, self._writer = self._writer, None, None
        if writer is not None:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def ping(self) -> dict[str, Any]:
        return await self._call({"op": "ping"})

    async def set_slot(self, entry: SlotEntry) -> None:
        await self._call({"op": "set", "slot": entry.to_wire()})

    async def remove_slot(self, source: str) -> None:
        await self._call({"op": "remove", "source": source})

    async def sync(self, entries: list[SlotEntry]) -> None:
        await self._call({"op": "sync", "slots": [e.to_wire() for e in entries]})

    async def close(self) -> None:
        async with self._lock:
            await self._drop()
