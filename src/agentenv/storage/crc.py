"""Raw CRC-32C as overlaybd's ZFile uses it (docs/overlaybd.md §7.3).

Castagnoli polynomial with no initial inversion and no final XOR: the plain `crc32`
instruction chain. The `crc32c` package computes the standard (inverted) form, so
raw(data, init) = ~std(data, value=~init).
"""

from __future__ import annotations

from crc32c import crc32c as _std_crc32c

BLOCK_SALT = 100007
"""Initial value of every per-block CRC (the "salt", 0x000186A7)."""

_MASK = 0xFFFFFFFF


def raw_crc32c(data: bytes | bytearray | memoryview, init: int = 0) -> int:
    """Raw CRC-32C of `data` starting from `init`."""
    return (~_std_crc32c(data, value=(~init) & _MASK)) & _MASK
