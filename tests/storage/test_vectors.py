"""Test vectors TV1-TV9 of docs/overlaybd.md §11 (byte-exact, C++ variant)."""

from __future__ import annotations

import hashlib
import io
import itertools
import os
from pathlib import Path

import pytest

from agentenv.storage.builder import LayerBuilder, commit_sealed, commit_upper
from agentenv.storage.crc import raw_crc32c
from agentenv.storage.image import Image
from agentenv.storage.layer import open_layer
from agentenv.storage.lsmt import (
    MAX_OFFSET,
    FlatIndex,
    HeaderTrailer,
    RawMapping,
    compress_raw_index,
    decode_mappings,
    encode_mapping,
    merge_indexes,
    overlay,
)
from agentenv.storage.tarwrap import wrap_bytes
from agentenv.storage.upper import Upper
from agentenv.storage.zfile import ZFileHeader, ZFileReader, ZFileWriter
from tests.storage.vectors import TV5_SHA256, UUID_B, sha256_file, tv5_bytes

TV3_SHA = "b70425bcbb70b706d42213e4434d24c4b57fd5b79e91c72e09b11049edaf4ff9"


@pytest.mark.parametrize(
    ("mapping", "hexbytes"),
    [
        ((2048, 16, 7680, False, 2), "00 08 00 00 00 00 40 00 00 1e 00 00 00 00 00 02"),
        ((4096, 2048, 0, True, 0), "00 10 00 00 00 00 00 20 00 00 00 00 00 00 80 00"),
        ((MAX_OFFSET, 0, 0, False, 0), "ff ff ff ff ff ff 03 00 00 00 00 00 00 00 00 00"),
        ((2**50 - 2, 16383, 2**55 - 1, True, 255), "fe" + " ff" * 15),
        ((0, 8448, 8, False, 0), "00 00 00 00 00 00 00 84 08 00 00 00 00 00 00 00"),
    ],
)
def test_tv1_mapping_encoding(mapping: tuple[int, int, int, bool, int], hexbytes: str) -> None:
    raw = encode_mapping(*mapping)
    assert raw == bytes.fromhex(hexbytes.replace(" ", ""))
    off, ln, mo, z, tag = decode_mappings(raw + bytes.fromhex("ffffffffffff03" + "00" * 9))
    if mapping[0] != MAX_OFFSET:  # INVALID padding is dropped on load
        assert (off[0], ln[0], mo[0], z[0], tag[0]) == mapping


def test_tv2_header_and_trailer() -> None:
    header = HeaderTrailer(flags=0x07, virtual_size=4 << 20)
    expected = bytes.fromhex(
        "4c534d5400010200657e63d29444084ca2d2c8ec4fcfae8a8601000007000000"
        "0000000000000000" "0000000000000000" "0000400000000000"
    ) + b"00000000-0000-0000-0000-000000000000\0" * 2 + bytes.fromhex("00000101")
    block = header.pack()
    assert len(block) == 4096
    assert block[:134] == expected
    assert block[134:] == bytes(4096 - 134)
    trailer = header.with_(flags=0x06, index_offset=16384, index_size=256).pack()
    assert trailer[28:48] == bytes.fromhex("06000000" "0040000000000000" "0001000000000000")
    parsed = HeaderTrailer.unpack(trailer, "t", 0)
    assert (parsed.index_offset, parsed.index_size, parsed.uuid) == (16384, 256, header.uuid)


def _tv3_upper(directory: Path, uuid: str = "", vsize: int = 4 << 20) -> Upper:
    upper = Upper.create(directory, vsize, uuid=uuid or "null", parent_uuid="")
    upper.write_extent(0, b"\x11" * 4096)
    upper.write_extent(2048, b"\x22" * 8192)
    return upper


def test_tv3_committed_layer(tmp_path: Path) -> None:
    _tv3_upper(tmp_path / "u").close()
    out = commit_upper(tmp_path / "u", tmp_path / "tv3")
    data = out.read_bytes()
    assert len(data) == 24576
    assert hashlib.sha256(data).hexdigest() == TV3_SHA
    assert data[16384:16432] == (encode_mapping(0, 8, 8) + encode_mapping(2048, 16, 16)
                                 + bytes.fromhex("ffffffffffff03000000000000000000"))
    with Image.open(out) as image:
        disk = image.read(0, image.virtual_size)
    assert hashlib.sha256(disk).hexdigest() == (
        "f97e525e2a42f973e8d7bb1c42cbaa15026a0a77f535c2dd3bbb5920df6c87d4")


def test_tv3_variants(tmp_path: Path) -> None:
    _tv3_upper(tmp_path / "u").close()
    b = commit_upper(tmp_path / "u", tmp_path / "tv3b", uuid=UUID_B, user_tag=b"tv3")
    assert sha256_file(b) == "021aaea33290c3bdf64f03934538108bc1df16c245debd7cf818b0c525502103"
    upper = Upper.open(tmp_path / "u")
    upper.zero_extent(4096, 2048)
    upper.close()
    c = commit_upper(tmp_path / "u", tmp_path / "tv3c")
    assert c.read_bytes()[16384 + 32 : 16384 + 48] == bytes.fromhex(
        "00100000000000202000000000008000")
    assert sha256_file(c) == "057c6abd75be12f14dfb96d9a2a93062196eb63ef9079974e2d35dcca7f11a1a"
    upper = Upper.create(tmp_path / "d", 1 << 20, uuid="null")
    upper.write_extent(0, b"\x5a" * 512)
    upper.close()
    d = commit_upper(tmp_path / "d", tmp_path / "tv3d")
    assert d.stat().st_size == 12800
    assert open_layer(d).trailer.index_offset == 4608
    assert sha256_file(d) == "babd9abf77e73311307cc758828919054d94613be61b79ea87380a3ba2bb3825"


def test_tv3_layer_builder_matches_commit(tmp_path: Path) -> None:
    with LayerBuilder(tmp_path / "b", 4 << 20) as builder:
        builder.add(0, b"\x11" * 4096)
        builder.add(1 << 20, b"\x22" * 8192)
    assert sha256_file(tmp_path / "b") == TV3_SHA


def test_tv4_rw_pair_and_in_place_seal(tmp_path: Path) -> None:
    upper = _tv3_upper(tmp_path / "u", uuid=UUID_B)
    upper.flush()
    assert (tmp_path / "u/upper.data").stat().st_size == 16384
    assert sha256_file(tmp_path / "u/upper.data") == (
        "82fa82dfd86f9980768f4dfe0a4fa51b3f56c7972c3cd8d90e8ca2e74e8b9009")
    assert (tmp_path / "u/upper.index").stat().st_size == 4128
    assert sha256_file(tmp_path / "u/upper.index") == (
        "178dd260584601e9529ee1a5c45502582e963a0f424be856b296130294f12459")
    trailer = upper.seal_in_place()
    upper.close()
    sealed = tmp_path / "u/upper.data"
    assert (trailer.flags, trailer.index_offset, trailer.index_size) == (0x06, 16384, 2)
    assert sealed.stat().st_size == 20992
    assert sha256_file(sealed) == (
        "47472cb4198a96ba360b5212cf86bc313c04c4b7312afde5507b0b4e9582c96d")
    layer = open_layer(sealed)
    assert layer.index.entries() == [(0, 8, 8, 0), (2048, 16, 16, 0)]
    layer.close()


def _tv5_blocks(tv5: bytes) -> list[bytes]:
    reader_blocks = []
    offs = [512, 615, 645, 675, 705, 771, 881]
    for a, b in itertools.pairwise(offs):
        reader_blocks.append(tv5[a : b - 4])
    return reader_blocks


def test_tv5_read_zfile(tmp_path: Path) -> None:
    tv5 = tv5_bytes()
    path = tmp_path / "tv5"
    path.write_bytes(tv5)
    fd = os.open(path, os.O_RDONLY)
    try:
        reader = ZFileReader(path, fd, 0, len(tv5))
        assert reader.offsets == [512, 615, 645, 675, 705, 771, 881]
        assert reader.size == 24576
        stream = reader.pread(24576, 0)
        assert hashlib.sha256(stream).hexdigest() == TV3_SHA
        assert reader.pread(10, 4090) == bytes(6) + b"\x11" * 4  # across a block boundary
    finally:
        os.close(fd)
    crcs = [int.from_bytes(tv5[b - 4 : b], "little") for b in [615, 645, 675, 705, 771, 881]]
    assert crcs == [0x86131DC7, 0xEA925F1F, 0x08978752, 0x08978752, 0xC5F715C1, 0x8ED52AE9]
    with Image.open(path) as image:
        assert image.read(0, 4096) == b"\x11" * 4096
        assert image.read(1 << 20, 8192) == b"\x22" * 8192


@pytest.mark.parametrize(("overwrite", "sha"), [
    (True, TV5_SHA256),
    (False, "51fa05c6bcf9717096c5d428c7f0f4783502f3fd8829d6d923e9f111e294b7da"),
])
def test_tv5_writer_layout(tmp_path: Path, overwrite: bool, sha: str) -> None:
    """Our ZFile writer, fed the LZ4 1.8.3 blocks of TV5 (python-lz4 is 1.9.x), reproduces
    header, CRCs, jump table, trailer and header overwrite byte for byte."""
    tv3 = _commit_tv3_bytes(tmp_path)
    blocks = iter(_tv5_blocks(tv5_bytes()))
    out = io.BytesIO()
    writer = ZFileWriter(out, "lz4", overwrite_header=overwrite, compressor=lambda _b: next(blocks))
    writer.write(tv3[:1000])
    writer.write(tv3[1000:])
    total = writer.close()
    data = out.getvalue()
    assert total == len(data) == 1417
    assert hashlib.sha256(data).hexdigest() == sha
    if not overwrite:
        header = ZFileHeader.unpack(data[:512], "x", 0)
        assert (header.flags, header.index_offset, header.digest) == (0x13, 0, 0xC7A212FC)


def _commit_tv3_bytes(tmp_path: Path) -> bytes:
    _tv3_upper(tmp_path / "u3").close()
    return commit_upper(tmp_path / "u3", tmp_path / "tv3").read_bytes()


def test_tv6_tar_wrapper(tmp_path: Path) -> None:
    wrapped = wrap_bytes(tv5_bytes())
    assert len(wrapped) == 4096
    assert hashlib.sha256(wrapped).hexdigest() == (
        "85fdae0a92acb51eeb9dc4c51e6b1de4b60ae5a3dbd027a2ee0ec2524f25a900")
    # The whole pipeline (compact -> ZFile -> tar) through LayerBuilder gives the same bytes.
    blocks = iter(_tv5_blocks(tv5_bytes()))
    path = tmp_path / "tv6"
    with LayerBuilder(path, 4 << 20, compress="lz4", tar=True,
                      zfile_compressor=lambda _b: next(blocks)) as builder:
        builder.add(0, b"\x11" * 4096)
        builder.add(1 << 20, b"\x22" * 8192)
    assert path.read_bytes() == wrapped
    with Image.open(path) as image:
        assert hashlib.sha256(image.read(0, 4 << 20)).hexdigest() == (
            "f97e525e2a42f973e8d7bb1c42cbaa15026a0a77f535c2dd3bbb5920df6c87d4")


def test_tv7a_insert() -> None:
    index = FlatIndex()
    for s, n, m in [(0, 20, 0), (10, 15, 50), (30, 100, 20), (5, 10, 3), (40, 10, 123),
                    (200, 10, 2133), (150, 100, 21)]:
        index.insert(s, s + n, m, 0)
    assert [e[:3] for e in index.entries()] == [
        (0, 5, 0), (5, 10, 3), (15, 10, 55), (30, 10, 20), (40, 10, 123), (50, 80, 40),
        (150, 100, 21)]


def _index(triples: list[tuple[int, int, int]], tag: int = 0) -> FlatIndex:
    return FlatIndex([t[0] for t in triples], [t[0] + t[1] for t in triples],
                     [t[2] for t in triples], [tag] * len(triples))


def test_tv7b_lookup() -> None:
    index = _index([(0, 10, 0), (10, 10, 50), (100, 10, 20)])

    def q(s: int, n: int) -> list[tuple[int, int, int]]:
        return [e[:3] for e in index.lookup(s, s + n)]

    assert q(5, 10) == [(5, 5, 5), (10, 5, 50)]
    assert q(16, 10) == [(16, 4, 56)]
    assert q(26, 10) == []
    assert q(6, 100) == [(6, 4, 6), (10, 10, 50), (100, 6, 20)]


def test_tv7c_merge_and_combo() -> None:
    upper = _index([(5, 5, 0), (10, 10, 50), (100, 10, 20)], tag=3)
    l1 = _index([(0, 1, 7), (2, 4, 5), (15, 10, 22), (30, 15, 89), (87, 50, 32), (150, 10, 84)], 0)
    l2 = _index([(1, 3, 134), (8, 4, 873), (18, 72, 320), (100, 100, 4893),
                 (1000, 1000, 39823)], 1)
    l3 = _index([(23, 10, 0), (65, 10, 50), (89, 10, 20), (230, 43, 432), (1999, 31, 2393)], 2)
    combo = overlay(upper, merge_indexes([l1, l2, l3]))
    assert combo.lookup(0, 10000) == [
        (0, 1, 7, 0), (1, 1, 134, 1), (2, 3, 5, 0), (5, 5, 0, 3), (10, 10, 50, 3),
        (20, 5, 27, 0), (25, 5, 327, 1), (30, 15, 89, 0), (45, 42, 347, 1), (87, 13, 32, 0),
        (100, 10, 20, 3), (110, 27, 55, 0), (137, 13, 4930, 1), (150, 10, 84, 0),
        (160, 40, 4953, 1), (230, 43, 432, 2), (1000, 1000, 39823, 1), (2000, 30, 2394, 2)]


def test_tv7d_compress() -> None:
    def run(items: list[tuple[int, ...]]) -> list[tuple[int, int, int, int]]:
        maps = [RawMapping(i[0], i[1], i[2], False, i[3] if len(i) > 3 else 0) for i in items]
        return [(m.offset, m.length, m.moffset, m.tag) for m in compress_raw_index(maps)]

    assert run([(5, 5, 0), (10, 10, 5), (100, 10, 20)]) == [(5, 15, 0, 0), (100, 10, 20, 0)]
    assert run([(5, 5, 0), (10, 10, 5), (20, 10, 15, 1), (100, 10, 20)]) == [
        (5, 15, 0, 0), (20, 10, 15, 1), (100, 10, 20, 0)]
    assert run([(5, 5, 0), (10, 10, 5, 3), (20, 10, 15, 3), (30, 10, 20)]) == [
        (5, 5, 0, 0), (10, 20, 5, 3), (30, 10, 20, 0)]


@pytest.mark.parametrize(("data", "init", "crc"), [
    (b"123456789", 0, 0x58E3FA20), (b"123456789", 100007, 0x3C9BD4E0),
    (b"", 100007, 0x000186A7), (bytes(512), 0, 0),
])
def test_tv8_raw_crc32c(data: bytes, init: int, crc: int) -> None:
    assert raw_crc32c(data, init) == crc


def test_tv9_compaction_boundary(tmp_path: Path) -> None:
    upper = Upper.create(tmp_path / "u", 16 << 20, uuid="null")
    upper.write_extent(0, b"\x33" * (4 << 20))
    upper.write_extent(8192, b"\x44" * ((4 << 20) - 512))
    upper.close()
    out = commit_upper(tmp_path / "u", tmp_path / "tv9")
    layer = open_layer(out)
    assert layer.index.entries() == [(0, 16320, 8, 0), (16320, 63, 16328, 0)]
    assert layer.trailer.index_offset == 8392192
    layer.close()
    assert out.stat().st_size == 8400384
    assert out.read_bytes()[8392192 : 8392192 + 32] == (
        encode_mapping(0, 16320, 8) + encode_mapping(16320, 63, 16328))
    assert sha256_file(out) == "50e7057513a35031f36000d1e3011e1ed8aa2adb283e876149f46359ee44987b"
    # C++ close_seal of the same upper keeps the two write mappings.
    upper = Upper.open(tmp_path / "u")
    upper.seal_in_place()
    upper.close()
    sealed = open_layer(tmp_path / "u/upper.data")
    assert sealed.index.entries() == [(0, 8192, 8, 0), (8192, 8191, 8200, 0)]
    sealed.close()
    # --commit_sealed of the in-place-sealed file gives the same committed layer.
    again = commit_sealed(tmp_path / "u/upper.data", tmp_path / "tv9b")
    assert sha256_file(again) == sha256_file(out)
