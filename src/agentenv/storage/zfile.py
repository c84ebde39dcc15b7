"""ZFile seekable block compression (docs/overlaybd.md §7): reader and streaming writer.

Layout: header(512) | blocks, each `compressed || u32 raw-CRC32C(salt 100007)` | jump table of
N u32 stored lengths | trailer(512). Header and trailer carry a raw CRC-32C digest of all 512
bytes (digest field zeroed). The writer follows the C++ recipe (docs/overlaybd.md §7.6): header 0x13, trailer
0x16, and with overwrite_header (as `overlaybd-commit -z`) a final header 0x1B.

LZ4 output comes from the python `lz4` wheel (LZ4 1.9.x), which decodes identically to, but is
not byte-identical with, the LZ4 1.8.3 the C++ tools vendor. ZSTD blocks are one frame each at
level 3, with the content size recorded.
"""

from __future__ import annotations

import os
import struct
import threading
from bisect import bisect_right
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from itertools import accumulate
from pathlib import Path
from typing import TYPE_CHECKING, BinaryIO, Literal

import lz4.block
import numpy as np
import zstandard
from crc32c import crc32c as _std_crc32c

from agentenv.storage.crc import BLOCK_SALT, raw_crc32c
from agentenv.storage.errors import LayerFormatError

if TYPE_CHECKING:
    from agentenv.storage.blob import BlobSource

ZF_BLOCK = 512
MAGIC0 = bytes.fromhex("5a46696c65000100")
MAGIC1 = b"tuji.yyf@Alibaba"
STRUCT_SIZE = 96

FLAG_HEADER = 0x01
FLAG_DATA = 0x02
FLAG_SEALED = 0x04
FLAG_HEADER_OVERWRITE = 0x08
FLAG_DIGEST = 0x10
FLAG_INDEX_COMPRESSED = 0x20

ALGO_LZ4 = 1
ALGO_ZSTD = 2
ALGO_BY_NAME = {"lz4": ALGO_LZ4, "zstd": ALGO_ZSTD}
NAME_BY_ALGO = {v: k for k, v in ALGO_BY_NAME.items()}
ZSTD_LEVEL = 3
MAX_BLOCKS = 1_000_000_000
READ_BATCH = 1 << 20  # compressed bytes fetched per pread on the read path

# magic0, magic1, size, digest, flags, index_offset, index_size, original_file_size,
# index_crc, reserved_0, block_size, algo, level, use_dict, pad, reserved, dict_size, verify, pad7
_ZH = struct.Struct("<8s16sIIQQQQIIIBBBBIIB7s")
assert _ZH.size == STRUCT_SIZE

_MASK = 0xFFFFFFFF
_SALT_INV = (~BLOCK_SALT) & _MASK


@dataclass(frozen=True)
class ZFileHeader:
    flags: int
    index_offset: int = 0
    index_size: int = 0
    original_file_size: int = 0
    index_crc: int = 0
    block_size: int = 4096
    algo: int = ALGO_LZ4
    level: int = 0
    dict_size: int = 0
    verify: bool = True
    digest: int = 0

    def pack(self) -> bytes:
        """512 bytes with the digest computed over all of them (digest field zero)."""
        def build(digest: int) -> bytes:
            raw = _ZH.pack(MAGIC0, MAGIC1, STRUCT_SIZE, digest, self.flags, self.index_offset,
                           self.index_size, self.original_file_size, self.index_crc, 0,
                           self.block_size, self.algo, self.level, 0, 0, 0, self.dict_size,
                           int(self.verify), bytes(7))
            return raw + bytes(ZF_BLOCK - STRUCT_SIZE)
        return build(raw_crc32c(build(0)))

    @classmethod
    def unpack(cls, block: bytes, path: Path | str, offset: int) -> ZFileHeader:
        if len(block) < ZF_BLOCK:
            raise LayerFormatError(path, offset, "truncated ZFile header/trailer")
        (m0, m1, size, digest, flags, ioff, isize, orig, icrc, _r0, bs, algo, level, _ud, _p,
         _r, dsize, verify, _p7) = _ZH.unpack_from(block)
        if m0 != MAGIC0 or m1 != MAGIC1:
            raise LayerFormatError(path, offset, "bad ZFile magic")
        if size != STRUCT_SIZE:
            raise LayerFormatError(path, offset + 24, f"ZFile header size {size}, expected 96")
        return cls(flags, ioff, isize, orig, icrc, bs, algo, level, dsize, bool(verify), digest)

    @staticmethod
    def digest_ok(block: bytes) -> bool:
        stored = int.from_bytes(block[28:32], "little")
        return raw_crc32c(block[:28] + b"\0\0\0\0" + block[32:ZF_BLOCK]) == stored


def is_zfile(block: bytes) -> bool:
    """ZFile magic and the header flag in the first 512 bytes (C++ is_zfile)."""
    if len(block) < STRUCT_SIZE or block[:8] != MAGIC0 or block[8:24] != MAGIC1:
        return False
    return bool(int.from_bytes(block[32:40], "little") & FLAG_HEADER)


class ZFileReader:
    """Random access to the uncompressed stream of a ZFile that starts at `base` in `fd`.

    `readinto(pos, buf)` decompresses only the blocks the range touches, verifying each
    block's CRC when the file has them; it returns the bytes filled (short at the end of the
    stream). Safe to call from several threads (per-thread zstd contexts).
    """

    def __init__(self, path: Path | str, fd: int | BlobSource, base: int,
                 stream_size: int) -> None:
        self.path = str(path)
        # A local file's descriptor, or a blob read through its own pread (a remote layer).
        self.fd = fd if isinstance(fd, int) else -1
        self.blob = None if isinstance(fd, int) else fd
        self._pread: Callable[[int, int], bytes] = (
            partial(os.pread, fd) if isinstance(fd, int) else fd.pread)
        self.base = base
        self.stream_size = stream_size
        if stream_size < 2 * ZF_BLOCK:
            raise LayerFormatError(path, base, f"truncated ZFile: {stream_size} bytes")
        hblock = self._pread(ZF_BLOCK, base)
        header = ZFileHeader.unpack(hblock, path, base)
        if not header.flags & FLAG_HEADER:
            raise LayerFormatError(path, base, "ZFile header block lacks the header flag")
        if header.flags & FLAG_DIGEST and not ZFileHeader.digest_ok(hblock):
            raise LayerFormatError(path, base + 28, "ZFile header digest (CRC) mismatch")
        self.header = header
        info = header
        self.trailer: ZFileHeader | None = None
        if not header.flags & FLAG_HEADER_OVERWRITE:
            toff = base + stream_size - ZF_BLOCK
            tblock = self._pread(ZF_BLOCK, toff)
            trailer = ZFileHeader.unpack(tblock, path, toff)
            need = FLAG_DATA | FLAG_SEALED
            if trailer.flags & FLAG_HEADER or trailer.flags & need != need:
                raise LayerFormatError(path, toff, f"bad ZFile trailer flags {trailer.flags:#x}")
            self.trailer = trailer
            info = trailer
        self.info = info
        if info.flags & FLAG_INDEX_COMPRESSED:
            raise LayerFormatError(path, base + 32, "compressed ZFile index is not supported")
        if info.algo not in NAME_BY_ALGO:
            raise LayerFormatError(path, base + 76, f"unsupported ZFile algorithm {info.algo}")
        bs = info.block_size
        if bs < 512 or bs & (bs - 1):
            raise LayerFormatError(path, base + 72, f"bad ZFile block size {bs}")
        nblocks = info.index_size
        trailer_off = stream_size - ZF_BLOCK
        if nblocks > MAX_BLOCKS or info.index_offset + 4 * nblocks > trailer_off:
            raise LayerFormatError(
                path, base + info.index_offset,
                f"jump table of {nblocks} entries at {info.index_offset} runs past the trailer "
                f"at {trailer_off}")
        if nblocks != (info.original_file_size + bs - 1) // bs:
            raise LayerFormatError(
                path, base + 48,
                f"jump table has {nblocks} blocks but original size {info.original_file_size} "
                f"needs {(info.original_file_size + bs - 1) // bs}")
        table = self._pread(4 * nblocks, base + info.index_offset)
        if len(table) != 4 * nblocks:
            raise LayerFormatError(path, base + info.index_offset, "truncated ZFile jump table")
        if info.flags & FLAG_DIGEST and raw_crc32c(table) != info.index_crc:
            raise LayerFormatError(path, base + info.index_offset, "ZFile jump table CRC mismatch")
        lengths = np.frombuffer(table, dtype="<u4")
        min_len = 5 if info.verify else 1
        if nblocks and int(lengths.min()) < min_len:
            bad = int(np.argmax(lengths < min_len))
            raise LayerFormatError(path, base + info.index_offset + 4 * bad,
                                   f"jump table entry {bad} has impossible length {lengths[bad]}")
        first = base + ZF_BLOCK + info.dict_size
        offsets = list(accumulate(lengths.tolist(), initial=first))
        if offsets[-1] != base + info.index_offset:
            raise LayerFormatError(
                path, base + info.index_offset,
                f"jump table does not add up: blocks end at {offsets[-1] - base}, "
                f"index starts at {info.index_offset}")
        self.offsets = offsets
        self.block_size = bs
        self.nblocks = nblocks
        self.size = info.original_file_size
        self.verify = info.verify
        self.algo = info.algo
        self._local = threading.local()

    def _decompressor(self) -> Callable[[bytes | memoryview, int], bytes]:
        """A per-thread `decompress(compressed, expected_size)` (zstd contexts are not
        thread-safe). Both codecs take the expected size as their second argument."""
        fn = getattr(self._local, "fn", None)
        if fn is None:
            if self.algo == ALGO_ZSTD:
                # ZSTD frames record their content size; the second argument caps the output.
                fn = zstandard.ZstdDecompressor().decompress
            else:
                fn = lz4.block.decompress
            self._local.fn = fn
        return fn

    def readinto(self, pos: int, buf: memoryview) -> int:
        end = min(pos + len(buf), self.size)
        if pos >= end:
            return 0
        bs = self.block_size
        offs = self.offsets
        pread = self._pread
        verify = self.verify
        decompress = self._decompressor()
        b = pos // bs
        last = (end - 1) // bs
        out = 0
        while b <= last:
            # Fetch a run of whole compressed blocks with one pread.
            stop = bisect_right(offs, offs[b] + READ_BATCH, b + 2) - 2
            stop = min(max(stop, b), last)
            base_off = offs[b]
            nbytes = offs[stop + 1] - base_off
            raw = pread(nbytes, base_off)
            if len(raw) != nbytes:
                raise LayerFormatError(self.path, base_off + len(raw), "ZFile data truncated")
            rv = memoryview(raw)
            for k in range(b, stop + 1):
                a = offs[k] - base_off
                z = offs[k + 1] - base_off
                blk_start = k * bs
                blen = min(bs, self.size - blk_start)
                if verify:
                    comp = rv[a : z - 4]
                    stored = int.from_bytes(rv[z - 4 : z], "little")
                    if (~_std_crc32c(comp, _SALT_INV)) & _MASK != stored:
                        raise LayerFormatError(self.path, offs[k],
                                               f"ZFile block {k} CRC mismatch")
                else:
                    comp = rv[a:z]
                try:
                    data = decompress(comp, blen)
                except (zstandard.ZstdError, lz4.block.LZ4BlockError, ValueError) as exc:
                    raise LayerFormatError(self.path, offs[k],
                                           f"ZFile block {k} does not decompress: {exc}") from exc
                if len(data) != blen:
                    raise LayerFormatError(self.path, offs[k],
                                           f"ZFile block {k} decompressed to {len(data)} bytes, "
                                           f"expected {blen}")
                s = pos - blk_start if pos > blk_start else 0
                e = end - blk_start if end - blk_start < blen else blen
                if s == 0 and e == blen:
                    buf[out : out + blen] = data
                else:
                    buf[out : out + e - s] = memoryview(data)[s:e]
                out += e - s
            b = stop + 1
        return out

    def pread(self, length: int, pos: int) -> bytes:
        """Up to `length` bytes at `pos` (short at the end of the stream)."""
        bs = self.block_size
        b = pos // bs
        if length > 0 and pos >= 0 and pos + length <= self.size and (pos + length - 1) // bs == b:
            # Inside one block: one pread, one CRC, one decompress, no extra buffer.
            offs = self.offsets
            a, z = offs[b], offs[b + 1]
            raw = self._pread(z - a, a)
            if len(raw) != z - a:
                raise LayerFormatError(self.path, a + len(raw), "ZFile data truncated")
            if self.verify:
                comp = memoryview(raw)[:-4]
                if (~_std_crc32c(comp, _SALT_INV)) & _MASK != int.from_bytes(raw[-4:], "little"):
                    raise LayerFormatError(self.path, a, f"ZFile block {b} CRC mismatch")
            else:
                comp = memoryview(raw)
            blen = min(bs, self.size - b * bs)
            try:
                data = self._decompressor()(comp, blen)
            except (zstandard.ZstdError, lz4.block.LZ4BlockError, ValueError) as exc:
                raise LayerFormatError(self.path, a,
                                       f"ZFile block {b} does not decompress: {exc}") from exc
            if len(data) != blen:
                raise LayerFormatError(self.path, a, f"ZFile block {b} decompressed to "
                                                     f"{len(data)} bytes, expected {blen}")
            s = pos - b * bs
            return data if s == 0 and length == blen else data[s : s + length]
        buf = bytearray(length)
        n = self.readinto(pos, memoryview(buf))
        return bytes(buf[:n])


def make_compressor(algo: Literal["zstd", "lz4"]) -> Callable[[bytes | memoryview], bytes]:
    if algo == "zstd":
        cctx = zstandard.ZstdCompressor(level=ZSTD_LEVEL, write_content_size=True,
                                        write_checksum=False)
        return cctx.compress
    if algo == "lz4":
        def lz4_compress(block: bytes | memoryview) -> bytes:
            return lz4.block.compress(block, mode="default", store_size=False)
        return lz4_compress
    raise ValueError(f"unknown compression {algo!r} (zstd or lz4)")


class ZFileWriter:
    """Streams a ZFile into the binary file `out`, starting at its current position.

    `write()` takes the uncompressed stream in any chunking; `close()` appends the jump table
    and trailer and (overwrite_header) rewrites the header, leaving `out` positioned at the end.
    `compressor` may be injected (tests use it to reproduce C++ LZ4 1.8.3 blocks).
    """

    def __init__(self, out: BinaryIO, algo: Literal["zstd", "lz4"], *, block_size: int = 4096,
                 verify: bool = True, overwrite_header: bool = True,
                 compressor: Callable[[bytes | memoryview], bytes] | None = None) -> None:
        if block_size < 4096 or block_size > 65536 or block_size & (block_size - 1):
            raise ValueError("ZFile block size must be a power of two from 4 KiB to 64 KiB")
        self.out = out
        self.start = out.tell()
        self.algo = ALGO_BY_NAME[algo]
        self.block_size = block_size
        self.verify = verify
        self.overwrite_header = overwrite_header
        self.compress = compressor or make_compressor(algo)
        self.lengths: list[int] = []
        self.pending = bytearray()
        self.original_size = 0
        self.written = ZF_BLOCK
        self.out.write(self._header(FLAG_HEADER | FLAG_DATA | FLAG_DIGEST).pack())

    def _header(self, flags: int, **fields: int) -> ZFileHeader:
        return ZFileHeader(flags=flags, block_size=self.block_size, algo=self.algo,
                           verify=self.verify, **fields)  # type: ignore[arg-type]

    def _emit(self, block: bytes | memoryview) -> None:
        comp = self.compress(block)
        self.out.write(comp)
        n = len(comp)
        if self.verify:
            self.out.write(raw_crc32c(comp, BLOCK_SALT).to_bytes(4, "little"))
            n += 4
        self.lengths.append(n)
        self.written += n

    def write(self, data: bytes | bytearray | memoryview) -> None:
        self.original_size += len(data)
        bs = self.block_size
        mv = memoryview(data)
        if self.pending:
            need = bs - len(self.pending)
            self.pending += mv[:need]
            mv = mv[need:]
            if len(self.pending) < bs:
                return
            self._emit(bytes(self.pending))
            self.pending.clear()
        full = len(mv) - len(mv) % bs
        for i in range(0, full, bs):
            self._emit(mv[i : i + bs])
        if full < len(mv):
            self.pending += mv[full:]

    def close(self) -> int:
        """Finish the file; returns its total size."""
        if self.pending:
            self._emit(bytes(self.pending))
            self.pending.clear()
        table = np.asarray(self.lengths, dtype="<u4").tobytes()
        index_offset = self.written
        self.out.write(table)
        fields = dict(index_offset=index_offset, index_size=len(self.lengths),
                      original_file_size=self.original_size, index_crc=raw_crc32c(table))
        self.out.write(self._header(FLAG_DATA | FLAG_SEALED | FLAG_DIGEST, **fields).pack())
        total = index_offset + len(table) + ZF_BLOCK
        if self.overwrite_header:
            flags = FLAG_HEADER | FLAG_DATA | FLAG_HEADER_OVERWRITE | FLAG_DIGEST
            self.out.seek(self.start)
            self.out.write(self._header(flags, **fields).pack())
            self.out.seek(self.start + total)
        return total
