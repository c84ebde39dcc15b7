"""Wire shapes of the E2B control-plane API (docs/e2b-api.md §1.4), with exact JSON names.

Requests are validated with pydantic in strict mode: a string where an int belongs is a 422, not
a silent conversion. Unknown fields are ignored, as newer SDKs send fields older servers lack.
Responses are pydantic models too (the `Response` classes below): api/openapi.py generates the
document's schemas from them, and the functions at the end build the bodies through them. A
field that may be left out (rather than sent as null, where the SDKs would choke) is `Omitted`:
it is not set unless it has a value, and bodies are dumped without unset fields.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator
from pydantic.json_schema import SkipJsonSchema


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True, populate_by_name=True)


class AutoResume(_Request):
    enabled: bool = False


class VolumeMountRequest(_Request):
    """One of `volumeMounts` (E2B SandboxVolumeMount: `name`, `path`); `mode` is our extension
    (`ro`, the default, `cow`, `rw` or `rw-shared`), also given as `name:mode`
    (docs/volumes.md §6, §7.1)."""

    name: str = Field(min_length=1, max_length=140)
    path: str = Field(min_length=1, max_length=1024)
    mode: str | None = None


#: Bounds of a sandbox's `metadata` and `envVars`. Both are stored with the sandbox and
#: metadata comes back in every listing of its team: unbounded, one create of a 1 MiB map per
#: sandbox makes each list of thousands of sandboxes gigabytes (the red team's finding 4).
MAX_METADATA_ENTRIES = 256
MAX_METADATA_BYTES = 64 << 10
MAX_METADATA_KEY = 256
MAX_ENV_VARS_ENTRIES = 4096
MAX_ENV_VARS_BYTES = 512 << 10


def _bounded_map(value: dict[str, str] | None, what: str, entries: int, total: int,
                 key_chars: int | None = None) -> dict[str, str] | None:
    if value is None:
        return None
    if len(value) > entries:
        raise ValueError(f"{what}: {len(value)} entries, at most {entries}")
    size = 0
    for key, item in value.items():
        if not key:
            raise ValueError(f"{what}: an empty key")
        if key_chars is not None and len(key) > key_chars:
            raise ValueError(f"{what}: key {key[:40]!r}... over {key_chars} characters")
        size += len(key.encode()) + len(item.encode())
    if size > total:
        raise ValueError(f"{what}: {size} bytes of keys and values, at most {total}")
    return value


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
    volumeMounts: list[VolumeMountRequest] | None = Field(default=None, max_length=16)
    #: an extension: this many sandboxes, answered as a list of ForkResult (as a fork is)
    count: int | None = None
    #: an extension: seconds without traffic after which the node pauses it, 0 off (also the
    #: metadata key aenv.idlePauseAfter; default: the template's, node/idle.py)
    idlePauseAfter: int | None = None

    @field_validator("metadata")
    @classmethod
    def _metadata_bounded(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        return _bounded_map(value, "metadata", MAX_METADATA_ENTRIES, MAX_METADATA_BYTES,
                            MAX_METADATA_KEY)

    @field_validator("envVars")
    @classmethod
    def _env_vars_bounded(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        return _bounded_map(value, "envVars", MAX_ENV_VARS_ENTRIES, MAX_ENV_VARS_BYTES)


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


class SandboxVolumeMount(Response):
    name: str
    path: str
    #: an extension: "ro" (read-only, shared), "cow" (copy-on-write, the sandbox's own),
    #: "rw" (read-write, this sandbox's alone: docs/volumes.md §6) or "rw-shared"
    #: (read-write, shared with other sandboxes and the content API over NFS: §7.1)
    mode: Literal["ro", "cow", "rw", "rw-shared"]


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
    volumeMounts: list[SandboxVolumeMount] | Omitted = absent()


class Lifecycle(Response):
    autoResume: bool
    onTimeout: Literal["kill", "pause"]
    #: an extension, present when on: seconds without traffic before the node pauses it
    idlePauseAfter: int | Omitted = absent()


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
    #: an extension, present when set: its sandboxes' default idlePauseAfter (node/idle.py)
    idlePauseAfter: int | Omitted = absent()


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
