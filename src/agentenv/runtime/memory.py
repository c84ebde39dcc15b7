"""Guest memory as overlaybd layers: capture written pages, materialise a stack as a file.

Capture. Guest RAM is a MAP_PRIVATE mapping of a read-only file (the snapshot's materialised
memory, or an empty sparse file for a cold boot). A page the guest wrote since the VM was
restored is exactly a present page that is no longer file-backed (an anonymous copy-on-write
copy), or a swapped-out one: /proc/PID/pagemap tells (bit 63 present, 62 swapped, 61
file-page). Those pages are read straight out of QEMU with process_vm_readv (batched iovecs)
and written, in address order, as one sealed overlaybd layer: all-zero pages as zeroed
mappings (they must hide older data in lower layers), the rest as data. Cost follows the
number of written pages, not the memory size (pagemap is 8 bytes per page).

Materialise. A snapshot's memory stack (oldest layer first) is exported once as a sparse
read-only raw file; every VM restored from the snapshot maps that file privately, so clean
pages are shared through the page cache. `MemoryFileCache` refcounts the files and removes
one when its last VM is gone.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from agentenv.runtime.errors import SnapshotError
from agentenv.storage.builder import LayerBuilder
from agentenv.storage.errors import StorageError
from agentenv.storage.export import export_raw
from agentenv.storage.image import Image

PAGE = 4096
IOV_MAX = 1024
BATCH_BYTES = 16 << 20

_libc = ctypes.CDLL(None, use_errno=True)


class _IoVec(ctypes.Structure):
    _fields_ = [("iov_base", ctypes.c_void_p), ("iov_len", ctypes.c_size_t)]


_libc.process_vm_readv.argtypes = [
    ctypes.c_int, ctypes.POINTER(_IoVec), ctypes.c_ulong,
    ctypes.POINTER(_IoVec), ctypes.c_ulong, ctypes.c_ulong,
]
_libc.process_vm_readv.restype = ctypes.c_ssize_t


def find_ram_mapping(pid: int, mem_path: str, size: int) -> int:
    """Host virtual address where QEMU mapped `mem_path` (the guest RAM)."""
    real = os.path.realpath(mem_path)
    with open(f"/proc/{pid}/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) < 6:
                continue
            path = fields[5].strip().removesuffix(" (deleted)")
            if path != real:
                continue
            start, end = (int(x, 16) for x in fields[0].split("-"))
            if end - start >= size and int(fields[2], 16) == 0:
                return start
    raise SnapshotError(f"QEMU pid {pid} has no mapping of its guest RAM file {mem_path}")


def written_page_runs(pid: int, addr: int, size: int) -> list[tuple[int, int]]:
    """(first page, page count) runs of pages written since the mapping was made."""
    npages = size // PAGE
    fd = os.open(f"/proc/{pid}/pagemap", os.O_RDONLY)
    try:
        raw = bytearray(npages * 8)
        view = memoryview(raw)
        got = 0
        while got < len(raw):
            n = os.preadv(fd, [view[got:]], (addr // PAGE) * 8 + got)
            if n <= 0:
                raise SnapshotError(f"short read of /proc/{pid}/pagemap")
            got += n
    finally:
        os.close(fd)
    entries = np.frombuffer(raw, dtype=np.uint64)
    present = (entries >> np.uint64(63)) & np.uint64(1)
    swapped = (entries >> np.uint64(62)) & np.uint64(1)
    file_page = (entries >> np.uint64(61)) & np.uint64(1)
    written = ((present & (file_page ^ np.uint64(1))) | swapped).astype(np.int8)
    edges = np.diff(np.concatenate(([0], written, [0])))
    starts = np.flatnonzero(edges == 1)
    ends = np.flatnonzero(edges == -1)
    return [(int(s), int(e - s)) for s, e in zip(starts, ends, strict=True)]


def _read_remote(pid: int, buf: bytearray, remote: list[tuple[int, int]]) -> None:
    """Fill buf with the concatenation of the remote (address, length) ranges."""
    base = ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))
    done = 0
    for i in range(0, len(remote), IOV_MAX):
        part = remote[i : i + IOV_MAX]
        total = sum(length for _, length in part)
        local = _IoVec(base + done, total)
        remote_iov = (_IoVec * len(part))(*[_IoVec(a, n) for a, n in part])
        got = _libc.process_vm_readv(pid, ctypes.byref(local), 1, remote_iov, len(part), 0)
        if got != total:
            err = ctypes.get_errno()
            raise SnapshotError(
                f"process_vm_readv from QEMU pid {pid} read {got} of {total} bytes: "
                f"{os.strerror(err) if got < 0 else 'short read'}"
            )
        done += total


@dataclass
class CaptureStats:
    written_pages: int
    zero_pages: int
    layer_bytes: int


def capture_memory_layer(
    pid: int, addr: int, size: int, out: Path, *, parent_uuid: str | None = None
) -> CaptureStats:
    """Write the pages QEMU pid wrote into its RAM mapping as a sealed layer at `out`."""
    runs = written_page_runs(pid, addr, size)
    written = zero = 0
    try:
        with LayerBuilder(out, size, parent_uuid=parent_uuid) as builder:
            batch: list[tuple[int, int]] = []
            batch_pages = 0

            def flush() -> None:
                nonlocal written, zero, batch_pages
                if not batch:
                    return
                buf = bytearray(batch_pages * PAGE)
                _read_remote(pid, buf, [(addr + p * PAGE, n * PAGE) for p, n in batch])
                pages = np.frombuffer(buf, dtype=np.uint64).reshape(batch_pages, PAGE // 8)
                nonzero = pages.any(axis=1)
                view = memoryview(buf)
                pos = 0
                for first, count in batch:
                    flags = nonzero[pos : pos + count]
                    edges = np.flatnonzero(np.diff(flags.astype(np.int8))) + 1
                    bounds = [0, *edges.tolist(), count]
                    for a, b in itertools.pairwise(bounds):
                        offset = (first + a) * PAGE
                        if flags[a]:
                            builder.add(offset, view[(pos + a) * PAGE : (pos + b) * PAGE])
                        else:
                            builder.add_zero(offset, (b - a) * PAGE)
                            zero += b - a
                    pos += count
                    written += count
                batch.clear()
                batch_pages = 0

            for first, count in runs:
                while count > 0:
                    take = min(count, BATCH_BYTES // PAGE - batch_pages)
                    batch.append((first, take))
                    batch_pages += take
                    first += take
                    count -= take
                    if batch_pages * PAGE >= BATCH_BYTES:
                        flush()
            flush()
    except OSError as exc:
        raise SnapshotError(f"cannot write memory layer {out}: {exc.strerror or exc}") from exc
    return CaptureStats(written, zero, out.stat().st_size)


def materialise(layers: list[Path], out: Path, size: int) -> Path:
    """Export a memory layer stack (oldest first) as a sparse raw file of `size` bytes."""
    try:
        image = Image.create(layers, None, size)
    except (StorageError, OSError) as exc:
        raise SnapshotError(f"memory layer stack cannot be opened: {exc}") from exc
    try:
        if image.virtual_size != size:
            raise SnapshotError(
                f"memory layers describe {image.virtual_size} bytes, the machine has {size}"
            )
        export_raw(image, out)
    except StorageError as exc:
        raise SnapshotError(f"memory layer stack cannot be read: {exc}") from exc
    finally:
        image.close()
    os.chmod(out, 0o444)
    return out


class MemoryFileCache:
    """Materialised memory files, one per snapshot, shared and refcounted."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.directory.mkdir(parents=True, exist_ok=True)
        self._refs: dict[str, int] = {}
        self._locks: dict[str, threading.Lock] = {}
        self._guard = threading.Lock()

    def path_for(self, key: str) -> Path:
        return self.directory / f"{key}.mem"

    def acquire(self, key: str, layers: list[Path], size: int) -> Path:
        """Materialise (once) and take a reference. Blocking: run it in a thread."""
        with self._guard:
            lock = self._locks.setdefault(key, threading.Lock())
        with lock:
            path = self.path_for(key)
            if not path.exists():
                materialise(layers, path, size)
            with self._guard:
                self._refs[key] = self._refs.get(key, 0) + 1
            return path

    def release(self, key: str) -> None:
        with self._guard:
            count = self._refs.get(key, 0) - 1
            if count > 0:
                self._refs[key] = count
                return
            self._refs.pop(key, None)
        self.path_for(key).unlink(missing_ok=True)

    def refcount(self, key: str) -> int:
        with self._guard:
            return self._refs.get(key, 0)

    def zero_file(self, size: int) -> Path:
        """An empty sparse file of `size` bytes: the RAM file of a cold-booted VM."""
        path = self.directory / f"zero-{size}.mem"
        if not path.exists() or path.stat().st_size != size:
            tmp = path.with_suffix(f".tmp{os.getpid()}")
            with open(tmp, "wb") as f:
                f.truncate(size)
            os.chmod(tmp, 0o444)
            os.replace(tmp, path)
        return path
