"""Prometheus metrics of the scheduler, served on their own port (`aenv scheduler
--metrics-port`, loopback unless `--metrics-bind` says otherwise, as blockd's): calls by method
and status code with their service time (counted where every call passes, the caller's check in
control/scheduler/auth.py), and the nodes and bindings the scheduler holds, read at scrape
time."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Iterator
from typing import Any
from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry
from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from agentenv import metrics_http
from agentenv.control.scheduler.service import SchedulerService
from agentenv.control.scheduler.store import now_ms

LOOPBACK = "127.0.0.1"
# a call is answered from memory in tens of microseconds, a write waits for Redis
CALL_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25,
                1.0, 5.0)


class _StateCollector(Collector):
    def __init__(self, service: SchedulerService) -> None:
        self._service = service

    def collect(self) -> Iterator[GaugeMetricFamily]:
        up, down = self._service.up_nodes(now_ms())
        nodes = GaugeMetricFamily("aenv_scheduler_nodes", "Nodes the scheduler knows, up or down",
                                  labels=["state"])
        nodes.add_metric(["up"], len(up))
        nodes.add_metric(["down"], len(down))
        yield nodes
        yield GaugeMetricFamily("aenv_scheduler_bindings", "Sandbox -> node bindings held",
                                value=len(self._service.bindings))


class _CallCollector(Collector):
    """The call counters and service-time histograms, from SchedulerMetrics' plain numbers:
    prometheus_client's Counter.inc and Histogram.observe take a lock per value changed (3-4 us a
    call here, on the event loop of every RPC); these are plain ints the loop alone changes,
    read at scrape time."""

    def __init__(self, metrics: SchedulerMetrics) -> None:
        self._metrics = metrics

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

        m = self._metrics
        calls = CounterMetricFamily(
            "aenv_scheduler_calls", "RPCs answered, by method and gRPC status code "
            "(UNAUTHENTICATED: a caller without the cluster's credential)",
            labels=["method", "code"])
        for (method, code), count in sorted(m.calls.items()):
            calls.add_metric([method, code], count[0])
        yield calls
        seconds = HistogramMetricFamily(
            "aenv_scheduler_call_seconds", "Service time of the RPCs that passed the caller's "
            "check, by method", labels=["method"])
        for method, (counts, total) in sorted(m.seconds.items()):
            cumulative, buckets = 0, []
            for bound, count in zip((*CALL_BUCKETS, float("inf")), counts, strict=True):
                cumulative += count
                buckets.append((floatToGoString(bound), cumulative))
            seconds.add_metric([method], buckets, total[0])
        yield seconds


class SchedulerMetrics:
    def __init__(self) -> None:
        self._http: WSGIServer | None = None
        self.registry = CollectorRegistry()
        #: (method, code) -> [calls]; method -> ([per bucket, +Inf last], [seconds]): changed
        #: by `observe` on the event loop only
        self.calls: dict[tuple[str, str], list[int]] = {}
        self.seconds: dict[str, tuple[list[int], list[float]]] = {}
        self.registry.register(_CallCollector(self))

    def watch(self, service: SchedulerService) -> None:
        self.registry.register(_StateCollector(service))

    def observe(self, method: str, code: str, seconds: float | None) -> None:
        call = self.calls.get((method, code))
        if call is None:
            call = self.calls[(method, code)] = [0]
        call[0] += 1
        if seconds is not None:
            timing = self.seconds.get(method)
            if timing is None:
                timing = self.seconds[method] = ([0] * (len(CALL_BUCKETS) + 1), [0.0])
            timing[0][bisect_left(CALL_BUCKETS, seconds)] += 1
            timing[1][0] += seconds

    def serve(self, port: int, bind: str = LOOPBACK) -> None:
        self._http = metrics_http.serve(port, bind, self.registry)

    def close(self) -> None:
        http = self._http
        if http is not None:
            http.shutdown()
            http.server_close()
            self._http = None
