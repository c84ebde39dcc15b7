"""Sandboxes made from sandboxes: fork (of a running or a paused one), batch create, rollback
(node/orchestrator.py wires this in).

A fork's children are counted from the moment their records exist (`_new_children`); each
child runs or is gone whatever the others do (`_finish_children`). A rollback restores a
sandbox in place to one of its own snapshots with a new envd token, which waits in a pending
operation until the new VM runs (node/recovery.py decides after a crash).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Protocol

from agentenv.api.errors import ApiError, BadRequest, Conflict
from agentenv.api.event_models import FAILED, FORKED, KILLED, ROLLED_BACK
from agentenv.node.admission import Reservation
from agentenv.node.backend import (
    BackendError,
    ForkOutcome,
    SnapshotBranching,
    SnapshotRef,
)
from agentenv.node.catalogue import TemplateCatalogue
from agentenv.node.creation import CreateParams
from agentenv.node.host import RunHost
from agentenv.node.operations import STABLE, backend_failure, failure_reason, log
from agentenv.node.records import SandboxRecord, State
from agentenv.node.security import TokenIssuer, new_id

#: children of one fork or batch create (E2B's limit; the seed's 16 was the floor)
MAX_FORK_COUNT = 100


@dataclass
class ForkResult:
    record: SandboxRecord | None = None
    error: str | None = None
    status: int = 500


def check_count(count: int) -> None:
    if not 1 <= count <= MAX_FORK_COUNT:
        raise BadRequest(f"count must be between 1 and {MAX_FORK_COUNT}, got {count}: "
                         f"{MAX_FORK_COUNT} children per call is this node's limit")


class LineageHost(RunHost, Protocol):
    """What forks, batch creates and rollbacks use of the orchestrator besides RunHost
    (node/host.py)."""

    tokens: TokenIssuer
    catalogue: TemplateCatalogue

    def left_running(self, sandbox_id: str, why: str) -> None: ...

    async def forget(self, rec: SandboxRecord) -> None: ...


class Lineage:
    def __init__(self, host: LineageHost,
                 create: Callable[[CreateParams], Awaitable[SandboxRecord]]) -> None:
        self._host = host
        #: one create (node/creation.py), made `count` times by create_many
        self._create = create

    async def create_many(self, params: CreateParams, count: int) -> list[ForkResult]:
        """`count` sandboxes of one template or snapshot (an extension: a batch create), a
        result each: every one is admitted, made and cleaned up on its own (creates are
        admitted in turn, so those past a limit get its 429 and nothing of them is made).
        When none is made, the first refusal is the answer (e.g. 429 naming the limit)."""
        check_count(count)
        made = await asyncio.gather(*(self._create(params) for _ in range(count)),
                                    return_exceptions=True)
        results: list[ForkResult] = []
        for one in made:
            if isinstance(one, SandboxRecord):
                results.append(ForkResult(record=one, status=201))
            elif isinstance(one, ApiError):
                results.append(ForkResult(error=one.message, status=one.status))
            elif isinstance(one, Exception):
                results.append(ForkResult(error=f"create failed: {one}", status=500))
            else:
                raise one
        if not any(r.record for r in results):
            first = next(m for m in made if isinstance(m, BaseException))
            raise first
        return results

    def _branching(self, what: str) -> SnapshotBranching:
        """The backend's SnapshotBranching, or 400 naming what it cannot do."""
        branching = self._host.capabilities.branching
        if branching is None:
            raise BadRequest(
                f"the {self._host.backend.name} backend cannot {what}: the VM backend can")
        return branching

    async def fork(self, sandbox_id: str, count: int, timeout: int | None) -> list[ForkResult]:
        """`count` running children: of a running sandbox (checkpoint in place, it goes on
        running), or of a paused one from its pause snapshot (it stays paused, untouched)."""
        host = self._host
        host.check_open()
        check_count(count)
        seconds = host.clamp_timeout(timeout, host.config.fork_default_timeout)
        rec = await host.ops.await_state(sandbox_id, STABLE, {State.KILLING: lambda rec: Conflict(
            f"sandbox {sandbox_id!r} cannot be forked while in '{rec.state.value}' state")})
        paused = rec.state == State.PAUSED
        if paused:
            self._branching("fork a paused sandbox (resume it and fork the running one)")
            if rec.pause_snapshot is None:
                raise Conflict(f"paused sandbox {sandbox_id!r} has no pause snapshot")
        # Held until the children's records exist (_new_children), which count from then on.
        held = host.admit(f"fork sandbox {sandbox_id} into {count}", rec.memory_mb,
                          rec.cpu_count, count)
        rec.state = State.BRANCHING if paused else State.FORKING
        work = (self._do_fork_paused(rec, count, seconds, held) if paused
                else self._do_fork(rec, count, seconds, held))
        try:
            return await host.ops.launch(sandbox_id, "fork", work)
        finally:
            host.release(held)

    def _new_children(self, rec: SandboxRecord, count: int, timeout: int,
                      held: Reservation | None) -> list[SandboxRecord]:
        """Records of `count` children of `rec` (its settings, their own ids and tokens),
        counted from now on (the admission reservation goes)."""
        host = self._host
        now = time.time()
        children: list[SandboxRecord] = []
        for _ in range(count):
            cid = new_id("i")
            child = SandboxRecord.from_row(rec.to_row())
            child.sandbox_id = cid
            child.state = State.CREATING
            child.envd_access_token = host.tokens.envd_token(cid)
            if rec.traffic_access_token:
                child.traffic_access_token = host.tokens.traffic_token(cid)
            child.placement, child.pause_snapshot, child.pause_mode = None, None, None
            child.parent_sandbox_id, child.source_snapshot_id = rec.sandbox_id, None
            child.last_pause = None
            # a read-write volume stays the parent's: a child has its writes copy-on-write
            child.volume_mounts = [m.shared() for m in child.volume_mounts]
            child.started_at, child.end_at, child.created_at = now, now + timeout, now
            children.append(child)
            host.sandboxes[cid] = child
        host.release(held)
        return children

    async def _drop_children(self, children: list[SandboxRecord]) -> None:
        for child in children:
            self._host.sandboxes.pop(child.sandbox_id, None)
            with contextlib.suppress(Exception):
                await self._host.store.delete_sandbox(child.sandbox_id)

    async def _do_fork(self, rec: SandboxRecord, count: int, timeout: int,
                       held: Reservation | None = None) -> list[ForkResult]:
        host = self._host
        children = self._new_children(rec, count, timeout, held)
        assert rec.placement is not None
        try:
            for child in children:
                await host.store.put_sandbox(child)
            outcomes = await host.backend.fork(
                host.spec(rec), rec.placement, [host.spec(c) for c in children]
            )
        except BaseException as exc:
            await self._drop_children(children)
            rec.state = State.RUNNING
            host.emit(FAILED, rec, operation="fork", reason=failure_reason(exc))
            if isinstance(exc, BackendError):
                if not exc.retryable:
                    await host.forget(rec)
                    host.emit(KILLED, rec, kill_reason="lost while forking")
                raise backend_failure(f"failed to fork sandbox {rec.sandbox_id}: {exc}", exc) from exc
            raise
        finally:
            if rec.state == State.FORKING:
                rec.state = State.RUNNING
        return await self._finish_children(children, outcomes, timeout)

    async def _do_fork_paused(self, rec: SandboxRecord, count: int, timeout: int,
                              held: Reservation | None) -> list[ForkResult]:
        """Children start from the parent's pause snapshot, which is only read: the parent
        is never resumed (BRANCHING keeps its kill or resume waiting until they run)."""
        host = self._host
        snapshot = rec.pause_snapshot
        assert snapshot is not None  # fork() checked
        children = self._new_children(rec, count, timeout, held)
        try:
            for child in children:
                # Its source is the snapshot it starts from: the node's GC keeps that
                # snapshot's files while the child (or a fork of it) needs them.
                child.source = snapshot
                await host.store.put_sandbox(child)
            outcomes = await self._branching("fork a paused sandbox").fork_snapshot(
                snapshot, [host.spec(c) for c in children])
        except BaseException as exc:
            await self._drop_children(children)
            if isinstance(exc, BackendError):
                raise backend_failure(f"failed to fork paused sandbox {rec.sandbox_id}: {exc}",
                                      exc) from exc
            raise
        finally:
            rec.state = State.PAUSED
        return await self._finish_children(children, outcomes, timeout)

    async def _finish_children(self, children: list[SandboxRecord], outcomes: list[ForkOutcome],
                               timeout: int) -> list[ForkResult]:
        """Each child runs (recorded with its layers) or is gone, whatever the others do."""
        host = self._host
        by_id = {o.sandbox_id: o for o in outcomes}

        async def finish(child: SandboxRecord) -> ForkResult:
            outcome = by_id.get(child.sandbox_id)
            error = "the backend returned no result" if outcome is None else outcome.error
            if outcome is not None and outcome.placement is not None and error is None:
                child.placement = outcome.placement
                try:
                    await host.envd_ready(child, outcome.placement)
                except BackendError as exc:
                    error = str(exc)
            if error is not None:
                host.sandboxes.pop(child.sandbox_id, None)
                with contextlib.suppress(Exception):
                    await host.backend.kill(child.sandbox_id, child.placement)
                await host.store.delete_sandbox(child.sandbox_id)
                host.emit(FAILED, child, operation="fork", reason=error,
                          source_sandbox_id=child.parent_sandbox_id)
                return ForkResult(error=f"fork failed: {error}", status=500)
            ready = time.time()
            child.started_at, child.end_at = ready, ready + timeout
            child.state = State.RUNNING
            await host.store.put_sandbox(child)
            host.emit(FORKED, child, source_sandbox_id=child.parent_sandbox_id)
            await host.store.set_layer_refs("sandbox", child.sandbox_id, list(child.source.layers))
            return ForkResult(record=child, status=201)

        return list(await asyncio.gather(*(finish(c) for c in children)))

    # --- rollback ----------------------------------------------------------------------------

    def _rollback_target(self, rec: SandboxRecord, snapshot_id: str | None) -> SnapshotRef:
        """A snapshot of the sandbox's own: a catalogue snapshot taken of it, or (None) its
        current or last pause."""
        if snapshot_id is None:
            target = rec.pause_snapshot if rec.state == State.PAUSED else rec.last_pause
            if target is None:
                raise Conflict(f"sandbox {rec.sandbox_id!r} was never paused: name a snapshot "
                               "of it (snapshotID) to roll back to")
            return target
        tpl = self._host.catalogue.resolve(snapshot_id, rec.team)
        if tpl.kind != "snapshot" or tpl.source_sandbox_id != rec.sandbox_id:
            raise BadRequest(f"{snapshot_id!r} is not a snapshot of sandbox {rec.sandbox_id!r}: "
                             "a sandbox rolls back to its own snapshots only")
        return tpl.ref

    async def rollback(self, sandbox_id: str, snapshot_id: str | None,
                       timeout: int | None) -> SandboxRecord:
        """Restore a running or paused sandbox in place to one of its snapshots: same id,
        network policy and lineage; memory, processes and disk as at the snapshot; a new envd
        token (the old one opens nothing). It runs afterwards, at least `timeout` seconds."""
        host = self._host
        host.check_open()
        branching = self._branching("roll a sandbox back")
        seconds = host.clamp_timeout(timeout, host.config.default_timeout)
        rec = await host.ops.await_state(sandbox_id, STABLE, {State.KILLING: lambda rec: Conflict(
            f"sandbox {sandbox_id!r} is being killed")})
        target = self._rollback_target(rec, snapshot_id)
        previous = rec.state
        # It gets a VM: a paused sandbox's only one (its record counts it from here on), a
        # running one's second, beside the old until that stops (held until the rollback ends).
        held = host.admit(f"roll back sandbox {sandbox_id}", rec.memory_mb, rec.cpu_count)
        if previous == State.PAUSED:
            host.release(held)
        else:
            host.left_running(sandbox_id, "rolled back")
        rec.state = State.ROLLING_BACK

        async def rolling_back() -> None:  # the work outlives a caller that goes away
            try:
                await self._do_rollback(rec, branching, target, previous, seconds)
            finally:
                host.release(held)

        await host.ops.launch(sandbox_id, "rollback", rolling_back())
        return rec

    async def _do_rollback(self, rec: SandboxRecord, branching: SnapshotBranching,
                           target: SnapshotRef, previous: State, timeout: int) -> None:
        host = self._host
        sid = rec.sandbox_id
        old_token = rec.envd_access_token
        try:
            # The record keeps the old token until the new VM runs; the new one waits in the
            # pending operation, for a node killed meanwhile (node/recovery.py: whichever VM
            # it finds decides which token the sandbox has).
            await host.store.put_sandbox(rec)
            new_token = host.tokens.fresh_envd_token()
            await host.store.put_pending(sid, "rollback", time.time(), {"token": new_token})
            rec.envd_access_token = new_token
            placement = await branching.rollback(host.spec(rec), rec.placement, target)
        except BaseException as exc:
            # The backend left the sandbox as it was: so is its record.
            rec.envd_access_token, rec.state = old_token, previous
            with contextlib.suppress(Exception):
                await host.store.put_sandbox(rec)
                await host.store.delete_pending(sid)
            if isinstance(exc, BackendError):
                raise backend_failure(f"failed to roll sandbox {sid} back: {exc}", exc) from exc
            raise
        rec.placement, rec.pause_snapshot = placement, None
        rec.end_at = max(rec.end_at, time.time() + timeout)
        rec.state = State.RUNNING
        await host.store.put_sandbox(rec)
        await host.store.delete_pending(sid)
        host.emit(ROLLED_BACK, rec)
        log.info("sandbox rolled back", extra={"sandbox_id": sid})
