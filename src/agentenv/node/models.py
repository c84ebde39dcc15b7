"""Wire shapes of the E2B control-plane API (docs/e2b-api.md §1.4), with exact JSON names.

Requests are validated with pydantic in strict mode: a string where an int belongs is a 422, not
a silent conversion. Unknown fields are ignored, as newer SDKs send fields older servers lack.
Responses are built as plain dicts by the functions at the end, so optional fields can be left
out rather than sent as null where the SDKs would choke.
"""

from __future__ import annotations

import time
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

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


# --- responses ---------------------------------------------------------------------------------


def iso(ts: float) -> str:
    """RFC 3339 UTC with milliseconds, e.g. 2025-01-01T00:00:00.123Z."""
    whole = int(ts)
    millis = int((ts - whole) * 1000)
    return time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(whole)) + f".{millis:03d}Z"


def sandbox_json(rec: SandboxRecord, client_id: str, domain: str | None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "templateID": rec.template_id,
        "sandboxID": rec.sandbox_id,
        "clientID": client_id,
        "envdVersion": rec.envd_version,
        "envdAccessToken": rec.envd_access_token,
        "trafficAccessToken": rec.traffic_access_token,
        "domain": domain,
    }
    if rec.alias:
        body["alias"] = rec.alias
    return body


def listed_json(rec: SandboxRecord, client_id: str) -> dict[str, Any]:
    body: dict[str, Any] = {
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
    }
    if rec.alias:
        body["alias"] = rec.alias
    return body


def detail_json(rec: SandboxRecord, client_id: str, domain: str | None) -> dict[str, Any]:
    body = listed_json(rec, client_id)
    body.update(
        {
            "envdAccessToken": rec.envd_access_token,
            "allowInternetAccess": rec.allow_internet_access,
            "domain": domain,
            "lifecycle": {
                "autoResume": rec.auto_resume,
                "onTimeout": "pause" if rec.auto_pause else "kill",
            },
        }
    )
    network = public_network(rec.network)
    if network is not None:
        body["network"] = network
    if rec.pause_mode is not None and rec.state == State.PAUSED:
        # only once the pause finished: while pausing, pause_mode is the previous pause's
        body["pauseMode"] = rec.pause_mode
    return body


def metric_json(sample: MetricSample) -> dict[str, Any]:
    return {
        "timestamp": iso(sample.timestamp),
        "timestampUnix": int(sample.timestamp),
        "cpuCount": sample.cpu_count,
        "cpuUsedPct": sample.cpu_used_pct,
        "memUsed": sample.mem_used,
        "memTotal": sample.mem_total,
        "memCache": sample.mem_cache,
        "diskUsed": sample.disk_used,
        "diskTotal": sample.disk_total,
    }


def snapshot_json(tpl: TemplateRecord) -> dict[str, Any]:
    return {
        "snapshotID": tpl.template_id,
        "names": list(tpl.names),
        "sandboxID": tpl.source_sandbox_id,
        "cpuCount": tpl.cpu_count,
        "memoryMB": tpl.memory_mb,
        "diskSizeMB": tpl.disk_size_mb,
        "createdAt": iso(tpl.created_at),
        "updatedAt": iso(tpl.updated_at),
    }


def template_json(tpl: TemplateRecord) -> dict[str, Any]:
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


def template_detail_json(tpl: TemplateRecord) -> dict[str, Any]:
    body = template_json(tpl)
    body["builds"] = [
        {
            "buildID": tpl.template_id,
            "status": tpl.build_status,
            "createdAt": iso(tpl.created_at),
            "updatedAt": iso(tpl.updated_at),
            "cpuCount": tpl.cpu_count,
            "memoryMB": tpl.memory_mb,
            "diskSizeMB": tpl.disk_size_mb,
            "envdVersion": tpl.envd_version,
        }
    ]
    return body
