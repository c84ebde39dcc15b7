"""The runtime's handles: a VM it runs (VM: its machine, QEMU process, network slot, disks and
memory lineage) and what a cold boot asks for (BootSpec)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from agentenv.network.policy import EgressPolicy
from agentenv.runtime.disks import AttachedDisk, DiskSource
from agentenv.runtime.errors import RuntimeError_
from agentenv.runtime.network import NetworkSlot
from agentenv.runtime.qemu import QemuProcess
from agentenv.snapshot.record import LayerRef, MachineConfig

VMState = Literal["starting", "running", "pausing", "paused", "stopped", "error"]


@dataclass
class BootSpec:
    kernel: Path
    cmdline: str  # base command line; network and hostname arguments are appended
    initramfs: Path | None = None
    vcpus: int | None = None
    memory_mib: int | None = None
    disks: list[DiskSource] = field(default_factory=list)
    hostname: str = "sandbox"
    outbound: bool = True
    dns: str | None = None  # the guest's resolver; None: RuntimeConfig.guest_dns
    egress: EgressPolicy | None = None  # the slot's policy (else `outbound`), before boot


@dataclass
class VM:
    id: str
    machine: MachineConfig
    process: QemuProcess
    slot: NetworkSlot | None
    workdir: Path
    memory_layers: list[LayerRef]
    mem_key: str | None  # MemoryFileCache key of the RAM file (None: the zero file)
    mem_path: Path
    disks: list[AttachedDisk]
    state: VMState = "starting"
    error: str | None = None
    started_at: float = field(default_factory=time.time)
    parent_snapshot: str | None = None
    timings: dict[str, float] = field(default_factory=dict)  # ms per phase of the last start
    _watch: asyncio.Task[None] | None = None

    @property
    def pid(self) -> int:
        return self.process.pid

    @property
    def vmgenid(self) -> str:
        return self.process.vmgenid

    @property
    def envd_url(self) -> str:
        if self.slot is None:
            raise RuntimeError_(f"VM {self.id} has no network")
        return self.slot.envd_url
