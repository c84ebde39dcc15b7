"""A decompression bomb: a gzip tar layer of one file of zeros expands far past the limit
(AENV_LAYER_MAX_UNCOMPRESSED_BYTES) and is refused with an error naming the layer, before the
applier writes past the limit."""

from __future__ import annotations

import gzip
import io
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentenv.template.apply import apply_layer
from agentenv.template.convert import loop_mount
from agentenv.template.errors import LayerApplyError
from tests.template.conftest import needs_root

pytestmark = pytest.mark.root
LIMIT = 8 << 20
ZEROS = 256 << 20  # a thousandfold: the gzip blob is about 250 KiB


class _Zeros(io.RawIOBase):
    def __init__(self, size: int) -> None:
        self.left = size

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
        n = min(len(buffer), self.left)
        buffer[:n] = bytes(n)
        self.left -= n
        return n


@pytest.fixture
def ext4_root(tmp_path: Path) -> Iterator[Path]:
    needs_root()
    disk = tmp_path / "disk.raw"
    with open(disk, "wb") as f:
        f.truncate(512 << 20)
    subprocess.run(["mkfs.ext4", "-F", "-q", str(disk)], check=True)
    with loop_mount(disk, tmp_path / "mnt") as root:
        yield root


def test_a_gzip_bomb_is_refused_naming_the_layer(ext4_root: Path, tmp_path: Path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AENV_LAYER_MAX_UNCOMPRESSED_BYTES", str(LIMIT))
    blob = tmp_path / "bomb.tar.gz"
    with gzip.open(blob, "wb", compresslevel=9) as gz, tarfile.open(fileobj=gz, mode="w|") as tar:
        info = tarfile.TarInfo("zeros")
        info.size = ZEROS
        tar.addfile(info, io.BufferedReader(_Zeros(ZEROS), 1 << 20))
    assert blob.stat().st_size < ZEROS // 500
    with pytest.raises(LayerApplyError, match=r"layer bomb-layer: expands to more than "
                       rf"{LIMIT} bytes uncompressed \(AENV_LAYER_MAX_UNCOMPRESSED_BYTES\)"):
        apply_layer(ext4_root, blob, "application/vnd.oci.image.layer.v1.tar+gzip",
                    name="bomb-layer")
    written = ext4_root / "zeros"
    assert not written.exists() or written.stat().st_size <= LIMIT


def test_a_layer_within_the_limit_applies(ext4_root: Path, tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AENV_LAYER_MAX_UNCOMPRESSED_BYTES", str(LIMIT))
    blob = tmp_path / "small.tar.gz"
    with gzip.open(blob, "wb") as gz, tarfile.open(fileobj=gz, mode="w|") as tar:
        info = tarfile.TarInfo("zeros")
        info.size = LIMIT // 2
        tar.addfile(info, io.BufferedReader(_Zeros(LIMIT // 2), 1 << 20))
    apply_layer(ext4_root, blob, "application/vnd.oci.image.layer.v1.tar+gzip")
    assert (ext4_root / "zeros").stat().st_size == LIMIT // 2


def test_a_bad_limit_is_named(ext4_root: Path, tmp_path: Path,
                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AENV_LAYER_MAX_UNCOMPRESSED_BYTES", "lots")
    blob = tmp_path / "empty.tar"
    with tarfile.open(blob, "w"):
        pass
    with pytest.raises(LayerApplyError, match="AENV_LAYER_MAX_UNCOMPRESSED_BYTES must be"):
        apply_layer(ext4_root, blob, "application/vnd.oci.image.layer.v1.tar")
