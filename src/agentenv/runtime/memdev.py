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
from agentenv.blockd.memdev import UNAVAILABLE
from agentenv.fsutil import atomic_write
from agentenv.runtime.errors import SnapshotError
from agentenv.runtime.memory import MemoryFileCache

log = logging.getLogger("agentenv.runtime.memdev")

PACK_NAME = "startup-pack.json"
PACK_WINDOW = 3.0  # seconds after a restore during which first touches count for the pack
MEMORY_SUFFIX = ".memory.json"


def load_pack(snapshot_dir: Path) -> list[int] | None:
    """The chunk order stored with a snapshot, or None."""
    try:
        doc = json.loads((snapshot_dir / PACK_NAME).read_text())
        chunk = int(doc["chunk_size"])
        return [int(c) * chunk for c in doc["memory"]]
    except (OSError, ValueError, KeyError, TypeError):
        return None


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
        self._orphans: dict[str, dict[str, Any]] | None = None
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()
        self.last_prefetch: dict[str, float] | None = None

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
                if not fallback and key in self._devices:
                    self._refs[key] += 1
                    return Path(self._devices[key]["file"])
            if fallback:
                return self._fallback_acquire(key, layers, size)
            orphan = self._find_orphans().pop(key, None)
            info = self._open(key, layers, size)
            if info is not None and orphan is not None:
                self._take_over(orphan)
            if info is None:
                return self._fallback_acquire(key, layers, size)
            with self._guard:
                self._devices[key] = info
                self._refs[key] = 1
            if orphan is None:
                self._after_open(key, layers, Path(info["file"]))
            return Path(info["file"])

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

    def _after_open(self, key: str, layers: list[Path], file: Path) -> None:
        """A fresh device: nothing of it is in the page cache. Prefetch along the snapshot's
        startup pack, or record one from this restore."""
        if not layers:
            return
        snap_dir = layers[-1].parent
        offsets = load_pack(snap_dir)
        if offsets is None:
            self._fresh[key] = snap_dir
        elif self.prefetch_enabled:
            def run() -> None:
                self.last_prefetch = prefetch(file, offsets)
                log.info("startup pack prefetched", extra={"snapshot": key, **self.last_prefetch})

            threading.Thread(target=run, name=f"prefetch-{key[:8]}", daemon=True).start()

    def after_restore(self, key: str, snapshot_dir: Path) -> None:
        """Called once a restore runs: record the startup pack if this restore was the first
        user of a fresh device (in a timer thread, PACK_WINDOW later)."""
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
                write_pack(snapshot_dir, trace["chunk_size"], trace["chunks"])
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
            info = self._devices.pop(key, None)
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


def write_pack(snapshot_dir: Path, chunk_size: int, chunks: list[int]) -> None:
    doc = {"version": 1, "chunk_size": chunk_size, "memory": chunks}
    atomic_write(snapshot_dir / PACK_NAME, json.dumps(doc) + "\n", mode=0o644)


def make_memory_store(config: Any, blockd: DiskService | None) -> MemoryFileCache | SharedMemoryDevices:
    """The runtime's RAM-file store for `config.memory_device` (module doc)."""
    files = MemoryFileCache(config.memory_dir)
    socket = blockd.socket_path if blockd is not None else None
    if config.memory_device != "blockd" or socket is None:
        return files
    return SharedMemoryDevices(socket, files, config.state_dir, prefetch=config.memory_prefetch)
