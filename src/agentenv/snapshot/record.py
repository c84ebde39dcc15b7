"""Snapshot records: what a paused, forked or template VM is made of.

A snapshot is immutable once written. It names
- the machine it was taken from (`MachineConfig`: everything QEMU's command line depends on,
  because a restored VM must have exactly the devices the snapshot had),
- the accelerator mode (`kvm` or `tcg`): device state of one cannot be loaded under the other,
- the memory layer stack (overlaybd layers, oldest first; the newest holds the pages written
  since the VM was last restored),
- each writable disk's sealed layer stack (oldest first),
- the device-state file (QEMU's migration stream with the guest RAM pages stripped out).

A filesystem-only snapshot (`memory=False`, a pause that keeps no memory) has no memory layers
and no device state: it is cold-booted from its disks, never restored. Its `device_state` names
the record file itself, so that every snapshot's directory is `Path(device_state).parent`.
"""

from __future__ import annotations

import json
import time
import uuid
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from agentenv.errors import AgentEnvError
from agentenv.fsutil import atomic_write
from agentenv.storage import blob

RECORD_NAME = "snapshot.json"
RECORD_VERSION = 1
MAX_DESCRIPTOR_SIZE = 1 << 16  # a remote layer's descriptor file is far smaller


class SnapshotRecordError(AgentEnvError):
    pass


DiskBus = Literal["virtio-blk", "virtio-scsi"]
#: the virtual size of every volume disk (DiskConfig.volume_slot): a volume's layers are made
#: this big whatever its file system's size (node/volumes.py), so any volume fits any slot
VOLUME_DISK_BYTES = 64 << 30
#: what the guest reads in /sys/block/<dev>/serial for the volume disk `name`
VOLUME_SERIAL_PREFIX = "aenv-"


def volume_slot_name(index: int) -> str:
    """The name (QEMU's device id) of a machine's volume disk number `index`."""
    return f"vol{index}"


class DiskConfig(BaseModel):
    """One disk of a machine, in PCI order: virtio-blk ones are vda, vdb, ... in the guest; a
    virtio-scsi one (at most one per machine) is sda. The bus is part of the device state, so a
    snapshot restores with the bus it was taken with (records from before the field: virtio-blk)."""

    name: str  # device id inside QEMU, stable across snapshots: "tools", "rootfs", "drive-x"
    read_only: bool = False
    size: int  # bytes, the virtual size the guest sees
    # virtio-scsi carries blockd's ENOSPC (upper cap) to the guest as ENOSPC; virtio-blk as EIO.
    bus: DiskBus = "virtio-blk"
    #: a volume disk (docs/volumes.md §6): in every machine, empty (a null device reading
    #: zeros) until a restore or boot gives it a volume's layers; its guest serial is
    #: `aenv-<name>`
    volume_slot: bool = False


class MachineConfig(BaseModel):
    """Everything QEMU's command line depends on; equal configs restore each other's state."""

    vcpus: int = Field(default=2, ge=1, le=64)
    memory_mib: int = Field(default=512, ge=64, le=262144)
    accel: Literal["kvm", "tcg"]
    machine_type: str = "q35"
    cpu_model: str = "max"
    kernel: str
    initramfs: str | None = None
    cmdline: str
    disks: list[DiskConfig] = []
    network: bool = True
    mac: str = "02:ae:00:00:00:01"

    @property
    def memory_bytes(self) -> int:
        return self.memory_mib << 20


class LayerRef(BaseModel):
    """A sealed overlaybd layer file."""

    path: str
    size: int  # file size in bytes


class DiskSnapshot(BaseModel):
    name: str
    layers: list[LayerRef]  # oldest first (a volume slot without layers: empty)
    #: a volume slot's: the volume mounted read-only (a shared device, no upper)
    read_only: bool = False
    file: str | None = None  # a read-only raw-file disk (e.g. the tools disk)
    #: bytes of the disk's own sealed uppers among `layers` (its sandbox's pauses and
    #: snapshots since it was made): a resume of that sandbox counts them against its cap
    chain_used: int = 0


class SnapshotRecord(BaseModel):
    version: int = RECORD_VERSION
    id: str = Field(default_factory=lambda: uuid.uuid4().hex)
    created_ms: int = Field(default_factory=lambda: int(time.time() * 1000))
    source_vm: str | None = None
    parent_snapshot: str | None = None
    mode: Literal["kvm", "tcg"]
    machine: MachineConfig
    #: False: a filesystem-only snapshot (disks only; see the module doc)
    memory: bool = True
    memory_layers: list[LayerRef]  # oldest first
    device_state: str  # path of the stripped migration stream (memory=False: the record file)
    device_state_ram_block: str  # RAM block whose pages live in memory_layers
    disks: list[DiskSnapshot] = []
    qemu_version: str = ""

    def save(self, directory: Path) -> Path:
        """Write the record atomically into directory/snapshot.json."""
        directory.mkdir(parents=True, exist_ok=True)
        target = directory / RECORD_NAME
        atomic_write(target, self.model_dump_json(indent=2), mode=0o644)
        return target

    @classmethod
    def load(cls, directory_or_file: Path) -> SnapshotRecord:
        path = directory_or_file
        if path.is_dir():
            path = path / RECORD_NAME
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError as exc:
            raise SnapshotRecordError(f"snapshot record {path} does not exist") from exc
        except ValueError as exc:
            raise SnapshotRecordError(f"snapshot record {path} is not valid JSON: {exc}") from exc
        if data.get("version") != RECORD_VERSION:
            raise SnapshotRecordError(
                f"snapshot record {path} has version {data.get('version')}, expected {RECORD_VERSION}"
            )
        return cls.model_validate(data)

    def check_files(self) -> None:
        """Fail with a clear error when a file the snapshot needs is missing or truncated."""
        for layer in self.memory_layers:
            _check(Path(layer.path), layer.size, "memory layer")
        for disk in self.disks:
            for layer in disk.layers:
                _check(Path(layer.path), layer.size, f"disk {disk.name} layer")
        if not Path(self.device_state).is_file():
            raise SnapshotRecordError(f"snapshot {self.id}: device state {self.device_state} is missing")


def _check(path: Path, size: int, what: str) -> None:
    try:
        actual = path.stat().st_size
    except FileNotFoundError as exc:
        raise SnapshotRecordError(f"{what} {path} is missing") from exc
    if actual != size and actual < MAX_DESCRIPTOR_SIZE:
        # A layer pulled lazily is a remote layer's descriptor (storage/blob.py) naming the
        # registry blob: its size is the blob's.
        with open(path, "rb") as f:
            head = f.read(512)
        if blob.is_descriptor(head):
            try:
                actual = blob.load_descriptor(path).size
            except AgentEnvError as exc:
                raise SnapshotRecordError(f"{what} {path}: {exc}") from exc
    if actual != size:
        raise SnapshotRecordError(f"{what} {path} has {actual} bytes, the record says {size}")
