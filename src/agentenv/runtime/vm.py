"""The runtime: boot, pause, restore, fork and kill QEMU VMs. The node server's entry point.

    runtime = Runtime(RuntimeConfig(state_dir=...), blockd=AsyncBlockdClient(sock))
    await runtime.start()
    vm = await runtime.boot(BootSpec(kernel=..., initramfs=..., cmdline=..., disks=[...]))
    record = await runtime.pause(vm)            # VM gone, snapshot written
    vm2 = await runtime.restore(record, env_vars={...}, access_token=...)
    children = await runtime.fork(vm2, 4)       # vm2 keeps running
    await runtime.kill(vm2)
    await runtime.close()

A VM's memory lineage is the memory layer stack of the snapshot it was restored from (empty
for a cold boot); `snapshot()` captures the pages written since then as one new layer on top.
Disks are blockd devices (an overlaybd stack + writable upper each) or read-only raw files.
Every VM runs in its own network slot; the host reaches envd at `vm.envd_url`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import shutil
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from ipaddress import IPv4Address
from pathlib import Path
from typing import Any, Literal, TypeVar

import httpx

from agentenv.blockd.errors import BlockdError
from agentenv.envd_client import (
    GuestReplyError,
    GuestReplyTimeout,
    init_body,
    init_headers,
    read_reply,
)
from agentenv.fsutil import fsync_dir
from agentenv.logs import trim_log
from agentenv.network.policy import ALL_TRAFFIC, EgressPolicy
from agentenv.runtime import privilege
from agentenv.runtime.accel import resolve_accel
from agentenv.runtime.cgroup import (
    Cgroup,
    CgroupManager,
    IOLimit,
    default_parent,
    io_device,
    limits_for,
)
from agentenv.runtime.config import RuntimeConfig
from agentenv.runtime.devstate import finish_device_state
from agentenv.runtime.disks import AttachedDisk
from agentenv.runtime.errors import (
    DiskError,
    GuestNotReadyError,
    GuestRefusedError,
    ModeMismatchError,
    QMPError,
    RuntimeError_,
    SnapshotError,
    VMDiedError,
)
from agentenv.runtime.jail import UidPool
from agentenv.runtime.memdev import make_memory_store
from agentenv.runtime.memory import (
    capture_memory_layer,
    find_ram_mapping,
    materialise,
)
from agentenv.runtime.network import (
    GUEST_IP,
    NetworkSlot,
    SlotPool,
    parse_open_ranges,
    setup_host,
)
from agentenv.runtime.qemu import DiskAttachment, QemuProcess
from agentenv.runtime.serial import CHECK_INTERVAL as SERIAL_CHECK_INTERVAL
from agentenv.runtime.serial import SERIAL_LOG
from agentenv.runtime.warm_pool import WarmPool, WarmProcess
from agentenv.snapshot.record import (
    RECORD_NAME,
    VOLUME_DISK_BYTES,
    DiskBus,
    DiskConfig,
    DiskSnapshot,
    LayerRef,
    MachineConfig,
    SnapshotRecord,
    SnapshotRecordError,
    volume_slot_name,
)
from agentenv.storage.export import import_raw

log = logging.getLogger("agentenv.runtime")
T = TypeVar("T")

VMState = Literal["starting", "running", "pausing", "paused", "stopped", "error"]


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


def _with_volumes(machine: MachineConfig, volumes: dict[str, VolumeDisk]) -> MachineConfig:
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


@dataclass(frozen=True)
class _SnapshotFrame:
    """A snapshot under way: its id and directory, when it began and when the VM stopped."""

    id: str
    dir: Path
    t0: float
    t_stop: float


def _cmdline(spec: BootSpec, network: bool, disks: list[DiskConfig],
             guest_dns: IPv4Address | None) -> str:
    parts = [spec.cmdline]
    if any(d.name == "rootfs" and d.bus == "virtio-scsi" for d in disks):
        parts.append("aenv.root=/dev/sda")  # the guest init's default is /dev/vdb
    if network:
        parts.append(f"aenv.ip={GUEST_IP}/30 aenv.gw=169.254.0.22")
        dns = spec.dns or (str(guest_dns) if guest_dns else None)
        if dns:
            parts.append(f"aenv.dns={dns}")
    parts.append(f"aenv.hostname={spec.hostname}")
    return " ".join(parts)


class Runtime:
    def __init__(self, config: RuntimeConfig, blockd: Any | None = None,
                 on_vm_died: Callable[[VM], None] | None = None) -> None:
        self.config = config
        self.blockd = blockd
        self.on_vm_died = on_vm_died
        self.vms: dict[str, VM] = {}
        self._starting_vcpus = 0
        self.memory = make_memory_store(config, blockd)
        self.slots = SlotPool(config.network_prefix, config.slot_pool_low, config.slot_pool_high,
                              first_index=config.slot_first_index,
                              reuse_delay=config.slot_reuse_delay,
                              open_ranges=parse_open_ranges(config.network_open_ranges),
                              rate_mbit=config.slot_rate_mbit,
                              max_flows=config.slot_max_flows)
        self.accel: Literal["kvm", "tcg"] | None = None
        # No keep-alive: a restored guest carries the TCP state of its snapshot, so a pooled
        # connection to a reused slot address belongs to another incarnation of the guest and
        # hangs until the timeout (seen: 2.2 s on every second restore of one snapshot).
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(5.0, connect=1.0),
                                       limits=httpx.Limits(max_keepalive_connections=0))
        self.warm = WarmPool(config.vm_dir, self.slots, self.memory, self._memory_file,
                             self._spawn_for_restore, self._release_resources)
        self._started = False
        self._background: set[asyncio.Task[None]] = set()
        self._serial_trimmer: asyncio.Task[None] | None = None
        self.vm_user: privilege.VMUser | None = None
        # Per-VM uids of jailed QEMUs (runtime/jail.py); None: every QEMU runs as vm_user.
        self.uids = (UidPool.parse(config.vm_uid_range, config.vm_uid_lease_dir)
                     if config.qemu_jail and config.qemu_user else None)
        self.cgroups = CgroupManager(None, {})
        self._io_limit: IOLimit | None = None

    # -- lifecycle of the runtime itself --------------------------------------------------

    async def start(self, kernel_for_probe: Path | None = None) -> None:
        for d in (self.config.vm_dir, self.config.snapshot_dir, self.config.memory_dir):
            d.mkdir(parents=True, exist_ok=True)
        self.accel = resolve_accel(self.config.accel, str(kernel_for_probe) if kernel_for_probe else None)
        if self.config.qemu_user:
            self.vm_user = privilege.VMUser.lookup(self.config.qemu_user, kvm=self.accel == "kvm")
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
        self._io_limit = self._io_limit_config()
        if self.config.network:
            # Refused before anything is touched when another runtime uses this prefix.
            self.slots.acquire_prefix()
            await setup_host(self.config.network_prefix, self.config.egress_proxy_port,
                             keep_sources=self.slots.in_use_addresses(),
                             open_ranges=self.slots.open_ranges,
                             nfs_port=self.config.nfs_port)
            await self.slots.fill(self.config.slot_pool_low)
        # After adoption (the node adopts before it starts the runtime): memory devices of an
        # earlier run that no adopted VM took over are released.
        await asyncio.to_thread(self.memory.drop_orphans)
        if self.config.serial_log_max_bytes:
            self._serial_trimmer = asyncio.create_task(self._trim_serial_logs())
        self._started = True
        log.info("runtime started", extra={"accel": self.accel})

    async def close(self) -> None:
        if self._serial_trimmer is not None:
            self._serial_trimmer.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._serial_trimmer
        await self.drain()
        await self.warm.close()
        for vm in list(self.vms.values()):
            with contextlib.suppress(Exception):
                await self.kill(vm)
        await self.slots.close()
        await self._http.aclose()
        self.cgroups.close()

    # -- boot -----------------------------------------------------------------------------

    async def boot(self, spec: BootSpec, wait_ready: bool = True) -> VM:
        """Cold-boot a VM from a kernel and disks; returns once envd answers."""
        assert self.accel is not None, "Runtime.start() first"
        spec = dataclasses.replace(
            spec, disks=[*spec.disks, *volume_slot_sources(self.config, spec.disks)])
        disks = [DiskConfig(name=d.name, read_only=d.read_only, size=d.size,
                            bus=d.bus or ("virtio-blk" if d.read_only or d.file
                                          else self.config.disk_bus),
                            volume_slot=d.volume_slot)
                 for d in spec.disks]
        machine = MachineConfig(
            vcpus=spec.vcpus or self.config.default_vcpus,
            memory_mib=spec.memory_mib or self.config.default_memory_mib,
            accel=self.accel, kernel=str(spec.kernel),
            initramfs=str(spec.initramfs) if spec.initramfs else None,
            cmdline=_cmdline(spec, self.config.network, disks, self.config.guest_dns),
            disks=disks, network=self.config.network,
        )
        with self._starting(machine.vcpus):
            return await self._boot(spec, machine, wait_ready)

    async def _boot(self, spec: BootSpec, machine: MachineConfig, wait_ready: bool) -> VM:
        vm_id = uuid.uuid4().hex[:12]
        workdir = self.config.vm_dir / vm_id
        mem_path = self.memory.zero_file(machine.memory_bytes)
        slot = await self.slots.take() if self.config.network else None
        disks: list[AttachedDisk] = []
        try:
            if slot is not None and spec.egress is not None:
                await slot.set_policy(spec.egress)
            elif slot is not None and not spec.outbound:
                await slot.set_outbound(False)

            async def attach(user: privilege.VMUser | None) -> list[DiskAttachment]:
                attachments = []
                for source, cfg in zip(spec.disks, machine.disks, strict=True):
                    disk, attachment = await self._attach_disk(
                        cfg, [LayerRef(path=str(p), size=p.stat().st_size)
                              for p in source.layers], source.file, workdir, user,
                        source.chain_used)
                    disks.append(disk)
                    attachments.append(attachment)
                return attachments

            process = await self._spawn_qemu(machine, workdir, mem_path, False, slot, attach)
        except BaseException:
            await self._release_resources(slot, disks, None)
            raise
        vm = VM(vm_id, machine, process, slot, workdir, [], None, mem_path, disks)
        self._adopt(vm)
        if wait_ready:
            try:
                await self.wait_envd(vm, self.config.boot_timeout)
            except BaseException:
                await self.kill(vm)
                raise
        vm.state = "running"
        return vm

    async def _attach_disk(self, config: DiskConfig, layers: list[LayerRef], file: Path | None,
                           workdir: Path, user: privilege.VMUser | None = None,
                           chain_used: int = 0) -> tuple[AttachedDisk, DiskAttachment]:
        """A disk for one QEMU; a writable one's NBD socket becomes `user`'s alone when that
        is a jailed QEMU's own uid (a read-only device may be shared by several VMs).
        `chain_used`: what the disk's own sealed uppers among `layers` took of its cap."""
        name, size, read_only = config.name, config.size, config.read_only
        if config.volume_slot and not layers:  # an empty volume slot
            return AttachedDisk(config, []), DiskAttachment(name, False, null_size=size)
        if file is not None:
            if not read_only:
                raise RuntimeError_(f"disk {name}: a raw file can only be a read-only disk")
            return (AttachedDisk(config, [], file=file),
                    DiskAttachment(name, True, file=str(file)))
        if self.blockd is None:
            raise RuntimeError_(f"disk {name} needs blockd, and the runtime has no blockd client")
        upper = None if read_only else workdir / "disks" / name
        if upper is not None:
            upper.parent.mkdir(parents=True, exist_ok=True)
        # blockd makes a jailed QEMU's writable disk socket that uid's alone as it makes it (and
        # again after a restart, from its record): no moment where another VM could connect
        owner = user.uid if not read_only and user is not None and user is not self.vm_user \
            else None
        try:
            if read_only:
                # one shared, refcounted device per layer for every VM (a volume mounted
                # read-only: docs/volumes.md §6)
                if len(layers) != 1:
                    raise RuntimeError_(f"disk {name}: a read-only blockd disk is one layer, "
                                        f"not {len(layers)}")
                info = await self.blockd.create(image=Path(layers[0].path), size=size,
                                                readonly=True)
            else:
                info = await self.blockd.create(lowers=[Path(x.path) for x in layers],
                                                upper_dir=upper, size=size, owner=owner,
                                                chain_used=chain_used or None)
        except BlockdError as exc:
            raise DiskError(f"disk {name}: {exc}") from exc
        disk = AttachedDisk(config, list(layers), device_id=info.id)
        return (disk,
                DiskAttachment(name, read_only, nbd_socket=info.nbd, nbd_export=info.export))

    def _qemu_tuning(self, extra_vcpus: int = 0, *, boot: bool = False) -> dict[str, Any]:
        """Options for a QEMU about to start; `extra_vcpus`: its vCPUs if not counted as
        starting (see _starting)."""
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

    def _identity(self, owner: str) -> privilege.VMUser | None:
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

    async def _spawn_qemu(self, machine: MachineConfig, workdir: Path, mem_path: Path,
                          incoming: bool, slot: NetworkSlot | None,
                          attach: Callable[[privilege.VMUser | None],
                                           Awaitable[list[DiskAttachment]]],
                          extra_vcpus: int = 0) -> QemuProcess:
        """A QEMU for `machine`, as the user (and in the jail) the config asks for; `attach`
        makes its disks for that user."""
        user = self._identity(workdir.name)
        jailed = user is not None and user is not self.vm_user
        try:
            attachments = await attach(user)
            tuning = {**self._qemu_tuning(extra_vcpus, boot=not incoming), "user": user}
            return await QemuProcess.spawn(
                machine, workdir, mem_path=str(mem_path), disks=attachments, incoming=incoming,
                netns=slot.netns_path if slot else None, qemu_binary=self.config.qemu_binary,
                die_with_parent=self.config.qemu_die_with_parent,
                cgroup=self._cgroup(workdir.name, machine, tuning),
                jail_root=self.jail_root if jailed else None,
                on_exit=self.uid_releaser(user), **tuning)
        except BaseException:
            release = self.uid_releaser(user)
            if release is not None:
                release()  # its QEMU never started, or has exited
            raise

    def _io_limit_config(self) -> IOLimit | None:
        c = self.config
        if not (c.io_read_bps or c.io_write_bps or c.io_read_iops or c.io_write_iops):
            return None
        device = io_device(c.state_dir)
        if device is None:
            log.warning("io limits set but the state directory has no block device: not applied",
                        extra={"state_dir": str(c.state_dir)})
            return None
        return IOLimit(device, c.io_read_bps, c.io_write_bps, c.io_read_iops, c.io_write_iops)

    def _cgroup(self, name: str, machine: MachineConfig,
                tuning: dict[str, Any]) -> Cgroup | None:
        """The cgroup a QEMU about to start joins (None when cgroups are off). Its CPU weight
        counts the host threads that run its vCPUs: one for single-threaded TCG."""
        threads = 1 if machine.accel == "tcg" and tuning["tcg_single_thread"] else None
        return self.cgroups.create(name, limits_for(machine, self.config, self._io_limit,
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
        demand = extra_vcpus + self._starting_vcpus + os.getloadavg()[0]
        return demand > self.config.tcg_vcpus_per_core * (os.cpu_count() or 1)

    @contextlib.contextmanager
    def _starting(self, vcpus: int) -> Iterator[None]:
        """Count a VM's vCPUs while it starts, so VMs started together (a fork's children)
        see each other in tcg_single_thread()."""
        self._starting_vcpus += vcpus
        try:
            yield
        finally:
            self._starting_vcpus -= vcpus

    def _adopt(self, vm: VM) -> None:
        self.vms[vm.id] = vm
        vm._watch = asyncio.create_task(self._watch(vm))

    def track(self, vm: VM) -> None:
        """Take over a VM this runtime did not start (runtime/adopt.py re-adopts the VMs of a
        crashed process): watched for its exit, killed and paused like any other."""
        self._adopt(vm)

    async def _trim_serial_logs(self) -> None:
        """Keeps every VM's serial console log within serial_log_max_bytes (runtime/serial.py)."""
        cap = self.config.serial_log_max_bytes

        def trim_all(logs: list[Path]) -> list[Path]:
            return [log_path for log_path in logs if trim_log(log_path, cap)]

        while True:
            logs = [vm.workdir / SERIAL_LOG for vm in list(self.vms.values())]
            try:
                for rotated in await asyncio.to_thread(trim_all, logs):
                    log.debug("serial log rotated", extra={"vm": rotated.parent.name})
            except OSError as exc:  # a full disk, say: tried again at the next look
                log.warning("serial log not trimmed", extra={"error": str(exc)})
            await asyncio.sleep(SERIAL_CHECK_INTERVAL)

    async def _watch(self, vm: VM) -> None:
        await vm.process.died.wait()
        if vm.process.expected_exit:
            return
        vm.state = "error"
        vm.error = vm.process.exit_reason()
        log.error("VM died", extra={"vm": vm.id, "reason": vm.error})
        await self._release_resources(vm.slot, vm.disks, vm.mem_key)
        vm.slot, vm.disks, vm.mem_key = None, [], None
        self.vms.pop(vm.id, None)
        if self.on_vm_died is not None:
            self.on_vm_died(vm)

    async def wait_envd(self, vm: VM, timeout: float) -> None:
        url = vm.envd_url + self.config.envd_health_path
        deadline = time.monotonic() + timeout
        while True:
            if vm.process.died.is_set():
                raise VMDiedError(vm.process.exit_reason())
            try:
                answer = await read_reply(self._http, "GET", url, what=f"envd of VM {vm.id}",
                                          timeout=1.0)
                if answer.is_success:
                    return
            except (httpx.HTTPError, GuestReplyTimeout):
                pass  # not up yet (or slow under load): polled again until the deadline
            except GuestReplyError as exc:
                raise GuestNotReadyError(str(exc)) from None
            if time.monotonic() > deadline:
                raise GuestNotReadyError(f"envd of VM {vm.id} did not answer within {timeout:.0f} s")
            await asyncio.sleep(0.02)

    async def envd_init(self, vm: VM, env_vars: dict[str, str] | None = None,
                        access_token: str | None = None, *,
                        guest_token: str | None = None,
                        mounts: list[dict[str, Any]] | None = None) -> None:
        """POST /init: env vars, access token, and the host's time (the guest clock stood still).

        `guest_token` is the token envd already holds in the snapshot (a fork child wakes up
        with its parent's): envd takes a new token only when the current one comes along.
        `mounts`: volume disks envd mounts before it answers (docs/volumes.md §6).
        """
        # The request is envd_client's; sent from here because it races QEMU's exit.
        headers = init_headers(guest_token) or None
        url = vm.envd_url + self.config.envd_init_path
        deadline = time.monotonic() + self.config.restore_timeout
        while True:
            if vm.process.died.is_set():
                raise VMDiedError(vm.process.exit_reason())
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise GuestNotReadyError(f"envd of VM {vm.id} unreachable after restore")
            body = init_body(env_vars=env_vars, access_token=access_token,
                             volume_mounts=mounts)
            try:
                # Connecting is retried quickly (envd may not listen yet), but once the request
                # is in, the answer is awaited until the deadline: under TCG with many guests
                # starting at once it takes seconds, and sending it again only adds work.
                answer = await self._while_alive(vm, read_reply(
                    self._http, "POST", url, what=f"envd /init of VM {vm.id}",
                    timeout=remaining, connect_timeout=1.0, json=body, headers=headers))
            except GuestReplyError as exc:
                # what answers on envd's port is the guest's: an endless or dripping reply
                raise GuestNotReadyError(str(exc)) from None
            except (httpx.ConnectError, httpx.ConnectTimeout, httpx.ReadError,
                    httpx.RemoteProtocolError):
                await asyncio.sleep(0.005)
                continue
            except httpx.HTTPError as exc:
                raise GuestNotReadyError(
                    f"envd /init of VM {vm.id} did not answer within "
                    f"{self.config.restore_timeout:.0f} s: {exc!r}") from None
            if answer.is_success:
                return
            # envd's message says why (a volume it could not mount): bounded, one line
            why = "".join(c if c.isprintable() else " " for c in answer.text[:300]).strip()
            message = f"envd /init of VM {vm.id} answered {answer.status_code}: {why}"
            if 400 <= answer.status_code < 500:
                raise GuestRefusedError(message, answer.status_code)
            raise GuestNotReadyError(message)

    async def _while_alive(self, vm: VM, call: Awaitable[T]) -> T:
        """`call`'s result, but give up as soon as the VM's QEMU exits (VMDiedError)."""
        post = asyncio.ensure_future(call)
        died = asyncio.ensure_future(vm.process.died.wait())
        try:
            await asyncio.wait({post, died}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            died.cancel()
            if not post.done():
                post.cancel()
                with contextlib.suppress(BaseException):
                    await post
        if post.cancelled():
            raise VMDiedError(vm.process.exit_reason())
        return post.result()

    # -- snapshot / pause -----------------------------------------------------------------

    async def snapshot(self, vm: VM, *, keep_running: bool = True) -> SnapshotRecord:
        """Stop the VM, write a snapshot, and resume it (keep_running) or leave it stopped."""
        async with self._stopped_for_snapshot(vm, "snapshot") as snap:
            snap_id, snap_dir, t0, t_stop = snap.id, snap.dir, snap.t0, snap.t_stop
            # Guest RAM is frozen from here on. The capture (a thread) runs while QEMU saves
            # its devices: device saving never writes guest RAM (QEMU's own migration saves
            # devices after the last RAM pass, so it could not).
            layer_path = snap_dir / "memory.layer"
            capture = asyncio.ensure_future(asyncio.to_thread(self._capture, vm, layer_path))
            try:
                devstate = await self._save_device_state(vm, snap_dir)
                t_dev = time.perf_counter()
                stats = await asyncio.shield(capture)
            except BaseException:
                # The capture thread writes into snap_dir: let it end before cleaning up.
                await asyncio.gather(capture, return_exceptions=True)
                raise
            t_capture = time.perf_counter()
            memory_layers = [*vm.memory_layers,
                             LayerRef(path=str(layer_path), size=layer_path.stat().st_size)]
            if self._memory_stack_too_big(memory_layers, vm.machine.memory_bytes):
                memory_layers = [await asyncio.to_thread(
                    _compact_memory, memory_layers, snap_dir, vm.machine.memory_bytes)]
            t_mem = time.perf_counter()
            disks = await self._snapshot_disks(vm, snap_dir)
            t_disks = time.perf_counter()
            record = SnapshotRecord(
                id=snap_id, source_vm=vm.id, parent_snapshot=vm.parent_snapshot,
                mode=vm.machine.accel, machine=vm.machine,
                memory_layers=memory_layers,
                device_state=str(devstate), device_state_ram_block="ram0", disks=disks,
                qemu_version=_qemu_version(vm.process),
            )
            await asyncio.to_thread(_save_record_durably, record, snap_dir)
        t_end = time.perf_counter()
        log.info("snapshot", extra={
            "vm": vm.id, "snapshot": snap_id, "devstate_ms": round((t_dev - t_stop) * 1e3, 1),
            "memory_ms": round((t_mem - t_stop) * 1e3, 1), "written_pages": stats.written_pages,
            "zero_pages": stats.zero_pages})
        vm.timings.update(snapshot_stop_ms=(t_stop - t0) * 1e3,
                          snapshot_devstate_ms=(t_dev - t_stop) * 1e3,
                          snapshot_memory_ms=(t_mem - t_stop) * 1e3,
                          snapshot_capture_wait_ms=(t_capture - t_dev) * 1e3,
                          snapshot_disks_ms=(t_disks - t_mem) * 1e3,
                          snapshot_record_ms=(t_end - t_disks) * 1e3,
                          snapshot_total_ms=(t_end - t0) * 1e3,
                          snapshot_written_pages=stats.written_pages,
                          **{f"snapshot_mem_{k}_ms": v for k, v in stats.phases_ms.items()})
        if keep_running:
            await vm.process.execute("cont")
            vm.state = "running"
        return record

    def _memory_stack_too_big(self, layers: list[LayerRef], memory_bytes: int) -> bool:
        """Whether a snapshot's memory stack must be merged: too deep (restore cost,
        overlaybd's layer cap) or too many bytes for the VM's RAM (a node's disk)."""
        return (len(layers) > self.config.max_memory_layers
                or sum(x.size for x in layers) > self.config.max_memory_stack_ratio * memory_bytes)

    async def snapshot_disks(self, vm: VM) -> SnapshotRecord:
        """Stop the VM and seal each writable disk's upper into a layer: a filesystem-only
        snapshot (no memory, no device state), left stopped. What the guest had not written
        to its disks is lost, as at a power cut: flush the guest's filesystems first (envd's
        /aenv/sync). A failure leaves the VM running, as `snapshot` does."""
        async with self._stopped_for_snapshot(vm, "disk snapshot") as snap:
            snap_id, snap_dir, t0, t_stop = snap.id, snap.dir, snap.t0, snap.t_stop
            disks = await self._snapshot_disks(vm, snap_dir)
            record = SnapshotRecord(
                id=snap_id, source_vm=vm.id, parent_snapshot=vm.parent_snapshot,
                mode=vm.machine.accel, machine=vm.machine, memory=False, memory_layers=[],
                device_state=str(snap_dir / RECORD_NAME), device_state_ram_block="",
                disks=disks, qemu_version=_qemu_version(vm.process))
            await asyncio.to_thread(_save_record_durably, record, snap_dir)
        t_end = time.perf_counter()
        vm.timings.update(snapshot_stop_ms=(t_stop - t0) * 1e3,
                          snapshot_disks_ms=(t_end - t_stop) * 1e3,
                          snapshot_total_ms=(t_end - t0) * 1e3)
        log.info("disk snapshot", extra={"vm": vm.id, "snapshot": snap_id,
                                         "ms": round((t_end - t0) * 1e3, 1)})
        return record

    @contextlib.asynccontextmanager
    async def _stopped_for_snapshot(self, vm: VM, what: str) -> AsyncIterator[_SnapshotFrame]:
        """The frame `snapshot` and `snapshot_disks` share: a new snapshot directory and the
        VM stopped (vCPUs halted) for the body. If the body fails, the directory goes and the
        VM runs again when QEMU is still alive (else it is in error); an OSError becomes a
        SnapshotError naming `what` failed."""
        if vm.state != "running":
            raise RuntimeError_(f"VM {vm.id} is {vm.state}, only a running VM can be snapshotted")
        snap_id = uuid.uuid4().hex
        snap_dir = self.config.snapshot_dir / snap_id
        snap_dir.mkdir(parents=True)
        vm.state = "pausing"
        t0 = time.perf_counter()
        try:
            await vm.process.execute("stop")
            yield _SnapshotFrame(snap_id, snap_dir, t0, time.perf_counter())
        except BaseException as exc:
            shutil.rmtree(snap_dir, ignore_errors=True)
            await self._after_failed_snapshot(vm, exc)
            if isinstance(exc, OSError):
                raise SnapshotError(
                    f"{what} of VM {vm.id} failed: {exc.strerror or exc}"
                    f"{' (' + exc.filename + ')' if exc.filename else ''}") from exc
            raise

    async def _save_device_state(self, vm: VM, snap_dir: Path) -> Path:
        """Device state (no RAM) of the stopped VM as a loadable stream (devstate.py)."""
        # Written by QEMU into its own workdir (an unprivileged QEMU cannot create files in the
        # snapshot directory), made loadable into the snapshot by the runtime.
        raw = vm.workdir / "devstate.raw"
        if vm.process.user is not None:
            privilege.precreate(raw, vm.process.user)
        try:
            await vm.process.execute("xen-save-devices-state",
                                     {"filename": str(raw), "live": False})
            machine_type = await vm.process.execute(
                "qom-get", {"path": "/machine", "property": "type"})
            devstate = snap_dir / "devstate.bin"
            await asyncio.to_thread(finish_device_state, raw, devstate, machine_type)
        finally:
            raw.unlink(missing_ok=True)
        return devstate

    def _capture(self, vm: VM, out: Path) -> Any:
        addr = find_ram_mapping(vm.pid, str(vm.mem_path), vm.machine.memory_bytes)
        parent = None
        return capture_memory_layer(vm.pid, addr, vm.machine.memory_bytes, out,
                                    parent_uuid=parent)

    async def _snapshot_disks(self, vm: VM, snap_dir: Path) -> list[DiskSnapshot]:
        out: list[DiskSnapshot] = []
        for disk in vm.disks:
            if disk.file is not None or disk.config.read_only or disk.device_id is None:
                # read-only, or an empty volume slot (no layers: it stays empty)
                out.append(DiskSnapshot(name=disk.config.name, layers=disk.layers,
                                        read_only=disk.config.read_only or disk.file is not None,
                                        file=str(disk.file) if disk.file else None))
                continue
            assert self.blockd is not None and disk.device_id is not None
            sealed = await self.blockd.seal(disk.device_id,
                                            snap_dir / f"disk-{disk.config.name}.layer")
            layer = Path(sealed.layer)
            disk.layers = [*disk.layers, LayerRef(path=str(layer), size=layer.stat().st_size)]
            out.append(DiskSnapshot(name=disk.config.name, layers=list(disk.layers),
                                    chain_used=sealed.chain_used))
        return out

    async def _after_failed_snapshot(self, vm: VM, exc: BaseException) -> None:
        """A failed snapshot leaves the VM running when QEMU is still alive, else in error."""
        if vm.process.died.is_set():
            vm.state = "error"
            vm.error = f"QEMU died during snapshot: {vm.process.exit_reason()}"
            return
        try:
            await vm.process.execute("cont")
            vm.state = "running"
            vm.error = f"snapshot failed: {exc}"
        except Exception as cont_exc:  # QEMU wedged: end it
            vm.state = "error"
            vm.error = f"snapshot failed ({exc}); resuming failed too ({cont_exc})"

    async def pause(self, vm: VM, *, wait_teardown: bool = False,
                    memory: bool = True) -> SnapshotRecord:
        """Snapshot the VM and end its QEMU process; the snapshot resumes it.

        memory=False keeps only the disks (a filesystem-only snapshot, `snapshot_disks`): it
        is cold-booted later (`boot` with its disk layers), never restored. Returns once the
        snapshot is durable and the VM stopped; QEMU's exit and the release of its slot and
        disks finish in the background (`drain()` waits for them) unless wait_teardown is set."""
        if memory:
            record = await self.snapshot(vm, keep_running=False)
        else:
            record = await self.snapshot_disks(vm)
        vm.state = "paused"
        vm.process.expected_exit = True
        task = asyncio.create_task(self._stop(vm))
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        if wait_teardown:
            await task
        return record

    async def drain(self) -> None:
        """Wait for background teardowns of paused VMs."""
        while self._background:
            await asyncio.gather(*list(self._background), return_exceptions=True)

    # -- restore / fork -------------------------------------------------------------------

    def check_restorable(self, record: SnapshotRecord) -> None:
        if self.accel is None:
            raise RuntimeError_("Runtime.start() first")
        if not record.memory:
            raise SnapshotError(
                f"snapshot {record.id} is filesystem-only (no memory, no device state): "
                "boot a VM from its disks instead of restoring it")
        if record.mode != self.accel:
            raise ModeMismatchError(
                f"snapshot {record.id} was taken under {record.mode.upper()} and this runtime "
                f"runs {self.accel.upper()}: device state cannot cross accelerators")
        try:
            record.check_files()
        except SnapshotRecordError as exc:
            raise SnapshotError(f"snapshot {record.id} cannot be restored: {exc}") from exc

    async def _memory_file(self, record: SnapshotRecord) -> Path:
        """Materialise and take a reference; a caller cancelled meanwhile (a restore whose
        client went away, a pool being unprimed) takes none."""
        acquire = asyncio.ensure_future(asyncio.to_thread(
            self.memory.acquire, record.id, [Path(x.path) for x in record.memory_layers],
            record.machine.memory_bytes))
        try:
            return await asyncio.shield(acquire)
        except asyncio.CancelledError:
            # The thread cannot be stopped and takes the reference anyway: give it back.
            def give_back(done: asyncio.Future[Path]) -> None:
                if not done.cancelled() and done.exception() is None:
                    self.memory.release(record.id)

            acquire.add_done_callback(give_back)
            raise

    async def restore(self, record: SnapshotRecord, *, env_vars: dict[str, str] | None = None,
                      access_token: str | None = None, outbound: bool = True,
                      guest_token: str | None = None, egress: EgressPolicy | None = None,
                      own_disks: bool = False, volumes: dict[str, VolumeDisk] | None = None,
                      mounts: list[dict[str, Any]] | None = None,
                      before_start: Callable[[VM], Awaitable[None]] | None = None) -> VM:
        """Start a new running VM from a snapshot (resume, or create-from-template).

        `guest_token` is the envd access token the snapshot's guest holds, if any (see envd_init).
        `egress` (else `outbound`) is the slot's policy, in force before the guest runs.
        `own_disks`: the snapshot is the same sandbox's (a resume of its pause): what its disks'
        sealed uppers hold stays counted against their caps (a fork child, a create from a
        template start with the whole cap). Never from a warm process (its disks count nothing).
        `volumes`: volume disks for empty volume slots of the snapshot, by slot name (never
        from a warm process either: its slots are empty); `mounts`: what envd's /init mounts
        where (docs/volumes.md §6). `before_start(vm)`: awaited once the VM has its slot, before
        its guest runs (a shared volume's NFS hole and export: a guest that kept its mount
        retries at once, and /init mounts it; docs/volumes.md §7.1); failing, the VM is killed.
        """
        if egress is None and not outbound:
            egress = EgressPolicy(deny_nets=(ALL_TRAFFIC,))
        self.check_restorable(record)
        # Counted as starting from the first line: the children of a fork (restores gathered
        # at once) all count before any of them spawns QEMU.
        with self._starting(record.machine.vcpus):
            t0 = time.perf_counter()
            mem_path = await self._memory_file(record)
            t1 = time.perf_counter()
            # _restore_with_memory owns the memory reference from here: it gives it back if
            # the restore fails before the VM exists, the VM's kill does after (never both).
            vm = await self._restore_with_memory(record, mem_path, env_vars, access_token,
                                                 egress, guest_token, own_disks, volumes or {},
                                                 mounts, before_start)
        vm.timings["memory_file_ms"] = (t1 - t0) * 1e3
        return vm

    async def _restore_with_memory(self, record: SnapshotRecord, mem_path: Path,
                                   env_vars: dict[str, str] | None, access_token: str | None,
                                   egress: EgressPolicy | None,
                                   guest_token: str | None = None,
                                   own_disks: bool = False,
                                   volumes: dict[str, VolumeDisk] | None = None,
                                   mounts: list[dict[str, Any]] | None = None,
                                   before_start: Callable[[VM], Awaitable[None]] | None = None
                                   ) -> VM:
        vm_id = uuid.uuid4().hex[:12]
        machine = _with_volumes(record.machine, volumes or {})
        t0 = time.perf_counter()
        warm: WarmProcess | None = None
        slot: NetworkSlot | None = None
        disks: list[AttachedDisk] = []
        process: QemuProcess | None = None
        workdir = self.config.vm_dir / vm_id
        stage = "starting"  # what the restore was doing, for the error if QEMU dies
        try:
            warm = None if own_disks or volumes else await self.warm.take(record.id)
            if warm is not None:
                process, slot, workdir, disks = warm.process, warm.slot, warm.workdir, warm.disks
            else:
                slot = await self.slots.take() if record.machine.network else None
            if slot is not None and egress is not None and egress != slot.policy:
                await slot.set_policy(egress)
            if process is None:
                process = await self._spawn_for_restore(record, mem_path, workdir, slot, disks,
                                                        own_disks=own_disks, volumes=volumes)
            t1 = time.perf_counter()
            try:
                await self._load_device_state(process, Path(record.device_state))
            except VMDiedError as exc:
                raise SnapshotError(
                    f"snapshot {record.id}: QEMU died loading its device state: {exc}") from exc
        except BaseException as exc:
            if process is not None:
                await process.stop_process()
            await self._release_resources(slot, disks, record.id)  # the reference restore took
            # Its disks' uppers, QEMU's logs: nothing in it outlives a failed restore.
            shutil.rmtree(workdir, ignore_errors=True)
            if isinstance(exc, VMDiedError):
                raise VMDiedError(
                    f"restore of snapshot {record.id}: QEMU died {stage}: {exc}") from exc
            raise
        vm = VM(vm_id, machine, process, slot, workdir, list(record.memory_layers),
                record.id, mem_path, disks, parent_snapshot=record.id)
        self._adopt(vm)
        t2 = time.perf_counter()
        stage = "resuming the guest"
        try:
            if before_start is not None:
                await before_start(vm)
            await process.execute("cont")
            vm.state = "running"
            t3 = time.perf_counter()
            if slot is not None:
                stage = "while envd /init was in flight"
                await self.envd_init(vm, env_vars, access_token, guest_token=guest_token,
                                     mounts=mounts)
            # the startup pack (runtime/memdev.py)
            self.memory.after_restore(record.id, Path(record.device_state).parent)
        except BaseException as exc:
            await self.kill(vm)
            if isinstance(exc, VMDiedError):
                raise VMDiedError(
                    f"restore of snapshot {record.id}: QEMU died {stage}: {exc}") from exc
            raise
        t4 = time.perf_counter()
        vm.timings.update(warm=float(warm is not None), process_ms=(t1 - t0) * 1e3,
                          load_ms=(t2 - t1) * 1e3, cont_ms=(t3 - t2) * 1e3,
                          envd_init_ms=(t4 - t3) * 1e3)
        return vm

    async def _load_device_state(self, process: QemuProcess, devstate: Path) -> None:
        queue = process.qmp.subscribe()
        try:
            # `events` makes QEMU announce each migration state change (no polling delay).
            await process.execute("migrate-set-capabilities",
                                  {"capabilities": [{"capability": "events", "state": True}]})
            # ~80 KB from the page cache: a thread hop would cost more than the copy.
            staged = privilege.stage_devstate(devstate, process.workdir, process.user)
            await process.execute("migrate-incoming", {"uri": f"file:{staged}"})
            deadline = time.monotonic() + self.config.restore_timeout
            while True:
                status = await process.execute("query-migrate")
                state = status.get("status")
                if state == "completed":
                    return
                if state == "failed":
                    raise SnapshotError(
                        f"device state {devstate} failed to load: {status.get('error-desc', '')}")
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise SnapshotError(f"device state {devstate} did not load in time")
                with contextlib.suppress(QMPError):
                    await process.qmp.wait_event(queue, "MIGRATION", min(remaining, 1.0))
        finally:
            process.qmp.unsubscribe(queue)

    async def fork(self, vm: VM, count: int, *, env_vars: dict[str, str] | None = None,
                   access_token: str | None = None) -> tuple[SnapshotRecord, list[VM]]:
        """Snapshot a running VM (it keeps running) and restore `count` children from it."""
        if not 1 <= count <= 16:
            raise RuntimeError_(f"fork count must be 1..16, not {count}")
        record = await self.snapshot(vm, keep_running=True)
        results = await asyncio.gather(
            *[self.restore(record, env_vars=env_vars, access_token=access_token)
              for _ in range(count)], return_exceptions=True)
        children = [r for r in results if isinstance(r, VM)]
        failures = [r for r in results if isinstance(r, BaseException)]
        if failures:
            for child in children:
                with contextlib.suppress(Exception):
                    await self.kill(child)
            raise failures[0]
        return record, children

    # -- warm QEMU processes for a snapshot -------------------------------------------------

    async def prime(self, record: SnapshotRecord, count: int | None = None) -> None:
        """Keep warm QEMU processes (with network slots and disks) waiting for restores of
        `record` (runtime/warm_pool.py): refilled in the background to the high watermark
        whenever fewer than the low one wait (config.process_pool_low/high; `count` sets both)."""
        self.check_restorable(record)
        low, high = ((count, count) if count is not None
                     else (self.config.process_pool_low, self.config.process_pool_high))
        await self.warm.prime(record, low, high)

    async def unprime(self, record_id: str) -> None:
        await self.warm.unprime(record_id)

    def warm_count(self, record_id: str) -> int:
        return self.warm.count(record_id)

    async def _spawn_for_restore(self, record: SnapshotRecord, mem_path: Path, workdir: Path,
                                 slot: NetworkSlot | None, disks: list[AttachedDisk],
                                 extra_vcpus: int = 0, *, own_disks: bool = False,
                                 volumes: dict[str, VolumeDisk] | None = None) -> QemuProcess:
        """A QEMU in `-incoming defer` with the record's disks, each a new blockd device over
        the snapshot's layers (appended to `disks` as made, for the caller to release);
        `own_disks` and `volumes` as in `restore`."""
        snaps = {d.name: d for d in record.disks}
        volumes = volumes or {}
        machine = _with_volumes(record.machine, volumes)

        async def attach(user: privilege.VMUser | None) -> list[DiskAttachment]:
            attachments = []
            for cfg in machine.disks:
                ds = snaps[cfg.name]
                layers = ds.layers
                if cfg.name in volumes:
                    if ds.layers:
                        raise RuntimeError_(f"volume slot {cfg.name} of snapshot {record.id} "
                                            "holds a volume already")
                    layers = [LayerRef(path=str(p), size=p.stat().st_size)
                              for p in volumes[cfg.name].layers]
                disk, attachment = await self._attach_disk(
                    cfg, layers, Path(ds.file) if ds.file else None, workdir, user,
                    ds.chain_used if own_disks else 0)
                disks.append(disk)
                attachments.append(attachment)
            return attachments

        return await self._spawn_qemu(machine, workdir, mem_path, True, slot, attach,
                                      extra_vcpus)

    # -- ending VMs -----------------------------------------------------------------------

    async def kill(self, vm: VM) -> None:
        """End a VM and free everything it holds (its snapshots stay)."""
        if vm.state != "paused":
            vm.state = "stopped"
        await self._stop(vm)

    async def _stop(self, vm: VM) -> None:
        await vm.process.stop_process()
        if vm._watch is not None:
            with contextlib.suppress(BaseException):
                await vm._watch
        await self._release_resources(vm.slot, vm.disks, vm.mem_key)
        vm.slot, vm.disks, vm.mem_key = None, [], None
        self.vms.pop(vm.id, None)
        shutil.rmtree(vm.workdir, ignore_errors=True)

    async def _release_resources(self, slot: NetworkSlot | None, disks: list[AttachedDisk],
                                 mem_key: str | None) -> None:
        for disk in disks:
            if disk.device_id is not None and self.blockd is not None:
                with contextlib.suppress(Exception):
                    await self.blockd.release(disk.device_id)
        if slot is not None:
            await self.slots.give_back(slot)
        if mem_key is not None:
            self.memory.release(mem_key)

    async def set_outbound(self, vm: VM, allowed: bool) -> None:
        if vm.slot is None:
            raise RuntimeError_(f"VM {vm.id} has no network")
        await vm.slot.set_outbound(allowed)

    async def set_policy(self, vm: VM, policy: EgressPolicy) -> None:
        """Replace the VM's egress policy (its slot's sets, the host's redirects)."""
        if vm.slot is None:
            raise RuntimeError_(f"VM {vm.id} has no network")
        await vm.slot.set_policy(policy)

    async def set_nfs(self, vm: VM, enabled: bool) -> None:
        """Open or close the VM's way to the node's NFS server (runtime/network.py
        `NetworkSlot.set_nfs`; docs/volumes.md §7.1). Refused when the runtime has none."""
        if vm.slot is None:
            raise RuntimeError_(f"VM {vm.id} has no network")
        if enabled and self.config.nfs_port is None:
            raise RuntimeError_("this runtime has no NFS server port (RuntimeConfig.nfs_port)")
        await vm.slot.set_nfs(enabled)


def _save_record_durably(record: SnapshotRecord, snap_dir: Path) -> None:
    """snapshot.json, then the directory entries (the record's and the snapshot directory's
    own), so a snapshot whose pause returned survives a crash."""
    record.save(snap_dir)
    fsync_dir(snap_dir)
    fsync_dir(snap_dir.parent)


def _compact_memory(layers: list[LayerRef], snap_dir: Path, size: int) -> LayerRef:
    """Merge a memory stack into one layer (the stack stays readable by older snapshots)."""
    raw = snap_dir / "memory-compact.raw"
    out = snap_dir / "memory-compacted.layer"
    try:
        materialise([Path(x.path) for x in layers], raw, size)
        import_raw(raw, out)
    finally:
        raw.unlink(missing_ok=True)
    (snap_dir / "memory.layer").unlink(missing_ok=True)
    return LayerRef(path=str(out), size=out.stat().st_size)


def _qemu_version(process: QemuProcess) -> str:
    qemu = process.qmp.greeting.get("QMP", {}).get("version", {}).get("qemu", {})
    return f"{qemu.get('major', 0)}.{qemu.get('minor', 0)}.{qemu.get('micro', 0)}"
