"""The upper's growth cap and in-place reuse of its own data (issue 18: a guest rewriting the
same blocks must not grow its upper without bound)."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from agentenv.storage.image import Image
from agentenv.storage.upper import Upper, UpperFull

MiB = 1 << 20


def test_rewriting_the_same_blocks_does_not_grow_the_upper(tmp_path: Path) -> None:
    with Image.create([], tmp_path / "u", 64 * MiB) as image:
        for i in range(50):
            image.write(3 * MiB, bytes([i]) * MiB)  # an append-only log rewritten in place
            image.write(10 * MiB + 512 * i, bytes([i]) * 4096)  # overlapping, partly new
        used = image.upper_used
        # 1 MiB once, plus the sliding 4 KiB writes: 4 KiB + 49 new sectors appended (the
        # part already held is rewritten in place), and one index entry per append.
        assert used == MiB + 4096 + 49 * 512 + 16 * 51, used
        assert image.read(3 * MiB, MiB) == bytes([49]) * MiB
        assert image.read(10 * MiB + 512 * 49, 4096) == bytes([49]) * 4096
        # The zero-copy path (slices of the upper's mmap) sees an in-place rewrite too.
        assert b"".join(bytes(p) for p in image.read_pieces(3 * MiB, MiB)) == bytes([49]) * MiB
        image.write(3 * MiB, b"\xee" * MiB)
        assert b"".join(bytes(p) for p in image.read_pieces(3 * MiB, MiB)) == b"\xee" * MiB
        assert image.upper_used == used
        image.write(3 * MiB, bytes([49]) * MiB)
        image.flush()
    with Image.open(tmp_path / "u" / "image.json", writable=False) as again:
        assert again.read(3 * MiB, MiB) == bytes([49]) * MiB
        assert again.read(10 * MiB, 512) == bytes([0]) * 512


def test_a_write_past_the_cap_is_enospc_and_changes_nothing(tmp_path: Path) -> None:
    with Image.create([], tmp_path / "u", 64 * MiB) as image:
        image.upper_limit = 2 * MiB
        image.write(0, b"\x01" * MiB)
        with pytest.raises(UpperFull) as err:
            image.write(4 * MiB, b"\x02" * (2 * MiB))
        assert err.value.errno == errno.ENOSPC
        assert "cap is 2097152 bytes" in str(err.value)
        assert image.read(4 * MiB, 2 * MiB) == bytes(2 * MiB)
        before = image.upper_used
        image.write(0, b"\x03" * MiB)  # at the cap, rewriting its own blocks still works
        assert image.upper_used == before
        image.write(2 * MiB, b"\x04" * (MiB - 4096))  # what fits still fits
        image.upper_limit = image.upper_used + 8
        with pytest.raises(UpperFull):
            image.discard(8 * MiB, MiB)  # a zeroed extent needs an index entry: over the cap
        assert image.read(0, MiB) == b"\x03" * MiB
        image.upper_limit = None
        image.write(4 * MiB, b"\x02" * (2 * MiB))
        assert image.read(4 * MiB, 2 * MiB) == b"\x02" * (2 * MiB)


def test_a_snapshot_does_not_renew_the_cap(tmp_path: Path) -> None:
    """The cap bounds the disk's own writes in all: a sealed upper stays counted (a pause and
    resume must not hand the guest a fresh allowance), and so does a reopen that says what
    its earlier sealed uppers hold (blockd's chain_used)."""
    with Image.create([], tmp_path / "u", 16 * MiB) as image:
        image.upper_limit = MiB
        image.write(0, b"\x01" * (MiB - 8192))
        sealed_used = image.upper_used  # data plus one index entry
        image.snapshot_and_restack(tmp_path / "u" / "sealed-1.lsmt")
        assert image.upper_used == 0 and image.chain_used == sealed_used
        image.write(0, b"\x05" * 4096)  # what is left of the cap still fits
        with pytest.raises(UpperFull) as err:
            image.write(2 * MiB, b"\x06" * 8192)
        assert "cap is" in str(err.value)
        assert image.read(0, 4096) == b"\x05" * 4096
        image.flush()
    with Image.open(tmp_path / "u" / "image.json") as again:
        again.chain_used = sealed_used
        again.upper_limit = MiB
        with pytest.raises(UpperFull):
            again.write(4 * MiB, b"\x07" * 8192)
        again.chain_used = MiB  # the chain alone holds the whole cap: nothing more appends
        with pytest.raises(UpperFull):
            again.write(6 * MiB, b"\x08" * 512)
        again.write(0, b"\x09" * 4096)  # its own blocks are still rewritten in place
        assert again.read(0, 4096) == b"\x09" * 4096


def test_reuse_keeps_the_index_log_consistent_across_a_reopen(tmp_path: Path) -> None:
    up = Upper.create(tmp_path / "u", 8 * MiB)
    up.write_extent(0, b"a" * 8192)
    up.write_extent(8, b"b" * 4096)  # inside the first extent: rewritten in place
    up.write_extent(8, b"c" * 8192)  # half held (in place), half new (appended)
    up.flush()
    size = os.path.getsize(tmp_path / "u" / "upper.data")
    up.close()
    assert size == 4096 + 8192 + 4096
    again = Upper.open(tmp_path / "u", writable=False)
    try:
        pieces = again.index.lookup(0, 32)
        data = b"".join(os.pread(again.data_fd, n * 512, m * 512) for _s, n, m, _l in pieces)
        assert data == b"a" * 4096 + b"c" * 8192  # sectors 0-24 mapped, 24-32 a hole
    finally:
        again.close()
