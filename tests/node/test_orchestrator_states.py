"""The sandbox state machine in-process: an `Orchestrator` over a real SQLite store and the
scripted backend (tests/node/scripted.py), with failures injected into every operation.

Each test ends with `settled()`: no sandbox in a transitional state, the store says what the
memory says, no pending operation is left, and the backend runs exactly the running sandboxes
and holds every paused one's snapshot: nothing half done. A node "crash" stops every write of the node
to its store at the point the scripted backend names (the node's own clean-up code after it
never reaches the disk) and ends that `asyncio.run` with the node's state abandoned; the next
`asyncio.run` starts a node on the same database and backend, as a restarted process would.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest

from agentenv.api.errors import ApiError, BadRequest, Conflict, Internal, NotFound, Unavailable
from agentenv.api.tenancy import LOCAL_TEAM
from agentenv.node.admission import Admission, AdmissionRefused
from agentenv.node.orchestrator import CreateParams, NodeConfig, Orchestrator
from agentenv.node.records import SandboxRecord, State
from agentenv.node.security import TokenIssuer
from agentenv.node.store import Store
from tests.node.scripted import Crash, ScriptedBackend

LIMIT = 20.0  # seconds one scenario may take; every one takes far less


def run(scenario: Callable[[], Awaitable[None]]) -> None:
    asyncio.run(asyncio.wait_for(scenario(), LIMIT))


class MortalStore(Store):
    """The node's store, which nothing reaches once the node process is dead."""

    dead = False

    def die(self) -> None:
        self.dead = True

    async def _run(self, fn: Callable[[Any], Any]) -> Any:
        if self.dead:
            raise Crash("the node is dead: this write never happens")
        return await super()._run(fn)


async def start(tmp_path: Path, backend: ScriptedBackend, **config: Any) -> Orchestrator:
    options: dict[str, Any] = {"reaper_interval": 3600.0, "envd_ready_timeout": 0.3}
    store = MortalStore(tmp_path / "node.db")
    backend.on_crash = store.die
    orch = Orchestrator(store, backend, TokenIssuer(tmp_path), NodeConfig(**(options | config)))
    # As server.build_app does for a real backend: the lost-sandbox callback at assembly.
    backend.on_sandbox_lost = orch.sandbox_lost
    await orch.start()
    return orch


async def create(orch: Orchestrator, **params: Any) -> SandboxRecord:
    return await orch.create(CreateParams(**({"template": "base", "timeout": 300} | params)))


async def settled(orch: Orchestrator, backend: ScriptedBackend) -> dict[str, SandboxRecord]:
    """Asserts that nothing is half done; returns the stored records."""
    await orch.wait_idle(5.0)
    counts = orch.count_by_state()
    assert {s for s, n in counts.items() if n} <= {"running", "paused"}, counts
    stored = {r.sandbox_id: r for r in await orch.store.load_sandboxes()}
    assert stored.keys() == orch.sandboxes.keys()
    for sid, rec in orch.sandboxes.items():
        assert stored[sid].state == rec.state, sid
        assert stored[sid].placement == rec.placement, sid
        assert stored[sid].pause_snapshot == rec.pause_snapshot, sid
        if rec.state == State.PAUSED:
            assert rec.placement is None and rec.pause_snapshot is not None
            assert rec.pause_snapshot.data["key"] in backend.snapshots, sid
        else:
            assert rec.placement is not None and rec.pause_snapshot is None
    assert await orch.store.load_pending() == {}
    running = {sid for sid, r in orch.sandboxes.items() if r.state == State.RUNNING}
    assert set(backend.running) == running
    refs = await orch.store.layer_ref_counts()
    assert refs.get("layer-base", 0) == 1 + len(orch.sandboxes)  # the template + each sandbox
    return stored


async def raises(kind: type[BaseException], work: Awaitable[Any]) -> BaseException:
    with pytest.raises(kind) as caught:
        await work
    return caught.value


# --- create ------------------------------------------------------------------------------------


@pytest.mark.parametrize("retryable", [True, False])
@pytest.mark.parametrize("after", [False, True])
def test_create_failure_leaves_nothing(tmp_path: Path, retryable: bool, after: bool) -> None:
    async def scenario() -> None:
        backend = ScriptedBackend()
        orch = await start(tmp_path, backend)
        backend.fail("create", retryable=retryable, after=after)
        await raises(Internal, create(orch))
        assert orch.sandboxes == {} and orch.counters.create_fails == 1
        if after:  # the VM it had started is killed again
            assert len(backend.called("kill")) == 1
        await settled(orch, backend)
        rec = await create(orch)  # the node still serves
        assert rec.state == State.RUNNING and orch.counters.create_successes == 1
        await settled(orch, backend)
        await orch.shutdown()

    run(scenario)


def test_create_unavailable_backend_is_503(tmp_path: Path) -> None:
    async def scenario() -> None:
        backend = ScriptedBackend()
        orch = await start(tmp_path, backend)
        backend.fail("create", unavailable=True)
        await raises(Unavailable, create(orch))
        await settled(orch, backend)
        await orch.shutdown()

    run(scenario)


# --- pause and resume ----------------------------------------------------------------------------


def test_pause_and_resume(tmp_path: Path) -> None:
    async def scenario() -> None:
        backend = ScriptedBackend()
        orch = await start(tmp_path, backend)
        rec = await create(orch)
        await orch.pause(rec.sandbox_id)
        stored = await settled(orch, backend)
        assert stored[rec.sandbox_id].state == State.PAUSED
        assert stored[rec.sandbox_id].pause_mode == "full"
        await raises(Conflict, orch.pause(rec.sandbox_id))
        again, resumed = await orch.connect(rec.sandbox_id, 60)
        assert resumed and again.state == State.RUNNING and again.pause_snapshot is None
        await settled(orch, backend)
        await orch.shutdown()

    run(scenario)


def test_an_operation_started_during_a_gc_pass_waits_for_its_sweep(tmp_path: Path) -> None:
    """A garbage collector pass marks what records name, then sweeps the rest: a pause begun
    in between wrote a snapshot directory no mark named, which a zero grace period let the
    sweep delete under it (a CI failure of the paused-fork test). Operations now wait while
    a pass holds them."""
    async def scenario() -> None:
        backend = ScriptedBackend()
        orch = await start(tmp_path, backend)
        rec = await create(orch)
        async with orch.operations_held():
            pausing = asyncio.create_task(orch.pause(rec.sandbox_id))
            await asyncio.sleep(0.2)
            assert not backend.called("pause") and not pausing.done()
        await pausing
        assert backend.called("pause")
        stored = await settled(orch, backend)
        assert stored[rec.sandbox_id].state == State.PAUSED
        await orch.shutdown()

    run(scenario)


def test_a_pause_releases_the_earlier_ones_no_record_names(tmp_path: Path) -> None:
    """Only the last pause is a resume or rollback target: a pause releases the earlier ones,
    except one a child forked from it names as its source (released at a later pause, once
    the child is gone). A failure to release costs disk, not the pause."""
    async def scenario() -> None:
        backend = ScriptedBackend()
        orch = await start(tmp_path, backend)
        sid = (await create(orch)).sandbox_id

        async def pause() -> str:
            await orch.pause(sid)
            await orch.wait_idle(5.0)  # (settled's layer count: a fork child's is its source)
            while orch._background:  # the release runs once the pause has answered
                await asyncio.wait(list(orch._background))
            snapshot = orch.sandboxes[sid].pause_snapshot
            assert snapshot is not None
            return str(snapshot.data["key"])

        async def resume() -> None:
            await orch.connect(sid, 60)
            await orch.wait_idle(5.0)

        first = await pause()
        [child] = [r.record for r in await orch.fork(sid, 1, 60)]
        assert child is not None
        await resume()
        second = await pause()
        assert backend.called("release") == []  # the child's source
        await resume()
        third = await pause()
        assert backend.called("release") == [second]
        await orch.kill(child.sandbox_id)
        await resume()
        backend.fail("release")
        kept = await pause()
        assert backend.called("release") == [second, first]
        assert first in backend.snapshots and third in backend.snapshots
        await resume()
        fourth = await pause()
        assert backend.called("release") == [second, first, first, third, kept]
        assert fourth in backend.snapshots
        assert not {first, second, third, kept} & set(backend.snapshots)
        await orch.shutdown()

    run(scenario)


def test_pause_retryable_failure_keeps_it_running(tmp_path: Path) -> None:
    async def scenario() -> None:
        backend = ScriptedBackend()
        orch = await start(tmp_path, backend)
        rec = await create(orch)
        backend.fail("pause")
        await raises(Internal, orch.pause(rec.sandbox_id))
        stored = await settled(orch, backend)
        assert stored[rec.sandbox_id].state == State.RUNNING
        await orch.pause(rec.sandbox_id)  # and a second try works
        await settled(orch, backend)
        await orch.shutdown()

    run(scenario)


def test_pause_fatal_failure_forgets_the_sandbox(tmp_path: Path) -> None:
    async def scenario() -> None:
        backend = ScriptedBackend()
        orch = await start(tmp_path, backend)
        rec = await create(orch)
        backend.fail("pause", retryable=False)
        error = await raises(Internal, orch.pause(rec.sandbox_id))
        assert "lost while pausing" in str(error)
        assert rec.sandbox_id not in orch.sandboxes
        await settled(orch, backend)
        await raises(NotFound, orch.kill(rec.sandbox_id))
        await orch.shutdown()

    run(scenario)


def test_kill_during_a_failing_pause_waits_then_kills(tmp_path: Path) -> None:
    """A retryable failure mid-pause while a kill waits for it: the kill runs after it."""

    async def scenario() -> None:
        backend = ScriptedBackend()
        orch = await start(tmp_path, backend)
        rec = await create(orch)
        held = backend.hold("pause")
        backend.fail("pause")
        pausing = asyncio.create_task(orch.pause(rec.sandbox_id))
        await held.entered.wait()
        assert orch.sandboxes[rec.sandbox_id].state == State.PAUSING
        stored = {r.sandbox_id: r for r in await orch.store.load_sandboxes()}
        assert stored[rec.sandbox_id].state == State.PAUSING  # written before the backend call
        assert rec.sandbox_id in await orch.store.load_pending()
        killing = asyncio.create_task(orch.kill(rec.sandbox_id))
        await raises(NotFound, orch.set_timeout(rec.sandbox_id, 10))  # paused for the API
        held.release()
        await raises(Internal, pausing)
        await killing
        assert orch.sandboxes == {}
        await settled(orch, backend)
        await orch.shutdown()

    run(scenario)


def test_caller_going_away_does_not_cut_the_pause(tmp_path: Path) -> None:
    async def scenario() -> None:
        backend = ScriptedBackend()
        orch = await start(tmp_path, backend)
        rec = await create(orch)
        held = backend.hold("pause")
        caller = asyncio.create_task(orch.pause(rec.sandbox_id))
        await held.entered.wait()
        caller.cancel()  # the client disconnected
        with contextlib.suppress(asyncio.CancelledError):
            await caller
        held.release()
        stored = await settled(orch, backend)
        assert stored[rec.sandbox_id].state == State.PAUSED
        await orch.shutdown()

    run(scenario)


def test_resume_failure_rolls_back_to_paused(tmp_path: Path) -> None:
    async def scenario() -> None:
        backend = ScriptedBackend()
        orch = await start(tmp_path, backend)
        rec = await create(orch)
        await orch.pause(rec.sandbox_id)
        snapshot = orch.sandboxes[rec.sandbox_id].pause_snapshot
        backend.fail("resume")
        await raises(Internal, orch.connect(rec.sandbox_id, 60))
        stored = await settled(orch, backend)
        assert stored[rec.sandbox_id].state == State.PAUSED
        assert stored[rec.sandbox_id].pause_snapshot == snapshot
        await orch.connect(rec.sandbox_id, 60)
        await settled(orch, backend)
        await orch.shutdown()

    run(scenario)


def test_resume_whose_envd_never_answers_is_rolled_back(tmp_path: Path) -> None:
    """The VM came back but envd did not: the VM is stopped again, the pause snapshot kept."""

    async def scenario() -> None:
        backend = ScriptedBackend(envd=("127.0.0.1", 9))  # nothing listens on port 9
        orch = await start(tmp_path, backend)
        rec = await create(orch)
        await orch.pause(rec.sandbox_id)
        snapshot = orch.sandboxes[rec.sandbox_id].pause_snapshot
        # From here the node checks envd itself (capabilities are resolved once, at assembly),
        # and finds none.
        orch.capabilities = dataclasses.replace(orch.capabilities, initialises_envd=False)
        await raises(Internal, orch.resume_legacy(rec.sandbox_id, 60, None))
        assert backend.called("pause") == [rec.sandbox_id] * 2  # the rollback stopped the VM
        stored = await settled(orch, backend)
        assert stored[rec.sandbox_id].state == State.PAUSED
        assert stored[rec.sandbox_id].pause_snapshot == snapshot
        await orch.shutdown()

    run(scenario)


# --- snapshots and forks -------------------------------------------------------------------------


def test_snapshot_and_its_failures(tmp_path: Path) -> None:
    async def scenario() -> None:
        backend = ScriptedBackend()
        orch = await start(tmp_path, backend)
        rec = await create(orch)
        tpl = await orch.snapshot(rec.sandbox_id, "snap-one")
        assert orch.catalogue.resolve("snap-one", LOCAL_TEAM) == tpl
        stored = {t.template_id for t in await orch.store.load_templates()}
        assert tpl.template_id in stored
        await raises(Conflict, orch.snapshot(rec.sandbox_id, "snap-one"))  # name taken
        assert len(backend.called("snapshot")) == 1  # refused before the backend was asked
        backend.fail("snapshot")
        await raises(Internal, orch.snapshot(rec.sandbox_id, None))
        assert orch.sandboxes[rec.sandbox_id].state == State.RUNNING
        await settled(orch, backend)
        backend.fail("snapshot", retryable=False)
        await raises(Internal, orch.snapshot(rec.sandbox_id, None))
        assert rec.sandbox_id not in orch.sandboxes
        assert len(orch.catalogue.of_kind("snapshot", LOCAL_TEAM)) == 1
        await settled(orch, backend)
        await orch.shutdown()

    run(scenario)


def test_fork(tmp_path: Path) -> None:
    async def scenario() -> None:
        backend = ScriptedBackend()
        orch = await start(tmp_path, backend)
        rec = await create(orch)
        backend.fork_child_errors = {1: "no slot"}
        results = await orch.fork(rec.sandbox_id, 3, 60)
        assert [r.status for r in results] == [201, 500, 201]
        assert "no slot" in (results[1].error or "")
        assert len(orch.sandboxes) == 3
        await settled(orch, backend)
        await orch.shutdown()

    run(scenario)


@pytest.mark.parametrize("retryable", [True, False])
def test_fork_failure_leaves_no_children(tmp_path: Path, retryable: bool) -> None:
    async def scenario() -> None:
        backend = ScriptedBackend()
        orch = await start(tmp_path, backend)
        rec = await create(orch)
        backend.fail("fork", retryable=retryable)
        await raises(Internal, orch.fork(rec.sandbox_id, 2, 60))
        # a retryable failure leaves the parent running; a fatal one took it
        assert list(orch.sandboxes) == ([rec.sandbox_id] if retryable else [])
        await settled(orch, backend)
        await orch.shutdown()

    run(scenario)


def test_pause_waits_for_a_snapshot_under_way(tmp_path: Path) -> None:
    async def scenario() -> None:
        backend = ScriptedBackend()
        orch = await start(tmp_path, backend)
        rec = await create(orch)
        held = backend.hold("snapshot")
        snapping = asyncio.create_task(orch.snapshot(rec.sandbox_id, None))
        await held.entered.wait()
        assert orch.sandboxes[rec.sandbox_id].state == State.SNAPSHOTTING
        pausing = asyncio.create_task(orch.pause(rec.sandbox_id))
        await asyncio.sleep(0.05)
        assert not pausing.done()  # it waits for the snapshot, then looks again
        held.release()
        await snapping
        await pausing
        stored = await settled(orch, backend)
        assert stored[rec.sandbox_id].state == State.PAUSED
        await orch.shutdown()

    run(scenario)


# --- kill --------------------------------------------------------------------------------------


def test_kill_running_paused_and_failing(tmp_path: Path) -> None:
    async def scenario() -> None:
        backend = ScriptedBackend()
        orch = await start(tmp_path, backend)
        a, b = await create(orch), await create(orch)
        await orch.pause(b.sandbox_id)
        backend.fail("kill")
        await raises(Internal, orch.kill(a.sandbox_id))
        stored = await settled(orch, backend)
        assert stored[a.sandbox_id].state == State.RUNNING  # the previous state is back
        await orch.kill(a.sandbox_id)
        paused_snapshot = orch.sandboxes[b.sandbox_id].pause_snapshot
        assert paused_snapshot is not None
        await orch.kill(b.sandbox_id)
        assert backend.called("discard_paused") == [b.sandbox_id]
        assert paused_snapshot.data["key"] not in backend.snapshots
        assert orch.sandboxes == {}
        await settled(orch, backend)
        await orch.shutdown()

    run(scenario)


def test_concurrent_kills_join(tmp_path: Path) -> None:
    async def scenario() -> None:
        backend = ScriptedBackend()
        orch = await start(tmp_path, backend)
        rec = await create(orch)
        held = backend.hold("kill")
        first = asyncio.create_task(orch.kill(rec.sandbox_id))
        await held.entered.wait()
        second = asyncio.create_task(orch.kill(rec.sandbox_id))
        await asyncio.sleep(0.02)
        assert not second.done()  # it joins the kill under way
        held.release()
        await first
        await raises(NotFound, second)
        assert backend.called("kill") == [rec.sandbox_id]
        await settled(orch, backend)
        await orch.shutdown()

    run(scenario)


def test_lost_sandbox_is_removed(tmp_path: Path) -> None:
    async def scenario() -> None:
        backend = ScriptedBackend()
        orch = await start(tmp_path, backend)
        rec = await create(orch)
        gone: list[tuple[str, str]] = []
        orch.on_leave_running(lambda sid, why: gone.append((sid, why)))
        backend.lose(rec.sandbox_id)
        await orch.wait_idle(5.0)
        await asyncio.sleep(0)  # the background task that logs the removal
        assert gone == [(rec.sandbox_id, "lost")] and orch.sandboxes == {}
        await settled(orch, backend)
        await orch.shutdown()

    run(scenario)


# --- timeouts ------------------------------------------------------------------------------------


def test_reaper_kills_or_pauses_what_timed_out(tmp_path: Path) -> None:
    async def scenario() -> None:
        backend = ScriptedBackend()
        orch = await start(tmp_path, backend, reaper_interval=0.02)
        killed = await create(orch)
        paused = await create(orch, auto_pause=True)
        kept = await create(orch)
        await orch.set_timeout(killed.sandbox_id, 0)
        await orch.set_timeout(paused.sandbox_id, 0)
        await orch.set_timeout(kept.sandbox_id, 0, shorten=False)  # never shortens
        deadline = time.monotonic() + 5
        while len(orch.sandboxes) != 2 or paused.state != State.PAUSED:
            assert time.monotonic() < deadline, orch.count_by_state()
            await asyncio.sleep(0.02)
        stored = await settled(orch, backend)
        assert stored[paused.sandbox_id].state == State.PAUSED
        assert stored[kept.sandbox_id].state == State.RUNNING
        await orch.shutdown()

    run(scenario)


@pytest.mark.parametrize("op", ["pause", "kill"])
def test_reaper_failure_keeps_the_sandbox_consistent(tmp_path: Path, op: str) -> None:
    async def scenario() -> None:
        backend = ScriptedBackend()
        orch = await start(tmp_path, backend)
        rec = await create(orch, auto_pause=op == "pause", timeout=0)
        backend.fail(op)
        assert orch.reap_once() == 1
        await settled(orch, backend)
        assert orch.sandboxes[rec.sandbox_id].state == State.RUNNING  # retried next pass
        assert orch.reap_once() == 1
        stored = await settled(orch, backend)
        if op == "pause":
            assert stored[rec.sandbox_id].state == State.PAUSED
        else:
            assert stored == {}
        await orch.shutdown()

    run(scenario)


# --- restarts and crashes ---------------------------------------------------------------------


async def crashed(orch: Orchestrator, work: Awaitable[Any]) -> None:
    """`work` ends the node process (a scripted Crash): its store connection goes with it."""
    await raises(Crash, work)
    await orch.store.close()


def test_crash_between_pause_snapshot_and_record(tmp_path: Path) -> None:
    backend = ScriptedBackend()
    ids: list[str] = []

    async def first_life() -> None:
        orch = await start(tmp_path, backend)
        rec = await create(orch, metadata={"k": "v"})
        ids.append(rec.sandbox_id)
        backend.crash("pause", after=True)  # the snapshot is written, the record is not
        await crashed(orch, orch.pause(rec.sandbox_id, memory=False))

    async def second_life() -> None:
        orch = await start(tmp_path, backend)
        assert backend.called("recover_pause") == ids
        stored = await settled(orch, backend)
        rec = stored[ids[0]]
        assert rec.state == State.PAUSED and rec.pause_mode == "filesystem"
        assert rec.pause_asked_memory is False and rec.metadata == {"k": "v"}
        await orch.connect(rec.sandbox_id, 60)
        await settled(orch, backend)
        await orch.shutdown()

    run(first_life)
    run(second_life)


def test_crash_before_the_pause_snapshot_adopts_the_vm(tmp_path: Path) -> None:
    backend = ScriptedBackend()

    async def first_life() -> None:
        orch = await start(tmp_path, backend)
        await create(orch)
        backend.crash("pause", after=False)  # the VM still runs, nothing was written
        await crashed(orch, orch.pause(next(iter(orch.sandboxes))))

    async def second_life() -> None:
        orch = await start(tmp_path, backend)
        stored = await settled(orch, backend)
        assert [r.state for r in stored.values()] == [State.RUNNING]
        await orch.shutdown()

    run(first_life)
    run(second_life)


def test_crash_mid_pause_with_the_vm_gone_and_no_snapshot(tmp_path: Path) -> None:
    backend = ScriptedBackend()

    async def first_life() -> None:
        orch = await start(tmp_path, backend)
        rec = await create(orch)
        backend.crash("pause", after=False)
        await crashed(orch, orch.pause(rec.sandbox_id))
        backend.running.clear()  # the VM died with the node

    async def second_life() -> None:
        orch = await start(tmp_path, backend)
        assert await settled(orch, backend) == {}
        await orch.shutdown()

    run(first_life)
    run(second_life)


def test_crash_mid_resume_finds_it_paused(tmp_path: Path) -> None:
    backend = ScriptedBackend()

    async def first_life() -> None:
        orch = await start(tmp_path, backend)
        rec = await create(orch)
        await orch.pause(rec.sandbox_id)
        backend.crash("resume", after=False)
        await crashed(orch, orch.connect(rec.sandbox_id, 60))

    async def second_life() -> None:
        orch = await start(tmp_path, backend)
        stored = await settled(orch, backend)
        assert [r.state for r in stored.values()] == [State.PAUSED]
        await orch.connect(next(iter(stored)), 60)
        await settled(orch, backend)
        await orch.shutdown()

    run(first_life)
    run(second_life)


def test_restart_drops_creating_records_and_orphan_vms(tmp_path: Path) -> None:
    backend = ScriptedBackend()

    async def first_life() -> None:
        orch = await start(tmp_path, backend)
        await create(orch)  # adopted at the restart
        backend.crash("create", after=True)  # record CREATING, VM started
        await crashed(orch, create(orch))
        backend.running["orphan"] = backend.running[next(iter(backend.running))]

    async def second_life() -> None:
        orch = await start(tmp_path, backend)
        stored = await settled(orch, backend)
        assert [r.state for r in stored.values()] == [State.RUNNING]
        assert "orphan" in backend.called("kill")
        await orch.shutdown()

    run(first_life)
    run(second_life)


def test_shutdown_pauses_running_sandboxes(tmp_path: Path) -> None:
    backend = ScriptedBackend()

    async def first_life() -> None:
        orch = await start(tmp_path, backend)
        await create(orch)
        await create(orch)
        await orch.shutdown()
        assert backend.running == {}
        await raises(Unavailable, create(orch))

    async def second_life() -> None:
        orch = await start(tmp_path, backend)
        stored = await settled(orch, backend)
        assert [r.state for r in stored.values()] == [State.PAUSED, State.PAUSED]
        await orch.shutdown()

    run(first_life)
    run(second_life)


def test_a_transitional_state_without_an_operation_is_refused(tmp_path: Path) -> None:
    """Never spin on a state nobody will end: 409 at once."""

    async def scenario() -> None:
        backend = ScriptedBackend()
        orch = await start(tmp_path, backend)
        rec = await create(orch)
        orch.sandboxes[rec.sandbox_id].state = State.FORKING  # as if its task had vanished
        error = await raises(Conflict, orch.pause(rec.sandbox_id))
        assert "stuck in 'forking'" in str(error)
        assert isinstance(error, ApiError) and error.status == 409
        orch.sandboxes[rec.sandbox_id].state = State.RUNNING
        await orch.shutdown()

    run(scenario)


# --- fork of a paused sandbox, rollback (issue 27) -------------------------------------------


def test_fork_of_a_paused_sandbox_keeps_it_paused_and_its_kill_waits(tmp_path: Path) -> None:
    async def scenario() -> None:
        backend = ScriptedBackend()
        orch = await start(tmp_path, backend)
        rec = await create(orch)
        await orch.pause(rec.sandbox_id)
        snapshot = rec.pause_snapshot
        held = backend.hold("fork_snapshot")
        forking = asyncio.create_task(orch.fork(rec.sandbox_id, 2, 60))
        await held.entered.wait()
        assert rec.state == State.BRANCHING and rec.state.public == "paused"
        killing = asyncio.create_task(orch.kill(rec.sandbox_id))
        await asyncio.sleep(0.05)
        assert not killing.done()  # the children read its pause snapshot: the kill waits
        held.release()
        results = await forking
        assert [r.status for r in results] == [201, 201]
        assert "resume" not in [op for op, _ in backend.calls]  # the parent never ran
        for result in results:
            assert result.record is not None
            assert result.record.parent_sandbox_id == rec.sandbox_id
            assert result.record.source == snapshot  # GC keeps the snapshot for the child
            assert result.record.sandbox_id in backend.running
        await killing
        assert rec.sandbox_id not in orch.sandboxes
        assert len(backend.running) == 2
        await orch.shutdown()

    run(scenario)


def test_rollback_rekeys_and_a_failed_one_changes_nothing(tmp_path: Path) -> None:
    async def scenario() -> None:
        backend = ScriptedBackend()
        orch = await start(tmp_path, backend)
        rec = await create(orch)
        await raises(Conflict, orch.rollback(rec.sandbox_id, None, None))  # never paused
        tpl = await orch.snapshot(rec.sandbox_id, None)
        token, placement = rec.envd_access_token, rec.placement
        backend.fail("rollback")
        await raises(Internal, orch.rollback(rec.sandbox_id, tpl.template_id, None))
        assert (rec.state, rec.envd_access_token, rec.placement) == (State.RUNNING, token,
                                                                     placement)
        await orch.rollback(rec.sandbox_id, tpl.template_id, None)
        assert rec.state == State.RUNNING and rec.envd_access_token != token
        assert rec.placement != placement and backend.running[rec.sandbox_id] == rec.placement
        # A paused sandbox rolls back to its pause and runs, re-keyed again.
        await orch.pause(rec.sandbox_id)
        token = rec.envd_access_token
        await orch.rollback(rec.sandbox_id, None, None)
        assert rec.state == State.RUNNING and rec.envd_access_token != token
        other = await create(orch)
        await raises(BadRequest, orch.rollback(other.sandbox_id, tpl.template_id, None))
        await settled(orch, backend)
        await orch.shutdown()

    run(scenario)


def test_a_node_that_died_before_the_release_releases_at_its_next_start(
        tmp_path: Path) -> None:
    """The release runs after the pause has answered; a node that dies in between releases
    the earlier pauses when it starts again, not only at the sandbox's next pause."""
    backend = ScriptedBackend()
    keys: list[str] = []

    async def first_life() -> None:
        orch = await start(tmp_path, backend)
        rec = await create(orch)
        for second in (False, True):
            if second:
                held = backend.hold("release")  # the node dies while the release waits
            await orch.pause(rec.sandbox_id)
            assert rec.pause_snapshot is not None
            keys.append(str(rec.pause_snapshot.data["key"]))
            if not second:
                await orch.wait_idle(5.0)
                await orch.connect(rec.sandbox_id, 60)
        await held.entered.wait()
        assert set(keys) <= set(backend.snapshots)  # nothing released yet
        store = orch.store
        assert isinstance(store, MortalStore)
        store.die()

    async def second_life() -> None:
        orch = await start(tmp_path, backend)
        while orch._background:
            await asyncio.wait(list(orch._background))
        assert keys[0] not in backend.snapshots and keys[1] in backend.snapshots
        rec = orch.sandboxes[next(iter(orch.sandboxes))]
        assert rec.state == State.PAUSED and rec.pause_snapshot is not None
        assert rec.pause_snapshot.data["key"] == keys[1]
        await orch.shutdown()

    run(first_life)
    run(second_life)


def test_a_running_sandboxs_rollback_is_admitted_for_its_second_vm(tmp_path: Path) -> None:
    """The new VM of a running sandbox's rollback starts before the old one stops: for that
    time the node holds two, and admission counts the second (refused when the node is full,
    held until the rollback ends)."""
    async def scenario() -> None:
        backend = ScriptedBackend()
        orch = await start(tmp_path, backend)
        orch.admission = Admission(tmp_path, max_sandboxes=2, memory_budget_mb=100_000,
                                   memory_reserve_mb=0, min_free_disk_mb=0,
                                   cpu_pressure_max=0, memory_pressure_max=0)
        rec = await create(orch)
        tpl = await orch.snapshot(rec.sandbox_id, None)
        other = await create(orch)
        refused = await raises(AdmissionRefused, orch.rollback(rec.sandbox_id, tpl.template_id,
                                                               None))
        assert isinstance(refused, AdmissionRefused)
        assert refused.limit == "max_sandboxes" and rec.state == State.RUNNING
        await orch.kill(other.sandbox_id)
        held = backend.hold("rollback")
        rolling = asyncio.create_task(orch.rollback(rec.sandbox_id, tpl.template_id, None))
        await held.entered.wait()
        # two VMs now: no room for a create until the rollback is over
        await raises(AdmissionRefused, create(orch))
        held.release()
        await rolling
        assert rec.state == State.RUNNING
        third = await create(orch)  # the reservation went with the old VM
        await orch.kill(third.sandbox_id)
        await settled(orch, backend)
        await orch.shutdown()

    run(scenario)


@pytest.mark.parametrize("after", [False, True])
def test_crash_mid_rollback_keeps_the_token_of_the_vm_found(tmp_path: Path, after: bool) -> None:
    """A node killed during a rollback: the VM the next start finds decides the token (the old
    VM: the old token; the rollback's VM: the new one), so the sandbox answers to its token."""
    backend = ScriptedBackend()
    ids: list[str] = []
    tokens: list[str] = []

    async def first_life() -> None:
        orch = await start(tmp_path, backend)
        rec = await create(orch)
        ids.append(rec.sandbox_id)
        tokens.append(rec.envd_access_token)
        tpl = await orch.snapshot(rec.sandbox_id, None)
        backend.crash("rollback", after=after)
        await crashed(orch, orch.rollback(rec.sandbox_id, tpl.template_id, None))

    async def second_life() -> None:
        orch = await start(tmp_path, backend)
        stored = await settled(orch, backend)
        rec = stored[ids[0]]
        assert rec.state == State.RUNNING
        expected = backend.rolled_back_tokens[ids[0]] if after else tokens[0]
        assert rec.envd_access_token == expected
        assert (rec.envd_access_token != tokens[0]) is after
        await orch.shutdown()

    run(first_life)
    run(second_life)
