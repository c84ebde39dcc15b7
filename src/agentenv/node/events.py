"""Lifecycle events: every transition of a sandbox (and of a template build), in the node's
SQLite, in E2B's event shape (`GET /events/sandboxes`, docs/e2b-api.md).

`EventLog.record` is synchronous and never waits: lifecycle code calls it at each transition,
and a single writer task stores what was recorded in batches, in recording order, so the
SQLite `seq` of the events table is their node-wide order (a monotonically increasing id next
to E2B's uuid `id`). Each stored event is then offered to the sinks (the webhooks,
node/webhooks.py), which must not block either. Events older than the retention are pruned.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import time
import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol

from agentenv.api.event_models import TEMPLATE_PREFIX
from agentenv.api.models import iso
from agentenv.node.store import Store
from agentenv.settings import get_settings

log = logging.getLogger("agentenv.node.events")

RETENTION_ENV = "AENV_EVENTS_RETENTION_DAYS"
PRUNE_INTERVAL = 3600.0
#: events recorded and not yet stored; past this the oldest unstored are dropped (logged):
#: a stuck disk must not grow the node's memory without bound
MAX_UNSTORED = 100_000


@dataclass
class Event:
    type: str
    team: str
    sandbox_id: str = ""
    template_id: str = ""
    build_id: str = ""
    execution_id: str = ""
    data: dict[str, Any] | None = None
    timestamp: float = field(default_factory=time.time)
    id: str = field(default_factory=lambda: str(uuid.uuid4()))
    node_id: str = ""
    seq: int = 0  # set when stored

    def to_json(self) -> dict[str, Any]:
        """E2B's event (v2 fields), plus `seq` and `nodeId`."""
        return {
            "version": "v2",
            "id": self.id,
            "seq": self.seq,
            "type": self.type,
            "eventData": self.data,
            "sandboxBuildId": self.build_id,
            "sandboxExecutionId": self.execution_id,
            "sandboxId": self.sandbox_id,
            "sandboxTeamId": self.team,
            "sandboxTemplateId": self.template_id,
            "nodeId": self.node_id,
            "timestamp": iso(self.timestamp),
        }

    def _doc(self) -> str:
        return json.dumps({**self.to_json(), "ts": self.timestamp})

    @classmethod
    def from_doc(cls, seq: int, doc: str) -> Event:
        d = json.loads(doc)
        return cls(type=d["type"], team=d["sandboxTeamId"], sandbox_id=d["sandboxId"],
                   template_id=d["sandboxTemplateId"], build_id=d["sandboxBuildId"],
                   execution_id=d["sandboxExecutionId"], data=d["eventData"],
                   timestamp=d["ts"], id=d["id"], node_id=d["nodeId"], seq=seq)


class EventSink(Protocol):
    """Where stored events go next (the webhooks): started once the store is open, stopped
    before it closes; `offer` must return at once."""

    async def start(self) -> None: ...

    async def stop(self) -> None: ...

    def offer(self, event: Event) -> None: ...


def retention_from_env() -> float:
    """Seconds events are kept (AENV_EVENTS_RETENTION_DAYS, default 7 days as E2B; 0: none
    are recorded, nor delivered to webhooks)."""
    days = get_settings().events_retention_days
    if days < 0:
        raise ValueError(f"{RETENTION_ENV} must be 0 (keep none) or more, got {days!r}")
    return days * 86400


class EventLog:
    def __init__(self, store: Store, node_id: str, retention: float) -> None:
        self.store = store
        self.node_id = node_id
        self.retention = retention
        self.sinks: list[EventSink] = []
        self.dropped = 0
        self._pending: list[Event] = []
        self._wake = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._writer: asyncio.Task[None] | None = None
        self._pruner: asyncio.Task[None] | None = None
        #: set (and replaced) each time events are stored: what a long poll (`since`) waits on
        self._stored = asyncio.Event()

    def record(self, event: Event) -> None:
        """Queue `event` for storing; returns at once (lifecycle code calls this inline)."""
        if not self.retention:
            return
        event.node_id = self.node_id
        if len(self._pending) >= MAX_UNSTORED:
            self._pending.pop(0)
            self.dropped += 1
            log.warning("event dropped: the store is behind", extra={"dropped": self.dropped})
        self._pending.append(event)
        self._idle.clear()
        self._wake.set()

    async def start(self) -> None:
        await self.store.prune_events(time.time() - self.retention)
        for sink in self.sinks:
            await sink.start()
        self._writer = asyncio.create_task(self._write_forever(), name="events-writer")
        self._pruner = asyncio.create_task(self._prune_forever(), name="events-pruner")

    async def stop(self) -> None:
        """Store what was recorded, then stop (before the store closes)."""
        if self._writer is None:
            return
        with contextlib.suppress(asyncio.TimeoutError):
            await asyncio.wait_for(self.flush(), 10)
        for task in (self._writer, self._pruner):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._writer = None
        self._stored.set()  # a long poll answers now
        for sink in self.sinks:
            await sink.stop()

    async def flush(self) -> None:
        """Return once every event recorded so far is stored (a reader sees its own writes)."""
        await self._idle.wait()

    async def _write_forever(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            batch, self._pending = self._pending, []
            if batch:
                await self._store(batch)
            if not self._pending:
                self._idle.set()

    async def _store(self, batch: list[Event]) -> None:
        rows = [(e.timestamp, e.type, e.team, e.sandbox_id, e._doc()) for e in batch]
        try:
            seqs = await self.store.add_events(rows)
        except Exception:
            self.dropped += len(batch)
            log.exception("events not stored", extra={"count": len(batch)})
            return
        stored, self._stored = self._stored, asyncio.Event()
        stored.set()
        for event, seq in zip(batch, seqs, strict=True):
            event.seq = seq
            for sink in self.sinks:
                try:
                    sink.offer(event)
                except Exception:
                    log.exception("event sink failed", extra={"type": event.type})

    async def _prune_forever(self) -> None:
        while True:
            await asyncio.sleep(PRUNE_INTERVAL)
            try:
                await self.store.prune_events(time.time() - self.retention)
            except Exception:
                log.exception("event pruning failed")

    async def query(self, team: str, *, sandbox_id: str | None = None,
                    types: list[str] | None = None, after: int = 0,
                    before: int | None = None, offset: int = 0, limit: int = 10,
                    ascending: bool = False) -> list[Event]:
        """The team's events; template build events only when `types` names them."""
        await self.flush()
        rows = await self.store.query_events(
            team, sandbox_id=sandbox_id, types=types or [], exclude_prefix=TEMPLATE_PREFIX,
            after=after, before=before, offset=offset, limit=limit, ascending=ascending)
        return [Event.from_doc(seq, doc) for seq, doc in rows]

    async def since(self, after: int, limit: int, wait: float = 0) -> tuple[list[Event], int]:
        """Every team's stored events after seq `after`, in seq order, and the last seq this
        node's store ever gave (below `after`: the store was made anew). With `wait`, a long
        poll: when there are none yet, the answer waits up to `wait` seconds for the next
        stored batch (the gateway's collector learns of an event as it is stored, and asks
        nothing while there is none)."""
        stored = self._stored  # taken before reading: a batch stored meanwhile sets it
        rows, last = await self.store.events_after(after, limit)
        if not rows and wait > 0 and last >= after and self._writer is not None:
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(stored.wait(), wait)
            rows, last = await self.store.events_after(after, limit)
        return [Event.from_doc(seq, doc) for seq, doc in rows], last
