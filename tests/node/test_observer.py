"""Metrics samples and sandbox logs (node/observer.py, node/observe_api.py) through E2B's
routes, with the process backend in-process; the SDK's get_metrics against a live node."""

from __future__ import annotations

import time
import warnings
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from agentenv.node.server import ServeOptions, build_app

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient

METRIC_FIELDS = {"timestamp", "timestampUnix", "cpuCount", "cpuUsedPct", "memUsed", "memTotal",
                 "memCache", "diskUsed", "diskTotal", "memUsedHost"}


@pytest.fixture
def node(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[TestClient]:
    monkeypatch.setenv("AENV_METRICS_INTERVAL", "3600")  # samples only when a test asks
    monkeypatch.setenv("AENV_LOGS_MAX_BYTES", "300")
    monkeypatch.setenv("AENV_METRICS_MAX_SAMPLES", "3")
    app = build_app(ServeOptions(state_dir=tmp_path / "state", backend="process"))
    key = (tmp_path / "state" / "secrets" / "api-key").read_text().strip()
    with TestClient(app, headers={"X-API-KEY": key}) as client:
        client.app_state = app  # type: ignore[attr-defined]
        yield client


def create(client: TestClient) -> str:
    answer = client.post("/v2/sandboxes", json={"templateID": "base", "timeout": 300})
    assert answer.status_code == 201, answer.text
    return str(answer.json()["sandboxID"])


def observe(client: TestClient) -> None:
    client.portal.call(client.app_state.orchestrator.companions[0].observe_once)  # type: ignore


def test_metrics_series_batch_and_grace(node: TestClient) -> None:
    sid, other = create(node), create(node)
    first = node.get(f"/sandboxes/{sid}/metrics")  # sampled on demand: the SDK asks at once
    assert first.status_code == 200, first.text
    (sample,) = first.json()
    assert set(sample) == METRIC_FIELDS
    assert sample["memUsed"] > 0 and sample["memUsedHost"] > 0 and sample["diskTotal"] > 0
    assert sample["memTotal"] >= sample["memUsed"] or sample["memTotal"] > 0
    observer = node.app_state.orchestrator.companions[0]  # type: ignore[attr-defined]
    for _ in range(4):
        observe(node)
    series = node.get(f"/sandboxes/{sid}/metrics").json()
    assert len(series) == 3  # bounded
    stamps = [s["timestampUnix"] for s in series]
    assert stamps == sorted(stamps)
    later = node.get(f"/sandboxes/{sid}/metrics", params={"start": stamps[-1] + 1}).json()
    assert later == []

    batch = node.get("/sandboxes/metrics", params={"sandbox_ids": f"{sid},{other},nope"})
    assert batch.status_code == 200, batch.text
    assert set(batch.json()["sandboxes"]) == {sid, other}
    assert set(batch.json()["sandboxes"][sid]) == METRIC_FIELDS
    assert node.get("/sandboxes/metrics").status_code == 400

    # killed: still answered within the grace period, then gone
    assert node.delete(f"/sandboxes/{sid}").status_code == 204
    observe(node)
    assert len(node.get(f"/sandboxes/{sid}/metrics").json()) == 3
    observer.config = replace(observer.config, grace=0)
    time.sleep(0.01)
    observe(node)
    assert node.get(f"/sandboxes/{sid}/metrics").status_code == 404


def _logs(client: TestClient, sid: str, v2: bool = False, **params: Any) -> Any:
    path = f"/v2/sandboxes/{sid}/logs" if v2 else f"/sandboxes/{sid}/logs"
    answer = client.get(path, params=params)
    assert answer.status_code == 200, answer.text
    return answer.json()


def test_a_request_during_the_intervals_look_waits_for_its_sample(node: TestClient) -> None:
    """The SDK's get_metrics right after a connect, while the interval's look at the sandbox
    was under way, answered [] (the request's own look stepped aside for it and returned at
    once, before any sample existed): it waits for that look now."""
    import asyncio

    sid = create(node)
    orchestrator = node.app_state.orchestrator  # type: ignore[attr-defined]
    observer = orchestrator.companions[0]
    backend = orchestrator.backend
    sampled = backend.metrics

    async def both() -> int:
        entered, release = asyncio.Event(), asyncio.Event()

        async def slow_metrics(sandbox_id: str, placement: Any) -> Any:
            entered.set()
            await release.wait()
            return await sampled(sandbox_id, placement)

        backend.metrics = slow_metrics
        try:
            interval = asyncio.create_task(observer.observe_once())
            await entered.wait()  # the interval's look is sampling
            request = asyncio.create_task(observer.observe(sid))
            await asyncio.sleep(0.05)
            release.set()
            await request
            count = len(observer.histories[sid].samples)
            await interval
            return count
        finally:
            backend.metrics = sampled

    assert node.portal.call(both) == 1


def test_logs_v1_and_v2_are_bounded_and_filtered(node: TestClient) -> None:
    sid = create(node)
    backend = node.app_state.orchestrator.backend  # type: ignore[attr-defined]
    ((source, path),) = backend.log_files(sid)
    assert source == "envd"
    with open(path, "a") as f:
        f.write('plain line one\n{"level":"error","msg":"boom"}\n{"level":"warn","msg":"w"}\n'
                "partial without newline")
    observe(node)
    v1 = _logs(node, sid)
    texts = [x["line"] for x in v1["logs"]]
    assert texts[-3:] == ["plain line one", '{"level":"error","msg":"boom"}',
                          '{"level":"warn","msg":"w"}']
    assert "partial without newline" not in texts  # until its line ends
    entry = v1["logEntries"][-2]
    assert entry["level"] == "error" and entry["fields"] == {"source": "envd"}
    v2 = _logs(node, sid, v2=True, level="warn")["logs"]
    assert [x["level"] for x in v2] == ["error", "warn"]
    newest = _logs(node, sid, v2=True, direction="backward", limit=1)["logs"]
    assert newest[0]["message"] == '{"level":"warn","msg":"w"}'
    assert _logs(node, sid, v2=True, search="boom")["logs"][0]["level"] == "error"
    future = int(time.time() * 1000) + 60_000
    assert _logs(node, sid, start=future)["logs"] == []
    # bounded: a flood keeps only the newest AENV_LOGS_MAX_BYTES (300) of lines
    with open(path, "a") as f:
        f.write("\n" + "".join(f"flood {i:04d} " + "x" * 40 + "\n" for i in range(100)))
    observe(node)
    kept = [x["line"] for x in _logs(node, sid)["logs"]]
    assert sum(len(t) for t in kept) <= 300 and kept[-1].startswith("flood 0099")
    assert node.get(f"/v2/sandboxes/{sid}/logs", params={"level": "loud"}).status_code == 400
    assert node.get("/sandboxes/nope/logs").status_code == 404
