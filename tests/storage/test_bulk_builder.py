"""LayerBuilder's bulk path (`add_extents`, `reserve_extents` + `write_data`, O_DIRECT): the
layer must read exactly like one built extent by extent, pass the C++ open checks, and keep
every mapping within the LSMT length limit."""

from __future__ import annotations

import mmap
import os
import random
from pathlib import Path

import numpy as np
import pytest

from agentenv.storage import builder as builder_mod
from agentenv.storage.builder import BULK_MAX_SECTORS, LayerBuilder
from agentenv.storage.export import export_raw
from agentenv.storage.image import Image
from agentenv.storage.layer import open_layer
from agentenv.storage.lsmt import (
    FLAG_DATA,
    FLAG_HEADER,
    FLAG_SEALED,
    HT_BLOCK,
    MAX_LENGTH,
    SECTOR,
    HeaderTrailer,
)

PAGE = 4096
VSIZE = 64 << 20
SMALL_VSIZE = 24 << 20  # the randomised comparison: build, export and compare this much


def _read_stack(layers: list[Path], out: Path, vsize: int = VSIZE) -> bytes:
    image = Image.create(layers, None, vsize)
    try:
        export_raw(image, out)
    finally:
        image.close()
    return out.read_bytes()


def _random_extents(rng: random.Random, count: int, vsize: int) -> list[tuple[int, int, bool]]:
    """(byte offset, byte length, zeroed), ascending, page sized; some adjacent, some long
    enough to cross the mapping length limit."""
    extents: list[tuple[int, int, bool]] = []
    pos = rng.randrange(0, 64) * PAGE
    big = 2  # runs longer than BULK_MAX_SECTORS (2040 pages), one data, one zeroed
    for i in range(count):
        pages = rng.choice([1, 1, 2, 7, 33, 150])
        zeroed = rng.random() < 0.3
        if big and i % 20 == 10:
            pages, zeroed, big = 2100 + rng.randrange(300), big == 2, big - 1
        if pos + pages * PAGE > vsize:
            continue
        extents.append((pos, pages * PAGE, zeroed))
        pos += pages * PAGE + rng.choice([0, 0, PAGE, 5 * PAGE, 64 * PAGE])
    return extents


def _check_layer(path: Path, vsize: int = VSIZE) -> list[tuple[int, int, int, bool]]:
    """C++ open checks (open_layer) plus the committed-layer layout of docs/overlaybd.md §4.4;
    returns the index rows (offset, length, moffset, zeroed) in sectors."""
    layer = open_layer(path)
    try:
        assert layer.header.flags == FLAG_HEADER | FLAG_DATA | FLAG_SEALED
        assert layer.trailer.flags == FLAG_DATA | FLAG_SEALED
        assert layer.trailer.index_size % 256 == 0
        size = path.stat().st_size
        assert layer.trailer.index_offset + 16 * layer.trailer.index_size == size - HT_BLOCK
        rows = [(s, n, m, lay == -1) for s, n, m, lay in layer.index.entries()]
    finally:
        layer.close()
    trailer = HeaderTrailer.unpack(path.read_bytes()[-HT_BLOCK:], path, 0)
    assert trailer.virtual_size == vsize
    for _off, length, _moff, _z in rows:
        assert 0 < length <= BULK_MAX_SECTORS < MAX_LENGTH
    return rows


@pytest.mark.parametrize("seed", [1, 2])
@pytest.mark.parametrize("aligned", [True, False])
def test_bulk_matches_per_extent_builder(tmp_path: Path, seed: int, aligned: bool) -> None:
    rng = random.Random(seed)
    extents = _random_extents(rng, 80, SMALL_VSIZE)
    payload = {off: rng.randbytes(n) for off, n, z in extents if not z}

    ref = tmp_path / "ref.layer"
    with LayerBuilder(ref, SMALL_VSIZE) as builder:
        for off, n, z in extents:
            if z:
                builder.add_zero(off, n)
            else:
                builder.add(off, payload[off])

    bulk = tmp_path / "bulk.layer"
    keep: list[mmap.mmap] = []
    with LayerBuilder(bulk, SMALL_VSIZE, direct=True) as builder:
        # Several calls of varying size; aligned data comes from page-aligned mmaps (O_DIRECT),
        # unaligned from bytes slices at odd addresses (the buffered fallback).
        i = 0
        while i < len(extents):
            part = extents[i:i + rng.randint(1, 20)]
            i += len(part)
            bufs: list[memoryview | bytes] = []
            for off, n, z in part:
                if z:
                    continue
                if aligned:
                    m = mmap.mmap(-1, n)
                    m[:] = payload[off]
                    keep.append(m)
                    bufs.append(memoryview(m))
                else:
                    bufs.append(memoryview(b"x" + payload[off])[1:])
            builder.add_extents(np.array([e[0] for e in part]), np.array([e[1] for e in part]),
                                np.array([e[2] for e in part]), bufs)
            for v in bufs:
                if isinstance(v, memoryview):
                    v.release()
        if aligned and builder.direct:
            assert (builder.direct_bytes, builder.buffered_bytes) == (len(b"".join(payload.values())), 0)
        if not aligned:  # odd addresses: O_DIRECT refuses them, the page cache takes them
            assert (builder.direct_bytes, builder.buffered_bytes) == (0, len(b"".join(payload.values())))
    for m in keep:
        m.close()

    rows = _check_layer(bulk, SMALL_VSIZE)
    # Zeroed extents become zeroed mappings, not data.
    data_bytes = sum(n for _o, n, z in extents if not z)
    assert sum(n for _o, n, _m, z in rows if not z) * SECTOR == data_bytes
    assert bulk.stat().st_size == ref.stat().st_size  # same data area, same padded index size
    lower = tmp_path / "lower.layer"
    with LayerBuilder(lower, SMALL_VSIZE) as builder:  # 0xAA everywhere: zeroed maps hide it
        for pos in range(0, SMALL_VSIZE, 4 << 20):
            builder.add(pos, b"\xaa" * (4 << 20))
    assert (_read_stack([lower, bulk], tmp_path / "a.raw", SMALL_VSIZE)
            == _read_stack([lower, ref], tmp_path / "b.raw", SMALL_VSIZE))


def test_long_runs_split_at_the_length_limit(tmp_path: Path) -> None:
    """Adjacent extents of one call join; runs are cut at BULK_MAX_SECTORS (data and zeroed)."""
    out = tmp_path / "l.layer"
    a, b = 10000 * SECTOR, 30000 * SECTOR
    data = mmap.mmap(-1, a + b)
    data[:] = bytes(range(256)) * ((a + b) // 256)
    z = 40000 * SECTOR
    with LayerBuilder(out, VSIZE, direct=True) as builder:
        builder.add_extents(np.array([0, a, a + b]), np.array([a, b, z]),
                            np.array([False, False, True]), [data])
    rows = _check_layer(out)
    full = BULK_MAX_SECTORS
    assert [(o, n, zz) for o, n, _m, zz in rows] == [
        (0, full, False), (full, full, False), (2 * full, 40000 - 2 * full, False),
        (40000, full, True), (40000 + full, full, True), (40000 + 2 * full, 40000 - 2 * full, True)]
    assert [m for _o, _n, m, zz in rows if not zz] == [8, 8 + full, 8 + 2 * full]
    assert all(m == 8 + 40000 for _o, _n, m, zz in rows if zz)  # the next data sector
    # The same extents in many calls (as memory capture batches them) give the same index.
    split = tmp_path / "split.layer"
    with LayerBuilder(split, VSIZE, direct=True) as builder, memoryview(data) as view:
        step = 4096 * SECTOR
        for pos in range(0, a + b, step):
            builder.add_extents(np.array([pos]), np.array([min(step, a + b - pos)]),
                                np.array([False]), [view[pos:pos + step]])
        for pos in range(a + b, a + b + z, step):
            builder.add_extents(np.array([pos]), np.array([min(step, a + b + z - pos)]),
                                np.array([True]), [])
    assert _check_layer(split) == rows
    image = Image.create([out], None, VSIZE)
    try:
        assert image.read(0, a + b) == bytes(data)
        assert image.read(a + b, z) == bytes(z)
    finally:
        image.close()
    data.close()


def test_mixed_with_per_extent_calls_and_threads(tmp_path: Path) -> None:
    """add(), add_extents(), reserve_extents() + write_data() out of order, add_zero()."""
    out = tmp_path / "m.layer"
    with LayerBuilder(out, VSIZE, direct=True) as builder:
        builder.add(0, b"a" * PAGE)
        builder.add_extents(np.array([PAGE]), np.array([2 * PAGE]), np.array([False]),
                            [b"b" * (2 * PAGE)])
        pos1, n1 = builder.reserve_extents(np.array([8 * PAGE]), np.array([PAGE]), np.array([False]))
        pos2, n2 = builder.reserve_extents(np.array([9 * PAGE, 12 * PAGE]),
                                           np.array([2 * PAGE, PAGE]), np.array([True, False]))
        assert (n1, n2) == (PAGE, PAGE) and pos2 == pos1 + PAGE
        builder.write_data([b"d" * PAGE], pos2)  # writes may land in any order
        builder.write_data([b"c" * PAGE], pos1)
        builder.add(13 * PAGE, b"e" * 512)
        builder.add_zero(14 * PAGE, PAGE)
    _check_layer(out)
    image = Image.create([out], None, VSIZE)
    try:
        got = image.read(0, 15 * PAGE)
    finally:
        image.close()
    assert got == (b"a" * PAGE + b"b" * 2 * PAGE + bytes(5 * PAGE) + b"c" * PAGE
                   + bytes(3 * PAGE) + b"d" * PAGE + b"e" * 512 + bytes(PAGE - 512 + PAGE))


def test_bulk_rejects_bad_extents(tmp_path: Path) -> None:
    out = tmp_path / "bad.layer"
    with LayerBuilder(out, VSIZE, direct=True) as builder:
        builder.add_extents(np.array([8 * PAGE]), np.array([PAGE]), np.array([False]),
                            [b"x" * PAGE])
        with pytest.raises(ValueError, match="backwards"):
            builder.add_extents(np.array([PAGE]), np.array([PAGE]), np.array([True]), [])
        with pytest.raises(ValueError, match="overlap"):
            builder.add_extents(np.array([9 * PAGE, 9 * PAGE + 512]), np.array([PAGE, PAGE]),
                                np.array([True, True]), [])
        with pytest.raises(ValueError, match="not sector aligned"):
            builder.add_extents(np.array([20 * PAGE + 1]), np.array([PAGE]), np.array([True]), [])
        with pytest.raises(ValueError, match="data buffers hold"):
            builder.add_extents(np.array([20 * PAGE]), np.array([PAGE]), np.array([False]),
                                [b"x" * 512])
        with pytest.raises(ValueError, match="beyond"):
            builder.add_extents(np.array([(1 << 50) * SECTOR]), np.array([PAGE]), np.array([True]), [])
    _check_layer(out)  # the rejected calls changed nothing
    with LayerBuilder(tmp_path / "z.layer", VSIZE, compress="zstd") as builder, \
            pytest.raises(ValueError, match="compression"):
        builder.add_extents(np.array([0]), np.array([PAGE]), np.array([True]), [])


def test_failed_bulk_build_leaves_nothing(tmp_path: Path) -> None:
    out = tmp_path / "f.layer"
    with pytest.raises(RuntimeError), LayerBuilder(out, VSIZE, direct=True) as builder:
        builder.add_extents(np.array([0]), np.array([PAGE]), np.array([False]), [b"x" * PAGE])
        raise RuntimeError("capture failed")
    assert list(tmp_path.iterdir()) == []


def test_short_writes_are_resumed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """pwritev may write less than asked (signals, limits); the rest must follow at the right
    place. (Injected: a regular file gives no short writes on demand.)"""
    rng = random.Random(9)
    real = os.pwritev

    def short_pwritev(fd: int, buffers: list[memoryview], pos: int) -> int:
        want = sum(b.nbytes for b in buffers)
        cut = rng.randint(1, want)
        joined = b"".join(bytes(b) for b in buffers)[:cut]
        return real(fd, [joined], pos)

    monkeypatch.setattr(builder_mod.os, "pwritev", short_pwritev)
    path = tmp_path / "s.bin"
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        parts = [rng.randbytes(rng.randint(1, 5000)) for _ in range(40)]
        builder_mod._pwrite_all(fd, [memoryview(p) for p in parts], 100)
    finally:
        os.close(fd)
    assert path.read_bytes()[100:] == b"".join(parts)
