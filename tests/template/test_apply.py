"""Applying layer tarballs onto a loop-mounted ext4, compared with umoci's unpack."""

from __future__ import annotations

import gzip
import os
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentenv.template.apply import apply_layer
from agentenv.template.blobtap import BlobTap
from agentenv.template.convert import loop_mount
from agentenv.template.errors import DigestMismatchError, LayerApplyError, UnsupportedImageError
from tests.template import helpers
from tests.template.conftest import needs_root

pytestmark = pytest.mark.root


@pytest.fixture
def ext4_root(tmp_path: Path) -> Iterator[Path]:
    needs_root()
    disk = tmp_path / "disk.raw"
    with open(disk, "wb") as f:
        f.truncate(256 << 20)
    subprocess.run(["mkfs.ext4", "-F", "-q", str(disk)], check=True)
    with loop_mount(disk, tmp_path / "mnt") as root:
        yield root
    result = subprocess.run(["e2fsck", "-fn", str(disk)], capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def _write_blobs(tmp: Path, image: helpers.BuiltImage) -> list[tuple[Path, str, str]]:
    import json

    body = json.loads(image.manifest)
    config = json.loads(image.blobs[body["config"]["digest"]])
    out = []
    for i, layer in enumerate(body["layers"]):
        path = tmp / f"layer{i}"
        path.write_bytes(image.blobs[layer["digest"]])
        out.append((path, layer["mediaType"], config["rootfs"]["diff_ids"][i]))
    return out


@pytest.mark.parametrize("compressions", [["gzip", "gzip"], ["zstd", ""]])
def test_two_layer_debian_like_matches_umoci(ext4_root: Path, tmp_path: Path,
                                             compressions: list[str]) -> None:
    image = helpers.build_image(list(helpers.debian_like_layers()), compressions)
    for blob, media_type, diff_id in _write_blobs(tmp_path, image):
        stats = apply_layer(ext4_root, blob, media_type, diff_id)
        assert stats.diff_id == diff_id
    expected = helpers.reference_unpack(image, tmp_path / "bundle", tmp_path)
    helpers.assert_same_tree(ext4_root, expected)
    # Spot checks that the comparison itself sees what matters.
    assert os.stat(ext4_root / "bin/tool").st_mode & 0o4000
    assert os.stat(ext4_root / "bin/tool").st_ino == os.stat(ext4_root / "opt/tool-hard").st_ino
    assert not (ext4_root / "usr/share/doc/pkg").exists()
    assert sorted(os.listdir(ext4_root / "var/cache/apt")) == ["fresh.bin"]
    assert (ext4_root / "opt/xdir/through-symlink").read_bytes().startswith(b"written")
    assert os.getxattr(ext4_root / "opt/keeps-xattrs", "trusted.t") == b"\x00\x01"
    assert "user.dirattr" not in os.listxattr(ext4_root / "opt/xdir")  # dir over dir: upper's only
    assert os.stat(ext4_root / "opt/xdir").st_uid == 11
    assert os.stat(ext4_root / "etc/shadow").st_mtime == 1_600_000_000
    assert os.stat(ext4_root / "usr/share").st_mtime == 1_600_000_000  # dir times set last


def test_busybox_layer_matches_tar(ext4_root: Path, tmp_path: Path) -> None:
    layer = helpers.busybox_layer()
    image = helpers.build_image([layer], ["gzip"])
    [(blob, media_type, diff_id)] = _write_blobs(tmp_path, image)
    apply_layer(ext4_root, blob, media_type, diff_id)
    expected = tmp_path / "expected"
    expected.mkdir()
    subprocess.run(["tar", "-x", "--numeric-owner", "--same-permissions", "-C", str(expected)],
                   input=layer, check=True)
    helpers.assert_same_tree(ext4_root, expected)
    assert os.readlink(ext4_root / "bin/sh") == "busybox"


def test_corrupt_gzip_and_tar(ext4_root: Path, tmp_path: Path) -> None:
    layer = helpers.TarBuilder().file("a", os.urandom(100_000)).bytes()
    data = gzip.compress(layer)
    truncated = tmp_path / "truncated.gz"
    truncated.write_bytes(data[: len(data) // 2])
    with pytest.raises(LayerApplyError, match="corrupt archive"):
        apply_layer(ext4_root, truncated, "application/vnd.oci.image.layer.v1.tar+gzip")
    garbage = tmp_path / "garbage.tar"
    garbage.write_bytes(b"\x01" * 4096)
    with pytest.raises(LayerApplyError, match="corrupt archive"):
        apply_layer(ext4_root, garbage, "application/vnd.oci.image.layer.v1.tar")
    plain = tmp_path / "plain.tar"
    plain.write_bytes(layer)
    with pytest.raises(LayerApplyError, match="not gzip"):
        apply_layer(ext4_root, plain, "application/vnd.oci.image.layer.v1.tar+gzip")
    with pytest.raises(LayerApplyError, match="image config says"):
        apply_layer(ext4_root, plain, "application/vnd.oci.image.layer.v1.tar", "sha256:" + "0" * 64)
    with pytest.raises(UnsupportedImageError, match="not supported"):
        apply_layer(ext4_root, plain, "application/vnd.example.squashfs")


def test_paths_never_escape_the_root(ext4_root: Path, tmp_path: Path) -> None:
    outside = tmp_path / "outside"
    outside.mkdir()
    layer = (helpers.TarBuilder()
             .symlink("evil", str(outside))
             .file("evil/planted", b"x")
             .file("../../escaped", b"y")
             .symlink("up", "../../../..")
             .file("up/escaped2", b"z")
             .bytes())
    blob = tmp_path / "l.tar"
    blob.write_bytes(layer)
    apply_layer(ext4_root, blob, "application/vnd.oci.image.layer.v1.tar")
    assert list(outside.iterdir()) == []
    assert (ext4_root / str(outside).lstrip("/") / "planted").read_bytes() == b"x"
    assert (ext4_root / "escaped").read_bytes() == b"y"
    assert (ext4_root / "escaped2").read_bytes() == b"z"


def _feed_tap(tap: BlobTap, path: Path, data: bytes, error: BaseException | None) -> None:
    with open(path, "wb", buffering=0) as out:
        tap.start(path)
        for start in range(0, len(data), 7919):  # odd-sized chunks, slowly
            out.write(data[start:start + 7919])
            tap.advance(len(data[start:start + 7919]))
            time.sleep(0.0005)
    tap.finish(error)


@pytest.mark.parametrize("compression", ["gzip", "zstd", ""])
def test_apply_while_downloading(ext4_root: Path, tmp_path: Path, compression: str) -> None:
    base, _ = helpers.debian_like_layers()
    image = helpers.build_image([base], [compression])
    [(blob, media_type, diff_id)] = _write_blobs(tmp_path, image)
    tap = BlobTap()
    feeder = threading.Thread(target=_feed_tap, args=(tap, tmp_path / "growing", blob.read_bytes(), None))
    feeder.start()
    stats = apply_layer(ext4_root, tap, media_type, diff_id)
    feeder.join()
    tap.close()
    assert stats.diff_id == diff_id
    expected = tmp_path / "expected"
    expected.mkdir()
    subprocess.run(["tar", "-x", "--numeric-owner", "--same-permissions", "--xattrs",
                    "--xattrs-include=*", "-C", str(expected)], input=base, check=True)
    helpers.assert_same_tree(ext4_root, expected)


def test_failed_download_fails_the_apply(ext4_root: Path, tmp_path: Path) -> None:
    layer = helpers.TarBuilder().file("a", os.urandom(300_000)).bytes()
    tap = BlobTap()
    feeder = threading.Thread(target=_feed_tap, args=(
        tap, tmp_path / "growing", gzip.compress(layer)[:100_000],
        DigestMismatchError("blob x: downloaded content has digest y")))
    feeder.start()
    with pytest.raises((DigestMismatchError, LayerApplyError)):
        apply_layer(ext4_root, tap, "application/vnd.oci.image.layer.v1.tar+gzip")
    feeder.join()
    tap.close()
