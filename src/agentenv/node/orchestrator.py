"""The sandbox state machine: create, pause, resume, snapshot, fork, kill, timeouts, restarts.

Rules that keep it simple and safe:
- All state lives on the event loop thread; a check-and-set of `record.state` happens without an
  `await` in between, which makes it a compare-and-set.
- At most one operation per sandbox runs at a time (`self._ops`). A call that finds the sandbox
  in a transitional state waits for that operation and looks again (`_await_state`), joins it
  (kill joins kill), or gets 409, as docs/e2b-api.md §4 says.
- Every operation runs in its own task and the caller awaits it through `asyncio.shield`: a client
  that disconnects never leaves a sandbox half paused or half created.
- Every transition is written to SQLite before the call returns, so a restarted node knows each
  sandbox's last state; running sandboxes are re-adopted from the backend after a SIGKILL.
- A pause is recorded as pending (store.pending_ops) before the backend writes its snapshot;
  a node killed between that write and the paused record finds the snapshot again at its next
  start through the backend's optional `recover_pause(sandbox_id, placement, since)`: complete
  on disk -> the sandbox is paused with it; none -> the VM, if it still runs, is adopted,
  else the sandbox is gone (its half-written files are garbage for node/gc.py).
- Files nobody needs any more are deleted by node/gc.py: at start after adoption, and
  (debounced) after every kill and snapshot/template delete.

Templates and snapshots live in the catalogue (node/catalogue.py); envd is reached through
envd_client.py. tests/node/test_orchestrator_states.py drives this class in-process.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Collection, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

import httpx

from agentenv.api.errors import (
    ApiError,
    BadRequest,
    Conflict,
    Internal,
    Unavailable,
    sandbox_not_found,
)
from agentenv.api.event_models import (
    CHECKPOINTED,
    CREATED,
    FAILED,
    FORKED,
    KILLED,
    PAUSED,
    RESUMED,
    ROLLED_BACK,
    UPDATED,
)
from agentenv.api.models import iso
from agentenv.api.tenancy import LOCAL_TEAM
from agentenv.envd_client import EnvdClient, EnvdClientError
from agentenv.node import network_policy
from agentenv.node.admission import Admission, Reservation
from agentenv.node.backend import (
    BackendError,
    Capabilities,
    ForkOutcome,
    Placement,
    SandboxBackend,
    SandboxSpec,
    SnapshotBranching,
    SnapshotRef,
    VolumeMount,
)
from agentenv.node.catalogue import TemplateCatalogue
from agentenv.node.events import Event, EventLog
from agentenv.node.idle import IDLE_REASON, IdleTracker, idle_setting
from agentenv.node.records import MountRecord, SandboxRecord, State, TemplateRecord
from agentenv.node.security import TokenIssuer, new_id
from agentenv.node.store import NameTaken, PendingOp, Store
from agentenv.node.volumes import PlannedMount, Volumes
from agentenv.settings import get_settings

log = logging.getLogger("agentenv.node.orchestrator")
T = TypeVar("T")

#: How long a call waits for another operation on the same sandbox before giving up with 409.
WAIT_TRANSITION_SECONDS = 60.0
#: children of one fork or batch create (E2B's limit; the seed's 16 was the floor)
MAX_FORK_COUNT = 100
#: Fault injection for tests only: when this variable names a crash point, the node process
#: ends with os._exit there (as a kill -9 would), e.g. "pause-snapshot-written": right after
#: the backend wrote a pause snapshot, before the node recorded it.
CRASH_POINT_ENV = "AENV_TEST_CRASH_AT"
CRASH_EXIT_CODE = 86


def _crash_point(name: str) -> None:
    if get_settings().test_crash_at == name:
        log.error("test crash point reached: exiting at once", extra={"crash_point": name})
        os._exit(CRASH_EXIT_CODE)


@dataclass
class NodeConfig:
    default_timeout: int = 300  # E2B's server default when the create body has no timeout
    fork_default_timeout: int = 15
    auto_resume_min_timeout: int = 300
    max_timeout: int = 30 * 24 * 3600
    reaper_interval: float = 1.0
    envd_ready_timeout: float = 60.0
    domain: str | None = None
    default_envd_version: str = "0.5.7"
    #: idlePauseAfter of sandboxes whose create and template name none (node/idle.py); 0: off
    idle_pause_after: int = 0


class Companion(Protocol):
    async def start(self) -> None: ...

    async def stop(self) -> None: ...


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


@dataclass
class ForkResult:
    record: SandboxRecord | None = None
    error: str | None = None
    status: int = 500


@dataclass
class NodeCounters:
    """Creates the node finished, in all and per team (a team's /nodes shows its own)."""

    create_successes: int = 0
    create_fails: int = 0
    #: team -> [successes, fails]
    teams: dict[str, list[int]] = field(default_factory=dict)
    #: pauses the node made of idle sandboxes, and resumes of sandboxes so paused
    idle_pauses: int = 0
    idle_resumes: int = 0

    def count_create(self, team: str, ok: bool) -> None:
        if ok:
            self.create_successes += 1
        else:
            self.create_fails += 1
        self.teams.setdefault(team, [0, 0])[0 if ok else 1] += 1

    def of_team(self, team: str) -> tuple[int, int]:
        successes, fails = self.teams.get(team, (0, 0))
        return successes, fails


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
        self._ops: dict[str, asyncio.Task[Any]] = {}
        #: cleared while the garbage collector marks and sweeps (operations_held): an
        #: operation starting then waits, so it never writes a snapshot the pass did not see
        self._ops_allowed = asyncio.Event()
        self._ops_allowed.set()
        self._background: set[asyncio.Task[Any]] = set()
        self._closing = False
        #: resumes ended early (_end_resume), with what their callers get instead
        self._resume_ended: dict[str, ApiError] = {}
        self._reaper: asyncio.Task[None] | None = None
        self._http: httpx.AsyncClient | None = None
        self._on_op = on_op or (lambda op, outcome, seconds: None)
        #: the layer garbage collector (node/gc.py), set by the server before start()
        self.gc: Any = None
        #: the templates and snapshots sandboxes start from (node/catalogue.py)
        self.catalogue = TemplateCatalogue(store, backend, self._collect_soon)
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

    def on_leave_running(self, listener: Callable[[str, str], None]) -> None:
        """Call `listener(sandbox_id, why)` synchronously whenever a running sandbox stops being
        reachable (paused, killed, timed out, lost): the proxy closes its streams to it at once."""
        self._leave_listeners.append(listener)

    @property
    def http(self) -> httpx.AsyncClient | None:
        """The node's client for calls to envd (None before start)."""
        return self._http

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

    def _left_running(self, sandbox_id: str, why: str) -> None:
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
        await self._reconcile()
        await self._reapply_network()
        # A node that died between a pause's record and its release left earlier pauses
        # behind: released now, one sandbox after another (the pause path's own work).
        self._in_background(self._release_all_unnamed())
        if self.gc is not None:
            try:
                await self.gc.collect("startup")
            except Exception:  # never keeps the node from starting; the next pass retries
                log.exception("garbage collection at startup failed")
        self._reaper = asyncio.create_task(self._reap_forever(), name="reaper")
        for companion in self.companions:
            await companion.start()

    async def _reconcile(self) -> None:
        """Match the records of the last run with what the backend still runs."""
        records = await self.store.load_sandboxes()
        pending = await self.store.load_pending()
        adopted = await self.backend.adopt()
        #: why the backend could not take a VM over (e.g. blockd restarted under it)
        recovery = self.capabilities.crash_recovery
        failures: dict[str, str] = dict(recovery.adopt_failures) if recovery else {}
        known = {rec.sandbox_id for rec in records}
        for rec in records:
            sid = rec.sandbox_id
            op = pending.pop(sid, None)
            if op is not None:
                await self.store.delete_pending(sid)
            if rec.state == State.PAUSED:
                self.sandboxes[sid] = rec
                continue
            live = adopted.get(sid)
            if live is not None and rec.state not in (State.CREATING, State.KILLING):
                if rec.state == State.ROLLING_BACK and op is not None and op.op == "rollback" \
                        and not _same_vm(live, rec.placement):
                    # The rollback's VM was up (it holds the new token): the rollback is done.
                    rec.envd_access_token = str(op.doc["token"])
                # Also a pause cut short before its snapshot was complete: the VM goes on.
                rec.state, rec.placement, rec.pause_snapshot = State.RUNNING, live, None
                self.sandboxes[sid] = rec
                await self.store.put_sandbox(rec)
                log.info("adopted running sandbox", extra={"sandbox_id": sid})
            elif live is None and rec.state == State.PAUSING and await self._recover_pause(rec, op):
                log.info("pause completed after a node crash", extra={"sandbox_id": sid})
            elif live is None and rec.state in (State.RESUMING, State.ROLLING_BACK) \
                    and rec.pause_snapshot:
                rec.state, rec.placement = State.PAUSED, None
                self.sandboxes[sid] = rec
                await self.store.put_sandbox(rec)
            else:
                log.warning(
                    "sandbox lost across node restart",
                    extra={
                        "sandbox_id": sid,
                        "last_state": rec.state.value,
                        "reason": failures.get(sid)
                        or ("its VM no longer runs" if live is None else "it was being "
                            f"{'created' if rec.state == State.CREATING else 'killed'}"),
                    },
                )
                with contextlib.suppress(BackendError):
                    await self.backend.kill(sid, live)
                await self.store.delete_sandbox(sid)
                await self.store.set_layer_refs("sandbox", sid, [])
        for sid, placement in adopted.items():
            if sid not in known:
                log.warning("killing orphan sandbox", extra={"sandbox_id": sid})
                with contextlib.suppress(BackendError):
                    await self.backend.kill(sid, placement)
        for sid in pending:  # pending operations of sandboxes without a record
            await self.store.delete_pending(sid)

    async def _reapply_network(self) -> None:
        """Adopted sandboxes get their policies again (their slots kept their own rules; the
        host's redirect sets and an adopted egress proxy's table kept theirs meanwhile, a
        restarted proxy starts empty); then the backend drops what no sandbox holds."""
        network = self.capabilities.network
        if network is None:
            return
        for rec in list(self.sandboxes.values()):
            if rec.state != State.RUNNING or rec.placement is None:
                continue
            spec = self._spec(rec)
            try:
                await network.set_network(rec.sandbox_id, rec.placement, spec.egress,
                                          spec.identity)
            except BackendError as exc:
                log.error("network policy not re-applied to an adopted sandbox",
                          extra={"sandbox_id": rec.sandbox_id, "error": str(exc)})
        await network.network_reapplied()

    async def update_network(self, sandbox_id: str, body: dict[str, Any]) -> None:
        """`PUT /sandboxes/{id}/network`: the whole egress policy is replaced. A running
        sandbox gets it before the call returns; a paused one when it resumes. Invalid input
        changes nothing (400); a failed apply leaves the old policy in force and recorded."""
        self._check_open()
        rec = await self._await_state(sandbox_id, _STABLE, {State.KILLING: _gone})
        network, allow, policy = network_policy.updated(rec, body)
        self._check_enforced(policy)
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

    def _check_enforced(self, policy: Any) -> None:
        if not policy.is_default and not self.capabilities.enforces_network_policy:
            raise BadRequest(
                f"network policies are not enforced by the {self.backend.name} backend (its "
                "sandboxes are host processes): only the VM backend accepts allowOut/denyOut/"
                "egressProxy/rules or allow_internet_access=false")

    async def _recover_pause(self, rec: SandboxRecord, op: PendingOp | None) -> bool:
        """A node killed while pausing `rec`: if the backend wrote the pause snapshot in full,
        the sandbox is paused with it (nothing is lost); False when there is none."""
        recovery = self.capabilities.crash_recovery
        if op is None or op.op != "pause" or recovery is None or rec.placement is None:
            return False
        try:
            result = await recovery.recover_pause(rec.sandbox_id, rec.placement, op.started_at)
        except Exception as exc:
            log.warning("pause snapshot not recovered",
                        extra={"sandbox_id": rec.sandbox_id, "error": str(exc)})
            return False
        if result is None:
            return False
        rec.placement = None
        rec.pause_snapshot = result.snapshot
        rec.pause_mode = "full" if result.memory else "filesystem"
        rec.pause_asked_memory = bool(op.doc.get("memory", True))
        rec.pause_reason = str(op.doc.get("reason", "request"))
        rec.last_pause = result.snapshot
        rec.state = State.PAUSED
        self.sandboxes[rec.sandbox_id] = rec
        await self.store.finish_pause(rec, [*rec.source.layers, *result.snapshot.layers])
        return True

    def sandbox_lost(self, sandbox_id: str, reason: str) -> None:
        """The backend saw a running sandbox end on its own (its VM died): remove it, as a kill
        would (the proxy then answers 502 "The sandbox was not found"). An operation under way
        on it sees the failure itself and cleans up."""
        rec = self.sandboxes.get(sandbox_id)
        if rec is None or rec.state != State.RUNNING or sandbox_id in self._ops:
            return
        log.error("sandbox lost", extra={"sandbox_id": sandbox_id, "reason": reason})
        rec.state = State.KILLING
        self._left_running(sandbox_id, "lost")
        work = self._start_op(sandbox_id, "kill",
                              self._do_kill(rec, State.RUNNING, f"lost: {reason}"))
        self._in_background(self._log_reap(sandbox_id, work, "sandbox removed"))

    def _in_background(self, work: Awaitable[Any]) -> None:
        """Run `work` beside the callers; shutdown waits for it."""
        task = asyncio.ensure_future(work)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def shutdown(self) -> None:
        """Stop taking lifecycle calls, finish the ones under way, pause every running sandbox."""
        self._closing = True
        for companion in self.companions:
            await companion.stop()
        for sid in list(self._ops):
            self._end_resume(sid, Unavailable(
                f"the node is shutting down: sandbox {sid} was not resumed (it stays paused)"))
        if self._reaper:
            self._reaper.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reaper
        for _ in range(3):
            pending = list(self._ops.values()) + list(self._background)
            if pending:
                await asyncio.wait(pending, timeout=WAIT_TRANSITION_SECONDS)
            running = [
                r
                for r in self.sandboxes.values()
                if r.state == State.RUNNING and r.sandbox_id not in self._ops
            ]
            if not running:
                break
            tasks = [self._begin_pause(rec, True, "shutdown") for rec in running]
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

    # --- helpers -----------------------------------------------------------------------------

    def _check_open(self) -> None:
        if self._closing:
            raise Unavailable("the node is shutting down")

    def get(self, sandbox_id: str) -> SandboxRecord:
        rec = self.sandboxes.get(sandbox_id)
        if rec is None:
            raise sandbox_not_found(sandbox_id)
        return rec

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

    async def _launch(self, sandbox_id: str, op: str, work: Awaitable[T]) -> T:
        """Run `work` as this sandbox's one operation; the caller may go away, the work won't."""
        return await asyncio.shield(self._start_op(sandbox_id, op, work))

    def _start_op(self, sandbox_id: str, op: str, work: Awaitable[T]) -> asyncio.Task[T]:
        """Register `work` as the sandbox's operation at once (no await), so nobody ever sees a
        transitional state without the task that will end it."""

        async def timed() -> T:
            began = time.monotonic()
            outcome = "error"
            try:
                await self._ops_allowed.wait()  # at once, unless a GC pass is sweeping
                result = await work
                outcome = "ok"
                return result
            finally:
                self._on_op(op, outcome, time.monotonic() - began)

        task = asyncio.create_task(timed(), name=f"{op}:{sandbox_id}")
        self._ops[sandbox_id] = task

        def done(t: asyncio.Task[Any]) -> None:
            if self._ops.get(sandbox_id) is t:
                del self._ops[sandbox_id]
            if not t.cancelled():
                t.exception()  # consumed here so an abandoned task logs nothing spurious

        task.add_done_callback(done)
        return task

    async def _wait_op(self, sandbox_id: str, state: State) -> None:
        task = self._ops.get(sandbox_id)
        if task is None:
            # a transitional state without a task cannot happen; never spin on it
            raise Conflict(f"sandbox {sandbox_id!r} is stuck in '{state.value}' state")
        done, _ = await asyncio.wait({task}, timeout=WAIT_TRANSITION_SECONDS)
        if not done:
            raise Conflict(f"sandbox {sandbox_id!r} stayed in '{state.value}' state too long")

    async def _await_state(
        self, sandbox_id: str, proceed: Collection[State],
        refuse: Mapping[State, Callable[[SandboxRecord], ApiError | None]] | None = None,
    ) -> SandboxRecord:
        """The record once its state is in `proceed`; in a state of `refuse`, that error (None:
        wait after all); in any other (another operation under way), wait for that operation
        and look again."""
        while True:
            rec = self.get(sandbox_id)
            if rec.state in proceed:
                return rec
            error = refuse[rec.state](rec) if refuse and rec.state in refuse else None
            if error is not None:
                raise error
            await self._wait_op(sandbox_id, rec.state)

    async def wait_idle(self, timeout: float) -> None:
        """Return once no operation is under way (each may be writing files no record names
        yet), or after about `timeout` seconds on a node too busy ever to be idle."""
        deadline = time.monotonic() + timeout
        while self._ops and time.monotonic() < deadline:
            await asyncio.wait(list(self._ops.values()), timeout=1.0)

    @contextlib.asynccontextmanager
    async def operations_held(self) -> AsyncIterator[None]:
        """While this lasts, operations that start wait before they do anything (the garbage
        collector's pass: a pause begun between its marks and its sweep wrote a snapshot
        directory no mark named, deleted under it with a zero grace period)."""
        self._ops_allowed.clear()
        try:
            yield
        finally:
            self._ops_allowed.set()

    def _clamp_timeout(self, seconds: int | None, default: int) -> int:
        if seconds is None:
            seconds = default
        return max(0, min(int(seconds), self.config.max_timeout))

    def _spec(self, rec: SandboxRecord) -> SandboxSpec:
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
            volume_mounts=tuple(VolumeMount(m.slot, m.path, m.mode == "ro", m.layer)
                                for m in rec.volume_mounts),
        )

    def _plan_mounts(self, params: CreateParams, tpl: TemplateRecord
                     ) -> tuple[list[MountRecord], list[PlannedMount]]:
        """The volumes a create mounts: those its snapshot mounted already (inherited, in
        their disks) and those it asks for, checked before anything is made (4xx)."""
        inherited = [MountRecord.from_json(m) for m in tpl.ref.data.get("volume_mounts", [])]
        if not params.volume_mounts:
            return inherited, []
        if self.volumes is None:
            raise BadRequest("volumeMounts: this node has no volumes")
        mounting = self.capabilities.volumes
        return inherited, self.volumes.plan_mounts(
            params.team, params.volume_mounts, inherited,
            None if mounting is None else mounting.free_volume_slots(tpl.ref),
            self.backend.name)

    def volume_layers(self) -> set[Path]:
        """The latest sealed version of every volume (node/volumes.py); none without volumes.
        Looked up at each call: the server sets the volumes after the collector is made."""
        return self.volumes.current_layers() if self.volumes is not None else set()

    def volume_writers(self) -> dict[str, str]:
        """The volumes a sandbox mounts read-write (exclusively), by volume id: its id."""
        return {m.volume_id: rec.sandbox_id for rec in self.sandboxes.values()
                for m in rec.volume_mounts if m.mode == "rw"}

    async def _mount(self, rec: SandboxRecord, planned: list[PlannedMount]) -> None:
        """The planned mounts with their volumes' sealed layers (sealed now if changed)."""
        if planned:
            assert self.volumes is not None
            rec.volume_mounts += [await self.volumes.mount(p) for p in planned]

    async def _envd_ready(self, rec: SandboxRecord, placement: Placement) -> None:
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

    def _collect_soon(self) -> None:
        """A debounced garbage collection pass (node/gc.py), if the node has a collector."""
        if self.gc is not None and not self._closing:
            self.gc.request()

    # --- create ------------------------------------------------------------------------------

    def _admit(self, what: str, memory_mb: int, cpu_count: int, count: int = 1
               ) -> Reservation | None:
        """Refuse (AdmissionRefused: 429/503, the limit named) what the node cannot hold;
        called before anything exists for the new VMs."""
        if self.admission is None:
            return None
        return self.admission.admit(what, self.sandboxes.values(), memory_mb, cpu_count, count)

    def _release(self, held: Reservation | None) -> None:
        if self.admission is not None:
            self.admission.release(held)

    async def create(self, params: CreateParams) -> SandboxRecord:
        self._check_open()
        tpl = self.catalogue.resolve(params.template, params.team)
        if params.auto_resume and params.auto_pause and not params.auto_pause_memory:
            raise BadRequest("autoResume cannot be combined with a filesystem-only autoPause")
        policy = network_policy.parse(params.network, params.allow_internet_access)
        self._check_enforced(policy)
        inherited, planned = self._plan_mounts(params, tpl)
        sid = new_id("i")
        now = time.time()
        timeout = self._clamp_timeout(params.timeout, self.config.default_timeout)
        idle_after = idle_setting(params.idle_pause_after, params.metadata, tpl.idle_pause_after,
                                  self.config.idle_pause_after, self.config.max_timeout)
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
            envd_access_token=self.tokens.envd_token(sid),
            traffic_access_token=(
                self.tokens.traffic_token(sid)
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
        self._release(self._admit("create sandbox", tpl.memory_mb, tpl.cpu_count))
        self.sandboxes[sid] = rec
        # A "name:tag" gives a copy with that build's snapshot: statistics go to the record.
        counted = self.catalogue.get(tpl.template_id) or tpl
        return await self._launch(sid, "create", self._do_create(rec, counted, timeout, planned))

    async def _do_create(
        self, rec: SandboxRecord, tpl: TemplateRecord, timeout: int,
        planned: list[PlannedMount] | None = None,
    ) -> SandboxRecord:
        sid = rec.sandbox_id
        placement: Placement | None = None

        async def persist() -> None:
            await self.store.put_sandbox(rec)
            await self.store.set_layer_refs(
                "sandbox", sid, [*rec.source.layers, *(m.layer for m in rec.volume_mounts)])

        try:
            await self._mount(rec, planned or [])
            # The record is written while the backend starts the sandbox (both take long on
            # a busy host); a crash in between leaves a CREATING record or an orphan, both
            # cleaned up at the next start.
            written = asyncio.ensure_future(persist())
            try:
                placement = await self.backend.create(self._spec(rec))
            finally:
                await written
            rec.placement = placement
            await self._envd_ready(rec, placement)
        except BaseException as exc:
            self.counters.count_create(rec.team, False)
            log.warning("sandbox create failed", extra={"sandbox_id": sid, "error": str(exc)})
            self.emit(FAILED, rec, operation="create", reason=_reason(exc))
            self.sandboxes.pop(sid, None)
            with contextlib.suppress(Exception):
                await self.backend.kill(sid, placement)
            with contextlib.suppress(Exception):
                await self.store.delete_sandbox(sid)
                await self.store.set_layer_refs("sandbox", sid, [])
            if isinstance(exc, BackendError):
                raise _backend_failure(f"failed to create sandbox: {exc}", exc) from exc
            raise
        if placement.envd_version:
            rec.envd_version = placement.envd_version
        now = time.time()
        rec.started_at, rec.end_at = now, now + timeout  # the TTL starts once envd is ready
        rec.state = State.RUNNING
        await self.store.put_sandbox(rec)
        self.counters.count_create(rec.team, True)
        self.emit(CREATED, rec)
        tpl.spawn_count += 1
        tpl.last_spawned_at = now
        # Statistics only: written in the background, off the create's latency.
        self._in_background(self._save_quietly(tpl))
        log.info("sandbox created", extra={"sandbox_id": sid, "template_id": rec.template_id})
        return rec

    async def create_many(self, params: CreateParams, count: int) -> list[ForkResult]:
        """`count` sandboxes of one template or snapshot (an extension: a batch create), a
        result each: every one is admitted, made and cleaned up on its own (creates are
        admitted in turn, so those past a limit get its 429 and nothing of them is made).
        When none is made, the first refusal is the answer (e.g. 429 naming the limit)."""
        self._check_count(count)
        made = await asyncio.gather(*(self.create(params) for _ in range(count)),
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

    async def _save_quietly(self, tpl: TemplateRecord) -> None:
        with contextlib.suppress(Exception):
            await self.store.put_template(tpl)

    # --- pause and resume --------------------------------------------------------------------

    async def pause(self, sandbox_id: str, memory: bool = True) -> None:
        self._check_open()

        def busy(rec: SandboxRecord) -> ApiError:
            return Conflict(
                f"sandbox {sandbox_id!r} cannot be paused while in '{rec.state.value}' state")

        rec = await self._await_state(sandbox_id, {State.RUNNING, State.PAUSED}, {
            State.PAUSING: _unless_idle(busy), State.KILLING: busy})
        if rec.state == State.PAUSED:
            if rec.pause_reason != IDLE_REASON:
                raise Conflict(f"sandbox {sandbox_id!r} is already paused")
            # Running as far as the caller knew: the node's pause becomes the caller's, which
            # traffic resumes only with autoResume (and a memory pause asked for).
            await self._repurpose_idle_pause(rec, "request", memory)
            return
        await asyncio.shield(self._begin_pause(rec, memory, "request"))

    def _begin_pause(self, rec: SandboxRecord, memory: bool, why: str) -> asyncio.Task[None]:
        """The pause of a running sandbox as its one operation, PAUSING from now on with its
        reason (no await in between: a call that looks sees both)."""
        rec.state, rec.pause_reason = State.PAUSING, why
        self._left_running(rec.sandbox_id, "paused")
        return self._start_op(rec.sandbox_id, "pause", self._do_pause(rec, memory, why))

    def _repurpose_idle_pause(self, rec: SandboxRecord, why: str, memory: bool
                              ) -> Awaitable[None]:
        """An idle pause becomes a pause for `why` ("request", "timeout"), as if the sandbox
        had been running until now (its snapshot serves as it is); returns the record's write.
        The change is made at once; the store writes in call order, so a transition begun
        meanwhile (a resume) writes its record after this one."""
        rec.pause_reason, rec.pause_asked_memory = why, memory
        self.emit(PAUSED, rec, pause_mode=rec.pause_mode, reason=why)
        return self.store.put_sandbox(rec)

    async def _do_pause(self, rec: SandboxRecord, memory: bool, why: str = "request") -> None:
        rec.state = State.PAUSING
        sid = rec.sandbox_id
        assert rec.placement is not None
        try:
            await self.store.put_sandbox(rec)
            # Before the backend writes anything: a crash between its snapshot and the paused
            # record below is then repaired at the next start (_recover_pause).
            await self.store.put_pending(sid, "pause", time.time(), {
                "memory": memory, "placement": rec.placement.to_json(), "reason": why})
            result = await self.backend.pause(sid, rec.placement, memory)
        except BackendError as exc:
            with contextlib.suppress(Exception):
                await self.store.delete_pending(sid)
            self.emit(FAILED, rec, operation="pause", reason=str(exc))
            if exc.retryable:
                rec.state = State.RUNNING
                await self.store.put_sandbox(rec)
                raise Internal(f"failed to pause sandbox {sid}: {exc}") from exc
            await self._forget(rec)
            self.emit(KILLED, rec, kill_reason="lost while pausing")
            raise Internal(f"sandbox {sid} was lost while pausing: {exc}") from exc
        _crash_point("pause-snapshot-written")
        rec.placement = None
        rec.pause_snapshot = result.snapshot
        rec.pause_mode = "full" if result.memory else "filesystem"
        rec.pause_asked_memory = memory
        rec.last_pause = result.snapshot
        rec.state = State.PAUSED
        await self.store.finish_pause(rec, [*rec.source.layers, *result.snapshot.layers])
        if why == IDLE_REASON:
            self.counters.idle_pauses += 1
        self.emit(PAUSED, rec, pause_mode=rec.pause_mode, reason=why, execution=_execution(rec))
        log.info("sandbox paused", extra={"sandbox_id": sid, "mode": rec.pause_mode})
        self._in_background(self._release_unnamed(rec, self._ops.get(sid)))

    async def _release_unnamed(self, rec: SandboxRecord, pausing: asyncio.Task[Any] | None
                               ) -> None:
        """Once the pause `pausing` is over (its caller has its answer): the sandbox's earlier
        pauses and fork points that no record names any more are released (only the last
        pause is a resume or rollback target; a child names the pause it was forked from as
        its source). Without this, every pause cycle kept the memory it dirtied on disk until
        the sandbox was deleted. Skipped when another operation began meanwhile (a snapshot it
        makes may not be named yet); the next pause does it. A failure costs disk: logged."""
        branching = self.capabilities.branching
        if branching is None:
            return
        if pausing is not None:
            await asyncio.wait([pausing])
        sid = rec.sandbox_id
        if self.sandboxes.get(sid) is not rec or rec.state != State.PAUSED or sid in self._ops:
            return
        # No await from here to the backend's reading of what the sandbox owns.
        named = [ref for other in self.sandboxes.values()
                 for ref in (other.source, other.pause_snapshot, other.last_pause)
                 if ref is not None]
        try:
            await branching.release_snapshots(sid, named)
        except Exception as exc:
            log.warning("earlier snapshots of a sandbox not released",
                        extra={"sandbox_id": sid, "error": str(exc)})

    async def _release_all_unnamed(self) -> None:
        for rec in [r for r in self.sandboxes.values() if r.state == State.PAUSED]:
            await self._release_unnamed(rec, None)

    async def connect(self, sandbox_id: str, timeout: int | None,
                      memory: bool = True) -> tuple[SandboxRecord, bool]:
        """Make sure the sandbox runs; returns (record, resumed). memory=False (the SDK's
        on_resume="reboot"): a paused sandbox cold-boots from its disk even when its pause
        kept memory (the memory snapshot is left as it is)."""
        self._check_open()
        seconds = self._clamp_timeout(timeout, self.config.default_timeout)
        rec = await self._await_state(sandbox_id, _STABLE, {
            State.KILLING: lambda rec: Conflict(f"sandbox {sandbox_id!r} is being killed")})
        if rec.state == State.RUNNING:
            self.activity.touch(sandbox_id)  # an SDK's connect: it is in use
            rec.end_at = max(rec.end_at, time.time() + seconds)
            await self.store.put_sandbox(rec)
            return rec, False
        # No await until the state changes: the resuming record counts from then on.
        self._release(self._admit(f"resume sandbox {sandbox_id}", rec.memory_mb, rec.cpu_count))
        rec.state = State.RESUMING
        await self._launch(sandbox_id, "resume", self._do_resume(rec, seconds, memory))
        return rec, True

    async def resume_legacy(
        self, sandbox_id: str, timeout: int | None, auto_pause: bool | None
    ) -> SandboxRecord:
        """`POST /sandboxes/{id}/resume` of SDK 2.0-2.5: 409 when the sandbox already runs."""
        self._check_open()
        seconds = self._clamp_timeout(timeout, 15)
        rec = await self._await_state(sandbox_id, {State.PAUSED}, dict.fromkeys(
            (State.RUNNING, State.KILLING, State.CREATING, State.RESUMING),
            lambda rec: Conflict(f"sandbox {sandbox_id!r} is already running")))
        self._release(self._admit(f"resume sandbox {sandbox_id}", rec.memory_mb, rec.cpu_count))
        if auto_pause is not None:
            rec.auto_pause = auto_pause
        rec.state = State.RESUMING
        await self._launch(sandbox_id, "resume", self._do_resume(rec, seconds))
        return rec

    async def _do_resume(self, rec: SandboxRecord, timeout: int, memory: bool = True) -> None:
        rec.state = State.RESUMING
        sid = rec.sandbox_id
        # A sandbox the node paused for idleness was running as far as its caller knew: its
        # endAt goes on (a connect may extend it, as it would a running one's).
        idle = rec.pause_reason == IDLE_REASON
        assert rec.pause_snapshot is not None
        placement: Placement | None = None
        try:
            await self.store.put_sandbox(rec)
            placement = await self.backend.resume(self._spec(rec), rec.pause_snapshot,
                                                  memory=memory)
            await self._envd_ready(rec, placement)
        except BaseException as exc:
            # roll back: the pause snapshot is untouched, the sandbox stays paused
            if placement is not None:
                with contextlib.suppress(Exception):
                    await self.backend.pause(sid, placement, True)
            rec.state = State.PAUSED
            with contextlib.suppress(Exception):
                await self.store.put_sandbox(rec)
            self.emit(FAILED, rec, operation="resume", reason=_reason(exc))
            if isinstance(exc, BackendError):
                raise _backend_failure(f"failed to resume sandbox {sid}: {exc}", exc) from exc
            ended = self._resume_ended.pop(sid, None)
            if isinstance(exc, asyncio.CancelledError) and ended is not None:
                raise ended from None
            raise
        rec.placement = placement
        rec.pause_snapshot = None
        end = time.time() + timeout
        rec.end_at = max(rec.end_at, end) if idle else end
        rec.state = State.RUNNING
        await self.store.put_sandbox(rec)
        if idle:
            self.counters.idle_resumes += 1
        self.emit(RESUMED, rec, cold_boot=not memory, **({"idle_pause": True} if idle else {}))
        log.info("sandbox resumed", extra={"sandbox_id": sid})

    def _end_resume(self, sandbox_id: str, why: ApiError) -> None:
        """End a resume under way now: it may be waiting on what its guest answers (bounded,
        but for as long as the restore timeout). It rolls back to paused (_do_resume) and its
        caller gets `why`."""
        rec = self.sandboxes.get(sandbox_id)
        task = self._ops.get(sandbox_id)
        if rec is not None and rec.state == State.RESUMING and task is not None:
            self._resume_ended[sandbox_id] = why
            task.cancel()

    async def running_placement(self, sandbox_id: str) -> Placement | None:
        """For the proxy: where the sandbox runs, resuming it when autoResume (or an idle
        pause) allows; None if the sandbox is unknown, killed, or paused otherwise. A resume
        the node cannot take on now (429/503: full, shutting down) raises that ApiError: the
        sandbox is there, the caller may try again."""
        rec = self.sandboxes.get(sandbox_id)
        for _ in range(3):
            if rec is None or rec.state == State.KILLING:
                return None
            if rec.state == State.RUNNING:
                return rec.placement
            if rec.state == State.PAUSED:
                # A filesystem-only pause asked for resumes on connect only (a cold boot: the
                # request would reach a sandbox that rebooted under it).
                if not rec.resumes_on_traffic or not rec.pause_asked_memory or self._closing:
                    return None
                try:
                    # after an idle pause, the endAt it had (_do_resume)
                    await self.connect(sandbox_id, 0 if rec.pause_reason == IDLE_REASON
                                       else self.config.auto_resume_min_timeout)
                except ApiError as exc:
                    if exc.status in (429, 503):
                        raise
                    log.warning(
                        "auto-resume failed", extra={"sandbox_id": sandbox_id, "error": str(exc)}
                    )
                    return None
                except Exception as exc:
                    log.warning(
                        "auto-resume failed", extra={"sandbox_id": sandbox_id, "error": str(exc)}
                    )
                    return None
            elif rec.state == State.PAUSING and not rec.resumes_on_traffic:
                return None
            else:
                with contextlib.suppress(Conflict):
                    await self._wait_op(sandbox_id, rec.state)
            rec = self.sandboxes.get(sandbox_id)
        return rec.placement if rec is not None and rec.state == State.RUNNING else None

    # --- kill --------------------------------------------------------------------------------

    async def kill(self, sandbox_id: str) -> None:
        self._check_open()
        self._end_resume(sandbox_id, ApiError(
            f"sandbox {sandbox_id} was deleted while it resumed", status=404))
        rec = await self._await_state(sandbox_id, {*_STABLE, State.KILLING})
        if rec.state == State.KILLING:
            # someone else's kill (or the reaper's): wait for it; then, like get_info,
            # answer that the sandbox does not exist (the SDK's kill() returns False)
            task = self._ops.get(sandbox_id)
            if task is not None:
                await asyncio.shield(task)
            raise sandbox_not_found(sandbox_id)
        previous = rec.state
        rec.state = State.KILLING
        self._left_running(sandbox_id, "killed")
        await self._launch(sandbox_id, "kill", self._do_kill(rec, previous))

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
        await self._forget(rec)
        ran = {"execution": _execution(rec)} if previous == State.RUNNING else {}
        self.emit(KILLED, rec, kill_reason=why, **ran)
        log.info("sandbox killed", extra={"sandbox_id": sid})

    async def _forget(self, rec: SandboxRecord) -> None:
        self.sandboxes.pop(rec.sandbox_id, None)
        await self.store.delete_sandbox(rec.sandbox_id)
        await self.store.set_layer_refs("sandbox", rec.sandbox_id, [])
        self._collect_soon()

    # --- timeouts ----------------------------------------------------------------------------

    async def set_timeout(self, sandbox_id: str, seconds: int, shorten: bool = True) -> None:
        """`endAt = now + seconds` (may shorten unless `shorten` is False); running only (a
        sandbox paused for idleness counts as running: its endAt goes on)."""
        self._check_open()
        rec = await self._await_state(
            sandbox_id, {State.RUNNING, State.SNAPSHOTTING, State.FORKING, State.PAUSED},
            {State.PAUSING: _unless_idle(_gone), State.KILLING: _gone})
        if rec.state == State.PAUSED and rec.pause_reason != IDLE_REASON:
            raise _gone(rec)
        end = time.time() + self._clamp_timeout(seconds, 0)
        rec.end_at = end if shorten else max(rec.end_at, end)
        await self.store.put_sandbox(rec)
        self.emit(UPDATED, rec, set_timeout=iso(rec.end_at))

    async def _reap_forever(self) -> None:
        while True:
            await asyncio.sleep(self.config.reaper_interval)
            try:
                self.reap_once()
            except Exception:
                log.exception("reaper pass failed")

    def reap_once(self) -> int:
        """Pause (autoPause) or kill every running sandbox past its endAt, and every one paused
        for idleness (its endAt goes on); pause those idle for their idlePauseAfter. Returns
        how many timed out."""
        now = time.time()
        count = 0
        self.activity.retain(self.sandboxes)
        for rec in list(self.sandboxes.values()):
            sid = rec.sandbox_id
            if sid in self._ops:
                continue
            if rec.state == State.PAUSED and rec.pause_reason == IDLE_REASON and rec.end_at <= now:
                count += 1
                self._expire_idle_pause(rec)
                continue
            if rec.state != State.RUNNING:
                continue
            if rec.end_at > now:
                if rec.idle_pause_after and not self._closing \
                        and self.activity.idle_for(sid) >= rec.idle_pause_after:
                    work = self._begin_pause(rec, True, IDLE_REASON)
                    self._in_background(self._log_reap(sid, work, "idle sandbox paused"))
                continue
            count += 1
            if rec.auto_pause:
                work = self._begin_pause(rec, rec.auto_pause_memory, "timeout")
            else:
                rec.state = State.KILLING
                self._left_running(sid, "killed")
                work = self._start_op(sid, "kill", self._do_kill(rec, State.RUNNING, "timeout"))
            self._in_background(self._log_reap(sid, work, "sandbox timed out"))
        return count

    def _expire_idle_pause(self, rec: SandboxRecord) -> None:
        """A sandbox paused for idleness reached its endAt: what its timeout does to a running
        one, it does now (autoPause: the pause it has becomes a timeout's; else a kill)."""
        sid = rec.sandbox_id
        if rec.auto_pause:
            work = self._repurpose_idle_pause(rec, "timeout", rec.auto_pause_memory)
        else:
            rec.state = State.KILLING
            self._left_running(sid, "killed")
            work = self._start_op(sid, "kill", self._do_kill(rec, State.PAUSED, "timeout"))
        self._in_background(self._log_reap(sid, work, "sandbox timed out while idle"))

    async def _log_reap(self, sandbox_id: str, work: Awaitable[None], done: str) -> None:
        try:
            await work
            log.info(done, extra={"sandbox_id": sandbox_id})
        except Exception as exc:
            log.error(
                "timeout handling failed", extra={"sandbox_id": sandbox_id, "error": str(exc)}
            )

    # --- snapshots and forks -----------------------------------------------------------------

    async def _wait_running(self, sandbox_id: str, what: str) -> SandboxRecord:
        def refuse(rec: SandboxRecord) -> ApiError:
            return Conflict(
                f"sandbox {sandbox_id!r} cannot {what} while in '{rec.state.value}' state")

        while True:
            rec = await self._await_state(sandbox_id, {State.RUNNING, State.PAUSED}, {
                State.PAUSING: _unless_idle(refuse), State.KILLING: refuse})
            if rec.state == State.RUNNING:
                return rec
            if rec.pause_reason != IDLE_REASON:
                raise refuse(rec)
            await self.connect(sandbox_id, 0)  # paused for idleness: woken, as traffic would

    async def snapshot(self, sandbox_id: str, name: str | None) -> TemplateRecord:
        self._check_open()
        team = self.get(sandbox_id).team
        owner = None if name is None else self.catalogue.name_owner(name, team)
        if owner is not None:
            raise Conflict(f"name {name!r} is already used by {owner}")
        with self.hold_snapshot_quota():
            rec = await self._wait_running(sandbox_id, "be snapshotted")
            rec.state = State.SNAPSHOTTING
            return await self._launch(sandbox_id, "snapshot", self._do_snapshot(rec, name))

    def hold_snapshot_quota(self) -> contextlib.AbstractContextManager[None]:
        """A place of a standalone node's team quota of snapshots, held until the new
        snapshot is in the catalogue (or was not made)."""
        if self.admission is None:
            return contextlib.nullcontext()
        return self.admission.hold_quota("snapshots", sum(
            t.kind == "snapshot" for t in self.catalogue.templates.values()))

    async def _do_snapshot(self, rec: SandboxRecord, name: str | None) -> TemplateRecord:
        sid = rec.sandbox_id
        snapshot_id = new_id("s")
        assert rec.placement is not None
        try:
            ref = await self.backend.snapshot(sid, rec.placement, snapshot_id)
        except BackendError as exc:
            rec.state = State.RUNNING
            self.emit(FAILED, rec, operation="snapshot", reason=str(exc))
            if not exc.retryable:
                await self._forget(rec)
                self.emit(KILLED, rec, kill_reason="lost while snapshotting")
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
            await self.catalogue.save(tpl)
        except NameTaken as exc:
            with contextlib.suppress(BackendError):
                await self.backend.delete_snapshot(ref)
            raise Conflict(str(exc)) from exc
        self.emit(CHECKPOINTED, rec, snapshot_id=snapshot_id, names=tpl.names)
        return tpl

    def _check_count(self, count: int) -> None:
        if not 1 <= count <= MAX_FORK_COUNT:
            raise BadRequest(f"count must be between 1 and {MAX_FORK_COUNT}, got {count}: "
                             f"{MAX_FORK_COUNT} children per call is this node's limit")

    def _branching(self, what: str) -> SnapshotBranching:
        """The backend's SnapshotBranching, or 400 naming what it cannot do."""
        branching = self.capabilities.branching
        if branching is None:
            raise BadRequest(f"the {self.backend.name} backend cannot {what}: the VM backend can")
        return branching

    async def fork(self, sandbox_id: str, count: int, timeout: int | None) -> list[ForkResult]:
        """`count` running children: of a running sandbox (checkpoint in place, it goes on
        running), or of a paused one from its pause snapshot (it stays paused, untouched)."""
        self._check_open()
        self._check_count(count)
        seconds = self._clamp_timeout(timeout, self.config.fork_default_timeout)
        rec = await self._await_state(sandbox_id, _STABLE, {State.KILLING: lambda rec: Conflict(
            f"sandbox {sandbox_id!r} cannot be forked while in '{rec.state.value}' state")})
        paused = rec.state == State.PAUSED
        if paused:
            self._branching("fork a paused sandbox (resume it and fork the running one)")
            if rec.pause_snapshot is None:
                raise Conflict(f"paused sandbox {sandbox_id!r} has no pause snapshot")
        # Held until the children's records exist (_new_children), which count from then on.
        held = self._admit(f"fork sandbox {sandbox_id} into {count}", rec.memory_mb,
                           rec.cpu_count, count)
        rec.state = State.BRANCHING if paused else State.FORKING
        work = (self._do_fork_paused(rec, count, seconds, held) if paused
                else self._do_fork(rec, count, seconds, held))
        try:
            return await self._launch(sandbox_id, "fork", work)
        finally:
            self._release(held)

    def _new_children(self, rec: SandboxRecord, count: int, timeout: int,
                      held: Reservation | None) -> list[SandboxRecord]:
        """Records of `count` children of `rec` (its settings, their own ids and tokens),
        counted from now on (the admission reservation goes)."""
        now = time.time()
        children: list[SandboxRecord] = []
        for _ in range(count):
            cid = new_id("i")
            child = SandboxRecord.from_row(rec.to_row())
            child.sandbox_id = cid
            child.state = State.CREATING
            child.envd_access_token = self.tokens.envd_token(cid)
            if rec.traffic_access_token:
                child.traffic_access_token = self.tokens.traffic_token(cid)
            child.placement, child.pause_snapshot, child.pause_mode = None, None, None
            child.parent_sandbox_id, child.source_snapshot_id = rec.sandbox_id, None
            child.last_pause = None
            # a read-write volume stays the parent's: a child has its writes copy-on-write
            child.volume_mounts = [m.shared() for m in child.volume_mounts]
            child.started_at, child.end_at, child.created_at = now, now + timeout, now
            children.append(child)
            self.sandboxes[cid] = child
        self._release(held)
        return children

    async def _drop_children(self, children: list[SandboxRecord]) -> None:
        for child in children:
            self.sandboxes.pop(child.sandbox_id, None)
            with contextlib.suppress(Exception):
                await self.store.delete_sandbox(child.sandbox_id)

    async def _do_fork(self, rec: SandboxRecord, count: int, timeout: int,
                       held: Reservation | None = None) -> list[ForkResult]:
        children = self._new_children(rec, count, timeout, held)
        assert rec.placement is not None
        try:
            for child in children:
                await self.store.put_sandbox(child)
            outcomes = await self.backend.fork(
                self._spec(rec), rec.placement, [self._spec(c) for c in children]
            )
        except BaseException as exc:
            await self._drop_children(children)
            rec.state = State.RUNNING
            self.emit(FAILED, rec, operation="fork", reason=_reason(exc))
            if isinstance(exc, BackendError):
                if not exc.retryable:
                    await self._forget(rec)
                    self.emit(KILLED, rec, kill_reason="lost while forking")
                raise _backend_failure(f"failed to fork sandbox {rec.sandbox_id}: {exc}", exc) from exc
            raise
        finally:
            if rec.state == State.FORKING:
                rec.state = State.RUNNING
        return await self._finish_children(children, outcomes, timeout)

    async def _do_fork_paused(self, rec: SandboxRecord, count: int, timeout: int,
                              held: Reservation | None) -> list[ForkResult]:
        """Children start from the parent's pause snapshot, which is only read: the parent
        is never resumed (BRANCHING keeps its kill or resume waiting until they run)."""
        snapshot = rec.pause_snapshot
        assert snapshot is not None  # fork() checked
        children = self._new_children(rec, count, timeout, held)
        try:
            for child in children:
                # Its source is the snapshot it starts from: the node's GC keeps that
                # snapshot's files while the child (or a fork of it) needs them.
                child.source = snapshot
                await self.store.put_sandbox(child)
            outcomes = await self._branching("fork a paused sandbox").fork_snapshot(
                snapshot, [self._spec(c) for c in children])
        except BaseException as exc:
            await self._drop_children(children)
            if isinstance(exc, BackendError):
                raise _backend_failure(f"failed to fork paused sandbox {rec.sandbox_id}: {exc}",
                                       exc) from exc
            raise
        finally:
            rec.state = State.PAUSED
        return await self._finish_children(children, outcomes, timeout)

    async def _finish_children(self, children: list[SandboxRecord], outcomes: list[ForkOutcome],
                               timeout: int) -> list[ForkResult]:
        """Each child runs (recorded with its layers) or is gone, whatever the others do."""
        by_id = {o.sandbox_id: o for o in outcomes}

        async def finish(child: SandboxRecord) -> ForkResult:
            outcome = by_id.get(child.sandbox_id)
            error = "the backend returned no result" if outcome is None else outcome.error
            if outcome is not None and outcome.placement is not None and error is None:
                child.placement = outcome.placement
                try:
                    await self._envd_ready(child, outcome.placement)
                except BackendError as exc:
                    error = str(exc)
            if error is not None:
                self.sandboxes.pop(child.sandbox_id, None)
                with contextlib.suppress(Exception):
                    await self.backend.kill(child.sandbox_id, child.placement)
                await self.store.delete_sandbox(child.sandbox_id)
                self.emit(FAILED, child, operation="fork", reason=error,
                          source_sandbox_id=child.parent_sandbox_id)
                return ForkResult(error=f"fork failed: {error}", status=500)
            ready = time.time()
            child.started_at, child.end_at = ready, ready + timeout
            child.state = State.RUNNING
            await self.store.put_sandbox(child)
            self.emit(FORKED, child, source_sandbox_id=child.parent_sandbox_id)
            await self.store.set_layer_refs("sandbox", child.sandbox_id, list(child.source.layers))
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
        tpl = self.catalogue.resolve(snapshot_id, rec.team)
        if tpl.kind != "snapshot" or tpl.source_sandbox_id != rec.sandbox_id:
            raise BadRequest(f"{snapshot_id!r} is not a snapshot of sandbox {rec.sandbox_id!r}: "
                             "a sandbox rolls back to its own snapshots only")
        return tpl.ref

    async def rollback(self, sandbox_id: str, snapshot_id: str | None,
                       timeout: int | None) -> SandboxRecord:
        """Restore a running or paused sandbox in place to one of its snapshots: same id,
        network policy and lineage; memory, processes and disk as at the snapshot; a new envd
        token (the old one opens nothing). It runs afterwards, at least `timeout` seconds."""
        self._check_open()
        branching = self._branching("roll a sandbox back")
        seconds = self._clamp_timeout(timeout, self.config.default_timeout)
        rec = await self._await_state(sandbox_id, _STABLE, {State.KILLING: lambda rec: Conflict(
            f"sandbox {sandbox_id!r} is being killed")})
        target = self._rollback_target(rec, snapshot_id)
        previous = rec.state
        # It gets a VM: a paused sandbox's only one (its record counts it from here on), a
        # running one's second, beside the old until that stops (held until the rollback ends).
        held = self._admit(f"roll back sandbox {sandbox_id}", rec.memory_mb, rec.cpu_count)
        if previous == State.PAUSED:
            self._release(held)
        else:
            self._left_running(sandbox_id, "rolled back")
        rec.state = State.ROLLING_BACK

        async def rolling_back() -> None:  # the work outlives a caller that goes away
            try:
                await self._do_rollback(rec, branching, target, previous, seconds)
            finally:
                self._release(held)

        await self._launch(sandbox_id, "rollback", rolling_back())
        return rec

    async def _do_rollback(self, rec: SandboxRecord, branching: SnapshotBranching,
                           target: SnapshotRef, previous: State, timeout: int) -> None:
        sid = rec.sandbox_id
        old_token = rec.envd_access_token
        try:
            # The record keeps the old token until the new VM runs; the new one waits in the
            # pending operation, for a node killed meanwhile (_reconcile: whichever VM it
            # finds decides which token the sandbox has).
            await self.store.put_sandbox(rec)
            new_token = self.tokens.fresh_envd_token()
            await self.store.put_pending(sid, "rollback", time.time(), {"token": new_token})
            rec.envd_access_token = new_token
            placement = await branching.rollback(self._spec(rec), rec.placement, target)
        except BaseException as exc:
            # The backend left the sandbox as it was: so is its record.
            rec.envd_access_token, rec.state = old_token, previous
            with contextlib.suppress(Exception):
                await self.store.put_sandbox(rec)
                await self.store.delete_pending(sid)
            if isinstance(exc, BackendError):
                raise _backend_failure(f"failed to roll sandbox {sid} back: {exc}", exc) from exc
            raise
        rec.placement, rec.pause_snapshot = placement, None
        rec.end_at = max(rec.end_at, time.time() + timeout)
        rec.state = State.RUNNING
        await self.store.put_sandbox(rec)
        await self.store.delete_pending(sid)
        self.emit(ROLLED_BACK, rec)
        log.info("sandbox rolled back", extra={"sandbox_id": sid})

    # --- node info ---------------------------------------------------------------------------

    def count_by_state(self) -> dict[str, int]:
        counts = {s.value: 0 for s in State}
        for rec in self.sandboxes.values():
            counts[rec.state.value] += 1
        return counts


_STABLE = frozenset({State.RUNNING, State.PAUSED})


def _same_vm(live: Placement, recorded: Placement | None) -> bool:
    """Whether an adopted VM is the one the record names (backends name VMs by `vm_id`)."""
    return recorded is not None and live.handle.get("vm_id") == recorded.handle.get("vm_id")


def _unless_idle(refusal: Callable[[SandboxRecord], ApiError]
                 ) -> Callable[[SandboxRecord], ApiError | None]:
    """`refusal`, except for a sandbox being paused for idleness: running as far as the
    caller knows, so the call waits for the pause and goes on (_await_state)."""
    return lambda rec: None if rec.pause_reason == IDLE_REASON else refusal(rec)


def _gone(rec: SandboxRecord) -> ApiError:
    """404, as E2B answers for a sandbox this call cannot act on (paused, being killed)."""
    return sandbox_not_found(rec.sandbox_id)


def _backend_failure(message: str, exc: BackendError) -> ApiError:
    """503 when the host cannot serve right now (blockd down: retry later), else 500."""
    return Unavailable(message) if getattr(exc, "unavailable", False) else Internal(message)


def _reason(exc: BaseException) -> str:
    return "cancelled" if isinstance(exc, asyncio.CancelledError) else str(exc) or type(exc).__name__


def _execution(rec: SandboxRecord) -> dict[str, Any]:
    """E2B's eventData.execution of a paused or killed sandbox: the run that just ended."""
    return {"started_at": iso(rec.started_at), "vcpu_count": rec.cpu_count,
            "memory_mb": rec.memory_mb,
            "execution_time": int((time.time() - rec.started_at) * 1000)}
