"""Red-team checks of the scheduler's metrics port (control/scheduler/metrics.py), which an
operator may bind beyond loopback (`--metrics-bind`, for a scraper on another host): a
stranger who reaches it must not be able to hold its threads."""

from __future__ import annotations

import asyncio
import socket
import time

from agentenv.control.scheduler.server import SchedulerOptions, SchedulerServer
from tests.control.conftest import RedisServer, free_port
from tests.control.helpers import SECRET

DEADLINE = 90.0  # generous: the server's idle timeout is far shorter


def _closed_by_server(port: int) -> bool:
    """Whether the server closes a connection that sends nothing, within DEADLINE."""
    with socket.create_connection(("127.0.0.1", port), timeout=DEADLINE) as conn:
        end = time.monotonic() + DEADLINE
        while time.monotonic() < end:
            conn.settimeout(max(0.1, end - time.monotonic()))
            try:
                if conn.recv(1024) == b"":
                    return True
            except TimeoutError:
                return False
            except ConnectionResetError:
                return True
    return False


def test_an_idle_connection_to_the_metrics_port_is_closed(
        redis_server: RedisServer, prefix: str) -> None:
    """prometheus_client's server starts a thread per connection and gives the connection no
    timeout: a stranger's connections that never send a request held a thread each, for ever
    (as many as it opened, in the scheduler's process)."""
    port = free_port()

    async def body() -> bool:
        server = SchedulerServer(SchedulerOptions(cluster_secret=SECRET, listen="127.0.0.1:0",
                                                  redis_url=redis_server.url, prefix=prefix,
                                                  metrics_port=port))
        await server.start()
        try:
            return await asyncio.to_thread(_closed_by_server, port)
        finally:
            await server.stop(grace=0)

    assert asyncio.run(body()), "the metrics port kept an idle connection open"


def test_a_stranger_cannot_grow_the_label_sets(redis_server: RedisServer, prefix: str) -> None:
    """Methods a stranger makes up, and any status it provokes, add no label value: the method
    label is one of the proto's methods, the code a gRPC status name."""
    import grpc
    import httpx

    from agentenv.control.scheduler.auth import SERVICE

    port = free_port()

    async def body() -> tuple[str, str]:
        server = SchedulerServer(SchedulerOptions(cluster_secret=SECRET, listen="127.0.0.1:0",
                                                  redis_url=redis_server.url, prefix=prefix,
                                                  metrics_port=port))
        await server.start()
        try:
            async with httpx.AsyncClient(trust_env=False) as http:
                before = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                for i in range(20):
                    rpc = channel.unary_unary(f"/{SERVICE.full_name}/Made{i}",
                                              request_serializer=bytes,
                                              response_deserializer=bytes)
                    try:
                        await rpc(b"\xff" * i, timeout=10)
                    except grpc.aio.AioRpcError as exc:
                        assert exc.code() == grpc.StatusCode.UNIMPLEMENTED
            async with httpx.AsyncClient(trust_env=False) as http:
                after = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
            return before, after
        finally:
            await server.stop(grace=0)

    before, after = asyncio.run(body())
    assert "Made" not in after
    labelled = [line for line in after.splitlines() if "{" in line and not line.startswith("#")]
    assert len(labelled) == len([line for line in before.splitlines()
                                 if "{" in line and not line.startswith("#")])
