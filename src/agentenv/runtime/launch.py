"""Starting QEMU processes for the runtime: as which user (the VM user, or a uid of its own
leased for a jailed QEMU), in which cgroup (limits, I/O limits, CPU weight), with which tuning
(TCG on one host thread or several, counting the vCPUs starting together), its disks attached
for that user by the caller's `attach`."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any, Literal

from agentenv.runtime import privilege
from agentenv.runtime.cgroup import (
    Cgroup,
    CgroupManager,
    IOLimit,
    default_parent,
    io_device,
    limits_for,
)
from agentenv.runtime.config import RuntimeConfig
from agentenv.runtime.jail import UidPool
from agentenv.runtime.network import NetworkSlot
from agentenv.runtime.qemu import DiskAttachment, QemuProcess
from agentenv.snapshot.record import MachineConfig

log = logging.getLogger("agentenv.runtime")


class QemuLauncher:
    """The runtime's QEMU starter; `start` (with the runtime's) settles the user and cgroups."""

    def __init__(self, config: RuntimeConfig) -> None:
        self.config = config
        self.vm_user: privilege.VMUser | None = None
        # Per-VM uids of jailed QEMUs (runtime/jail.py); None: every QEMU runs as vm_user.
        self.uids = (UidPool.parse(config.vm_uid_range, config.vm_uid_lease_dir)
                     if config.qemu_jail and config.qemu_user else None)
        self.cgroups = CgroupManager(None, {})
        self.io_limit: IOLimit | None = None
        self.starting_vcpus = 0

    async def start(self, accel: Literal["kvm", "tcg"]) -> None:
        """The VM user (and its directories), the uid leases, the cgroups: before the first
        QEMU, after the adoption of an earlier run's VMs."""
        if self.config.qemu_user:
            self.vm_user = privilege.VMUser.lookup(self.config.qemu_user, kvm=accel == "kvm")
            if self.uids is not None:
                # A jailed QEMU reaches its files through its jail's bind mounts: no VM uid
                # needs any way into the state directory.
                privilege.withdraw(self.vm_user, self.config.state_dir,
                                   [self.config.vm_dir, self.config.memory_dir])
                self.jail_root.mkdir(mode=0o700, exist_ok=True)
                # After adoption (the node adopts before it starts the runtime).
                freed = await asyncio.to_thread(self.uids.sweep)
                if freed:
                    log.info("VM uid leases of gone VMs dropped", extra={"uids": freed})
            else:
                privilege.prepare_dirs(self.vm_user, self.config.state_dir,
                                       [self.config.vm_dir, self.config.memory_dir])
        self.cgroups = CgroupManager.detect(
            self.config.cgroups, self.config.cgroup_parent
            or default_parent(self.config.network_prefix, self.config.state_dir))
        self.io_limit = self.io_limit_config()

    def jailed_uid(self, user: privilege.VMUser | None) -> int | None:
        """`user`'s uid when it is a jailed QEMU's own (its writable disks are its alone)."""
        return user.uid if user is not None and user is not self.vm_user else None

    def tuning(self, extra_vcpus: int = 0, *, boot: bool = False) -> dict[str, Any]:
        """Options for a QEMU about to start; `extra_vcpus`: its vCPUs if not counted as
        starting (see starting)."""
        return {"tb_size_mib": self.config.tcg_tb_size_mib, "thp": self.config.qemu_thp,
                "return_free_memory": self.config.return_free_memory,
                "tcg_single_thread": self.tcg_single_thread(extra_vcpus, boot=boot),
                "user": self.vm_user, "sandbox": self.config.qemu_sandbox,
                "limits": self.config.qemu_limits}

    @property
    def jail_root(self) -> Path:
        """The empty directory each jailed QEMU's tmpfs root is mounted on, in its own mount
        namespace (runtime/jail.py)."""
        return self.config.state_dir / "jail-root"

    def identity(self, owner: str) -> privilege.VMUser | None:
        """The user the next QEMU runs as: a uid of its own when jailed (leased here; given
        back by uid_releaser once that QEMU has exited, or by the caller if it never starts)."""
        if self.uids is None or self.vm_user is None:
            return self.vm_user
        return self.vm_user.jailed(self.uids.allocate(owner))

    def uid_releaser(self, user: privilege.VMUser | None) -> Callable[[], None] | None:
        """What gives `user`'s uid back to the pool (None: not a leased uid)."""
        uids = self.uids
        if uids is None or user is None or not uids.contains(user.uid):
            return None
        uid = user.uid
        return lambda: uids.release(uid)

    async def spawn(self, machine: MachineConfig, workdir: Path, mem_path: Path,
                          incoming: bool, slot: NetworkSlot | None,
                          attach: Callable[[privilege.VMUser | None],
                                           Awaitable[list[DiskAttachment]]],
                          extra_vcpus: int = 0) -> QemuProcess:
        """A QEMU for `machine`, as the user (and in the jail) the config asks for; `attach`
        makes its disks for that user."""
        user = self.identity(workdir.name)
        jailed = user is not None and user is not self.vm_user
        try:
            attachments = await attach(user)
            tuning = {**self.tuning(extra_vcpus, boot=not incoming), "user": user}
            return await QemuProcess.spawn(
                machine, workdir, mem_path=str(mem_path), disks=attachments, incoming=incoming,
                netns=slot.netns_path if slot else None, qemu_binary=self.config.qemu_binary,
                die_with_parent=self.config.qemu_die_with_parent,
                cgroup=self.cgroup(workdir.name, machine, tuning),
                jail_root=self.jail_root if jailed else None,
                on_exit=self.uid_releaser(user), **tuning)
        except BaseException:
            release = self.uid_releaser(user)
            if release is not None:
                release()  # its QEMU never started, or has exited
            raise

    def io_limit_config(self) -> IOLimit | None:
        c = self.config
        if not (c.io_read_bps or c.io_write_bps or c.io_read_iops or c.io_write_iops):
            return None
        device = io_device(c.state_dir)
        if device is None:
            log.warning("io limits set but the state directory has no block device: not applied",
                        extra={"state_dir": str(c.state_dir)})
            return None
        return IOLimit(device, c.io_read_bps, c.io_write_bps, c.io_read_iops, c.io_write_iops)

    def cgroup(self, name: str, machine: MachineConfig,
                tuning: dict[str, Any]) -> Cgroup | None:
        """The cgroup a QEMU about to start joins (None when cgroups are off). Its CPU weight
        counts the host threads that run its vCPUs: one for single-threaded TCG."""
        threads = 1 if machine.accel == "tcg" and tuning["tcg_single_thread"] else None
        return self.cgroups.create(name, limits_for(machine, self.config, self.io_limit,
                                                    vcpu_threads=threads))

    def tcg_single_thread(self, extra_vcpus: int = 0, *, boot: bool = False) -> bool:
        """Whether a TCG VM starting now runs its vCPUs on one host thread (config.tcg_threads).
        "auto" never picks it for a boot: boots are template builds, one at a time, whose steps
        want both vCPUs, and the saving was measured on restores."""
        mode = self.config.tcg_threads
        if mode != "auto":
            return mode == "single"
        if boot:
            return False
        # Demand = the vCPUs starting now (a fork's children all at once) plus the host's load
        # (runnable threads, 1-minute average): idle VMs, parked or waiting for the model,
        # take no CPU and do not count.
        demand = extra_vcpus + self.starting_vcpus + os.getloadavg()[0]
        return demand > self.config.tcg_vcpus_per_core * (os.cpu_count() or 1)

    @contextlib.contextmanager
    def starting(self, vcpus: int) -> Iterator[None]:
        """Count a VM's vCPUs while it starts, so VMs started together (a fork's children)
        see each other in tcg_single_thread()."""
        self.starting_vcpus += vcpus
        try:
            yield
        finally:
            self.starting_vcpus -= vcpus
