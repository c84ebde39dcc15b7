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
# Shorter runs of zero pages among written pages are stored as data (see _with_short_zero_gaps).
MIN_ZERO_PAGES = 16

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


def written_pages(pid: int, addr: int, size: int) -> np.ndarray:
    """Page numbers (ascending) of the pages written since the mapping was made."""
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
    return np.flatnonzero((present & (file_page ^ np.uint64(1))) | swapped)


def written_page_runs(pid: int, addr: int, size: int) -> list[tuple[int, int]]:
    """(first page, page count) runs of pages written since the mapping was made."""
    pages = written_pages(pid, addr, size)
    starts, ends = _runs(pages, np.ones(len(pages), dtype=bool))
    return [(int(pages[a]), int(b - a)) for a, b in zip(starts, ends, strict=True)]


def _runs(pages: np.ndarray, same: np.ndarray) -> tuple[list[int], list[int]]:
    """[start, end) index ranges of `pages` that are consecutive page numbers with equal `same`."""
    if len(pages) == 0:
        return [], []
    breaks = np.flatnonzero((np.diff(pages) != 1) | (np.diff(same.astype(np.int8)) != 0)) + 1
    return [0, *breaks.tolist()], [*breaks.tolist(), len(pages)]


def _read_remote(pid: int, buf: bytearray, addrs: np.ndarray, lengths: np.ndarray) -> None:
    """Fill buf with the concatenation of the remote ranges (addrs[i], lengths[i])."""
    base = ctypes.addressof((ctypes.c_char * len(buf)).from_buffer(buf))
    # struct iovec arrays built with numpy: no Python object per range.
    iovecs = np.empty((len(addrs), 2), dtype=np.uint64)
    iovecs[:, 0] = addrs
    iovecs[:, 1] = lengths
    done = 0
    for i in range(0, len(addrs), IOV_MAX):
        part = iovecs[i : i + IOV_MAX]
        total = int(part[:, 1].sum())
        local = _IoVec(base + done, total)
        got = _libc.process_vm_readv(pid, ctypes.byref(local), 1,
                                     ctypes.cast(part.ctypes.data, ctypes.POINTER(_IoVec)),
                                     len(part), 0)
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
    """Write the pages QEMU pid wrote into its RAM mapping as a sealed layer at `out`.

    Pages are read in batches of BATCH_BYTES with one process_vm_readv per IOV_MAX runs; the
    batch is split into extents (consecutive pages, all zero or all data) with numpy, so the
    Python work is per extent, not per page; each extent is one write. Writeback of a batch
    starts as soon as it is written, so the final fsync waits for little more than the
    last batch."""
    pages = written_pages(pid, addr, size)
    zero = 0
    buf = bytearray(min(len(pages) * PAGE, BATCH_BYTES))
    view = memoryview(buf)
    per_batch = BATCH_BYTES // PAGE
    try:
        with LayerBuilder(out, size, parent_uuid=parent_uuid) as builder:
            for first in range(0, len(pages), per_batch):
                batch = pages[first : first + per_batch]
                n = len(batch)
                starts, ends = _runs(batch, np.ones(n, dtype=bool))
                first_pages = batch[starts].astype(np.uint64)
                counts = np.asarray(ends, dtype=np.uint64) - np.asarray(starts, dtype=np.uint64)
                _read_remote(pid, buf, np.uint64(addr) + first_pages * np.uint64(PAGE),
                             counts * np.uint64(PAGE))
                nonzero = np.frombuffer(buf, dtype=np.uint64, count=n * (PAGE // 8)).reshape(
                    n, PAGE // 8).any(axis=1)
                data = _with_short_zero_gaps(batch, nonzero)
                zero += n - int(np.count_nonzero(data))
                starts, ends = _runs(batch, data)
                for a, b in zip(starts, ends, strict=True):
                    offset = int(batch[a]) * PAGE
                    if data[a]:
                        builder.add(offset, view[a * PAGE : b * PAGE])
                    else:
                        builder.add_zero(offset, (b - a) * PAGE)
                if builder.sink is builder.file:
                    builder.file.flush()
                    _start_writeback(builder.file.fileno())
    except OSError as exc:
        raise SnapshotError(f"cannot write memory layer {out}: {exc.strerror or exc}") from exc
    return CaptureStats(len(pages), zero, out.stat().st_size)


def _with_short_zero_gaps(pages: np.ndarray, nonzero: np.ndarray) -> np.ndarray:
    """Which pages to store as data: the non-zero ones, and zero pages in stretches shorter
    than MIN_ZERO_PAGES between them. A zero page stored as data reads the same as a zeroed
    mapping; merging short gaps keeps the extent count (Python work and index size) down,
    since guests zero pages as they allocate them and so interleave zero and data pages."""
    data = nonzero.copy()
    starts, ends = _runs(pages, nonzero)
    for a, b in zip(starts, ends, strict=True):
        if not nonzero[a] and b - a < MIN_ZERO_PAGES:
            data[a:b] = True
    return data


_SYNC_FILE_RANGE_WRITE = 2
_libc.sync_file_range.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
_libc.sync_file_range.restype = ctypes.c_int


def _start_writeback(fd: int) -> None:
    """Start (not wait for) writeback of the file's dirty pages, overlapping it with capture."""
    _libc.sync_file_range(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)


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
