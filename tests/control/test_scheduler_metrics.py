"""The scheduler's Prometheus metrics (control/scheduler/metrics.py): calls by method and status
code, as a scraper reads them from the metrics port, which listens on loopback."""

from __future__ import annotations

import asyncio

import grpc
import httpx
import pytest

from agentenv.control.scheduler.server import SchedulerOptions, SchedulerServer
from agentenv.scheduling.client import SchedulerError
from tests.control.conftest import RedisServer, free_port
from tests.control.helpers import SECRET, ClusterClient, node_credentials, status
from tests.control.test_scheduler_auth import raw_call, sample


def _value(text: str, sample_line: str) -> float:
    for line in text.splitlines():
        if line.startswith(sample_line + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0


def test_calls_refusals_and_nodes_are_counted(redis_server: RedisServer, prefix: str) -> None:
    port = free_port()

    async def body() -> str:
        server = SchedulerServer(SchedulerOptions(cluster_secret=SECRET, listen="127.0.0.1:0",
                                                  redis_url=redis_server.url, prefix=prefix,
                                                  metrics_port=port))
        await server.start()
        client = ClusterClient(f"127.0.0.1:{server.port}")
        try:
            await client.heartbeat(status("n1", address="127.0.0.1:8001"))
            await client.lookup("nobody")
            with pytest.raises(SchedulerError):  # another node's heartbeat
                await client.heartbeat(status("n1", address="127.0.0.1:6666"),
                                       credentials=node_credentials("n2"))
            async with grpc.aio.insecure_channel(f"127.0.0.1:{server.port}") as channel:
                with pytest.raises(grpc.aio.AioRpcError):  # a stranger
                    await raw_call(channel, "Lookup", sample("Lookup"), None)
            async with httpx.AsyncClient(trust_env=False) as http:
                answer = await http.get(f"http://127.0.0.1:{port}/metrics")
            assert answer.status_code == 200
            return answer.text
        finally:
            await client.close()
            await server.stop(grace=0)

    text = asyncio.run(body())
    calls = 'aenv_scheduler_calls_total{code="%s",method="%s"}'
    assert _value(text, calls % ("OK", "Heartbeat")) == 1
    assert _value(text, calls % ("OK", "Lookup")) == 1
    assert _value(text, calls % ("PERMISSION_DENIED", "Heartbeat")) == 1
    assert _value(text, calls % ("UNAUTHENTICATED", "Lookup")) == 1
    assert _value(text, 'aenv_scheduler_call_seconds_count{method="Lookup"}') == 1
    assert _value(text, 'aenv_scheduler_call_seconds_bucket{le="+Inf",method="Lookup"}') == 1
    assert _value(text, 'aenv_scheduler_nodes{state="up"}') == 1
    assert "aenv_scheduler_bindings" in text
