"""Bad input raises LayerFormatError naming file, offset and problem; failed writes leave no
output; the CLI prints one line."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from pathlib import Path

import pytest

from agentenv.storage import builder as builder_mod
from agentenv.storage.builder import LayerBuilder, commit_upper
from agentenv.storage.crc import raw_crc32c
from agentenv.storage.errors import ImageUsageError, LayerFormatError
from agentenv.storage.image import Image
from agentenv.storage.lsmt import encode_mapping
from agentenv.storage.tarwrap import wrap_bytes
from agentenv.storage.upper import Upper
from agentenv.storage.zfile import ZFileHeader
from tests.storage.vectors import tv5_bytes

AENV = Path(sys.executable).parent / "aenv"


def _tv3(tmp_path: Path) -> bytes:
    upper = Upper.create(tmp_path / "u", 4 << 20, uuid="null")
    upper.write_extent(0, b"\x11" * 4096)
    upper.write_extent(2048, b"\x22" * 8192)
    upper.close()
    return commit_upper(tmp_path / "u", tmp_path / "tv3").read_bytes()


def _expect(path: Path, *words: str) -> LayerFormatError:
    with pytest.raises(LayerFormatError) as info, Image.open(path) as image:
        image.read(0, image.virtual_size)
    msg = str(info.value)
    assert str(path) in msg
    for word in words:
        assert word in msg, msg
    return info.value


def _write(tmp_path: Path, name: str, data: bytes | bytearray) -> Path:
    path = tmp_path / name
    path.write_bytes(bytes(data))
    return path


def test_truncated_layers(tmp_path: Path) -> None:
    tv3 = _tv3(tmp_path)
    err = _expect(_write(tmp_path, "t1", tv3[:6000]), "truncated")
    assert err.offset is not None
    _expect(_write(tmp_path, "t2", tv3[:-100]), "trailer")
    tv5 = tv5_bytes()
    _expect(_write(tmp_path, "t3", tv5[:300]), "truncated")
    _expect(_write(tmp_path, "t4", wrap_bytes(tv5)[:2000]), "truncated tar")


def test_wrong_magic(tmp_path: Path) -> None:
    tv3 = bytearray(_tv3(tmp_path))
    tv3[0] ^= 0xFF
    err = _expect(_write(tmp_path, "m", tv3), "magic")
    assert err.offset == 0
    tv5 = bytearray(tv5_bytes())
    tv5[1417 - 512 + 3] ^= 0xFF  # trailer magic: unused (header overwritten) -> still readable
    with Image.open(_write(tmp_path, "ok", tv5)) as image:
        assert image.read(0, 4096) == b"\x11" * 4096


def test_index_past_the_end(tmp_path: Path) -> None:
    tv3 = bytearray(_tv3(tmp_path))
    trailer = 20480
    tv3[trailer + 40 : trailer + 48] = struct.pack("<Q", 1000)
    err = _expect(_write(tmp_path, "p", tv3), "points past")
    assert err.offset == trailer + 32
    tv3 = bytearray(_tv3(tmp_path))
    tv3[16384:16400] = encode_mapping(0, 8, 40)  # data beyond the index offset
    _expect(_write(tmp_path, "q", tv3), "outside the data area")


def test_unsorted_and_overlapping_entries(tmp_path: Path) -> None:
    tv3 = bytearray(_tv3(tmp_path))
    first, second = bytes(tv3[16384:16400]), bytes(tv3[16400:16416])
    tv3[16384:16400], tv3[16400:16416] = second, first
    err = _expect(_write(tmp_path, "unsorted", tv3), "out of order")
    assert err.offset == 16400
    tv3 = bytearray(_tv3(tmp_path))
    tv3[16400:16416] = encode_mapping(4, 16, 16)
    _expect(_write(tmp_path, "o", tv3), "overlaps")


def test_crc_mismatches(tmp_path: Path) -> None:
    tv5 = bytearray(tv5_bytes())
    tv5[620] ^= 0x01  # inside block 1 (starts at 615)
    err = _expect(_write(tmp_path, "c1", tv5), "block 1 CRC mismatch")
    assert err.offset == 615
    tv5 = bytearray(tv5_bytes())
    tv5[100] = 1  # header bytes are covered by the digest
    _expect(_write(tmp_path, "c2", tv5), "digest")
    tv5 = bytearray(tv5_bytes())
    tv5[881] ^= 1  # jump table vs index_crc
    _expect(_write(tmp_path, "c3", tv5), "jump table CRC")


def test_jump_table_that_does_not_add_up(tmp_path: Path) -> None:
    tv5 = bytearray(tv5_bytes())
    table = bytearray(tv5[881 : 881 + 24])
    table[0:4] = struct.pack("<I", 104)  # first block one byte longer
    tv5[881 : 881 + 24] = table
    header = ZFileHeader.unpack(bytes(tv5[:512]), "x", 0)
    fixed = ZFileHeader(header.flags, header.index_offset, header.index_size,
                        header.original_file_size, raw_crc32c(bytes(table)), header.block_size,
                        header.algo, header.level, header.dict_size, header.verify)
    tv5[:512] = fixed.pack()
    err = _expect(_write(tmp_path, "j", tv5), "does not add up")
    assert err.offset == 881


def test_config_naming_a_missing_layer(tmp_path: Path) -> None:
    config = tmp_path / "image.json"
    config.write_text(json.dumps({"lowers": [{"file": str(tmp_path / "nope")}]}))
    with pytest.raises(LayerFormatError, match=r"lowers\[0\] names a missing layer"):
        Image.open(config)
    config.write_text("{ not json")
    with pytest.raises(LayerFormatError, match="invalid JSON"):
        Image.open(config)


def test_bad_upper(tmp_path: Path) -> None:
    upper = Upper.create(tmp_path / "u", 1 << 20)
    upper.write_extent(0, b"a" * 4096)
    upper.close()
    os.truncate(tmp_path / "u/upper.data", 6000)  # index now points past the data
    with pytest.raises(LayerFormatError, match="outside the data file"):
        Upper.open(tmp_path / "u")


def test_usage_errors(tmp_path: Path) -> None:
    with Image.open(_write(tmp_path, "l", _tv3(tmp_path))) as image:
        with pytest.raises(ImageUsageError, match="read-only"):
            image.write(0, b"x")
        with pytest.raises(ImageUsageError, match="outside"):
            image.read(image.virtual_size - 10, 11)


def test_failed_commit_leaves_no_output(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    upper = Upper.create(tmp_path / "u", 64 << 20)
    for i in range(16):
        upper.write_extent(i * 4096, os.urandom(1 << 20))
    upper.close()
    calls = {"n": 0}
    real_add = LayerBuilder.add

    def failing_add(self: LayerBuilder, offset: int, data: bytes) -> None:
        calls["n"] += 1
        if calls["n"] == 5:
            raise OSError(28, "No space left on device")  # the fault: disk full midway
        real_add(self, offset, data)

    monkeypatch.setattr(builder_mod.LayerBuilder, "add", failing_add)
    out = tmp_path / "out" / "layer.commit"
    out.parent.mkdir()
    for compress in (None, "zstd"):
        calls["n"] = 0
        with pytest.raises(OSError, match="No space"):
            commit_upper(tmp_path / "u", out, compress=compress, tar=True)  # type: ignore[arg-type]
        assert list(out.parent.iterdir()) == []
    # An existing output stays untouched by a failed commit.
    out.write_bytes(b"previous")
    calls["n"] = 0
    with pytest.raises(OSError):
        commit_upper(tmp_path / "u", out)
    assert out.read_bytes() == b"previous"
    assert [p.name for p in out.parent.iterdir()] == ["layer.commit"]


def test_cli_one_line_errors(tmp_path: Path) -> None:
    bad = _write(tmp_path, "bad.layer", b"LSMT" + bytes(9000))
    for args in (["layer", "inspect", str(bad)], ["image", "export", str(bad), str(tmp_path / "o")],
                 ["layer", "inspect", str(tmp_path / "missing")]):
        proc = subprocess.run([str(AENV), *args], capture_output=True, text=True)
        assert proc.returncode == 1
        lines = proc.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("aenv: error: "), proc.stderr
        assert "Traceback" not in proc.stderr
    assert not (tmp_path / "o").exists()
