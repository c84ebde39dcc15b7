"""Prometheus metrics of the node (served at GET /metrics, without an API key)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from agentenv.node.admission import RESOURCE

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


class _IdleCollector(Collector):
    """Idle pauses (node/idle.py), counted by the orchestrator and read at scrape time."""

    def __init__(self, counts: Callable[[], tuple[int, int]]) -> None:
        self._counts = counts

    def collect(self) -> Iterator[CounterMetricFamily]:
        pauses, resumes = self._counts()
        yield CounterMetricFamily(
            "aenv_node_idle_pauses", "Sandboxes the node paused after their idlePauseAfter "
            "without traffic", value=pauses)
        yield CounterMetricFamily(
            "aenv_node_idle_resumes", "Resumes of sandboxes the node had paused for idleness "
            "(by traffic, a connect, or a call that needs them running)", value=resumes)


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


class _AdmissionCollector(Collector):
    """Admission by use (node/admission.py), read at scrape time: refusals by resource and
    limit, what is requested against the ceilings and what the node would admit now, the
    host's pressure and available memory, and what the running sandboxes use (their latest
    samples, node/observer.py): requested/used is the overcommit actually reached."""

    def __init__(self, admission: Callable[[], Any], records: Callable[[], Any],
                 usage: Callable[[], tuple[float, int] | None]) -> None:
        self._admission = admission
        self._records = records
        self._usage = usage

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        admission = self._admission()
        if admission is None:
            return
        refusals = CounterMetricFamily(
            "aenv_node_admission_refusals", "Creates, resumes and forks refused (429), by "
            "resource and limit", labels=["resource", "limit"])
        for limit, count in sorted(admission.refusals.items()):
            refusals.add_metric([RESOURCE.get(limit, limit.removeprefix("team_")), limit],
                                count)
        yield refusals
        room = admission.room(list(self._records()))
        for name, what, values in (
            ("ceiling", "The ceiling on what sandboxes request (vCPUs; MiB with overhead)",
             (room.cpu_ceiling, room.memory_ceiling_mib)),
            ("requested", "What the sandboxes holding a VM request (vCPUs; MiB)",
             (room.cpu_requested, room.memory_requested_mib)),
            ("free", "What the node would admit now, the smaller of the ceiling's room and "
             "the real headroom's (vCPUs; MiB)", (room.cpu_free, room.memory_free_mib)),
        ):
            family = GaugeMetricFamily(f"aenv_node_admission_{name}", what, labels=["resource"])
            family.add_metric(["cpu"], values[0])
            family.add_metric(["memory"], values[1])
            yield family
        use = room.use
        pressure = GaugeMetricFamily(
            "aenv_node_host_pressure", "PSI some avg10 of the host, percent (none without "
            "PSI)", labels=["resource"])
        for resource, value in (("cpu", use.cpu_pressure), ("memory", use.memory_pressure)):
            if value is not None:
                pressure.add_metric([resource], value)
        yield pressure
        yield GaugeMetricFamily("aenv_node_host_memory_available_bytes",
                                "The host's MemAvailable", value=use.memory_available_mib << 20)
        yield GaugeMetricFamily("aenv_node_host_cpu_busy_ratio",
                                "Share of the host's CPU time busy over the last ~10 s",
                                value=use.cpu_busy / 100)
        used = self._usage()
        if used is not None:
            family = GaugeMetricFamily(
                "aenv_node_sandbox_usage", "What the running sandboxes use by their latest "
                "samples: CPUs busy, resident bytes", labels=["resource"])
            family.add_metric(["cpu"], used[0])
            family.add_metric(["memory"], used[1])
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

    def watch_idle(self, counts: Callable[[], tuple[int, int]]) -> None:
        """`counts()`: (idle pauses, resumes of idle-paused sandboxes) so far."""
        self.registry.register(_IdleCollector(counts))

    def watch_ready_pools(self, pool: Callable[[], Any]) -> None:
        self.registry.register(_ReadyPoolCollector(pool))

    def watch_admission(self, admission: Callable[[], Any], records: Callable[[], Any],
                        usage: Callable[[], tuple[float, int] | None]) -> None:
        self.registry.register(_AdmissionCollector(admission, records, usage))

    def record_op(self, op: str, outcome: str, seconds: float) -> None:
        self.ops.labels(op, outcome).observe(seconds)
