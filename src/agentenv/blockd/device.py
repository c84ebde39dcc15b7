"""A blockd device: an image behind an NBD socket, with a gate and counters.

Every NBD request (and every FUSE call, through the event loop) passes the device's gate.
Operations that change what the device is (snapshot, resize, release) close the
gate, wait until the requests already admitted have finished, do their work, and reopen it:
a write acknowledged before a snapshot began is in the sealed layer, one admitted after it is
in the new upper, and none is lost or reordered across the seal.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import errno
import logging
import time
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Executor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

from agentenv.blockd.results import DeviceInfo
from agentenv.storage.blob import WouldBlock, nonblocking

log = logging.getLogger("agentenv.blockd.device")

T = TypeVar("T")
Buffer = bytes | bytearray | memoryview

# Reads and writes up to this size run on the event loop itself. Against the page cache a
# 4 KiB one takes a few microseconds, far less than a hop to a thread and back (4 KiB random
# reads at depth 1: about 3,000 IOPS through threads, 12,000 inline). For 1 MiB reads the
# threads lose too: the I/O thread and the loop convoy on the GIL (server CPU per 1 MiB read
# of a 10-layer stack: about 2.1 ms through threads, 1.0-1.3 ms inline). The price is that a
# large or cold read holds up the other devices on the loop for its duration (`--inline-max`
# lowers the threshold). Flushes, and writes while one runs, always go to the I/O threads.
INLINE_MAX = 1024 * 1024
FULL_LOG_INTERVAL = 60.0


class ImageLike(Protocol):
    """What blockd needs of agentenv.storage.image.Image."""

    @property
    def virtual_size(self) -> int: ...

    @property
    def readonly(self) -> bool: ...

    def read(self, offset: int, length: int) -> bytes: ...

    def write(self, offset: int, data: bytes) -> None: ...

    def discard(self, offset: int, length: int) -> None: ...

    def write_zeroes(self, offset: int, length: int) -> None: ...

    def flush(self) -> None: ...

    def resize(self, new_size: int) -> None: ...

    def snapshot_and_restack(self, sealed_path: Path) -> Path: ...

    def close(self) -> None: ...


@dataclass
class DeviceStats:
    reads: int = 0
    writes: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    flushes: int = 0
    trims: int = 0
    zeroes: int = 0
    errors: int = 0
    connections: int = 0
    enospc: int = 0  # writes refused: the disk at its cap, or the node's disk at its reserve


class Gate:
    """Admits requests while open; close() waits for the admitted ones to finish."""

    def __init__(self) -> None:
        self._inflight = 0
        self._open = asyncio.Event()
        self._open.set()
        self._idle = asyncio.Event()
        self._idle.set()
        self._closers = asyncio.Lock()

    def try_enter(self) -> bool:
        """Admit without waiting, if the gate is open."""
        if not self._open.is_set():
            return False
        self._inflight += 1
        self._idle.clear()
        return True

    async def enter(self) -> None:
        while not self._open.is_set():
            await self._open.wait()
        self._inflight += 1
        self._idle.clear()

    def leave(self) -> None:
        self._inflight -= 1
        if self._inflight == 0:
            self._idle.set()

    @contextlib.asynccontextmanager
    async def closed(self) -> AsyncIterator[None]:
        async with self._closers:
            self._open.clear()
            try:
                await self._idle.wait()
                yield
            finally:
                self._open.set()


@dataclass
class DeviceRecord:
    """What the state directory keeps of a device, to find it again after a restart."""

    id: str
    kind: str  # "disk" (writable, own upper) or "shared" (read-only, refcounted): manager.py
    socket: str
    source: str | None  # image config (writable) or image/layer (read-only) to reopen
    upper_dir: str | None
    owns_upper: bool  # the daemon made upper_dir itself and removes it on release
    readonly: bool
    size: int
    refcount: int = 1
    snapshots: list[str] = field(default_factory=list)
    upper_limit: int | None = None  # cap on the disk's own writes in bytes (None: no cap)
    # bytes of the disk's own sealed uppers (earlier pauses, snapshots) counted against the cap
    chain_used: int = 0
    # uid (and gid) of the one client that may connect (a jailed QEMU's own); None: the VM group
    owner: int | None = None

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class Device:
    """One disk: an image, an NBD socket, a FUSE file, a gate and counters."""

    def __init__(
        self,
        record: DeviceRecord,
        image: ImageLike,
        executor: Executor,
        on_stats: Callable[[Device, str, int], None] | None = None,
        inline_max: int = INLINE_MAX,
    ) -> None:
        self.record = record
        self.image = image
        self.executor = executor
        self.stats = DeviceStats()
        self.gate = Gate()
        self.server: asyncio.AbstractServer | None = None
        self.clients: set[asyncio.StreamWriter] = set()
        self.fuse_path: Path | None = None
        self._on_stats = on_stats
        self._loop = asyncio.get_running_loop()
        self._offloop_writers = 0
        self.inline_max = inline_max
        self._full_logged = 0.0
        self._full_unlogged = 0
        self.apply_limit(image)

    def apply_limit(self, image: ImageLike) -> None:
        """Give `image` the record's cap and what its earlier sealed uppers already took of it
        (images without an upper have nothing to cap)."""
        if hasattr(image, "upper_limit") and not getattr(image, "readonly", True):
            image.chain_used = self.record.chain_used  # type: ignore[attr-defined]
            image.upper_limit = self.record.upper_limit  # type: ignore[attr-defined]

    def _note_full(self, exc: OSError, count: int = 1) -> None:
        """Count writes refused for the cap; log the first one and then one a minute (a
        guest filling its disk sends thousands)."""
        self.stats.enospc += count
        self._count("enospc", count)
        now = time.monotonic()
        if now - self._full_logged >= FULL_LOG_INTERVAL:
            log.warning("disk full: write refused with ENOSPC",
                        extra={"device": self.id, "error": str(exc),
                               "refused_since_last_log": self._full_unlogged + count})
            self._full_logged = now
            self._full_unlogged = 0
        else:
            self._full_unlogged += count

    def _image_call(self, fn: Callable[..., T], *args: Any) -> T:
        try:
            return fn(*args)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                self._note_full(exc)
            raise

    @property
    def id(self) -> str:
        return self.record.id

    # -- Export protocol (used by the NBD server) --------------------------------------------

    @property
    def size(self) -> int:
        return self.image.virtual_size

    @property
    def readonly(self) -> bool:
        return self.record.readonly

    @property
    def description(self) -> str:
        return f"aenv blockd device {self.id} ({self.record.kind})"

    def connection_opened(self) -> None:
        self.stats.connections += 1

    def connection_closed(self) -> None:
        self.stats.connections -= 1

    def count_error(self) -> None:
        self.stats.errors += 1
        self._count("errors", 1)

    @property
    def native_core(self) -> Any:
        """The image's native core when it has one: the NBD server then runs this device's
        connections on native threads (blockd/nbd.py)."""
        return getattr(self.image, "native_core", None)

    def collect_native_stats(self) -> None:
        """Fold what the native threads counted into the stats and metrics."""
        core = self.native_core
        if core is None:
            return
        reads, writes, bytes_read, bytes_written, flushes, trims, zeroes, errors, enospc = (
            core.take_stats())
        st = self.stats
        st.reads += reads
        st.writes += writes
        st.bytes_read += bytes_read
        st.bytes_written += bytes_written
        st.flushes += flushes
        st.trims += trims
        st.zeroes += zeroes
        st.errors += errors
        if errors > enospc:
            # The native threads answered these with an NBD error (range, EPERM, EIO): say so
            # here, as the Python path logs each.
            log.warning("native requests failed", extra={"device": self.id,
                                                         "failed": errors - enospc})
        for what, amount in (("reads", reads), ("writes", writes), ("bytes_read", bytes_read),
                             ("bytes_written", bytes_written), ("errors", errors)):
            if amount:
                self._count(what, amount)
        if enospc:
            self._note_full(OSError(errno.ENOSPC, f"{enospc} writes refused: the disk is at its "
                                                  f"cap of {self.record.upper_limit} bytes, or "
                                                  "the node's disk at its reserve "
                                                  "(AENV_DISK_RESERVE)"), enospc)

    def _count(self, what: str, amount: int) -> None:
        if self._on_stats is not None:
            self._on_stats(self, what, amount)

    async def _call_image(self, method: str, *args: Any) -> Any:
        """Call an image method on whatever image is current once the gate admits us."""
        await self.gate.enter()
        try:
            return await self._loop.run_in_executor(
                self.executor, getattr(self.image, method), *args
            )
        finally:
            self.gate.leave()

    def read_now(self, offset: int, length: int) -> bytes | list[Buffer] | None:
        if length > self.inline_max or not self.gate.try_enter():
            return None
        try:
            # On the event loop: a remote layer's read that would wait for the network goes
            # to an I/O thread instead (storage/blob.py).
            with nonblocking():
                data = _read_for_socket(self.image, offset, length)
        except WouldBlock:
            return None
        finally:
            self.gate.leave()
        self.stats.reads += 1
        self.stats.bytes_read += length
        self._count("reads", 1)
        self._count("bytes_read", length)
        return data

    def write_now(self, offset: int, data: bytes) -> bool:
        # Only while no flush runs on a thread: Image.flush holds the image's write lock
        # during fsync, and waiting for it here would stall every device on the loop.
        if len(data) > self.inline_max or self._offloop_writers or not self.gate.try_enter():
            return False
        try:
            self._image_call(self.image.write, offset, data)
        finally:
            self.gate.leave()
        self.stats.writes += 1
        self.stats.bytes_written += len(data)
        self._count("writes", 1)
        self._count("bytes_written", len(data))
        return True

    async def read(self, offset: int, length: int) -> bytes:
        await self.gate.enter()
        try:
            data = await self._loop.run_in_executor(self.executor, _read, self.image, offset, length)
        finally:
            self.gate.leave()
        self.stats.reads += 1
        self.stats.bytes_read += length
        self._count("reads", 1)
        self._count("bytes_read", length)
        return data

    async def write(self, offset: int, data: bytes, fua: bool) -> None:
        await self.gate.enter()
        self._offloop_writers += 1
        try:
            image = self.image
            await self._loop.run_in_executor(self.executor, self._image_call, image.write,
                                             offset, data)
            if fua:
                await self._loop.run_in_executor(self.executor, image.flush)
        finally:
            self._offloop_writers -= 1
            self.gate.leave()
        self.stats.writes += 1
        self.stats.bytes_written += len(data)
        self._count("writes", 1)
        self._count("bytes_written", len(data))

    async def _mutate(self, method: str, *args: Any) -> Any:
        self._offloop_writers += 1
        try:
            return await self._call_image(method, *args)
        except OSError as exc:
            if exc.errno == errno.ENOSPC:
                self._note_full(exc)
            raise
        finally:
            self._offloop_writers -= 1

    async def block_status(self, offset: int, length: int) -> list[tuple[int, bool]]:
        await self.gate.enter()
        try:
            return await self._loop.run_in_executor(
                self.executor, _allocation_runs, self.image, offset, length
            )
        finally:
            self.gate.leave()

    async def flush(self) -> None:
        await self._mutate("flush")
        self.stats.flushes += 1

    async def trim(self, offset: int, length: int, fua: bool) -> None:
        await self._mutate("discard", offset, length)
        if fua:
            await self._mutate("flush")
        self.stats.trims += 1

    async def write_zeroes(self, offset: int, length: int, fua: bool) -> None:
        await self._mutate("write_zeroes", offset, length)
        if fua:
            await self._mutate("flush")
        self.stats.zeroes += 1

    # -- management ----------------------------------------------------------------------------

    async def snapshot(self, sealed_path: Path) -> Path:
        async with self.gate.closed():
            image = self.image
            layer = await self._loop.run_in_executor(
                self.executor, image.snapshot_and_restack, sealed_path
            )
            self.record.chain_used = getattr(image, "chain_used", 0)
            return layer

    async def resize(self, new_size: int) -> None:
        async with self.gate.closed():
            await self._loop.run_in_executor(self.executor, self.image.resize, new_size)
            self.record.size = new_size

    async def close_image(self) -> None:
        async with self.gate.closed():
            image = self.image
            await self._loop.run_in_executor(self.executor, _flush_and_close, image)

    def info(self) -> DeviceInfo:
        self.collect_native_stats()
        return DeviceInfo(
            id=self.id, nbd=self.record.socket, export=self.id,
            file=str(self.fuse_path) if self.fuse_path else None, size=self.size,
            readonly=self.readonly, kind=self.record.kind, source=self.record.source,
            upper_dir=self.record.upper_dir, refcount=self.record.refcount,
            upper_limit=self.record.upper_limit, chain_used=self.record.chain_used,
            upper_used=getattr(self.image, "upper_used", 0), stats=asdict(self.stats),
        )


MAX_STATUS_RUNS = 4096
BIG_READ = 64 * 1024


def tune_allocator() -> None:
    """Keep big buffers on the heap. By default glibc serves each 1 MiB read buffer with a
    fresh mmap whose pages all fault in when Python zeroes it: about 0.7 ms of a 1 MiB read's
    1.1 ms in a profile of the daemon. A fixed mmap threshold (which also stops glibc from
    moving it) lets freed buffers be reused."""
    try:
        libc = ctypes.CDLL("libc.so.6")
    except OSError:
        return  # not glibc: nothing to tune
    m_trim_threshold, m_mmap_threshold = -1, -3
    libc.mallopt(m_mmap_threshold, 64 * 1024 * 1024)
    libc.mallopt(m_trim_threshold, 256 * 1024 * 1024)


def _read(image: ImageLike, offset: int, length: int) -> bytes:
    """Large reads fill a fresh buffer that goes to the socket as it is: Image.read would
    copy it once more into bytes."""
    readinto = getattr(image, "readinto", None)
    if length < BIG_READ or readinto is None:
        return image.read(offset, length)
    buf = bytearray(length)
    readinto(offset, buf)
    return buf  # type: ignore[return-value]  # bytes-like; the NBD server only sends it


def _read_for_socket(image: ImageLike, offset: int, length: int) -> bytes | list[Buffer]:
    """Large reads as the image's pieces (slices of its layers' mmaps) when it has them: the
    NBD server hands them to sendmsg, so the data is copied once, by the kernel, instead of
    zero-fill + preadv per piece + send."""
    read_pieces = getattr(image, "read_pieces", None)
    if length < BIG_READ or read_pieces is None:
        return _read(image, offset, length)
    return read_pieces(offset, length)  # type: ignore[no-any-return]


def _allocation_runs(image: ImageLike, offset: int, length: int) -> list[tuple[int, bool]]:
    """(length, has_data) runs from `offset`, covering at most `length` bytes; adjacent runs
    of the same kind merged. Images without an extent map report all data."""
    allocation = getattr(image, "allocation", None)
    if allocation is not None:  # the native core walks its indexes itself
        return allocation(offset, length, MAX_STATUS_RUNS)  # type: ignore[no-any-return]
    extents = getattr(image, "extents", None)
    end = offset + length
    if extents is None:
        return [(length, True)]
    runs: list[tuple[int, bool]] = []

    def add(run_length: int, has_data: bool) -> None:
        if run_length <= 0:
            return
        if runs and runs[-1][1] == has_data:
            runs[-1] = (runs[-1][0] + run_length, has_data)
        else:
            runs.append((run_length, has_data))

    pos = offset
    for start, size, has_data in extents():
        if start + size <= pos:
            continue
        if start >= end or len(runs) >= MAX_STATUS_RUNS:
            break
        add(min(start, end) - pos, False)  # the hole before this extent
        a, b = max(start, pos), min(start + size, end)
        add(b - a, has_data)
        pos = b
    if pos < end and len(runs) < MAX_STATUS_RUNS:
        add(end - pos, False)
    return runs


def _flush_and_close(image: ImageLike) -> None:
    try:
        if not image.readonly:
            image.flush()
    finally:
        image.close()
