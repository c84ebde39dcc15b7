"""The RAM file of a restore: blockd's shared memory device, and the startup pack.

`SharedMemoryDevices` has the interface of `MemoryFileCache` (runtime/memory.py) and replaces
it when the runtime has a blockd (`RuntimeConfig.memory_device = "blockd"`, the default): a snapshot's memory layers are served by blockd as one read-only file
(blockd/memdev.py, served by blockd's memfs process) that every VM restored from the snapshot
maps privately. Nothing is exported: no raw copy per snapshot, no export time on the first
restore. Where FUSE cannot be mounted it falls back to the materialised file.

References. The runtime counts its own users of each snapshot's device and holds one blockd
reference while any exists. blockd keeps its devices (and their refcounts) across a restart
of the node; the node's next run finds its memory devices (`_owner` prefix in the key) at the
first acquire, takes one over for each snapshot an adopted VM uses, and releases the rest when
the runtime starts (`drop_orphans`, after adoption).

Startup pack. A fresh memory device traces the order of its first reads (page-cache misses),
i.e. the order in which the first restore touched memory, per 1 MiB chunk. `PACK_WINDOW`
seconds after that restore the runtime stores the trace in the snapshot directory
(`startup-pack.json`, a sidecar the record does not name; it travels with the snapshot when
it is pushed). A later restore that opens the device fresh (nothing of it in the page cache)
reads the chunks in that order in a background thread while QEMU starts (`prefetch`), so the
guest's first touches hit the page cache instead of a FUSE round trip each. This is also the
seam for remote layers: with a chunk cache the same order is the network prefetch.

The pack's `load` ranges ([offset, length], ascending) are the pages QEMU's start and its
device-state load faulted in (virtio rings, the vmgenid page, kvmclock areas: ~150 pages in
~10 places of a 512 MiB guest), read from QEMU's page tables (runtime/memory.py
`present_ranges`) between the load and `cont` of the first restore that finds the pack without
them. Each such fault on a page missing from the page cache costs a FUSE round trip on the
load's critical path, and QEMU's RAM being MADV_HUGEPAGE, the kernel reads 4 MiB around it
(2 MiB aligned, four 1 MiB FUSE reads). Every restore, on a fresh device or one already open
(whose pages the host may have dropped, or the running VMs privately rewritten), reads exactly
those ranges into the page cache in a background thread while QEMU starts (`warm`, on a
descriptor of the device's file kept per device, with POSIX_FADV_RANDOM: no read-ahead beyond
them); the load's faults then find their pages cached and read nothing around them. Pages
already cached cost a copy each. bench/RESULTS.md (2026-12-07) has what it gains on the cold
second restore.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import threading
import time
from pathlib import Path
from typing import Any

from agentenv.blockd.client import BlockdClient, DiskService
from agentenv.blockd.errors import BlockdError
from agentenv.blockd.memdev import CHUNK, UNAVAILABLE
from agentenv.fsutil import atomic_write
from agentenv.runtime.errors import SnapshotError
from agentenv.runtime.memory import MemoryFileCache

log = logging.getLogger("agentenv.runtime.memdev")

PACK_NAME = "startup-pack.json"
PACK_WINDOW = 3.0  # seconds after a restore during which first touches count for the pack
MEMORY_SUFFIX = ".memory.json"
LOAD_CAP = 16 << 20  # most bytes of load ranges kept (more: not a restore's load; none kept)
WARM_STEP = 1 << 20  # largest single read of a warm-up


def read_pack(snapshot_dir: Path) -> dict[str, Any] | None:
    """The startup pack stored with a snapshot, checked: {"chunks": [offset, ...] in order or
    None (not recorded yet), "load": [(offset, length), ...] or None (not recorded yet: a pack
    written before load ranges)}; None without a readable pack."""
    try:
        doc = json.loads((snapshot_dir / PACK_NAME).read_text())
        chunk = int(doc["chunk_size"])
        memory = doc.get("memory")
        chunks = None if memory is None else [int(c) * chunk for c in memory]
        load = doc.get("load")
        ranges = None if load is None else [(int(o), int(n)) for o, n in load]
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    if ranges is not None and any(o < 0 or n <= 0 for o, n in ranges):
        return None
    return {"chunks": chunks, "load": ranges}


def warm(fd: int, ranges: list[tuple[int, int]]) -> dict[str, float]:
    """Read `ranges` of the file open at `fd` into the page cache (in at most WARM_STEP pieces).
    The caller set POSIX_FADV_RANDOM on `fd`: each read brings exactly its range."""
    t0 = time.perf_counter()
    done = nbytes = 0
    buf = memoryview(bytearray(min(WARM_STEP, max((n for _, n in ranges), default=0))))
    try:
        for offset, length in ranges:
            pos, end = offset, offset + length
            while pos < end:
                got = os.preadv(fd, [buf[:min(end - pos, len(buf))]], pos)
                if got <= 0:
                    break
                pos += got
                nbytes += got
            done += 1
    except OSError as exc:
        log.warning("startup pages not read", extra={"error": str(exc)})
    return {"ranges": done, "bytes": nbytes, "ms": round((time.perf_counter() - t0) * 1e3, 2)}


class _WarmFile:
    """A descriptor of one device's file for its warm-ups (POSIX_FADV_RANDOM), opened at the
    first one (in its thread: memfs answers the open), closed once the device is released and
    no warm-up uses it."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.fd: int | None = None
        self.users = 0  # warm-ups in flight (a restore's acquire skips its own then)
        self.released = False
        self.lock = threading.Lock()

    def enter(self) -> int | None:
        with self.lock:
            if self.released:
                return None
            if self.fd is None:
                try:
                    self.fd = os.open(self.path, os.O_RDONLY | os.O_CLOEXEC)
                except OSError as exc:
                    log.warning("memory file not opened for warm-ups",
                                extra={"path": str(self.path), "error": str(exc)})
                    return None
                os.posix_fadvise(self.fd, 0, 0, os.POSIX_FADV_RANDOM)
            self.users += 1
            return self.fd

    def leave(self) -> None:
        with self.lock:
            self.users -= 1
            self._close_if_done()

    def release(self) -> None:
        with self.lock:
            self.released = True
            self._close_if_done()

    def _close_if_done(self) -> None:
        if self.released and self.users == 0 and self.fd is not None:
            os.close(self.fd)
            self.fd = None


def prefetch(path: Path, offsets: list[int], chunk: int = 1 << 20) -> dict[str, float]:
    """Read `path` chunk by chunk in `offsets` order (warms the page cache)."""
    t0 = time.perf_counter()
    done = 0
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        log.warning("prefetch cannot open the memory file", extra={"path": str(path), "error": str(exc)})
        return {"chunks": 0, "ms": 0.0}
    try:
        buf = bytearray(chunk)
        for off in offsets:
            os.preadv(fd, [buf], off)
            done += 1
    except OSError as exc:
        log.warning("prefetch stopped", extra={"path": str(path), "error": str(exc)})
    finally:
        os.close(fd)
    return {"chunks": done, "ms": round((time.perf_counter() - t0) * 1e3, 1)}


class SharedMemoryDevices:
    """Memory files as blockd memory devices, refcounted per snapshot (module doc)."""

    def __init__(self, socket: Path, fallback: MemoryFileCache, state_dir: Path,
                 *, prefetch: bool = True) -> None:
        self.socket = Path(socket)
        self.fallback = fallback
        self.directory = fallback.directory
        self.prefetch_enabled = prefetch
        # Keys of this runtime's devices start with a tag of its state directory: two runtimes
        # on one blockd never take or drop each other's devices.
        self._owner = hashlib.sha256(str(Path(state_dir).resolve()).encode()).hexdigest()[:10]
        self._refs: dict[str, int] = {}
        self._devices: dict[str, dict[str, Any]] = {}  # key -> blockd device info
        self._fallback_keys: set[str] = set()
        self._fresh: dict[str, Path] = {}  # key -> snapshot dir, until its pack is recorded
        # key -> the pack's load ranges; [] while a restore records them (one at a time)
        self._load: dict[str, list[tuple[int, int]]] = {}
        self._pack_lock = threading.Lock()  # the pack's writers: chunk order, load ranges
        self._warm_files: dict[str, _WarmFile] = {}
        self._orphans: dict[str, dict[str, Any]] | None = None
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()
        self.last_prefetch: dict[str, float] | None = None
        self.last_warm: dict[str, float] | None = None  # the last warm-up of load ranges

    def _client(self) -> BlockdClient:
        return BlockdClient(self.socket, timeout=120.0)

    def _device_key(self, key: str) -> str:
        return f"{self._owner}-{key}"

    def _find_orphans(self) -> dict[str, dict[str, Any]]:
        """This runtime's memory devices blockd holds from an earlier run of the node."""
        if self._orphans is None:
            found: dict[str, dict[str, Any]] = {}
            prefix = f"{self._owner}-"
            try:
                with self._client() as client:
                    for dev in client.call("list"):
                        name = Path(dev.get("source") or "").name
                        if name.startswith(prefix) and name.endswith(MEMORY_SUFFIX):
                            found[name[len(prefix):-len(MEMORY_SUFFIX)]] = dev
            except (BlockdError, OSError) as exc:
                log.warning("cannot list blockd's memory devices", extra={"error": str(exc)})
            self._orphans = found
        return self._orphans

    def path_for(self, key: str) -> Path:
        info = self._devices.get(key)
        return Path(info["file"]) if info else self.fallback.path_for(key)

    def acquire(self, key: str, layers: list[Path], size: int) -> Path:
        """A reference on the snapshot's memory file (blockd's device). Blocking."""
        with self._guard:
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:
            with self._guard:
                fallback = key in self._fallback_keys
                reuse = not fallback and key in self._devices
                if reuse:
                    self._refs[key] += 1
                    ranges, warm_file = self._load.get(key), self._warm_files[key]
                    file = Path(self._devices[key]["file"])
            if reuse:
                # Its pages may be cached, or dropped by the host, or privately rewritten by
                # the VMs running from it (then gone from the cache): read the load's again.
                if ranges and self.prefetch_enabled:
                    self._start_warm(key, warm_file, ranges)
                return file
            if fallback:
                return self._fallback_acquire(key, layers, size)
            orphan = self._find_orphans().pop(key, None)
            info = self._open(key, layers, size)
            if info is not None and orphan is not None:
                self._take_over(orphan)
            if info is None:
                return self._fallback_acquire(key, layers, size)
            file = Path(info["file"])
            with self._guard:
                self._devices[key] = info
                self._refs[key] = 1
                self._warm_files[key] = _WarmFile(file)
            self._after_open(key, layers, file, taken_over=orphan is not None)
            return file

    def _open(self, key: str, layers: list[Path], size: int) -> dict[str, Any] | None:
        try:
            with self._client() as client:
                info = client.call("memory_open", key=self._device_key(key),
                                   layers=[str(p) for p in layers], size=size)
        except (BlockdError, OSError) as exc:
            if UNAVAILABLE in str(exc):  # no FUSE on this host: materialise as before
                log.warning("memory devices unavailable, exporting memory files",
                            extra={"snapshot": key, "error": str(exc)})
                return None
            raise SnapshotError(f"memory layer stack of snapshot {key} cannot be served: {exc}") from exc
        return dict(info)

    def _take_over(self, dev: dict[str, Any]) -> None:
        """After a fresh `memory_open` of a device an earlier run held: drop that run's
        references, so this runtime holds exactly one."""
        with self._client() as client:
            for _ in range(max(0, int(dev.get("refcount", 1)))):
                client.release(dev["id"])

    def _after_open(self, key: str, layers: list[Path], file: Path, *, taken_over: bool = False
                    ) -> None:
        """A device opened by this runtime: warm its load ranges and (fresh: nothing of it in
        the page cache) prefetch along the snapshot's startup pack, or record the pack's chunk
        order from this restore."""
        if not layers:
            return
        snap_dir = layers[-1].parent
        pack = read_pack(snap_dir)
        ranges = None if pack is None else pack["load"]
        offsets = None if pack is None else pack["chunks"]
        if ranges is not None:
            with self._guard:
                self._load[key] = ranges
        if not taken_over and offsets is None:
            with self._guard:
                self._fresh[key] = snap_dir
        if not self.prefetch_enabled:
            return
        if taken_over or offsets is None:  # (an earlier run's device: its pages likely cached)
            if ranges:
                self._start_warm(key, self._warm_files[key], ranges)
            return
        warm_file = self._warm_files[key]

        def run() -> None:
            if ranges:
                self._warm(key, warm_file, ranges)
            self.last_prefetch = prefetch(file, offsets)
            log.info("startup pack prefetched", extra={"snapshot": key, **self.last_prefetch})

        threading.Thread(target=run, name=f"prefetch-{key[:8]}", daemon=True).start()

    def _start_warm(self, key: str, warm_file: _WarmFile, ranges: list[tuple[int, int]]) -> None:
        if warm_file.users:  # one in flight (the children of a fork): it reads the same pages
            return
        threading.Thread(target=self._warm, args=(key, warm_file, ranges),
                         name=f"warm-{key[:8]}", daemon=True).start()

    def _warm(self, key: str, warm_file: _WarmFile, ranges: list[tuple[int, int]]) -> None:
        """Read the pack's load ranges of a device into the page cache (module doc)."""
        fd = warm_file.enter()
        if fd is None:
            return
        try:
            self.last_warm = warm(fd, ranges)
        finally:
            warm_file.leave()
        log.debug("startup pages read", extra={"snapshot": key, **self.last_warm})

    def wants_load_pages(self, key: str) -> bool:
        """Whether the restore asking (its device-state load done, its guest not started)
        should record the pages QEMU mapped, the pack's load ranges: yes for the first one
        that finds the snapshot's pack without them."""
        with self._guard:
            if key not in self._devices or key in self._load:
                return False
            self._load[key] = []  # claimed: the restores beside this one do not scan
            return True

    def set_load_pages(self, key: str, snapshot_dir: Path, ranges: list[tuple[int, int]]) -> None:
        """Keep a restore's load ranges (`wants_load_pages`) in the startup pack; none past
        LOAD_CAP bytes or none at all (not a load's: the next restore tries again)."""
        if not ranges or sum(n for _, n in ranges) > LOAD_CAP:
            log.warning("load pages not kept", extra={"snapshot": key, "ranges": len(ranges),
                                                      "bytes": sum(n for _, n in ranges)})
            with self._guard:
                if self._load.get(key) == []:
                    del self._load[key]
            return
        with self._guard:
            if key in self._devices:
                self._load[key] = list(ranges)
        try:
            self._update_pack(snapshot_dir, load=ranges)
        except OSError as exc:
            log.warning("load pages not stored", extra={"snapshot": key, "error": str(exc)})

    def _update_pack(self, snapshot_dir: Path, *, chunk_size: int | None = None,
                     chunks: list[int] | None = None,
                     load: list[tuple[int, int]] | None = None) -> None:
        with self._pack_lock:
            pack = read_pack(snapshot_dir)
            size = chunk_size or CHUNK
            if chunks is None and pack is not None and pack["chunks"] is not None:
                chunks = [c // size for c in pack["chunks"]]
            if load is None and pack is not None:
                load = pack["load"]
            write_pack(snapshot_dir, size, chunks, load)

    def after_restore(self, key: str, snapshot_dir: Path) -> None:
        """Called once a restore runs: record the startup pack's chunk order if this restore
        was the first user of a fresh device (in a timer thread, PACK_WINDOW later)."""
        with self._guard:
            if self._fresh.get(key) is None:
                return
            self._fresh.pop(key)
            info = self._devices.get(key)
        if info is None:
            return

        def record() -> None:
            try:
                with self._client() as client:
                    trace = client.call("memory_trace", id=info["id"])
                self._update_pack(snapshot_dir, chunk_size=trace["chunk_size"], chunks=trace["chunks"])
            except (BlockdError, OSError, KeyError) as exc:
                log.warning("startup pack not recorded", extra={"snapshot": key, "error": str(exc)})

        timer = threading.Timer(PACK_WINDOW, record)
        timer.daemon = True
        timer.start()

    def _fallback_acquire(self, key: str, layers: list[Path], size: int) -> Path:
        with self._guard:
            self._fallback_keys.add(key)
        return self.fallback.acquire(key, layers, size)

    def release(self, key: str) -> None:
        with self._guard:
            if key in self._fallback_keys:
                self.fallback.release(key)
                if self.fallback.refcount(key) == 0:
                    self._fallback_keys.discard(key)
                return
            count = self._refs.get(key, 0) - 1
            if count > 0:
                self._refs[key] = count
                return
            self._refs.pop(key, None)
            self._fresh.pop(key, None)
            self._load.pop(key, None)
            warm_file = self._warm_files.pop(key, None)
            info = self._devices.pop(key, None)
        if warm_file is not None:
            warm_file.release()  # before blockd's release: memfs closes the stack then
        if info is not None:
            try:
                with self._client() as client:
                    client.release(info["id"])
            except (BlockdError, OSError) as exc:
                log.warning("memory device not released", extra={"snapshot": key, "error": str(exc)})

    def refcount(self, key: str) -> int:
        with self._guard:
            if key in self._fallback_keys:
                return self.fallback.refcount(key)
            return self._refs.get(key, 0)

    def drop_orphans(self) -> None:
        """Release the memory devices of an earlier run that no adopted VM took over."""
        orphans = self._find_orphans()
        self._orphans = {}
        for key, dev in orphans.items():
            try:
                with self._client() as client:
                    for _ in range(max(1, int(dev.get("refcount", 1)))):
                        client.release(dev["id"])
                log.info("memory device of an earlier run released", extra={"snapshot": key})
            except (BlockdError, OSError) as exc:
                log.warning("memory device of an earlier run not released",
                            extra={"snapshot": key, "error": str(exc)})

    def zero_file(self, size: int) -> Path:
        return self.fallback.zero_file(size)


def write_pack(snapshot_dir: Path, chunk_size: int, chunks: list[int] | None,
               load: list[tuple[int, int]] | None = None) -> None:
    """`chunks` (chunk numbers in first-touch order) or `load` may be None: not recorded yet."""
    doc: dict[str, Any] = {"version": 1, "chunk_size": chunk_size}
    if chunks is not None:
        doc["memory"] = chunks
    if load is not None:
        doc["load"] = [[offset, length] for offset, length in load]
    atomic_write(snapshot_dir / PACK_NAME, json.dumps(doc) + "\n", mode=0o644)


def make_memory_store(config: Any, blockd: DiskService | None) -> MemoryFileCache | SharedMemoryDevices:
    """The runtime's RAM-file store for `config.memory_device` (module doc)."""
    files = MemoryFileCache(config.memory_dir)
    socket = blockd.socket_path if blockd is not None else None
    if config.memory_device != "blockd" or socket is None:
        return files
    return SharedMemoryDevices(socket, files, config.state_dir, prefetch=config.memory_prefetch)
