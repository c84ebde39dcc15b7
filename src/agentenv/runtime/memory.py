"""Guest memory as overlaybd layers: capture written pages, materialise a stack as a file.

Capture. Guest RAM is a MAP_PRIVATE mapping of a read-only file (the snapshot's materialised
memory, or an empty sparse file for a cold boot). A page the guest wrote since the VM was
restored is exactly a present page that is no longer file-backed (an anonymous copy-on-write
copy), or a swapped-out one: /proc/PID/pagemap tells (bit 63 present, 62 swapped, 61
file-page). Those pages are read straight out of QEMU with process_vm_readv (batched iovecs)
and written, in address order, as one sealed overlaybd layer: all-zero pages as zeroed
mappings (they must hide older data in lower layers), the rest as data. Cost follows the
number of written pages, not the memory size (pagemap is 8 bytes per page). Reading,
classifying and writing run as a pipeline (`capture_memory_layer`); the data goes from
QEMU into a reused buffer and from there with O_DIRECT into the layer file. The pipeline runs
in the native core (storage/_native.cpp `capture_pages`: pagemap scan, process_vm_readv,
zero-page classification and pwritev on threads without the GIL) when it is built and not
switched off (AENV_BLOCKD_NATIVE=0); the Python pipeline here is its reference, and both
write the same bytes (tests/runtime/test_memory_capture.py).

Materialise. A snapshot's memory stack (oldest layer first) is exported once as a sparse
read-only raw file; every VM restored from the snapshot maps that file privately, so clean
pages are shared through the page cache. `MemoryFileCache` refcounts the files and removes
one when its last VM is gone.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
import mmap
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from agentenv.fsutil import InsufficientSpace, SpaceGuard, require_free_space
from agentenv.runtime.errors import SnapshotError
from agentenv.storage import native
from agentenv.storage.builder import LayerBuilder
from agentenv.storage.errors import StorageError
from agentenv.storage.export import export_raw
from agentenv.storage.image import Image

PAGE = 4096
IOV_MAX = 1024
BATCH_BYTES = 4 << 20
PIPELINE_DEPTH = 6  # read buffers (batches being read, waiting, or being written)
WRITERS = 2  # concurrent O_DIRECT writes: the disk gets a queue depth above one
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


# PAGEMAP_SCAN (Linux 6.7, include/uapi/linux/fs.h): _IOWR('f', 16, struct pm_scan_arg).
_PAGEMAP_SCAN = 0xC0606610
_PAGE_IS_PRESENT = 1 << 3
_SCAN_REGIONS = 1024


def present_ranges(pid: int, addr: int, size: int) -> list[tuple[int, int]]:
    """(offset, length) ranges of the mapping [addr, addr + size) of process `pid` whose pages
    are mapped (present) now, ascending: between a restore's device-state load and its `cont`,
    the pages QEMU's start and load faulted in (each with the cached neighbours the kernel's
    fault-around mapped). PAGEMAP_SCAN walks only populated page tables; without it (before
    Linux 6.7) the whole range's pagemap is read."""
    fd = os.open(f"/proc/{pid}/pagemap", os.O_RDONLY | os.O_CLOEXEC)
    try:
        try:
            return _scan_present(fd, addr, size)
        except OSError as exc:
            if exc.errno not in (errno.ENOTTY, errno.EINVAL, errno.EOPNOTSUPP):
                raise
        entries = _pagemap_entries(fd, pid, addr, size)
    finally:
        os.close(fd)
    pages = np.flatnonzero((entries >> np.uint64(63)) & np.uint64(1))
    first, ends = _run_bounds(pages)
    return [(int(pages[a]) * PAGE, int(b - a) * PAGE)
            for a, b in zip(first.tolist(), ends.tolist(), strict=True)]


def _pagemap_entries(fd: int, pid: int, addr: int, size: int) -> np.ndarray:
    """The pagemap entries (one uint64 a page) of [addr, addr + size) from `fd`, process
    `pid`'s /proc pagemap."""
    raw = bytearray(size // PAGE * 8)
    view = memoryview(raw)
    got = 0
    while got < len(raw):
        n = os.preadv(fd, [view[got:]], (addr // PAGE) * 8 + got)
        if n <= 0:
            raise SnapshotError(f"short read of /proc/{pid}/pagemap")
        got += n
    return np.frombuffer(raw, dtype=np.uint64)


def _scan_present(fd: int, addr: int, size: int) -> list[tuple[int, int]]:
    regions = (ctypes.c_uint64 * (3 * _SCAN_REGIONS))()
    out: list[tuple[int, int]] = []
    start, end = addr, addr + size
    while start < end:
        # struct pm_scan_arg: size, flags, start, end, walk_end, vec, vec_len, max_pages,
        # category_inverted, category_mask, category_anyof_mask, return_mask
        arg = (ctypes.c_uint64 * 12)(96, 0, start, end, 0, ctypes.addressof(regions),
                                     _SCAN_REGIONS, 0, 0, _PAGE_IS_PRESENT, 0, _PAGE_IS_PRESENT)
        count = fcntl.ioctl(fd, _PAGEMAP_SCAN, arg, True)  # type: ignore[call-overload]
        for i in range(count):
            a, b = regions[3 * i], regions[3 * i + 1]
            if out and out[-1][0] + out[-1][1] == a - addr:
                out[-1] = (out[-1][0], out[-1][1] + b - a)
            else:
                out.append((a - addr, b - a))
        walked = arg[4]
        if walked <= start:
            break
        start = walked
    return out


def written_pages(pid: int, addr: int, size: int) -> np.ndarray:
    """Page numbers (ascending) of the pages written since the mapping was made."""
    fd = os.open(f"/proc/{pid}/pagemap", os.O_RDONLY | os.O_CLOEXEC)
    try:
        entries = _pagemap_entries(fd, pid, addr, size)
    finally:
        os.close(fd)
    present = (entries >> np.uint64(63)) & np.uint64(1)
    swapped = (entries >> np.uint64(62)) & np.uint64(1)
    file_page = (entries >> np.uint64(61)) & np.uint64(1)
    return np.flatnonzero((present & (file_page ^ np.uint64(1))) | swapped)


def written_page_runs(pid: int, addr: int, size: int) -> list[tuple[int, int]]:
    """(first page, page count) runs of pages written since the mapping was made."""
    pages = written_pages(pid, addr, size)
    starts, ends = _run_bounds(pages)
    return [(int(pages[a]), int(b - a)) for a, b in zip(starts.tolist(), ends.tolist(), strict=True)]


def _run_bounds(pages: np.ndarray, same: np.ndarray | None = None) -> tuple[np.ndarray, np.ndarray]:
    """[first, end) indexes (int64 arrays) of the runs of `pages` that are consecutive page
    numbers (with equal `same`, when given)."""
    if len(pages) == 0:
        return np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)
    step = np.diff(pages) != 1
    if same is not None:
        step |= same[1:] != same[:-1]
    breaks = np.flatnonzero(step) + 1
    return (np.concatenate(([0], breaks)).astype(np.int64),
            np.concatenate((breaks, [len(pages)])).astype(np.int64))


def _read_remote(pid: int, buf: bytearray | mmap.mmap, addrs: np.ndarray, lengths: np.ndarray) -> None:
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
    # Where the time went (ms): pagemap scan; busy time of reading QEMU's pages, of zero-page
    # detection and extents, of writing (threads, overlapped: sums, not wall time); the
    # pipeline's wall time; index, fsync and rename; total.
    phases_ms: dict[str, float] = field(default_factory=dict)


class _BufferPool:
    """Page-aligned read buffers kept between captures. Fresh anonymous memory costs a page
    fault per 4 KiB on first touch (much more on a VM host that returns free memory to its
    hypervisor), so the runtime keeps one set, PIPELINE_DEPTH * BATCH_BYTES (24 MiB), resident."""

    def __init__(self) -> None:
        self._free: list[list[mmap.mmap]] = []
        self._lock = threading.Lock()

    def take(self) -> list[mmap.mmap]:
        with self._lock:
            if self._free:
                return self._free.pop()
        return [mmap.mmap(-1, BATCH_BYTES) for _ in range(PIPELINE_DEPTH)]

    def give(self, buffers: list[mmap.mmap]) -> None:
        with self._lock:
            if len(self._free) < 1:  # concurrent captures beyond one allocate and free their own
                self._free.append(buffers)
                return
        for b in buffers:
            # A view kept by a failed capture's traceback blocks close(): GC closes it later.
            with contextlib.suppress(BufferError):
                b.close()


_buffers = _BufferPool()


@dataclass
class _Batch:
    """One batch read and classified: extents (bytes) for the index, data runs (byte ranges
    of the buffer) for the file."""

    offsets: np.ndarray
    lengths: np.ndarray
    zeroed: np.ndarray
    data_runs: list[tuple[int, int]]
    zero_pages: int


def capture_memory_layer(
    pid: int, addr: int, size: int, out: Path, *, parent_uuid: str | None = None,
    use_native: bool | None = None, keep_free: int | None = None,
) -> CaptureStats:
    """Write the pages QEMU pid wrote into its RAM mapping as a sealed layer at `out`, on
    the native core (`use_native`, by default when it is enabled) or in Python.

    `keep_free` (bytes; default AENV_DISK_RESERVE, 0: none) stays free on out's filesystem,
    which running sandboxes' disks write to: a capture whose written pages would not fit above
    it is refused before a byte is written, and one that finds it taken when it is done (by
    another writer meanwhile: the native pipeline cannot stop half-way) is removed. Either way
    a SnapshotError names the setting and nothing is left."""
    what = f"the memory layer {out}"
    if keep_free != 0:
        try:
            need = int(written_pages(pid, addr, size).size) * PAGE
            require_free_space(out.parent, need, what, reserve=keep_free)
        except InsufficientSpace as exc:
            raise SnapshotError(str(exc)) from None
        except OSError as exc:  # QEMU gone
            raise SnapshotError(f"cannot write memory layer {out}: {exc.strerror or exc}"
                                ) from exc
    if use_native if use_native is not None else native.enabled():
        stats = _capture_native(pid, addr, size, out, parent_uuid)
    else:
        stats = _capture_python(pid, addr, size, out, parent_uuid)
    if keep_free != 0:
        guard = SpaceGuard(out.parent, what, reserve=keep_free)
        guard.written = stats.layer_bytes
        try:
            guard.check()
        except InsufficientSpace as exc:
            out.unlink(missing_ok=True)
            raise SnapshotError(str(exc)) from None
    return stats


def _capture_native(pid: int, addr: int, size: int, out: Path, parent_uuid: str | None
                    ) -> CaptureStats:
    """The pipeline of `_capture_python` in one native call without the GIL; LayerBuilder
    then records the extents it returns (their data is already in place) and closes."""
    # optional: the extension exists only in a build with it (the caller chose this path)
    from agentenv.storage import _native

    t0 = time.perf_counter()
    buffers = _buffers.take()
    try:
        with LayerBuilder(out, size, parent_uuid=parent_uuid, direct=True) as builder:
            pos, direct_fd, buffered_fd = builder.data_target()
            pagemap = os.open(f"/proc/{pid}/pagemap", os.O_RDONLY | os.O_CLOEXEC)
            try:
                (offsets, lengths, zeroed, written, zero, data_bytes, direct_bytes, buffered_bytes,
                 (scan, read, classify, write)) = _native.capture_pages(
                    pid, addr, size, pagemap, buffers, BATCH_BYTES // PAGE, MIN_ZERO_PAGES, pos,
                    -1 if direct_fd is None else direct_fd, buffered_fd, WRITERS)
            finally:
                os.close(pagemap)
            t_pipeline = time.perf_counter()
            placed = builder.reserve_extents(np.frombuffer(offsets, dtype=np.int64),
                                             np.frombuffer(lengths, dtype=np.int64),
                                             np.frombuffer(zeroed, dtype=np.int64).astype(bool))
            if placed != (pos, data_bytes):
                raise SnapshotError(f"memory layer {out}: data written at {pos}+{data_bytes}, "
                                    f"the index places it at {placed[0]}+{placed[1]}")
            builder.direct_bytes += direct_bytes
            builder.buffered_bytes += buffered_bytes
        t_end = time.perf_counter()
    except OSError as exc:
        raise SnapshotError(f"cannot write memory layer {out}: {exc.strerror or exc}") from exc
    finally:
        _buffers.give(buffers)
    phases = {"pagemap": scan, "read": read, "classify": classify, "write": write,
              "pipeline": t_pipeline - t0 - scan, "close": t_end - t_pipeline,
              "total": t_end - t0}
    return CaptureStats(written, zero, out.stat().st_size,
                        {k: round(v * 1e3, 1) for k, v in phases.items()})


def _capture_python(pid: int, addr: int, size: int, out: Path, parent_uuid: str | None
                    ) -> CaptureStats:
    """The reference pipeline.

    A pipeline over batches of BATCH_BYTES in PIPELINE_DEPTH page-aligned buffers: a reader
    thread fills a buffer with process_vm_readv (one call per IOV_MAX runs) and classifies it
    (zero pages, extents; numpy); this thread appends the extents to the index in order
    (`LayerBuilder.reserve_extents`); WRITERS threads write each batch's data runs with pwritev
    straight from the buffer into the layer file with O_DIRECT (`LayerBuilder.write_data`).
    No per-page Python objects, one copy (QEMU -> buffer), no page cache to fill, reading
    and writing overlapped; the closing fsync then only commits metadata."""
    t0 = time.perf_counter()
    pages = written_pages(pid, addr, size)
    t_pagemap = time.perf_counter()
    per_batch = BATCH_BYTES // PAGE
    batches = [pages[i:i + per_batch] for i in range(0, len(pages), per_batch)]
    busy = {"read": 0.0, "classify": 0.0, "write": 0.0}
    busy_lock = threading.Lock()
    buffers = _buffers.take()
    reads: list[Future[_Batch]] = []
    writes: list[Future[None]] = []

    def read(k: int) -> _Batch:
        if k >= PIPELINE_DEPTH:
            writes[k - PIPELINE_DEPTH].result()  # that batch's buffer is ours once written
        t = time.perf_counter()
        batch = batches[k]
        buf = buffers[k % PIPELINE_DEPTH]
        first_idx, ends = _run_bounds(batch)
        _read_remote(pid, buf, np.uint64(addr) + batch[first_idx].astype(np.uint64) * np.uint64(PAGE),
                     (ends - first_idx).astype(np.uint64) * np.uint64(PAGE))
        t_read = time.perf_counter()
        n = len(batch)
        data = _with_short_zero_gaps(batch, _nonzero_pages(buf, n))
        first_idx, ends = _run_bounds(batch, data)
        is_data = data[first_idx]
        runs = list(zip((first_idx[is_data] * PAGE).tolist(), (ends[is_data] * PAGE).tolist(),
                        strict=True))
        result = _Batch(batch[first_idx] * PAGE, (ends - first_idx) * PAGE, ~is_data, runs,
                        n - int(np.count_nonzero(data)))
        with busy_lock:
            busy["read"] += t_read - t
            busy["classify"] += time.perf_counter() - t_read
        return result

    def write(k: int, b: _Batch, pos: int) -> None:
        t = time.perf_counter()
        with memoryview(buffers[k % PIPELINE_DEPTH]) as view:
            builder.write_data([view[lo:hi] for lo, hi in b.data_runs], pos)
        with busy_lock:
            busy["write"] += time.perf_counter() - t

    zero = 0
    try:
        with LayerBuilder(out, size, parent_uuid=parent_uuid, direct=True) as builder:
            reader = ThreadPoolExecutor(1, thread_name_prefix="memcapture-read")
            writer = ThreadPoolExecutor(WRITERS, thread_name_prefix="memcapture-write")
            try:
                reads.extend(reader.submit(read, k) for k in range(min(PIPELINE_DEPTH, len(batches))))
                for k in range(len(batches)):
                    b = reads[k].result()
                    zero += b.zero_pages
                    pos, _ = builder.reserve_extents(b.offsets, b.lengths, b.zeroed)
                    writes.append(writer.submit(write, k, b, pos))
                    if k + PIPELINE_DEPTH < len(batches):
                        reads.append(reader.submit(read, k + PIPELINE_DEPTH))
                for w in writes:
                    w.result()
            finally:
                # Nothing may touch the buffers or the file after this (failure paths too).
                reader.shutdown(wait=True, cancel_futures=True)
                writer.shutdown(wait=True, cancel_futures=True)
            t_close = time.perf_counter()
        t_end = time.perf_counter()
    except OSError as exc:
        raise SnapshotError(f"cannot write memory layer {out}: {exc.strerror or exc}") from exc
    finally:
        _buffers.give(buffers)
    phases = {"pagemap": t_pagemap - t0, **busy, "pipeline": t_close - t_pagemap,
              "close": t_end - t_close, "total": t_end - t0}
    return CaptureStats(len(pages), zero, out.stat().st_size,
                        {k: round(v * 1e3, 1) for k, v in phases.items()})


def _nonzero_pages(buf: mmap.mmap, n: int) -> np.ndarray:
    """Which of the first n pages of buf hold a non-zero byte. Most data pages have a non-zero
    first word, so only pages starting with 8 zero bytes are scanned whole."""
    words = np.frombuffer(buf, dtype=np.uint64, count=n * (PAGE // 8)).reshape(n, PAGE // 8)
    nonzero = words[:, 0] != 0
    maybe_zero = np.flatnonzero(~nonzero)
    for i in range(0, len(maybe_zero), 1024):  # bounded temporary copies
        part = maybe_zero[i:i + 1024]
        nonzero[part] = words[part].any(axis=1)
    return nonzero


def _with_short_zero_gaps(pages: np.ndarray, nonzero: np.ndarray) -> np.ndarray:
    """Which pages to store as data: the non-zero ones, and zero pages in stretches shorter
    than MIN_ZERO_PAGES between them. A zero page stored as data reads the same as a zeroed
    mapping; merging short gaps keeps the extent count (index size) down, since guests zero
    pages as they allocate them and so interleave zero and data pages."""
    first_idx, ends = _run_bounds(pages, nonzero)
    short_zero = ~nonzero[first_idx] & (ends - first_idx < MIN_ZERO_PAGES)
    return nonzero | np.repeat(short_zero, ends - first_idx)


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

    def wants_load_pages(self, key: str) -> bool:
        """No: a materialised file has no startup pack (runtime/memdev.py)."""
        return False

    def set_load_pages(self, key: str, snapshot_dir: Path, ranges: list[tuple[int, int]]) -> None:
        """Nothing to keep (see wants_load_pages)."""

    def after_restore(self, key: str, snapshot_dir: Path) -> None:
        """Nothing to record: a materialised file has no startup pack (runtime/memdev.py)."""

    def drop_orphans(self) -> None:
        """Nothing to drop: files of an earlier run are found again by `acquire`."""

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
