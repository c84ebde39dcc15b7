"""Writing committed (compacted) layers: `LayerBuilder`, `commit_upper`, `commit_sealed`.

The output is exactly what C++ `compact()` writes (spec 4.4): header 0x07; data dense from
sector 8 in pieces of at most 64 sectors counted from each extent's start; zeroed extents
emitted with moffset = the next data sector; the index merged by `compress_raw_index` (sum
strictly below 16383) and padded with INVALID entries to a multiple of 256; trailer 0x06 right
after it. Optionally the LSMT stream goes through a ZFile writer (as `overlaybd-commit -z`,
header overwritten) and a tar wrapper (`-t`). Output is written to a temp file in the target
directory, fsynced and renamed, so a failure leaves no partial output.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from types import TracebackType
from typing import BinaryIO, Literal

from agentenv.storage import tarwrap
from agentenv.storage.errors import LayerFormatError
from agentenv.storage.layer import open_layer
from agentenv.storage.lsmt import (
    FLAG_DATA,
    FLAG_HEADER,
    FLAG_SEALED,
    HT_SECTORS,
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

Compression = Literal["zstd", "lz4"]
Progress = Callable[[int], None]


class LayerBuilder:
    """Build a committed read-only layer from extents given in increasing offset order.

    `add(offset, data)` adds data at a byte offset, `add_zero(offset, length)` a zeroed
    mapping; both must be sector aligned and must not go backwards. `close()` writes index
    and trailer, finishes ZFile/tar wrapping, fsyncs and renames the temp file to `path`,
    returning `path`. `abort()` (or leaving a `with` block by an exception) removes the temp
    file. `uuid`/`parent_uuid` follow C++ CommitArgs: invalid or missing => null UUID string.
    """

    def __init__(self, path: Path, virtual_size: int, *, uuid: str | None = None,
                 parent_uuid: str | None = None, compress: Compression | None = None,
                 tar: bool = False, user_tag: bytes = b"", block_size: int = 4096,
                 zfile_compressor: Callable[[bytes | memoryview], bytes] | None = None) -> None:
        self.path = Path(path)
        self.virtual_size = virtual_size
        self.tar = tar
        self.tmp = self.path.parent / f".{self.path.name}.tmp-{os.getpid()}-{id(self):x}"
        self.file: BinaryIO = open(self.tmp, "w+b", buffering=1 << 20)  # noqa: SIM115
        self._closed = False
        try:
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

    # -- finishing --------------------------------------------------------------------------

    def close(self) -> Path:
        if self._closed:
            raise ValueError("layer builder is closed")
        try:
            index_offset = self.dest * SECTOR
            maps = [RawMapping(*m) for m in self.mappings]
            index = pack_mappings(maps, INDEX_PAD_ENTRIES)
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
            os.fsync(self.file.fileno())
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
            self.file.close()
        finally:
            self.tmp.unlink(missing_ok=True)

    def __enter__(self) -> LayerBuilder:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if exc_type is not None:
            if not self._closed:
                self.abort()
        elif not self._closed:
            self.close()


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
