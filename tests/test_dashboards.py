"""deploy/grafana: the dashboard's queries name only metrics the code exports (each exporter
(node, blockd, chunk cache, egress proxy, gateway, scheduler) run in process, with the collectors it registers in its server) and the scrape config loads."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from prometheus_client import CollectorRegistry, generate_latest

from agentenv.blockd.metrics import Metrics as BlockdMetrics
from agentenv.blockd.remote.service import _Collector as RemoteCollector
from agentenv.blockd.remote.store import RemoteConfig, RemoteStore
from agentenv.control.gateway.metrics import GatewayMetrics
from agentenv.control.scheduler.metrics import SchedulerMetrics
from agentenv.control.scheduler.service import SchedulerService
from agentenv.control.scheduler.store import Store
from agentenv.network.egress import EgressProxyServer
from agentenv.node.admission import Admission
from agentenv.node.metrics import NodeMetrics
from agentenv.node.ready_pool import ReadyPool, ReadyPoolConfig

GRAFANA = Path(__file__).resolve().parents[1] / "deploy" / "grafana"
METRIC = re.compile(r"\baenv_[a-z0-9_]+\b")


def _sample_names(text: str) -> set[str]:
    """The names of the samples in an exposition, and of the families it describes (`# TYPE`:
    a family with no sample yet, such as an empty pool's)."""
    names = set()
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            names.add(line.split()[2])
        elif line and not line.startswith("#"):
            names.add(line.split("{", 1)[0].split(" ", 1)[0])
    return names


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    """Every sample name the node, blockd (with its chunk cache), the egress proxy and the
    gateway expose, with a sample for each labelled family."""
    tmp = tmp_path_factory.mktemp("exporters")
    node = NodeMetrics()
    node.watch_states(lambda: {"running": 1})
    node.record_op("create", "ok", 0.1)
    node.requests.labels("api", "GET", "200").inc()
    node.record_gc(1, 4096, 0, 0.01)

    # the VM backend's ready pools, as the node's server registers them (no pool filled: its
    # families are still described)
    pools = ReadyPool(None, ReadyPoolConfig(), tmp / "pools")
    node.watch_ready_pools(lambda: pools)
    # admission by use, as the node's server registers it (one refusal, sandboxes sampled)
    admission = Admission(tmp, min_free_disk_mb=0)
    admission.refusals["memory_requested"] = 1
    node.watch_admission(lambda: admission, list, lambda: (0.5, 64 << 20))
    blockd = BlockdMetrics()
    for what in ("reads", "writes", "bytes_read", "bytes_written", "errors", "enospc"):
        blockd.counters[what].labels("d0").inc()
    store = RemoteStore(RemoteConfig(tmp / "cache", capacity=1 << 20, chunk_size=1 << 16,
                                     background_bw=0))
    remote = CollectorRegistry()
    remote.register(RemoteCollector(store))
    store.stats.add("fetched", "peer", 1)
    store.stats.add("corrupt", "peer", 1)
    store.stats.add("failures", "registry", 1)
    gateway = GatewayMetrics()
    gateway.limit_refusals.labels("sandboxes").inc()
    gateway.capacity_refusals.labels("cpu").inc()
    gateway.placement_retries.labels("cpu").inc()
    egress = EgressProxyServer(tmp / "egress.sock", 0)
    scheduler = SchedulerMetrics()
    scheduler.watch(SchedulerService(Store("redis://127.0.0.1:9/0", "aenv:test:")))
    scheduler.observe("Lookup", "OK", 0.0001)
    try:
        texts = [generate_latest(r).decode() for r in
                 (node.registry, blockd.registry, remote, gateway.registry, scheduler.registry)]
    finally:
        store.close()
    return set().union(*map(_sample_names, texts), _sample_names(egress.metrics_text()))


def test_every_dashboard_query_names_an_exported_metric(exported: set[str]) -> None:
    dashboard = json.loads((GRAFANA / "agentenv.json").read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)) and len(ids) >= 10
    used: set[str] = set()
    for panel in dashboard["panels"]:
        assert panel["targets"], panel["title"]
        for target in panel["targets"]:
            names = set(METRIC.findall(target["expr"]))
            assert names, (panel["title"], target["expr"])
            missing = names - exported
            assert not missing, f"{panel['title']}: {sorted(missing)} not exported"
            used |= names
    # the list: sandboxes by state, lifecycle latency, blockd IOPS, cache hit rate,
    # egress denials; and the scheduler
    for name in ("aenv_scheduler_calls_total", "aenv_node_sandboxes", "aenv_node_sandbox_operation_seconds_bucket",
                 "aenv_blockd_reads_total", "aenv_chunk_cache_hits_total",
                 "aenv_egress_connections_total", "aenv_node_admission_refusals_total",
                 "aenv_gateway_capacity_refusals_total", "aenv_node_sandbox_usage"):
        assert name in used


def test_a_misspelt_metric_would_be_caught(exported: set[str]) -> None:
    assert "aenv_node_sandboxes" in exported
    assert "aenv_node_sandboxes_total" not in exported  # gauges carry no _total


def test_the_scrape_config_loads_and_covers_every_exporter() -> None:
    config = yaml.safe_load((GRAFANA / "prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    assert set(jobs) == {"agentenv-gateway", "agentenv-node", "agentenv-scheduler",
                         "agentenv-blockd", "agentenv-egress"}
    for name in ("agentenv-gateway", "agentenv-node"):  # /metrics wants the metrics token
        assert jobs[name]["authorization"]["credentials_file"]
    for job in jobs.values():
        assert all(":" in t for c in job["static_configs"] for t in c["targets"])
