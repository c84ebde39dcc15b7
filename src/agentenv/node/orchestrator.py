"""The sandbox state machine: create, pause, resume, snapshot, fork, kill, timeouts, restarts.

`Orchestrator` owns the node's sandbox records and wires the collaborators that do the work,
one module per concern; its public methods are the node's lifecycle calls (node/api.py and the
proxy call them) and delegate:
- node/operations.py: at most one operation per sandbox (a call that finds the sandbox in a
  transitional state waits, joins or gets 409), each in its own task the caller awaits through
  `asyncio.shield`; the garbage collector's gate (operations_held);
- node/creation.py: create; node/pauses.py: pause, resume, connect, auto-resume;
- node/lineage.py: fork, batch create, rollback; node/snapshots.py: snapshots;
- node/expiry.py: endAt, the reaper, idle pauses; node/recovery.py: what a restarted node
  makes of the last run (adoption, pauses a crash cut short).

Rules that keep it simple and safe:
- All state lives on the event loop thread; a check-and-set of `record.state` happens without an
  `await` in between, which makes it a compare-and-set.
- Every transition is written to SQLite before the call returns, so a restarted node knows each
  sandbox's last state; running sandboxes are re-adopted from the backend after a SIGKILL.
- Files nobody needs any more are deleted by node/gc.py: at start after adoption, and
  (debounced) after every kill and snapshot/template delete.

Templates and snapshots live in the catalogue (node/catalogue.py); envd is reached through
envd_client.py. tests/node/test_orchestrator_states.py drives this class in-process.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any, Protocol

import httpx

from agentenv.api.errors import ApiError, BadRequest, Internal, Unavailable, sandbox_not_found
from agentenv.api.event_models import FAILED, KILLED
from agentenv.envd_client import EnvdClient, EnvdClientError
from agentenv.node import network_policy
from agentenv.node.admission import Admission, Reservation
from agentenv.node.backend import (
    BackendError,
    Capabilities,
    Placement,
    SandboxBackend,
    SandboxSpec,
    VolumeMount,
)
from agentenv.node.catalogue import TemplateCatalogue
from agentenv.node.creation import CreateParams, Creation
from agentenv.node.events import Event, EventLog
from agentenv.node.expiry import Expiry
from agentenv.node.host import NodeConfig, NodeCounters
from agentenv.node.idle import IdleTracker
from agentenv.node.lineage import ForkResult, Lineage
from agentenv.node.operations import (
    STABLE,
    WAIT_TRANSITION_SECONDS,
    Operations,
    execution,
    gone,
    log,
    log_reap,
)
from agentenv.node.pauses import Pauses
from agentenv.node.records import MountRecord, SandboxRecord, State, TemplateRecord
from agentenv.node.recovery import Recovery
from agentenv.node.security import TokenIssuer
from agentenv.node.snapshots import Snapshots
from agentenv.node.store import Store
from agentenv.node.volumes import SHARED, Volumes

#: what callers import from here (the dataclasses live beside the work that takes them)
__all__ = ["CreateParams", "ForkResult", "NodeConfig", "NodeCounters", "Orchestrator"]


class Companion(Protocol):
    async def start(self) -> None: ...

    async def stop(self) -> None: ...


class Orchestrator:
    def __init__(
        self,
        store: Store,
        backend: SandboxBackend,
        tokens: TokenIssuer,
        config: NodeConfig | None = None,
        on_op: Callable[[str, str, float], None] | None = None,
        capabilities: Capabilities | None = None,
    ) -> None:
        self.store = store
        self.backend = backend
        #: what the backend can do beyond SandboxBackend (resolved by node/server.py)
        self.capabilities = capabilities or Capabilities.of(backend)
        self.tokens = tokens
        self.config = config or NodeConfig()
        self.sandboxes: dict[str, SandboxRecord] = {}
        self.counters = NodeCounters()
        #: the operations under way, one per sandbox, and the work beside the callers
        self.ops = Operations(self.sandboxes, on_op or (lambda op, outcome, seconds: None))
        # the same dict and set under their earlier names (the in-process tests look at them)
        self._ops = self.ops.running
        self._background = self.ops.background
        self._closing = False
        self._reaper: asyncio.Task[None] | None = None
        self._http: httpx.AsyncClient | None = None
        #: the layer garbage collector (node/gc.py), set by the server before start()
        self.gc: Any = None
        #: the templates and snapshots sandboxes start from (node/catalogue.py)
        self.catalogue = TemplateCatalogue(store, backend, self.collect_soon)
        #: limits on what the node takes on (node/admission.py), set by the server; None: none
        self.admission: Admission | None = None
        self._leave_listeners: list[Callable[[str, str], None]] = []
        #: where lifecycle events go (node/events.py), set by the server; None: nowhere
        self.events: EventLog | None = None
        #: services over the running node (node/observer.py), started once it runs and
        #: stopped first at shutdown
        self.companions: list[Companion] = []
        #: how long each running sandbox has been without traffic (the proxy touches it)
        self.activity = IdleTracker()
        #: the teams' volumes (node/volumes.py), set by the server; None: no volumes
        self.volumes: Volumes | None = None
        # The collaborators, one per concern; each reads what the server sets after
        # construction (admission, events, volumes, capabilities) through this owner.
        self._creation = Creation(self)
        self._pauses = Pauses(self)
        self._lineage = Lineage(self, self._creation.create)
        self._snapshots = Snapshots(self, self._pauses.connect)
        self._expiry = Expiry(self, self._pauses)

    def on_leave_running(self, listener: Callable[[str, str], None]) -> None:
        """Call `listener(sandbox_id, why)` synchronously whenever a running sandbox stops being
        reachable (paused, killed, timed out, lost): the proxy closes its streams to it at once."""
        self._leave_listeners.append(listener)

    @property
    def http(self) -> httpx.AsyncClient | None:
        """The node's client for calls to envd (None before start)."""
        return self._http

    @property
    def closing(self) -> bool:
        """Whether the node is shutting down (it takes no lifecycle calls)."""
        return self._closing

    @property
    def backend_name(self) -> str:
        """The name of the node's backend ("process", "vm"), for answers and logs."""
        return self.backend.name

    @property
    def state_dir(self) -> Path:
        """The directory the node keeps its state in (its store's)."""
        return self.store.path.parent

    def add_companion(self, companion: Companion) -> None:
        """Run `companion` with the node: started once it runs, stopped first at shutdown."""
        self.companions.append(companion)

    def record_event(self, event: Event) -> None:
        """Record an event that is not a sandbox's (a build's; emit records a sandbox's).
        Looked up at each call: the event log is set (and may be replaced) after construction."""
        if self.events is not None:
            self.events.record(event)

    def check_quota(self, kind: str, have: int) -> None:
        """Admission.check_quota (a new template or snapshot of a team that has `have`); no-op
        on a node without admission. Looked up at each call, like record_event."""
        if self.admission is not None:
            self.admission.check_quota(kind, have)

    def create_counts(self, team: str) -> tuple[int, int]:
        """(successful, failed) creates of `team` on this node since it started."""
        return self.counters.of_team(team)

    def emit(self, kind: str, rec: SandboxRecord, **data: Any) -> None:
        """Record a lifecycle event of `rec` (never waits: node/events.py)."""
        if self.events is None:
            return
        self.events.record(Event(
            type=kind, team=rec.team, sandbox_id=rec.sandbox_id, template_id=rec.template_id,
            build_id=rec.source.layers[-1] if rec.source.layers else "",
            execution_id=f"{rec.sandbox_id}-{int(rec.started_at * 1000)}",
            data={"sandbox_metadata": dict(rec.metadata), **data}))

    def left_running(self, sandbox_id: str, why: str) -> None:
        """A running sandbox stopped being reachable: its idleness restarts, the listeners
        (on_leave_running) hear of it."""
        self.activity.restart(sandbox_id)
        for listener in self._leave_listeners:
            try:
                listener(sandbox_id, why)
            except Exception:
                log.exception("leave-running listener failed", extra={"sandbox_id": sandbox_id})

    # --- start and stop ----------------------------------------------------------------------

    async def start(self) -> None:
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(10.0, connect=2.0), trust_env=False)
        await self.store.open()
        if self.volumes is not None:  # before the garbage collector looks at their layers
            await self.volumes.start()
        if self.events is not None:
            await self.events.start()
        await self.backend.start()
        await self.catalogue.load(await self.backend.default_templates(),
                                  self.config.default_envd_version)
        recovery = Recovery(self.store, self.backend, self.capabilities, self.sandboxes,
                            self.spec)
        await recovery.reconcile()
        await recovery.reapply_network()
        # A node that died between a pause's record and its release left earlier pauses
        # behind: released now, one sandbox after another (the pause path's own work).
        self.ops.in_background(self._pauses.release_all_unnamed())
        if self.gc is not None:
            try:
                await self.gc.collect("startup")
            except Exception:  # never keeps the node from starting; the next pass retries
                log.exception("garbage collection at startup failed")
        self._reaper = asyncio.create_task(self._expiry.reap_forever(), name="reaper")
        for companion in self.companions:
            await companion.start()

    async def update_network(self, sandbox_id: str, body: dict[str, Any]) -> None:
        """`PUT /sandboxes/{id}/network`: the whole egress policy is replaced. A running
        sandbox gets it before the call returns; a paused one when it resumes. Invalid input
        changes nothing (400); a failed apply leaves the old policy in force and recorded."""
        self.check_open()
        rec = await self.ops.await_state(sandbox_id, STABLE, {State.KILLING: gone})
        network, allow, policy = network_policy.updated(rec, body)
        self.check_enforced(policy)
        if rec.state == State.RUNNING and rec.placement is not None:
            apply = self.capabilities.network
            if apply is not None:
                identity = network_policy.identity_of(rec, self.tokens)
                try:
                    await apply.set_network(sandbox_id, rec.placement, policy, identity)
                except BackendError as exc:
                    if rec.state == State.RUNNING:  # not a pause that took the VM meanwhile
                        raise Internal(f"network policy of {sandbox_id} not applied: {exc}"
                                       ) from exc
        rec.network, rec.allow_internet_access = network, allow
        await self.store.put_sandbox(rec)

    def check_enforced(self, policy: Any) -> None:
        if not policy.is_default and not self.capabilities.enforces_network_policy:
            raise BadRequest(
                f"network policies are not enforced by the {self.backend.name} backend (its "
                "sandboxes are host processes): only the VM backend accepts allowOut/denyOut/"
                "egressProxy/rules or allow_internet_access=false")

    def sandbox_lost(self, sandbox_id: str, reason: str) -> None:
        """The backend saw a running sandbox end on its own (its VM died): remove it, as a kill
        would (the proxy then answers 502 "The sandbox was not found"). An operation under way
        on it sees the failure itself and cleans up."""
        rec = self.sandboxes.get(sandbox_id)
        if rec is None or rec.state != State.RUNNING or sandbox_id in self.ops.running:
            return
        log.error("sandbox lost", extra={"sandbox_id": sandbox_id, "reason": reason})
        rec.state = State.KILLING
        self.left_running(sandbox_id, "lost")
        work = self.ops.start(sandbox_id, "kill",
                              self._do_kill(rec, State.RUNNING, f"lost: {reason}"))
        self.ops.in_background(log_reap(sandbox_id, work, "sandbox removed"))

    async def shutdown(self) -> None:
        """Stop taking lifecycle calls, finish the ones under way, pause every running sandbox."""
        self._closing = True
        for companion in self.companions:
            await companion.stop()
        for sid in list(self.ops.running):
            self._pauses.end_resume(sid, Unavailable(
                f"the node is shutting down: sandbox {sid} was not resumed (it stays paused)"))
        if self._reaper:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        for _ in range(3):
            pending = list(self.ops.running.values()) + list(self.ops.background)
            if pending:
                await asyncio.wait(pending, timeout=WAIT_TRANSITION_SECONDS)
            running = [
                r
                for r in self.sandboxes.values()
                if r.state == State.RUNNING and r.sandbox_id not in self.ops.running
            ]
            if not running:
                break
            tasks = [self._pauses.begin_pause(rec, True, "shutdown") for rec in running]
            results = await asyncio.gather(*tasks, return_exceptions=True)
            for rec, result in zip(running, results, strict=True):
                if isinstance(result, BaseException):
                    log.error(
                        "pause at shutdown failed",
                        extra={"sandbox_id": rec.sandbox_id, "error": str(result)},
                    )
        if self.gc is not None:
            await self.gc.close()
        await self.backend.close()
        if self.events is not None:
            await self.events.stop()
        await self.store.close()
        if self._http:
            await self._http.aclose()

    # --- helpers (the collaborators' too) ----------------------------------------------------

    def check_open(self) -> None:
        if self._closing:
            raise Unavailable("the node is shutting down")

    def get(self, sandbox_id: str) -> SandboxRecord:
        return self.ops.get(sandbox_id)

    def sandbox(self, sandbox_id: str) -> SandboxRecord | None:
        """The record of `sandbox_id` in any state (being killed too), None when the node has
        none: for callers that answer a missing sandbox their own way (get raises 404)."""
        return self.sandboxes.get(sandbox_id)

    def all_sandboxes(self) -> list[SandboxRecord]:
        """Every record the node holds, those being killed too (list_visible leaves them out).
        A copy: callers iterate it across awaits while sandboxes come and go."""
        return list(self.sandboxes.values())

    def list_visible(self) -> list[SandboxRecord]:
        """Sandboxes the API lists: everything except those being killed."""
        return [r for r in self.sandboxes.values() if r.state != State.KILLING]

    def children(self, sandbox_id: str) -> list[SandboxRecord]:
        """The sandboxes forked from (or made from a snapshot of) `sandbox_id`, oldest first."""
        return sorted((r for r in self.list_visible() if r.parent_sandbox_id == sandbox_id),
                      key=lambda r: (r.created_at, r.sandbox_id))

    def made_from_snapshot(self, snapshot_id: str) -> list[SandboxRecord]:
        """The sandboxes made from catalogue snapshot `snapshot_id`, oldest first."""
        return sorted((r for r in self.list_visible() if r.source_snapshot_id == snapshot_id),
                      key=lambda r: (r.created_at, r.sandbox_id))

    async def wait_idle(self, timeout: float) -> None:
        """Return once no operation is under way (each may be writing files no record names
        yet), or after about `timeout` seconds on a node too busy ever to be idle."""
        await self.ops.wait_idle(timeout)

    @contextlib.asynccontextmanager
    async def operations_held(self) -> AsyncIterator[None]:
        """While this lasts, operations that start wait before they do anything (the garbage
        collector's pass: a pause begun between its marks and its sweep wrote a snapshot
        directory no mark named, deleted under it with a zero grace period)."""
        async with self.ops.held():
            yield

    def clamp_timeout(self, seconds: int | None, default: int) -> int:
        if seconds is None:
            seconds = default
        return max(0, min(int(seconds), self.config.max_timeout))

    def spec(self, rec: SandboxRecord) -> SandboxSpec:
        return SandboxSpec(
            egress=network_policy.policy_of(rec),
            identity=network_policy.identity_of(rec, self.tokens),
            sandbox_id=rec.sandbox_id,
            source=rec.source,
            cpu_count=rec.cpu_count,
            memory_mb=rec.memory_mb,
            disk_size_mb=rec.disk_size_mb,
            env_vars=dict(rec.env_vars),
            access_token=rec.envd_access_token if rec.secure else None,
            own_token=rec.envd_access_token,
            allow_internet_access=rec.allow_internet_access is not False,
            metadata=dict(rec.metadata),
            template_id=rec.template_id,
            volume_mounts=tuple(self._volume_mount(m) for m in rec.volume_mounts),
        )

    def _volume_mount(self, m: MountRecord) -> VolumeMount:
        if m.mode != SHARED:
            return VolumeMount(m.slot, m.path, m.mode == "ro", m.layer)
        # rw-shared: the volume's own file system, exported over NFS (docs/volumes.md §7.1).
        # Deleting a volume is refused while a sandbox mounts it so, paused ones too.
        assert self.volumes is not None
        volume = self.volumes.records[m.volume_id]
        return VolumeMount(-1, m.path, False, "", volume_id=m.volume_id,
                           shared_dir=str(self.volumes.shared_dir(volume)),
                           owner=self.volumes.shared_owner(volume))

    def _refuse_shared(self, sandbox_id: str, what: str) -> None:
        """A fork child, or a sandbox made from a snapshot, wakes up with its parent's NFSv4
        client identity and session in memory: its NFS access hangs (docs/volumes.md §7.1)."""
        rec = self.sandboxes.get(sandbox_id)
        shared = [m.name for m in rec.volume_mounts if m.mode == SHARED] if rec else []
        if shared:
            raise BadRequest(
                f"sandbox {sandbox_id!r} mounts volume {shared[0]!r} shared read-write "
                f"(rw-shared): it cannot {what}. A copy of its memory would share its NFS "
                "client identity with it, and the copy's NFS access would hang; mount the "
                "volume 'rw-shared' in a new sandbox instead")

    def volume_layers(self) -> set[Path]:
        """The latest sealed version of every volume (node/volumes.py); none without volumes.
        Looked up at each call: the server sets the volumes after the collector is made."""
        return self.volumes.current_layers() if self.volumes is not None else set()

    def volume_sharers(self) -> dict[str, list[str]]:
        """The sandboxes (running or paused) mounting each volume rw-shared, by volume id."""
        found: dict[str, list[str]] = {}
        for rec in self.sandboxes.values():
            for m in rec.volume_mounts:
                if m.mode == SHARED:
                    found.setdefault(m.volume_id, []).append(rec.sandbox_id)
        return found

    def volume_writers(self) -> dict[str, str]:
        """The volumes a sandbox mounts read-write (exclusively), by volume id: its id."""
        return {m.volume_id: rec.sandbox_id for rec in self.sandboxes.values()
                for m in rec.volume_mounts if m.mode == "rw"}

    async def envd_ready(self, rec: SandboxRecord, placement: Placement) -> None:
        """Return once envd answers /health and has taken the sandbox's env vars and token."""
        assert self._http is not None
        if self.capabilities.initialises_envd:
            # The backend returned only after its own /init with this spec's env vars and
            # token (the VM runtime does, on every restore): a second round trip is waste.
            return
        token = rec.envd_access_token if rec.secure else None
        envd = EnvdClient(placement.envd_url, token, http=self._http)
        try:
            await envd.wait_healthy(self.config.envd_ready_timeout)
        except EnvdClientError as exc:
            raise BackendError(f"envd of {rec.sandbox_id} not ready: {exc}") from exc
        try:
            await envd.init(env_vars=rec.env_vars, access_token=token)
        except EnvdClientError as exc:
            raise BackendError(f"{exc} (sandbox {rec.sandbox_id})") from exc

    def collect_soon(self) -> None:
        """A debounced garbage collection pass (node/gc.py), if the node has a collector."""
        if self.gc is not None and not self._closing:
            self.gc.request()

    def admit(self, what: str, memory_mb: int, cpu_count: int, count: int = 1
              ) -> Reservation | None:
        """Refuse (AdmissionRefused: 429/503, the limit named) what the node cannot hold;
        called before anything exists for the new VMs."""
        if self.admission is None:
            return None
        return self.admission.admit(what, self.sandboxes.values(), memory_mb, cpu_count, count)

    def release(self, held: Reservation | None) -> None:
        if self.admission is not None:
            self.admission.release(held)

    # --- create (node/creation.py), batch create (node/lineage.py) ---------------------------

    async def create(self, params: CreateParams) -> SandboxRecord:
        return await self._creation.create(params)

    async def create_many(self, params: CreateParams, count: int) -> list[ForkResult]:
        """`count` sandboxes of one template or snapshot (an extension: a batch create)."""
        return await self._lineage.create_many(params, count)

    # --- pause and resume (node/pauses.py) ---------------------------------------------------

    async def pause(self, sandbox_id: str, memory: bool = True) -> None:
        await self._pauses.pause(sandbox_id, memory)

    async def connect(self, sandbox_id: str, timeout: int | None,
                      memory: bool = True) -> tuple[SandboxRecord, bool]:
        """Make sure the sandbox runs; returns (record, resumed) (node/pauses.py)."""
        return await self._pauses.connect(sandbox_id, timeout, memory)

    async def resume_legacy(
        self, sandbox_id: str, timeout: int | None, auto_pause: bool | None
    ) -> SandboxRecord:
        """`POST /sandboxes/{id}/resume` of SDK 2.0-2.5: 409 when the sandbox already runs."""
        return await self._pauses.resume_legacy(sandbox_id, timeout, auto_pause)

    async def running_placement(self, sandbox_id: str) -> Placement | None:
        """For the proxy: where the sandbox runs, resuming it when it may (node/pauses.py)."""
        return await self._pauses.running_placement(sandbox_id)

    # --- kill --------------------------------------------------------------------------------

    async def kill(self, sandbox_id: str) -> None:
        self.check_open()
        self._pauses.end_resume(sandbox_id, ApiError(
            f"sandbox {sandbox_id} was deleted while it resumed", status=404))
        rec = await self.ops.await_state(sandbox_id, {*STABLE, State.KILLING})
        if rec.state == State.KILLING:
            # someone else's kill (or the reaper's): wait for it; then, like get_info,
            # answer that the sandbox does not exist (the SDK's kill() returns False)
            task = self.ops.running.get(sandbox_id)
            if task is not None:
                await asyncio.shield(task)
            raise sandbox_not_found(sandbox_id)
        await asyncio.shield(self.begin_kill(rec, rec.state))

    def begin_kill(self, rec: SandboxRecord, previous: State, why: str = "request"
                   ) -> asyncio.Task[None]:
        """The kill of a sandbox in state `previous` as its one operation, KILLING from now
        on (no await in between)."""
        rec.state = State.KILLING
        self.left_running(rec.sandbox_id, "killed")
        return self.ops.start(rec.sandbox_id, "kill", self._do_kill(rec, previous, why))

    async def _do_kill(self, rec: SandboxRecord, previous: State, why: str = "request") -> None:
        sid = rec.sandbox_id
        try:
            await self.store.put_sandbox(rec)
            if previous == State.PAUSED and rec.pause_snapshot is not None:
                await self.backend.discard_paused(sid, rec.pause_snapshot)
            else:
                await self.backend.kill(sid, rec.placement)
        except BackendError as exc:
            rec.state = previous
            await self.store.put_sandbox(rec)
            self.emit(FAILED, rec, operation="kill", reason=str(exc))
            raise Internal(f"failed to kill sandbox {sid}: {exc}") from exc
        await self.forget(rec)
        ran = {"execution": execution(rec)} if previous == State.RUNNING else {}
        self.emit(KILLED, rec, kill_reason=why, **ran)
        log.info("sandbox killed", extra={"sandbox_id": sid})

    async def forget(self, rec: SandboxRecord) -> None:
        """Drop a sandbox that is gone: its record, stored and in memory, and its layers."""
        self.sandboxes.pop(rec.sandbox_id, None)
        await self.store.delete_sandbox(rec.sandbox_id)
        await self.store.set_layer_refs("sandbox", rec.sandbox_id, [])
        self.collect_soon()

    # --- timeouts (node/expiry.py) -----------------------------------------------------------

    async def set_timeout(self, sandbox_id: str, seconds: int, shorten: bool = True) -> None:
        """`endAt = now + seconds` (may shorten unless `shorten` is False; node/expiry.py)."""
        await self._expiry.set_timeout(sandbox_id, seconds, shorten)

    def reap_once(self) -> int:
        """One pass of the reaper; returns how many sandboxes timed out (node/expiry.py)."""
        return self._expiry.reap_once()

    # --- snapshots (node/snapshots.py), forks and rollback (node/lineage.py) -----------------

    async def snapshot(self, sandbox_id: str, name: str | None) -> TemplateRecord:
        self._refuse_shared(sandbox_id, "be snapshotted")
        return await self._snapshots.snapshot(sandbox_id, name)

    def hold_snapshot_quota(self) -> contextlib.AbstractContextManager[None]:
        """A place of a standalone node's team quota of snapshots, held until the new
        snapshot is in the catalogue (or was not made)."""
        return self._snapshots.hold_snapshot_quota()

    async def fork(self, sandbox_id: str, count: int, timeout: int | None) -> list[ForkResult]:
        """`count` running children of a running or paused sandbox (node/lineage.py)."""
        self._refuse_shared(sandbox_id, "be forked")
        return await self._lineage.fork(sandbox_id, count, timeout)

    async def rollback(self, sandbox_id: str, snapshot_id: str | None,
                       timeout: int | None) -> SandboxRecord:
        """Restore a sandbox in place to one of its snapshots (node/lineage.py)."""
        return await self._lineage.rollback(sandbox_id, snapshot_id, timeout)

    # --- node info ---------------------------------------------------------------------------

    def count_by_state(self) -> dict[str, int]:
        counts = {s.value: 0 for s in State}
        for rec in self.sandboxes.values():
            counts[rec.state.value] += 1
        return counts
