"""The scheduler answers only its cluster (control/scheduler/auth.py): every RPC of the service
(read from the proto's descriptor, so a new one cannot be left out) refuses a caller without the
token derived from the cluster secret, and each identity may call only its own methods: a node
may not heartbeat for another node (which would move that node's address and bindings to the
sender), nor release, place or look up anything."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import grpc
import pytest

from agentenv.cluster_keys import node_key
from agentenv.scheduling.client import CREDENTIAL_KEY, Credentials, SchedulerError
from agentenv.scheduling.proto import scheduler_pb2 as pb
from tests.control.conftest import RedisServer
from tests.control.helpers import SECRET, ClusterClient, node_credentials, scheduler, status

SERVICE = pb.DESCRIPTOR.services_by_name["Scheduler"]
METHODS = list(SERVICE.methods)
VICTIM_ADDRESS = "127.0.0.1:8001"
#: what each identity may call (the rule of docs/control-plane.md §1)
GATEWAY_METHODS = {"Schedule", "RecordAssignment", "Release", "Lookup", "ListNodes"}
NODE_METHODS = {"Heartbeat", "Holders"}
DIGEST = "sha256:" + "ab" * 32


def sample(method_name: str, caller: str = "n1") -> object:
    """A request each method would act on (a stranger's would do harm); an empty message for a
    method this table does not know yet, which is refused all the same."""
    requests: dict[str, Callable[[], object]] = {
        "Schedule": lambda: pb.ScheduleRequest(template_id="base", vcpus=1, memory_mib=1),
        "RecordAssignment": lambda: pb.Assignment(sandbox_id="planted", node_id="n1"),
        "Release": lambda: pb.ReleaseRequest(sandbox_id="s1"),
        "Lookup": lambda: pb.LookupRequest(sandbox_id="s1"),
        "Heartbeat": lambda: status(caller, address="127.0.0.1:6666"),
        "ListNodes": pb.Empty,
        "Holders": lambda: pb.HoldersRequest(digests=[DIGEST], node_id=caller),
    }
    method = SERVICE.methods_by_name[method_name]
    return requests.get(method_name, getattr(pb, method.input_type.name))()


async def raw_call(channel: grpc.aio.Channel, method_name: str, request: object,
                   metadata: tuple[tuple[str, str], ...] | None) -> object:
    method = SERVICE.methods_by_name[method_name]
    rpc = channel.unary_unary(
        f"/{SERVICE.full_name}/{method_name}",
        request_serializer=lambda m: m if isinstance(m, bytes) else m.SerializeToString(),
        response_deserializer=getattr(pb, method.output_type.name).FromString,
    )
    return await rpc(request, metadata=metadata, timeout=10)


async def victim_unchanged(client: ClusterClient) -> None:
    where = await client.lookup("s1")
    assert where is not None and (where.node_id, where.node_address) == ("n1", VICTIM_ADDRESS)
    (n1,) = [n for n in await client.list_nodes() if n.node_id == "n1"]
    assert n1.address == VICTIM_ADDRESS and n1.status.running == 1
    assert await client.lookup("planted") is None


WRONG = {
    "none": None,
    "another-secret": Credentials.gateway("another-cluster-" + "x" * 32).metadata,
    # a real token, of another identity
    "another-identity": ((CREDENTIAL_KEY, f"gateway {node_credentials('n1').token}"),),
    "token-only": ((CREDENTIAL_KEY, Credentials.gateway(SECRET).token),),
    "garbage": ((CREDENTIAL_KEY, "gateway " + "0" * 64),),
}


@pytest.mark.parametrize("credential", list(WRONG), ids=list(WRONG))
def test_every_rpc_is_refused_without_the_cluster_credential(
    redis_server: RedisServer, prefix: str, credential: str
) -> None:
    async def body() -> None:
        # grace 0: on a scheduler without this check, an empty heartbeat drops s1 at once
        async with scheduler(redis_server.url, prefix, reconcile_grace_s=0.0) as (server, client):
            await client.heartbeat(status("n1", address=VICTIM_ADDRESS, sandboxes=["s1"],
                                          templates=["base"]))
            await victim_unchanged(client)  # the right tokens pass (and are remembered)
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                for method in METHODS:
                    with pytest.raises(grpc.aio.AioRpcError) as caught:
                        await raw_call(channel, method.name, sample(method.name),
                                       WRONG[credential])
                    assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED, method.name
                    assert "credential" in (caught.value.details() or ""), method.name
            await victim_unchanged(client)

    asyncio.run(body())


def test_a_node_cannot_heartbeat_for_another_node(redis_server: RedisServer, prefix: str) -> None:
    async def body() -> None:
        async with scheduler(redis_server.url, prefix, reconcile_grace_s=0.0) as (_, client):
            await client.heartbeat(status("n1", address=VICTIM_ADDRESS, sandboxes=["s1"]))
            intruder = node_credentials("n2")  # a node of the cluster, or its token
            for forged in (status("n1", address="127.0.0.1:6666", sandboxes=["s1"]),
                           status("n1", address=VICTIM_ADDRESS)):  # empty: drops n1's bindings
                with pytest.raises(SchedulerError) as caught:
                    await client.heartbeat(forged, credentials=intruder)
                assert caught.value.code == grpc.StatusCode.PERMISSION_DENIED
                assert "node 'n2' may not call Heartbeat for node 'n1'" in caught.value.details
            await victim_unchanged(client)
            # its own heartbeat is taken
            await client.heartbeat(status("n2", address="127.0.0.1:8002"), credentials=intruder)
            with pytest.raises(SchedulerError) as caught:
                await client.holders([DIGEST], node_id="n1", credentials=intruder)
            assert caught.value.code == grpc.StatusCode.PERMISSION_DENIED

    asyncio.run(body())


def test_a_node_cannot_claim_another_nodes_sandbox(redis_server: RedisServer,
                                                  prefix: str) -> None:
    """A node, with its own credential, lists another node's sandbox in its heartbeat: the
    binding stays with the node the gateway recorded, up or down (else, once that node is down,
    the gateway would send the sandbox's traffic and its users' envd tokens to the claimant).
    Only the gateway's RecordAssignment moves it."""
    async def body() -> None:
        async with scheduler(redis_server.url, prefix, reconcile_grace_s=0.0,
                             heartbeat_interval_s=0.2, missed_heartbeats=1) as (_, client):
            await client.heartbeat(status("n1", address=VICTIM_ADDRESS, sandboxes=["s1"]))
            intruder = node_credentials("n2")
            claim = status("n2", address="127.0.0.1:6666", sandboxes=["s1"])
            await client.heartbeat(claim, credentials=intruder)
            await victim_unchanged(client)
            # n1 stops beating: down after 1.5 intervals (0.3 s)
            deadline = time.monotonic() + 30
            while (await client.lookup("s1")).node_up:  # type: ignore[union-attr]
                assert time.monotonic() < deadline, "n1 never went down"
                await asyncio.sleep(0.1)
            for extra in range(3):  # reconciling heartbeats (the list changes each time)
                await client.heartbeat(status("n2", address="127.0.0.1:6666",
                                              sandboxes=["s1", f"own{extra}"]),
                                       credentials=intruder)
            where = await client.lookup("s1")
            assert where is not None and (where.node_id, where.node_up) == ("n1", False)
            # the gateway placed it on n2 (a resume there): that moves it
            await client.record_assignment("s1", "n2")
            where = await client.lookup("s1")
            assert where is not None and where.node_id == "n2"

    asyncio.run(body())


@pytest.mark.parametrize("who", ["gateway", "node"])
def test_each_identity_calls_only_its_methods(redis_server: RedisServer, prefix: str,
                                              who: str) -> None:
    """A node may not release (or place, record, look up, list); the gateway may not send
    heartbeats. A method neither list names is refused to both."""
    credentials = Credentials.gateway(SECRET) if who == "gateway" else node_credentials("n2")
    allowed = GATEWAY_METHODS if who == "gateway" else NODE_METHODS

    async def body() -> None:
        async with scheduler(redis_server.url, prefix, reconcile_grace_s=0.0) as (server, client):
            await client.heartbeat(status("n1", address=VICTIM_ADDRESS, sandboxes=["s1"],
                                          templates=["base"]))
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                for method in METHODS:
                    if method.name in allowed:
                        continue
                    with pytest.raises(grpc.aio.AioRpcError) as caught:
                        await raw_call(channel, method.name, sample(method.name, "n2"),
                                       credentials.metadata)
                    assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED, method.name
                for name in sorted(allowed):
                    if name not in ("RecordAssignment", "Release"):  # those change the victim
                        await raw_call(channel, name, sample(name, "n2"), credentials.metadata)
            await victim_unchanged(client)

    asyncio.run(body())


def test_every_rpc_has_a_rule() -> None:
    """A method without a rule is refused to everyone: a new RPC must get one."""
    from agentenv.control.scheduler.auth import RULES

    assert set(RULES) == {f"/{SERVICE.full_name}/{m.name}" for m in METHODS}
    assert {m.name for m in METHODS} == GATEWAY_METHODS | NODE_METHODS


def test_no_scheduler_without_a_cluster_secret(redis_server: RedisServer, prefix: str) -> None:
    from agentenv.control.scheduler.server import SchedulerOptions, SchedulerServer
    from agentenv.errors import AgentEnvError

    with pytest.raises(AgentEnvError, match="needs the cluster secret"):
        SchedulerServer(SchedulerOptions(cluster_secret="", redis_url=redis_server.url,
                                         prefix=prefix))


def test_a_node_key_proves_only_its_own_node(redis_server: RedisServer, prefix: str) -> None:
    """A node holds only its key (agentenv.cluster_keys): the token it makes with it for another
    node's identity is refused, so a node taken over cannot heartbeat as another."""
    async def body() -> None:
        async with scheduler(redis_server.url, prefix, reconcile_grace_s=0.0) as (_, client):
            await client.heartbeat(status("n1", address=VICTIM_ADDRESS, sandboxes=["s1"]))
            n2_key = node_key(SECRET, "n2")
            posing = Credentials.node(n2_key, "n1")
            with pytest.raises(SchedulerError) as caught:
                await client.heartbeat(status("n1", address="127.0.0.1:6666"), credentials=posing)
            assert caught.value.code == grpc.StatusCode.UNAUTHENTICATED
            await victim_unchanged(client)
            # with its own key, as itself: taken
            await client.heartbeat(status("n2", address="127.0.0.1:8002"),
                                   credentials=Credentials.node(n2_key, "n2"))

    asyncio.run(body())


def test_a_method_without_a_rule_is_closed(redis_server: RedisServer, prefix: str,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A new RPC nobody gave a rule is refused to every identity, however well proven."""
    from agentenv.control.scheduler import auth

    lookup = f"/{SERVICE.full_name}/Lookup"
    monkeypatch.setattr(auth, "RULES", {m: r for m, r in auth.RULES.items() if m != lookup})

    async def body() -> None:
        async with scheduler(redis_server.url, prefix) as (server, _), \
                grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            for credentials in (Credentials.gateway(SECRET), node_credentials("n1")):
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await raw_call(channel, "Lookup", sample("Lookup"), credentials.metadata)
                assert caught.value.code() == grpc.StatusCode.PERMISSION_DENIED
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await raw_call(channel, "Lookup", sample("Lookup"), None)
            assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED

    asyncio.run(body())


def largest_heartbeat(node_id: str) -> pb.NodeStatus:
    """The heartbeat the scheduler's MAX_MESSAGE_BYTES is sized for (control/scheduler/server.py)."""
    msg = status(node_id, address="127.0.0.1:8002")
    for i in range(4096):
        msg.sandboxes.add(sandbox_id=f"i{i:019d}", state="running", team_id="t" * 40)
    for i in range(1024):
        names = [f"t{i:019d}", f"{i:04d}" + "n" * 124, f"{i:04d}" + "m" * 124]
        msg.templates.extend(names)
        for name in names:
            msg.template_layers.add(template_id=name, layers=[DIGEST] * 8)
    for field in (msg.layers, msg.blobs, msg.partial_blobs):
        field.extend([DIGEST] * 8192)
    return msg


def test_requests_are_parsed_after_the_credential_and_bounded(redis_server: RedisServer,
                                                              prefix: str) -> None:
    """A stranger's bytes are refused for their credential, not parsed first; a request over
    MAX_MESSAGE_BYTES is refused; the heartbeat of a very large node fits."""
    from agentenv.control.scheduler.server import MAX_MESSAGE_BYTES

    async def body() -> None:
        async with scheduler(redis_server.url, prefix) as (server, client), \
                grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
            garbage = b"\xff" * 64  # no protobuf message
            for credentials in (None, WRONG["garbage"]):
                with pytest.raises(grpc.aio.AioRpcError) as caught:
                    await raw_call(channel, "Heartbeat", garbage, credentials)
                assert caught.value.code() == grpc.StatusCode.UNAUTHENTICATED
            with pytest.raises(grpc.aio.AioRpcError) as caught:  # the right caller: a 400
                await raw_call(channel, "Heartbeat", garbage, node_credentials("n2").metadata)
            assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            large = largest_heartbeat("n2")
            assert 4 << 20 < large.ByteSize() < MAX_MESSAGE_BYTES
            await client.heartbeat(large, credentials=node_credentials("n2"))
            where = await client.lookup(f"i{4095:019d}")
            assert where is not None and where.node_id == "n2"
            too_large = pb.NodeStatus(node_id="n2", layers=[DIGEST] * (MAX_MESSAGE_BYTES // 70))
            with pytest.raises(grpc.aio.AioRpcError) as caught:
                await raw_call(channel, "Heartbeat", too_large, node_credentials("n2").metadata)
            assert caught.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED

    asyncio.run(body())
