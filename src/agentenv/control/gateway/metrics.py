"""Prometheus metrics of the gateway (GET /metrics, no API key, as on the node)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter


class GatewayMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.signed_files = Counter(
            "aenv_gateway_signed_file_requests", "Signed file URL requests, by how their "
            "sandbox was found: the gateway's cache of signature owners, or asking the nodes",
            ["owner"], registry=self.registry)
        self.owner_queries = Counter(
            "aenv_gateway_signature_owner_queries",
            "Signature owner lookups sent to nodes (one per up node per uncached URL)",
            registry=self.registry)
        self.limit_refusals = Counter(
            "aenv_gateway_limit_refusals", "Requests refused by a team quota or the signed "
            "URL lookup rate (control/gateway/limits.py), by limit", ["limit"],
            registry=self.registry)
