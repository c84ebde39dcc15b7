"""Warm QEMU processes per snapshot: what makes a restore skip spawning QEMU and attaching disks.

A warm process is a QEMU already waiting in `-incoming defer` for one snapshot, with the
snapshot's memory file mapped, a network slot and the snapshot's disks (a blockd device per
writable disk, its fresh upper in the warm workdir). A restore that takes one only loads the
device state and `cont`s (disk creation and attachment were ~24 ms of a ~40 ms restore to
running). A QEMU cannot serve another snapshot: its RAM file is mapped at start, so processes
are kept per snapshot.

`Runtime.prime(record, n)` / `unprime(record_id)` drive this pool; `Runtime.restore` takes from
it. Refilled in the background to the high watermark once fewer than the low one wait
(config.process_pool_low/high; `prime(record, n)` sets both to n). A warm process found dead
is released and skipped.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from agentenv.runtime.disks import AttachedDisk

if TYPE_CHECKING:
    from agentenv.runtime.memory import MemoryFileCache
    from agentenv.runtime.network import NetworkSlot, SlotPool
    from agentenv.runtime.qemu import QemuProcess
    from agentenv.snapshot.record import SnapshotRecord

    #: the runtime's memory file of a snapshot, with a reference taken
    MemoryFile = Callable[[SnapshotRecord], Awaitable[Path]]
    #: a QEMU in `-incoming defer` for a snapshot: (record, memory file, workdir, slot,
    #: disks made so far (appended to), extra_vcpus)
    Spawn = Callable[[SnapshotRecord, Path, Path, NetworkSlot | None, list[AttachedDisk], int],
                     Awaitable[QemuProcess]]
    #: give back a slot, disks and a memory reference (any of them None/empty)
    Release = Callable[[NetworkSlot | None, list[AttachedDisk], str | None], Awaitable[None]]

log = logging.getLogger("agentenv.runtime")


@dataclass
class WarmProcess:
    """A QEMU waiting in `-incoming defer` for a restore of one snapshot, with its network
    slot and the snapshot's disks (blockd devices with fresh uppers) already attached."""

    process: QemuProcess
    slot: NetworkSlot | None
    workdir: Path
    disks: list[AttachedDisk]


class WarmPool:
    """The runtime's warm processes, keyed by snapshot id. Each holds a reference on its
    snapshot's memory file (MemoryFileCache), like a running VM."""

    def __init__(self, vm_dir: Path, slots: SlotPool, memory: MemoryFileCache,
                 memory_file: MemoryFile, spawn: Spawn, release: Release) -> None:
        self.vm_dir = vm_dir
        self.slots = slots
        self.memory = memory
        self._memory_file = memory_file
        self._spawn = spawn
        self._release = release
        self._waiting: dict[str, list[WarmProcess]] = {}
        self._targets: dict[str, tuple[SnapshotRecord, int, int]] = {}  # record, low, high
        self._tasks: dict[str, asyncio.Task[None]] = {}

    async def prime(self, record: SnapshotRecord, low: int, high: int) -> None:
        self._targets[record.id] = (record, low, max(low, high))
        await self._refill(record.id)

    async def unprime(self, record_id: str) -> None:
        self._targets.pop(record_id, None)
        task = self._tasks.pop(record_id, None)
        if task is not None:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        await self._drain(record_id)

    def count(self, record_id: str) -> int:
        return len(self._waiting.get(record_id, []))

    def waiting(self, record_id: str) -> list[WarmProcess]:
        """The processes waiting for `record_id`; a restore takes the last one."""
        return list(self._waiting.get(record_id, []))

    async def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        for task in self._tasks.values():
            with contextlib.suppress(BaseException):
                await task
        for key in list(self._waiting):
            await self._drain(key)

    async def take(self, key: str) -> WarmProcess | None:
        """A live warm process for snapshot `key` (None: none waits); starts a refill when
        fewer than the low watermark are left."""
        pool = self._waiting.get(key)
        taken = None
        while pool and taken is None:
            warm = pool.pop()
            # The warm process holds a reference on the memory file and the restore took
            # another one, so drop one of them (a dead one's as well).
            self.memory.release(key)
            if warm.process.died.is_set():
                log.warning("warm QEMU died while waiting", extra={
                    "snapshot": key, "reason": warm.process.exit_reason()})
                await warm.process.stop_process()  # closes its QMP connection
                await self._release(warm.slot, warm.disks, None)
                shutil.rmtree(warm.workdir, ignore_errors=True)
                continue
            taken = warm
        target = self._targets.get(key)
        if target is not None and len(pool or []) < target[1]:
            self._kick_refill(key)
        return taken

    async def _refill(self, key: str) -> None:
        target = self._targets.get(key)
        if target is None:
            return
        record, _, high = target
        pool = self._waiting.setdefault(key, [])
        while len(pool) < high:
            mem_path = await self._memory_file(record)
            workdir = self.vm_dir / f"warm-{uuid.uuid4().hex[:12]}"
            slot: NetworkSlot | None = None
            disks: list[AttachedDisk] = []
            try:
                slot = await self.slots.take() if record.machine.network else None
                process = await self._spawn(record, mem_path, workdir, slot, disks,
                                            record.machine.vcpus)
            except BaseException:
                await self._release(slot, disks, record.id)
                shutil.rmtree(workdir, ignore_errors=True)
                raise
            pool.append(WarmProcess(process, slot, workdir, disks))

    def _kick_refill(self, key: str) -> None:
        if key not in self._targets:
            return
        task = self._tasks.get(key)
        if task is None or task.done():
            self._tasks[key] = asyncio.create_task(self._refill(key))

    async def _drain(self, key: str) -> None:
        for warm in self._waiting.pop(key, []):
            await warm.process.stop_process()
            await self._release(warm.slot, warm.disks, key)
            shutil.rmtree(warm.workdir, ignore_errors=True)
