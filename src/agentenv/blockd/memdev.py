"""Memory devices: a snapshot's memory layer stack served as one read-only FUSE file.

A restore maps guest RAM privately from this file (`memory-backend-file,share=off`), so
every VM restored from one snapshot reads its clean pages from one page cache and no raw
copy of the memory exists on disk (docs/snapshots.md §3). A memory device is an ordinary
shared read-only device (refcounted, recovered from its record after a daemon restart)
whose image is an image config `STATE/memdev/<key>.memory.json` listing the layers; the
suffix is what marks it as memory for the FUSE file:

- served through the page cache (no direct_io, keep_cache): the content never changes, and
  sharing clean pages across VMs is the point;
- readable and openable read-write by the VM group (QEMU opens its RAM file O_RDWR for
  free-page reporting, runtime/qemu.py) while every write or hole punch is refused: QEMU's
  mapping is private, so nothing it does ever reaches the file;
- the order in which chunks (CHUNK bytes) are first read is traced (`TouchTrace`). Reads
  reach the daemon only on page-cache misses, so the trace of a fresh device is the order in
  which the first restore touched its memory: the runtime stores it with the snapshot as its
  startup pack (runtime/memdev.py).

Operations (daemon RPC): `memory_open {key, layers, size}` -> device (refcount+1 when it
exists); `memory_trace {id}` -> {"chunk_size", "chunks"}; release is the ordinary `release`.
"""

from __future__ import annotations

import re
import threading
from pathlib import Path
from typing import TYPE_CHECKING, Any

from agentenv.blockd.errors import BlockdError
from agentenv.storage.config import ImageConfig

if TYPE_CHECKING:
    from agentenv.blockd.daemon import Blockd
    from agentenv.blockd.device import Device

MEMORY_SUFFIX = ".memory.json"
CHUNK = 1 << 20  # the remote chunk size as well (the startup pack's unit)
_KEY = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def is_memory(device: Device) -> bool:
    return device.readonly and (device.record.source or "").endswith(MEMORY_SUFFIX)


class TouchTrace:
    """Chunks in the order of their first read (each chunk once)."""

    def __init__(self, size: int) -> None:
        self._seen = bytearray((size + CHUNK - 1) // CHUNK)
        self.order: list[int] = []
        self._lock = threading.Lock()

    def note(self, offset: int, length: int) -> None:
        first, last = offset // CHUNK, (offset + max(length, 1) - 1) // CHUNK
        with self._lock:
            for chunk in range(first, min(last + 1, len(self._seen))):
                if not self._seen[chunk]:
                    self._seen[chunk] = 1
                    self.order.append(chunk)


def note_read(device: Device, offset: int, length: int) -> None:
    """Called by the FUSE read of every device; traces memory devices only."""
    trace: TouchTrace | None = getattr(device, "touch_trace", None)
    if trace is not None:
        trace.note(offset, length)


def attach_trace(device: Device) -> None:
    if is_memory(device) and getattr(device, "touch_trace", None) is None:
        device.touch_trace = TouchTrace(device.size)  # type: ignore[attr-defined]


async def memory_open(daemon: Blockd, key: str, layers: list[str], size: int) -> dict[str, Any]:
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
    folder = daemon.state_dir / "memdev"
    folder.mkdir(mode=0o700, exist_ok=True)
    config = folder / f"{key}{MEMORY_SUFFIX}"
    wanted = ImageConfig(config, paths)
    if not config.exists() or config.read_text() != _render(wanted):
        existing = daemon._shared_by_source.get(str(config.resolve()))
        if existing is not None and existing in daemon.devices:
            raise BlockdError(f"memory device {key} is open with other layers")
        wanted.save()
    try:
        info = await daemon.create(image=str(config), readonly=True, size=size)
    except BaseException:
        if str(config.resolve()) not in daemon._shared_by_source:
            config.unlink(missing_ok=True)
        raise
    device = daemon.devices[info["id"]]
    attach_trace(device)
    return device.info()


async def memory_trace(daemon: Blockd, id: str) -> dict[str, Any]:
    device = daemon._get(id)
    trace: TouchTrace | None = getattr(device, "touch_trace", None)
    if trace is None:
        raise BlockdError(f"device {id} is not a memory device")
    with trace._lock:
        chunks = list(trace.order)
    return {"chunk_size": CHUNK, "chunks": chunks}


def forget_config(source: str | None) -> None:
    """A released memory device's image config goes with it."""
    if source and source.endswith(MEMORY_SUFFIX):
        Path(source).unlink(missing_ok=True)


def _render(config: ImageConfig) -> str:
    import json

    return json.dumps(config.to_json(), indent=2) + "\n"
