"""Taking snapshots of running VMs: a memory snapshot (`snapshot`: the pages written since the
VM's memory lineage as a new layer, QEMU's device state, each writable disk's upper sealed) or
a filesystem-only one (`snapshot_disks`), each written durably beside its snapshot.json."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from agentenv.blockd.client import DiskService
from agentenv.fsutil import fsync_dir
from agentenv.runtime import privilege
from agentenv.runtime.config import RuntimeConfig
from agentenv.runtime.devstate import finish_device_state
from agentenv.runtime.errors import RuntimeError_, SnapshotError
from agentenv.runtime.machine import VM
from agentenv.runtime.memory import capture_memory_layer, find_ram_mapping, materialise
from agentenv.runtime.qemu import QemuProcess
from agentenv.snapshot.record import RECORD_NAME, DiskSnapshot, LayerRef, SnapshotRecord
from agentenv.storage.export import import_raw

log = logging.getLogger("agentenv.runtime")


@dataclass(frozen=True)
class SnapshotFrame:
    """A snapshot under way: its id and directory, when it began and when the VM stopped."""

    id: str
    dir: Path
    t0: float
    t_stop: float


class SnapshotTaker:
    """Snapshots of a runtime's VMs into config.snapshot_dir; disks are sealed by `blockd`."""

    def __init__(self, config: RuntimeConfig, blockd: DiskService | None) -> None:
        self.config = config
        self.blockd = blockd

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
    async def _stopped_for_snapshot(self, vm: VM, what: str) -> AsyncIterator[SnapshotFrame]:
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
            yield SnapshotFrame(snap_id, snap_dir, t0, time.perf_counter())
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
