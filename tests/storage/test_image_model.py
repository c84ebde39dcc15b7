"""Property tests: an Image against a model (a bytearray of the virtual disk).

Random writes (unaligned too), discards, write-zeroes, flushes, seal/restack across many
layers, commits of the upper, close + reopen from disk; every step is followed by reads
checked against the model.
"""

from __future__ import annotations

import random
import tempfile
import threading
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentenv.storage.builder import LayerBuilder, commit_upper
from agentenv.storage.errors import ImageUsageError
from agentenv.storage.image import Image
from agentenv.storage.lsmt import ZEROED, FlatIndex, _overlay_arrays, _to_arrays, overlay
from agentenv.storage.upper import Upper

VSIZE = 192 * 1024


def _base_layers(root: Path, model: bytearray, rng: random.Random) -> list[Path]:
    """Two lowers: a plain one and a zstd ZFile, with data and zeroed extents."""
    paths = []
    for i, compress in enumerate((None, "zstd")):
        path = root / f"base{i}"
        with LayerBuilder(path, VSIZE, compress=compress) as builder:  # type: ignore[arg-type]
            pos = rng.randrange(0, 8) * 4096
            while pos < VSIZE:
                n = min(rng.randrange(1, 6) * 4096, VSIZE - pos)
                if rng.random() < 0.25:
                    builder.add_zero(pos, n)
                    model[pos : pos + n] = bytes(n)
                else:
                    data = rng.randbytes(n)
                    builder.add(pos, data)
                    model[pos : pos + n] = data
                pos += n + rng.randrange(0, 6) * 4096
        paths.append(path)
    return paths


_offsets = st.integers(0, VSIZE - 1)
_op = st.one_of(
    st.tuples(st.just("write"), _offsets, st.integers(1, 20000), st.integers(0, 255)),
    st.tuples(st.just("write_aligned"), st.integers(0, VSIZE // 512 - 1), st.integers(1, 40),
              st.integers(0, 255)),
    st.tuples(st.just("discard"), _offsets, st.integers(1, 40000), st.just(0)),
    st.tuples(st.just("write_zeroes"), _offsets, st.integers(1, 40000), st.just(0)),
    st.tuples(st.just("flush"), st.just(0), st.just(0), st.just(0)),
    st.tuples(st.just("snapshot"), st.just(0), st.just(0), st.just(0)),
    st.tuples(st.just("commit"), st.just(0), st.just(0), st.just(0)),
    st.tuples(st.just("reopen"), st.just(0), st.just(0), st.just(0)),
)


def _check(image: Image, model: bytearray, rng: random.Random) -> None:
    assert image.read(0, VSIZE) == bytes(model)
    for _ in range(3):
        off = rng.randrange(0, VSIZE)
        n = rng.randrange(0, min(9000, VSIZE - off) + 1)
        assert image.read(off, n) == bytes(model[off : off + n])
        buf = bytearray(b"\xee" * n)
        image.readinto(off, buf)
        assert buf == model[off : off + n]
        assert b"".join(image.read_pieces(off, n)) == bytes(model[off : off + n])
    assert b"".join(image.read_pieces(0, VSIZE)) == bytes(model)


@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
@given(ops=st.lists(_op, min_size=1, max_size=25), seed=st.integers(0, 2**32 - 1))
def test_image_matches_model(ops: list[tuple[str, int, int, int]], seed: int) -> None:
    rng = random.Random(seed)
    model = bytearray(VSIZE)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        lowers = _base_layers(root, model, rng)
        upper_dir = root / "upper0"
        image = Image.create(lowers, upper_dir)
        generation = 0
        try:
            _check(image, model, rng)
            for step, (kind, a, b, value) in enumerate(ops):
                if kind == "write":
                    n = min(b, VSIZE - a)
                    data = bytes([value]) * n if value % 3 else rng.randbytes(n)
                    image.write(a, data)
                    model[a : a + n] = data
                elif kind == "write_aligned":
                    off = a * 512
                    n = min(b * 512, VSIZE - off)
                    data = rng.randbytes(n)
                    image.write(off, data)
                    model[off : off + n] = data
                elif kind in ("discard", "write_zeroes"):
                    n = min(b, VSIZE - a)
                    getattr(image, kind)(a, n)
                    model[a : a + n] = bytes(n)
                elif kind == "flush":
                    image.flush()
                elif kind == "snapshot":
                    sealed = image.snapshot_and_restack(root / f"sealed{step}")
                    assert image.lowers[-1] == sealed
                elif kind == "commit":
                    image.flush()
                    committed = commit_upper(image.upper_dir, root / f"commit{step}",  # type: ignore[arg-type]
                                             compress=rng.choice([None, "lz4", "zstd"]),
                                             tar=rng.random() < 0.5)
                    stack = [*image.lowers, committed]
                    image.close()
                    generation += 1
                    image = Image.create(stack, root / f"upper{generation}")
                elif kind == "reopen":
                    config = image.config_path
                    image.close()
                    image = Image.open(config)  # type: ignore[arg-type]
                _check(image, model, rng)
            config = image.config_path
            image.close()
            image = Image.open(config, writable=False)  # type: ignore[arg-type]
            assert image.readonly
            _check(image, model, rng)
        finally:
            image.close()


def test_many_layers_and_resize(tmp_path: Path) -> None:
    """30 restacks deep, reopen, then grow and shrink the disk."""
    rng = random.Random(7)
    model = bytearray(VSIZE)
    image = Image.create([], tmp_path / "u", virtual_size=VSIZE)
    for i in range(30):
        off = rng.randrange(0, VSIZE - 8192)
        data = rng.randbytes(rng.randrange(1, 8192))
        image.write(off, data)
        model[off : off + len(data)] = data
        image.snapshot_and_restack(tmp_path / f"s{i}")
    assert len(image.lowers) == 30
    config = image.config_path
    image.close()
    image = Image.open(config)  # type: ignore[arg-type]
    assert image.read(0, VSIZE) == bytes(model)
    image.resize(2 * VSIZE)
    assert image.virtual_size == 2 * VSIZE
    assert image.read(VSIZE, VSIZE) == bytes(VSIZE)
    image.write(2 * VSIZE - 100, b"x" * 100)
    image.close()
    image = Image.open(config)  # type: ignore[arg-type]
    assert image.virtual_size == 2 * VSIZE
    assert image.read(2 * VSIZE - 100, 100) == b"x" * 100
    image.resize(VSIZE)
    assert image.read(0, VSIZE) == bytes(model)
    image.close()


def test_concurrent_reads_during_writes_and_snapshots(tmp_path: Path) -> None:
    """Readers never see a torn state: each 4 KiB block always holds one uniform value
    that was written to it, while a writer writes and restacks concurrently."""
    blocks = 64
    image = Image.create([], tmp_path / "u", virtual_size=blocks * 4096)
    written: list[set[int]] = [{0} for _ in range(blocks)]
    stop = threading.Event()
    errors: list[str] = []

    def reader(seed: int) -> None:
        rng = random.Random(seed)
        while not stop.is_set():
            first = rng.randrange(blocks)
            count = rng.randrange(1, blocks - first + 1)
            data = image.read(first * 4096, count * 4096)
            for k in range(count):
                blk = data[k * 4096 : (k + 1) * 4096]
                if blk != bytes([blk[0]]) * 4096 or blk[0] not in written[first + k]:
                    errors.append(f"block {first + k} torn or unknown")
                    return

    threads = [threading.Thread(target=reader, args=(s,)) for s in range(3)]
    for t in threads:
        t.start()
    rng = random.Random(1)
    try:
        for i in range(300):
            blk = rng.randrange(blocks)
            value = rng.randrange(1, 256)
            written[blk].add(value)
            image.write(blk * 4096, bytes([value]) * 4096)
            if i % 50 == 49:
                image.snapshot_and_restack(tmp_path / f"snap{i}")
    finally:
        stop.set()
        for t in threads:
            t.join()
    image.close()
    assert not errors, errors


def test_interrupted_restack_recovers(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Faults injected at both sides of the commit point (image.json) of a restack."""
    image = Image.create([], tmp_path / "u", virtual_size=VSIZE)
    image.write(0, b"a" * 8192)
    config = image.config_path
    assert config is not None

    # Before the commit point: the snapshot fails, the image carries on unchanged.
    def fail_save(*_args: object) -> None:
        raise OSError(28, "No space left on device")

    monkeypatch.setattr("agentenv.storage.config.ImageConfig.save", fail_save)
    with pytest.raises(OSError):
        image.snapshot_and_restack(tmp_path / "s1")
    monkeypatch.undo()
    assert not (tmp_path / "s1").exists()
    image.write(8192, b"b" * 4096)
    assert image.read(0, 12288) == b"a" * 8192 + b"b" * 4096

    # After the commit point: the fresh upper cannot be created (crash stand-in).
    real_create = Upper.create

    def fail_create(*_args: object, **_kwargs: object) -> Upper:
        raise OSError(5, "I/O error")

    monkeypatch.setattr("agentenv.storage.image.Upper.create", fail_create)
    with pytest.raises(OSError):
        image.snapshot_and_restack(tmp_path / "s2")
    monkeypatch.setattr("agentenv.storage.image.Upper.create", real_create)
    assert image.readonly and image.lowers == [tmp_path / "s2"]
    assert image.read(0, 12288) == b"a" * 8192 + b"b" * 4096
    image.close()
    with Image.open(config, writable=False) as ro:
        assert ro.read(0, 12288) == b"a" * 8192 + b"b" * 4096
    image = Image.open(config)  # finishes the restack
    assert not image.readonly and image.lowers == [tmp_path / "s2"]
    assert image.read(0, 12288) == b"a" * 8192 + b"b" * 4096
    image.write(0, b"c" * 512)
    image.snapshot_and_restack(tmp_path / "s3")
    image.close()
    with Image.open(config) as image:
        assert image.read(0, 12288) == b"c" * 512 + b"a" * 7680 + b"b" * 4096
        assert image.lowers == [tmp_path / "s2", tmp_path / "s3"]


@settings(max_examples=50, deadline=None)
@given(seed=st.integers(0, 2**32 - 1), layers=st.integers(1, 6))
def test_vectorised_merge_matches_sweep(seed: int, layers: int) -> None:
    """The numpy merge used for big stacks gives exactly the pure-Python sweep's result."""
    rng = random.Random(seed)
    indexes = []
    for k in range(layers):
        ix = FlatIndex()
        pos = 0
        for _ in range(rng.randrange(0, 60)):
            pos += rng.randrange(0, 30)
            n = rng.randrange(1, 30)
            zeroed = rng.random() < 0.2
            ix.insert(pos, pos + n, rng.randrange(8, 1000), ZEROED if zeroed else k)
            pos += n
        indexes.append(ix)
    expected = indexes[0].copy()
    for lower in indexes[1:]:
        expected = overlay(expected, lower)
    arrays = _to_arrays(indexes[0])
    for lower in indexes[1:]:
        arrays = _overlay_arrays(arrays, _to_arrays(lower))
    got = FlatIndex(*(a.tolist() for a in arrays))
    assert got.entries() == expected.entries()


def test_read_pieces_outlive_close(tmp_path: Path) -> None:
    """Pieces are zero-copy slices of the layers' and the upper's mappings; closing the image
    while some are still held (a reply waiting on a socket) must neither fail nor unmap them."""
    rng = random.Random(3)
    model = bytearray(VSIZE)
    lowers = _base_layers(tmp_path, model, rng)
    image = Image.create(lowers, tmp_path / "u")
    data = rng.randbytes(8192)
    image.write(4096, data)
    model[4096 : 4096 + 8192] = data
    pieces = image.read_pieces(0, VSIZE)
    upper_piece = image.read_pieces(4096, 8192)
    assert [type(p) for p in upper_piece] == [memoryview]  # from the upper's mapping
    pieces += upper_piece
    model += data
    image.close()
    assert b"".join(pieces) == bytes(model)
    with pytest.raises(ImageUsageError):
        image.read_pieces(0, 1)
