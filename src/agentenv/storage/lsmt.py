"""LSMT building blocks: the 4096-byte header/trailer, 16-byte segment mappings, index algebra.

Follows the C++ reference (containerd/overlaybd) where it and the Rust re-implementation differ
(docs/overlaybd.md §12): uppercase UUID text, the null UUID written as the all-zero *string*, the
`< 16383` merge limit in `compress_raw_index`, tags written as they are in memory.

Index representation in memory: four parallel flat lists `(starts, ends, moffsets, layers)`
sorted by start and non-overlapping. Units are whatever the caller uses consistently (sectors
for on-disk work, bytes on the read path). `layers[i]` is the source-layer slot of the mapping,
or ZEROED (-1) for a mapping that reads as zeros. Flat lists keep `bisect` in C.
"""

from __future__ import annotations

import re
import struct
import uuid as uuidlib
from bisect import bisect_left, bisect_right
from dataclasses import dataclass, replace
from pathlib import Path

import numpy as np

from agentenv.storage.errors import LayerFormatError

SECTOR = 512
HT_BLOCK = 4096
HT_SECTORS = HT_BLOCK // SECTOR  # first data sector of every LSMT data file

MAGIC0 = bytes.fromhex("4c534d5400010200")
MAGIC1 = bytes.fromhex("657e63d29444084ca2d2c8ec4fcfae8a")
HT_STRUCT_SIZE = 390

FLAG_HEADER = 0x01
FLAG_DATA = 0x02
FLAG_SEALED = 0x04
FLAG_SPARSE_RW = 0x10

MAX_LENGTH = 16383
MAX_OFFSET = (1 << 50) - 1
MAX_MOFFSET = (1 << 55) - 1
MAX_IO_SIZE = 4 << 20
MAX_RO_ENTRIES = 1_000_000
MAX_RW_ENTRIES = 128_000_000
MAX_LAYERS = 255
ZEROED = -1

NULL_UUID = "00000000-0000-0000-0000-000000000000"
INVALID_MAPPING_BYTES = bytes.fromhex("ffffffffffff03000000000000000000")

_UUID_RE = re.compile(r"^[0-9A-Fa-f]{8}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{4}-[0-9A-Fa-f]{12}$")
# magic0, magic1, size, flags, index_offset, index_size, virtual_size, uuid, parent, reserved,
# version, sub_version, user_tag: 390 bytes, packed.
_HT = struct.Struct("<8s16sIIQQQ37s37sHBB256s")
assert _HT.size == HT_STRUCT_SIZE


def valid_uuid(text: str | None) -> bool:
    """True for a 36-character 8-4-4-4-12 hex UUID (either case), like Photon's parser."""
    return bool(text) and _UUID_RE.match(text) is not None  # type: ignore[arg-type]


def normalize_uuid(text: str | None) -> str:
    """The C++ text form: uppercase, or the null-UUID string when missing or invalid."""
    if text is None or not valid_uuid(text):
        return NULL_UUID
    return text.upper()


def random_uuid() -> str:
    return str(uuidlib.uuid4()).upper()


@dataclass(frozen=True)
class HeaderTrailer:
    """One LSMT header or trailer block (docs/overlaybd.md §2)."""

    flags: int
    index_offset: int = 0
    index_size: int = 0
    virtual_size: int = 0
    uuid: str = NULL_UUID
    parent_uuid: str = NULL_UUID
    user_tag: bytes = b""
    version: int = 1
    sub_version: int = 1

    @property
    def is_header(self) -> bool:
        return bool(self.flags & FLAG_HEADER)

    @property
    def is_data(self) -> bool:
        return bool(self.flags & FLAG_DATA)

    @property
    def is_sealed(self) -> bool:
        return bool(self.flags & FLAG_SEALED)

    @property
    def is_sparse(self) -> bool:
        return bool(self.flags & FLAG_SPARSE_RW)

    def with_(self, **changes: object) -> HeaderTrailer:
        return replace(self, **changes)  # type: ignore[arg-type]

    def pack(self) -> bytes:
        """The full 4096-byte block."""
        if len(self.user_tag) > 256:
            raise ValueError("user_tag is longer than 256 bytes")
        raw = _HT.pack(
            MAGIC0,
            MAGIC1,
            HT_STRUCT_SIZE,
            self.flags,
            self.index_offset,
            self.index_size,
            self.virtual_size,
            normalize_uuid(self.uuid).encode() + b"\0",
            normalize_uuid(self.parent_uuid).encode() + b"\0",
            0,
            self.version,
            self.sub_version,
            self.user_tag,
        )
        return raw + bytes(HT_BLOCK - HT_STRUCT_SIZE)

    @classmethod
    def unpack(cls, block: bytes, path: Path | str, offset: int) -> HeaderTrailer:
        """Parse a header/trailer block; raises LayerFormatError on a bad magic or size."""
        if len(block) < HT_STRUCT_SIZE:
            raise LayerFormatError(path, offset, "truncated LSMT header/trailer")
        (m0, m1, size, flags, ioff, isize, vsize, uuid_raw, parent_raw, _res, ver, sub, tag) = (
            _HT.unpack_from(block)
        )
        if m0 != MAGIC0 or m1 != MAGIC1:
            raise LayerFormatError(path, offset, f"bad LSMT magic {m0.hex()}")
        if size != HT_STRUCT_SIZE:
            raise LayerFormatError(path, offset + 24, f"LSMT header size {size}, expected 390")
        return cls(
            flags=flags,
            index_offset=ioff,
            index_size=isize,
            virtual_size=vsize,
            uuid=_parse_uuid_field(uuid_raw),
            parent_uuid=_parse_uuid_field(parent_raw),
            user_tag=tag.rstrip(b"\0"),
            version=ver,
            sub_version=sub,
        )


def _parse_uuid_field(raw: bytes) -> str:
    """Both the C++ null string and Rust's 37 zero bytes read as the null UUID."""
    text = raw.split(b"\0", 1)[0].decode("ascii", "replace")
    return text.upper() if valid_uuid(text) else NULL_UUID


# ---------------------------------------------------------------------------------------------
# Segment mappings (docs/overlaybd.md §3)

_M50 = (1 << 50) - 1
_M55 = (1 << 55) - 1


def encode_mapping(offset: int, length: int, moffset: int, zeroed: bool = False, tag: int = 0) -> bytes:
    """One 16-byte on-disk SegmentMapping (offset/length/moffset in sectors)."""
    lo = (offset & _M50) | (length << 50)
    hi = (moffset & _M55) | (int(bool(zeroed)) << 55) | ((tag & 0xFF) << 56)
    return struct.pack("<QQ", lo, hi)


@dataclass(frozen=True)
class RawMapping:
    """A decoded on-disk mapping, units in sectors."""

    offset: int
    length: int
    moffset: int
    zeroed: bool = False
    tag: int = 0

    @property
    def end(self) -> int:
        return self.offset + self.length

    @property
    def mend(self) -> int:
        return self.moffset if self.zeroed else self.moffset + self.length

    def pack(self) -> bytes:
        return encode_mapping(self.offset, self.length, self.moffset, self.zeroed, self.tag)


def decode_mappings(buf: bytes | memoryview) -> tuple[list[int], list[int], list[int], list[bool], list[int]]:
    """Decode packed mappings into flat lists (offset, length, moffset, zeroed, tag), dropping
    INVALID padding (offset == 2^50-1), as C++ loaders do. Fast (numpy)."""
    words = np.frombuffer(buf, dtype="<u8").reshape(-1, 2)
    lo = words[:, 0]
    hi = words[:, 1]
    offsets = lo & np.uint64(_M50)
    keep = offsets != np.uint64(_M50)
    if not keep.all():
        lo, hi, offsets = lo[keep], hi[keep], offsets[keep]
    lengths = lo >> np.uint64(50)
    moffsets = hi & np.uint64(_M55)
    zeroed = ((hi >> np.uint64(55)) & np.uint64(1)).astype(bool)
    tags = hi >> np.uint64(56)
    return (offsets.tolist(), lengths.tolist(), moffsets.tolist(), zeroed.tolist(), tags.tolist())


# ---------------------------------------------------------------------------------------------
# Index algebra on flat lists


class FlatIndex:
    """Sorted, non-overlapping mappings as four flat lists (see module docstring).

    `insert` implements the writable-index overwrite rule (docs/overlaybd.md §5.1): intersected mappings are
    removed, their left and right remainders kept (the right one with moffset advanced unless
    zeroed). Callers serialise mutation against readers themselves.
    """

    __slots__ = ("ends", "layers", "moffsets", "starts")

    def __init__(
        self,
        starts: list[int] | None = None,
        ends: list[int] | None = None,
        moffsets: list[int] | None = None,
        layers: list[int] | None = None,
    ) -> None:
        self.starts: list[int] = starts if starts is not None else []
        self.ends: list[int] = ends if ends is not None else []
        self.moffsets: list[int] = moffsets if moffsets is not None else []
        self.layers: list[int] = layers if layers is not None else []

    def __len__(self) -> int:
        return len(self.starts)

    def copy(self) -> FlatIndex:
        return FlatIndex(self.starts[:], self.ends[:], self.moffsets[:], self.layers[:])

    def entries(self) -> list[tuple[int, int, int, int]]:
        """(start, length, moffset, layer) tuples, for tests and dumps."""
        return [
            (s, e - s, m, ly)
            for s, e, m, ly in zip(self.starts, self.ends, self.moffsets, self.layers, strict=True)
        ]

    def insert(self, start: int, end: int, moffset: int, layer: int) -> None:
        if end <= start:
            return
        starts, ends, moffs, lays = self.starts, self.ends, self.moffsets, self.layers
        lo = bisect_right(ends, start)  # first mapping ending after `start`
        hi = bisect_left(starts, end, lo)  # first mapping starting at or after `end`
        new_s = [start]
        new_e = [end]
        new_m = [moffset]
        new_l = [layer]
        if lo < hi:
            if starts[lo] < start:
                new_s.insert(0, starts[lo])
                new_e.insert(0, start)
                new_m.insert(0, moffs[lo])
                new_l.insert(0, lays[lo])
            last = hi - 1
            if ends[last] > end:
                new_s.append(end)
                new_e.append(ends[last])
                lay = lays[last]
                new_m.append(moffs[last] if lay == ZEROED else moffs[last] + (end - starts[last]))
                new_l.append(lay)
        starts[lo:hi] = new_s
        ends[lo:hi] = new_e
        moffs[lo:hi] = new_m
        lays[lo:hi] = new_l

    def lookup(self, start: int, end: int) -> list[tuple[int, int, int, int]]:
        """Mappings intersecting [start, end), first and last trimmed: (start, length, moffset, layer)."""
        starts, ends, moffs, lays = self.starts, self.ends, self.moffsets, self.layers
        out: list[tuple[int, int, int, int]] = []
        i = bisect_right(ends, start)
        n = len(starts)
        while i < n and starts[i] < end:
            s = max(starts[i], start)
            e = min(ends[i], end)
            lay = lays[i]
            m = moffs[i] if lay == ZEROED else moffs[i] + (s - starts[i])
            out.append((s, e - s, m, lay))
            i += 1
        return out


def overlay(top: FlatIndex, bottom: FlatIndex) -> FlatIndex:
    """Merge two indexes where `top` wins: its mappings as they are, plus `bottom`'s mappings
    trimmed to the gaps `top` leaves (one step of C++ merge_memory_indexes / ComboIndex)."""
    if len(top) + len(bottom) >= _VECTOR_MIN:
        s_, e_, m_, l_ = (a.tolist() for a in _overlay_arrays(_to_arrays(top), _to_arrays(bottom)))
        return FlatIndex(s_, e_, m_, l_)
    ts, te, tm, tl = top.starts, top.ends, top.moffsets, top.layers
    bs, be, bm, bl = bottom.starts, bottom.ends, bottom.moffsets, bottom.layers
    if not ts:
        return bottom.copy()
    if not bs:
        return top.copy()
    os_: list[int] = []
    oe: list[int] = []
    om: list[int] = []
    ol: list[int] = []
    nb = len(bs)
    j = 0
    gap_start = 0
    inf = 1 << 62
    for k in range(len(ts) + 1):
        gap_end = ts[k] if k < len(ts) else inf
        if gap_start < gap_end:
            while j < nb and be[j] <= gap_start:
                j += 1
            i = j
            while i < nb and bs[i] < gap_end:
                s = bs[i] if bs[i] > gap_start else gap_start
                e = be[i] if be[i] < gap_end else gap_end
                lay = bl[i]
                os_.append(s)
                oe.append(e)
                om.append(bm[i] if lay == ZEROED else bm[i] + (s - bs[i]))
                ol.append(lay)
                i += 1
            if i > j:
                j = i - 1
        if k < len(ts):
            os_.append(ts[k])
            oe.append(te[k])
            om.append(tm[k])
            ol.append(tl[k])
            gap_start = te[k]
    return FlatIndex(os_, oe, om, ol)


_Arrays = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]
_VECTOR_MIN = 4096  # below this many entries the pure-Python sweep is faster


def _to_arrays(index: FlatIndex) -> _Arrays:
    return (np.asarray(index.starts, dtype=np.int64), np.asarray(index.ends, dtype=np.int64),
            np.asarray(index.moffsets, dtype=np.int64), np.asarray(index.layers, dtype=np.int64))


def _overlay_arrays(top: _Arrays, bottom: _Arrays) -> _Arrays:
    """`overlay` vectorised: bottom mappings cut to the gaps between top mappings."""
    ts, te, tm, tl = top
    bs, be, bm, bl = bottom
    if not len(ts):
        return bottom
    if not len(bs):
        return top
    gap_s = np.concatenate(([0], te))
    gap_e = np.concatenate((ts, [np.iinfo(np.int64).max]))
    keep = gap_e > gap_s
    gap_s, gap_e = gap_s[keep], gap_e[keep]
    # Gaps intersecting bottom mapping i: indexes [j0[i], j1[i]).
    j0 = np.searchsorted(gap_e, bs, side="right")
    j1 = np.searchsorted(gap_s, be, side="left")
    counts = np.maximum(j1 - j0, 0)
    total = int(counts.sum())
    src = np.repeat(np.arange(len(bs)), counts)
    first = np.repeat(np.cumsum(counts) - counts, counts)
    gap = np.repeat(j0, counts) + (np.arange(total) - first)
    ps = np.maximum(bs[src], gap_s[gap])
    pe = np.minimum(be[src], gap_e[gap])
    ok = pe > ps
    src, ps, pe = src[ok], ps[ok], pe[ok]
    lay = bl[src]
    pm = np.where(lay == ZEROED, bm[src], bm[src] + (ps - bs[src]))
    starts = np.concatenate((ts, ps))
    order = np.argsort(starts, kind="stable")
    return (starts[order], np.concatenate((te, pe))[order], np.concatenate((tm, pm))[order],
            np.concatenate((tl, lay))[order])


def merge_indexes(indexes_top_first: list[FlatIndex]) -> FlatIndex:
    """One merged read-only index over a stack given top layer first (docs/overlaybd.md §5.3)."""
    if not indexes_top_first:
        return FlatIndex()
    if sum(len(ix) for ix in indexes_top_first) < _VECTOR_MIN:
        merged = indexes_top_first[0].copy()
        for lower in indexes_top_first[1:]:
            merged = overlay(merged, lower)
        return merged
    arrays = _to_arrays(indexes_top_first[0])
    for lower in indexes_top_first[1:]:
        arrays = _overlay_arrays(arrays, _to_arrays(lower))
    s_, e_, m_, l_ = (a.tolist() for a in arrays)
    return FlatIndex(s_, e_, m_, l_)


def compress_raw_index(mappings: list[RawMapping]) -> list[RawMapping]:
    """C++ compress_raw_index: merge a neighbour into the accumulated entry when logically and
    physically contiguous, same zeroed and tag, and the sum stays strictly below 16383."""
    out: list[RawMapping] = []
    for m in mappings:
        if out:
            a = out[-1]
            if (
                a.end == m.offset
                and a.mend == m.moffset
                and a.zeroed == m.zeroed
                and a.tag == m.tag
                and a.length + m.length < MAX_LENGTH
            ):
                out[-1] = RawMapping(a.offset, a.length + m.length, a.moffset, a.zeroed, a.tag)
                continue
        out.append(m)
    return out


def pack_mappings(mappings: list[RawMapping], pad_to: int = 1) -> bytes:
    """Pack mappings, padding with INVALID entries up to a multiple of `pad_to` entries."""
    parts = [m.pack() for m in mappings]
    rem = len(parts) % pad_to
    if rem:
        parts.extend([INVALID_MAPPING_BYTES] * (pad_to - rem))
    return b"".join(parts)


def check_sorted(
    starts: list[int], lengths: list[int], path: Path | str, index_offset: int
) -> None:
    """C++ RO-open check: every mapping ends at or before the next one starts."""
    prev_end = -1
    for i, (s, n) in enumerate(zip(starts, lengths, strict=True)):
        if s < prev_end:
            raise LayerFormatError(
                path,
                index_offset + 16 * i,
                f"index entry {i} (offset {s}) overlaps or is out of order with the previous one "
                f"(ending at sector {prev_end})",
            )
        prev_end = s + n
