"""Memory devices: a snapshot's memory layer stack served as one read-only file.

A restore maps guest RAM privately from this file (`memory-backend-file,share=off`), so
every VM restored from one snapshot reads its clean pages from one page cache and no raw
copy of the memory exists on disk (docs/snapshots.md §3). A memory device is an image config
`STATE/memdev/<key>.memory.json` listing the layers, refcounted as an ordinary shared
read-only device (its record brings the refcount back after a daemon restart), and served as
the file `STATE/memfs/<key>` by the memfs process (blockd/memfs.py): a FUSE mount of its own
that outlives a killed blockd, since QEMU's mapping would fault (SIGBUS) on a dead FUSE
connection. memfs traces the order of each device's first reads (page-cache misses, per
1 MiB chunk); `memory_trace` returns it, the runtime's startup pack (runtime/memdev.py).

Operations (daemon RPC): `memory_open {key, layers, size}` -> device with "file" = the memfs
path (refcount+1 when it exists); `memory_trace {id}` -> {"chunk_size", "chunks"}; release is
the ordinary `release` (the last one removes the config, and memfs closes the stack).
"""

from __future__ import annotations

import asyncio
import dataclasses
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentenv.blockd import memfs
from agentenv.blockd.errors import BlockdError
from agentenv.blockd.results import DeviceInfo
from agentenv.storage.config import ImageConfig

if TYPE_CHECKING:
    from agentenv.blockd.manager import DeviceManager

MEMORY_SUFFIX = memfs.MEMORY_SUFFIX
CHUNK = memfs.CHUNK
UNAVAILABLE = "memory devices unavailable"
_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def _key_of(source: str | None) -> str | None:
    if source and source.endswith(MEMORY_SUFFIX):
        return Path(source).name.removesuffix(MEMORY_SUFFIX)
    return None


async def memory_open(manager: DeviceManager, key: str, layers: list[str], size: int
                      ) -> DeviceInfo:
    if not isinstance(key, str) or not _KEY.match(key):
        raise BlockdError(f"memory key {key!r}: letters, digits, '_', '.', '-' (at most 128)")
    if not isinstance(layers, list) or not layers or not all(isinstance(x, str) for x in layers):
        raise BlockdError("memory_open needs `layers`: the memory layer paths, oldest first")
    if not isinstance(size, int) or isinstance(size, bool) or size <= 0:
        raise BlockdError(f"size must be a positive number of bytes, got {size!r}")
    paths = [Path(x).resolve() for x in layers]
    for p in paths:
        if not p.is_file():
            raise BlockdError(f"memory layer {p} does not exist")
    try:
        mountpoint = await asyncio.to_thread(memfs.ensure_running, manager.layout.root)
    except (RuntimeError, OSError) as exc:
        raise BlockdError(f"{UNAVAILABLE}: {exc}") from exc
    folder = manager.layout.root / "memdev"
    folder.mkdir(mode=0o700, exist_ok=True)
    config = folder / f"{key}{MEMORY_SUFFIX}"
    wanted = ImageConfig(config, paths)
    if not config.exists() or config.read_text() != _render(wanted):
        if manager.shared_id(config.resolve()) is not None:
            raise BlockdError(f"memory device {key} is open with other layers")
        wanted.save()
    try:
        info = await manager.create(image=str(config), readonly=True, size=size)
    except BaseException:
        if manager.shared_id(config.resolve()) is None:
            config.unlink(missing_ok=True)
        raise
    return dataclasses.replace(info, file=str(mountpoint / key))


async def memory_trace(manager: DeviceManager, id: str) -> dict[str, Any]:
    device = manager.get(id)
    key = _key_of(device.record.source)
    if key is None:
        raise BlockdError(f"device {id} is not a memory device")
    trace = manager.layout.root / "memdev" / f"{key}{memfs.TRACE_SUFFIX}"
    try:
        raw = trace.read_bytes()
    except FileNotFoundError:
        raw = b""
    chunks = [int.from_bytes(raw[i:i + 4], "little") for i in range(0, len(raw) - len(raw) % 4, 4)]
    return {"chunk_size": CHUNK, "chunks": chunks}


def forget_config(source: str | None) -> None:
    """A released memory device's image config goes with it (memfs then closes the stack)."""
    if _key_of(source) is not None:
        assert source is not None
        Path(source).unlink(missing_ok=True)


def stop(state_dir: Path) -> None:
    """A graceful blockd stop ends memfs too (a killed blockd leaves it serving)."""
    memfs.stop(state_dir)


def _render(config: ImageConfig) -> str:
    import json

    return json.dumps(config.to_json(), indent=2) + "\n"
