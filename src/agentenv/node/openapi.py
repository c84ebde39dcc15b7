"""The node's OpenAPI 3.1 document, served at `GET /openapi.json`.

Request bodies come from the pydantic models the API validates with (`models.py`), so the document
and the validation cannot drift apart. Responses are the dicts `models.py` builds; their schemas are
written out here, next to the route table, and tests/node/test_openapi.py checks every answer of a
live node against them (schemathesis). Sandbox traffic (envd behind the proxy) is not described:
it is the envd protocol (docs/e2b-api.md §3), not REST.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from pydantic import BaseModel

from agentenv import __version__
from agentenv.node import models
from agentenv.node import template_models as tpl

REF = "#/components/schemas/{model}"


def _ref(name: str) -> dict[str, Any]:
    return {"$ref": REF.format(model=name)}


def _array(name: str) -> dict[str, Any]:
    return {"type": "array", "items": _ref(name)}


_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_NULLABLE_STRING = {"type": ["string", "null"]}
_INT = {"type": "integer"}
_STR = {"type": "string"}
_BOOL = {"type": "boolean"}

# Response schemas: what models.*_json() produce.
RESPONSE_SCHEMAS: dict[str, dict[str, Any]] = {
    "Error": {
        "type": "object",
        "required": ["code", "message"],
        "properties": {"code": _INT, "message": _STR},
    },
    "Health": {
        "type": "object",
        "required": ["status", "version"],
        "properties": {"status": {"const": "ok"}, "version": _STR},
    },
    "Unhealthy": {
        "type": "object",
        "required": ["status", "reason", "version"],
        "properties": {"status": {"const": "unhealthy"}, "reason": _STR, "version": _STR},
    },
    "Sandbox": {
        "type": "object",
        "required": ["templateID", "sandboxID", "clientID", "envdVersion"],
        "properties": {
            "templateID": _STR,
            "sandboxID": {"type": "string", "pattern": "^[a-z0-9]+$"},
            "clientID": _STR,
            "envdVersion": _STR,
            "envdAccessToken": _STR,
            "trafficAccessToken": _NULLABLE_STRING,
            "domain": _NULLABLE_STRING,
            "alias": _STR,
        },
    },
    "ListedSandbox": {
        "type": "object",
        "required": [
            "templateID",
            "sandboxID",
            "clientID",
            "startedAt",
            "endAt",
            "envdVersion",
            "cpuCount",
            "memoryMB",
            "diskSizeMB",
            "state",
        ],
        "properties": {
            "templateID": _STR,
            "sandboxID": _STR,
            "clientID": _STR,
            "alias": _STR,
            "startedAt": {"type": "string", "format": "date-time"},
            "endAt": {"type": "string", "format": "date-time"},
            "envdVersion": _STR,
            "cpuCount": _INT,
            "memoryMB": _INT,
            "diskSizeMB": _INT,
            "state": {"enum": ["running", "paused"]},
            "metadata": _STRING_MAP,
        },
    },
    "SandboxDetail": {
        "allOf": [
            _ref("ListedSandbox"),
            {
                "type": "object",
                "required": ["lifecycle"],
                "properties": {
                    "envdAccessToken": _STR,
                    "allowInternetAccess": {"type": ["boolean", "null"]},
                    "domain": _NULLABLE_STRING,
                    "network": {"type": "object"},
                    "pauseMode": {"enum": ["full", "filesystem"]},
                    "lifecycle": {
                        "type": "object",
                        "required": ["autoResume", "onTimeout"],
                        "properties": {
                            "autoResume": _BOOL,
                            "onTimeout": {"enum": ["kill", "pause"]},
                        },
                    },
                },
            },
        ]
    },
    "SandboxMetric": {
        "type": "object",
        "required": [
            "timestamp",
            "timestampUnix",
            "cpuCount",
            "cpuUsedPct",
            "memUsed",
            "memTotal",
            "memCache",
            "diskUsed",
            "diskTotal",
        ],
        "properties": {
            "timestamp": {"type": "string", "format": "date-time"},
            "timestampUnix": _INT,
            "cpuCount": _INT,
            "cpuUsedPct": {"type": "number"},
            "memUsed": _INT,
            "memTotal": _INT,
            "memCache": _INT,
            "diskUsed": _INT,
            "diskTotal": _INT,
        },
    },
    "SnapshotInfo": {
        "type": "object",
        "required": ["snapshotID", "names"],
        "properties": {
            "snapshotID": _STR,
            "names": {"type": "array", "items": _STR},
            "sandboxID": _NULLABLE_STRING,
            "cpuCount": _INT,
            "memoryMB": _INT,
            "diskSizeMB": _INT,
            "createdAt": {"type": "string", "format": "date-time"},
            "updatedAt": {"type": "string", "format": "date-time"},
        },
    },
    "ForkResult": {
        "type": "object",
        "properties": {"sandbox": _ref("Sandbox"), "error": _ref("Error")},
    },
    "Template": {
        "type": "object",
        "required": [
            "templateID",
            "buildID",
            "cpuCount",
            "memoryMB",
            "diskSizeMB",
            "public",
            "aliases",
            "names",
            "createdAt",
            "updatedAt",
            "createdBy",
            "lastSpawnedAt",
            "spawnCount",
            "buildCount",
            "envdVersion",
            "buildStatus",
        ],
        "properties": {
            "templateID": _STR,
            "buildID": _STR,
            "cpuCount": _INT,
            "memoryMB": _INT,
            "diskSizeMB": _INT,
            "public": _BOOL,
            "aliases": {"type": "array", "items": _STR},
            "names": {"type": "array", "items": _STR},
            "createdAt": {"type": "string", "format": "date-time"},
            "updatedAt": {"type": "string", "format": "date-time"},
            "createdBy": {"type": ["object", "null"]},
            "lastSpawnedAt": {"type": ["string", "null"]},
            "spawnCount": _INT,
            "buildCount": _INT,
            "envdVersion": _NULLABLE_STRING,
            "buildStatus": _STR,
        },
    },
    "TemplateDetail": {
        "allOf": [
            _ref("Template"),
            {
                "type": "object",
                "required": ["builds"],
                "properties": {"builds": {"type": "array", "items": {"type": "object"}}},
            },
        ]
    },
    "TemplateAlias": {
        "type": "object",
        "required": ["templateID", "public"],
        "properties": {"templateID": _STR, "public": _BOOL},
    },
    "TemplateRequestResponseV3": {
        "type": "object",
        "required": ["templateID", "buildID", "public", "names", "tags", "aliases"],
        "properties": {
            "templateID": _STR,
            "buildID": _STR,
            "public": _BOOL,
            "names": {"type": "array", "items": _STR},
            "tags": {"type": "array", "items": _STR},
            "aliases": {"type": "array", "items": _STR},
        },
    },
    "TemplateBuildFileUpload": {
        "type": "object",
        "required": ["present"],
        "properties": {"present": _BOOL, "url": _STR, "headers": _STRING_MAP},
    },
    "BuildLogEntry": {
        "type": "object",
        "required": ["timestamp", "message", "level"],
        "properties": {
            "timestamp": {"type": "string", "format": "date-time"},
            "message": _STR,
            "level": {"enum": ["debug", "info", "warn", "error"]},
            "step": _STR,
        },
    },
    "BuildStatusReason": {
        "type": "object",
        "required": ["message"],
        "properties": {
            "message": _STR,
            "step": _STR,
            "logEntries": {"type": "array", "items": _ref("BuildLogEntry")},
        },
    },
    "TemplateBuildInfo": {
        "type": "object",
        "required": ["templateID", "buildID", "status", "logs", "logEntries"],
        "properties": {
            "templateID": _STR,
            "buildID": _STR,
            "status": {"enum": ["building", "waiting", "ready", "error"]},
            "logs": {"type": "array", "items": _STR},
            "logEntries": {"type": "array", "items": _ref("BuildLogEntry")},
            "reason": _ref("BuildStatusReason"),
        },
    },
    "TemplateTag": {
        "type": "object",
        "required": ["tag", "buildID", "createdAt"],
        "properties": {
            "tag": _STR,
            "buildID": _STR,
            "createdAt": {"type": "string", "format": "date-time"},
        },
    },
    "AssignedTemplateTags": {
        "type": "object",
        "required": ["tags", "buildID"],
        "properties": {"tags": {"type": "array", "items": _STR}, "buildID": _STR},
    },
    "Node": {
        "type": "object",
        "required": ["id", "nodeID", "version", "status", "backend", "sandboxCount", "metrics"],
        "properties": {
            "id": _STR,
            "nodeID": _STR,
            "version": _STR,
            "status": _STR,
            "backend": _STR,
            "sandboxCount": _INT,
            "metrics": {"type": "object"},
        },
    },
}


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


@dataclass(frozen=True)
class Operation:
    method: str
    path: str
    operation_id: str
    summary: str
    responses: dict[int, str | None]  # status -> schema name, "[Name]" for an array, None = empty
    body: type[BaseModel] | None = None
    body_required: bool = False
    query: list[dict[str, Any]] = field(default_factory=list)
    public: bool = False
    headers: dict[int, list[str]] = field(default_factory=dict)
    raw_body: str | None = None  # a request body of this media type, not JSON (uploads)


_E = {401: "Error"}
_NF = {401: "Error", 404: "Error"}
_BODY_ERRORS = {400: "Error", 413: "Error", 422: "Error"}
# Admission control (node/admission.py): 429 node limits, 503 host short.
_ADMISSION = {429: "Error", 503: "Error"}

ROUTES: list[Operation] = [
    Operation("get", "/health", "health", "Liveness (503 with the reason: blockd down)",
              {200: "Health", 503: "Unhealthy"}, public=True),
    Operation("get", "/openapi.json", "openapi", "This document", {200: None}, public=True),
    Operation(
        "post",
        "/v2/sandboxes",
        "createSandboxV2",
        "Create a sandbox (SDK 2.46+, TS 2.x)",
        {201: "Sandbox", **_NF, **_BODY_ERRORS, **_ADMISSION},
        body=models.NewSandbox,
        body_required=True,
    ),
    Operation(
        "post",
        "/sandboxes",
        "createSandbox",
        "Create a sandbox (legacy, SDK 2.0-2.45)",
        {201: "Sandbox", **_NF, **_BODY_ERRORS, **_ADMISSION},
        body=models.NewSandbox,
        body_required=True,
    ),
    Operation(
        "get",
        "/v2/sandboxes",
        "listSandboxesV2",
        "List running and paused sandboxes, paged by X-Next-Token",
        {200: "[ListedSandbox]", 400: "Error", **_E},
        query=[*_SANDBOX_FILTERS, _LIMIT, _NEXT, _query("order", {"enum": ["asc", "desc"]})],
        headers={200: ["X-Next-Token", "X-Total-Running"]},
    ),
    Operation(
        "get",
        "/sandboxes",
        "listSandboxes",
        "List running sandboxes (legacy v1)",
        {200: "[ListedSandbox]", 400: "Error", **_E},
        query=_SANDBOX_FILTERS,
    ),
    Operation(
        "get",
        "/sandboxes/{sandboxID}",
        "getSandbox",
        "Sandbox detail",
        {200: "SandboxDetail", **_NF},
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
        {204: None, **_NF, **_BODY_ERRORS, 409: "Error"},
        body=models.TimeoutRequest,
        body_required=True,
    ),
    Operation(
        "post",
        "/sandboxes/{sandboxID}/refreshes",
        "refreshSandbox",
        "Extend the TTL (legacy v1 keep-alive)",
        {204: None, **_NF, **_BODY_ERRORS, 409: "Error"},
        body=models.RefreshRequest,
    ),
    Operation(
        "post",
        "/sandboxes/{sandboxID}/pause",
        "pauseSandbox",
        "Pause; 409 when already paused",
        {204: None, **_NF, **_BODY_ERRORS, 409: "Error"},
        body=models.PauseRequest,
    ),
    Operation(
        "post",
        "/sandboxes/{sandboxID}/resume",
        "resumeSandbox",
        "Resume (legacy, SDK 2.0-2.5); 409 when running",
        {201: "Sandbox", **_NF, **_BODY_ERRORS, 409: "Error", **_ADMISSION},
        body=models.ResumeRequest,
    ),
    Operation(
        "post",
        "/sandboxes/{sandboxID}/connect",
        "connectSandbox",
        "Connect: 200 running (TTL extended), 201 resumed (legacy, SDK 2.6-2.45)",
        {200: "Sandbox", 201: "Sandbox", **_NF, **_BODY_ERRORS, 409: "Error",
         **_ADMISSION},
        body=models.ConnectV1Request,
        body_required=True,
    ),
    Operation(
        "post",
        "/v2/sandboxes/{sandboxID}/connect",
        "connectSandboxV2",
        "Connect: 200 running (TTL extended), 201 resumed",
        {200: "Sandbox", 201: "Sandbox", **_NF, **_BODY_ERRORS, 409: "Error",
         **_ADMISSION},
        body=models.ConnectV2Request,
    ),
    Operation(
        "get",
        "/sandboxes/{sandboxID}/metrics",
        "getSandboxMetrics",
        "CPU, memory and disk samples",
        {200: "[SandboxMetric]", 400: "Error", **_NF},
        query=[_query("start", _INT, "unix seconds"), _query("end", _INT, "unix seconds")],
    ),
    Operation(
        "post",
        "/sandboxes/{sandboxID}/snapshots",
        "createSnapshot",
        "Snapshot a running sandbox into a template",
        {201: "SnapshotInfo", **_NF, **_BODY_ERRORS, 409: "Error"},
        body=models.SnapshotRequest,
    ),
    Operation(
        "post",
        "/sandboxes/{sandboxID}/fork",
        "forkSandbox",
        "Fork a running sandbox into count children",
        {201: "[ForkResult]", **_NF, **_BODY_ERRORS, 409: "Error", **_ADMISSION},
        body=models.ForkRequest,
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
        {200: "[SnapshotInfo]", 400: "Error", **_E},
        query=[_query("sandboxID", _STR), _query("name", _STR), _LIMIT, _NEXT],
        headers={200: ["X-Next-Token"]},
    ),
    Operation(
        "get",
        "/snapshots/{snapshotID}",
        "getSnapshot",
        "One snapshot",
        {200: "SnapshotInfo", **_NF},
    ),
    Operation("get", "/templates", "listTemplates", "Templates", {200: "[Template]", **_E}),
    Operation(
        "get",
        "/v2/templates",
        "listTemplatesV2",
        "Templates, paged by X-Next-Token",
        {200: "[Template]", 400: "Error", **_E},
        query=[_LIMIT, _NEXT],
        headers={200: ["X-Next-Token"]},
    ),
    Operation(
        "get",
        "/templates/aliases/{alias}",
        "getTemplateByAlias",
        "Resolve a template alias",
        {200: "TemplateAlias", **_NF},
    ),
    Operation(
        "get",
        "/templates/{templateID}",
        "getTemplate",
        "One template or snapshot",
        {200: "TemplateDetail", **_NF},
    ),
    Operation(
        "delete",
        "/templates/{templateID}",
        "deleteTemplate",
        "Delete a template or snapshot; 409 while sandboxes use it",
        {204: None, **_NF, 400: "Error", 409: "Error"},
    ),
    # The E2B template build API (node/template_api.py; docs/e2b-api.md §1.7). A node whose
    # backend cannot boot build VMs (the process backend) refuses createTemplateV3 with 400.
    Operation(
        "post",
        "/v3/templates",
        "createTemplateV3",
        "Request a template build (SDK Template.build); 400 without a VM backend",
        {202: "TemplateRequestResponseV3", **_E, **_BODY_ERRORS, 409: "Error"},
        body=tpl.TemplateBuildRequestV3,
        body_required=True,
    ),
    Operation(
        "get",
        "/templates/{templateID}/files/{hash}",
        "getTemplateFilesUploadLink",
        "Whether a COPY step's files (a tar named by hash) are on the node, else an upload URL",
        {201: "TemplateBuildFileUpload", **_NF, 400: "Error"},
    ),
    Operation(
        "put",
        tpl.UPLOAD_PREFIX + "{templateID}/{hash}",
        "uploadTemplateFiles",
        "The upload URL handed out above: a signed, expiring URL (no API key)",
        {200: None, 403: "Error", 413: "Error"},
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
        {200: "TemplateBuildInfo", **_NF, 400: "Error"},
        query=[_query("logsOffset", {"type": "integer", "minimum": 0})],
    ),
    Operation(
        "get",
        "/templates/{templateID}/tags",
        "getTemplateTags",
        "A template's tags and the builds they name ('default': what the bare name means)",
        {200: "[TemplateTag]", **_NF, 400: "Error"},
    ),
    Operation(
        "post",
        "/templates/tags",
        "assignTemplateTags",
        "Point tags at the build target ('name:tag', or 'name' for default) names",
        {201: "AssignedTemplateTags", **_NF, **_BODY_ERRORS},
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
    Operation("get", "/nodes", "listNodes", "This node", {200: "[Node]", **_E}),
    Operation("get", "/nodes/{nodeID}", "getNode", "This node by id", {200: "Node", **_NF}),
]


def _response(status: int, schema_name: str | None, headers: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {"description": str(status)}
    if schema_name is not None:
        schema = _array(schema_name[1:-1]) if schema_name.startswith("[") else _ref(schema_name)
        out["content"] = {"application/json": {"schema": schema}}
    if headers:
        out["headers"] = {h: {"schema": _STR} for h in headers}
    return out


def _operation(op: Operation, request_schemas: dict[str, Any]) -> dict[str, Any]:
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
            str(status): _response(status, schema, op.headers.get(status, []))
            for status, schema in sorted(op.responses.items())
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
        schema = op.body.model_json_schema(ref_template=REF)
        request_schemas.update(schema.pop("$defs", {}))
        request_schemas[op.body.__name__] = schema
        out["requestBody"] = {
            "required": op.body_required,
            "content": {"application/json": {"schema": _ref(op.body.__name__)}},
        }
    return out


@lru_cache(maxsize=1)
def openapi_document() -> dict[str, Any]:
    request_schemas: dict[str, Any] = {}
    paths: dict[str, dict[str, Any]] = {}
    for op in ROUTES:
        paths.setdefault(op.path, {})[op.method] = _operation(op, request_schemas)
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
            "schemas": {**request_schemas, **RESPONSE_SCHEMAS},
        },
    }
