"""Root in a guest answers envd's `/metrics` with figures of its own: the node's observer takes
only sane ones.

Red team of 2026-12-07: the observer took `int(guest["mem_used"])` and ignored only
ValueError/TypeError/KeyError; JSON's `1e400` (or `Infinity`) is a float infinity whose int()
is an OverflowError, which escaped: that sandbox's `/metrics` answered 500 and every observer
pass logged a traceback (its gather raised). Negative or 2**200-byte figures were kept and
shown.
"""

from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any

import httpx
import pytest

from agentenv.node.backend import MetricSample, Placement
from agentenv.node.observer import Observer, ObserverConfig
from agentenv.node.records import State

HOST = MetricSample(timestamp=1.0, cpu_count=2, cpu_used_pct=10.0, mem_used=100 << 20,
                    mem_total=512 << 20, mem_cache=0, disk_used=0, disk_total=1 << 30)


def observer_of(body: bytes) -> Observer:
    async def metrics(sandbox_id: str, placement: Placement) -> MetricSample:
        return HOST

    def guest(request: httpx.Request) -> httpx.Response:
        assert request.url.path == "/metrics"
        return httpx.Response(200, stream=httpx.ByteStream(body),
                              headers={"content-type": "application/json"})

    rec = SimpleNamespace(sandbox_id="s1", team="t", state=State.RUNNING, secure=False,
                          envd_access_token=None, placement=Placement("10.12.0.3", 49983))
    orchestrator: Any = SimpleNamespace(
        backend=SimpleNamespace(metrics=metrics), capabilities=SimpleNamespace(logs=None),
        http=httpx.AsyncClient(transport=httpx.MockTransport(guest)),
        sandbox=lambda sid: rec if sid == "s1" else None, all_sandboxes=lambda: [rec])
    return Observer(orchestrator, ObserverConfig(interval=0))


@pytest.mark.parametrize("body", [b'{"mem_used": 1e400, "mem_cache": 0}',
                                  b'{"mem_used": Infinity, "mem_cache": 0}',
                                  b'{"mem_used": -5, "mem_cache": 0}',
                                  b'{"mem_used": 1, "mem_cache": 1606938044258990275541962092341'
                                  b'162602522202993782792835301376}'])
def test_a_guests_figures_out_of_range_are_not_taken(body: bytes) -> None:
    observer = observer_of(body)
    asyncio.run(observer.observe("s1"))
    history = observer.histories["s1"]
    assert len(history.samples) == 1
    assert history.samples[0].metric == HOST  # the host's own figures, the guest's ignored


def test_a_guests_sane_figures_are_taken() -> None:
    observer = observer_of(b'{"mem_used": 12345, "mem_cache": 678}')
    asyncio.run(observer.observe("s1"))
    metric = observer.histories["s1"].samples[0].metric
    assert (metric.mem_used, metric.mem_cache) == (12345, 678)
