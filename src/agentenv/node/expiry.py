"""Timeouts and idleness: endAt, the reaper that pauses or kills sandboxes past it, and the idle
pause (node/orchestrator.py wires this in; node/idle.py measures idleness).

A sandbox paused for idleness counts as running for its caller: its endAt goes on, and when
it is reached the pause it has becomes a timeout's (autoPause) or it is killed.
"""

from __future__ import annotations

import asyncio
import time
from typing import Protocol

from agentenv.api.event_models import UPDATED
from agentenv.api.models import iso
from agentenv.node.host import RecordsHost
from agentenv.node.idle import IDLE_REASON, IdleTracker
from agentenv.node.operations import gone, log, log_reap, unless_idle
from agentenv.node.pauses import Pauses
from agentenv.node.records import SandboxRecord, State


class ExpiryHost(RecordsHost, Protocol):
    """What timeouts use of the orchestrator besides RecordsHost (node/host.py)."""

    activity: IdleTracker

    @property
    def closing(self) -> bool: ...

    def begin_kill(self, rec: SandboxRecord, previous: State, why: str = "request"
                   ) -> asyncio.Task[None]: ...


class Expiry:
    def __init__(self, host: ExpiryHost, pauses: Pauses) -> None:
        self._host = host
        self._pauses = pauses

    async def set_timeout(self, sandbox_id: str, seconds: int, shorten: bool = True) -> None:
        """`endAt = now + seconds` (may shorten unless `shorten` is False); running only (a
        sandbox paused for idleness counts as running: its endAt goes on)."""
        host = self._host
        host.check_open()
        rec = await host.ops.await_state(
            sandbox_id, {State.RUNNING, State.SNAPSHOTTING, State.FORKING, State.PAUSED},
            {State.PAUSING: unless_idle(gone), State.KILLING: gone})
        if rec.state == State.PAUSED and rec.pause_reason != IDLE_REASON:
            raise gone(rec)
        end = time.time() + host.clamp_timeout(seconds, 0)
        rec.end_at = end if shorten else max(rec.end_at, end)
        await host.store.put_sandbox(rec)
        host.emit(UPDATED, rec, set_timeout=iso(rec.end_at))

    async def reap_forever(self) -> None:
        while True:
            await asyncio.sleep(self._host.config.reaper_interval)
            try:
                self.reap_once()
            except Exception:
                log.exception("reaper pass failed")

    def reap_once(self) -> int:
        """Pause (autoPause) or kill every running sandbox past its endAt, and every one paused
        for idleness (its endAt goes on); pause those idle for their idlePauseAfter. Returns
        how many timed out."""
        host = self._host
        now = time.time()
        count = 0
        host.activity.retain(host.sandboxes)
        for rec in list(host.sandboxes.values()):
            sid = rec.sandbox_id
            if sid in host.ops.running:
                continue
            if rec.state == State.PAUSED and rec.pause_reason == IDLE_REASON and rec.end_at <= now:
                count += 1
                self._expire_idle_pause(rec)
                continue
            if rec.state != State.RUNNING:
                continue
            if rec.end_at > now:
                if rec.idle_pause_after and not host.closing \
                        and host.activity.idle_for(sid) >= rec.idle_pause_after:
                    work = self._pauses.begin_pause(rec, True, IDLE_REASON)
                    host.ops.in_background(log_reap(sid, work, "idle sandbox paused"))
                continue
            count += 1
            if rec.auto_pause:
                work = self._pauses.begin_pause(rec, rec.auto_pause_memory, "timeout")
            else:
                work = host.begin_kill(rec, State.RUNNING, "timeout")
            host.ops.in_background(log_reap(sid, work, "sandbox timed out"))
        return count

    def _expire_idle_pause(self, rec: SandboxRecord) -> None:
        """A sandbox paused for idleness reached its endAt: what its timeout does to a running
        one, it does now (autoPause: the pause it has becomes a timeout's; else a kill)."""
        sid = rec.sandbox_id
        if rec.auto_pause:
            work = self._pauses.repurpose_idle_pause(rec, "timeout", rec.auto_pause_memory)
        else:
            work = self._host.begin_kill(rec, State.PAUSED, "timeout")
        self._host.ops.in_background(log_reap(sid, work, "sandbox timed out while idle"))
