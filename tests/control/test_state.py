"""Bindings and liveness: reconciliation both ways, down after 3 missed heartbeats and back,
a scheduler killed with -9 and restarted, Redis killed and restarted (AOF)."""

from __future__ import annotations

import asyncio
import signal
import time
from pathlib import Path

import grpc
import pytest
from redis.exceptions import TimeoutError as RedisTimeout

from agentenv.control.scheduler.store import Binding, Store
from agentenv.scheduling.client import SchedulerError
from tests.control.conftest import RedisServer, SchedulerProcess
from tests.control.helpers import ClusterClient, scheduler, status


def test_reconciliation_both_ways(redis_server: RedisServer, prefix: str) -> None:
    async def body() -> None:
        async with scheduler(redis_server.url, prefix, reconcile_grace_s=0.3) as (_, client):
            await client.heartbeat(status("n1"))
            await client.heartbeat(status("n2"))
            await client.record_assignment("gone", "n1", team_id="t")
            await client.record_assignment("moved", "n1", team_id="t")
            await client.record_assignment("released", "n1")
            await asyncio.sleep(0.4)
            await client.record_assignment("fresh", "n1")  # younger than the grace
            await client.release("released")
            # n1's list predates "fresh" and the release; "gone" ended on the node.
            await client.heartbeat(
                status("n1", sandboxes=[("new", "team-b"), "released", "moved"])
            )
            assert await client.lookup("gone") is None  # binding without sandbox: dropped
            new = await client.lookup("new")  # sandbox without binding: added, with its team
            assert new is not None and (new.node_id, new.team_id) == ("n1", "team-b")
            assert await client.lookup("fresh") is not None  # within the grace: kept
            assert await client.lookup("released") is None  # released within the grace
            # Another node's claim on it (older than the grace) moves nothing (nor once n1 is
            # down: tests/control/test_scheduler_auth.py); only RecordAssignment moves.
            await client.heartbeat(status("n2", sandboxes=["moved"]))
            moved = await client.lookup("moved")
            assert moved is not None and (moved.node_id, moved.team_id) == ("n1", "t")
            await asyncio.sleep(0.4)
            await client.heartbeat(status("n1", sandboxes=["new"]))
            assert await client.lookup("fresh") is None  # the grace is over
            assert await client.lookup("moved") is None  # n1 no longer has it

    asyncio.run(body())


def test_steady_heartbeats_skip_reconciliation_until_a_change(
    redis_server: RedisServer, prefix: str
) -> None:
    async def body() -> None:
        async with scheduler(redis_server.url, prefix, reconcile_grace_s=0.3) as (srv, client):
            listed = ["a", ("b", "t")]
            await client.heartbeat(status("n1", sandboxes=listed))
            view = srv.service.views["n1"]
            await asyncio.sleep(0.35)
            await client.heartbeat(status("n1", sandboxes=listed))  # full: within the grace
            reconciled = view.reconciled_ms
            await client.heartbeat(status("n1", sandboxes=listed))
            assert view.reconciled_ms == reconciled  # same list, nothing changed: skipped
            await client.record_assignment("x", "n1")
            await client.heartbeat(status("n1", sandboxes=listed))
            assert view.reconciled_ms > reconciled  # a change: reconciled again
            assert await client.lookup("x") is not None  # young: kept
            await asyncio.sleep(0.35)
            await client.heartbeat(status("n1", sandboxes=listed))
            assert await client.lookup("x") is None  # the node does not have it: dropped
            await client.release("b")
            await asyncio.sleep(0.35)
            await client.heartbeat(status("n1", sandboxes=listed))
            assert (await client.lookup("b")).team_id == "t"  # type: ignore[union-attr]
            # A changed list is always reconciled (b's re-added binding has aged past the grace).
            await asyncio.sleep(0.35)
            await client.heartbeat(status("n1", sandboxes=["a"]))
            assert await client.lookup("b") is None

    asyncio.run(body())


def test_down_after_three_missed_heartbeats_and_back(
    redis_server: RedisServer, prefix: str
) -> None:
    async def body() -> None:
        async with scheduler(redis_server.url, prefix, heartbeat_interval_s=0.2) as (_, client):
            assert await client.heartbeat(status("n1", templates=["base"])) == 0.2
            await client.record_assignment("s1", "n1")
            started = time.monotonic()
            await asyncio.sleep(0.5)  # 2 missed: still up
            assert (await client.lookup("s1")).node_up  # type: ignore[union-attr]
            await asyncio.sleep(max(0.0, 0.8 - (time.monotonic() - started)))  # 4 missed
            where = await client.lookup("s1")
            assert where is not None and where.node_id == "n1" and not where.node_up
            nodes = await client.list_nodes()
            assert not nodes[0].up and nodes[0].down_reason.startswith("no heartbeat for")
            with pytest.raises(SchedulerError) as caught:
                await client.schedule(template_id="base")
            assert caught.value.code == grpc.StatusCode.UNAVAILABLE
            assert "n1: down (no heartbeat for" in caught.value.details
            await client.heartbeat(status("n1", templates=["base"], sandboxes=["s1"]))
            assert (await client.lookup("s1")).node_up  # type: ignore[union-attr]
            assert (await client.schedule(template_id="base")).node_id == "n1"

    asyncio.run(body())


BINDINGS = 300


def test_scheduler_kill9_restart_keeps_every_binding(
    redis_server: RedisServer, prefix: str, tmp_path: Path
) -> None:
    sched = SchedulerProcess(redis_server.url, prefix, tmp_path / "scheduler.log",
                             "--heartbeat-interval", "1")

    async def fill() -> None:
        async with ClusterClient(sched.address) as client:
            for n in range(3):
                await client.heartbeat(status(f"n{n}", templates=["base"]))
            await asyncio.gather(*(
                client.record_assignment(f"s{i}", f"n{i % 3}", team_id=f"t{i % 2}")
                for i in range(BINDINGS)
            ))
            for n in range(3):  # just before the kill
                await client.heartbeat(status(f"n{n}", templates=["base"], sandboxes=[
                    f"s{i}" for i in range(n, BINDINGS, 3)]))

    async def check() -> None:
        async with ClusterClient(sched.address) as client:
            found = await asyncio.gather(*(client.lookup(f"s{i}") for i in range(BINDINGS)))
            for i, where in enumerate(found):
                assert where is not None, f"s{i} lost"
                assert (where.node_id, where.team_id) == (f"n{i % 3}", f"t{i % 2}")
                # Away 4 s (> 3.5 intervals): the outage is not held against the nodes.
                assert where.node_up, f"s{i}: node reported down right after the restart"
            placement = await client.schedule(template_id="base")
            assert placement.node_id in ("n0", "n1", "n2")

    try:
        sched.start()
        asyncio.run(fill())
        sched.kill9()
        time.sleep(4)
        sched.start()
        asyncio.run(check())
    finally:
        sched.stop()


def test_redis_restart_loses_nothing(redis_server: RedisServer, prefix: str) -> None:
    async def body() -> None:
        async with scheduler(redis_server.url, prefix) as (_, client):
            await client.heartbeat(status("n1"))
            for i in range(50):
                await client.record_assignment(f"s{i}", "n1", team_id="t")
            await client.release("s0")
            redis_server.kill()  # -9: only the AOF (fsync always) keeps the writes
            # Routing goes on from memory; changes are refused until Redis is back.
            assert (await client.lookup("s1")).node_id == "n1"  # type: ignore[union-attr]
            with pytest.raises(SchedulerError) as caught:
                await client.record_assignment("s50", "n1")
            assert caught.value.code == grpc.StatusCode.UNAVAILABLE
            assert "Redis is unavailable" in caught.value.details
            redis_server.start()
            await client.record_assignment("s50", "n1")
        # A fresh scheduler reads everything back from the restarted Redis.
        async with scheduler(redis_server.url, prefix) as (_, client):
            assert await client.lookup("s0") is None
            for i in range(1, 51):
                where = await client.lookup(f"s{i}")
                assert where is not None and where.node_id == "n1" and where.node_up, i
            assert len(await client.list_nodes()) == 1

    try:
        asyncio.run(body())
    finally:
        if redis_server.proc is None or redis_server.proc.poll() is not None:
            redis_server.start()


def test_lookup_answers_while_redis_is_stalled(redis_server: RedisServer, prefix: str) -> None:
    """Redis stopped (SIGSTOP, not gone): writes wait for it (more of them than any thread pool
    of the server holds), Lookup and Schedule still answer from memory at once, and the writes
    complete when Redis resumes."""
    assert redis_server.proc is not None

    async def body() -> None:
        async with scheduler(redis_server.url, prefix) as (_, client):
            await client.heartbeat(status("n1", cpu=256, mem=1 << 20))
            await client.record_assignment("s1", "n1")
            redis_server.proc.send_signal(signal.SIGSTOP)  # type: ignore[union-attr]
            try:
                writes = [asyncio.create_task(client.record_assignment(f"w{i}", "n1"))
                          for i in range(64)]
                await asyncio.sleep(0.2)
                began = time.monotonic()
                for _ in range(20):
                    where = await client.lookup("s1", timeout=2)
                    assert where is not None and where.node_id == "n1"
                    placed = await client.schedule(template_id="base", timeout=2)
                    assert placed.node_id == "n1"
                assert time.monotonic() - began < 2
                assert not any(w.done() for w in writes)
                # A write does not wait for ever: past the store's timeout it fails.
                impatient = Store(redis_server.url, prefix, timeout=0.5)
                try:
                    with pytest.raises(RedisTimeout):
                        await asyncio.to_thread(impatient.record, Binding("x", "n1", "", 0, 1, 1))
                finally:
                    impatient.close()
            finally:
                redis_server.proc.send_signal(signal.SIGCONT)  # type: ignore[union-attr]
            await asyncio.gather(*writes)
            assert all(await asyncio.gather(*(client.lookup(f"w{i}") for i in range(64))))

    asyncio.run(body())
