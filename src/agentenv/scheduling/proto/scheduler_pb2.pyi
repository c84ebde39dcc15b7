from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Empty(_message.Message):
    __slots__ = ()
    def __init__(self) -> None: ...

class ScheduleRequest(_message.Message):
    __slots__ = ("template_id", "snapshot_id", "vcpus", "memory_mib", "source_sandbox_id", "team_id", "strategy", "layers", "exclude_nodes")
    TEMPLATE_ID_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOT_ID_FIELD_NUMBER: _ClassVar[int]
    VCPUS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_MIB_FIELD_NUMBER: _ClassVar[int]
    SOURCE_SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    TEAM_ID_FIELD_NUMBER: _ClassVar[int]
    STRATEGY_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    EXCLUDE_NODES_FIELD_NUMBER: _ClassVar[int]
    template_id: str
    snapshot_id: str
    vcpus: int
    memory_mib: int
    source_sandbox_id: str
    team_id: str
    strategy: str
    layers: _containers.RepeatedScalarFieldContainer[str]
    exclude_nodes: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, template_id: _Optional[str] = ..., snapshot_id: _Optional[str] = ..., vcpus: _Optional[int] = ..., memory_mib: _Optional[int] = ..., source_sandbox_id: _Optional[str] = ..., team_id: _Optional[str] = ..., strategy: _Optional[str] = ..., layers: _Optional[_Iterable[str]] = ..., exclude_nodes: _Optional[_Iterable[str]] = ...) -> None: ...

class ScheduleResponse(_message.Message):
    __slots__ = ("node_id", "node_address", "reason", "reservation")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    node_address: str
    reason: str
    reservation: str
    def __init__(self, node_id: _Optional[str] = ..., node_address: _Optional[str] = ..., reason: _Optional[str] = ..., reservation: _Optional[str] = ...) -> None: ...

class Assignment(_message.Message):
    __slots__ = ("sandbox_id", "node_id", "team_id", "vcpus", "memory_mib", "reservation")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    TEAM_ID_FIELD_NUMBER: _ClassVar[int]
    VCPUS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_MIB_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    node_id: str
    team_id: str
    vcpus: int
    memory_mib: int
    reservation: str
    def __init__(self, sandbox_id: _Optional[str] = ..., node_id: _Optional[str] = ..., team_id: _Optional[str] = ..., vcpus: _Optional[int] = ..., memory_mib: _Optional[int] = ..., reservation: _Optional[str] = ...) -> None: ...

class ReleaseRequest(_message.Message):
    __slots__ = ("sandbox_id", "reservation")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    RESERVATION_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    reservation: str
    def __init__(self, sandbox_id: _Optional[str] = ..., reservation: _Optional[str] = ...) -> None: ...

class LookupRequest(_message.Message):
    __slots__ = ("sandbox_id",)
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    def __init__(self, sandbox_id: _Optional[str] = ...) -> None: ...

class LookupResponse(_message.Message):
    __slots__ = ("found", "node_id", "node_address", "node_up", "team_id")
    FOUND_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    NODE_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    NODE_UP_FIELD_NUMBER: _ClassVar[int]
    TEAM_ID_FIELD_NUMBER: _ClassVar[int]
    found: bool
    node_id: str
    node_address: str
    node_up: bool
    team_id: str
    def __init__(self, found: _Optional[bool] = ..., node_id: _Optional[str] = ..., node_address: _Optional[str] = ..., node_up: _Optional[bool] = ..., team_id: _Optional[str] = ...) -> None: ...

class SandboxState(_message.Message):
    __slots__ = ("sandbox_id", "state", "team_id")
    SANDBOX_ID_FIELD_NUMBER: _ClassVar[int]
    STATE_FIELD_NUMBER: _ClassVar[int]
    TEAM_ID_FIELD_NUMBER: _ClassVar[int]
    sandbox_id: str
    state: str
    team_id: str
    def __init__(self, sandbox_id: _Optional[str] = ..., state: _Optional[str] = ..., team_id: _Optional[str] = ...) -> None: ...

class NodeStatus(_message.Message):
    __slots__ = ("node_id", "address", "layer_address", "cpu_total", "cpu_free", "memory_total_mib", "memory_free_mib", "disk_free_bytes", "running", "paused", "sandboxes", "templates", "snapshots", "layers", "max_sandboxes", "template_layers", "blobs", "partial_blobs", "sandbox_overhead_mib", "sandbox_overhead_per_vcpu_mib", "disk_floor_bytes", "cpu_bound", "memory_bound", "host_cpus", "host_memory_mib", "memory_available_mib", "cpu_pressure", "memory_pressure", "cpu_busy", "template_sizes")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    ADDRESS_FIELD_NUMBER: _ClassVar[int]
    LAYER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CPU_TOTAL_FIELD_NUMBER: _ClassVar[int]
    CPU_FREE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_TOTAL_MIB_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FREE_MIB_FIELD_NUMBER: _ClassVar[int]
    DISK_FREE_BYTES_FIELD_NUMBER: _ClassVar[int]
    RUNNING_FIELD_NUMBER: _ClassVar[int]
    PAUSED_FIELD_NUMBER: _ClassVar[int]
    SANDBOXES_FIELD_NUMBER: _ClassVar[int]
    TEMPLATES_FIELD_NUMBER: _ClassVar[int]
    SNAPSHOTS_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    MAX_SANDBOXES_FIELD_NUMBER: _ClassVar[int]
    TEMPLATE_LAYERS_FIELD_NUMBER: _ClassVar[int]
    BLOBS_FIELD_NUMBER: _ClassVar[int]
    PARTIAL_BLOBS_FIELD_NUMBER: _ClassVar[int]
    SANDBOX_OVERHEAD_MIB_FIELD_NUMBER: _ClassVar[int]
    SANDBOX_OVERHEAD_PER_VCPU_MIB_FIELD_NUMBER: _ClassVar[int]
    DISK_FLOOR_BYTES_FIELD_NUMBER: _ClassVar[int]
    CPU_BOUND_FIELD_NUMBER: _ClassVar[int]
    MEMORY_BOUND_FIELD_NUMBER: _ClassVar[int]
    HOST_CPUS_FIELD_NUMBER: _ClassVar[int]
    HOST_MEMORY_MIB_FIELD_NUMBER: _ClassVar[int]
    MEMORY_AVAILABLE_MIB_FIELD_NUMBER: _ClassVar[int]
    CPU_PRESSURE_FIELD_NUMBER: _ClassVar[int]
    MEMORY_PRESSURE_FIELD_NUMBER: _ClassVar[int]
    CPU_BUSY_FIELD_NUMBER: _ClassVar[int]
    TEMPLATE_SIZES_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    address: str
    layer_address: str
    cpu_total: int
    cpu_free: int
    memory_total_mib: int
    memory_free_mib: int
    disk_free_bytes: int
    running: int
    paused: int
    sandboxes: _containers.RepeatedCompositeFieldContainer[SandboxState]
    templates: _containers.RepeatedScalarFieldContainer[str]
    snapshots: _containers.RepeatedScalarFieldContainer[str]
    layers: _containers.RepeatedScalarFieldContainer[str]
    max_sandboxes: int
    template_layers: _containers.RepeatedCompositeFieldContainer[TemplateLayers]
    blobs: _containers.RepeatedScalarFieldContainer[str]
    partial_blobs: _containers.RepeatedScalarFieldContainer[str]
    sandbox_overhead_mib: int
    sandbox_overhead_per_vcpu_mib: int
    disk_floor_bytes: int
    cpu_bound: str
    memory_bound: str
    host_cpus: int
    host_memory_mib: int
    memory_available_mib: int
    cpu_pressure: float
    memory_pressure: float
    cpu_busy: float
    template_sizes: _containers.RepeatedCompositeFieldContainer[TemplateSize]
    def __init__(self, node_id: _Optional[str] = ..., address: _Optional[str] = ..., layer_address: _Optional[str] = ..., cpu_total: _Optional[int] = ..., cpu_free: _Optional[int] = ..., memory_total_mib: _Optional[int] = ..., memory_free_mib: _Optional[int] = ..., disk_free_bytes: _Optional[int] = ..., running: _Optional[int] = ..., paused: _Optional[int] = ..., sandboxes: _Optional[_Iterable[_Union[SandboxState, _Mapping]]] = ..., templates: _Optional[_Iterable[str]] = ..., snapshots: _Optional[_Iterable[str]] = ..., layers: _Optional[_Iterable[str]] = ..., max_sandboxes: _Optional[int] = ..., template_layers: _Optional[_Iterable[_Union[TemplateLayers, _Mapping]]] = ..., blobs: _Optional[_Iterable[str]] = ..., partial_blobs: _Optional[_Iterable[str]] = ..., sandbox_overhead_mib: _Optional[int] = ..., sandbox_overhead_per_vcpu_mib: _Optional[int] = ..., disk_floor_bytes: _Optional[int] = ..., cpu_bound: _Optional[str] = ..., memory_bound: _Optional[str] = ..., host_cpus: _Optional[int] = ..., host_memory_mib: _Optional[int] = ..., memory_available_mib: _Optional[int] = ..., cpu_pressure: _Optional[float] = ..., memory_pressure: _Optional[float] = ..., cpu_busy: _Optional[float] = ..., template_sizes: _Optional[_Iterable[_Union[TemplateSize, _Mapping]]] = ...) -> None: ...

class TemplateSize(_message.Message):
    __slots__ = ("template_id", "vcpus", "memory_mib")
    TEMPLATE_ID_FIELD_NUMBER: _ClassVar[int]
    VCPUS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_MIB_FIELD_NUMBER: _ClassVar[int]
    template_id: str
    vcpus: int
    memory_mib: int
    def __init__(self, template_id: _Optional[str] = ..., vcpus: _Optional[int] = ..., memory_mib: _Optional[int] = ...) -> None: ...

class TemplateLayers(_message.Message):
    __slots__ = ("template_id", "layers")
    TEMPLATE_ID_FIELD_NUMBER: _ClassVar[int]
    LAYERS_FIELD_NUMBER: _ClassVar[int]
    template_id: str
    layers: _containers.RepeatedScalarFieldContainer[str]
    def __init__(self, template_id: _Optional[str] = ..., layers: _Optional[_Iterable[str]] = ...) -> None: ...

class HeartbeatResponse(_message.Message):
    __slots__ = ("interval_ms",)
    INTERVAL_MS_FIELD_NUMBER: _ClassVar[int]
    interval_ms: int
    def __init__(self, interval_ms: _Optional[int] = ...) -> None: ...

class HoldersRequest(_message.Message):
    __slots__ = ("digests", "node_id", "limit")
    DIGESTS_FIELD_NUMBER: _ClassVar[int]
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    digests: _containers.RepeatedScalarFieldContainer[str]
    node_id: str
    limit: int
    def __init__(self, digests: _Optional[_Iterable[str]] = ..., node_id: _Optional[str] = ..., limit: _Optional[int] = ...) -> None: ...

class Holder(_message.Message):
    __slots__ = ("node_id", "layer_address", "complete", "credential")
    NODE_ID_FIELD_NUMBER: _ClassVar[int]
    LAYER_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    COMPLETE_FIELD_NUMBER: _ClassVar[int]
    CREDENTIAL_FIELD_NUMBER: _ClassVar[int]
    node_id: str
    layer_address: str
    complete: bool
    credential: str
    def __init__(self, node_id: _Optional[str] = ..., layer_address: _Optional[str] = ..., complete: _Optional[bool] = ..., credential: _Optional[str] = ...) -> None: ...

class BlobHolders(_message.Message):
    __slots__ = ("digest", "holders")
    DIGEST_FIELD_NUMBER: _ClassVar[int]
    HOLDERS_FIELD_NUMBER: _ClassVar[int]
    digest: str
    holders: _containers.RepeatedCompositeFieldContainer[Holder]
    def __init__(self, digest: _Optional[str] = ..., holders: _Optional[_Iterable[_Union[Holder, _Mapping]]] = ...) -> None: ...

class HoldersResponse(_message.Message):
    __slots__ = ("blobs",)
    BLOBS_FIELD_NUMBER: _ClassVar[int]
    blobs: _containers.RepeatedCompositeFieldContainer[BlobHolders]
    def __init__(self, blobs: _Optional[_Iterable[_Union[BlobHolders, _Mapping]]] = ...) -> None: ...

class NodeInfo(_message.Message):
    __slots__ = ("status", "up", "last_heartbeat_unix_ms", "down_reason", "discovered_by")
    STATUS_FIELD_NUMBER: _ClassVar[int]
    UP_FIELD_NUMBER: _ClassVar[int]
    LAST_HEARTBEAT_UNIX_MS_FIELD_NUMBER: _ClassVar[int]
    DOWN_REASON_FIELD_NUMBER: _ClassVar[int]
    DISCOVERED_BY_FIELD_NUMBER: _ClassVar[int]
    status: NodeStatus
    up: bool
    last_heartbeat_unix_ms: int
    down_reason: str
    discovered_by: str
    def __init__(self, status: _Optional[_Union[NodeStatus, _Mapping]] = ..., up: _Optional[bool] = ..., last_heartbeat_unix_ms: _Optional[int] = ..., down_reason: _Optional[str] = ..., discovered_by: _Optional[str] = ...) -> None: ...

class NodeList(_message.Message):
    __slots__ = ("nodes",)
    NODES_FIELD_NUMBER: _ClassVar[int]
    nodes: _containers.RepeatedCompositeFieldContainer[NodeInfo]
    def __init__(self, nodes: _Optional[_Iterable[_Union[NodeInfo, _Mapping]]] = ...) -> None: ...
