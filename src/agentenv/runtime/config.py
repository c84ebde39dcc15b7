"""Runtime configuration."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field


class RuntimeConfig(BaseModel):
    state_dir: Path = Path("/var/lib/aenv")
    accel: Literal["auto", "kvm", "tcg"] = "auto"
    qemu_binary: str = "qemu-system-x86_64"
    default_vcpus: int = Field(default=2, ge=1)
    default_memory_mib: int = Field(default=512, ge=64)
    network: bool = True
    network_prefix: str = "aenv"
    # The node-wide egress proxy's port on the host (agentenv.network): TCP to the metadata
    # address, and the TCP a slot's policy sends through the proxy, are redirected to it.
    egress_proxy_port: int | None = Field(default=None, ge=1, le=65535)
    # Private ranges an operator opens to guests (a lab), e.g. ["192.168.50.0/24"]; they then
    # obey each sandbox's policy like any address. Off by default (runtime/network.py).
    network_open_ranges: list[str] = Field(default_factory=list)
    slot_pool_low: int = 2
    slot_pool_high: int = 16
    # Slot i's addresses are 10.12.x.(2i, 2i+1) whatever the prefix: two runtimes on one host
    # need disjoint index ranges.
    slot_first_index: int = Field(default=1, ge=1)
    # Seconds a freed slot's addresses rest before another VM gets them (0: reuse at once).
    slot_reuse_delay: float = Field(default=0.0, ge=0.0)
    # Warm QEMU processes per primed snapshot (restores/forks of templates).
    process_pool_low: int = 2
    process_pool_high: int = 16
    # TCG translation cache per VM (MiB) and whether QEMU may use transparent huge pages;
    # both are private memory of every VM (see bench/RESULTS.md "VM lifecycle").
    tcg_tb_size_mib: int = Field(default=64, ge=1)
    # TCG vCPU threads. "multi": one host thread per vCPU (a lone VM computes in parallel);
    # "single": all of a VM's vCPUs take turns on one thread, which wastes less CPU when the
    # host is oversubscribed (no guest vCPU spinning on a lock or IPI whose holder's thread is
    # descheduled: a fork of 16 on 2 cores costs ~20% less; bench/RESULTS.md). "auto": single
    # once the vCPUs starting at the same time plus the host's load average exceed
    # tcg_vcpus_per_core per host core, decided when each restored QEMU starts (boots: multi).
    tcg_threads: Literal["auto", "multi", "single"] = "auto"
    tcg_vcpus_per_core: float = Field(default=2.0, gt=0)
    qemu_thp: bool = False
    # Free-page reporting gives the guest's freed memory back to the host: QEMU opens the
    # shared RAM file writable under a seccomp filter that ignores punch-hole (runtime/qemu.py).
    # False: the file is opened read-only and QEMU refuses every discard.
    return_free_memory: bool = True
    envd_port: int = 49983
    envd_health_path: str = "/health"
    envd_init_path: str = "/init"
    boot_timeout: float = 120.0
    restore_timeout: float = 30.0
    blockd_socket: Path | None = None
    snapshot_root: Path | None = None  # default: <state_dir>/snapshots
    # A memory stack deeper than this is compacted into one layer when a snapshot is taken.
    max_memory_layers: int = Field(default=32, ge=1, le=255)
    # False: QEMU processes survive a crash of the runtime's process (no PDEATHSIG), so a
    # restarted process can re-adopt them (runtime/adopt.py).
    qemu_die_with_parent: bool = True

    @property
    def vm_dir(self) -> Path:
        return self.state_dir / "vms"

    @property
    def snapshot_dir(self) -> Path:
        return self.snapshot_root or self.state_dir / "snapshots"

    @property
    def memory_dir(self) -> Path:
        return self.state_dir / "memory"
