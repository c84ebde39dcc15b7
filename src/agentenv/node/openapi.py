"""The node's OpenAPI 3.1 document, served at `GET /openapi.json`.

Every schema is generated from the pydantic models (`models.py`, `template_models.py`): request
bodies from those the API validates with, responses from the `Response` models the bodies are
built through, so the document and the code cannot drift apart; the route table is here.
tests/node/test_openapi.py checks every answer of a live node against the document (schemathesis). Sandbox traffic (envd behind the proxy) is not described:
it is the envd protocol (docs/e2b-api.md §3), not REST.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from pydantic import BaseModel
from pydantic.json_schema import JsonSchemaMode, JsonSchemaValue, models_json_schema

from agentenv import __version__
from agentenv.node import event_models as em
from agentenv.node import models
from agentenv.node import template_models as tpl
from agentenv.node.events import TYPES

REF = "#/components/schemas/{model}"


_STR = {"type": "string"}
_INT = {"type": "integer"}

#: a response body: a model, a JSON array of one model ([Model]), one of several of those
#: (a tuple: the request decides which), or none
One = type[BaseModel] | list[type[BaseModel]]
Body = One | tuple[One, ...] | None
#: (model, "validation" for a request or "serialization" for a response) -> its $ref
Refs = dict[tuple[Any, JsonSchemaMode], JsonSchemaValue]

def _query(name: str, schema: dict[str, Any], description: str = "") -> dict[str, Any]:
    param: dict[str, Any] = {"name": name, "in": "query", "required": False, "schema": schema}
    if description:
        param["description"] = description
    return param


_LIMIT = _query("limit", {"type": "integer", "minimum": 1, "maximum": 100})
_NEXT = _query("nextToken", _STR, "the X-Next-Token header of the previous page")
_SANDBOX_FILTERS = [
    _query("metadata", _STR, "k=v&k2=v2, URL-encoded once more"),
    _query("state", _STR, "comma-separated running,paused"),
    _query("template", _STR),
    _query("startedAfter", {"type": "string", "format": "date-time"}),
]
_EVENT_QUERY = [
    _query("offset", {"type": "integer", "minimum": 0}),
    _query("limit", {"type": "integer", "minimum": 1, "maximum": 100}),
    _query("orderAsc", {"type": "boolean"}),
    _query("types", {"type": "array", "items": {"enum": list(TYPES)}}, "repeated"),
    _query("after", {"type": "integer", "minimum": 0}, "only events with a greater seq"),
]


@dataclass(frozen=True)
class Operation:
    method: str
    path: str
    operation_id: str
    summary: str
    responses: dict[int, Body]  # status -> what the answer's body is
    body: type[BaseModel] | None = None
    body_required: bool = False
    query: list[dict[str, Any]] = field(default_factory=list)
    public: bool = False
    headers: dict[int, list[str]] = field(default_factory=dict)
    raw_body: str | None = None  # a request body of this media type, not JSON (uploads)


_E = {401: models.Error}
_NF = {401: models.Error, 404: models.Error}
_BODY_ERRORS = {400: models.Error, 413: models.Error, 422: models.Error}
# Admission control (node/admission.py): 429 node limits, 503 host short.
_ADMISSION = {429: models.Error, 503: models.Error}

ROUTES: list[Operation] = [
    Operation("get", "/health", "health", "Liveness (503 with the reason: blockd down)",
              {200: models.Health, 503: models.Unhealthy}, public=True),
    Operation("get", "/openapi.json", "openapi", "This document", {200: None}, public=True),
    Operation(
        "post",
        "/v2/sandboxes",
        "createSandboxV2",
        "Create a sandbox (SDK 2.46+, TS 2.x); with count (extension) a batch: a "
        "SandboxForkResult per sandbox",
        {201: (models.Sandbox, [models.ForkResult]), **_NF, **_BODY_ERRORS, **_ADMISSION},
        body=models.NewSandbox,
        body_required=True,
    ),
    Operation(
        "post",
        "/sandboxes",
        "createSandbox",
        "Create a sandbox (legacy, SDK 2.0-2.45); with count (extension) a batch",
        {201: (models.Sandbox, [models.ForkResult]), **_NF, **_BODY_ERRORS, **_ADMISSION},
        body=models.NewSandbox,
        body_required=True,
    ),
    Operation(
        "get",
        "/v2/sandboxes",
        "listSandboxesV2",
        "List running and paused sandboxes, paged by X-Next-Token",
        {200: [models.ListedSandbox], 400: models.Error, **_E},
        query=[*_SANDBOX_FILTERS, _LIMIT, _NEXT, _query("order", {"enum": ["asc", "desc"]})],
        headers={200: ["X-Next-Token", "X-Total-Running"]},
    ),
    Operation(
        "get",
        "/sandboxes",
        "listSandboxes",
        "List running sandboxes (legacy v1)",
        {200: [models.ListedSandbox], 400: models.Error, **_E},
        query=_SANDBOX_FILTERS,
    ),
    Operation(
        "get",
        "/sandboxes/{sandboxID}",
        "getSandbox",
        "Sandbox detail",
        {200: models.SandboxDetail, **_NF},
    ),
    Operation(
        "delete",
        "/sandboxes/{sandboxID}",
        "killSandbox",
        "Kill (running or paused)",
        {204: None, **_NF},
    ),
    Operation(
        "post",
        "/sandboxes/{sandboxID}/timeout",
        "setSandboxTimeout",
        "End the sandbox this many seconds from now",
        {204: None, **_NF, **_BODY_ERRORS, 409: models.Error},
        body=models.TimeoutRequest,
        body_required=True,
    ),
    Operation(
        "post",
        "/sandboxes/{sandboxID}/refreshes",
        "refreshSandbox",
        "Extend the TTL (legacy v1 keep-alive)",
        {204: None, **_NF, **_BODY_ERRORS, 409: models.Error},
        body=models.RefreshRequest,
    ),
    Operation(
        "post",
        "/sandboxes/{sandboxID}/pause",
        "pauseSandbox",
        "Pause; 409 when already paused",
        {204: None, **_NF, **_BODY_ERRORS, 409: models.Error},
        body=models.PauseRequest,
    ),
    Operation(
        "post",
        "/sandboxes/{sandboxID}/resume",
        "resumeSandbox",
        "Resume (legacy, SDK 2.0-2.5); 409 when running",
        {201: models.Sandbox, **_NF, **_BODY_ERRORS, 409: models.Error, **_ADMISSION},
        body=models.ResumeRequest,
    ),
    Operation(
        "post",
        "/sandboxes/{sandboxID}/connect",
        "connectSandbox",
        "Connect: 200 running (TTL extended), 201 resumed (legacy, SDK 2.6-2.45)",
        {200: models.Sandbox, 201: models.Sandbox, **_NF, **_BODY_ERRORS, 409: models.Error,
         **_ADMISSION},
        body=models.ConnectV1Request,
        body_required=True,
    ),
    Operation(
        "post",
        "/v2/sandboxes/{sandboxID}/connect",
        "connectSandboxV2",
        "Connect: 200 running (TTL extended), 201 resumed",
        {200: models.Sandbox, 201: models.Sandbox, **_NF, **_BODY_ERRORS, 409: models.Error,
         **_ADMISSION},
        body=models.ConnectV2Request,
    ),
    Operation(
        "get",
        "/sandboxes/{sandboxID}/metrics",
        "getSandboxMetrics",
        "CPU, memory and disk samples",
        {200: [models.SandboxMetric], 400: models.Error, **_NF},
        query=[_query("start", _INT, "unix seconds"), _query("end", _INT, "unix seconds")],
    ),
    Operation("get", "/sandboxes/metrics", "getSandboxesMetrics",
              "The latest sample of each named sandbox (node/observer.py)",
              {200: em.SandboxesWithMetrics, 400: models.Error, **_E},
              query=[{**_query("sandbox_ids", {"type": "string", "minLength": 1},
                               "comma-separated, at most 100"), "required": True}]),
    Operation("get", "/sandboxes/{sandboxID}/logs", "getSandboxLogs",
              "Console or envd lines from start (unix ms), oldest first",
              {200: em.SandboxLogs, 400: models.Error, **_NF},
              query=[_query("start", {"type": "integer", "minimum": 0}),
                     _query("limit", {"type": "integer", "minimum": 0, "maximum": 1000})]),
    Operation("get", "/v2/sandboxes/{sandboxID}/logs", "getSandboxLogsV2",
              "Console or envd lines from cursor (unix ms), either direction, filtered",
              {200: em.SandboxLogsV2, 400: models.Error, **_NF},
              query=[_query("cursor", {"type": "integer", "minimum": 0}),
                     _query("limit", {"type": "integer", "minimum": 0, "maximum": 1000}),
                     _query("direction", {"enum": ["forward", "backward"]}),
                     _query("level", {"enum": ["debug", "info", "warn", "error"]}),
                     _query("search", {"type": "string", "maxLength": 256})]),
    Operation(
        "post",
        "/sandboxes/{sandboxID}/snapshots",
        "createSnapshot",
        "Snapshot a running sandbox into a template",
        {201: models.SnapshotInfo, **_NF, **_BODY_ERRORS, 409: models.Error},
        body=models.SnapshotRequest,
    ),
    Operation(
        "post",
        "/sandboxes/{sandboxID}/fork",
        "forkSandbox",
        "Fork a sandbox into count children: a running one from a checkpoint in place, a "
        "paused one from its pause snapshot (it stays paused)",
        {201: [models.ForkResult], **_NF, **_BODY_ERRORS, 409: models.Error, **_ADMISSION},
        body=models.ForkRequest,
    ),
    Operation(
        "post",
        "/sandboxes/{sandboxID}/rollback",
        "rollbackSandbox",
        "Restore a sandbox in place to one of its snapshots (or its last pause); it runs "
        "afterwards with a new envd token (extension)",
        {200: models.Sandbox, **_NF, **_BODY_ERRORS, 409: models.Error, **_ADMISSION},
        body=models.RollbackRequest,
    ),
    Operation(
        "get",
        "/sandboxes/{sandboxID}/children",
        "listSandboxChildren",
        "Sandboxes forked from this one (extension: lineage)",
        {200: [models.ListedSandbox], **_NF},
    ),
    Operation(
        "put",
        "/sandboxes/{sandboxID}/network",
        "updateSandboxNetwork",
        "Replace the egress policy (VM backend; the process backend refuses non-default ones)",
        {204: None, **_NF, **_BODY_ERRORS},
        body=models.NetworkUpdate,
    ),
    Operation(
        "get",
        "/snapshots",
        "listSnapshots",
        "Snapshots, newest first, paged by X-Next-Token",
        {200: [models.SnapshotInfo], 400: models.Error, **_E},
        query=[_query("sandboxID", _STR), _query("name", _STR), _LIMIT, _NEXT],
        headers={200: ["X-Next-Token"]},
    ),
    Operation(
        "post",
        "/snapshots/{snapshotID}/fork",
        "forkSnapshot",
        "count sandboxes from a snapshot, a result each (extension: batch create)",
        {201: [models.ForkResult], **_NF, **_BODY_ERRORS, **_ADMISSION},
        body=models.ForkRequest,
    ),
    Operation(
        "get",
        "/snapshots/{snapshotID}/children",
        "listSnapshotChildren",
        "Sandboxes made from this snapshot (extension: lineage)",
        {200: [models.ListedSandbox], **_NF},
    ),
    Operation(
        "get",
        "/snapshots/{snapshotID}",
        "getSnapshot",
        "One snapshot",
        {200: models.SnapshotInfo, **_NF},
    ),
    Operation("get", "/templates", "listTemplates", "Templates", {200: [models.Template], **_E}),
    Operation(
        "get",
        "/v2/templates",
        "listTemplatesV2",
        "Templates, paged by X-Next-Token",
        {200: [models.Template], 400: models.Error, **_E},
        query=[_LIMIT, _NEXT],
        headers={200: ["X-Next-Token"]},
    ),
    Operation(
        "get",
        "/templates/aliases/{alias}",
        "getTemplateByAlias",
        "Resolve a template alias",
        {200: models.TemplateAlias, **_NF},
    ),
    Operation(
        "get",
        "/templates/{templateID}",
        "getTemplate",
        "One template or snapshot",
        {200: models.TemplateDetail, **_NF},
    ),
    Operation(
        "delete",
        "/templates/{templateID}",
        "deleteTemplate",
        "Delete a template or snapshot; 409 while sandboxes use it",
        {204: None, **_NF, 400: models.Error, 409: models.Error},
    ),
    # The E2B template build API (node/template_api.py; docs/e2b-api.md §1.7). A node whose
    # backend cannot boot build VMs (the process backend) refuses createTemplateV3 with 400.
    Operation(
        "post",
        "/v3/templates",
        "createTemplateV3",
        "Request a template build (SDK Template.build); 400 without a VM backend",
        {202: tpl.TemplateRequestResponseV3, **_E, **_BODY_ERRORS, 409: models.Error},
        body=tpl.TemplateBuildRequestV3,
        body_required=True,
    ),
    Operation(
        "get",
        "/templates/{templateID}/files/{hash}",
        "getTemplateFilesUploadLink",
        "Whether a COPY step's files (a tar named by hash) are on the node, else an upload URL",
        {201: tpl.TemplateBuildFileUpload, **_NF, 400: models.Error},
    ),
    Operation(
        "put",
        tpl.UPLOAD_PREFIX + "{templateID}/{hash}",
        "uploadTemplateFiles",
        "The upload URL handed out above: a signed, expiring URL (no API key)",
        {200: None, 403: models.Error, 413: models.Error},
        query=[_query("expires", _INT, "unix seconds"), _query("signature", _STR)],
        public=True,
        raw_body="application/octet-stream",
    ),
    Operation(
        "post",
        "/v2/templates/{templateID}/builds/{buildID}",
        "startTemplateBuildV2",
        "Start a requested build: the steps run in a build VM in the background",
        {202: None, **_NF, **_BODY_ERRORS},
        body=tpl.TemplateBuildStartV2,
        body_required=True,
    ),
    Operation(
        "get",
        "/templates/{templateID}/builds/{buildID}/status",
        "getTemplateBuildStatus",
        "A build's status and its log from logsOffset (100 entries per call)",
        {200: tpl.TemplateBuildInfo, **_NF, 400: models.Error},
        query=[_query("logsOffset", {"type": "integer", "minimum": 0})],
    ),
    Operation(
        "get",
        "/templates/{templateID}/tags",
        "getTemplateTags",
        "A template's tags and the builds they name ('default': what the bare name means)",
        {200: [tpl.TemplateTag], **_NF, 400: models.Error},
    ),
    Operation(
        "post",
        "/templates/tags",
        "assignTemplateTags",
        "Point tags at the build target ('name:tag', or 'name' for default) names",
        {201: tpl.AssignedTemplateTags, **_NF, **_BODY_ERRORS},
        body=tpl.AssignTemplateTagsRequest,
        body_required=True,
    ),
    Operation(
        "delete",
        "/templates/tags",
        "deleteTemplateTags",
        "Remove tags of a template (absent ones are ignored; 'default' cannot go)",
        {204: None, **_NF, **_BODY_ERRORS},
        body=tpl.DeleteTemplateTagsRequest,
        body_required=True,
    ),
    # Lifecycle events and webhooks (node/events_api.py), E2B's /events API.
    Operation("get", "/events/sandboxes", "listSandboxEvents",
              "The team's lifecycle events, newest first unless orderAsc",
              {200: [em.SandboxEvent], 400: models.Error, **_E}, query=_EVENT_QUERY),
    Operation("get", "/events/sandboxes/{sandboxID}", "listSandboxEventsOfSandbox",
              "One sandbox's lifecycle events (kept for the retention after it ended)",
              {200: [em.SandboxEvent], 400: models.Error, **_E}, query=_EVENT_QUERY),
    Operation("get", "/events/webhooks", "listWebhooks", "The team's webhooks",
              {200: [em.Webhook], **_E}),
    Operation("post", "/events/webhooks", "createWebhook",
              "Register a webhook: events POSTed to url, signed with signatureSecret",
              {201: em.Webhook, **_E, **_BODY_ERRORS}, body=em.NewWebhook, body_required=True),
    Operation("get", "/events/webhooks/{webhookID}", "getWebhook", "One webhook",
              {200: em.Webhook, **_NF}),
    Operation("patch", "/events/webhooks/{webhookID}", "updateWebhook",
              "Change the fields given", {200: em.Webhook, **_NF, **_BODY_ERRORS},
              body=em.WebhookUpdate, body_required=True),
    Operation("delete", "/events/webhooks/{webhookID}", "deleteWebhook", "Unregister",
              {200: None, **_NF}),
    Operation("get", "/events/webhooks/{webhookID}/deliveries", "listWebhookDeliveries",
              "The webhook's delivery attempts, newest first",
              {200: [em.WebhookAttempt], 400: models.Error, **_NF},
              query=[_query("limit", {"type": "integer", "minimum": 1, "maximum": 1000})]),
    Operation("get", "/nodes", "listNodes", "This node", {200: [models.Node], **_E}),
    Operation("get", "/nodes/{nodeID}", "getNode", "This node by id", {200: models.Node, **_NF}),
]


def _one_schema(body: One, refs: Refs) -> dict[str, Any]:
    return ({"type": "array", "items": refs[(body[0], "serialization")]}
            if isinstance(body, list) else refs[(body, "serialization")])


def _models(body: Body) -> list[type[BaseModel]]:
    """The models a response body is made of."""
    ones = body if isinstance(body, tuple) else () if body is None else (body,)
    return [one[0] if isinstance(one, list) else one for one in ones]


def _response(status: int, body: Body, headers: list[str], refs: Refs) -> dict[str, Any]:
    out: dict[str, Any] = {"description": str(status)}
    if body is not None:
        schema = ({"oneOf": [_one_schema(one, refs) for one in body]}
                  if isinstance(body, tuple) else _one_schema(body, refs))
        out["content"] = {"application/json": {"schema": schema}}
    if headers:
        out["headers"] = {h: {"schema": _STR} for h in headers}
    return out


def _operation(op: Operation, refs: Refs) -> dict[str, Any]:
    params = list(op.query)
    for name in (p[1:-1] for p in op.path.split("/") if p.startswith("{")):
        params.append(
            {
                "name": name,
                "in": "path",
                "required": True,
                "schema": {"type": "string", "minLength": 1},
            }
        )
    out: dict[str, Any] = {
        "operationId": op.operation_id,
        "summary": op.summary,
        "responses": {
            str(status): _response(status, body, op.headers.get(status, []), refs)
            for status, body in sorted(op.responses.items())
        },
    }
    if params:
        out["parameters"] = params
    if op.public:
        out["security"] = []
    if op.raw_body is not None:
        out["requestBody"] = {
            "required": True,
            "content": {op.raw_body: {"schema": {"type": "string", "format": "binary"}}},
        }
    if op.body is not None:
        out["requestBody"] = {
            "required": op.body_required,
            "content": {"application/json": {"schema": refs[(op.body, "validation")]}},
        }
    return out


def _schemas() -> tuple[Refs, dict[str, Any]]:
    """Every model the routes name, with the models they nest, as components/schemas (one
    pydantic run, so that a nested model is one schema however many bodies use it)."""
    used: dict[tuple[type[BaseModel], JsonSchemaMode], None] = {}  # ordered set
    for op in ROUTES:
        if op.body is not None:
            used[(op.body, "validation")] = None
        for body in op.responses.values():
            for model in _models(body):
                used[(model, "serialization")] = None
    refs, top = models_json_schema(list(used), ref_template=REF)
    return dict(refs), dict(top.get("$defs", {}))


@lru_cache(maxsize=1)
def openapi_document() -> dict[str, Any]:
    refs, schemas = _schemas()
    paths: dict[str, dict[str, Any]] = {}
    for op in ROUTES:
        paths.setdefault(op.path, {})[op.method] = _operation(op, refs)
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "agentenv node API (E2B-compatible control plane)",
            "version": __version__,
            "description": (
                "Every non-2xx answer is JSON {code, message} with code equal to the HTTP status. "
                "Sandbox traffic (requests with an E2b-Sandbox-Id header) goes to envd instead."
            ),
        },
        "security": [{"ApiKeyAuth": []}],
        "paths": paths,
        "components": {
            "securitySchemes": {
                "ApiKeyAuth": {"type": "apiKey", "in": "header", "name": "X-API-KEY"}
            },
            "schemas": schemas,
        },
    }
