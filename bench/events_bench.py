"""The cluster's event collector and webhooks (control/gateway/events.py) against the lifecycle.

A local cluster (tests/control/cluster.py: Redis with the cluster-up ACL, the scheduler, two
process-backend nodes) and two gateways on it: `on` (collector and webhook delivery, with a
webhook of the team's aimed at a receiver that never answers, so its worker is always mid
attempt) and `off` (AENV_EVENTS_RETENTION_DAYS=0: no collector). Rounds alternate (on first in
every other round): in an `on` round only the `on` gateway runs, in an `off` round only the `off` one, and each makes ROUNDS x
N sandboxes (create, then kill) through the gateway that runs; the lag is measured after. Prints, as JSON lines:

- create_p50_ms, kill_p50_ms with the collector on; baseline: the same with it off (issue 28:
  no more than 5% worse);
- collect_lag_p50_ms: from a create's answer to its event listed by the gateway;
- delivery_lag_p50_ms: from a create's answer to its event's arrival at a webhook receiver
  that answers at once (the events are pushed: the node answers the collector's long poll, the
  collector wakes the team's webhook worker; neither waits for AENV_GATEWAY_EVENTS_POLL);
- collect_per_s: events moved per second from a node holding a backlog (BACKLOG timeout
  updates made straight at the node while no collector ran); baseline: the node's own rate of
  answering those pages (GET /cluster/events, the same page size).

Run: PYTHONPATH=src scripts/isolated.sh .venv/bin/python bench/events_bench.py [--quick]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT))

from tests.control.cluster import GatewayProcess, LocalCluster  # noqa: E402
from tests.node.test_events import Receiver  # noqa: E402

from agentenv.api.routes import CLUSTER_EVENTS_PATH  # noqa: E402
from agentenv.control.gateway.events import NODE_PAGE  # noqa: E402


def emit(metric: str, value: float, unit: str, baseline: str, baseline_value: float,
         **extra: Any) -> None:
    ratio = value / baseline_value if baseline_value else float("nan")
    print(json.dumps({"metric": metric, "value": round(value, 3), "unit": unit,
                      "baseline": baseline, "baseline_value": round(baseline_value, 3),
                      "ratio": round(ratio, 3), **extra}), flush=True)


def wait(check: Any, timeout: float = 120) -> Any:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = check()
        if value:
            return value
        time.sleep(0.01)
    raise RuntimeError("timed out")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    rounds, per_round, backlog = (2, 5, 500) if args.quick else (6, 15, 2000)
    env = {"AENV_WEBHOOK_ALLOW_PRIVATE": "1", "AENV_GATEWAY_EVENTS_POLL": "1"}
    with tempfile.TemporaryDirectory(prefix="aenv-events-bench-") as tmp:
        cluster = LocalCluster(Path(tmp), nodes=2, strategy="round-robin",
                               node_env={"AENV_NODE_VCPUS": "64",
                                         "AENV_MEMORY_BUDGET_MB": "100000"})
        cluster.gateway.env.update(env)
        off = GatewayProcess(cluster.scheduler.address, cluster.redis.url, cluster.secret_file,
                             Path(tmp) / "gateway-off.log",
                             env={**cluster.redis.env("gateway"),
                                  "AENV_EVENTS_RETENTION_DAYS": "0"})
        stuck, prompt = Receiver(), Receiver()
        stuck.hold.clear()
        try:
            cluster.start()
            key = cluster.team("bench")
            headers = {"X-API-KEY": key}
            hook = httpx.post(cluster.url + "/events/webhooks", headers=headers, json={
                "url": stuck.url, "signatureSecret": "s",
                "events": ["sandbox.lifecycle.created", "sandbox.lifecycle.killed"]})
            hook.raise_for_status()
            times: dict[str, dict[str, list[float]]] = {
                m: {"create": [], "kill": []} for m in ("on", "off")}
            lags: list[float] = []
            for round_no in range(rounds):
                for mode in (("off", "on") if round_no % 2 else ("on", "off")):
                    gateway = cluster.gateway if mode == "on" else off
                    other = off if mode == "on" else cluster.gateway
                    other.stop()
                    if gateway.proc is None:  # cluster.start() started the `on` one
                        gateway.start()
                    with httpx.Client(base_url=gateway.url, headers=headers,
                                      timeout=120) as client:
                        for _ in range(per_round):
                            began = time.perf_counter()
                            made = client.post("/v2/sandboxes", json={"templateID": "base"})
                            made.raise_for_status()
                            times[mode]["create"].append(time.perf_counter() - began)
                            sid = made.json()["sandboxID"]
                            began = time.perf_counter()
                            client.delete(f"/sandboxes/{sid}").raise_for_status()
                            times[mode]["kill"].append(time.perf_counter() - began)
            # the lags apart: their polling is load the timed rounds should not carry
            deliveries: list[float] = []
            with httpx.Client(base_url=cluster.url, headers=headers, timeout=120) as client:
                client.post("/events/webhooks", json={
                    "url": prompt.url, "signatureSecret": "s",
                    "events": ["sandbox.lifecycle.created"]}).raise_for_status()
                for _ in range(per_round):
                    made = client.post("/v2/sandboxes", json={"templateID": "base"})
                    made.raise_for_status()
                    answered = time.perf_counter()
                    sid = made.json()["sandboxID"]
                    wait(lambda: sid in {json.loads(b)["sandboxId"]  # noqa: B023
                                         for _, b in prompt.requests})
                    deliveries.append(time.perf_counter() - answered)
                    client.delete(f"/sandboxes/{sid}").raise_for_status()
                for _ in range(per_round):
                    made = client.post("/v2/sandboxes", json={"templateID": "base"})
                    made.raise_for_status()
                    answered = time.perf_counter()
                    sid = made.json()["sandboxID"]
                    wait(lambda: client.get(f"/events/sandboxes/{sid}").json())  # noqa: B023
                    lags.append(time.perf_counter() - answered)
                    client.delete(f"/sandboxes/{sid}").raise_for_status()
            for op in ("create", "kill"):
                # each round's p50s too: the spread says how much of the difference is noise
                medians = {m: [round(statistics.median(times[m][op][i:i + per_round]) * 1000)
                               for i in range(0, len(times[m][op]), per_round)]
                           for m in ("on", "off")}
                emit(f"{op}_p50_ms", statistics.median(times["on"][op]) * 1000, "ms",
                     "collector off", statistics.median(times["off"][op]) * 1000,
                     samples=len(times["on"][op]), rounds_on=medians["on"],
                     rounds_off=medians["off"])
            emit("collect_lag_p50_ms", statistics.median(lags) * 1000, "ms",
                 "poll interval", 1000.0, samples=len(lags))
            emit("delivery_lag_p50_ms", statistics.median(deliveries) * 1000, "ms",
                 "poll interval", 1000.0, samples=len(deliveries),
                 max_ms=round(max(deliveries) * 1000))

            # a backlog at node0 made while no collector runs, then moved
            cluster.gateway.stop()
            node = cluster.nodes[0]
            with httpx.Client(base_url=node.url, timeout=60,
                              headers=cluster.node_headers(node, "bench")) as direct:
                sid = direct.post("/v2/sandboxes", json={"templateID": "base"}).json()[
                    "sandboxID"]
                for i in range(backlog):
                    direct.post(f"/sandboxes/{sid}/timeout", json={"timeout": 300 + i % 7})
                began = time.perf_counter()
                after, pages = 0, 0
                node_key = {k: v for k, v in cluster.node_headers(node, "").items()
                            if k != "x-agentenv-team"}
                while True:
                    page = httpx.get(node.url + CLUSTER_EVENTS_PATH, headers=node_key,
                                     params={"after": after, "limit": NODE_PAGE}).json()
                    if not page["events"]:
                        break
                    after, pages = page["events"][-1]["seq"], pages + 1
                node_rate = after / (time.perf_counter() - began)
                redis = cluster.redis.raw("gateway")
                before = int(redis.hget("aenv:events:count", "bench") or 0)
                # node0 is the bench's until the gateway is up: its start is not timed
                lease = "aenv:events:lease:node0"
                wait(lambda: redis.set(lease, "bench", nx=True, px=600_000), 30)
                cluster.gateway.start()
                began = time.perf_counter()
                redis.delete(lease)
                wait(lambda: int(redis.hget("aenv:events:count", "bench") or 0)
                     >= before + backlog + 1, 600)
                moved = int(redis.hget("aenv:events:count", "bench")) - before
                emit("collect_per_s", moved / (time.perf_counter() - began), "events/s",
                     "node pages alone", node_rate, backlog=moved)
        finally:
            stuck.close()
            prompt.close()
            off.stop()
            cluster.stop()


if __name__ == "__main__":
    main()
