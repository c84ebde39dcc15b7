"""Prometheus metrics of the node (served at GET /metrics, without an API key)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import GaugeMetricFamily
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

    def record_op(self, op: str, outcome: str, seconds: float) -> None:
        self.ops.labels(op, outcome).observe(seconds)
