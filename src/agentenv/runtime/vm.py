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
import shutil
import time
import uuid
from collections.abc import Awaitable, Callable
from ipaddress import IPv4Address
from pathlib import Path
from typing import Any, Literal

from agentenv.blockd.client import DiskService
from agentenv.network.policy import ALL_TRAFFIC, EgressPolicy
from agentenv.runtime import privilege
from agentenv.runtime.accel import resolve_accel
from agentenv.runtime.cgroup import (
    CgroupManager,
)
from agentenv.runtime.config import RuntimeConfig
from agentenv.runtime.devstate import load_device_state
from agentenv.runtime.disks import (
    AttachedDisk,
    DiskSource,
    VolumeDisk,
    attach_disk,
    volume_slot_sources,
    with_volumes,
)
from agentenv.runtime.envd_calls import EnvdCalls
from agentenv.runtime.errors import (
    ModeMismatchError,
    RuntimeError_,
    SnapshotError,
    VMDiedError,
)
from agentenv.runtime.jail import UidPool
from agentenv.runtime.launch import QemuLauncher
from agentenv.runtime.machine import VM, BootSpec
from agentenv.runtime.memdev import make_memory_store
from agentenv.runtime.memory import find_ram_mapping, present_ranges
from agentenv.runtime.network import (
    GUEST_IP,
    NetworkSlot,
    SlotPool,
    parse_open_ranges,
    setup_host,
)
from agentenv.runtime.qemu import DiskAttachment, QemuProcess
from agentenv.runtime.serial import SERIAL_LOG, keep_serial_logs_trimmed
from agentenv.runtime.snapshots import SnapshotTaker
from agentenv.runtime.warm_pool import WarmPool, WarmProcess
from agentenv.snapshot.record import (
    DiskConfig,
    LayerRef,
    MachineConfig,
    SnapshotRecord,
    SnapshotRecordError,
)

# What callers import from here (the handles and disk requests live in machine.py and disks.py).
__all__ = ["VM", "BootSpec", "DiskSource", "Runtime", "VolumeDisk", "volume_slot_sources"]

log = logging.getLogger("agentenv.runtime")

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
    def __init__(self, config: RuntimeConfig, blockd: DiskService | None = None,
                 on_vm_died: Callable[[VM], None] | None = None) -> None:
        self.config = config
        self.blockd = blockd
        self.on_vm_died = on_vm_died
        self.vms: dict[str, VM] = {}
        self.memory = make_memory_store(config, blockd)
        self.slots = SlotPool(config.network_prefix, config.slot_pool_low, config.slot_pool_high,
                              first_index=config.slot_first_index,
                              reuse_delay=config.slot_reuse_delay,
                              open_ranges=parse_open_ranges(config.network_open_ranges),
                              rate_mbit=config.slot_rate_mbit,
                              max_flows=config.slot_max_flows)
        self.accel: Literal["kvm", "tcg"] | None = None
        self.envd = EnvdCalls(config)
        self.snapshots = SnapshotTaker(config, blockd)
        self.warm = WarmPool(config.vm_dir, self.slots, self.memory, self._memory_file,
                             self._spawn_for_restore, self._release_resources)
        self._started = False
        self._background: set[asyncio.Task[None]] = set()
        self._serial_trimmer: asyncio.Task[None] | None = None
        self.launcher = QemuLauncher(config)

    # -- lifecycle of the runtime itself --------------------------------------------------

    async def start(self, kernel_for_probe: Path | None = None) -> None:
        for d in (self.config.vm_dir, self.config.snapshot_dir, self.config.memory_dir):
            d.mkdir(parents=True, exist_ok=True)
        self.accel = resolve_accel(self.config.accel, str(kernel_for_probe) if kernel_for_probe else None)
        await self.launcher.start(self.accel)
        if self.config.network:
            # Refused before anything is touched when another runtime uses this prefix.
            self.slots.acquire_prefix()
            await setup_host(self.config.network_prefix, self.config.egress_proxy_port,
                             keep_sources=self.slots.in_use_addresses(),
                             open_ranges=self.slots.open_ranges,
                             nfs_port=self.config.nfs_port,
                             nfs_address=self.config.nfs_address)
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
        await self.envd.aclose()
        self.launcher.cgroups.close()

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
        with self.launcher.starting(machine.vcpus):
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
                    disk, attachment = await attach_disk(
                        self.blockd, cfg, [LayerRef(path=str(p), size=p.stat().st_size)
                                           for p in source.layers], source.file, workdir,
                        self.launcher.jailed_uid(user), source.chain_used)
                    disks.append(disk)
                    attachments.append(attachment)
                return attachments

            process = await self.launcher.spawn(machine, workdir, mem_path, False, slot, attach)
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

    # -- QEMU processes (QemuLauncher) --------------------------------------------------------

    @property
    def vm_user(self) -> privilege.VMUser | None:
        return self.launcher.vm_user

    @vm_user.setter
    def vm_user(self, user: privilege.VMUser | None) -> None:
        self.launcher.vm_user = user

    @property
    def uids(self) -> UidPool | None:
        return self.launcher.uids

    @property
    def cgroups(self) -> CgroupManager:
        return self.launcher.cgroups

    @cgroups.setter
    def cgroups(self, cgroups: CgroupManager) -> None:
        self.launcher.cgroups = cgroups

    @property
    def jail_root(self) -> Path:
        return self.launcher.jail_root

    def uid_releaser(self, user: privilege.VMUser | None) -> Callable[[], None] | None:
        return self.launcher.uid_releaser(user)

    def tcg_single_thread(self, extra_vcpus: int = 0, *, boot: bool = False) -> bool:
        return self.launcher.tcg_single_thread(extra_vcpus, boot=boot)

    def _adopt(self, vm: VM) -> None:
        self.vms[vm.id] = vm
        vm._watch = asyncio.create_task(self._watch(vm))

    def track(self, vm: VM) -> None:
        """Take over a VM this runtime did not start (runtime/adopt.py re-adopts the VMs of a
        crashed process): watched for its exit, killed and paused like any other."""
        self._adopt(vm)

    async def _trim_serial_logs(self) -> None:
        """Keeps every VM's serial console log and QEMU's stderr (which a guest can fill with
        the device errors it provokes) within serial_log_max_bytes (runtime/serial.py)."""
        await keep_serial_logs_trimmed(
            lambda: [log for vm in list(self.vms.values())
                     for log in (vm.workdir / SERIAL_LOG, vm.process.stderr_log)],
            self.config.serial_log_max_bytes)

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
        # Its working directory goes as at a kill: it holds the writable disks' uppers (all
        # the guest wrote), and a guest crashes its VM at will (red team of 2026-12-07: each
        # crash left its writes on the node until a restart; tests/redteam/test_guest_crash.py)
        await asyncio.to_thread(shutil.rmtree, vm.workdir, True)
        if self.on_vm_died is not None:
            self.on_vm_died(vm)

    async def wait_envd(self, vm: VM, timeout: float) -> None:
        await self.envd.wait_ready(vm, timeout)

    async def envd_init(self, vm: VM, env_vars: dict[str, str] | None = None,
                        access_token: str | None = None, *,
                        guest_token: str | None = None,
                        mounts: list[dict[str, Any]] | None = None) -> None:
        """POST /init to the VM's envd (EnvdCalls.init)."""
        await self.envd.init(vm, env_vars, access_token, guest_token=guest_token, mounts=mounts)

    # -- snapshot / pause -----------------------------------------------------------------

    async def snapshot(self, vm: VM, *, keep_running: bool = True) -> SnapshotRecord:
        """Stop the VM, write a snapshot, and resume it (keep_running) or leave it stopped
        (SnapshotTaker.snapshot)."""
        return await self.snapshots.snapshot(vm, keep_running=keep_running)

    async def snapshot_disks(self, vm: VM) -> SnapshotRecord:
        """A filesystem-only snapshot, the VM left stopped (SnapshotTaker.snapshot_disks)."""
        return await self.snapshots.snapshot_disks(vm)

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
        with self.launcher.starting(record.machine.vcpus):
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
        machine = with_volumes(record.machine, volumes or {})
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
                await load_device_state(process, Path(record.device_state),
                                        self.config.restore_timeout)
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
        if self.memory.wants_load_pages(record.id):
            # The pages QEMU's start and load faulted in, before the guest touches any: the
            # startup pack's load pages, read ahead by later restores (runtime/memdev.py).
            pages: list[tuple[int, int]] = []
            try:
                addr = find_ram_mapping(process.pid, str(mem_path), record.machine.memory_bytes)
                pages = present_ranges(process.pid, addr, record.machine.memory_bytes)
            except (OSError, SnapshotError) as exc:
                log.warning("load pages not read", extra={"snapshot": record.id, "error": str(exc)})
            self.memory.set_load_pages(record.id, Path(record.device_state).parent, pages)
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
        machine = with_volumes(record.machine, volumes)

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
                disk, attachment = await attach_disk(
                    self.blockd, cfg, layers, Path(ds.file) if ds.file else None, workdir,
                    self.launcher.jailed_uid(user), ds.chain_used if own_disks else 0)
                disks.append(disk)
                attachments.append(attachment)
            return attachments

        return await self.launcher.spawn(machine, workdir, mem_path, True, slot, attach,
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

