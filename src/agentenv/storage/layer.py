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
from functools import partial
from pathlib import Path
from typing import Any

from agentenv.storage import blob, tarwrap, zfile
from agentenv.storage.blob import BlobSource
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
    blob: BlobSource | None = None  # a remote layer's bytes (fd is then -1)

    def pread(self, length: int, pos: int) -> bytes:
        if self.zreader is not None:
            return self.zreader.pread(length, pos)
        length = max(0, min(length, self.size - pos))
        if self.blob is not None:
            return self.blob.pread(length, self.base + pos)
        return os.pread(self.fd, length, self.base + pos)

    def readinto(self, pos: int, buf: memoryview) -> int:
        if self.zreader is not None:
            return self.zreader.readinto(pos, buf)
        n = max(0, min(len(buf), self.size - pos))
        if self.blob is not None:
            return self.blob.readinto(self.base + pos, buf[:n]) if n else 0
        return os.preadv(self.fd, [buf[:n]], self.base + pos) if n else 0


def open_stream(path: Path, fd: int | BlobSource) -> StreamSource:
    """Detect tar and ZFile wrappers on an open layer file, or a remote blob
    (docs/overlaybd.md §1)."""
    if isinstance(fd, int):
        file_size = os.fstat(fd).st_size
        pread = partial(os.pread, fd)
        blob = None
    else:
        blob, file_size, fd = fd, fd.size, -1
        pread = blob.pread
    entry = tarwrap.read_tar_entry(pread, path, file_size)
    base, size = (entry.payload_offset, entry.payload_size) if entry else (0, file_size)
    head = pread(zfile.ZF_BLOCK, base)
    if zfile.is_zfile(head):
        reader = zfile.ZFileReader(path, fd if blob is None else blob, base, size)
        return StreamSource(str(path), fd, base, reader.size, reader, entry, blob)
    return StreamSource(str(path), fd, base, size, None, entry, blob)


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
        if self.source.blob is not None:
            self.source.blob.close()
            self.source.blob = None


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
    """Open a lower layer file or blob: tar-wrapped, ZFile or plain sealed LSMT; or a remote
    layer's descriptor (storage/blob.py), read through the process's remote opener."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError as exc:
        raise LayerFormatError(path, None, "layer file does not exist") from exc
    try:
        if blob.is_descriptor(os.pread(fd, 512, 0)):
            os.close(fd)
            fd = -1
            return _open_remote(path)
        return load_sealed(path, open_stream(path, fd))
    except BaseException:
        if fd >= 0:
            os.close(fd)
        raise


def _open_remote(path: Path) -> SealedLayer:
    ref = blob.load_descriptor(path)
    source = blob.open_remote(ref)
    try:
        layer = load_sealed(path, open_stream(path, source))
    except BaseException:
        source.close()
        raise
    layer.extra["remote"] = ref
    return layer


def is_remote(path: Path) -> bool:
    """True when `path` is a remote layer's descriptor rather than a layer file."""
    try:
        with open(path, "rb") as f:
            return blob.is_descriptor(f.read(512))
    except OSError:
        return False


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
    remote: dict[str, Any] | None = None
    if is_remote(path):
        ref = blob.load_descriptor(path)
        remote = {"digest": ref.digest, "size": ref.size,
                  "sources": [s.to_json() for s in ref.sources]}
        if ref.facts:  # recorded at pull: no need to fetch anything
            return {**ref.facts, "path": str(path), "remote": remote}
    layer = open_layer(path)
    try:
        result = describe_layer(layer, path)
        if remote is not None:
            result["remote"] = remote
        return result
    finally:
        layer.close()


def describe_layer(layer: SealedLayer, path: Path | str) -> dict[str, Any]:
    """`inspect_layer`'s answer for an open sealed layer."""
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
