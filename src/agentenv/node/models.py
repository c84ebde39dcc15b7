"""Wire shapes of the E2B control-plane API (docs/e2b-api.md §1.4), with exact JSON names.

Requests are validated with pydantic in strict mode: a string where an int belongs is a 422, not
a silent conversion. Unknown fields are ignored, as newer SDKs send fields older servers lack.
Responses are pydantic models too (the `Response` classes below): node/openapi.py generates the
document's schemas from them, and the functions at the end build the bodies through them. A
field that may be left out (rather than sent as null, where the SDKs would choke) is `Omitted`:
it is not set unless it has a value, and bodies are dumped without unset fields.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema
from pydantic.json_schema import SkipJsonSchema

from agentenv.node.backend import MetricSample
from agentenv.node.network_policy import public_network
from agentenv.node.records import SandboxRecord, State, TemplateRecord


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)


class AutoResume(_Request):
    enabled: bool = False


class NewSandbox(_Request):
    """`POST /v2/sandboxes` (and the v1 `POST /sandboxes`, which adds `secure`)."""

    templateID: str = Field(default="base", min_length=1, max_length=256)
    timeout: int | None = None
    metadata: dict[str, str] | None = None
    envVars: dict[str, str] | None = None
    autoPause: bool | None = None
    autoPauseMemory: bool | None = None
    autoResume: AutoResume | None = None
    allow_internet_access: bool | None = None
    network: dict[str, Any] | None = None
    secure: bool | None = None
    mcp: dict[str, Any] | None = None
    volumeMounts: list[dict[str, Any]] | None = None
    #: an extension: this many sandboxes, answered as a list of ForkResult (as a fork is)
    count: int | None = None


class NetworkUpdate(_Request):
    """`PUT /sandboxes/{id}/network` (SandboxNetworkUpdateConfig); the entries themselves are
    checked by node/network_policy.py, which names a bad one."""

    model_config = ConfigDict(extra="allow", strict=True)
    allowOut: list[str] | None = None
    denyOut: list[str] | None = None
    dnsServers: list[str] | None = None
    egressProxy: dict[str, Any] | None = None
    rules: dict[str, Any] | None = None
    allow_internet_access: bool | None = None


class TimeoutRequest(_Request):
    timeout: int


class RefreshRequest(_Request):
    duration: int | None = Field(default=None, ge=0, le=3600)


class PauseRequest(_Request):
    memory: bool | None = None
    requireHealthyGuest: bool | None = None


class ConnectV2Request(_Request):
    timeout: int | None = None
    memory: bool | None = None


class ConnectV1Request(_Request):
    timeout: int
    memory: bool | None = None


class ResumeRequest(_Request):
    timeout: int | None = 15
    autoPause: bool | None = None
    memory: bool | None = None


class SnapshotRequest(_Request):
    name: str | None = Field(
        default=None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9][A-Za-z0-9_./:-]*$"
    )
    memory: bool | None = None


class ForkRequest(_Request):
    timeout: int | None = None
    count: int = 1


class RollbackRequest(_Request):
    """`POST /sandboxes/{id}/rollback` (an extension): a snapshot of the sandbox's own, or
    none for its last pause; it runs afterwards for at least `timeout` seconds."""

    snapshotID: str | None = Field(default=None, min_length=1, max_length=256)
    timeout: int | None = None


# --- responses ---------------------------------------------------------------------------------

#: a time as iso() writes it
DateTime = Annotated[str, WithJsonSchema({"type": "string", "format": "date-time"})]


def _no_default(schema: dict[str, Any]) -> None:
    schema.pop("default", None)


#: `name: X | Omitted = absent()`: X when present; the key is left out otherwise (never null)
Omitted = SkipJsonSchema[None]


def absent() -> Any:
    return Field(default=None, json_schema_extra=_no_default)


class Response(BaseModel):
    """A response body. Extra keys are allowed in the document (E2B adds fields over time)."""

    model_config = ConfigDict(extra="ignore")

    def body(self) -> dict[str, Any]:
        """The JSON body: unset (Omitted) fields left out."""
        return self.model_dump(mode="json", exclude_unset=True)


class Error(Response):
    code: int
    message: str


class Health(Response):
    status: Literal["ok"]
    version: str


class Unhealthy(Response):
    status: Literal["unhealthy"]
    reason: str
    version: str


class Sandbox(Response):
    templateID: str
    sandboxID: str = Field(pattern=r"^[a-z0-9]+$")
    clientID: str
    envdVersion: str
    envdAccessToken: str | Omitted = absent()
    trafficAccessToken: str | None = None
    domain: str | None = None
    alias: str | Omitted = absent()


class ListedSandbox(Response):
    templateID: str
    sandboxID: str
    clientID: str
    alias: str | Omitted = absent()
    startedAt: DateTime
    endAt: DateTime
    envdVersion: str
    cpuCount: int
    memoryMB: int
    diskSizeMB: int
    state: Literal["running", "paused"]
    metadata: dict[str, str] | Omitted = absent()
    #: lineage (an extension; the SDKs ignore it): the sandbox this one was forked from or
    #: whose snapshot it was made from, and the catalogue snapshot it was made from
    parentSandboxID: str | None = None
    sourceSnapshotID: str | None = None


class Lifecycle(Response):
    autoResume: bool
    onTimeout: Literal["kill", "pause"]


class SandboxDetail(ListedSandbox):
    envdAccessToken: str | Omitted = absent()
    allowInternetAccess: bool | None = None
    domain: str | None = None
    network: dict[str, Any] | Omitted = absent()
    pauseMode: Literal["full", "filesystem"] | Omitted = absent()
    lifecycle: Lifecycle


class SandboxMetric(Response):
    timestamp: DateTime
    timestampUnix: int
    cpuCount: int
    cpuUsedPct: float
    memUsed: int
    memTotal: int
    memCache: int
    diskUsed: int
    diskTotal: int
    #: the host-side resident memory of the sandbox's VM or processes (this node's field)
    memUsedHost: int | Omitted = absent()


class SnapshotInfo(Response):
    snapshotID: str
    names: list[str]
    sandboxID: str | None = None
    cpuCount: int | Omitted = absent()
    memoryMB: int | Omitted = absent()
    diskSizeMB: int | Omitted = absent()
    createdAt: DateTime | Omitted = absent()
    updatedAt: DateTime | Omitted = absent()


class ForkResult(Response):
    """One child of a fork: its sandbox, or why it failed."""

    sandbox: Sandbox | Omitted = absent()
    error: Error | Omitted = absent()


class Template(Response):
    templateID: str
    buildID: str
    cpuCount: int
    memoryMB: int
    diskSizeMB: int
    public: bool
    aliases: list[str]
    names: list[str]
    createdAt: DateTime
    updatedAt: DateTime
    createdBy: dict[str, Any] | None
    lastSpawnedAt: str | None
    spawnCount: int
    buildCount: int
    envdVersion: str | None
    buildStatus: str


class TemplateBuild(Response):
    buildID: str
    status: str
    createdAt: DateTime
    updatedAt: DateTime
    finishedAt: DateTime | Omitted = absent()
    cpuCount: int
    memoryMB: int
    diskSizeMB: int
    envdVersion: str | None


class TemplateDetail(Template):
    builds: list[TemplateBuild]


class TemplateAlias(Response):
    templateID: str
    public: bool


class Node(Response):
    id: str
    nodeID: str
    version: str
    status: str
    backend: str
    sandboxCount: int
    metrics: dict[str, Any]



def iso(ts: float) -> str:
    """RFC 3339 UTC with milliseconds, e.g. 2025-01-01T00:00:00.123Z."""
    whole = int(ts)
    millis = int((ts - whole) * 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole)) + f".{millis:03d}Z"


def sandbox_json(rec: SandboxRecord, client_id: str, domain: str | None) -> dict[str, Any]:
    return Sandbox(
        templateID=rec.template_id,
        sandboxID=rec.sandbox_id,
        clientID=client_id,
        envdVersion=rec.envd_version,
        envdAccessToken=rec.envd_access_token,
        trafficAccessToken=rec.traffic_access_token,
        domain=domain,
        **({"alias": rec.alias} if rec.alias else {}),
    ).body()


def _listed_fields(rec: SandboxRecord, client_id: str) -> dict[str, Any]:
    return {
        "templateID": rec.template_id,
        "sandboxID": rec.sandbox_id,
        "clientID": client_id,
        "startedAt": iso(rec.started_at),
        "endAt": iso(rec.end_at),
        "envdVersion": rec.envd_version,
        "cpuCount": rec.cpu_count,
        "memoryMB": rec.memory_mb,
        "diskSizeMB": rec.disk_size_mb,
        "state": rec.state.public,
        "metadata": rec.metadata,
        "parentSandboxID": rec.parent_sandbox_id,
        "sourceSnapshotID": rec.source_snapshot_id,
        **({"alias": rec.alias} if rec.alias else {}),
    }


def listed_json(rec: SandboxRecord, client_id: str) -> dict[str, Any]:
    return ListedSandbox(**_listed_fields(rec, client_id)).body()


def detail_json(rec: SandboxRecord, client_id: str, domain: str | None) -> dict[str, Any]:
    extra: dict[str, Any] = {}
    network = public_network(rec.network)
    if network is not None:
        extra["network"] = network
    if rec.pause_mode is not None and rec.state == State.PAUSED:
        # only once the pause finished: while pausing, pause_mode is the previous pause's
        extra["pauseMode"] = rec.pause_mode
    return SandboxDetail(
        **_listed_fields(rec, client_id),
        envdAccessToken=rec.envd_access_token,
        allowInternetAccess=rec.allow_internet_access,
        domain=domain,
        lifecycle=Lifecycle(autoResume=rec.auto_resume,
                            onTimeout="pause" if rec.auto_pause else "kill"),
        **extra,
    ).body()


def metric_json(sample: MetricSample, mem_used_host: int) -> dict[str, Any]:
    return SandboxMetric(
        timestamp=iso(sample.timestamp),
        timestampUnix=int(sample.timestamp),
        cpuCount=sample.cpu_count,
        cpuUsedPct=sample.cpu_used_pct,
        memUsed=sample.mem_used,
        memTotal=sample.mem_total,
        memCache=sample.mem_cache,
        diskUsed=sample.disk_used,
        diskTotal=sample.disk_total,
        memUsedHost=mem_used_host,
    ).body()


def snapshot_json(tpl: TemplateRecord) -> dict[str, Any]:
    return SnapshotInfo(
        snapshotID=tpl.template_id,
        names=list(tpl.names),
        sandboxID=tpl.source_sandbox_id,
        cpuCount=tpl.cpu_count,
        memoryMB=tpl.memory_mb,
        diskSizeMB=tpl.disk_size_mb,
        createdAt=iso(tpl.created_at),
        updatedAt=iso(tpl.updated_at),
    ).body()


def _template_fields(tpl: TemplateRecord) -> dict[str, Any]:
    return {
        "templateID": tpl.template_id,
        "buildID": tpl.template_id,
        "cpuCount": tpl.cpu_count,
        "memoryMB": tpl.memory_mb,
        "diskSizeMB": tpl.disk_size_mb,
        "public": True,
        "aliases": list(tpl.names),
        "names": list(tpl.names) or [tpl.template_id],
        "createdAt": iso(tpl.created_at),
        "updatedAt": iso(tpl.updated_at),
        "createdBy": None,
        "lastSpawnedAt": iso(tpl.last_spawned_at) if tpl.last_spawned_at else None,
        "spawnCount": tpl.spawn_count,
        "buildCount": 1,
        "envdVersion": tpl.envd_version,
        "buildStatus": tpl.build_status,
    }


def template_json(tpl: TemplateRecord) -> dict[str, Any]:
    return Template(**_template_fields(tpl)).body()


def template_detail_json(tpl: TemplateRecord) -> dict[str, Any]:
    build = TemplateBuild(
        buildID=tpl.template_id,
        status=tpl.build_status,
        createdAt=iso(tpl.created_at),
        updatedAt=iso(tpl.updated_at),
        cpuCount=tpl.cpu_count,
        memoryMB=tpl.memory_mb,
        diskSizeMB=tpl.disk_size_mb,
        envdVersion=tpl.envd_version,
    )
    return TemplateDetail(**_template_fields(tpl), builds=[build]).body()
