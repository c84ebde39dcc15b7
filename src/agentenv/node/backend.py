"""The port between the orchestrator and whatever runs sandboxes.

The orchestrator owns states, timeouts, records and the API; a backend only starts, stops,
snapshots and restores sandboxes. Two implementations are meant to plug in here:

- `ProcessBackend` (node/process_backend.py): envd as a host process on a copied directory.
  It needs no VM and is the development and test backend.
- the VM runtime (agentenv.runtime): QEMU VMs whose disks and memory are overlaybd stacks.

Everything a backend hands back (Placement.handle, SnapshotRef.data, TemplateRef.data) must be
JSON-serialisable: the orchestrator stores it in SQLite and passes it back after a node restart.

What a backend can do beyond `SandboxBackend` is declared by the capability protocols at the end
(a backend class names those it implements among its bases); `Capabilities.of` resolves them
once where the node is assembled (node/server.py), and the node uses its typed fields.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, Protocol, runtime_checkable

from agentenv.network.control import SlotIdentity
from agentenv.network.policy import EgressPolicy

if TYPE_CHECKING:  # for annotations only: the process backend never loads blockd or the pool
    from agentenv.blockd.client import DeviceInfo
    from agentenv.node.ready_pool import ReadyPool

#: The port envd listens on inside a sandbox, as the SDKs address it (E2b-Sandbox-Port).
ENVD_PORT = 49983
#: The code-interpreter server's port (E2B's JUPYTER_PORT; agentenv.guest.codeint).
CODE_INTERPRETER_PORT = 49999


class BackendError(Exception):
    """A backend operation failed; `retryable` says whether the sandbox is still intact."""

    def __init__(self, message: str, *, retryable: bool = True,
                 unavailable: bool = False, bad_request: bool = False) -> None:
        super().__init__(message)
        self.retryable = retryable
        #: what was asked cannot be done with this sandbox's source (the API answers 400)
        self.bad_request = bad_request
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
class VolumeMount:
    """A volume in a sandbox (docs/volumes.md §6): the volume disk `slot` of its machine holds
    `layer` (a sealed version of the volume), mounted at `path`, read-only or copy-on-write."""

    slot: int
    path: str
    read_only: bool
    layer: str
    #: a shared read-write mount (`rw-shared`, docs/volumes.md §7.1): no volume disk (slot -1,
    #: no layer); the volume's directory on the host (`shared_dir`, the root of its own file
    #: system) is exported over NFS to the sandbox, whose root and users act as `owner` there
    volume_id: str = ""
    shared_dir: str = ""
    owner: tuple[int, int] = (0, 0)

    @property
    def shared(self) -> bool:
        return bool(self.shared_dir)


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
    #: what the sandbox may reach (backends with the NetworkPolicies capability apply it before
    #: the sandbox runs) and who it is to the metadata service
    egress: EgressPolicy = field(default_factory=EgressPolicy)
    identity: SlotIdentity | None = None
    #: the sandbox's envd token even when it is not secure (`access_token` None): a snapshot
    #: whose envd holds another sandbox's token (a pulled one carries it in its artifact) is
    #: re-keyed to this one, so that token never opens the copy
    own_token: str | None = None
    #: volumes the sandbox mounts (backends with the VolumeMounting capability): a create
    #: puts each in its slot unless its source snapshot has it there already; every start
    #: mounts them all before it returns
    volume_mounts: tuple[VolumeMount, ...] = ()


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


# --- capabilities beyond SandboxBackend ------------------------------------------------------


@runtime_checkable
class SandboxLogs(Protocol):
    """Where a running sandbox's output lands on the host (node/observer.py tails it)."""

    def log_files(self, sandbox_id: str) -> list[tuple[str, Path]]:
        """(source, file) pairs, e.g. ("console", the VM's serial log); [] when unknown."""
        ...


@runtime_checkable
class CrashRecovery(Protocol):
    """Finishes what a node killed in the middle of things left behind (node/recovery.py)."""

    #: after start(): why a sandbox of the previous run was not adopted, by sandbox id
    adopt_failures: dict[str, str]

    async def recover_pause(self, sandbox_id: str, placement: Placement,
                            since: float) -> PauseResult | None:
        """The pause a node killed while pausing `sandbox_id` (since `since`) completed on
        disk, as pause() would have returned it; None when there is no complete one."""
        ...


@runtime_checkable
class LayerAware(Protocol):
    """Tells the layer garbage collector (node/gc.py) what its live VMs and blockd use."""

    def files_in_use(self) -> set[Path]:
        """Files and directories live VMs and built-in templates use (never collected)."""
        ...

    async def blockd_devices(self) -> list[DeviceInfo]:
        """The block daemon's devices (their uppers and sources are in use)."""
        ...

    async def release_device(self, device_id: str) -> None:
        """Close a blockd device no VM uses."""
        ...


@runtime_checkable
class TemplateBuilding(Protocol):
    """Builds templates (node/template_api.py): from another template always, from images only
    where `builds_from_images` (a build VM booted from the image's layers)."""

    builds_from_images: bool

    async def boot_image(self, sandbox_id: str, lowers: list[Path], disk_bytes: int,
                         cpu_count: int, memory_mb: int) -> Placement:
        """Boot a build VM whose root disk is the layer stack `lowers`; return once its envd
        answers. kill() ends it."""
        ...

    async def capture_template(self, sandbox_id: str) -> TemplateRef:
        """Stop a build VM into a template's boot snapshot (owned by the template)."""
        ...


@runtime_checkable
class InitialisesEnvd(Protocol):
    """create/resume/fork return only after envd's /init with the spec's env vars and token:
    the orchestrator skips its own readiness round trip."""

    initialises_envd: Literal[True]


@runtime_checkable
class NetworkPolicies(Protocol):
    """Enforces SandboxSpec.egress, and replaces a running sandbox's policy."""

    async def set_network(self, sandbox_id: str, placement: Placement, policy: EgressPolicy,
                          identity: SlotIdentity | None) -> None:
        """Apply `policy` to the running sandbox, or raise BackendError with the old one kept."""
        ...

    async def network_reapplied(self) -> None:
        """Called after a start re-applied every adopted sandbox's policy: drop what no
        sandbox holds any more (an adopted egress proxy's stale entries)."""
        ...


@runtime_checkable
class SnapshotBranching(Protocol):
    """Starts sandboxes from a snapshot without touching it (a paused sandbox's pause snapshot:
    fork with no parent running), and restores a sandbox in place to one of its snapshots."""

    async def fork_snapshot(self, snapshot: SnapshotRef,
                            children: list[SandboxSpec]) -> list[ForkOutcome]:
        """Start len(children) sandboxes from `snapshot`, which stays as it is; an outcome
        per child (a child's failure is its own)."""
        ...

    async def rollback(self, spec: SandboxSpec, placement: Placement | None,
                       snapshot: SnapshotRef) -> Placement:
        """Sandbox `spec` (running at `placement`; None: paused) runs from `snapshot` instead,
        with spec's identity (a new envd token). The old VM ends only once the new one runs:
        a failure leaves the sandbox as it was."""
        ...

    async def release_snapshots(self, sandbox_id: str, keep: list[SnapshotRef]) -> None:
        """Release the snapshots the sandbox made for itself (earlier pauses, fork points)
        except those in `keep` (what a record still names: its current and last pause, a
        child's source). Their files go, but those a later snapshot grew from or a running
        VM (a child forked from one) still reads."""
        ...


@runtime_checkable
class VolumeMounting(Protocol):
    """Mounts volumes in sandboxes (SandboxSpec.volume_mounts; docs/volumes.md §6)."""

    def free_volume_slots(self, source: TemplateRef) -> list[int]:
        """The volume disks of `source`'s machine that hold no volume yet ([]: it has none,
        a template built before volumes)."""
        ...


@runtime_checkable
class HealthReport(Protocol):
    def health_problem(self) -> str | None:
        """Why the backend cannot serve sandboxes fully right now (/health: 503); None: fine."""
        ...


@runtime_checkable
class SharedHostPorts(Protocol):
    """A backend whose sandboxes' ports are ports of the node's own host (the process
    backend): the proxy must not relay to a port no process of the sandbox listens on."""

    def port_problem(self, sandbox_id: str, placement: Placement, port: int) -> str | None:
        """Why sandbox port `port` (as the SDK names it) may not be relayed; None: it may."""
        ...


@runtime_checkable
class ReadyPools(Protocol):
    """Keeps pre-started sandboxes ready (node/ready_pool.py; its figures are in /metrics)."""

    #: None until start() made it
    pool: ReadyPool | None


@dataclass(frozen=True)
class Capabilities:
    """What a backend can do beyond SandboxBackend, resolved once (`of`); None: it cannot."""

    crash_recovery: CrashRecovery | None = None
    layers: LayerAware | None = None
    templates: TemplateBuilding | None = None
    network: NetworkPolicies | None = None
    health: HealthReport | None = None
    pools: ReadyPools | None = None
    host_ports: SharedHostPorts | None = None
    logs: SandboxLogs | None = None
    branching: SnapshotBranching | None = None
    volumes: VolumeMounting | None = None
    initialises_envd: bool = False

    @property
    def enforces_network_policy(self) -> bool:
        return self.network is not None

    @classmethod
    def of(cls, backend: SandboxBackend) -> Capabilities:
        return cls(
            crash_recovery=backend if isinstance(backend, CrashRecovery) else None,
            layers=backend if isinstance(backend, LayerAware) else None,
            templates=backend if isinstance(backend, TemplateBuilding) else None,
            network=backend if isinstance(backend, NetworkPolicies) else None,
            health=backend if isinstance(backend, HealthReport) else None,
            pools=backend if isinstance(backend, ReadyPools) else None,
            host_ports=backend if isinstance(backend, SharedHostPorts) else None,
            logs=backend if isinstance(backend, SandboxLogs) else None,
            branching=backend if isinstance(backend, SnapshotBranching) else None,
            volumes=backend if isinstance(backend, VolumeMounting) else None,
            initialises_envd=isinstance(backend, InitialisesEnvd)
            and backend.initialises_envd is True,
        )
