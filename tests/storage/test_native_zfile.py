"""ZFile layers (LZ4 and ZSTD) decoded by the native core (storage/_native.cpp `read_zfile`)
against the reference reader (storage/zfile.py): the same bytes, no call into Python for a
healthy layer, and a corrupt or forged block still fails with the reference's own error."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from agentenv.storage import native
from agentenv.storage.builder import LayerBuilder
from agentenv.storage.crc import BLOCK_SALT, raw_crc32c
from agentenv.storage.image import Image
from tests.storage.test_native import corrupt_zfile_layer

if not native.available():  # the project's build compiles it (make venv): not built is a failure
    pytest.fail(f"native core not built: {native.unavailable_reason()}", pytrace=False)

KiB = 1024
MiB = 1 << 20
SIZE = 3 * MiB + 5 * KiB  # the last ZFile block is short


#: the layers of a stack: (compression, tar-wrapped, block size)
_LAYERS = (("lz4", True, 4096), (None, False, 4096), ("lz4", False, 16384),
           ("zstd", True, 4096), ("zstd", False, 16384))


def _build(folder: Path, seed: int) -> list[Path]:
    """ZFile layers of both codecs (4 KiB blocks with CRCs, tar-wrapped; 16 KiB blocks) and a
    plain one; data of every compressibility (random, repeated patterns, zeros) and zeroed
    extents."""
    rng = random.Random(seed)
    paths = []
    for n, (compress, tar, block) in enumerate(_LAYERS):
        path = folder / f"z{seed}-{n}.lsmt"
        with LayerBuilder(path, SIZE, compress=compress, tar=tar,  # type: ignore[arg-type]
                          block_size=block) as builder:
            pos = rng.randrange(0, 8) * 512
            while pos < SIZE - 200 * KiB:
                length = rng.choice([1, 7, 16, 64, 150]) * KiB
                kind = rng.random()
                if kind < 0.2 and n:
                    builder.add_zero(pos, length)
                elif kind < 0.5:
                    unit = rng.randbytes(rng.choice([1, 3, 17, 300]))
                    builder.add(pos, (unit * (length // len(unit) + 1))[:length])
                else:
                    builder.add(pos, rng.randbytes(length))
                pos += length + rng.randrange(0, 20) * 512
        paths.append(path)
    return paths


@pytest.fixture(scope="module")
def stacks(tmp_path_factory: pytest.TempPathFactory) -> dict[int, list[Path]]:
    folder = tmp_path_factory.mktemp("zstacks")
    return {seed: _build(folder, seed) for seed in range(2)}


@settings(max_examples=60, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(seed=st.integers(0, 1), order=st.permutations(range(len(_LAYERS))),
       depth=st.integers(1, len(_LAYERS)),
       reads=st.lists(st.tuples(st.integers(0, SIZE - 1), st.integers(1, 600 * KiB)),
                      min_size=1, max_size=12))
def test_zfile_layers_read_natively_match_the_reference(stacks: dict[int, list[Path]],
                                                        seed: int, order: list[int],
                                                        depth: int,
                                                        reads: list[tuple[int, int]]) -> None:
    lowers = [stacks[seed][i] for i in order[:depth]]
    with Image.create(lowers, None, SIZE) as ref, \
            native.NativeImage.create(lowers, None, SIZE) as nat:
        for offset, length in reads:
            length = min(length, SIZE - offset)
            assert nat.read(offset, length) == ref.read(offset, length), (offset, length)
        assert nat.native_core.io_counts()[1] == 0  # never through Python


def test_whole_stack_and_writes_over_it(stacks: dict[int, list[Path]], tmp_path: Path) -> None:
    lowers = stacks[0]
    ref = Image.create(lowers, tmp_path / "ref", SIZE)
    nat = native.NativeImage.create(lowers, tmp_path / "nat", SIZE)
    for image in (ref, nat):
        image.write(4000, b"\x77" * 10000)  # unaligned: read-modify-write of ZFile blocks
        image.write(SIZE - 3000, b"\x01" * 3000)
    assert nat.read(0, SIZE) == ref.read(0, SIZE)
    assert nat.native_core.io_counts()[1] == 0
    nat.close()
    ref.close()


@pytest.mark.parametrize("algo", ["lz4", "zstd"])
def test_a_corrupt_block_raises_the_reference_error(tmp_path: Path, algo: str) -> None:
    """A block whose CRC does not match goes to the reference reader, which raises its own
    error in the caller (and the bytes before it were read natively)."""
    layer = corrupt_zfile_layer(tmp_path, algo)
    with Image.create([layer], None) as ref, native.NativeImage.create([layer], None) as nat:
        with pytest.raises(Exception) as expected:
            ref.read(0, 1 * MiB)
        with pytest.raises(type(expected.value)) as got:
            nat.read(0, 1 * MiB)
        assert str(got.value) == str(expected.value)
        assert nat.native_core.io_counts()[1] == 1
        assert nat.read(0, 64 * KiB) == ref.read(0, 64 * KiB)


_HOSTILE: dict[str, bytes] = {}


@settings(max_examples=200, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture])
@given(algo=st.sampled_from(["lz4", "zstd"]), block=st.integers(0, 63), edits=st.lists(
    st.tuples(st.integers(0, 5000), st.integers(0, 255)), min_size=1, max_size=6),
    cut=st.integers(0, 3))
def test_forged_blocks_with_valid_crcs_read_like_the_reference(
        tmp_path: Path, algo: str, block: int, edits: list[tuple[int, int]], cut: int) -> None:
    """A hostile layer: LZ4 blocks or ZSTD frames changed (bytes replaced, the block
    shortened) with their CRCs made valid again. The core never reads or writes out of
    bounds, and reads what the reference reads, or fails as it does."""
    if algo not in _HOSTILE:
        rng = random.Random(9)
        source = tmp_path / "src.lsmt"
        with LayerBuilder(source, 256 * KiB, compress=algo) as builder:  # type: ignore[arg-type]
            unit = rng.randbytes(40)
            builder.add(0, (unit * 4000)[: 128 * KiB])
            builder.add(128 * KiB, rng.randbytes(128 * KiB))
        _HOSTILE[algo] = source.read_bytes()
    raw = bytearray(_HOSTILE[algo])
    probe = tmp_path / "probe.lsmt"
    probe.write_bytes(raw)
    with Image.create([probe], None) as image:
        reader = image._view.layers[0].source.zreader
        assert reader is not None
        offsets = list(reader.offsets)
    k = min(block, len(offsets) - 2)
    a, z = offsets[k], offsets[k + 1] - 4
    comp = bytearray(raw[a:z])
    for at, value in edits:
        comp[at % len(comp)] = value
    comp = comp[: max(1, len(comp) - cut)] + bytes(cut)  # shorter stream, same stored length
    raw[a:z] = comp
    raw[z : z + 4] = raw_crc32c(bytes(comp), BLOCK_SALT).to_bytes(4, "little")
    layer = tmp_path / "hostile.lsmt"
    layer.write_bytes(bytes(raw))
    assert _outcome(native.NativeImage, layer) == _outcome(Image, layer)


def _outcome(kind: type[Image], layer: Path) -> bytes | str:
    """The whole disk, or the error opening or reading it."""
    try:
        with kind.create([layer], None) as image:
            return image.read(0, 256 * KiB)
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
