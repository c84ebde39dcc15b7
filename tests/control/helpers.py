"""Shared helpers for the control-plane tests."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import AsyncIterator, Callable, Iterable, Iterator
from contextlib import asynccontextmanager, contextmanager
from typing import TYPE_CHECKING, Any

import httpx

from agentenv.cluster_keys import node_key
from agentenv.control.scheduler.server import SchedulerOptions, SchedulerServer
from agentenv.control.scheduler.service import SchedulerConfig
from agentenv.scheduling.client import Credentials, Holder, SchedulerClient
from agentenv.scheduling.proto import scheduler_pb2 as pb

if TYPE_CHECKING:
    from tests.control.cluster import LocalCluster

#: the cluster secret of the tests' schedulers, nodes and gateways (one per test session)
SECRET = secrets.token_urlsafe(32)


def node_credentials(node_id: str, secret: str = SECRET) -> Credentials:
    """What node `node_id` of the cluster calls the scheduler with (from its node key)."""
    return Credentials.node(node_key(secret, node_id), node_id)


class ClusterClient(SchedulerClient):
    """A client holding the cluster secret, as the tests' stand-in for the whole cluster: it
    calls as the gateway, and sends each heartbeat (and Holders) as the node it is for."""

    def __init__(self, target: str, secret: str = SECRET, timeout: float = 5.0) -> None:
        super().__init__(target, Credentials.gateway(secret), timeout)
        self.secret = secret

    async def heartbeat(self, status: pb.NodeStatus, *, timeout: float | None = None,
                        credentials: Credentials | None = None) -> float:
        return await super().heartbeat(
            status, timeout=timeout,
            credentials=credentials or node_credentials(status.node_id, self.secret))

    async def holders(self, digests: Iterable[str], *, node_id: str = "", limit: int = 0,
                      timeout: float | None = None,
                      credentials: Credentials | None = None) -> dict[str, list[Holder]]:
        return await super().holders(
            list(digests), node_id=node_id, limit=limit, timeout=timeout,
            credentials=credentials or node_credentials(node_id, self.secret))


def status(
    node_id: str,
    *,
    cpu: int = 16,
    cpu_free: int | None = None,
    mem: int = 32768,
    mem_free: int | None = None,
    disk_free: int = 100 << 30,
    sandboxes: Iterable[str | tuple[str, str]] = (),
    templates: Iterable[str] = (),
    snapshots: Iterable[str] = (),
    layers: Iterable[str] = (),
    template_layers: dict[str, list[str]] | None = None,
    max_sandboxes: int = 0,
    address: str | None = None,
    overhead: tuple[int, int] = (0, 0),
    disk_floor: int = 0,
    bounds: tuple[str, str] = ("", ""),
    template_sizes: dict[str, tuple[int, int]] | None = None,
) -> pb.NodeStatus:
    msg = pb.NodeStatus(
        node_id=node_id,
        address=address if address is not None else f"127.0.0.1:{8000 + abs(hash(node_id)) % 1000}",
        cpu_total=cpu,
        cpu_free=cpu if cpu_free is None else cpu_free,
        memory_total_mib=mem,
        memory_free_mib=mem if mem_free is None else mem_free,
        disk_free_bytes=disk_free,
        templates=list(templates),
        snapshots=list(snapshots),
        layers=list(layers),
        max_sandboxes=max_sandboxes,
        sandbox_overhead_mib=overhead[0],
        sandbox_overhead_per_vcpu_mib=overhead[1],
        disk_floor_bytes=disk_floor,
        cpu_bound=bounds[0],
        memory_bound=bounds[1],
    )
    for tpl, (vcpus, mib) in (template_sizes or {}).items():
        msg.template_sizes.add(template_id=tpl, vcpus=vcpus, memory_mib=mib)
    for item in sandboxes:
        sid, team = (item, "") if isinstance(item, str) else item
        msg.sandboxes.add(sandbox_id=sid, state="running", team_id=team)
    msg.running = len(msg.sandboxes)
    for tpl, digests in (template_layers or {}).items():
        msg.template_layers.add(template_id=tpl, layers=digests)
    return msg


@asynccontextmanager
async def scheduler(
    redis_url: str, prefix: str, **config: object
) -> AsyncIterator[tuple[SchedulerServer, ClusterClient]]:
    """An in-process scheduler on a loopback port and a client connected to it."""
    static = config.pop("static_nodes", [])
    options = SchedulerOptions(
        cluster_secret=SECRET,
        listen="127.0.0.1:0",
        redis_url=redis_url,
        prefix=prefix,
        config=SchedulerConfig(**config),  # type: ignore[arg-type]
        static_nodes=list(static),  # type: ignore[call-overload]
    )
    server = SchedulerServer(options)
    await server.start()
    client = ClusterClient(f"127.0.0.1:{server.port}")
    try:
        yield server, client
    finally:
        await client.close()
        await server.stop(grace=0)


def call(address: str, method: str, *args: Any, **kwargs: Any) -> Any:
    """One ClusterClient call from synchronous test code."""

    async def once() -> Any:
        async with ClusterClient(address) as client:
            return await getattr(client, method)(*args, **kwargs)

    return asyncio.run(once())


def wait_for(what: str, probe: Callable[[], Any], timeout: float = 20,
             interval: float = 0.1) -> Any:
    """Poll `probe` until it returns something truthy; that value."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = probe()
        if value:
            return value
        time.sleep(interval)
    raise AssertionError(f"timed out waiting for {what}")


@contextmanager
def team_api(cluster: LocalCluster, team: str, timeout: float) -> Iterator[httpx.Client]:
    """A client of the cluster's gateway with `team`'s API key; on leaving, every sandbox of
    the team is deleted (each test starts from an empty cluster)."""
    with httpx.Client(base_url=cluster.url, timeout=timeout, trust_env=False,
                      headers={"X-API-KEY": cluster.keys[team]}) as client:
        yield client
        for sandbox in client.get("/v2/sandboxes").json():
            client.delete(f"/sandboxes/{sandbox['sandboxID']}")


def sandbox_and_snapshot(api: httpx.Client) -> tuple[str, str]:
    """(a new base sandbox of the client's team, a snapshot of it), both made as asked."""
    source = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 120})
    assert source.status_code == 201, source.text
    source_id = source.json()["sandboxID"]
    snap = api.post(f"/sandboxes/{source_id}/snapshots", json={})
    assert snap.status_code == 201, snap.text
    return source_id, snap.json()["snapshotID"]
