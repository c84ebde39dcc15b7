"""Bodies of the events, webhooks, metrics and logs routes (node/events_api.py): requests are
validated with these models and answers built through them, so the OpenAPI document
(node/openapi.py) describes what the node does."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field

from agentenv.node.events import TYPES
from agentenv.node.models import DateTime, Response, SandboxMetric, _Request

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
