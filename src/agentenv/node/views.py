"""The E2B API's bodies built from the node's records, through the response models of
agentenv.api (so what the node answers is what the OpenAPI document says)."""

from __future__ import annotations

from typing import Any

from agentenv.api.models import (
    Lifecycle,
    ListedSandbox,
    Sandbox,
    SandboxDetail,
    SandboxMetric,
    SandboxVolumeMount,
    SnapshotInfo,
    Template,
    TemplateBuild,
    TemplateDetail,
    iso,
)
from agentenv.api.volume_models import Volume, VolumeAndToken, VolumeEntryStat
from agentenv.node.backend import MetricSample
from agentenv.node.network_policy import public_network
from agentenv.node.records import SandboxRecord, State, TemplateRecord, VolumeRecord


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
        **({"volumeMounts": [SandboxVolumeMount(name=m.name, path=m.path, mode=m.mode)
                             for m in rec.volume_mounts]} if rec.volume_mounts else {}),
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
                            onTimeout="pause" if rec.auto_pause else "kill",
                            **({"idlePauseAfter": rec.idle_pause_after}
                               if rec.idle_pause_after else {})),
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
        **({"idlePauseAfter": tpl.idle_pause_after} if tpl.idle_pause_after is not None else {}),
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


def volume_json(rec: VolumeRecord, token: str | None = None) -> dict[str, Any]:
    fields: dict[str, Any] = {"volumeID": rec.volume_id, "name": rec.name,
                              "sizeMB": rec.size_bytes >> 20}
    if token is None:
        return Volume(**fields).body()
    return VolumeAndToken(**fields, token=token).body()


def entry_json(entry: dict[str, Any]) -> dict[str, Any]:
    return VolumeEntryStat(**entry).body()
