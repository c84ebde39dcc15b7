"""Runtime configuration."""

from __future__ import annotations

from collections.abc import Mapping
from ipaddress import IPv4Address
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field

from agentenv.envd_client import INIT_PATH
from agentenv.runtime.jail import ProcessLimits
from agentenv.settings import setting_text


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
    # The node's NFS server's port on the host (shared volumes, docs/volumes.md §7.1): TCP of
    # a slot with its NFS hole open (Runtime.set_nfs) to 169.254.169.254:2049 is redirected
    # to it, and nothing else reaches it. None: no slot can reach an NFS server.
    nfs_port: int | None = Field(default=None, ge=1, le=65535)
    # The NFS server's address in its own network namespace (runtime/nfs_net.py): the slots'
    # NFS TCP is DNATed to nfs_address:nfs_port. None: redirected to the host's nfs_port
    # (a server in the host's namespace: tests only; the node always sets it).
    nfs_address: str | None = None
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
    # Where a restore's RAM file comes from (runtime/memdev.py): "blockd" = blockd's shared
    # read-only memory device (its FUSE file; no export, no copy per snapshot), falling back
    # to "file" when blockd has no FUSE files; "file" = the stack exported once per snapshot
    # as a raw file (runtime/memory.py). memory_prefetch: read a fresh device in the order of
    # the snapshot's startup pack, and the pack's load ranges at every restore, while QEMU
    # starts.
    memory_device: Literal["blockd", "file"] = "blockd"
    memory_prefetch: bool = True
    envd_port: int = 49983
    envd_health_path: str = "/health"
    envd_init_path: str = INIT_PATH
    boot_timeout: float = 120.0
    restore_timeout: float = 30.0
    blockd_socket: Path | None = None
    snapshot_root: Path | None = None  # default: <state_dir>/snapshots
    # A memory stack deeper than this is compacted into one layer when a snapshot is taken.
    max_memory_layers: int = Field(default=32, ge=1, le=255)
    # ... and so is a stack whose layers hold more bytes than this times the VM's RAM: each
    # pause adds a layer of the pages dirtied since the last restore, so by depth alone one
    # sandbox's memory snapshots could reach 32x its RAM. Compacting keeps them within RAM +
    # one layer's worth (the merged layer holds at most RAM).
    max_memory_stack_ratio: float = Field(default=1.5, ge=1.0)
    # False: QEMU processes survive a crash of the runtime's process (no PDEATHSIG), so a
    # restarted process can re-adopt them (runtime/adopt.py).
    qemu_die_with_parent: bool = True
    # Least privilege (runtime/privilege.py): QEMU runs as this unprivileged user (None: as
    # root) under its own seccomp sandbox (-sandbox on,obsolete=deny,elevateprivileges=deny,
    # spawn=deny,resourcecontrol=deny) stacked on the punch-hole filter.
    qemu_user: str | None = "aenv-vm"
    qemu_sandbox: bool = True
    # A jail per VM (runtime/jail.py): each QEMU runs as a uid and gid of its own from
    # vm_uid_range (no passwd entries; qemu_user's group as a supplementary group), as PID 1
    # of its own PID namespace, in a mount namespace holding only its files. Needs qemu_user.
    # Leases of the uids in use live in vm_uid_lease_dir (host-wide, survives a node crash).
    qemu_jail: bool = True
    vm_uid_range: str = Field(default="200000-265535", pattern=r"^\d+-\d+$")
    vm_uid_lease_dir: Path = Path("/run/aenv/vm-uids")
    # One cgroup per QEMU (runtime/cgroup.py). "auto": cgroup v2, else v1 controllers (hybrid
    # hosts), else a logged warning and no limits; "on": fail at start without them; "off":
    # none; "v1": the same as "auto" (v1 used to be opt-in).
    cgroups: Literal["auto", "on", "off", "v1"] = "auto"
    # Parent of the VMs' cgroups: relative = under the node's own cgroup, absolute = from the
    # hierarchy root. None: "<network_prefix>-<hash of state_dir>.slice" (cgroup.default_parent).
    cgroup_parent: str | None = None
    # memory.max = guest memory + this (None: vm_memory_overhead(), measured under TCG).
    vm_memory_overhead_mib: int | None = Field(default=None, ge=0)
    # cpu.weight = cpu_weight_per_vcpu x the host threads running vCPUs (vCPUs, or 1 under
    # single-threaded TCG); cpu.max = cpu_max_per_vcpu host CPUs per vCPU (0: no cap).
    cpu_weight_per_vcpu: int = Field(default=100, ge=1, le=10000)
    cpu_max_per_vcpu: float = Field(default=1.0, ge=0)
    qemu_pids_max: int = Field(default=512, ge=0)  # QEMU's threads (0: no limit)
    # Throttle of QEMU's own file I/O on the state directory's device (0: none). The guest's
    # disks go through blockd (another process), so these bound RAM-file reads and the like.
    io_read_bps: int = Field(default=0, ge=0)
    io_write_bps: int = Field(default=0, ge=0)
    io_read_iops: int = Field(default=0, ge=0)
    io_write_iops: int = Field(default=0, ge=0)
    # Bus of a booted VM's writable blockd disk (a DiskSource may name its own). "virtio-scsi":
    # the guest gets ENOSPC when the disk's upper reaches blockd's cap (and root is /dev/sda);
    # "virtio-blk": it gets EIO. Restores keep the bus their snapshot was taken with.
    disk_bus: Literal["virtio-blk", "virtio-scsi"] = "virtio-blk"
    # Volume disks every booted machine gets (DiskConfig.volume_slot, `vol0`...): empty null
    # devices until a restore or boot gives one a volume's layers, so a snapshot's device
    # state already has them (a restore cannot add devices). Each is VOLUME_DISK_BYTES big.
    volume_slots: int = Field(default=0, ge=0, le=8)
    # The resolver a booted guest's /etc/resolv.conf names (init bind-mounts a tmpfs copy over
    # the image's). An image's own resolv.conf is the build host's (debootstrap copies it) or
    # empty (OCI images), and a host's resolver is usually on loopback or a private address,
    # which the egress walls keep guests from. 8.8.8.8 is E2B's, and the address the network
    # policy opens by default for DNS (`dnsServers`). None: leave the image's file alone.
    guest_dns: IPv4Address | None = IPv4Address("8.8.8.8")
    # Each slot's network bandwidth, each way, in Mbit/s (runtime/network.py: a token bucket on
    # the slot's veth, so one guest's bulk transfer or flood of flows cannot take the host's
    # link from the others; traffic through the egress proxy included). 0: not shaped.
    slot_rate_mbit: int = Field(default=0, ge=0, le=400_000)
    # A guest's live flows at most (its connection-tracking entries: the host has one table for
    # every slot and the node itself, ~262144 entries). 0: no limit.
    slot_max_flows: int = Field(default=4096, ge=0)
    # Bytes of a VM's serial console log kept on disk (serial.log and its rotated tail
    # serial.log.1, runtime/serial.py): a guest writes to ttyS0 without end. 0: no cap.
    serial_log_max_bytes: int = Field(default=4 << 20, ge=0)
    # QEMU's RLIMIT_FSIZE (runtime/jail.py ProcessLimits): the most bytes of any file it writes
    # or grows (qemu.stderr, serial.log, a snapshot's device state, ~100 KB); never below the
    # serial log's cap, so the log reaches its trim size. RLIMIT_NOFILE: its descriptors.
    qemu_max_file_bytes: int = Field(default=64 << 20, ge=1 << 20)
    qemu_max_open_files: int = Field(default=4096, ge=256)

    @property
    def qemu_limits(self) -> ProcessLimits:
        return ProcessLimits(max(self.qemu_max_file_bytes, self.serial_log_max_bytes),
                             self.qemu_max_open_files)

    @property
    def vm_dir(self) -> Path:
        return self.state_dir / "vms"

    @property
    def snapshot_dir(self) -> Path:
        return self.snapshot_root or self.state_dir / "snapshots"

    @property
    def memory_dir(self) -> Path:
        return self.state_dir / "memory"


# Environment variables for the least-privilege and limit settings (the node's VM backend).
PRIVILEGE_ENV = {
    "AENV_QEMU_USER": "qemu_user", "AENV_QEMU_SANDBOX": "qemu_sandbox",
    "AENV_QEMU_JAIL": "qemu_jail", "AENV_VM_UID_RANGE": "vm_uid_range",
    "AENV_CGROUPS": "cgroups", "AENV_CGROUP_PARENT": "cgroup_parent",
    "AENV_VM_MEMORY_OVERHEAD_MB": "vm_memory_overhead_mib",
    "AENV_CPU_WEIGHT_PER_VCPU": "cpu_weight_per_vcpu", "AENV_CPU_MAX_PER_VCPU": "cpu_max_per_vcpu",
    "AENV_QEMU_PIDS_MAX": "qemu_pids_max",
    "AENV_IO_READ_BPS": "io_read_bps", "AENV_IO_WRITE_BPS": "io_write_bps",
    "AENV_IO_READ_IOPS": "io_read_iops", "AENV_IO_WRITE_IOPS": "io_write_iops",
    "AENV_MEMORY_DEVICE": "memory_device", "AENV_MEMORY_PREFETCH": "memory_prefetch",
    "AENV_DISK_BUS": "disk_bus", "AENV_GUEST_DNS": "guest_dns",
    "AENV_SERIAL_LOG_MAX_BYTES": "serial_log_max_bytes",
    "AENV_SLOT_RATE_MBIT": "slot_rate_mbit",
    "AENV_SLOT_MAX_FLOWS": "slot_max_flows",
    "AENV_QEMU_MAX_FILE_BYTES": "qemu_max_file_bytes",
    "AENV_QEMU_MAX_OPEN_FILES": "qemu_max_open_files",
}


def privilege_settings_from_env(env: Mapping[str, str] | None = None) -> dict[str, Any]:
    """RuntimeConfig fields from the AENV_* variables that are set (pydantic checks the
    values: a bad one names the field). AENV_QEMU_USER=root runs QEMU as root;
    AENV_GUEST_DNS=none leaves the guest's resolv.conf as the image has it."""
    out: dict[str, Any] = {}
    for name, field_name in PRIVILEGE_ENV.items():
        raw = setting_text(name, env).strip()
        if not raw:
            continue
        if (field_name, raw.lower()) in (("qemu_user", "root"), ("guest_dns", "none")):
            out[field_name] = None
        elif field_name in ("qemu_sandbox", "memory_prefetch", "qemu_jail"):
            out[field_name] = raw.lower() not in ("0", "false", "no", "off")
        else:
            out[field_name] = raw
    return out

