"""Snapshots of running sandboxes into the catalogue (node/orchestrator.py wires this in).

A snapshot checkpoints a running sandbox in place (it goes on running) and becomes a catalogue
entry sandboxes can be made from; a sandbox paused for idleness is woken first, as traffic
would wake it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from agentenv.api.errors import ApiError, Conflict, Internal
from agentenv.api.event_models import CHECKPOINTED, FAILED, KILLED
from agentenv.node.admission import Admission
from agentenv.node.backend import BackendError, SandboxBackend
from agentenv.node.catalogue import TemplateCatalogue
from agentenv.node.host import RecordsHost
from agentenv.node.idle import IDLE_REASON
from agentenv.node.operations import unless_idle
from agentenv.node.records import SandboxRecord, State, TemplateRecord
from agentenv.node.security import new_id
from agentenv.node.store import NameTaken


class SnapshotHost(RecordsHost, Protocol):
    """What snapshots use of the orchestrator besides RecordsHost (node/host.py)."""

    backend: SandboxBackend
    catalogue: TemplateCatalogue
    admission: Admission | None

    async def forget(self, rec: SandboxRecord) -> None: ...


class Snapshots:
    def __init__(self, host: SnapshotHost,
                 connect: Callable[[str, int | None], Awaitable[Any]]) -> None:
        self._host = host
        #: the resume of a sandbox paused for idleness (node/pauses.py)
        self._connect = connect

    async def _wait_running(self, sandbox_id: str, what: str) -> SandboxRecord:
        def refuse(rec: SandboxRecord) -> ApiError:
            return Conflict(
                f"sandbox {sandbox_id!r} cannot {what} while in '{rec.state.value}' state")

        while True:
            rec = await self._host.ops.await_state(sandbox_id, {State.RUNNING, State.PAUSED}, {
                State.PAUSING: unless_idle(refuse), State.KILLING: refuse})
            if rec.state == State.RUNNING:
                return rec
            if rec.pause_reason != IDLE_REASON:
                raise refuse(rec)
            await self._connect(sandbox_id, 0)  # paused for idleness: woken, as traffic would

    async def snapshot(self, sandbox_id: str, name: str | None) -> TemplateRecord:
        host = self._host
        host.check_open()
        team = host.ops.get(sandbox_id).team
        owner = None if name is None else host.catalogue.name_owner(name, team)
        if owner is not None:
            raise Conflict(f"name {name!r} is already used by {owner}")
        with self.hold_snapshot_quota():
            rec = await self._wait_running(sandbox_id, "be snapshotted")
            rec.state = State.SNAPSHOTTING
            return await host.ops.launch(sandbox_id, "snapshot", self._do_snapshot(rec, name))

    def hold_snapshot_quota(self) -> contextlib.AbstractContextManager[None]:
        """A place of a standalone node's team quota of snapshots, held until the new
        snapshot is in the catalogue (or was not made)."""
        admission = self._host.admission
        if admission is None:
            return contextlib.nullcontext()
        return admission.hold_quota("snapshots", sum(
            t.kind == "snapshot" for t in self._host.catalogue.templates.values()))

    async def _do_snapshot(self, rec: SandboxRecord, name: str | None) -> TemplateRecord:
        host = self._host
        sid = rec.sandbox_id
        snapshot_id = new_id("s")
        assert rec.placement is not None
        try:
            ref = await host.backend.snapshot(sid, rec.placement, snapshot_id)
        except BackendError as exc:
            rec.state = State.RUNNING
            host.emit(FAILED, rec, operation="snapshot", reason=str(exc))
            if not exc.retryable:
                await host.forget(rec)
                host.emit(KILLED, rec, kill_reason="lost while snapshotting")
            raise Internal(f"failed to snapshot sandbox {sid}: {exc}") from exc
        finally:
            if rec.state == State.SNAPSHOTTING:
                rec.state = State.RUNNING
        if rec.volume_mounts:  # a sandbox made from the snapshot mounts them too
            ref.data["volume_mounts"] = [m.shared().to_json() for m in rec.volume_mounts]
        now = time.time()
        tpl = TemplateRecord(
            template_id=snapshot_id,
            kind="snapshot",
            names=[name] if name else [],
            ref=ref,
            cpu_count=rec.cpu_count,
            memory_mb=rec.memory_mb,
            disk_size_mb=rec.disk_size_mb,
            envd_version=rec.envd_version,
            created_at=now,
            updated_at=now,
            source_sandbox_id=sid,
            team=rec.team,
            # sandboxes made from it idle as their source did, unless told otherwise
            idle_pause_after=rec.idle_pause_after,
        )
        try:
            await host.catalogue.save(tpl)
        except NameTaken as exc:
            with contextlib.suppress(BackendError):
                await host.backend.delete_snapshot(ref)
            raise Conflict(str(exc)) from exc
        host.emit(CHECKPOINTED, rec, snapshot_id=snapshot_id, names=tpl.names)
        return tpl
