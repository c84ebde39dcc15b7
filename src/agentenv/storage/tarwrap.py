"""The overlaybd tar wrapper (docs/overlaybd.md §8): pax header, pax record, ustar header, payload.

Writer output is byte-identical to `overlaybd-commit -t` (uname/gname root, mode 0100644,
mtime 0). The reader accepts any single-entry ustar/pax stream and reports where the payload
sits and how long it is.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from agentenv.storage.errors import LayerFormatError

BLOCK = 512
PAYLOAD_OFFSET_PAX = 3 * BLOCK
ENTRY_NAME = b"overlaybd.commit"
PAX_NAME = b"overlaybd.pax"


def _oct8(value: int) -> bytes:
    return f"{value:6o} ".encode() + b"\0"


def _oct12(value: int) -> bytes:
    return f"{value:11o} ".encode()


def _checksum(block: bytearray) -> int:
    return sum(block[:148]) + 8 * 0x20 + sum(block[156:])


def _header(name: bytes, *, mode: bytes, uid: bytes, gid: bytes, size: int, mtime: bytes,
            typeflag: bytes, owner: bytes) -> bytes:
    block = bytearray(BLOCK)
    block[0 : len(name)] = name
    block[100:108] = mode
    block[108:116] = uid
    block[116:124] = gid
    block[124:136] = _oct12(size)
    block[136:148] = mtime
    block[156:157] = typeflag
    block[257:263] = b"ustar\0"
    block[263:265] = b"00"
    block[265 : 265 + len(owner)] = owner
    block[297 : 297 + len(owner)] = owner
    block[148:156] = _oct8(_checksum(block))
    return bytes(block)


def pax_size_record(payload_size: int) -> bytes:
    """`"<L> size=<n>\\n"` where L counts the record's own length including its digits."""
    body = f" size={payload_size}\n"
    length = len(body) + 1
    while len(str(length)) + len(body) != length:
        length = len(str(length)) + len(body)
    return f"{length}{body}".encode()


def tar_prefix(payload_size: int) -> bytes:
    """The 1536 bytes before the payload: pax header, pax data block, ustar header."""
    record = pax_size_record(payload_size)
    zero8 = bytes(8)
    pax = _header(PAX_NAME, mode=zero8, uid=zero8, gid=zero8, size=len(record),
                  mtime=bytes(12), typeflag=b"x", owner=b"")
    data = record + bytes(BLOCK - len(record))
    ustar = _header(ENTRY_NAME, mode=_oct8(0o100644), uid=_oct8(0), gid=_oct8(0), size=0,
                    mtime=_oct12(0), typeflag=b"0", owner=b"root")
    return pax + data + ustar


def tar_suffix(payload_size: int) -> bytes:
    """Zero padding of the payload to 512 bytes, then the two zero end-of-archive blocks."""
    return bytes((-payload_size) % BLOCK) + bytes(2 * BLOCK)


def wrap_bytes(payload: bytes) -> bytes:
    return tar_prefix(len(payload)) + payload + tar_suffix(len(payload))


@dataclass(frozen=True)
class TarEntry:
    payload_offset: int
    payload_size: int
    has_pax: bool


def _parse_octal(field: bytes) -> int | None:
    text = field.split(b"\0", 1)[0].strip()
    if not text:
        return 0
    try:
        return int(text, 8)
    except ValueError:
        return None


def is_tar_header(block: bytes) -> bool:
    """Magic `ustar` at 257, version `00` at 263 and a valid checksum (docs/overlaybd.md §1)."""
    if len(block) < BLOCK or block[257:262] != b"ustar" or block[263:265] != b"00":
        return False
    stored = _parse_octal(block[148:156])
    return stored is not None and stored == _checksum(bytearray(block[:BLOCK]))


def read_tar_entry(fd: int | Callable[[int, int], bytes], path: Path | str,
                   file_size: int) -> TarEntry | None:
    """Parse the wrapper at the start of `fd` (a file descriptor, or a `pread(length, offset)`
    of a blob); None when the file is not a tar stream."""
    pread = (lambda n, off: os.pread(fd, n, off)) if isinstance(fd, int) else fd
    block0 = pread(BLOCK, 0)
    if not is_tar_header(block0):
        return None
    size = _parse_octal(block0[124:136])
    if size is None:
        raise LayerFormatError(path, 124, "tar header size field is not octal")
    if block0[156:157] in (b"x", b"g"):
        pax_blocks = (size + BLOCK - 1) // BLOCK
        pax = pread(size, BLOCK)
        if len(pax) < size:
            raise LayerFormatError(path, BLOCK, "truncated pax header data")
        payload_size: int | None = None
        for record in pax.split(b"\n"):
            _, _, kv = record.partition(b" ")
            key, _, value = kv.partition(b"=")
            if key == b"size":
                try:
                    payload_size = int(value)
                except ValueError as exc:
                    raise LayerFormatError(path, BLOCK, f"bad pax size record {record!r}") from exc
        entry_off = BLOCK + pax_blocks * BLOCK
        entry = pread(BLOCK, entry_off)
        if not is_tar_header(entry):
            raise LayerFormatError(path, entry_off, "no valid ustar header after the pax header")
        if payload_size is None:
            payload_size = _parse_octal(entry[124:136])
            if payload_size is None:
                raise LayerFormatError(path, entry_off + 124, "tar size field is not octal")
        result = TarEntry(entry_off + BLOCK, payload_size, True)
    else:
        result = TarEntry(BLOCK, size, False)
    if result.payload_offset + result.payload_size > file_size:
        raise LayerFormatError(
            path,
            result.payload_offset,
            f"truncated tar: payload of {result.payload_size} bytes does not fit in the "
            f"{file_size}-byte file",
        )
    return result
