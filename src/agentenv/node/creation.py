"""Create: a new sandbox of a template or snapshot (node/orchestrator.py wires this in).

The record counts against the node's limits from the moment it exists (no await between the
admission check and its insertion); it is written while the backend starts the sandbox, and a
failed create leaves nothing behind (the record, the VM and its layer references go).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from agentenv.api.errors import BadRequest
from agentenv.api.event_models import CREATED, FAILED
from agentenv.api.tenancy import LOCAL_TEAM
from agentenv.node import network_policy
from agentenv.node.backend import BackendError, Placement
from agentenv.node.catalogue import TemplateCatalogue
from agentenv.node.host import NodeCounters, RunHost
from agentenv.node.idle import idle_setting
from agentenv.node.operations import backend_failure, failure_reason, log
from agentenv.node.records import MountRecord, SandboxRecord, State, TemplateRecord
from agentenv.node.security import TokenIssuer, new_id
from agentenv.node.volumes import PlannedMount, Volumes


@dataclass
class CreateParams:
    template: str
    timeout: int | None = None
    metadata: dict[str, str] = field(default_factory=dict)
    env_vars: dict[str, str] = field(default_factory=dict)
    auto_pause: bool = False
    auto_pause_memory: bool = True
    auto_resume: bool = False
    secure: bool = True
    allow_internet_access: bool | None = None
    network: dict[str, Any] | None = None
    #: the team the sandbox is made for: it sees only that team's templates and snapshots
    team: str = LOCAL_TEAM
    #: the create body's idlePauseAfter (None: from its metadata, template or the node)
    idle_pause_after: int | None = None
    #: volumes to mount: (name, path, mode or None), as the API took them (docs/volumes.md §6)
    volume_mounts: list[tuple[str, str, str | None]] = field(default_factory=list)


class CreateHost(RunHost, Protocol):
    """What creates use of the orchestrator besides RunHost (node/host.py)."""

    tokens: TokenIssuer
    catalogue: TemplateCatalogue
    volumes: Volumes | None
    counters: NodeCounters

    def check_enforced(self, policy: Any) -> None: ...


class Creation:
    def __init__(self, host: CreateHost) -> None:
        self._host = host

    def _plan_mounts(self, params: CreateParams, tpl: TemplateRecord
                     ) -> tuple[list[MountRecord], list[PlannedMount]]:
        """The volumes a create mounts: those its snapshot mounted already (inherited, in
        their disks) and those it asks for, checked before anything is made (4xx)."""
        host = self._host
        inherited = [MountRecord.from_json(m) for m in tpl.ref.data.get("volume_mounts", [])]
        if not params.volume_mounts:
            return inherited, []
        if host.volumes is None:
            raise BadRequest("volumeMounts: this node has no volumes")
        mounting = host.capabilities.volumes
        return inherited, host.volumes.plan_mounts(
            params.team, params.volume_mounts, inherited,
            None if mounting is None else mounting.free_volume_slots(tpl.ref),
            host.backend.name)

    async def _mount(self, rec: SandboxRecord, planned: list[PlannedMount]) -> None:
        """The planned mounts with their volumes' sealed layers (sealed now if changed)."""
        if planned:
            assert self._host.volumes is not None
            rec.volume_mounts += [await self._host.volumes.mount(p) for p in planned]

    async def create(self, params: CreateParams) -> SandboxRecord:
        host = self._host
        host.check_open()
        tpl = host.catalogue.resolve(params.template, params.team)
        if params.auto_resume and params.auto_pause and not params.auto_pause_memory:
            raise BadRequest("autoResume cannot be combined with a filesystem-only autoPause")
        policy = network_policy.parse(params.network, params.allow_internet_access)
        host.check_enforced(policy)
        inherited, planned = self._plan_mounts(params, tpl)
        sid = new_id("i")
        now = time.time()
        timeout = host.clamp_timeout(params.timeout, host.config.default_timeout)
        idle_after = idle_setting(params.idle_pause_after, params.metadata, tpl.idle_pause_after,
                                  host.config.idle_pause_after, host.config.max_timeout)
        rec = SandboxRecord(
            sandbox_id=sid,
            template_id=tpl.template_id,
            alias=tpl.names[0] if tpl.names else None,
            state=State.CREATING,
            started_at=now,
            end_at=now + timeout,
            metadata=dict(params.metadata),
            env_vars=dict(params.env_vars),
            auto_pause=params.auto_pause,
            auto_pause_memory=params.auto_pause_memory,
            auto_resume=params.auto_resume,
            cpu_count=tpl.cpu_count,
            memory_mb=tpl.memory_mb,
            disk_size_mb=tpl.disk_size_mb,
            envd_version=tpl.envd_version,
            envd_access_token=host.tokens.envd_token(sid),
            traffic_access_token=(
                host.tokens.traffic_token(sid)
                if params.network and params.network.get("allowPublicTraffic") is False
                else None
            ),
            secure=params.secure,
            allow_internet_access=params.allow_internet_access,
            network=network_policy.stored(params.network, policy),
            source=tpl.ref,
            team=params.team,
            # lineage: a snapshot's sandbox descends from the sandbox the snapshot was taken of
            parent_sandbox_id=tpl.source_sandbox_id if tpl.kind == "snapshot" else None,
            source_snapshot_id=tpl.template_id if tpl.kind == "snapshot" else None,
            idle_pause_after=idle_after,
            volume_mounts=inherited,
        )
        # Nothing awaits between the check and the insertion: the record counts from then on.
        host.release(host.admit("create sandbox", tpl.memory_mb, tpl.cpu_count))
        host.sandboxes[sid] = rec
        # A "name:tag" gives a copy with that build's snapshot: statistics go to the record.
        counted = host.catalogue.get(tpl.template_id) or tpl
        return await host.ops.launch(sid, "create", self._do_create(rec, counted, timeout,
                                                                    planned))

    async def _do_create(
        self, rec: SandboxRecord, tpl: TemplateRecord, timeout: int,
        planned: list[PlannedMount] | None = None,
    ) -> SandboxRecord:
        host = self._host
        sid = rec.sandbox_id
        placement: Placement | None = None

        async def persist() -> None:
            await host.store.put_sandbox(rec)
            await host.store.set_layer_refs(
                "sandbox", sid, [*rec.source.layers, *(m.layer for m in rec.volume_mounts if m.layer)])

        try:
            await self._mount(rec, planned or [])
            # The record is written while the backend starts the sandbox (both take long on
            # a busy host); a crash in between leaves a CREATING record or an orphan, both
            # cleaned up at the next start.
            written = asyncio.ensure_future(persist())
            try:
                placement = await host.backend.create(host.spec(rec))
            finally:
                await written
            rec.placement = placement
            await host.envd_ready(rec, placement)
        except BaseException as exc:
            host.counters.count_create(rec.team, False)
            log.warning("sandbox create failed", extra={"sandbox_id": sid, "error": str(exc)})
            host.emit(FAILED, rec, operation="create", reason=failure_reason(exc))
            host.sandboxes.pop(sid, None)
            with contextlib.suppress(Exception):
                await host.backend.kill(sid, placement)
            with contextlib.suppress(Exception):
                await host.store.delete_sandbox(sid)
                await host.store.set_layer_refs("sandbox", sid, [])
            if isinstance(exc, BackendError):
                raise backend_failure(f"failed to create sandbox: {exc}", exc) from exc
            raise
        if placement.envd_version:
            rec.envd_version = placement.envd_version
        now = time.time()
        rec.started_at, rec.end_at = now, now + timeout  # the TTL starts once envd is ready
        rec.state = State.RUNNING
        await host.store.put_sandbox(rec)
        host.counters.count_create(rec.team, True)
        host.emit(CREATED, rec)
        tpl.spawn_count += 1
        tpl.last_spawned_at = now
        # Statistics only: written in the background, off the create's latency.
        host.ops.in_background(self._save_quietly(tpl))
        log.info("sandbox created", extra={"sandbox_id": sid, "template_id": rec.template_id})
        return rec

    async def _save_quietly(self, tpl: TemplateRecord) -> None:
        with contextlib.suppress(Exception):
            await self._host.store.put_template(tpl)
