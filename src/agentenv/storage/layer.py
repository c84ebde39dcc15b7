"""Opening sealed read-only layers through their wrappers, and `inspect_layer`.

A lower is read through up to three wrappers (docs/overlaybd.md §1): optional tar, optional ZFile, then the
sealed LSMT file (header | data | index | trailer). `SealedLayer` exposes the unwrapped stream
through either a plain fd plus a base offset (fast path: one pread per piece) or a ZFileReader.
"""

from __future__ import annotations

import contextlib
import mmap
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from agentenv.storage import tarwrap, zfile
from agentenv.storage.errors import LayerFormatError
from agentenv.storage.lsmt import (
    FLAG_DATA,
    FLAG_HEADER,
    FLAG_SEALED,
    HT_BLOCK,
    HT_SECTORS,
    MAX_RO_ENTRIES,
    SECTOR,
    ZEROED,
    FlatIndex,
    HeaderTrailer,
    check_sorted,
    decode_mappings,
)


@dataclass
class StreamSource:
    """Where the unwrapped LSMT stream of a layer lives."""

    path: str
    fd: int
    base: int  # byte offset of the stream in the file (1536 for a pax-tar-wrapped layer)
    size: int  # unwrapped stream size
    zreader: zfile.ZFileReader | None = None
    tar: tarwrap.TarEntry | None = None

    def pread(self, length: int, pos: int) -> bytes:
        if self.zreader is not None:
            return self.zreader.pread(length, pos)
        length = max(0, min(length, self.size - pos))
        return os.pread(self.fd, length, self.base + pos)

    def readinto(self, pos: int, buf: memoryview) -> int:
        if self.zreader is not None:
            return self.zreader.readinto(pos, buf)
        n = max(0, min(len(buf), self.size - pos))
        return os.preadv(self.fd, [buf[:n]], self.base + pos) if n else 0


def open_stream(path: Path, fd: int) -> StreamSource:
    """Detect tar and ZFile wrappers on an open layer file (docs/overlaybd.md §1)."""
    file_size = os.fstat(fd).st_size
    entry = tarwrap.read_tar_entry(fd, path, file_size)
    base, size = (entry.payload_offset, entry.payload_size) if entry else (0, file_size)
    head = os.pread(fd, zfile.ZF_BLOCK, base)
    if zfile.is_zfile(head):
        reader = zfile.ZFileReader(path, fd, base, size)
        return StreamSource(str(path), fd, base, reader.size, reader, entry)
    return StreamSource(str(path), fd, base, size, None, entry)


@dataclass
class SealedLayer:
    """A sealed LSMT layer opened read-only; `index` is in sectors, layer slot 0."""

    path: Path
    source: StreamSource
    header: HeaderTrailer
    trailer: HeaderTrailer
    index: FlatIndex
    raw_index_size: int
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def virtual_size(self) -> int:
        return self.trailer.virtual_size

    @property
    def uuid(self) -> str:
        return self.trailer.uuid

    @property
    def parent_uuid(self) -> str:
        return self.trailer.parent_uuid

    def mapping(self) -> mmap.mmap | None:
        """A read-only mmap of the whole file for plain (non-ZFile) layers, made once; the
        hot read path slices it instead of issuing a syscall. Layers are immutable, so the
        mapping never goes stale."""
        if self.source.zreader is not None or self.source.fd < 0:
            return None
        mm = self.extra.get("mmap")
        if mm is None:
            mm = mmap.mmap(self.source.fd, 0, prot=mmap.PROT_READ)
            self.extra["mmap"] = mm
        return mm

    def mapping_view(self) -> memoryview | None:
        """A memoryview of `mapping()`, made once: slicing it gives zero-copy pieces
        (Image.read_pieces) where slicing the mmap itself would copy into bytes."""
        view = self.extra.get("mmap_view")
        if view is None:
            mm = self.mapping()
            if mm is None:
                return None
            view = self.extra["mmap_view"] = memoryview(mm)
        return view

    def close(self) -> None:
        view = self.extra.pop("mmap_view", None)
        if view is not None:
            view.release()
        _close_mapping(self.extra.pop("mmap", None))
        if self.source.fd >= 0:
            os.close(self.source.fd)
            self.source.fd = -1


def _close_mapping(mm: mmap.mmap | None) -> None:
    """Unmap now, unless slices of it are still out (pieces of a read waiting on a socket):
    then the mapping goes when the last of them is released."""
    if mm is not None:
        with contextlib.suppress(BufferError):
            mm.close()


def load_sealed(path: Path, source: StreamSource) -> SealedLayer:
    """Parse and validate header, trailer and index (docs/overlaybd.md §4.5)."""
    size = source.size
    if size < 2 * HT_BLOCK:
        raise LayerFormatError(path, source.base, f"truncated LSMT layer: {size} bytes")
    header = HeaderTrailer.unpack(source.pread(HT_BLOCK, 0), path, source.base)
    if not header.is_header:
        raise LayerFormatError(path, source.base, "LSMT header block lacks the header flag")
    toff = size - HT_BLOCK
    tblock = source.pread(HT_BLOCK, toff)
    try:
        trailer = HeaderTrailer.unpack(tblock, path, toff)
    except LayerFormatError as exc:
        raise LayerFormatError(path, toff, f"no LSMT trailer (truncated or not sealed): "
                                           f"{exc.problem}") from exc
    need = FLAG_DATA | FLAG_SEALED
    if trailer.flags & FLAG_HEADER or trailer.flags & need != need:
        raise LayerFormatError(path, toff, f"bad LSMT trailer flags {trailer.flags:#x}")
    if trailer.index_size > MAX_RO_ENTRIES:
        raise LayerFormatError(path, toff + 40,
                               f"index of {trailer.index_size} entries exceeds {MAX_RO_ENTRIES}")
    ioff = trailer.index_offset
    if ioff < HT_BLOCK or ioff % SECTOR or ioff + 16 * trailer.index_size > toff:
        raise LayerFormatError(
            path, toff + 32,
            f"index ({trailer.index_size} entries at {ioff}) points past the trailer at {toff}")
    raw = source.pread(16 * trailer.index_size, ioff)
    if len(raw) != 16 * trailer.index_size:
        raise LayerFormatError(path, ioff, "truncated LSMT index")
    offsets, lengths, moffsets, zeroed, _tags = decode_mappings(raw)
    check_sorted(offsets, lengths, path, ioff)
    data_end = ioff // SECTOR
    layers: list[int] = []
    for i, (ln, mo, z) in enumerate(zip(lengths, moffsets, zeroed, strict=True)):
        ok = HT_SECTORS <= mo <= data_end if z else mo >= HT_SECTORS and mo + ln <= data_end
        if not ok:
            raise LayerFormatError(
                path, ioff + 16 * i,
                f"index entry {i} maps sectors [{mo}, {mo + ln}) outside the data area "
                f"[{HT_SECTORS}, {data_end})")
        layers.append(ZEROED if z else 0)
    ends = [o + n for o, n in zip(offsets, lengths, strict=True)]
    index = FlatIndex(offsets, ends, moffsets, layers)
    return SealedLayer(path, source, header, trailer, index, trailer.index_size)


def open_layer(path: Path) -> SealedLayer:
    """Open a lower layer file or blob: tar-wrapped, ZFile or plain sealed LSMT."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError as exc:
        raise LayerFormatError(path, None, "layer file does not exist") from exc
    try:
        return load_sealed(path, open_stream(path, fd))
    except BaseException:
        os.close(fd)
        raise


def _lsmt_facts(header: HeaderTrailer, trailer: HeaderTrailer | None, entries: int,
                data_size: int) -> dict[str, Any]:
    info = trailer or header
    return {
        "uuid": info.uuid,
        "parent_uuid": info.parent_uuid,
        "virtual_size": info.virtual_size,
        "index_entries": entries,
        "data_size": data_size,
        "header_flags": header.flags,
        "trailer_flags": trailer.flags if trailer else None,
        "user_tag": info.user_tag.decode("utf-8", "replace"),
        "version": f"{info.version}.{info.sub_version}",
    }


def inspect_layer(path: Path) -> dict[str, Any]:
    """Describe a layer for `aenv layer inspect` (JSON-ready).

    Keys: `kind` (outermost: tar, zfile, sealed or upper), `uuid`, `parent_uuid`,
    `virtual_size` (bytes), `index_entries` (valid mappings; for an upper, entries in the index
    log), `data_size` (bytes of data between header and index), plus `tar`/`zfile` sub-dicts
    with the wrapper facts and `inner_kind` for wrapped layers. An upper is given as its
    directory or its `upper.data` file.
    """
    from agentenv.storage.upper import Upper, is_upper_path

    path = Path(path)
    if is_upper_path(path):
        upper = Upper.open(path if path.is_dir() else path.parent, writable=False,
                           data_path=None if path.is_dir() else path)
        try:
            facts = _lsmt_facts(upper.data_header, None, upper.log_entries, upper.data_size)
            facts["index_entries_live"] = len(upper.index)
            return {"kind": "upper", "path": str(path), **facts}
        finally:
            upper.close()
    layer = open_layer(path)
    try:
        src = layer.source
        facts = _lsmt_facts(layer.header, layer.trailer, len(layer.index),
                            layer.trailer.index_offset - HT_BLOCK)
        facts["index_size"] = layer.raw_index_size
        facts["index_offset"] = layer.trailer.index_offset
        facts["lsmt_size"] = src.size
        result: dict[str, Any] = {"path": str(path)}
        kind = "sealed"
        if src.zreader is not None:
            z = src.zreader
            result["zfile"] = {
                "algorithm": zfile.NAME_BY_ALGO[z.algo],
                "block_size": z.block_size,
                "blocks": z.nblocks,
                "original_size": z.size,
                "verify": z.verify,
                "header_flags": z.header.flags,
                "header_overwritten": bool(z.header.flags & zfile.FLAG_HEADER_OVERWRITE),
                "compressed_size": z.info.index_offset + 4 * z.nblocks + zfile.ZF_BLOCK,
            }
            result["inner_kind"] = "sealed"
            kind = "zfile"
        if src.tar is not None:
            result["tar"] = {"payload_offset": src.tar.payload_offset,
                             "payload_size": src.tar.payload_size, "pax": src.tar.has_pax}
            result["inner_kind"] = kind
            kind = "tar"
        return {"kind": kind, **facts, **result}
    finally:
        layer.close()
