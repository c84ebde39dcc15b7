"""What the node remembers about sandboxes and templates (persisted by node/store.py)."""

from __future__ import annotations

import dataclasses
import enum
import time
from dataclasses import dataclass, field
from typing import Any

from agentenv.api.tenancy import LOCAL_TEAM
from agentenv.node.backend import Placement, SnapshotRef, TemplateRef
from agentenv.node.idle import IDLE_REASON


class State(enum.StrEnum):
    CREATING = "creating"
    RUNNING = "running"
    PAUSING = "pausing"
    PAUSED = "paused"
    RESUMING = "resuming"
    SNAPSHOTTING = "snapshotting"
    FORKING = "forking"
    #: a paused sandbox whose pause snapshot children are starting from (it stays paused)
    BRANCHING = "branching"
    #: being restored in place to one of its snapshots (it runs afterwards)
    ROLLING_BACK = "rolling-back"
    KILLING = "killing"

    @property
    def stable(self) -> bool:
        return self in (State.RUNNING, State.PAUSED)

    @property
    def public(self) -> str:
        """The state as the E2B API shows it: only "running" or "paused"."""
        return "paused" if self in (State.PAUSING, State.PAUSED, State.BRANCHING) else "running"

    @property
    def holds_vm(self) -> bool:
        """Whether a sandbox in this state has (or is getting) a VM of its own."""
        return self not in (State.PAUSED, State.BRANCHING)


@dataclass(frozen=True)
class MountRecord:
    """A volume mounted in a sandbox (docs/volumes.md §6): which volume (its name and id when
    it was mounted), where, how (`ro` or `cow`), in which volume disk of the machine, and the
    sealed version of the volume the disk holds. `rw` is `cow` held by one sandbox alone:
    the volume changes through it (a commit), nowhere else."""

    name: str
    volume_id: str
    path: str
    mode: str
    slot: int
    layer: str

    def shared(self) -> MountRecord:
        """This mount in another sandbox (a fork child, a sandbox made from a snapshot): a
        read-write mount is one sandbox's, so theirs is copy-on-write."""
        return dataclasses.replace(self, mode="cow") if self.mode == "rw" else self

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "volume_id": self.volume_id, "path": self.path,
                "mode": self.mode, "slot": self.slot, "layer": self.layer}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> MountRecord:
        return cls(name=str(raw["name"]), volume_id=str(raw["volume_id"]),
                   path=str(raw["path"]), mode=str(raw["mode"]), slot=int(raw["slot"]),
                   layer=str(raw["layer"]))


@dataclass
class SandboxRecord:
    sandbox_id: str
    template_id: str
    alias: str | None
    state: State
    started_at: float
    end_at: float
    metadata: dict[str, str]
    env_vars: dict[str, str]
    auto_pause: bool
    auto_pause_memory: bool
    auto_resume: bool
    cpu_count: int
    memory_mb: int
    disk_size_mb: int
    envd_version: str
    envd_access_token: str
    traffic_access_token: str | None
    secure: bool
    allow_internet_access: bool | None
    network: dict[str, Any] | None
    source: TemplateRef
    placement: Placement | None = None
    pause_snapshot: SnapshotRef | None = None
    #: "full" (memory kept) or "filesystem"; set when paused
    pause_mode: str | None = None
    #: False when the caller asked for a filesystem-only pause (E2B: such a sandbox resumes
    #: on connect only, never by traffic; the process backend keeps no memory either way)
    pause_asked_memory: bool = True
    created_at: float = field(default_factory=time.time)
    #: the team the sandbox is of (api/tenancy.py); only that team's requests reach it
    team: str = LOCAL_TEAM
    #: lineage: the sandbox this one was forked from (or whose snapshot it was made from)...
    parent_sandbox_id: str | None = None
    #: ...and the catalogue snapshot it was made from (None: a template, or a fork point)
    source_snapshot_id: str | None = None
    #: the snapshot of its last pause, kept after it resumed: a rollback target
    last_pause: SnapshotRef | None = None
    #: seconds without traffic after which the node pauses it (node/idle.py); 0: never
    idle_pause_after: int = 0
    #: why its last pause began: "request", "timeout", "shutdown" or "idle" (node/idle.py)
    pause_reason: str | None = None

    @property
    def resumes_on_traffic(self) -> bool:
        """Whether a request to it resumes it while paused: autoResume, or an idle pause
        (which the caller never asked for and must not notice)."""
        return self.auto_resume or self.pause_reason == IDLE_REASON
    #: the volumes it mounts (kept through pauses, forks and its snapshots)
    volume_mounts: list[MountRecord] = field(default_factory=list)

    def to_row(self) -> dict[str, Any]:
        return {
            "id": self.sandbox_id,
            "template_id": self.template_id,
            "alias": self.alias,
            "state": self.state.value,
            "started_at": self.started_at,
            "end_at": self.end_at,
            "metadata": self.metadata,
            "env_vars": self.env_vars,
            "auto_pause": self.auto_pause,
            "auto_pause_memory": self.auto_pause_memory,
            "auto_resume": self.auto_resume,
            "cpu_count": self.cpu_count,
            "memory_mb": self.memory_mb,
            "disk_size_mb": self.disk_size_mb,
            "envd_version": self.envd_version,
            "envd_access_token": self.envd_access_token,
            "traffic_access_token": self.traffic_access_token,
            "secure": self.secure,
            "allow_internet_access": self.allow_internet_access,
            "network": self.network,
            "source": self.source.to_json(),
            "placement": self.placement.to_json() if self.placement else None,
            "pause_snapshot": self.pause_snapshot.to_json() if self.pause_snapshot else None,
            "pause_mode": self.pause_mode,
            "pause_asked_memory": self.pause_asked_memory,
            "created_at": self.created_at,
            "team": self.team,
            "parent_sandbox_id": self.parent_sandbox_id,
            "source_snapshot_id": self.source_snapshot_id,
            "last_pause": self.last_pause.to_json() if self.last_pause else None,
            "idle_pause_after": self.idle_pause_after,
            "pause_reason": self.pause_reason,
            "volume_mounts": [m.to_json() for m in self.volume_mounts],
        }

    @classmethod
    def from_row(cls, row: dict[str, Any]) -> SandboxRecord:
        return cls(
            sandbox_id=row["id"],
            template_id=row["template_id"],
            alias=row["alias"],
            state=State(row["state"]),
            started_at=row["started_at"],
            end_at=row["end_at"],
            metadata=dict(row["metadata"]),
            env_vars=dict(row["env_vars"]),
            auto_pause=bool(row["auto_pause"]),
            auto_pause_memory=bool(row["auto_pause_memory"]),
            auto_resume=bool(row["auto_resume"]),
            cpu_count=int(row["cpu_count"]),
            memory_mb=int(row["memory_mb"]),
            disk_size_mb=int(row["disk_size_mb"]),
            envd_version=row["envd_version"],
            envd_access_token=row["envd_access_token"],
            traffic_access_token=row["traffic_access_token"],
            secure=bool(row["secure"]),
            allow_internet_access=row["allow_internet_access"],
            network=row["network"],
            source=TemplateRef.from_json(row["source"]),
            placement=Placement.from_json(row["placement"]) if row["placement"] else None,
            pause_snapshot=(
                TemplateRef.from_json(row["pause_snapshot"]) if row["pause_snapshot"] else None
            ),
            pause_mode=row["pause_mode"],
            pause_asked_memory=bool(row.get("pause_asked_memory", True)),
            created_at=row["created_at"],
            team=row.get("team", LOCAL_TEAM),
            parent_sandbox_id=row.get("parent_sandbox_id"),
            source_snapshot_id=row.get("source_snapshot_id"),
            last_pause=(TemplateRef.from_json(row["last_pause"]) if row.get("last_pause")
                        else None),
            idle_pause_after=int(row.get("idle_pause_after", 0)),
            pause_reason=row.get("pause_reason"),
            volume_mounts=[MountRecord.from_json(m) for m in row.get("volume_mounts") or []],
        )


@dataclass
class TemplateRecord:
    """A template or a sandbox snapshot; both can be named as templateID at create time."""

    template_id: str
    kind: str  # "template" | "snapshot"
    names: list[str]
    ref: TemplateRef
    cpu_count: int
    memory_mb: int
    disk_size_mb: int
    envd_version: str
    created_at: float
    updated_at: float
    source_sandbox_id: str | None = None
    spawn_count: int = 0
    last_spawned_at: float | None = None
    build_status: str = "ready"
    #: the template build whose snapshot `ref` is (its "default" tag); None for snapshots,
    #: built-in templates and templates built before tags were kept
    build_id: str | None = None
    #: the team that made it (api/tenancy.py); tenancy.SHARED for a built-in template
    team: str = LOCAL_TEAM
    #: idlePauseAfter of the sandboxes made from it that name none (node/idle.py); None:
    #: the node's default
    idle_pause_after: int | None = None


#: The tag every template build gets when it is built without tags (E2B's DEFAULT_TAG); a
#: name without ":tag" means this one.
DEFAULT_TAG = "default"


@dataclass
class BuildSnapshot:
    """One template build that a tag points at: what a sandbox made from "name:tag" starts."""

    build_id: str
    template_id: str
    ref: TemplateRef
    cpu_count: int
    memory_mb: int
    disk_size_mb: int
    envd_version: str
    created_at: float

    def to_json(self) -> dict[str, Any]:
        return {"ref": self.ref.to_json(), "cpu_count": self.cpu_count,
                "memory_mb": self.memory_mb, "disk_size_mb": self.disk_size_mb,
                "envd_version": self.envd_version}

    @classmethod
    def from_row(cls, build_id: str, template_id: str, created_at: float,
                 doc: dict[str, Any]) -> BuildSnapshot:
        return cls(build_id=build_id, template_id=template_id,
                   ref=TemplateRef.from_json(doc["ref"]), cpu_count=int(doc["cpu_count"]),
                   memory_mb=int(doc["memory_mb"]), disk_size_mb=int(doc["disk_size_mb"]),
                   envd_version=str(doc["envd_version"]), created_at=created_at)


@dataclass(frozen=True)
class TagAssignment:
    """Tag `tag` of a template names build `build_id` since `assigned_at`."""

    template_id: str
    tag: str
    build_id: str
    assigned_at: float


@dataclass
class VolumeRecord:
    """A team's volume (node/volumes.py): its content is the directory
    `<state>/volumes/<volume_id>/data`."""

    volume_id: str
    team: str
    name: str
    #: what its content may count (node/volume_files.py `charge`)
    size_bytes: int
    created_at: float = field(default_factory=time.time)
    #: its latest sealed version (an overlaybd layer mounts use) and that version's number
    layer: str | None = None
    version: int = 0
    #: the content changed since `layer` was sealed (set before a change is made)
    dirty: bool = True

    def to_doc(self) -> dict[str, Any]:
        return {"size_bytes": self.size_bytes, "layer": self.layer, "version": self.version,
                "dirty": self.dirty}

    @classmethod
    def from_row(cls, volume_id: str, team: str, name: str, created_at: float,
                 doc: dict[str, Any]) -> VolumeRecord:
        return cls(volume_id=volume_id, team=team, name=name, created_at=created_at,
                   size_bytes=int(doc["size_bytes"]), layer=doc.get("layer"),
                   version=int(doc.get("version", 0)), dirty=bool(doc.get("dirty", True)))
