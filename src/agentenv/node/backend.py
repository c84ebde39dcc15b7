"""The port between the orchestrator and whatever runs sandboxes.

The orchestrator owns states, timeouts, records and the API; a backend only starts, stops,
snapshots and restores sandboxes. Two implementations are meant to plug in here:

- `ProcessBackend` (node/process_backend.py): envd as a host process on a copied directory.
  It needs no VM and is the development and test backend.
- the VM runtime (agentenv.runtime): QEMU VMs whose disks and memory are overlaybd stacks.

Everything a backend hands back (Placement.handle, SnapshotRef.data, TemplateRef.data) must be
JSON-serialisable: the orchestrator stores it in SQLite and passes it back after a node restart.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from agentenv.network.control import SlotIdentity
from agentenv.network.policy import EgressPolicy

#: The port envd listens on inside a sandbox, as the SDKs address it (E2b-Sandbox-Port).
ENVD_PORT = 49983


class BackendError(Exception):
    """A backend operation failed; `retryable` says whether the sandbox is still intact."""

    def __init__(self, message: str, *, retryable: bool = True,
                 unavailable: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable
        #: the host cannot serve the operation right now (blockd down): the API answers 503
        self.unavailable = unavailable


@dataclass(frozen=True)
class TemplateRef:
    """What a backend needs to start a sandbox from a template or snapshot (opaque to the node)."""

    kind: str  # "template" or "snapshot"
    data: dict[str, Any]
    #: overlaybd layer ids this template/snapshot pins (recorded as layer references).
    layers: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "data": self.data, "layers": list(self.layers)}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> TemplateRef:
        return cls(kind=raw["kind"], data=dict(raw["data"]), layers=tuple(raw.get("layers", ())))


#: A snapshot is the same thing as a template source: a snapshot id works as a templateID.
SnapshotRef = TemplateRef


@dataclass(frozen=True)
class SandboxSpec:
    sandbox_id: str
    source: TemplateRef
    cpu_count: int
    memory_mb: int
    disk_size_mb: int
    env_vars: dict[str, str]
    access_token: str | None
    allow_internet_access: bool
    metadata: dict[str, str]
    #: the templateID the sandbox was created from (a snapshot id for a sandbox made from one)
    template_id: str = ""
    #: what the sandbox may reach (backends with `enforces_network_policy` apply it before the
    #: sandbox runs) and who it is to the metadata service
    egress: EgressPolicy = field(default_factory=EgressPolicy)
    identity: SlotIdentity | None = None


@dataclass(frozen=True)
class Placement:
    """Where a running sandbox can be reached, plus the backend's own handle for it."""

    host: str
    #: the port envd really listens on at `host` (49983 inside a VM, anything for processes)
    envd_port: int
    handle: dict[str, Any] = field(default_factory=dict)
    #: the envd version the sandbox runs, if the backend knows it
    envd_version: str | None = None

    def address(self, port: int) -> tuple[str, int]:
        """(host, port) for sandbox port `port` as the SDK names it (49983 means envd)."""
        return self.host, self.envd_port if port == ENVD_PORT else port

    def upstream(self, port: int) -> str:
        """Base URL for sandbox port `port` as the SDK names it (49983 means envd)."""
        host, real = self.address(port)
        return f"http://{host}:{real}"

    @property
    def envd_url(self) -> str:
        return self.upstream(ENVD_PORT)

    def to_json(self) -> dict[str, Any]:
        return {
            "host": self.host,
            "envd_port": self.envd_port,
            "handle": self.handle,
            "envd_version": self.envd_version,
        }

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> Placement:
        return cls(
            host=raw["host"],
            envd_port=int(raw["envd_port"]),
            handle=dict(raw.get("handle") or {}),
            envd_version=raw.get("envd_version"),
        )


@dataclass(frozen=True)
class PauseResult:
    snapshot: SnapshotRef
    #: True when process memory was kept (real pause); False when only files were kept.
    memory: bool


@dataclass(frozen=True)
class ForkOutcome:
    """One child of a fork: a placement, or the reason this child failed."""

    sandbox_id: str
    placement: Placement | None = None
    error: str | None = None


@dataclass(frozen=True)
class MetricSample:
    timestamp: float
    cpu_count: int
    cpu_used_pct: float
    mem_used: int
    mem_total: int
    mem_cache: int
    disk_used: int
    disk_total: int


@dataclass(frozen=True)
class DefaultTemplate:
    name: str
    ref: TemplateRef
    cpu_count: int
    memory_mb: int
    disk_size_mb: int
    envd_version: str | None = None


@runtime_checkable
class SandboxBackend(Protocol):
    """What the orchestrator needs from a sandbox runtime. Every method may raise BackendError.

    Calls for one sandbox never overlap: the orchestrator serialises them.
    """

    #: "process" or "vm"; shown in /nodes and logs
    name: str

    async def start(self) -> None:
        """Prepare the backend (pools, daemons). Called once before anything else."""

    async def close(self) -> None:
        """Release what start() acquired. Running sandboxes are left alone (adopt() finds them)."""

    async def default_templates(self) -> list[DefaultTemplate]:
        """Templates the node registers at start-up when missing (at least "base")."""

    async def create(self, spec: SandboxSpec) -> Placement:
        """Start a sandbox from spec.source; return once its envd can be reached."""

    async def pause(self, sandbox_id: str, placement: Placement, memory: bool) -> PauseResult:
        """Stop the sandbox and keep its state; the sandbox no longer runs afterwards."""

    async def resume(self, spec: SandboxSpec, snapshot: SnapshotRef,
                     memory: bool = True) -> Placement:
        """Start the sandbox again from the snapshot pause() returned; memory=False boots it
        from the snapshot's disk even when the snapshot kept memory."""

    async def snapshot(
        self, sandbox_id: str, placement: Placement, snapshot_id: str
    ) -> SnapshotRef:
        """A persistent snapshot of a running sandbox, which keeps running."""

    async def fork(
        self, spec: SandboxSpec, placement: Placement, children: list[SandboxSpec]
    ) -> list[ForkOutcome]:
        """Start len(children) sandboxes from the current state of a running one."""

    async def kill(self, sandbox_id: str, placement: Placement | None) -> None:
        """Stop the sandbox if it runs and delete everything it owns (not its templates)."""

    async def delete_snapshot(self, ref: SnapshotRef) -> None:
        """Delete a snapshot or template's data (no sandbox uses it any more)."""

    async def discard_paused(self, sandbox_id: str, snapshot: SnapshotRef) -> None:
        """Delete the pause snapshot of a paused sandbox that is being killed."""

    async def adopt(self) -> dict[str, Placement]:
        """After a node restart: the sandboxes still running, by sandbox id."""

    async def metrics(self, sandbox_id: str, placement: Placement) -> MetricSample:
        """One current resource sample of a running sandbox."""
