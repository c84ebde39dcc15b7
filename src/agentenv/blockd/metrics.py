"""blockd's Prometheus metrics: counters per device, registered only when a metrics port is
asked for (`aenv blockd --metrics-port`), served on loopback unless `--metrics-bind` names
another address (device ids and traffic are the node's business, not its network's)."""

from __future__ import annotations

import contextlib

from agentenv.blockd.device import Device

LOOPBACK = "127.0.0.1"


class Metrics:
    def __init__(self) -> None:
        from prometheus_client import CollectorRegistry, Counter, Gauge

        self.registry = CollectorRegistry()
        self.counters = {
            name: Counter(
                f"aenv_blockd_{name}", f"NBD {name.replace('_', ' ')} per device", ["device"],
                registry=self.registry,
            )
            for name in ("reads", "writes", "bytes_read", "bytes_written", "errors")
        }
        self.counters["enospc"] = Counter(
            "aenv_blockd_enospc", "writes refused with ENOSPC: the upper reached its cap",
            ["device"], registry=self.registry,
        )
        self.devices = Gauge("aenv_blockd_devices", "devices served", registry=self.registry)

    def serve(self, port: int, bind: str = LOOPBACK) -> None:
        # lazy: prometheus_client and its HTTP server load only when metrics are asked for
        from agentenv import metrics_http

        metrics_http.serve(port, bind, self.registry)

    def count(self, device: Device, what: str, amount: int) -> None:
        counter = self.counters.get(what)
        if counter is not None:
            counter.labels(device.id).inc(amount)

    def forget(self, device_id: str) -> None:
        for counter in self.counters.values():
            with contextlib.suppress(KeyError):
                counter.remove(device_id)
