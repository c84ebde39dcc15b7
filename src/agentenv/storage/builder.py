"""Writing committed (compacted) layers: `LayerBuilder`, `commit_upper`, `commit_sealed`.

The output is exactly what C++ `compact()` writes (docs/overlaybd.md §4.4): header 0x07; data dense from
sector 8 in pieces of at most 64 sectors counted from each extent's start; zeroed extents
emitted with moffset = the next data sector; the index merged by `compress_raw_index` (sum
strictly below 16383) and padded with INVALID entries to a multiple of 256; trailer 0x06 right
after it. Optionally the LSMT stream goes through a ZFile writer (as `overlaybd-commit -z`,
header overwritten) and a tar wrapper (`-t`). Output is written to a temp file in the target
directory, fsynced and renamed, so a failure leaves no partial output.

Bulk path (`LayerBuilder.add_extents`, used by memory capture): many extents per call, the
index built with numpy, the data written with one `pwritev` per IOV_MAX buffers straight from
the caller's memory into the file, optionally with O_DIRECT (`direct=True`). Its layout is
still docs/overlaybd.md §4.4's (the bulk path itself: §4.6) (header 0x07, dense data from sector 8, sorted index padded to 256 entries,
trailer 0x06); only the split of long runs differs from `compact()`: a run of extents
contiguous in both the disk and the file becomes mappings of BULK_MAX_SECTORS (255 pieces of
64 sectors, page aligned) plus a remainder, as C++ compact would cut a single long extent.
"""

from __future__ import annotations

import ctypes
import errno
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from types import TracebackType
from typing import BinaryIO, Literal

import numpy as np

from agentenv.storage import tarwrap
from agentenv.storage.errors import LayerFormatError
from agentenv.storage.layer import open_layer
from agentenv.storage.lsmt import (
    FLAG_DATA,
    FLAG_HEADER,
    FLAG_SEALED,
    HT_SECTORS,
    INVALID_MAPPING_BYTES,
    MAX_LENGTH,
    MAX_OFFSET,
    SECTOR,
    ZEROED,
    HeaderTrailer,
    RawMapping,
    normalize_uuid,
    pack_mappings,
    valid_uuid,
)
from agentenv.storage.upper import Upper, fsync_dir
from agentenv.storage.zfile import ZFileWriter

PIECE_SECTORS = 64  # C++ pcopy copies in 32 KiB pieces
INDEX_PAD_ENTRIES = 256
COPY_CHUNK = 4 << 20  # a multiple of 64 sectors, so piece boundaries are unchanged
# Longest mapping the bulk path emits: 255 pieces of 64 sectors, the longest data mapping C++
# compact produces (its merge stops below 16383), and a multiple of 8 sectors (4 KiB pages).
BULK_MAX_SECTORS = 255 * PIECE_SECTORS
IOV_MAX = 1024

_libc = ctypes.CDLL(None, use_errno=True)
_libc.sync_file_range.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
_libc.sync_file_range.restype = ctypes.c_int
_SYNC_FILE_RANGE_WRITE = 2

Compression = Literal["zstd", "lz4"]
Progress = Callable[[int], None]


class LayerBuilder:
    """Build a committed read-only layer from extents given in increasing offset order.

    `add(offset, data)` adds data at a byte offset, `add_zero(offset, length)` a zeroed
    mapping; both must be sector aligned and must not go backwards. `close()` writes index
    and trailer, finishes ZFile/tar wrapping, fsyncs and renames the temp file to `path`,
    returning `path`. `abort()` (or leaving a `with` block by an exception) removes the temp
    file. `uuid`/`parent_uuid` follow C++ CommitArgs: invalid or missing => null UUID string.

    Bulk path: `add_extents(offsets, lengths, zeroed, buffers)` adds many extents per call
    (numpy index, pwritev of the caller's buffers), or split in two for pipelines:
    `reserve_extents` (in order, returns where the data goes) and `write_data` (any thread,
    any order). `direct=True` writes that data with O_DIRECT when the file system allows it.
    """

    def __init__(self, path: Path, virtual_size: int, *, uuid: str | None = None,
                 parent_uuid: str | None = None, compress: Compression | None = None,
                 tar: bool = False, user_tag: bytes = b"", block_size: int = 4096,
                 zfile_compressor: Callable[[bytes | memoryview], bytes] | None = None,
                 direct: bool = False) -> None:
        self.path = Path(path)
        self.virtual_size = virtual_size
        self.tar = tar
        self.tmp = self.path.parent / f".{self.path.name}.tmp-{os.getpid()}-{id(self):x}"
        self.file: BinaryIO = open(self.tmp, "w+b", buffering=1 << 20)  # noqa: SIM115
        self._closed = False
        # Bulk data goes through this descriptor: O_DIRECT when asked for and the file system
        # supports it (no page cache to fill: on a host whose free memory is handed back to
        # its hypervisor, first-touch page-cache pages cost more than the disk write), else
        # the buffered file's own descriptor with writeback started after each call.
        self._bulk_fd: int | None = None
        self._bulk_used = False
        # Bytes write_data wrote with O_DIRECT / through the page cache (stats, tests).
        self.direct_bytes = 0
        self.buffered_bytes = 0
        self._count_lock = threading.Lock()
        # Index pieces from add_extents (int64 rows: offset, length, moffset, zeroed), in
        # order; `mappings` (the per-extent path) is moved here before each bulk call.
        self._segments: list[np.ndarray] = []
        try:
            if direct and not tar and compress is None:
                try:
                    self._bulk_fd = os.open(self.tmp, os.O_WRONLY | os.O_DIRECT | os.O_CLOEXEC)
                except OSError as exc:
                    if exc.errno != errno.EINVAL:  # EINVAL: the file system has no O_DIRECT
                        raise
            if tar:
                self.file.write(bytes(tarwrap.PAYLOAD_OFFSET_PAX))
            self.zwriter: ZFileWriter | None = None
            if compress is not None:
                self.zwriter = ZFileWriter(self.file, compress, block_size=block_size,
                                           compressor=zfile_compressor)
            self.sink = self.zwriter if self.zwriter is not None else self.file
            self.header = HeaderTrailer(
                flags=FLAG_HEADER | FLAG_DATA | FLAG_SEALED, virtual_size=virtual_size,
                uuid=normalize_uuid(uuid), parent_uuid=normalize_uuid(parent_uuid),
                user_tag=user_tag)
            self.sink.write(self.header.pack())
        except BaseException:
            self.abort()
            raise
        self.dest = HT_SECTORS  # next physical sector
        self.next_offset = 0  # sectors; extents must not go backwards
        # Accumulated (merged) mappings as tuples (offset, length, moffset, zeroed, tag).
        self.mappings: list[tuple[int, int, int, bool, int]] = []

    # -- emitting mappings with on-the-fly compress_raw_index -------------------------------

    def _emit(self, off: int, length: int, moff: int, zeroed: bool) -> None:
        maps = self.mappings
        if maps:
            a_off, a_len, a_moff, a_z, _a_tag = maps[-1]
            a_mend = a_moff if a_z else a_moff + a_len
            if (a_off + a_len == off and a_mend == moff and a_z == zeroed
                    and a_len + length < MAX_LENGTH):
                maps[-1] = (a_off, a_len + length, a_moff, a_z, 0)
                return
        maps.append((off, length, moff, zeroed, 0))

    def _check(self, offset: int, length: int) -> tuple[int, int]:
        if self._closed:
            raise ValueError("layer builder is closed")
        if offset % SECTOR or length % SECTOR:
            raise ValueError(f"extent ({offset}, {length}) is not sector aligned")
        sec, n = offset // SECTOR, length // SECTOR
        if sec < self.next_offset:
            raise ValueError(f"extent at byte {offset} goes backwards (next allowed byte "
                             f"{self.next_offset * SECTOR})")
        if sec + n > MAX_OFFSET:
            raise ValueError(f"extent at byte {offset} is beyond the largest LSMT offset")
        return sec, n

    def add(self, offset: int, data: bytes | bytearray | memoryview) -> None:
        """Add data at byte `offset` (sector aligned, length a multiple of 512)."""
        sec, n = self._check(offset, len(data))
        if n == 0:
            return
        if self._bulk_used:  # bulk writes are positional: put the file position after them
            self.file.seek(self.dest * SECTOR)
        self.sink.write(data)
        done = 0
        while done < n:
            plen = min(PIECE_SECTORS, n - done)
            self._emit(sec + done, plen, self.dest, False)
            self.dest += plen
            done += plen
        self.next_offset = sec + n

    def add_zero(self, offset: int, length: int) -> None:
        """Add a zeroed mapping (reads as zeros, no data) over [offset, offset+length)."""
        sec, n = self._check(offset, length)
        while n > 0:
            chunk = min(n, MAX_LENGTH)
            self._emit(sec, chunk, self.dest, True)
            sec += chunk
            n -= chunk
        self.next_offset = sec

    def _add_zero_raw(self, sec: int, n: int) -> None:
        """Emit one zeroed source mapping unchanged (compaction of an existing index)."""
        self._emit(sec, n, self.dest, True)
        self.next_offset = sec + n

    # -- bulk path --------------------------------------------------------------------------

    def add_extents(self, offsets: np.ndarray, lengths: np.ndarray, zeroed: np.ndarray,
                    data: Sequence[bytes | bytearray | memoryview]) -> None:
        """Add many extents at once: byte `offsets`/`lengths` (sector aligned, ascending,
        non-overlapping, not before earlier extents) and whether each is a `zeroed` mapping.
        `data` holds the bytes of the data extents in order, split into any buffers (e.g. one
        per extent); they are written at the file's data end with pwritev, without copies.
        With `direct=True` buffers should be 4 KiB aligned in address and length (a
        misaligned call falls back to the buffered descriptor). Not with ZFile or tar."""
        expected = int(np.sum(np.where(np.asarray(zeroed, dtype=bool), 0,
                                       np.asarray(lengths, dtype=np.int64))))
        given = sum(memoryview(b).nbytes for b in data)
        if given != expected:
            raise ValueError(f"data buffers hold {given} bytes, the data extents {expected}")
        pos, _total = self.reserve_extents(offsets, lengths, zeroed)
        self.write_data(data, pos)

    def reserve_extents(self, offsets: np.ndarray, lengths: np.ndarray,
                        zeroed: np.ndarray) -> tuple[int, int]:
        """The index half of add_extents: record the extents, return (file byte position,
        byte count) where their data goes. The caller then writes exactly those bytes with
        `write_data` (from any thread, in any order, before close()); until it has, the
        builder must not be closed."""
        if self._closed:
            raise ValueError("layer builder is closed")
        if self.sink is not self.file or self.tar:
            raise ValueError("add_extents writes raw data; not with compression or tar")
        off = np.asarray(offsets, dtype=np.int64)
        length = np.asarray(lengths, dtype=np.int64)
        zero = np.asarray(zeroed, dtype=bool)
        if not (off.ndim == length.ndim == zero.ndim == 1 and len(off) == len(length) == len(zero)):
            raise ValueError("offsets, lengths and zeroed must be 1-D arrays of one length")
        if len(off) == 0:
            return self.dest * SECTOR, 0
        if np.any(off % SECTOR) or np.any(length % SECTOR) or np.any(length <= 0):
            bad = int(np.flatnonzero((off % SECTOR) | (length % SECTOR) | (length <= 0))[0])
            raise ValueError(f"extent ({int(off[bad])}, {int(length[bad])}) is not sector "
                             "aligned or is empty")
        sec, n = off // SECTOR, length // SECTOR
        if sec[0] < self.next_offset or np.any(sec[1:] < sec[:-1] + n[:-1]):
            raise ValueError("extents overlap or go backwards (next allowed byte "
                             f"{self.next_offset * SECTOR})")
        if int(sec[-1] + n[-1]) > MAX_OFFSET:
            raise ValueError("extents reach beyond the largest LSMT offset")
        data_sectors = np.where(zero, 0, n)
        # Physical sector of each extent: data packed densely from dest; a zeroed mapping
        # points at the next data sector, as compact() emits it.
        moff = self.dest + np.cumsum(data_sectors) - data_sectors
        self._flush_mappings()
        if self._segments and len(self._segments[-1]):
            # A run continuing the previous call's last mapping is cut as one run: callers
            # that batch (memory capture) get the same index as one big call would give.
            last = self._segments[-1][-1]
            l_off, l_len, l_moff, l_zero = (int(x) for x in last)
            l_mend = l_moff if l_zero else l_moff + l_len
            if l_off + l_len == sec[0] and bool(l_zero) == bool(zero[0]) and l_mend == moff[0]:
                self._segments[-1] = self._segments[-1][:-1]
                sec = np.concatenate(([l_off], sec))
                n = np.concatenate(([l_len], n))
                moff = np.concatenate(([l_moff], moff))
                zero = np.concatenate(([bool(l_zero)], zero))
        self._segments.append(_split_runs(sec, n, moff, zero))
        self.file.flush()  # buffered bytes (the header, add() data) reach the file first
        self._bulk_used = True
        pos = self.dest * SECTOR
        total = int(data_sectors.sum())
        self.dest += total
        self.next_offset = int(sec[-1] + n[-1])
        return pos, total * SECTOR

    def write_data(self, data: Sequence[bytes | bytearray | memoryview], pos: int) -> None:
        """Write the concatenation of `data` at file byte `pos` (a range reserve_extents
        returned). Thread safe: positional pwritev, O_DIRECT when the builder has it."""
        views = [memoryview(b).cast("B") for b in data]
        views = [v for v in views if v.nbytes]
        if not views:
            return
        nbytes = sum(v.nbytes for v in views)
        fd = self._bulk_fd
        if fd is not None:
            try:
                _pwrite_all(fd, list(views), pos)  # a copy: short writes trim the list
                with self._count_lock:
                    self.direct_bytes += nbytes
                return
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                # Misaligned buffers, or a file system refusing this O_DIRECT write: this
                # call goes through the page cache instead (the bytes written so far are
                # simply written again).
        fd = self.file.fileno()
        _pwrite_all(fd, views, pos)
        _libc.sync_file_range(fd, 0, 0, _SYNC_FILE_RANGE_WRITE)  # start writeback, no wait
        with self._count_lock:
            self.buffered_bytes += nbytes

    def data_target(self) -> tuple[int, int | None, int]:
        """(file byte position of the next data, the O_DIRECT descriptor or None, the
        buffered descriptor), for a writer that puts extents' data there itself (the native
        memory capture) and then records those extents with reserve_extents, which lays
        their data out densely from that same position. Buffered bytes are flushed first."""
        if self._closed:
            raise ValueError("layer builder is closed")
        if self.sink is not self.file or self.tar:
            raise ValueError("data_target writes raw data; not with compression or tar")
        self.file.flush()
        return self.dest * SECTOR, self._bulk_fd, self.file.fileno()

    @property
    def direct(self) -> bool:
        """Whether bulk data can go out with O_DIRECT (asked for, and the file system has it)."""
        return self._bulk_fd is not None

    def _flush_mappings(self) -> None:
        if self.mappings:
            self._segments.append(np.array(
                [(o, n, m, int(z)) for o, n, m, z, _tag in self.mappings], dtype=np.int64))
            self.mappings = []

    # -- finishing --------------------------------------------------------------------------

    def close(self) -> Path:
        if self._closed:
            raise ValueError("layer builder is closed")
        try:
            index_offset = self.dest * SECTOR
            if self._segments:
                self._flush_mappings()
                index = _pack_rows(np.concatenate(self._segments), INDEX_PAD_ENTRIES)
            else:
                maps = [RawMapping(*m) for m in self.mappings]
                index = pack_mappings(maps, INDEX_PAD_ENTRIES)
            if self._bulk_used:
                self.file.seek(index_offset)
            trailer = self.header.with_(flags=FLAG_DATA | FLAG_SEALED, index_offset=index_offset,
                                        index_size=len(index) // 16)
            self.sink.write(index)
            self.sink.write(trailer.pack())
            if self.zwriter is not None:
                payload = self.zwriter.close()
            else:
                payload = index_offset + len(index) + len(trailer.pack())
            if self.tar:
                self.file.write(tarwrap.tar_suffix(payload))
                self.file.seek(0)
                self.file.write(tarwrap.tar_prefix(payload))
            self.file.flush()
            # One fsync covers the inode: page-cache data, O_DIRECT data, allocation metadata.
            os.fsync(self.file.fileno())
            self._close_bulk_fd()
            self.file.close()
            os.replace(self.tmp, self.path)
            fsync_dir(self.path.parent)
        except BaseException:
            self.abort()
            raise
        self._closed = True
        return self.path

    def abort(self) -> None:
        """Drop everything written so far; the target path is left untouched."""
        self._closed = True
        try:
            self._close_bulk_fd()
            self.file.close()
        finally:
            self.tmp.unlink(missing_ok=True)

    def _close_bulk_fd(self) -> None:
        if self._bulk_fd is not None:
            fd, self._bulk_fd = self._bulk_fd, None
            os.close(fd)

    def __enter__(self) -> LayerBuilder:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is not None:
            if not self._closed:
                self.abort()
        elif not self._closed:
            self.close()


def _split_runs(sec: np.ndarray, n: np.ndarray, moff: np.ndarray, zero: np.ndarray) -> np.ndarray:
    """Index rows (offset, length, moffset, zeroed) for extents in sectors: extents that
    continue each other on the disk and in the file (same kind) are joined, then cut into
    mappings of at most BULK_MAX_SECTORS."""
    mend = np.where(zero, moff, moff + n)
    brk = np.ones(len(sec), dtype=bool)
    brk[1:] = (sec[1:] != sec[:-1] + n[:-1]) | (zero[1:] != zero[:-1]) | (moff[1:] != mend[:-1])
    first = np.flatnonzero(brk)
    run_len = np.add.reduceat(n, first)
    pieces = -(-run_len // BULK_MAX_SECTORS)
    run = np.repeat(np.arange(len(first)), pieces)
    k = np.arange(len(run)) - np.repeat(np.cumsum(pieces) - pieces, pieces)
    done = k * BULK_MAX_SECTORS
    rows = np.empty((len(run), 4), dtype=np.int64)
    rows[:, 0] = sec[first][run] + done
    rows[:, 1] = np.minimum(BULK_MAX_SECTORS, run_len[run] - done)
    run_zero = zero[first][run]
    rows[:, 2] = moff[first][run] + np.where(run_zero, 0, done)
    rows[:, 3] = run_zero
    return rows


def _pack_rows(rows: np.ndarray, pad_to: int) -> bytes:
    """On-disk mappings (tag 0) for index rows, padded with INVALID entries (docs/overlaybd.md §3)."""
    words = np.empty((len(rows), 2), dtype="<u8")
    r = rows.astype(np.uint64)
    words[:, 0] = r[:, 0] | (r[:, 1] << np.uint64(50))
    words[:, 1] = r[:, 2] | (r[:, 3] << np.uint64(55))
    pad = (-len(rows)) % pad_to
    return words.tobytes() + INVALID_MAPPING_BYTES * pad


def _pwrite_all(fd: int, views: list[memoryview], pos: int) -> None:
    """Write the concatenation of `views` at `pos`: pwritev of up to IOV_MAX buffers at a
    time, resuming after short writes."""
    i = 0
    while i < len(views):
        part = views[i:i + IOV_MAX]
        want = sum(v.nbytes for v in part)
        got = os.pwritev(fd, part, pos)
        pos += got
        if got == want:
            i += len(part)
            continue
        if got <= 0:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        # Short write: skip what was written, continue with the rest of the part.
        for j, v in enumerate(part):
            if got < v.nbytes:
                views[i + j] = v[got:]
                i += j
                break
            got -= v.nbytes


def _compact(builder: LayerBuilder, entries: list[tuple[int, int, int, int]],
             read: Callable[[int, int], bytes], source: str, progress: Progress | None) -> Path:
    """Run C++ compact over (offset, length, moffset, layer) sector entries in logical order."""
    with builder:
        for off, n, mo, lay in entries:
            if lay == ZEROED:
                builder._add_zero_raw(off, n)
                continue
            done = 0
            while done < n:
                chunk = min(n - done, COPY_CHUNK // SECTOR)
                data = read((mo + done) * SECTOR, chunk * SECTOR)
                if len(data) != chunk * SECTOR:
                    raise LayerFormatError(source, (mo + done) * SECTOR,
                                           f"short read of mapped data ({len(data)} of "
                                           f"{chunk * SECTOR} bytes)")
                builder.add((off + done) * SECTOR, data)
                done += chunk
                if progress:
                    progress(len(data))
        return builder.close()


def commit_upper(upper_dir: Path, out: Path, *, compress: Compression | None = None,
                 tar: bool = False, uuid: str | None = None, parent_uuid: str | None = None,
                 user_tag: bytes = b"", progress: Progress | None = None,
                 zfile_compressor: Callable[[bytes | memoryview], bytes] | None = None) -> Path:
    """`overlaybd-commit [-z] [-t] data index out`: compact a writable upper into a new layer.

    vsize comes from the upper's header; parent defaults to the upper's own parent_uuid."""
    upper = Upper.open(upper_dir, writable=False)
    try:
        parent = parent_uuid if valid_uuid(parent_uuid) else upper.data_header.parent_uuid
        builder = LayerBuilder(out, upper.virtual_size, uuid=uuid, parent_uuid=parent,
                               compress=compress, tar=tar, user_tag=user_tag,
                               zfile_compressor=zfile_compressor)
        fd = upper.data_fd

        def read(pos: int, length: int) -> bytes:
            return os.pread(fd, length, pos)

        return _compact(builder, upper.index.entries(), read, str(upper.data_path), progress)
    finally:
        upper.close()


def commit_sealed(layer_path: Path, out: Path, *, compress: Compression | None = None,
                  tar: bool = False, uuid: str | None = None, parent_uuid: str | None = None,
                  user_tag: bytes = b"", progress: Progress | None = None,
                 zfile_compressor: Callable[[bytes | memoryview], bytes] | None = None) -> Path:
    """`overlaybd-commit --commit_sealed`: re-compact a sealed (or committed) layer.

    `zfile_compressor` (both commit functions) replaces the block compressor; tests use it to
    replay LZ4 1.8.3 blocks."""
    layer = open_layer(layer_path)
    try:
        parent = parent_uuid if valid_uuid(parent_uuid) else layer.header.parent_uuid
        builder = LayerBuilder(out, layer.header.virtual_size, uuid=uuid, parent_uuid=parent,
                               compress=compress, tar=tar, user_tag=user_tag,
                               zfile_compressor=zfile_compressor)
        source = layer.source

        def read(pos: int, length: int) -> bytes:
            return source.pread(length, pos)

        return _compact(builder, layer.index.entries(), read, str(layer_path), progress)
    finally:
        layer.close()
