"""Bodies of the events, webhooks, metrics and logs routes (node/events_api.py): requests are
validated with these models and answers built through them, so the OpenAPI document
(api/openapi.py) describes what the node does."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from agentenv.api.models import DateTime, Response, SandboxMetric, _Request

# E2B's types (packages/shared/pkg/events in e2b-dev/infra), then this node's own.
CREATED = "sandbox.lifecycle.created"
KILLED = "sandbox.lifecycle.killed"
PAUSED = "sandbox.lifecycle.paused"
RESUMED = "sandbox.lifecycle.resumed"
UPDATED = "sandbox.lifecycle.updated"
CHECKPOINTED = "sandbox.lifecycle.checkpointed"  # a snapshot
FORKED = "sandbox.lifecycle.forked"  # a fork's child; eventData.source_sandbox_id
FAILED = "sandbox.lifecycle.failed"  # eventData.operation and .reason
ROLLED_BACK = "sandbox.lifecycle.rolled_back"  # restored in place to one of its snapshots
BUILD_STARTED = "template.build.started"
BUILD_FINISHED = "template.build.finished"
BUILD_FAILED = "template.build.failed"
TEMPLATE_PREFIX = "template."
TYPES = (CREATED, KILLED, PAUSED, RESUMED, UPDATED, CHECKPOINTED, FORKED, FAILED, ROLLED_BACK,
         BUILD_STARTED, BUILD_FINISHED, BUILD_FAILED)

EventType = Literal[TYPES]  # type: ignore[valid-type]


class NewWebhook(_Request):
    name: str = Field(default="", max_length=200)
    url: str = Field(min_length=1, max_length=2048)
    events: list[EventType] = Field(min_length=1, max_length=len(TYPES))
    enabled: bool = True
    signatureSecret: str = Field(min_length=1, max_length=256)


class WebhookUpdate(_Request):
    name: str | None = Field(default=None, max_length=200)
    url: str | None = Field(default=None, min_length=1, max_length=2048)
    events: list[EventType] | None = Field(default=None, min_length=1, max_length=len(TYPES))
    enabled: bool | None = None
    signatureSecret: str | None = Field(default=None, min_length=1, max_length=256)


class Webhook(Response):
    id: str
    teamID: str
    name: str
    createdAt: DateTime
    enabled: bool
    url: str
    events: list[str]
    queued: int
    dropped: int


class WebhookAttempt(Response):
    deliveryId: str
    eventId: str
    eventType: str
    attempt: int
    timestamp: DateTime
    status: int | None
    error: str | None
    seconds: float
    delivered: bool


class SandboxEvent(Response):
    version: str
    id: str
    seq: int
    type: str
    eventData: dict[str, Any] | None
    sandboxBuildId: str
    sandboxExecutionId: str
    sandboxId: str
    sandboxTeamId: str
    sandboxTemplateId: str
    nodeId: str
    timestamp: DateTime


#: how many sandboxes GET /sandboxes/metrics names at the most
MAX_METRICS_BATCH = 100


class SandboxesWithMetrics(Response):
    sandboxes: dict[str, SandboxMetric]


class SandboxLog(Response):
    timestamp: DateTime
    line: str


class SandboxLogEntry(Response):
    timestamp: DateTime
    message: str
    level: Literal["debug", "info", "warn", "error"]
    fields: dict[str, str]


class SandboxLogs(Response):
    logs: list[SandboxLog]
    logEntries: list[SandboxLogEntry]


class SandboxLogsV2(Response):
    logs: list[SandboxLogEntry]
