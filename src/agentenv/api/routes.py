"""The E2B contract, once: every route the node and the gateway serve, as one table.

Each `Operation` names its method, its path (OpenAPI's form; `{name:path}` marks a parameter
that may hold '/'), the handler that serves it (its operationId: the node and the gateway each
map operationIds to handlers of their own, agentenv.api.serve), who may call it (`Auth`), and
what it takes and answers (pydantic models of agentenv.api: api/openapi.py generates the
document from this table, so the document and the servers cannot drift apart). A route the SDK
knows and no server supports is in the table too (`unsupported`: both answer 501 saying why).

Order matters where paths overlap: the first operation whose path and method match serves a
request (specific paths before the `:path` ones that would swallow them).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from pydantic import BaseModel

from agentenv.api import event_models as em
from agentenv.api import models
from agentenv.api import template_models as tpl
from agentenv.api import volume_models as vm
from agentenv.api.auth import SIGNATURE_OWNER_PATH
from agentenv.api.event_models import TYPES

#: every team's events after a seq, for a cluster's gateway (its node key only; the gateway
#: stores them in the cluster's Redis: control/gateway/events.py)
CLUSTER_EVENTS_PATH = "/cluster/events"


class Auth(StrEnum):
    """Who may call an operation."""

    #: anyone (/health, /openapi.json)
    PUBLIC = "public"
    #: a team's X-API-KEY (on a node of a cluster: its gateway's node key, naming the team)
    API_KEY = "api-key"
    #: a scraper's bearer metrics token (agentenv.api.auth), or anyone where metrics are public
    METRICS = "metrics"
    #: a signed, expiring URL the route checks itself (template build file uploads)
    SIGNED = "signed"
    #: the volume's bearer token, checked by the route (the volume content API)
    VOLUME_TOKEN = "volume-token"
    #: a node's cluster-internal routes: its gateway's node key, no team (node/api.py)
    NODE = "node"


_STR = {"type": "string"}
_INT = {"type": "integer"}

#: a response body: a model, a JSON array of one model ([Model]), one of several of those
#: (a tuple: the request decides which), or none
One = type[BaseModel] | list[type[BaseModel]]
Body = One | tuple[One, ...] | None


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
    _query("before", {"type": "integer", "minimum": 0},
           "only events with a smaller seq (0: no bound)"),
]


@dataclass(frozen=True)
class Operation:
    method: str
    path: str
    #: the operationId, and the name the node's and the gateway's handlers are registered by
    operation_id: str
    summary: str
    responses: dict[int, Body]  # status -> what the answer's body is
    body: type[BaseModel] | None = None
    body_required: bool = False
    query: list[dict[str, Any]] = field(default_factory=list)
    auth: Auth = Auth.API_KEY
    headers: dict[int, list[str]] = field(default_factory=dict)
    raw_body: str | None = None  # a request body of this media type, not JSON (uploads)
    raw_answer: str | None = None  # a 200 body of this media type, not JSON (downloads)
    #: in the OpenAPI document (not: the internal and the unsupported routes)
    documented: bool = True
    #: served by a node only: its cluster-internal routes, and the node-local `aenv` ones
    node_only: bool = False
    #: the SDK has this route and nothing here serves it: 501 with this reason
    unsupported: str | None = None

    @property
    def handler(self) -> str:
        return self.operation_id


_E = {401: models.Error}
_NF = {401: models.Error, 404: models.Error}
_BODY_ERRORS = {400: models.Error, 413: models.Error, 422: models.Error}
# Admission control (node/admission.py): 429 no room (the resource named, Should-Retry: false);
# 503 the node cannot serve now (shutting down, its request cap).
_ADMISSION = {429: models.Error, 503: models.Error}
# The volume content API: a bad path (400), no or another volume's token (401), nothing there
# (404), a file where a directory belongs or an entry in the way (409).
_CONTENT = {400: models.Error, 401: models.Error, 404: models.Error, 409: models.Error}
_PATH = {**_query("path", _STR, "inside the volume; '..' is refused"), "required": True}
_OWNER = [_query("uid", {"type": "integer", "minimum": 0}),
          _query("gid", {"type": "integer", "minimum": 0}),
          _query("mode", {"type": "integer", "minimum": 0, "maximum": 4095})]

SECRETS = ("secrets (E2B's header injection into a sandbox's egress requests) are not "
           "supported: this node does not rewrite egress requests; pass values as envVars")
DEFAULT_TEMPLATES = ("default templates are not supported: this node has no public template "
                     "gallery; GET /templates lists the ones you can use")
TEMPLATE_PATCH = ("updating a template (its public flag) is not supported: templates are "
                  "private to their team on this node")
#: E2B routes the SDK can call that nothing here serves (tests/node/test_sdk_routes.py walks
#: the SDK's generated client and checks every route is served or here): 501 naming why, never
#: a fake success
_UNSUPPORTED = [
    ("/secrets", ["get", "post"], SECRETS),
    ("/secrets/{secretID}", ["get", "post", "delete"], SECRETS),
    ("/default-templates", ["get"], DEFAULT_TEMPLATES),
    ("/templates/{templateID}", ["patch"], TEMPLATE_PATCH),
    ("/v2/templates/{templateID}", ["patch"], TEMPLATE_PATCH),
]

ROUTES: list[Operation] = [
    Operation("get", "/health", "health", "Liveness (503 with the reason: blockd down)",
              {200: models.Health, 503: models.Unhealthy}, auth=Auth.PUBLIC),
    Operation("get", "/openapi.json", "openapi", "This document", {200: None}, auth=Auth.PUBLIC),
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
    # before getSandbox, whose path would take it
    Operation("get", "/sandboxes/metrics", "getSandboxesMetrics",
              "The latest sample of each named sandbox (node/observer.py)",
              {200: em.SandboxesWithMetrics, 400: models.Error, **_E},
              query=[{**_query("sandbox_ids", {"type": "string", "minLength": 1},
                               "comma-separated, at most 100"), "required": True}]),
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
        "/snapshots/{snapshotID:path}/fork",
        "forkSnapshot",
        "count sandboxes from a snapshot, a result each (extension: batch create)",
        {201: [models.ForkResult], **_NF, **_BODY_ERRORS, **_ADMISSION},
        body=models.ForkRequest,
    ),
    Operation(
        "get",
        "/snapshots/{snapshotID:path}/children",
        "listSnapshotChildren",
        "Sandboxes made from this snapshot (extension: lineage)",
        {200: [models.ListedSandbox], **_NF},
    ),
    Operation(
        "get",
        "/snapshots/{snapshotID:path}",
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
        "/templates/aliases/{alias:path}",
        "getTemplateByAlias",
        "Resolve a template alias",
        {200: models.TemplateAlias, **_NF},
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
        auth=Auth.SIGNED,
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
    # after the routes under /templates/ that their paths would take
    Operation(
        "get",
        "/templates/{templateID:path}",
        "getTemplate",
        "One template or snapshot",
        {200: models.TemplateDetail, **_NF},
    ),
    Operation(
        "delete",
        "/templates/{templateID:path}",
        "deleteTemplate",
        "Delete a template or snapshot; 409 while sandboxes use it",
        {204: None, **_NF, 400: models.Error, 409: models.Error},
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
    # Volumes (node/volume_api.py; docs/volumes.md): the volume API with the API key...
    Operation("get", "/volumes", "listVolumes", "The team's volumes", {200: [vm.Volume], **_E}),
    Operation("post", "/volumes", "createVolume",
              "Create a volume (sizeMB: our extension); the answer carries its content token",
              {201: vm.VolumeAndToken, **_E, **_BODY_ERRORS, 409: models.Error},
              body=vm.NewVolume, body_required=True),
    Operation("get", "/volumes/{volumeID}", "getVolume", "One volume, with its content token",
              {200: vm.VolumeAndToken, **_NF}),
    Operation("delete", "/volumes/{volumeID}", "deleteVolume", "Delete a volume and its content",
              {204: None, **_NF}),
    Operation("post", "/volumes/{volumeID}/commit", "commitVolume",
              "The volume's content becomes a running sandbox's copy-on-write mount of it "
              "(extension)", {200: vm.Volume, **_NF, **_BODY_ERRORS, 409: models.Error,
                              502: models.Error}, body=vm.VolumeCommit, body_required=True),
    # ...and the content API, at E2B_VOLUME_API_URL, with the volume's token
    Operation("get", vm.CONTENT_PREFIX + "{volumeID}/path", "statVolumePath",
              "An entry's type, size, mode, owner and times (a link is not followed)",
              {200: vm.VolumeEntryStat, **_CONTENT}, query=[_PATH], auth=Auth.VOLUME_TOKEN),
    Operation("patch", vm.CONTENT_PREFIX + "{volumeID}/path", "updateVolumePath",
              "Change an entry's owner or mode", {200: vm.VolumeEntryStat, **_CONTENT,
                                                  413: models.Error, 422: models.Error},
              query=[_PATH], body=vm.VolumeMetadataUpdate, auth=Auth.VOLUME_TOKEN),
    Operation("delete", vm.CONTENT_PREFIX + "{volumeID}/path", "removeVolumePath",
              "Remove a file, link or directory (with what it holds)",
              {204: None, **_CONTENT}, query=[_PATH], auth=Auth.VOLUME_TOKEN),
    Operation("get", vm.CONTENT_PREFIX + "{volumeID}/dir", "listVolumeDir",
              "A directory's entries, depth levels down",
              {200: [vm.VolumeEntryStat], **_CONTENT}, auth=Auth.VOLUME_TOKEN,
              query=[_PATH, _query("depth", {"type": "integer", "minimum": 0, "maximum": 100})]),
    Operation("post", vm.CONTENT_PREFIX + "{volumeID}/dir", "makeVolumeDir",
              "Create a directory (force: its parents too, and no error when it exists)",
              {201: vm.VolumeEntryStat, **_CONTENT, 413: models.Error}, auth=Auth.VOLUME_TOKEN,
              query=[_PATH, *_OWNER, _query("force", {"type": "boolean"})]),
    Operation("get", vm.CONTENT_PREFIX + "{volumeID}/file", "readVolumeFile",
              "A file's bytes", {200: None, **_CONTENT}, query=[_PATH], auth=Auth.VOLUME_TOKEN,
              raw_answer="application/octet-stream"),
    Operation("put", vm.CONTENT_PREFIX + "{volumeID}/file", "writeVolumeFile",
              "Write a file (force: replace one there); its parent must exist",
              {201: vm.VolumeEntryStat, **_CONTENT, 413: models.Error, 507: models.Error},
              query=[_PATH, *_OWNER, _query("force", {"type": "boolean"})], auth=Auth.VOLUME_TOKEN,
              raw_body="application/octet-stream"),
    Operation("get", "/nodes", "listNodes", "This node", {200: [models.Node], **_E}),
    Operation("get", "/nodes/{nodeID}", "getNode", "This node by id", {200: models.Node, **_NF}),
    # Not in the document: Prometheus, a node's cluster-internal routes, the node-local `aenv`
    # extensions, and the SDK's routes nothing here serves.
    Operation("get", "/metrics", "metrics", "Prometheus metrics", {200: None}, auth=Auth.METRICS,
              documented=False),
    Operation("post", SIGNATURE_OWNER_PATH, "signatureOwner",
              "Which sandbox of the node made a signed file URL (the gateway asks)",
              {200: None, **_NF}, auth=Auth.NODE, documented=False, node_only=True),
    Operation("get", CLUSTER_EVENTS_PATH, "clusterEvents",
              "Every team's events after a seq (the gateway's collector)", {200: None},
              auth=Auth.NODE, documented=False, node_only=True),
    Operation("post", "/aenv/snapshots/push", "pushSnapshot",
              "aenv snapshot push: a snapshot to an OCI registry", {200: None},
              documented=False, node_only=True),
    Operation("post", "/aenv/snapshots/pull", "pullSnapshot",
              "aenv snapshot pull: a snapshot from an OCI registry", {201: None},
              documented=False, node_only=True),
    Operation("post", "/aenv/snapshots/delete", "deleteSnapshotRef",
              "A snapshot's reference the team pushed, deleted from its OCI registry (the "
              "gateway's spill-over tags)", {200: None}, documented=False, node_only=True),
    *(Operation(method, path, f"unsupported{method.title()}{path}", why, {501: models.Error},
                documented=False, unsupported=why)
      for path, methods, why in _UNSUPPORTED for method in methods),
]
