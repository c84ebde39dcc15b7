"""Prometheus metrics of the node (served at GET /metrics, without an API key)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

OP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class _StateCollector(Collector):
    def __init__(self, counts: Callable[[], dict[str, int]]) -> None:
        self._counts = counts

    def collect(self) -> Iterator[GaugeMetricFamily]:
        family = GaugeMetricFamily(
            "aenv_node_sandboxes", "Sandboxes on this node by state", labels=["state"]
        )
        for state, count in sorted(self._counts().items()):
            family.add_metric([state], count)
        yield family


class _ReadyPoolCollector(Collector):
    """The VM backend's ready pools (node/ready_pool.py), read at scrape time: the pool exists
    only once the backend has started, and not at all for other backends."""

    def __init__(self, pool: Callable[[], Any]) -> None:
        self._pool = pool

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        pool = self._pool()
        if pool is None:
            return
        parked = GaugeMetricFamily(
            "aenv_node_ready_pool_vms", "Pre-restored VMs parked, by pool (snapshot)",
            labels=["pool"])
        target = GaugeMetricFamily(
            "aenv_node_ready_pool_target", "VMs each pool is filled to", labels=["pool"])
        for key in pool.pooled_keys():
            parked.add_metric([Path(key).name], pool.count(key))
            target.add_metric([Path(key).name], pool.target(key))
        events = CounterMetricFamily(
            "aenv_node_ready_pool_events",
            "Ready pool events: creates served (taken) or not (missed), VMs filled, discarded, "
            "failed fills", labels=["event"])
        for event, count in sorted(pool.stats.items()):
            events.add_metric([event], count)
        yield parked
        yield target
        yield events


class NodeMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "aenv_node_http_requests",
            "HTTP requests answered, by kind (api or proxy), method and status",
            ["kind", "method", "status"],
            registry=self.registry,
        )
        self.ops = Histogram(
            "aenv_node_sandbox_operation_seconds",
            "Duration of sandbox operations (create, pause, resume, snapshot, fork, kill)",
            ["op", "outcome"],
            buckets=OP_BUCKETS,
            registry=self.registry,
        )
        self.proxy_bytes = Counter(
            "aenv_node_proxy_bytes",
            "Bytes relayed by the sandbox proxy, by direction",
            ["direction"],
            registry=self.registry,
        )

        self.gc_files = Counter(
            "aenv_node_gc_reclaimed_files",
            "Layer and snapshot files deleted by garbage collection",
            registry=self.registry,
        )
        self.gc_bytes = Counter(
            "aenv_node_gc_reclaimed_bytes",
            "Disk bytes (allocated blocks) freed by garbage collection",
            registry=self.registry,
        )
        self.gc_devices = Counter(
            "aenv_node_gc_released_devices",
            "Stray blockd devices released by garbage collection",
            registry=self.registry,
        )
        self.gc_seconds = Histogram(
            "aenv_node_gc_seconds",
            "Duration of garbage collection passes",
            buckets=OP_BUCKETS,
            registry=self.registry,
        )

    def record_gc(self, files: int, size: int, devices: int, seconds: float) -> None:
        self.gc_files.inc(files)
        self.gc_bytes.inc(size)
        self.gc_devices.inc(devices)
        self.gc_seconds.observe(seconds)

    def watch_states(self, counts: Callable[[], dict[str, int]]) -> None:
        self.registry.register(_StateCollector(counts))

    def watch_ready_pools(self, pool: Callable[[], Any]) -> None:
        self.registry.register(_ReadyPoolCollector(pool))

    def record_op(self, op: str, outcome: str, seconds: float) -> None:
        self.ops.labels(op, outcome).observe(seconds)
