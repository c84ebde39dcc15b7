"""Raw disk export and import.

`export_raw` writes the virtual disk as a sparse raw file: only mapped data is written (holes
and zeroed mappings are skipped by position, never written as zeros), then the file is
truncated to the virtual size. `import_raw` turns a raw disk into a committed layer, finding
data with SEEK_DATA/SEEK_HOLE and skipping all-zero 4 KiB blocks. Both write a temp file and
rename it, so a failure leaves no output.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np

from agentenv.storage.builder import Compression, LayerBuilder
from agentenv.storage.errors import StorageError
from agentenv.storage.image import Image
from agentenv.storage.lsmt import NULL_UUID, SECTOR
from agentenv.storage.upper import fsync_dir, pwrite_all

CHUNK = 4 << 20
ZERO_BLOCK = 4096
Progress = Callable[[int], None]


def export_raw(image: Image, out: Path, progress: Progress | None = None) -> None:
    """Write `image`'s virtual disk to `out` as a sparse raw file (atomically)."""
    out = Path(out)
    tmp = out.parent / f".{out.name}.tmp-{os.getpid()}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o644)
    try:
        buf = bytearray(CHUNK)
        mv = memoryview(buf)
        for off, length, has_data in image.extents():
            if not has_data:
                continue
            pos, end = off, off + length
            while pos < end:
                n = min(CHUNK, end - pos)
                image.readinto(pos, mv[:n])
                pwrite_all(fd, mv[:n], pos)
                pos += n
                if progress:
                    progress(n)
        os.ftruncate(fd, image.virtual_size)
        os.fsync(fd)
        os.close(fd)
        fd = -1
        os.replace(tmp, out)
        fsync_dir(out.parent)
    except BaseException:
        if fd >= 0:
            os.close(fd)
        tmp.unlink(missing_ok=True)
        raise


def _data_ranges(fd: int, size: int) -> Iterator[tuple[int, int]]:
    """(start, end) ranges holding data per SEEK_DATA/SEEK_HOLE (whole file if unsupported)."""
    pos = 0
    while pos < size:
        try:
            start = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError as exc:
            if exc.errno == 6:  # ENXIO: no data after pos
                return
            yield pos, size  # filesystem without SEEK_DATA
            return
        end = os.lseek(fd, start, os.SEEK_HOLE)
        yield start, min(end, size)
        pos = end


def import_raw(raw: Path, out: Path, *, compress: Compression | None = None, tar: bool = False,
               uuid: str | None = None, parent_uuid: str | None = None,
               progress: Progress | None = None) -> Path:
    """Make a committed layer from raw disk `raw` (virtual size = file size, rounded up to a
    sector); all-zero 4 KiB blocks and holes become holes."""
    raw = Path(raw)
    fd = os.open(raw, os.O_RDONLY | os.O_CLOEXEC)
    try:
        size = os.fstat(fd).st_size
        if size == 0:
            raise StorageError(f"{raw}: empty raw image")
        vsize = -(-size // SECTOR) * SECTOR
        with LayerBuilder(out, vsize, uuid=uuid, parent_uuid=parent_uuid or NULL_UUID,
                          compress=compress, tar=tar) as builder:
            for start, end in _data_ranges(fd, size):
                # Align to ZERO_BLOCK so block tests line up with the disk's blocks.
                pos = start - start % ZERO_BLOCK
                while pos < end:
                    n = min(CHUNK, end - pos)
                    data = os.pread(fd, n, pos)
                    if len(data) % SECTOR:
                        data += bytes(SECTOR - len(data) % SECTOR)
                    _add_nonzero(builder, pos, data)
                    pos += n
                    if progress:
                        progress(n)
            return builder.close()
    finally:
        os.close(fd)


def _add_nonzero(builder: LayerBuilder, pos: int, data: bytes) -> None:
    """Add runs of non-zero 4 KiB blocks (the tail block may be shorter)."""
    full = len(data) - len(data) % ZERO_BLOCK
    nonzero = np.frombuffer(data, dtype=np.uint64, count=full // 8).reshape(-1, ZERO_BLOCK // 8)
    flags = nonzero.any(axis=1).tolist()
    if full < len(data):
        flags.append(any(data[full:]))
    mv = memoryview(data)
    i = 0
    nblocks = len(flags)
    while i < nblocks:
        if not flags[i]:
            i += 1
            continue
        j = i
        while j < nblocks and flags[j]:
            j += 1
        a, b = i * ZERO_BLOCK, min(j * ZERO_BLOCK, len(data))
        builder.add(pos + a, mv[a:b])
        i = j
