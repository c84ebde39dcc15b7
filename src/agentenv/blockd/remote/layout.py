"""What is known about a remote blob before its data is read: its wrappers, the small metadata
ranges (tar prefix, ZFile header, jump table, trailer; or the LSMT header, index and trailer)
and how each chunk of it is checked (docs/remote-layers.md §2).

A ZFile blob with block CRCs is checkable byte for byte: data blocks by their CRC-32C, the
tar prefix, ZFile header, jump table and trailer against the metadata (itself checked by the
ZFile header digest and the jump table's CRC when it was read), the tar suffix as zeros. A
plain LSMT blob has no checksums: its chunks can be checked only as part of the whole blob's
sha256.
"""

from __future__ import annotations

import base64
import json
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from crc32c import crc32c as _std_crc32c

from agentenv.fsutil import atomic_write
from agentenv.storage import tarwrap, zfile
from agentenv.storage.crc import BLOCK_SALT
from agentenv.storage.errors import LayerFormatError
from agentenv.storage.lsmt import HT_BLOCK, HeaderTrailer

_MASK = 0xFFFFFFFF
_SALT_INV = (~BLOCK_SALT) & _MASK
HEAD_BYTES = 4096


@dataclass
class Layout:
    kind: str  # "zfile" (checkable per chunk) or "plain"
    size: int
    base: int
    payload_size: int
    metas: list[tuple[int, bytes]] = field(default_factory=list)
    offsets: np.ndarray | None = None  # absolute start of every ZFile block, plus the end

    @property
    def checkable(self) -> bool:
        return self.kind == "zfile"

    def meta_read(self, offset: int, length: int) -> bytes | None:
        for start, data in self.metas:
            if start <= offset and offset + length <= start + len(data):
                return data[offset - start : offset - start + length]
        return None

    # -- per-chunk checks ----------------------------------------------------------------

    def fetch_range(self, start: int, end: int) -> tuple[int, int]:
        """The bytes to fetch for chunk [start, end): widened to whole ZFile blocks, so every
        block the chunk touches can be checked."""
        if self.offsets is None:
            return start, end
        offs = self.offsets
        first, last = int(offs[0]), int(offs[-1])
        lo, hi = start, end
        if first <= start < last:
            k = int(np.searchsorted(offs, start, side="right")) - 1
            lo = int(offs[k])
        if first < end <= last:
            k = int(np.searchsorted(offs, end - 1, side="right")) - 1
            hi = int(offs[k + 1])
        return lo, hi

    def check(self, start: int, end: int, data: bytes, data_start: int) -> str | None:
        """None when chunk [start, end), inside `data` (which starts at `data_start`), is
        right; else what is wrong."""
        if self.offsets is None:
            return "no per-chunk checks for this blob"
        offs = self.offsets
        first, last = int(offs[0]), int(offs[-1])
        view = memoryview(data)
        # Data blocks touched by the chunk.
        if start < last and end > first:
            k0 = int(np.searchsorted(offs, max(start, first), side="right")) - 1
            k1 = int(np.searchsorted(offs, min(end, last) - 1, side="right")) - 1
            for k in range(k0, k1 + 1):
                a, z = int(offs[k]) - data_start, int(offs[k + 1]) - data_start
                if a < 0 or z > len(view):
                    return f"block {k} not fetched whole"
                stored = int.from_bytes(view[z - 4 : z], "little")
                if (~_std_crc32c(view[a : z - 4], _SALT_INV)) & _MASK != stored:
                    return f"ZFile block {k} CRC mismatch"
        # Everything else against the metadata, or zeros past the tar payload.
        payload_end = self.base + self.payload_size
        for lo, hi in ((start, min(end, first)), (max(start, last), end)):
            pos = lo
            while pos < hi:
                if pos >= payload_end:
                    if any(view[pos - data_start : hi - data_start]):
                        return f"non-zero bytes at {pos} past the tar payload"
                    break
                span = self._meta_span(pos)
                if span is None:
                    return f"bytes at {pos} are in no known metadata range"
                m_start, m_data = span
                stop = min(hi, m_start + len(m_data), payload_end)
                if view[pos - data_start : stop - data_start] != m_data[pos - m_start : stop - m_start]:
                    return f"metadata bytes at {pos} differ"
                pos = stop
        return None

    def _meta_span(self, pos: int) -> tuple[int, bytes] | None:
        for start, data in self.metas:
            if start <= pos < start + len(data):
                return start, data
        return None

    # -- persistence ---------------------------------------------------------------------

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "size": self.size, "base": self.base,
                "payloadSize": self.payload_size,
                "metas": [[o, base64.b64encode(d).decode()] for o, d in self.metas]}

    def save(self, path: Path) -> None:
        atomic_write(path, json.dumps(self.to_json()), mode=0o600)

    @classmethod
    def load(cls, path: Path, size: int) -> Layout | None:
        try:
            doc = json.loads(path.read_text())
            metas = [(int(o), base64.b64decode(d)) for o, d in doc["metas"]]
            if doc["size"] != size:
                return None
            return parse(lambda n, off: _from_metas(metas, n, off), size, str(path))
        except (OSError, ValueError, KeyError, TypeError, LayerFormatError):
            return None


def _from_metas(metas: list[tuple[int, bytes]], length: int, offset: int) -> bytes:
    for start, data in metas:
        if start <= offset and offset + length <= start + len(data):
            return data[offset - start : offset - start + length]
    raise LayerFormatError("cached layout", offset, "metadata range not recorded")


class MetaReader:
    """A BlobSource that reads through `fetch(length, offset)` exactly the ranges asked for,
    remembering each (a layer's metadata is read once, in a few small ranges)."""

    def __init__(self, fetch: Callable[[int, int], bytes], size: int) -> None:
        self.fetch = fetch
        self.size = size
        self.metas: list[tuple[int, bytes]] = []
        self.fetched = 0

    def pread(self, length: int, offset: int) -> bytes:
        length = max(0, min(length, self.size - offset))
        for start, data in self.metas:
            if start <= offset and offset + length <= start + len(data):
                return data[offset - start : offset - start + length]
        data = self.fetch(length, offset)
        self.fetched += len(data)
        if len(data) != length:
            raise LayerFormatError("remote blob", offset, f"short metadata read ({len(data)} "
                                                          f"of {length} bytes)")
        self.metas.append((offset, data))
        return data

    def readinto(self, offset: int, buf: memoryview) -> int:
        data = self.pread(len(buf), offset)
        buf[: len(data)] = data
        return len(data)

    def close(self) -> None:
        pass


def parse(fetch: Callable[[int, int], bytes], size: int, where: str) -> Layout:
    """Read and check a blob's wrappers and metadata with `fetch(length, offset)`."""
    reader = MetaReader(fetch, size)
    reader.pread(min(size, HEAD_BYTES), 0)
    entry = tarwrap.read_tar_entry(reader.pread, where, size)
    base, psize = (entry.payload_offset, entry.payload_size) if entry else (0, size)
    head = reader.pread(zfile.ZF_BLOCK, base)
    if zfile.is_zfile(head):
        zr = zfile.ZFileReader(where, reader, base, psize)  # checks header digest, table CRC
        reader.pread(zfile.ZF_BLOCK, base + psize - zfile.ZF_BLOCK)  # the trailer, for checks
        # Without block CRCs, or with a dictionary region we never read: not checkable.
        kind = "zfile" if zr.verify and not zr.info.dict_size else "plain"
        offsets = np.asarray(zr.offsets, dtype=np.int64) if kind == "zfile" else None
        return Layout(kind, size, base, psize, sorted(reader.metas), offsets)
    header = HeaderTrailer.unpack(reader.pread(HT_BLOCK, base), where, base)
    if not header.is_header:
        raise LayerFormatError(where, base, "neither a ZFile nor an LSMT layer")
    trailer = HeaderTrailer.unpack(reader.pread(HT_BLOCK, base + psize - HT_BLOCK), where,
                                   base + psize - HT_BLOCK)
    if trailer.index_offset + 16 * trailer.index_size > psize:
        raise LayerFormatError(where, base + psize - HT_BLOCK, "LSMT index runs past the trailer")
    reader.pread(16 * trailer.index_size, base + trailer.index_offset)
    return Layout("plain", size, base, psize, sorted(reader.metas), None)
