"""Every placement strategy, through the scheduler's RPCs (real Redis)."""

from __future__ import annotations

import asyncio
from collections import Counter

import grpc
import pytest

from agentenv.control.gateway import placement
from agentenv.control.gateway.placement import Binding, Node, NoPlacement, SchedulerLink
from agentenv.scheduling.client import Credentials, SchedulerError
from tests.control.conftest import RedisServer
from tests.control.helpers import SECRET, scheduler, status


def test_round_robin_cycles_over_fitting_nodes(redis_server: RedisServer, prefix: str) -> None:
    async def body() -> None:
        async with scheduler(redis_server.url, prefix, strategy="round-robin") as (_, client):
            for name in ("a", "b", "c"):
                await client.heartbeat(status(name))
            await client.heartbeat(status("full", cpu_free=0))
            chosen = [(await client.schedule(template_id="base")).node_id for _ in range(6)]
            assert chosen == ["a", "b", "c", "a", "b", "c"]

    asyncio.run(body())


def test_random_spreads(redis_server: RedisServer, prefix: str) -> None:
    async def body() -> None:
        async with scheduler(redis_server.url, prefix, strategy="random") as (_, client):
            for name in ("a", "b", "c"):
                await client.heartbeat(status(name, cpu=1000, mem=1 << 20))
            counts = Counter(
                [(await client.schedule(template_id="base")).node_id for _ in range(150)]
            )
            assert set(counts) == {"a", "b", "c"}
            assert min(counts.values()) > 20, counts  # P(false failure) is astronomically small

    asyncio.run(body())


def test_a_node_that_gains_or_drops_a_template_counts_at_once(
    redis_server: RedisServer, prefix: str
) -> None:
    """The template's holders are remembered between Schedules (with the up nodes, 100 ms), and
    a heartbeat that changes a node's templates is seen by the very next Schedule."""
    async def body() -> None:
        async with scheduler(redis_server.url, prefix) as (_, client):
            await client.heartbeat(status("a"))
            await client.heartbeat(status("b", cpu_free=8))
            for _ in range(2):
                placed = await client.schedule(template_id="base")
                assert not placed.reason.startswith("cache"), placed.reason
            await client.heartbeat(status("b", cpu_free=8, templates=["base"]))
            placed = await client.schedule(template_id="base")
            assert (placed.node_id, placed.reason) == ("b", "cache: holds the template")
            await client.heartbeat(status("b", cpu_free=8))
            placed = await client.schedule(template_id="base")
            assert not placed.reason.startswith("cache"), placed.reason

    asyncio.run(body())


def test_least_loaded_counts_placements_between_heartbeats(
    redis_server: RedisServer, prefix: str
) -> None:
    async def body() -> None:
        async with scheduler(redis_server.url, prefix, strategy="least-loaded") as (_, client):
            await client.heartbeat(status("busy", cpu=16, cpu_free=4))
            await client.heartbeat(status("idle", cpu=16))
            first = await client.schedule(template_id="base", vcpus=4, memory_mib=512)
            assert (first.node_id, first.reason) == ("idle", "least-loaded")
            # Placed but not yet in a heartbeat: idle fills until it is as loaded as busy
            # (12 of 16 vCPUs used), then they alternate.
            chosen = [(await client.schedule(template_id="base", vcpus=4)).node_id
                      for _ in range(3)]
            assert chosen == ["idle", "idle", "busy"]
            # Recording keeps the count (until the node's own heartbeat lists the sandbox).
            await client.record_assignment("s1", "idle", vcpus=4, memory_mib=512)
            # busy: 0 free now; idle: 4 free (16 - 3 pending x 4) -> 4 more fit on idle only
            assert (await client.schedule(template_id="base", vcpus=4)).node_id == "idle"
            with pytest.raises(SchedulerError) as caught:
                await client.schedule(template_id="base", vcpus=4)
            assert caught.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "busy: cpu: 0 free vCPUs < 4" in caught.value.details
            assert "idle: cpu: 0 free vCPUs < 4" in caught.value.details
            assert caught.value.refused == {"cpu": 2}

    asyncio.run(body())


def test_cache_aware_prefers_template_then_layers_then_load(
    redis_server: RedisServer, prefix: str
) -> None:
    async def body() -> None:
        async with scheduler(redis_server.url, prefix) as (_, client):
            layers = ["sha256:l1", "sha256:l2", "sha256:l3", "sha256:l4"]
            await client.heartbeat(status("holder", cpu=16, cpu_free=2, templates=["py"],
                                          template_layers={"py": layers}, layers=layers))
            await client.heartbeat(status("half", cpu=16, cpu_free=8, layers=layers[:2]))
            await client.heartbeat(status("quarter", cpu=16, layers=layers[:1]))
            await client.heartbeat(status("empty", cpu=16))
            first = await client.schedule(template_id="py", vcpus=2)
            assert (first.node_id, first.reason) == ("holder", "cache: holds the template")
            # holder is full now (2 vCPUs were free): the most layers wins next, load aside.
            second = await client.schedule(template_id="py", vcpus=2)
            assert (second.node_id, second.reason) == ("half", "cache: holds 50% of the layers")
            # layers given by the caller count as well as learnt ones
            third = await client.schedule(template_id="other", layers=layers[:1], vcpus=2)
            assert third.node_id == "quarter"
            # nothing held anywhere: ties broken by load (empty and quarter idle; by id)
            fourth = await client.schedule(template_id="unknown", vcpus=2)
            assert fourth.node_id in ("empty", "quarter")
            assert fourth.reason.startswith("least-loaded")

    asyncio.run(body())


def test_never_a_full_node_by_count_memory_or_disk(redis_server: RedisServer, prefix: str) -> None:
    async def body() -> None:
        async with scheduler(redis_server.url, prefix) as (_, client):
            await client.heartbeat(status("count", templates=["base"], max_sandboxes=1,
                                          sandboxes=["x"]))
            await client.heartbeat(status("memory", templates=["base"], mem_free=100))
            await client.heartbeat(status("disk", templates=["base"], disk_free=10 << 20))
            with pytest.raises(SchedulerError) as caught:
                await client.schedule(template_id="base")
            text = caught.value.details
            assert "count: sandboxes: full (1 sandboxes)" in text
            assert "memory: memory: 100 MiB free < 512 MiB" in text
            assert "disk: disk: 10 MiB free < 512 MiB" in text
            assert caught.value.refused == {"sandboxes": 1, "memory": 1, "disk": 1}
            await client.heartbeat(status("ok"))
            assert (await client.schedule(template_id="base")).node_id == "ok"

    asyncio.run(body())


def test_fork_goes_to_source_and_snapshot_to_holder(redis_server: RedisServer, prefix: str) -> None:
    async def body() -> None:
        async with scheduler(redis_server.url, prefix, strategy="round-robin") as (_, client):
            await client.heartbeat(status("a", templates=["base"]))
            await client.heartbeat(status("b", templates=["base"], snapshots=["snap-1"]))
            await client.heartbeat(status("c", templates=["base"]))
            await client.record_assignment("src", "c")
            for _ in range(4):
                fork = await client.schedule(source_sandbox_id="src", template_id="base")
                assert (fork.node_id, fork.reason) == ("c", "fork source")
            for strategy in ("round-robin", "random", "least-loaded", "cache-aware"):
                resume = await client.schedule(snapshot_id="snap-1", strategy=strategy)
                assert resume.node_id == "b", strategy
            # The source's node full: the fork is refused, not sent elsewhere.
            await client.heartbeat(status("c", cpu_free=1, sandboxes=["src"]))
            with pytest.raises(SchedulerError) as caught:
                await client.schedule(source_sandbox_id="src", vcpus=2)
            assert caught.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "on node c, which cannot take 2 vCPUs" in caught.value.details

    asyncio.run(body())


def test_the_gateway_tells_a_team_no_other_nodes_load(redis_server: RedisServer, prefix: str) -> None:
    """"No room" names every node's free vCPUs and memory (other teams' load) and "no node up"
    every node's state: the scheduler's callers may read that, a team through the gateway may
    not. It gets a summary; the detail stays for the gateway's log."""
    async def body() -> None:
        async with scheduler(redis_server.url, prefix) as (server, client):
            link = SchedulerLink(f"127.0.0.1:{server.port}", Credentials.gateway(SECRET))
            try:
                await client.heartbeat(status("victim-node", templates=["base"], mem_free=100))
                with pytest.raises(NoPlacement) as full:
                    await link.schedule(template="base")
                await client.record_assignment("src", "victim-node")
                with pytest.raises(NoPlacement) as fork:
                    await link.schedule(template="base", source="src")
                with pytest.raises(NoPlacement) as snapshot:
                    await link.schedule(snapshot="snap-x")
            finally:
                await link.close()
            for refused in (full.value, fork.value):
                assert "victim-node" not in str(refused) and "MiB free" not in str(refused)
                assert "victim-node" in refused.detail and "MiB free" in refused.detail
            # the resource and the size asked (the team's own), not which node or how full
            assert str(full.value) == ("no node has room for 2 vCPUs and 512 MiB now (memory: "
                                       "1 node); try again later")
            assert str(fork.value) == ("the fork source's node has no room for 2 vCPUs and "
                                       "512 MiB now (memory: 1 node)")
            # what names only the caller's own ids stays as the scheduler said it
            assert str(snapshot.value) == "no node holds snapshot 'snap-x'"

    asyncio.run(body())


def test_a_node_fits_as_it_admits_overhead_disk_floor_and_template_size(
    redis_server: RedisServer, prefix: str
) -> None:
    """A node's free figures are in its own units (node/admission.py room): its per-sandbox
    memory overhead counts beside the guest's, its free-disk floor beside the scheduler's, a
    template's size as its holders report it; the refusal names what bounds the node."""
    async def body() -> None:
        async with scheduler(redis_server.url, prefix) as (_, client):
            # 1000 MiB free: 512 + 64 + 2 x 4 = 584 fits once, not twice
            await client.heartbeat(status(
                "n1", mem=1000, overhead=(64, 4),
                bounds=("14 x 2 host CPUs, AENV_CPU_REQUEST_RATIO",
                        "5 x 200 MiB host memory, AENV_MEMORY_REQUEST_RATIO")))
            await client.schedule(template_id="base")
            with pytest.raises(SchedulerError) as caught:
                await client.schedule(template_id="base")
            assert caught.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert ("n1: memory: 416 MiB free < 584 MiB (5 x 200 MiB host memory, "
                    "AENV_MEMORY_REQUEST_RATIO)") in caught.value.details
            assert (caught.value.refused, caught.value.request) == (
                {"memory": 1}, "2 vCPUs and 512 MiB")
            # a floor above the scheduler's --min-disk-free-mib is the node's
            await client.heartbeat(status("n2", disk_free=800 << 20, disk_floor=1 << 30))
            with pytest.raises(SchedulerError) as caught:
                await client.schedule(template_id="base", strategy="least-loaded")
            assert "n2: disk: 800 MiB free < 1024 MiB" in caught.value.details
            # a template's size as its holders report it, when the request names none
            await client.heartbeat(status("n3", cpu=16, cpu_free=6, templates=["big"],
                                          template_sizes={"big": (8, 1024)}))
            with pytest.raises(SchedulerError) as caught:
                await client.schedule(template_id="big")
            assert "n3: cpu: 6 free vCPUs < 8" in caught.value.details
            assert caught.value.request == "8 vCPUs and 1024 MiB"
            assert (await client.schedule(template_id="big", vcpus=2)).node_id == "n3"

    asyncio.run(body())


def test_reservations_are_named_cancelled_and_tried_nodes_left_out(
    redis_server: RedisServer, prefix: str
) -> None:
    """Schedule holds room under a reservation: RecordAssignment names it (that placement
    becomes the sandbox), Release(reservation) gives it back at once (the create failed), and a
    retry leaves out the nodes that refused (exclude_nodes)."""
    async def body() -> None:
        async with scheduler(redis_server.url, prefix, strategy="least-loaded") as (_, client):
            await client.heartbeat(status("a", cpu=4))
            await client.heartbeat(status("b", cpu=4))
            first = await client.schedule(template_id="base")
            second = await client.schedule(template_id="base")
            assert {first.node_id, second.node_id} == {"a", "b"}
            assert first.reservation.startswith(f"{first.node_id}/")
            # both hold 2 of 4 vCPUs; one more each fits, then nothing
            await client.release(reservation=first.reservation)  # its create failed
            again = await client.schedule(template_id="base")
            assert again.node_id == first.node_id  # its room came back: the least loaded
            await client.record_assignment("s1", again.node_id, reservation=again.reservation)
            await client.release(reservation=again.reservation)  # recorded: nothing to give
            # a holds s1 (recorded), b its reservation: equal loads, by id
            assert [(await client.schedule(template_id="base")).node_id
                    for _ in range(2)] == ["a", "b"]
            with pytest.raises(SchedulerError) as full:
                await client.schedule(template_id="base")
            assert full.value.refused == {"cpu": 2}

            await client.heartbeat(status("c", cpu=4))
            await client.heartbeat(status("d", cpu=4))
            chosen = await client.schedule(template_id="base", exclude_nodes=["c"])
            assert chosen.node_id == "d"
            await client.release(reservation=chosen.reservation)
            with pytest.raises(SchedulerError) as tried:
                await client.schedule(template_id="base", exclude_nodes=["c", "d"])
            assert tried.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
            assert "c: tried (it refused the sandbox)" in tried.value.details
            assert tried.value.refused == {"cpu": 2, "tried": 2}
            for bad in ("x", "c/zz", "nope/0123456789abcdef"):
                with pytest.raises(SchedulerError) as refused:
                    await client.record_assignment("s2", "c", reservation=bad)
                assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT
            with pytest.raises(SchedulerError) as refused:
                await client.release(reservation="no such thing")
            assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT

    asyncio.run(body())


def test_a_heartbeat_listing_a_new_sandbox_takes_over_its_reservation(
    redis_server: RedisServer, prefix: str
) -> None:
    """Between the node's heartbeat that lists a sandbox being made and the gateway's
    RecordAssignment, the sandbox is counted once (by the node), not also by its reservation:
    a burst at the node's last room fits exactly."""
    async def body() -> None:
        async with scheduler(redis_server.url, prefix) as (_, client):
            await client.heartbeat(status("a", cpu=6, templates=["base"]))
            placed = [await client.schedule(template_id="base") for _ in range(3)]
            assert {p.node_id for p in placed} == {"a"}
            # the node made the first one and counts it: 4 of 6 vCPUs free by its figures
            await client.heartbeat(status("a", cpu=6, cpu_free=4, templates=["base"],
                                          sandboxes=["s1"]))
            with pytest.raises(SchedulerError) as full:
                await client.schedule(template_id="base")
            assert "a: cpu: 0 free vCPUs < 2" in full.value.details  # not "-2"
            await client.record_assignment("s1", "a", reservation=placed[0].reservation)
            await client.release(reservation=placed[2].reservation)  # its create failed
            assert (await client.schedule(template_id="base")).node_id == "a"

    asyncio.run(body())


def test_a_miss_is_cached_briefly_and_a_recorded_sandbox_replaces_it(
        redis_server: RedisServer, prefix: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A lookup that finds nothing is cached (red team finding 5: made-up ids cost the
    scheduler a call each), apart from the bindings and bounded; a sandbox this gateway
    records is routable at once, and one the scheduler binds otherwise after MISS_TTL."""
    monkeypatch.setattr(placement, "MAX_MISSES", 50)

    async def body() -> None:
        async with scheduler(redis_server.url, prefix) as (server, client):
            link = SchedulerLink(f"127.0.0.1:{server.port}", Credentials.gateway(SECRET))
            asked: list[str] = []
            lookup = link.client.lookup

            async def counted(sandbox_id: str, **kw: object) -> object:
                asked.append(sandbox_id)
                return await lookup(sandbox_id, **kw)  # type: ignore[arg-type]

            link.client.lookup = counted  # type: ignore[method-assign]
            try:
                await client.heartbeat(status("n1", address="127.0.0.1:8001"))
                assert [await link.lookup("ghost") for _ in range(20)] == [None] * 20
                assert asked == ["ghost"] and link.cached("ghost")
                node = Node("n1", "127.0.0.1:8001")
                await link.record("ghost", node, "team")  # created here: routable at once
                assert (await link.lookup("ghost")) == Binding("ghost", node, "team")
                assert asked == ["ghost"]
                assert await link.lookup("later") is None
                await client.record_assignment("later", "n1", team_id="team")  # elsewhere
                assert await link.lookup("later") is None  # the miss, for MISS_TTL at most
                await asyncio.sleep(placement.MISS_TTL + 0.1)
                assert (await link.lookup("later")) is not None
                for i in range(200):  # made-up ids: the misses stay bounded
                    await link.lookup(f"made{i}")
                assert len(link._misses) == 50 and link.cached("later")  # the binding kept
            finally:
                await link.close()

    asyncio.run(body())
