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
            "aenv_gateway_limit_refusals", "Requests refused by a team quota or a lookup "
            "rate (control/gateway/limits.py), by limit", ["limit"],
            registry=self.registry)
        # control/gateway/events.py
        self.events_collected = Counter(
            "aenv_gateway_events_collected", "Lifecycle events moved from the nodes into the "
            "cluster's Redis by this gateway's collector", registry=self.registry)
        self.webhook_attempts = Counter(
            "aenv_gateway_webhook_attempts", "Webhook delivery attempts by this gateway, by "
            "result (delivered, failed: an error or a non-2xx answer)", ["result"],
            registry=self.registry)
        self.webhook_dropped = Counter(
            "aenv_gateway_webhook_dropped", "Events a webhook skipped: its receiver was more "
            "than AENV_WEBHOOK_QUEUE events of its team behind", registry=self.registry)
        self.capacity_refusals = Counter(
            "aenv_gateway_capacity_refusals", "Creates refused for room (429): no node would "
            "take them, by the resource (cpu, memory, disk, sandboxes) most nodes refused for",
            ["resource"], registry=self.registry)
        self.placement_retries = Counter(
            "aenv_gateway_placement_retries", "Creates a node refused for room (its own "
            "admission) that the gateway handed on to the next node, by that resource",
            ["resource"], registry=self.registry)
        self.batch_spilled = Counter(
            "aenv_gateway_batch_spilled", "Children of a batch (a create with count, a fork) "
            "made on another node than the first asked, because that one had no room for them "
            "(control/gateway/batch.py), by kind (template, snapshot)", ["kind"],
            registry=self.registry)
