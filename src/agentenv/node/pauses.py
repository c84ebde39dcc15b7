"""Pause, resume and connect of the node's sandboxes (node/orchestrator.py wires this in).

A pause is recorded as pending (store.pending_ops) before the backend writes its snapshot; a
node killed between that write and the paused record finds the snapshot again at its next start
(node/recovery.py). Only the last pause is a resume or rollback target: once a pause has
answered, the earlier ones no record names are released (`release_unnamed`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections.abc import Awaitable
from typing import Any, Protocol

from agentenv.api.errors import ApiError, Conflict, Internal
from agentenv.api.event_models import FAILED, KILLED, PAUSED, RESUMED
from agentenv.node.backend import BackendError, Placement
from agentenv.node.host import NodeCounters, RunHost
from agentenv.node.idle import IDLE_REASON, IdleTracker
from agentenv.node.operations import (
    STABLE,
    backend_failure,
    execution,
    failure_reason,
    log,
    unless_idle,
)
from agentenv.node.records import SandboxRecord, State
from agentenv.settings import get_settings

#: Fault injection for tests only: when this variable names a crash point, the node process
#: ends with os._exit there (as a kill -9 would), e.g. "pause-snapshot-written": right after
#: the backend wrote a pause snapshot, before the node recorded it.
CRASH_POINT_ENV = "AENV_TEST_CRASH_AT"
CRASH_EXIT_CODE = 86


def _crash_point(name: str) -> None:
    if get_settings().test_crash_at == name:
        log.error("test crash point reached: exiting at once", extra={"crash_point": name})
        os._exit(CRASH_EXIT_CODE)


#: seconds an auto-resume that failed keeps traffic from trying again, doubled at each failure
#: in a row up to AUTO_RESUME_BACKOFF_MAX_S: a guest that broke its own resume (envd replaced
#: by a server that never answers) made every allowed request a full restore held up to 30 s
#: (red team of 2026-12-07). A connect by the sandbox's owner is not held back.
AUTO_RESUME_BACKOFF_S = 5.0
AUTO_RESUME_BACKOFF_MAX_S = 300.0


class PauseHost(RunHost, Protocol):
    """What pauses and resumes use of the orchestrator besides RunHost (node/host.py)."""

    activity: IdleTracker
    counters: NodeCounters

    @property
    def closing(self) -> bool: ...

    def left_running(self, sandbox_id: str, why: str) -> None: ...

    async def forget(self, rec: SandboxRecord) -> None: ...


class Pauses:
    def __init__(self, host: PauseHost) -> None:
        self._host = host
        #: resumes ended early (end_resume), with what their callers get instead
        self._resume_ended: dict[str, ApiError] = {}
        #: auto-resumes by traffic that failed: sandbox -> (failures in a row, no new try
        #: before this `clock()` time)
        self._auto_resume_failed: dict[str, tuple[int, float]] = {}
        self.clock = time.monotonic

    async def pause(self, sandbox_id: str, memory: bool = True) -> None:
        host = self._host
        host.check_open()

        def busy(rec: SandboxRecord) -> ApiError:
            return Conflict(
                f"sandbox {sandbox_id!r} cannot be paused while in '{rec.state.value}' state")

        rec = await host.ops.await_state(sandbox_id, {State.RUNNING, State.PAUSED}, {
            State.PAUSING: unless_idle(busy), State.KILLING: busy})
        if rec.state == State.PAUSED:
            if rec.pause_reason != IDLE_REASON:
                raise Conflict(f"sandbox {sandbox_id!r} is already paused")
            # Running as far as the caller knew: the node's pause becomes the caller's, which
            # traffic resumes only with autoResume (and a memory pause asked for).
            await self.repurpose_idle_pause(rec, "request", memory)
            return
        await asyncio.shield(self.begin_pause(rec, memory, "request"))

    def begin_pause(self, rec: SandboxRecord, memory: bool, why: str) -> asyncio.Task[None]:
        """The pause of a running sandbox as its one operation, PAUSING from now on with its
        reason (no await in between: a call that looks sees both)."""
        rec.state, rec.pause_reason = State.PAUSING, why
        self._host.left_running(rec.sandbox_id, "paused")
        return self._host.ops.start(rec.sandbox_id, "pause", self._do_pause(rec, memory, why))

    def repurpose_idle_pause(self, rec: SandboxRecord, why: str, memory: bool
                             ) -> Awaitable[None]:
        """An idle pause becomes a pause for `why` ("request", "timeout"), as if the sandbox
        had been running until now (its snapshot serves as it is); returns the record's write.
        The change is made at once; the store writes in call order, so a transition begun
        meanwhile (a resume) writes its record after this one."""
        rec.pause_reason, rec.pause_asked_memory = why, memory
        self._host.emit(PAUSED, rec, pause_mode=rec.pause_mode, reason=why)
        return self._host.store.put_sandbox(rec)

    async def _do_pause(self, rec: SandboxRecord, memory: bool, why: str = "request") -> None:
        host = self._host
        rec.state = State.PAUSING
        sid = rec.sandbox_id
        assert rec.placement is not None
        try:
            await host.store.put_sandbox(rec)
            # Before the backend writes anything: a crash between its snapshot and the paused
            # record below is then repaired at the next start (node/recovery.py).
            await host.store.put_pending(sid, "pause", time.time(), {
                "memory": memory, "placement": rec.placement.to_json(), "reason": why})
            result = await host.backend.pause(sid, rec.placement, memory)
        except BackendError as exc:
            with contextlib.suppress(Exception):
                await host.store.delete_pending(sid)
            host.emit(FAILED, rec, operation="pause", reason=str(exc))
            if exc.retryable:
                rec.state = State.RUNNING
                await host.store.put_sandbox(rec)
                raise Internal(f"failed to pause sandbox {sid}: {exc}") from exc
            await host.forget(rec)
            host.emit(KILLED, rec, kill_reason="lost while pausing")
            raise Internal(f"sandbox {sid} was lost while pausing: {exc}") from exc
        _crash_point("pause-snapshot-written")
        rec.placement = None
        rec.pause_snapshot = result.snapshot
        rec.pause_mode = "full" if result.memory else "filesystem"
        rec.pause_asked_memory = memory
        rec.last_pause = result.snapshot
        rec.state = State.PAUSED
        await host.store.finish_pause(rec, [*rec.source.layers, *result.snapshot.layers])
        if why == IDLE_REASON:
            host.counters.idle_pauses += 1
        host.emit(PAUSED, rec, pause_mode=rec.pause_mode, reason=why, execution=execution(rec))
        log.info("sandbox paused", extra={"sandbox_id": sid, "mode": rec.pause_mode})
        host.ops.in_background(self.release_unnamed(rec, host.ops.running.get(sid)))

    async def release_unnamed(self, rec: SandboxRecord, pausing: asyncio.Task[Any] | None
                              ) -> None:
        """Once the pause `pausing` is over (its caller has its answer): the sandbox's earlier
        pauses and fork points that no record names any more are released (only the last
        pause is a resume or rollback target; a child names the pause it was forked from as
        its source). Without this, every pause cycle kept the memory it dirtied on disk until
        the sandbox was deleted. Skipped when another operation began meanwhile (a snapshot it
        makes may not be named yet); the next pause does it. A failure costs disk: logged."""
        host = self._host
        branching = host.capabilities.branching
        if branching is None:
            return
        if pausing is not None:
            await asyncio.wait([pausing])
        sid = rec.sandbox_id
        if host.sandboxes.get(sid) is not rec or rec.state != State.PAUSED \
                or sid in host.ops.running:
            return
        # No await from here to the backend's reading of what the sandbox owns.
        named = [ref for other in host.sandboxes.values()
                 for ref in (other.source, other.pause_snapshot, other.last_pause)
                 if ref is not None]
        try:
            await branching.release_snapshots(sid, named)
        except Exception as exc:
            log.warning("earlier snapshots of a sandbox not released",
                        extra={"sandbox_id": sid, "error": str(exc)})

    async def release_all_unnamed(self) -> None:
        for rec in [r for r in self._host.sandboxes.values() if r.state == State.PAUSED]:
            await self.release_unnamed(rec, None)

    async def connect(self, sandbox_id: str, timeout: int | None,
                      memory: bool = True) -> tuple[SandboxRecord, bool]:
        """Make sure the sandbox runs; returns (record, resumed). memory=False (the SDK's
        on_resume="reboot"): a paused sandbox cold-boots from its disk even when its pause
        kept memory (the memory snapshot is left as it is)."""
        host = self._host
        host.check_open()
        seconds = host.clamp_timeout(timeout, host.config.default_timeout)
        rec = await host.ops.await_state(sandbox_id, STABLE, {
            State.KILLING: lambda rec: Conflict(f"sandbox {sandbox_id!r} is being killed")})
        if rec.state == State.RUNNING:
            host.activity.touch(sandbox_id)  # an SDK's connect: it is in use
            rec.end_at = max(rec.end_at, time.time() + seconds)
            await host.store.put_sandbox(rec)
            return rec, False
        # No await until the state changes: the resuming record counts from then on.
        host.release(host.admit(f"resume sandbox {sandbox_id}", rec.memory_mb, rec.cpu_count))
        rec.state = State.RESUMING
        await host.ops.launch(sandbox_id, "resume", self._do_resume(rec, seconds, memory))
        return rec, True

    async def resume_legacy(
        self, sandbox_id: str, timeout: int | None, auto_pause: bool | None
    ) -> SandboxRecord:
        """`POST /sandboxes/{id}/resume` of SDK 2.0-2.5: 409 when the sandbox already runs."""
        host = self._host
        host.check_open()
        seconds = host.clamp_timeout(timeout, 15)
        rec = await host.ops.await_state(sandbox_id, {State.PAUSED}, dict.fromkeys(
            (State.RUNNING, State.KILLING, State.CREATING, State.RESUMING),
            lambda rec: Conflict(f"sandbox {sandbox_id!r} is already running")))
        host.release(host.admit(f"resume sandbox {sandbox_id}", rec.memory_mb, rec.cpu_count))
        if auto_pause is not None:
            rec.auto_pause = auto_pause
        rec.state = State.RESUMING
        await host.ops.launch(sandbox_id, "resume", self._do_resume(rec, seconds))
        return rec

    async def _do_resume(self, rec: SandboxRecord, timeout: int, memory: bool = True) -> None:
        host = self._host
        rec.state = State.RESUMING
        sid = rec.sandbox_id
        # A sandbox the node paused for idleness was running as far as its caller knew: its
        # endAt goes on (a connect may extend it, as it would a running one's).
        idle = rec.pause_reason == IDLE_REASON
        assert rec.pause_snapshot is not None
        placement: Placement | None = None
        try:
            await host.store.put_sandbox(rec)
            placement = await host.backend.resume(host.spec(rec), rec.pause_snapshot,
                                                  memory=memory)
            await host.envd_ready(rec, placement)
        except BaseException as exc:
            # roll back: the pause snapshot is untouched, the sandbox stays paused
            if placement is not None:
                with contextlib.suppress(Exception):
                    await host.backend.pause(sid, placement, True)
            rec.state = State.PAUSED
            with contextlib.suppress(Exception):
                await host.store.put_sandbox(rec)
            host.emit(FAILED, rec, operation="resume", reason=failure_reason(exc))
            if isinstance(exc, BackendError):
                raise backend_failure(f"failed to resume sandbox {sid}: {exc}", exc) from exc
            ended = self._resume_ended.pop(sid, None)
            if isinstance(exc, asyncio.CancelledError) and ended is not None:
                raise ended from None
            raise
        rec.placement = placement
        rec.pause_snapshot = None
        end = time.time() + timeout
        rec.end_at = max(rec.end_at, end) if idle else end
        rec.state = State.RUNNING
        await host.store.put_sandbox(rec)
        if idle:
            host.counters.idle_resumes += 1
        host.emit(RESUMED, rec, cold_boot=not memory, **({"idle_pause": True} if idle else {}))
        log.info("sandbox resumed", extra={"sandbox_id": sid})

    def end_resume(self, sandbox_id: str, why: ApiError) -> None:
        """End a resume under way now: it may be waiting on what its guest answers (bounded,
        but for as long as the restore timeout). It rolls back to paused (_do_resume) and its
        caller gets `why`."""
        rec = self._host.sandboxes.get(sandbox_id)
        task = self._host.ops.running.get(sandbox_id)
        if rec is not None and rec.state == State.RESUMING and task is not None:
            self._resume_ended[sandbox_id] = why
            task.cancel()

    def _auto_resume_failure(self, sandbox_id: str, failures: int, exc: Exception) -> None:
        wait = min(AUTO_RESUME_BACKOFF_S * 2 ** (failures - 1), AUTO_RESUME_BACKOFF_MAX_S)
        self._auto_resume_failed[sandbox_id] = (failures, self.clock() + wait)
        log.warning("auto-resume failed", extra={
            "sandbox_id": sandbox_id, "error": str(exc), "failures": failures,
            "next_try_s": wait})

    async def running_placement(self, sandbox_id: str) -> Placement | None:
        """For the proxy: where the sandbox runs, resuming it when autoResume (or an idle
        pause) allows; None if the sandbox is unknown, killed, or paused otherwise. A resume
        the node cannot take on now (429/503: full, shutting down) raises that ApiError: the
        sandbox is there, the caller may try again."""
        host = self._host
        rec = host.sandboxes.get(sandbox_id)
        for _ in range(3):
            if rec is None or rec.state == State.KILLING:
                self._auto_resume_failed.pop(sandbox_id, None)
                return None
            if rec.state == State.RUNNING:
                self._auto_resume_failed.pop(sandbox_id, None)
                return rec.placement
            if rec.state == State.PAUSED:
                # A filesystem-only pause asked for resumes on connect only (a cold boot: the
                # request would reach a sandbox that rebooted under it).
                if not rec.resumes_on_traffic or not rec.pause_asked_memory or host.closing:
                    return None
                failures, not_before = self._auto_resume_failed.get(sandbox_id, (0, 0.0))
                if self.clock() < not_before:
                    return None  # its last auto-resume failed: not again yet
                try:
                    # after an idle pause, the endAt it had (_do_resume)
                    await self.connect(sandbox_id, 0 if rec.pause_reason == IDLE_REASON
                                       else host.config.auto_resume_min_timeout)
                except ApiError as exc:
                    if exc.status in (429, 503):
                        raise
                    self._auto_resume_failure(sandbox_id, failures + 1, exc)
                    return None
                except Exception as exc:
                    self._auto_resume_failure(sandbox_id, failures + 1, exc)
                    return None
            elif rec.state == State.PAUSING and not rec.resumes_on_traffic:
                return None
            else:
                with contextlib.suppress(Conflict):
                    await host.ops.wait(sandbox_id, rec.state)
            rec = host.sandboxes.get(sandbox_id)
        return rec.placement if rec is not None and rec.state == State.RUNNING else None
