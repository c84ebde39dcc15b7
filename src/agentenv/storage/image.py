"""An overlaybd image: up to 255 read-only layers plus at most one writable upper.

Reads consult the upper's index first, then ONE merged read-only index built once per stack
(docs/overlaybd.md §5.3); holes and zeroed mappings read as zeros. All of an image's read state lives in an
immutable `_View` (merged index, layer sources, upper) that `snapshot_and_restack` replaces
with one assignment, so a reader never sees a half-applied snapshot.

Threading: reads may run concurrently from any number of threads; write, discard,
write_zeroes, flush, resize, snapshot_and_restack and close are serialised by one lock.
The upper's in-memory index is guarded by its own short lock (see upper.py); data already
written is never overwritten, so preads run outside every lock.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import threading
from bisect import bisect_left, bisect_right
from collections.abc import Iterator, Sequence
from pathlib import Path

from agentenv.storage.config import CONFIG_NAME, ImageConfig, load_config
from agentenv.storage.errors import ImageUsageError, LayerFormatError
from agentenv.storage.layer import SealedLayer, StreamSource, load_sealed, open_layer
from agentenv.storage.lsmt import (
    MAX_LAYERS,
    NULL_UUID,
    SECTOR,
    ZEROED,
    FlatIndex,
    merge_indexes,
    overlay,
)
from agentenv.storage.upper import UPPER_DATA, UPPER_INDEX, Upper, fsync_dir
from agentenv.storage.zfile import ZFileReader

_ZERO_CHUNK = bytes(1 << 20)
_ZERO_VIEW = memoryview(_ZERO_CHUNK)
# The upper's data file only grows; read_pieces maps it once and maps it again only when it has
# grown by this much past the mapping (newer data is pread meanwhile), so a write-then-read
# pattern does not remap on every read.
UPPER_REMAP_MIN = 8 << 20
Piece = bytes | bytearray | memoryview


def _zero(buf: memoryview, a: int, b: int) -> None:
    while a < b:
        n = min(b - a, len(_ZERO_CHUNK))
        buf[a : a + n] = _ZERO_CHUNK[:n]
        a += n


def _zero_pieces(out: list[Piece], n: int) -> None:
    while n > 0:
        k = min(n, len(_ZERO_CHUNK))
        out.append(_ZERO_VIEW[:k])
        n -= k


def _map_upper(v: _View, up: Upper, need_end: int) -> memoryview | None:
    """The upper data file's mapping when it can cover byte `need_end`, (re)made when the
    file has grown enough; None means pread. Racing threads may each map: harmless."""
    current = v.upper_map
    size = os.fstat(up.data_fd).st_size
    if size < need_end or (current is not None and size - len(current) < UPPER_REMAP_MIN):
        return current
    view = memoryview(mmap.mmap(up.data_fd, size, prot=mmap.PROT_READ))
    v.upper_map = view  # the old mapping goes with its last slice
    return view


def _relabel(index: FlatIndex, slot: int) -> FlatIndex:
    layers = [ZEROED if ly == ZEROED else slot for ly in index.layers]
    return FlatIndex(index.starts, index.ends, index.moffsets, layers)


class _View:
    """Everything a read needs, never mutated after construction except the upper's index
    (under its lock)."""

    __slots__ = ("bases", "fast_bends", "fast_bstarts", "fast_kind", "fast_mm", "fast_mv",
                 "fast_n", "fast_phys", "layers", "ro", "srcs", "upper", "upper_map", "vsize")

    def __init__(self, layers: list[SealedLayer], ro: FlatIndex, upper: Upper | None,
                 vsize: int) -> None:
        self.layers = layers
        self.ro = ro
        self.upper = upper
        self.vsize = vsize
        # A memoryview of an mmap of the upper's data file (made on demand by read_pieces).
        self.upper_map: memoryview | None = None
        # Per layer slot: an int fd (plain stream, read with one pread at bases[k] + pos) or a
        # ZFileReader.
        # A plain remote layer is its StreamSource (same pread/readinto as a ZFileReader).
        self.srcs: list[int | ZFileReader | StreamSource] = []
        self.bases: list[int] = []
        for layer in layers:
            src = layer.source
            self.srcs.append(src.zreader if src.zreader is not None else
                             src if src.blob is not None else src.fd)
            self.bases.append(src.base)
        # Hot-path tables for read(): byte bounds of each merged mapping; its kind (1 plain
        # data, 0 ZFile data, -2 zeroed); for plain data the layer's mmap and the file position
        # of virtual byte 0. A read inside one mapping is then one bisect and one slice.
        mms = [layer.mapping() for layer in layers]
        mvs = [layer.mapping_view() for layer in layers]
        self.fast_bstarts = [x << 9 for x in ro.starts]
        self.fast_bends = [x << 9 for x in ro.ends]
        self.fast_n = len(ro.starts)
        kinds: list[int] = []
        maps: list[mmap.mmap | None] = []
        views: list[memoryview | None] = []
        phys: list[int] = []
        for s, m, lay in zip(ro.starts, ro.moffsets, ro.layers, strict=True):
            if lay == ZEROED:
                kinds.append(-2)
                maps.append(None)
                views.append(None)
                phys.append(0)
            elif mms[lay] is not None:
                kinds.append(1)
                maps.append(mms[lay])
                views.append(mvs[lay])
                phys.append(self.bases[lay] + ((m - s) << 9))
            else:
                kinds.append(0)
                maps.append(None)
                views.append(None)
                phys.append(0)
        self.fast_kind = kinds
        self.fast_mm = maps
        self.fast_mv = views
        self.fast_phys = phys


def _restack_interrupted(config: ImageConfig, layers: Sequence[SealedLayer]) -> bool:
    """True when image.json was committed by snapshot_and_restack but the fresh upper was not
    (fully) created: upper.data is still the very file that is now the top lower."""
    if not layers or config.upper_data is None:
        return False
    try:
        a = os.stat(config.upper_data)
    except FileNotFoundError:
        return False
    b = os.stat(layers[-1].path)
    return (a.st_dev, a.st_ino) == (b.st_dev, b.st_ino)


def _stack_vsize(layers: Sequence[SealedLayer]) -> int:
    for layer in reversed(layers):
        if layer.virtual_size > 0:
            return layer.virtual_size
    return 0


class Image:
    """A layer stack opened for block I/O. See the module docstring for the threading rules.

    Byte offsets and lengths may be unaligned for every operation; unaligned writes
    read-modify-write the edge sectors. I/O beyond `virtual_size` raises ImageUsageError.
    """

    def __init__(self, layers: list[SealedLayer], upper: Upper | None,
                 config: ImageConfig | None, writable: bool,
                 virtual_size: int | None = None) -> None:
        if len(layers) > MAX_LAYERS:
            raise ImageUsageError(f"{len(layers)} layers exceed the limit of {MAX_LAYERS}")
        self._wlock = threading.RLock()
        self._config = config
        self._writable = writable and upper is not None
        self._closed = False
        indexes = [_relabel(layer.index, slot) for slot, layer in enumerate(layers)]
        ro = merge_indexes(indexes[::-1])
        vsize = upper.virtual_size if upper is not None and upper.virtual_size else 0
        vsize = vsize or virtual_size or _stack_vsize(layers)
        self._view = _View(layers, ro, upper, vsize)
        self._upper_limit: int | None = None
        self._chain_used = 0

    # -- construction ---------------------------------------------------------------------

    @classmethod
    def open(cls, source: Path, *, writable: bool = True) -> Image:
        """Open an image config JSON (lowers + optional upper; a directory holding image.json
        also works), or a single layer file/blob (tar-wrapped, ZFile or plain sealed), which
        gives a read-only image. `writable=False` opens the upper read-only."""
        source = Path(source)
        if source.is_dir() and (source / CONFIG_NAME).is_file():
            source = source / CONFIG_NAME
        try:
            with open(source, "rb") as f:
                head = f.read(64).lstrip()
        except FileNotFoundError as exc:
            raise LayerFormatError(source, None, "image source does not exist") from exc
        except IsADirectoryError as exc:
            raise LayerFormatError(source, None, f"no {CONFIG_NAME} in this directory") from exc
        if not head.startswith(b"{"):
            return cls([open_layer(source)], None, None, False)
        config = load_config(source)
        layers: list[SealedLayer] = []
        upper: Upper | None = None
        try:
            for p in config.lowers:
                layers.append(open_layer(p))
            if config.upper_data is not None and _restack_interrupted(config, layers):
                if writable:
                    top = layers[-1]
                    upper = Upper.create(config.upper_data.parent, top.header.virtual_size,
                                         parent_uuid=top.uuid, rw_tag=len(layers))
                    if upper.data_path != config.upper_data:
                        config.upper_data, config.upper_index = upper.data_path, upper.index_path
                        config.save()
                # Read-only: the top lower already holds everything the upper held.
            elif config.upper_data is not None:
                upper = Upper.open(data_path=config.upper_data, index_path=config.upper_index,
                                   writable=writable, rw_tag=len(layers))
            return cls(layers, upper, config, writable)
        except BaseException:
            for layer in layers:
                layer.close()
            if upper is not None:
                upper.close()
            raise

    @classmethod
    def create(cls, lowers: Sequence[Path], upper_dir: Path | None,
               virtual_size: int | None = None) -> Image:
        """Open `lowers` (bottom -> top) and, unless `upper_dir` is None (read-only image),
        create an empty upper (upper.data, upper.index) there plus `upper_dir/image.json`.
        `virtual_size` defaults to the lowers' size (the topmost non-zero one)."""
        layers = [open_layer(Path(p)) for p in lowers]
        try:
            vsize = virtual_size or _stack_vsize(layers)
            if vsize <= 0 or vsize % SECTOR:
                raise ImageUsageError(f"virtual size {vsize} must be a positive multiple of 512")
            if upper_dir is None:
                return cls(layers, None, None, False, vsize)
            upper_dir = Path(upper_dir).absolute()
            if (upper_dir / UPPER_DATA).exists():
                raise ImageUsageError(f"{upper_dir} already holds an upper layer")
            parent = layers[-1].uuid if layers else NULL_UUID
            upper = Upper.create(upper_dir, vsize, parent_uuid=parent, rw_tag=len(layers))
            config = ImageConfig(upper_dir / CONFIG_NAME, [p.path.absolute() for p in layers],
                                 upper.data_path, upper.index_path)
            config.save()
            return cls(layers, upper, config, True)
        except BaseException:
            for layer in layers:
                layer.close()
            raise

    # -- properties -----------------------------------------------------------------------

    @property
    def virtual_size(self) -> int:
        return self._view.vsize

    @property
    def readonly(self) -> bool:
        return not self._writable

    @property
    def lowers(self) -> list[Path]:
        """Lower layer paths, bottom -> top."""
        return [layer.path for layer in self._view.layers]

    @property
    def upper_dir(self) -> Path | None:
        up = self._view.upper
        return up.data_path.parent if up is not None else None

    @property
    def config_path(self) -> Path | None:
        return self._config.path if self._config is not None else None

    @property
    def upper_limit(self) -> int | None:
        """Cap in bytes on what this disk's writes may take (None: no cap): the current upper's
        growth (data appended plus index log) plus `chain_used`, the sealed uppers of its
        earlier snapshots. Writes that would pass it raise UpperFull (ENOSPC); a snapshot
        starts a new upper with what is left, so a pause and resume never renews it."""
        return self._upper_limit

    @upper_limit.setter
    def upper_limit(self, limit: int | None) -> None:
        if limit is not None and (not isinstance(limit, int) or limit <= 0):
            raise ImageUsageError(f"upper limit must be a positive number of bytes, got {limit!r}")
        with self._wlock:
            self._upper_limit = limit
            self._apply_upper_cap()

    @property
    def chain_used(self) -> int:
        """Bytes this disk's own sealed uppers hold (counted against `upper_limit`): what the
        caller said at open (its earlier pauses) plus each snapshot_and_restack since."""
        return self._chain_used

    @chain_used.setter
    def chain_used(self, used: int) -> None:
        if not isinstance(used, int) or used < 0:
            raise ImageUsageError(f"chain_used must be a non-negative number of bytes, got {used!r}")
        with self._wlock:
            self._chain_used = used
            self._apply_upper_cap()

    def _upper_cap(self) -> int | None:
        """What the current upper may grow to (None: no cap; 0: nothing more)."""
        if self._upper_limit is None:
            return None
        return max(0, self._upper_limit - self._chain_used)

    def _apply_upper_cap(self) -> None:
        """Give the current upper its cap (the caller holds the write lock)."""
        if self._view.upper is not None:
            self._view.upper.limit = self._upper_cap()

    @property
    def upper_used(self) -> int:
        """Bytes the cap counts in the current upper (0 without one)."""
        up = self._view.upper
        return up.used_bytes if up is not None else 0

    # -- reads ----------------------------------------------------------------------------

    def _check_range(self, v: _View, offset: int, length: int) -> None:
        if self._closed:
            raise ImageUsageError("image is closed")
        if offset < 0 or length < 0 or offset + length > v.vsize:
            raise ImageUsageError(
                f"I/O at [{offset}, {offset + length}) is outside the {v.vsize}-byte image")

    def read(self, offset: int, length: int) -> bytes:
        """Bytes [offset, offset+length) of the virtual disk (any alignment)."""
        v = self._view
        end = offset + length
        if length <= 0 or offset < 0 or end > v.vsize or self._closed:
            self._check_range(v, offset, length)
            return b""
        up = v.upper
        hit = False
        if up is not None and up.index.starts:
            idx = up.index
            with up.index_lock:
                j = bisect_right(idx.ends, offset >> 9)
                if j < len(idx.starts):
                    us = idx.starts[j] << 9
                    hit = us < end
                    if hit:
                        ue = idx.ends[j] << 9
                        um = idx.moffsets[j]
                        ul = idx.layers[j]
            # Whole request inside one upper data mapping: one pread from upper.data.
            if hit and us <= offset and end <= ue and ul >= 0:
                data = os.pread(up.data_fd, length, (um << 9) + offset - us)
                if len(data) == length:
                    return data
        if not hit:
            # Whole request inside one read-only mapping of a plain layer: one pread.
            i = bisect_right(v.fast_bends, offset)
            if i < v.fast_n and v.fast_bstarts[i] <= offset and end <= v.fast_bends[i]:
                kind = v.fast_kind[i]
                if kind == 1:
                    p = v.fast_phys[i] + offset
                    data = v.fast_mm[i][p : p + length]  # type: ignore[index]
                    if len(data) == length:
                        return data
                elif kind == -2:
                    return bytes(length)
                else:
                    lay = v.ro.layers[i]
                    data = v.srcs[lay].pread(  # type: ignore[union-attr]
                        length, (v.ro.moffsets[i] << 9) + offset - v.fast_bstarts[i])
                    if len(data) == length:
                        return data
        buf = bytearray(length)
        self._fill(v, offset, end, memoryview(buf), True)
        return bytes(buf)

    def readinto(self, offset: int, buf: bytearray | memoryview) -> int:
        """Fill `buf` with the bytes at `offset`; returns len(buf)."""
        v = self._view
        mv = memoryview(buf).cast("B")
        self._check_range(v, offset, len(mv))
        if mv:
            self._fill(v, offset, offset + len(mv), mv, False)
        return len(mv)

    def read_pieces(self, offset: int, length: int) -> list[Piece]:
        """Bytes [offset, offset+length) as buffers in order whose lengths sum to `length`:
        slices of the layers' and the upper's mmaps where the data is plain (no copy: a server
        hands them to sendmsg as they are), shared zero buffers for holes, pread bytes
        elsewhere. The slices pin their mappings; close() leaves a pinned one to be unmapped
        when its last slice is released, so drop them once sent."""
        v = self._view
        self._check_range(v, offset, length)
        out: list[Piece] = []
        end = offset + length
        up = v.upper
        ust: list[int] = []
        if up is not None and length:
            # Copy out the intersecting mappings under the lock (C-speed slices), walk them
            # outside it. After random 4 KiB writes a 1 MiB read meets ~250 of them, so this
            # loop is the per-read cost: kept to plain list indexing, no per-piece tuples.
            idx = up.index
            with up.index_lock:
                i = bisect_right(idx.ends, offset >> 9)
                j = bisect_left(idx.starts, (end + SECTOR - 1) >> 9, i)
                if i < j:
                    ust, uen = idx.starts[i:j], idx.ends[i:j]
                    umo, uly = idx.moffsets[i:j], idx.layers[i:j]
        if not ust:
            self._pieces_ro(v, offset, end, out)
            return out
        assert up is not None
        umap = v.upper_map
        ulen = len(umap) if umap is not None else 0
        remap_tried = False  # at most one fstat (and maybe one mmap) per call
        pos = offset
        for s, e, mo, lay in zip(ust, uen, umo, uly, strict=True):
            s <<= 9
            if s > pos:
                self._pieces_ro(v, pos, s, out)
                pos = s
            e <<= 9
            if e > end:
                e = end
            if lay == ZEROED:
                _zero_pieces(out, e - pos)
                pos = e
                continue
            fpos = (mo << 9) + pos - s
            fend = fpos + e - pos
            if fend > ulen and not remap_tried:
                remap_tried = True
                umap = _map_upper(v, up, fend)
                ulen = len(umap) if umap is not None else 0
            if fend <= ulen:
                out.append(umap[fpos:fend])  # type: ignore[index]
            else:
                data = os.pread(up.data_fd, e - pos, fpos)
                out.append(data)
                _zero_pieces(out, e - pos - len(data))
            pos = e
        if pos < end:
            self._pieces_ro(v, pos, end, out)
        return out

    @staticmethod
    def _pieces_ro(v: _View, pos: int, end: int, out: list[Piece]) -> None:
        bstarts, bends, kinds, views, phys = (v.fast_bstarts, v.fast_bends, v.fast_kind,
                                             v.fast_mv, v.fast_phys)
        n = v.fast_n
        i = bisect_right(bends, pos)
        while pos < end:
            if i >= n or bstarts[i] >= end:
                _zero_pieces(out, end - pos)
                return
            s = bstarts[i]
            if s > pos:
                _zero_pieces(out, s - pos)
                pos = s
            e = bends[i]
            if e > end:
                e = end
            kind = kinds[i]
            if kind == 1:
                p = phys[i]
                piece = views[i][p + pos : p + e]  # type: ignore[index]
                out.append(piece)
                _zero_pieces(out, e - pos - len(piece))  # past the layer's EOF reads as zeros
            elif kind == -2:
                _zero_pieces(out, e - pos)
            else:
                buf = bytearray(e - pos)
                got = v.srcs[v.ro.layers[i]].readinto(  # type: ignore[union-attr]
                    (v.ro.moffsets[i] << 9) + pos - s, memoryview(buf))
                del buf[got:]
                out.append(buf)
                _zero_pieces(out, e - pos - got)
            pos = e
            i += 1

    def _fill(self, v: _View, pos: int, end: int, buf: memoryview, prezeroed: bool) -> None:
        """Fill buf (whose byte 0 is virtual byte `pos`) with [pos, end)."""
        start = pos
        up = v.upper
        pieces: list[tuple[int, int, int, int]] = []
        if up is not None:
            with up.index_lock:
                if up.index.starts:
                    pieces = up.index.lookup(pos >> 9, (end + SECTOR - 1) >> 9)
        if not pieces:
            self._fill_ro(v, pos, end, buf, start, prezeroed)
            return
        fd = up.data_fd  # type: ignore[union-attr]
        for s, n, mo, lay in pieces:
            ps = max(s << 9, pos)
            pe = min((s + n) << 9, end)
            if ps > pos:
                self._fill_ro(v, pos, ps, buf, start, prezeroed)
            if lay == ZEROED:
                if not prezeroed:
                    _zero(buf, ps - start, pe - start)
            else:
                dst = buf[ps - start : pe - start]
                got = os.preadv(fd, [dst], (mo << 9) + ps - (s << 9))
                if got < len(dst) and not prezeroed:
                    _zero(buf, ps - start + got, pe - start)
            pos = pe
        if pos < end:
            self._fill_ro(v, pos, end, buf, start, prezeroed)

    @staticmethod
    def _fill_ro(v: _View, pos: int, end: int, buf: memoryview, start: int,
                 prezeroed: bool) -> None:
        ro = v.ro
        st, en, mo, ly = ro.starts, ro.ends, ro.moffsets, ro.layers
        srcs, bases = v.srcs, v.bases
        n = len(st)
        i = bisect_right(en, pos >> 9)
        while pos < end:
            if i >= n or st[i] << 9 >= end:
                if not prezeroed:
                    _zero(buf, pos - start, end - start)
                return
            s = st[i] << 9
            if s > pos:
                if not prezeroed:
                    _zero(buf, pos - start, s - start)
                pos = s
            e = en[i] << 9
            if e > end:
                e = end
            lay = ly[i]
            if lay >= 0:
                src = srcs[lay]
                fpos = (mo[i] << 9) + pos - s
                dst = buf[pos - start : e - start]
                if type(src) is int:
                    got = os.preadv(src, [dst], bases[lay] + fpos)
                else:
                    got = src.readinto(fpos, dst)  # type: ignore[union-attr]
                if got < e - pos and not prezeroed:  # short read at layer EOF reads as zeros
                    _zero(buf, pos - start + got, e - start)
            elif not prezeroed:
                _zero(buf, pos - start, e - start)
            pos = e
            i += 1

    def extents(self) -> Iterator[tuple[int, int, bool]]:
        """Mapped extents of the whole stack in order, clipped to the virtual size:
        (byte offset, byte length, has_data). Holes are not listed; zeroed mappings are
        listed with has_data False."""
        v = self._view
        merged = v.ro
        if v.upper is not None:
            with v.upper.index_lock:
                top = _relabel(v.upper.index.copy(), len(v.layers))
            merged = overlay(top, v.ro)
        limit = v.vsize
        for s, e, lay in zip(merged.starts, merged.ends, merged.layers, strict=True):
            bs, be = s << 9, min(e << 9, limit)
            if bs >= limit:
                break
            yield bs, be - bs, lay != ZEROED

    # -- writes ---------------------------------------------------------------------------

    def _check_writable(self) -> Upper:
        if self._closed:
            raise ImageUsageError("image is closed")
        up = self._view.upper
        if not self._writable or up is None:
            raise ImageUsageError("image is read-only")
        return up

    def write(self, offset: int, data: bytes | bytearray | memoryview) -> None:
        """Write bytes at `offset` (appended to the upper; unaligned edges are RMW)."""
        with self._wlock:
            up = self._check_writable()
            v = self._view
            self._check_range(v, offset, len(data))
            if not data:
                return
            end = offset + len(data)
            a = offset & ~(SECTOR - 1)
            b = (end + SECTOR - 1) & ~(SECTOR - 1)
            if a != offset or b != end:
                buf = bytearray(b - a)
                mv = memoryview(buf)
                if a != offset:
                    self._fill(v, a, a + SECTOR, mv[:SECTOR], True)
                if b != end and (b - SECTOR >= a + SECTOR or a == offset):
                    self._fill(v, b - SECTOR, b, mv[b - SECTOR - a :], True)
                buf[offset - a : end - a] = data
                data = buf
            up.write_extent(a >> 9, data)

    def _zero_range(self, offset: int, length: int) -> None:
        with self._wlock:
            up = self._check_writable()
            self._check_range(self._view, offset, length)
            end = offset + length
            a = (offset + SECTOR - 1) & ~(SECTOR - 1)
            b = end & ~(SECTOR - 1)
            if a >= b:
                if length:
                    self.write(offset, bytes(length))
                return
            if a > offset:
                self.write(offset, bytes(a - offset))
            if end > b:
                self.write(b, bytes(end - b))
            up.zero_extent(a >> 9, (b - a) >> 9)

    def discard(self, offset: int, length: int) -> None:
        """Discard (reads as zeros afterwards): a zeroed mapping, unaligned edges zero-written."""
        self._zero_range(offset, length)

    def write_zeroes(self, offset: int, length: int) -> None:
        """Write zeros without storing data: a zeroed mapping (edges zero-written)."""
        self._zero_range(offset, length)

    def flush(self) -> None:
        """Make every completed write durable: fsync the data file, then the index log."""
        with self._wlock:
            if self._closed:
                raise ImageUsageError("image is closed")
            up = self._view.upper
            if up is not None and self._writable:
                up.flush()

    def resize(self, new_size: int) -> None:
        """Change the virtual size (rewrites vsize in the upper's headers)."""
        with self._wlock:
            up = self._check_writable()
            if new_size <= 0 or new_size % SECTOR:
                raise ImageUsageError(f"new size {new_size} must be a positive multiple of 512")
            up.set_virtual_size(new_size)
            v = self._view
            self._view = _View(v.layers, v.ro, up, new_size)

    def snapshot_and_restack(self, sealed_path: Path) -> Path:
        """Seal the upper in place (C++ close_seal), make it `sealed_path` (same filesystem),
        put it on top of the read-only stack, open a fresh empty upper in the same directory
        and rewrite image.json. No data is copied; concurrent readers keep reading (the
        sealed file keeps its open descriptor). Returns `sealed_path`.

        Crash safety: the sealed file is hard-linked to `sealed_path`, then image.json is
        replaced (the commit point), then the new upper replaces upper.index and upper.data.
        Before the commit point the old config still describes a consistent image (an upper
        that carries a trailer stays a valid upper); after it, `Image.open` sees upper.data
        being the same file as the top lower and finishes the restack."""
        with self._wlock:
            up = self._check_writable()
            v = self._view
            config = self._config
            if config is None or config.path is None:
                raise ImageUsageError("snapshot needs an image config (image.json)")
            if len(v.layers) + 1 > MAX_LAYERS:
                raise ImageUsageError(f"stack already has {len(v.layers)} layers "
                                      f"(limit {MAX_LAYERS})")
            sealed_path = Path(sealed_path).absolute()
            if sealed_path.exists():
                raise ImageUsageError(f"{sealed_path} already exists")
            if os.stat(sealed_path.parent).st_dev != os.stat(up.data_path.parent).st_dev:
                raise ImageUsageError(f"{sealed_path} is not on the upper's filesystem")
            upper_dir = up.data_path.parent
            up.flush()
            sealed_used = up.used_bytes
            trailer = up.seal_in_place()
            os.link(up.data_path, sealed_path)
            try:
                fsync_dir(sealed_path.parent)
                fd = up.data_fd
                layer = load_sealed(sealed_path,
                                    StreamSource(str(sealed_path), fd, 0, os.fstat(fd).st_size))
                slot = len(v.layers)
                ro = overlay(_relabel(layer.index, slot), v.ro)
                layers = [*v.layers, layer]
                old_paths = (up.data_path, up.index_path)
                config.lowers = [lay.path.absolute() for lay in layers]
                config.upper_data = upper_dir / UPPER_DATA
                config.upper_index = upper_dir / UPPER_INDEX
                config.save()  # commit point
            except BaseException:
                sealed_path.unlink(missing_ok=True)
                raise
            self._chain_used += sealed_used  # the sealed upper is the chain's from here on
            try:
                fsync_dir(config.path.parent)
                new_upper = Upper.create(upper_dir, v.vsize, parent_uuid=trailer.uuid,
                                         rw_tag=slot + 1)
                new_upper.limit = self._upper_cap()
            except BaseException:
                # On disk the restack is committed; the next open finishes it. Here the
                # image goes read-only over the new stack.
                self._writable = False
                self._view = _View(layers, ro, None, v.vsize)
                raise
            for old in old_paths:
                if old not in (new_upper.data_path, new_upper.index_path):
                    old.unlink(missing_ok=True)
            if up.index_fd is not None:
                os.close(up.index_fd)
                up.index_fd = None
            self._view = _View(layers, ro, new_upper, v.vsize)
            return sealed_path

    def close(self) -> None:
        """Close every file. In-flight reads from other threads must have finished."""
        with self._wlock:
            if self._closed:
                return
            self._closed = True
            v = self._view
            for layer in v.layers:
                layer.close()
            if v.upper_map is not None:
                mm = v.upper_map.obj
                v.upper_map.release()
                v.upper_map = None
                with contextlib.suppress(BufferError):  # slices still out: unmapped with the last
                    mm.close()  # type: ignore[attr-defined]
            if v.upper is not None:
                v.upper.close()

    def __enter__(self) -> Image:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
