"""Idle pause (node/idle.py) without VMs: the tracker's logic on a clock the test moves, and
the node's reaper, proxy and lifecycle calls in-process over the scripted backend
(tests/node/scripted.py), with every sandbox port answered by a real loopback HTTP server.
The reaper runs when the test calls `reap_once`; the idle clock is the test's, so "idle for
an hour" takes no time and nothing depends on timing. A WebSocket through a real node
(process backend) at the end; tests/node/test_idle_pause_vm.py does the rest with real VMs
and the official SDK."""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import Any

import pytest

from agentenv.api.errors import BadRequest, NotFound
from agentenv.api.event_models import PAUSED, RESUMED
from agentenv.node.admission import Admission
from agentenv.node.events import Event, EventLog
from agentenv.node.idle import IDLE_PAUSE_METADATA, IdleTracker, idle_setting
from agentenv.node.orchestrator import Orchestrator
from agentenv.node.records import State
from tests.node.conftest import NodeProcess, free_host_port, ws_echo_server
from tests.node.test_proxy_admission_inprocess import STREAMING, Node, at, limits, run
from tests.node.test_proxy_admission_inprocess import node as inprocess_node


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_tracker_counts_open_exchanges_and_the_last_one_that_reached_the_sandbox() -> None:
    clock = Clock()
    tracker = IdleTracker(clock)
    assert tracker.idle_for("a") == 0  # the first question starts the clock
    clock.now += 7
    assert tracker.idle_for("a") == 7
    tracker.opened("a")
    tracker.opened("a")
    clock.now += 100
    assert tracker.idle_for("a") == 0  # busy however long the exchanges last
    tracker.closed("a", active=True)
    assert tracker.idle_for("a") == 0  # one is still open
    tracker.closed("a", active=True)
    clock.now += 3
    assert tracker.idle_for("a") == 3  # counted from the end of the last to close
    tracker.opened("a")
    clock.now += 50
    tracker.closed("a", active=False)  # refused: not activity
    assert tracker.idle_for("a") == 53
    tracker.touch("a")
    assert tracker.idle_for("a") == 0
    clock.now += 9
    tracker.restart("a")  # paused: the clock starts again at its next run
    clock.now += 20
    assert tracker.idle_for("a") == 0
    clock.now += 1
    tracker.touch("gone")
    tracker.retain({"a"})
    assert tracker.idle_for("a") == 1 and "gone" not in tracker._last


def test_idle_setting_comes_from_the_body_metadata_template_then_node() -> None:
    meta = {IDLE_PAUSE_METADATA: "30"}
    assert idle_setting(5, meta, 60, 90, 3600) == 5
    assert idle_setting(0, meta, 60, 90, 3600) == 0  # the body turns it off
    assert idle_setting(None, meta, 60, 90, 3600) == 30
    assert idle_setting(None, {}, 60, 90, 3600) == 60
    assert idle_setting(None, {}, None, 90, 3600) == 90
    for bad in ("-1", "1.5", "soon", "", "99999"):
        with pytest.raises(BadRequest, match=f"metadata {IDLE_PAUSE_METADATA}"):
            idle_setting(None, {IDLE_PAUSE_METADATA: bad}, None, 0, 3600)
    for wrong in (-1, 3601, True):
        with pytest.raises(BadRequest, match="idlePauseAfter must be a whole number"):
            idle_setting(wrong, {}, None, 0, 3600)


class Collected:
    """An event sink that keeps what the node's event log stored."""

    def __init__(self) -> None:
        self.events: list[Event] = []

    async def start(self) -> None:
        pass

    async def stop(self) -> None:
        pass

    def offer(self, event: Event) -> None:
        self.events.append(event)

    def of(self, sandbox_id: str, kind: str) -> list[dict[str, Any]]:
        return [e.data or {} for e in self.events if e.sandbox_id == sandbox_id
                and e.type == kind]


@contextlib.asynccontextmanager
async def idle_node(tmp_path: Path, admission: Admission | None = None) -> Any:
    """The in-process node with a clock the test moves, and its events collected."""
    async with inprocess_node(tmp_path, admission) as n:
        clock = Clock()
        n.orch.activity = IdleTracker(clock)
        collected = Collected()
        n.orch.events = EventLog(n.orch.store, "node-test", 3600)
        n.orch.events.sinks.append(collected)
        await n.orch.events.start()
        try:
            yield n, clock, collected
        finally:
            await n.orch.events.stop()


async def settle(orch: Orchestrator, sandbox_id: str, state: State) -> None:
    """Wait (bounded by the scenario's limit) until the sandbox's operation is over in `state`."""
    while orch.sandboxes[sandbox_id].state != state or sandbox_id in orch._ops:
        await asyncio.sleep(0.01)


async def events_stored(collected: Collected, sandbox_id: str, kind: str, count: int) -> None:
    while len(collected.of(sandbox_id, kind)) < count:
        await asyncio.sleep(0.01)


async def idle_pause(n: Node, clock: Clock, sid: str, after: int) -> None:
    """Let the sandbox idle for `after` seconds of the test's clock: it is paused."""
    n.orch.reap_once()  # starts its clock, if nothing did
    clock.now += after
    n.orch.reap_once()
    await settle(n.orch, sid, State.PAUSED)


def test_idle_sandbox_pauses_and_any_request_resumes_it_transparently(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with idle_node(tmp_path) as (n, clock, collected):
            sid = await n.create(idle_pause_after=5, timeout=600)
            other = await n.create()  # no idle pause: E2B's default
            rec = n.orch.sandboxes[sid]
            end_at = rec.end_at
            n.orch.reap_once()
            clock.now += 4.9
            n.orch.reap_once()
            assert rec.state == State.RUNNING
            clock.now += 0.2
            n.orch.reap_once()
            await settle(n.orch, sid, State.PAUSED)
            assert n.orch.sandboxes[other].state == State.RUNNING
            assert rec.pause_reason == "idle" and n.orch.counters.idle_pauses == 1
            await events_stored(collected, sid, PAUSED, 1)
            assert collected.of(sid, PAUSED)[0]["reason"] == "idle"

            # A request to envd resumes it and goes through; endAt is as it was.
            answer = await n.client.get(at(sid) + "/files?path=/a", headers=n.envd(sid))
            assert answer.status_code == 200 and answer.json()["path"] == "/files"
            assert rec.state == State.RUNNING and rec.end_at == end_at
            assert n.orch.counters.idle_resumes == 1
            await events_stored(collected, sid, RESUMED, 1)
            assert collected.of(sid, RESUMED)[0]["idle_pause"] is True

            # A request to another port of it too.
            await idle_pause(n, clock, sid, 5)
            answer = await n.client.get("/app", headers={"E2b-Sandbox-Id": sid,
                                                         "E2b-Sandbox-Port": str(n.port)})
            assert answer.status_code == 200 and answer.json()["path"] == "/app"
            assert n.backend.called("resume") == [sid, sid]
            assert n.orch.counters.idle_resumes == 2

            # A request envd would refuse neither resumes it nor counts as activity.
            await idle_pause(n, clock, sid, 5)
            refused = await n.client.get(at(sid) + "/health")
            assert refused.status_code == 401 and rec.state == State.PAUSED
            assert len(n.backend.called("resume")) == 2

    run(scenario)


def test_open_streams_keep_a_sandbox_running_and_refusals_do_not(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with idle_node(tmp_path) as (n, clock, _):
            sid = await n.create(idle_pause_after=5)
            n.orch.reap_once()
            stream = asyncio.create_task(n.client.get(at(sid) + f"/stream?{sid}",
                                                      headers=n.envd(sid)))
            while sid not in STREAMING:
                assert not stream.done(), stream
                await asyncio.sleep(0.01)
            clock.now += 3600  # an hour of a command streaming (or a WebSocket open)
            n.orch.reap_once()
            assert n.orch.sandboxes[sid].state == State.RUNNING
            stream.cancel()  # the client goes away: the exchange ends now
            with contextlib.suppress(asyncio.CancelledError):
                await stream
            assert n.app.proxy.connections(sid) == 0
            clock.now += 4
            n.orch.reap_once()
            assert n.orch.sandboxes[sid].state == State.RUNNING  # idle since the stream ended
            # requests envd would refuse (no token) keep nothing awake
            for _ in range(3):
                assert (await n.client.get(at(sid) + "/envs")).status_code == 401
            clock.now += 1
            n.orch.reap_once()
            await settle(n.orch, sid, State.PAUSED)

    run(scenario)


def test_lifecycle_calls_on_an_idle_paused_sandbox(tmp_path: Path) -> None:
    """It runs as far as its caller knows: a timeout can be set, a snapshot taken (it wakes
    up), a connect extends it; the caller's own pause makes the pause the caller's; at its
    endAt what a timeout does happens."""
    async def scenario() -> None:
        async with idle_node(tmp_path) as (n, clock, collected):
            sid = await n.create(idle_pause_after=5, timeout=600)
            rec = n.orch.sandboxes[sid]
            await idle_pause(n, clock, sid, 5)
            await n.orch.set_timeout(sid, 900)
            assert rec.state == State.PAUSED and rec.end_at > time.time() + 800
            snapshot = await n.orch.snapshot(sid, None)  # wakes it
            assert rec.state == State.RUNNING and snapshot.idle_pause_after == 5
            await idle_pause(n, clock, sid, 5)
            _, resumed = await n.orch.connect(sid, 1200)
            assert resumed and rec.state == State.RUNNING and rec.end_at > time.time() + 1100
            await idle_pause(n, clock, sid, 5)
            await n.orch.pause(sid)  # the caller's pause now: 204, no 409
            assert rec.pause_reason == "request" and rec.state == State.PAUSED
            await events_stored(collected, sid, PAUSED, 4)
            assert collected.of(sid, PAUSED)[-1]["reason"] == "request"
            # no autoResume: traffic no longer resumes it, the caller paused it
            gone = await n.client.get(at(sid) + "/health", headers=n.envd(sid))
            assert gone.status_code == 502
            with pytest.raises(NotFound):
                await n.orch.set_timeout(sid, 900)

            # endAt reached while idle-paused: killed (no autoPause) ...
            killed = await n.create(idle_pause_after=5)
            await idle_pause(n, clock, killed, 5)
            n.orch.sandboxes[killed].end_at = time.time() - 1
            assert n.orch.reap_once() == 1
            while killed in n.orch.sandboxes:
                await asyncio.sleep(0.01)
            # ... or with autoPause, its pause becomes the timeout's: traffic no longer resumes
            kept = await n.create(idle_pause_after=5, auto_pause=True)
            await idle_pause(n, clock, kept, 5)
            n.orch.sandboxes[kept].end_at = time.time() - 1
            assert n.orch.reap_once() == 1
            assert n.orch.sandboxes[kept].pause_reason == "timeout"
            assert (await n.client.get(at(kept) + "/health", headers=n.envd(kept))
                    ).status_code == 502
            while True:  # the record is written in the background
                stored = {r.sandbox_id: r for r in await n.orch.store.load_sandboxes()}
                if stored[kept].pause_reason == "timeout":
                    break
                await asyncio.sleep(0.01)
            assert killed not in stored

    run(scenario)


def test_a_resume_the_node_cannot_take_on_is_a_429_not_a_lost_sandbox(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with idle_node(tmp_path, limits(tmp_path, max_sandboxes=1)) as (n, clock, _):
            sid = await n.create(idle_pause_after=5)
            await idle_pause(n, clock, sid, 5)
            other = await n.create()  # the node is full now
            answer = await n.client.get(at(sid) + "/health", headers=n.envd(sid))
            assert answer.status_code == 429 and "AENV_MAX_SANDBOXES" in answer.text
            assert n.orch.sandboxes[sid].state == State.PAUSED
            await n.orch.kill(other)
            answer = await n.client.get(at(sid) + "/health", headers=n.envd(sid))
            assert answer.status_code == 200 and n.orch.sandboxes[sid].state == State.RUNNING

    run(scenario)


def test_the_setting_of_a_create(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with idle_node(tmp_path) as (n, _, _):
            by_meta = await n.create(metadata={IDLE_PAUSE_METADATA: "7"})
            assert n.orch.sandboxes[by_meta].idle_pause_after == 7
            assert n.orch.sandboxes[await n.create()].idle_pause_after == 0  # off by default
            with pytest.raises(BadRequest, match=IDLE_PAUSE_METADATA):
                await n.create(metadata={IDLE_PAUSE_METADATA: "a while"})
            n.orch.config.idle_pause_after = 40  # aenv serve --idle-pause-after
            assert n.orch.sandboxes[await n.create()].idle_pause_after == 40
            assert len(n.orch.sandboxes) == 3  # the refused create left nothing
            body = {"templateID": "base", "idlePauseAfter": 12}
            headers = {"X-API-KEY": "test-api-key-0123456789"}
            made = await n.client.post("/v2/sandboxes", json=body, headers=headers)
            assert made.status_code == 201, made.text
            detail = (await n.client.get(f"/sandboxes/{made.json()['sandboxID']}",
                                         headers=headers)).json()
            assert detail["lifecycle"]["idlePauseAfter"] == 12
            bad = await n.client.post("/v2/sandboxes", json=body | {"idlePauseAfter": -3},
                                      headers=headers)
            assert bad.status_code == 400 and "idlePauseAfter" in bad.json()["message"]

    run(scenario)


def test_an_open_websocket_keeps_it_running_and_a_new_one_resumes_it(node: NodeProcess) -> None:
    from websockets.sync.client import connect

    from tests.node.test_lifecycle import wait_for

    port = free_host_port()
    stop = ws_echo_server(port)
    with node.client() as api:
        sid = api.post("/v2/sandboxes", json={"timeout": 120, "idlePauseAfter": 1}).json()[
            "sandboxID"]
        try:
            def state() -> str:
                return str(api.get(f"/sandboxes/{sid}").json()["state"])

            def idle_pauses() -> int:
                return sum(e["type"] == PAUSED and e["eventData"]["reason"] == "idle"
                           for e in api.get(f"/events/sandboxes/{sid}",
                                            params={"limit": 100}).json())

            route = {"E2b-Sandbox-Id": sid, "E2b-Sandbox-Port": str(port)}
            ws_url = node.url.replace("http", "ws", 1) + "/echo"
            with connect(ws_url, additional_headers=route) as ws:
                ws.send("first")
                assert ws.recv() == "first"
                # Silent for 4 x its idlePauseAfter (the reaper looks every second): it must
                # not pause under an open WebSocket. (Only a missing reaper pass could hide a
                # pause here; a loaded host makes one less likely, never more.)
                began = time.monotonic()
                while time.monotonic() - began < 4:
                    assert state() == "running"
                    time.sleep(0.5)
                ws.send("still there")
                assert ws.recv() == "still there"
            assert idle_pauses() == 0
            # closed: idle from then on (the event is stored just after the pause)
            wait_for(lambda: state() == "paused" and idle_pauses() == 1)
            with connect(ws_url, additional_headers=route) as ws:  # resumes it
                ws.send("again")
                assert ws.recv() == "again"
                assert state() == "running"
            metrics = api.get("/metrics").text
            assert "aenv_node_idle_pauses_total" in metrics
            assert "aenv_node_idle_resumes_total" in metrics
        finally:
            api.delete(f"/sandboxes/{sid}")
            stop()


def test_hostile_metadata_values_are_a_400_naming_the_key(tmp_path: Path) -> None:
    """Red team (2026-12-06): `str.isdigit` holds for '²' (and int() refuses it) and for a
    number of more digits than int() parses: the metadata key of an unchanged SDK made the
    create a 500 instead of a 400 naming it."""
    async def scenario() -> None:
        async with idle_node(tmp_path) as (n, _, _):
            for value in ("²", "9" * 5000, "٣"):  # the last is an Arabic-Indic 3
                with pytest.raises(BadRequest, match=IDLE_PAUSE_METADATA):
                    await n.create(metadata={IDLE_PAUSE_METADATA: value})
            assert n.orch.sandboxes == {}  # nothing half-made
            headers = {"X-API-KEY": "test-api-key-0123456789"}
            bad = await n.client.post("/v2/sandboxes", headers=headers, json={
                "templateID": "base", "metadata": {IDLE_PAUSE_METADATA: "²"}})
            assert bad.status_code == 400, bad.text
            assert IDLE_PAUSE_METADATA in bad.json()["message"]

    run(scenario)


def test_a_strangers_health_checks_do_not_keep_a_secure_sandbox_awake(tmp_path: Path) -> None:
    """Red team (2026-12-06): a body-less `/health` is the one envd request of a secure
    sandbox the proxy lets through without its token, and it counted as the sandbox's
    activity: a stranger who knew the id polled it and the sandbox never idled out."""
    async def scenario() -> None:
        async with idle_node(tmp_path) as (n, clock, _):
            sid = await n.create(idle_pause_after=5)
            n.orch.reap_once()
            first = await n.client.get(at(sid) + "/health")
            assert first.status_code < 400, first.text  # let through: envd answers it
            for _ in range(10):
                clock.now += 1
                await n.client.get(at(sid) + "/health")  # no token: a stranger's
                n.orch.reap_once()
            await asyncio.wait_for(settle(n.orch, sid, State.PAUSED), 60)

    run(scenario)
