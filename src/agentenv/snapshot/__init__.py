"""Snapshot records: memory layers, disk layers, device state, machine config."""

from agentenv.snapshot.record import (
    DiskConfig,
    DiskSnapshot,
    LayerRef,
    MachineConfig,
    SnapshotRecord,
    SnapshotRecordError,
)

__all__ = [
    "DiskConfig",
    "DiskSnapshot",
    "LayerRef",
    "MachineConfig",
    "SnapshotRecord",
    "SnapshotRecordError",
]
