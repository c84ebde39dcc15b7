"""A VM's disks: what a boot or restore asks for (DiskSource, VolumeDisk, the empty volume
slots), how one is attached to a QEMU (a blockd device over sealed layers, or a read-only raw
file), and what the runtime holds of it while the VM runs (AttachedDisk)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

from agentenv.blockd.client import DiskService
from agentenv.blockd.errors import BlockdError
from agentenv.runtime.config import RuntimeConfig
from agentenv.runtime.errors import DiskError, RuntimeError_
from agentenv.runtime.qemu import DiskAttachment
from agentenv.snapshot.record import (
    VOLUME_DISK_BYTES,
    DiskBus,
    DiskConfig,
    LayerRef,
    MachineConfig,
    volume_slot_name,
)


@dataclass
class AttachedDisk:
    """A disk as the runtime holds it while a VM runs: what it is, the sealed layers under it,
    and what serves it (a blockd device or a plain file)."""

    config: DiskConfig
    layers: list[LayerRef]  # sealed layers under the device's upper (oldest first)
    device_id: str | None = None  # blockd device
    file: Path | None = None


@dataclass
class DiskSource:
    """A disk for a boot: an overlaybd stack served by blockd, or a read-only raw file."""

    name: str
    size: int
    read_only: bool = False
    layers: list[Path] = field(default_factory=list)  # oldest first (blockd lowers)
    file: Path | None = None  # raw file, read-only disks only
    chain_used: int = 0  # bytes of its own sealed uppers among `layers` (DiskSnapshot's)
    # None: RuntimeConfig.disk_bus for a writable disk, virtio-blk for a read-only one.
    bus: DiskBus | None = None
    volume_slot: bool = False  # DiskConfig.volume_slot: empty without layers


@dataclass(frozen=True)
class VolumeDisk:
    """A volume for an empty volume slot of a restored machine (docs/volumes.md §6): its
    sealed layers (oldest first), read-only (one blockd device shared by every VM that mounts
    them) or copy-on-write (a device of its own, with a private upper)."""

    layers: list[Path]
    read_only: bool


def with_volumes(machine: MachineConfig, volumes: dict[str, VolumeDisk]) -> MachineConfig:
    """`machine` with the slots `volumes` fills read-only where their volume is: QEMU's node
    for such a disk is read-only (the device state does not record it, so a snapshot of the
    machine with empty slots restores)."""
    if not volumes:
        return machine
    slots = {d.name for d in machine.disks if d.volume_slot}
    if not set(volumes) <= slots:
        raise RuntimeError_(f"disks {sorted(set(volumes) - slots)} are not volume slots of "
                            f"this machine (it has {sorted(slots)})")
    disks = [d.model_copy(update={"read_only": volumes[d.name].read_only})
             if d.name in volumes else d for d in machine.disks]
    return machine.model_copy(update={"disks": disks})


def volume_slot_sources(config: RuntimeConfig, disks: list[DiskSource]) -> list[DiskSource]:
    """The empty volume slots a booted machine gets beside `disks` (those it has already,
    a cold boot from a snapshot's disks, are kept as they are)."""
    have = {d.name for d in disks}
    return [DiskSource(volume_slot_name(i), VOLUME_DISK_BYTES, bus="virtio-blk",
                       volume_slot=True)
            for i in range(config.volume_slots) if volume_slot_name(i) not in have]


async def attach_disk(blockd: DiskService | None, config: DiskConfig, layers: list[LayerRef],
                      file: Path | None, workdir: Path, jailed_uid: int | None = None,
                      chain_used: int = 0) -> tuple[AttachedDisk, DiskAttachment]:
    """A disk for one QEMU, served by `blockd` (or a raw file); a writable one's NBD socket
    becomes `jailed_uid`'s alone, a jailed QEMU's own uid (a read-only device may be shared by
    several VMs). `chain_used`: what the disk's own sealed uppers among `layers` took of its
    cap."""
    name, size, read_only = config.name, config.size, config.read_only
    if config.volume_slot and not layers:  # an empty volume slot
        return AttachedDisk(config, []), DiskAttachment(name, False, null_size=size)
    if file is not None:
        if not read_only:
            raise RuntimeError_(f"disk {name}: a raw file can only be a read-only disk")
        return (AttachedDisk(config, [], file=file),
                DiskAttachment(name, True, file=str(file)))
    if blockd is None:
        raise RuntimeError_(f"disk {name} needs blockd, and the runtime has no blockd client")
    upper = None if read_only else workdir / "disks" / name
    if upper is not None:
        upper.parent.mkdir(parents=True, exist_ok=True)
    # blockd makes a jailed QEMU's writable disk socket that uid's alone as it makes it (and
    # again after a restart, from its record): no moment where another VM could connect
    owner = jailed_uid if not read_only else None
    try:
        if read_only:
            # one shared, refcounted device per layer for every VM (a volume mounted
            # read-only: docs/volumes.md §6)
            if len(layers) != 1:
                raise RuntimeError_(f"disk {name}: a read-only blockd disk is one layer, "
                                    f"not {len(layers)}")
            info = await blockd.create(image=Path(layers[0].path), size=size,
                                       readonly=True)
        else:
            info = await blockd.create(lowers=[Path(x.path) for x in layers],
                                       upper_dir=upper, size=size, owner=owner,
                                       chain_used=chain_used or None)
    except BlockdError as exc:
        raise DiskError(f"disk {name}: {exc}") from exc
    disk = AttachedDisk(config, list(layers), device_id=info.id)
    return (disk,
            DiskAttachment(name, read_only, nbd_socket=info.nbd, nbd_export=info.export))
