"""Applying layer tarballs onto a loop-mounted ext4, compared with umoci's unpack."""

from __future__ import annotations

import gzip
import io
import os
import subprocess
import tarfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentenv.registry.blobtap import BlobTap
from agentenv.registry.errors import DigestMismatchError, UnsupportedImageError
from agentenv.template.apply import _TarInfo, apply_layer
from agentenv.template.convert import loop_mount
from agentenv.template.errors import LayerApplyError
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


def test_pax_times_kept_to_the_nanosecond(ext4_root: Path, tmp_path: Path) -> None:
    """GNU tar --xattrs and containerd write PAX times with nanoseconds; they are applied
    exactly (a float keeps only ~240 ns of them), as tar -x and umoci do."""
    times = {"d": "-1.5", "d/f": "1796234804.576088959", "d/l": "1600000000.000000001",
             "d/p": "1700000000.999999999"}
    kinds = {"d": tarfile.DIRTYPE, "d/f": tarfile.REGTYPE, "d/l": tarfile.SYMTYPE,
             "d/p": tarfile.FIFOTYPE}
    layer = helpers.TarBuilder()
    for name, when in times.items():
        info = tarfile.TarInfo(name)
        info.type = kinds[name]
        info.mode = 0o755 if name == "d" else 0o644
        info.linkname = "f" if name == "d/l" else ""
        info.size = 1 if name == "d/f" else 0
        info.pax_headers = {"mtime": when, "atime": when}
        layer.tar.addfile(info, io.BytesIO(b"x") if name == "d/f" else None)
    image = helpers.build_image([layer.bytes()], [""])
    [(blob, media_type, diff_id)] = _write_blobs(tmp_path, image)
    apply_layer(ext4_root, blob, media_type, diff_id)
    expected = {"d": -1_500000000, "d/f": 1796234804_576088959, "d/l": 1600000000_000000001,
                "d/p": 1700000000_999999999}
    for name, ns in expected.items():
        st = os.lstat(ext4_root / name)
        assert (st.st_mtime_ns, st.st_atime_ns) == (ns, ns), name


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
             .symlink("up", "../../../..")
             .file("up/escaped2", b"z")
             .bytes())
    blob = tmp_path / "l.tar"
    blob.write_bytes(layer)
    apply_layer(ext4_root, blob, "application/vnd.oci.image.layer.v1.tar")
    assert list(outside.iterdir()) == []
    assert (ext4_root / str(outside).lstrip("/") / "planted").read_bytes() == b"x"
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


def _big_layer() -> bytes:
    """Files larger than the decompression pipeline's blocks and than the size from which the
    applier starts writeback early, next to small ones."""
    t = helpers.TarBuilder().dir("data")
    t.file("data/big", os.urandom(5 << 20) + b"tail", mode=0o755)
    t.file("data/half-zero", bytes(3 << 20) + os.urandom(300_000))
    for i in range(50):
        t.file(f"data/small{i}", os.urandom(i * 97))
    return t.bytes()


@pytest.mark.parametrize("compression", ["gzip", "zstd"])
def test_multi_member_streams_apply_whole(ext4_root: Path, tmp_path: Path, compression: str) -> None:
    # pigz/concatenated gzip members and multi-frame zstd: every member is part of the layer.
    layer = _big_layer()
    cut = len(layer) // 3
    blob = tmp_path / "layer"
    blob.write_bytes(helpers.compress(layer[:cut], compression)
                     + helpers.compress(layer[cut:], compression))
    media_type = f"application/vnd.oci.image.layer.v1.tar+{compression}"
    stats = apply_layer(ext4_root, blob, media_type, helpers.digest_of(layer))
    assert stats.diff_id == helpers.digest_of(layer)
    assert stats.bytes_written == (5 << 20) + 4 + (3 << 20) + 300_000 + sum(i * 97 for i in range(50))
    expected = tmp_path / "expected"
    expected.mkdir()
    subprocess.run(["tar", "-x", "--numeric-owner", "--same-permissions", "-C", str(expected)],
                   input=layer, check=True)
    helpers.assert_same_tree(ext4_root, expected)


def test_trailing_garbage_and_truncation_fail_without_leaving_threads(ext4_root: Path,
                                                                     tmp_path: Path) -> None:
    layer = _big_layer()
    data = gzip.compress(layer, compresslevel=1)
    before = {t.ident for t in threading.enumerate()}
    cases = {"garbage": data + b"not gzip at all", "truncated": data[: len(data) * 2 // 3]}
    for name, content in cases.items():
        blob = tmp_path / name
        blob.write_bytes(content)
        with pytest.raises(LayerApplyError, match="corrupt archive"):
            apply_layer(ext4_root, blob, "application/vnd.oci.image.layer.v1.tar+gzip",
                        helpers.digest_of(layer))
    # A corrupt stream fails when it is read (never as a wrong diff_id); the decompressing
    # worker is gone once apply_layer returns.
    assert {t.ident for t in threading.enumerate()} - before == set()


def test_apply_error_midway_stops_the_pipeline(ext4_root: Path, tmp_path: Path) -> None:
    # A hard link to a missing target fails after the first (big) entries were applied: the
    # worker still decoding the rest of the stream must stop, not run to the end.
    t = helpers.TarBuilder().file("first", os.urandom(2 << 20))
    t.hardlink("broken", "missing")
    for i in range(40):
        t.file(f"after{i}", os.urandom(1 << 20))
    blob = tmp_path / "layer.gz"
    blob.write_bytes(gzip.compress(t.bytes(), compresslevel=1))
    before = {t.ident for t in threading.enumerate()}
    with pytest.raises(LayerApplyError, match="target does not exist"):
        apply_layer(ext4_root, blob, "application/vnd.oci.image.layer.v1.tar+gzip")
    assert {t.ident for t in threading.enumerate()} - before == set()
    assert (ext4_root / "first").stat().st_size == 2 << 20


def _members(data: bytes, tarinfo: type[tarfile.TarInfo]) -> list[tuple[object, ...]]:
    with tarfile.open(fileobj=io.BytesIO(data), mode="r|", tarinfo=tarinfo) as tar:
        return [(m.name, m.mode, m.uid, m.gid, m.size, m.mtime, m.type, m.linkname, m.uname,
                 m.gname, m.devmajor, m.devminor, sorted(m.pax_headers.items()),
                 tar.extractfile(m).read() if m.isreg() else None) for m in tar]  # type: ignore[union-attr]


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.GNU_FORMAT, tarfile.PAX_FORMAT])
def test_quick_header_parser_reads_like_tarfile(fmt: int) -> None:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=fmt) as tar:
        def add(name: str, kind: bytes = tarfile.REGTYPE, data: bytes = b"", **attrs: object) -> None:
            info = tarfile.TarInfo(name)
            info.type, info.size = kind, len(data)
            for key, value in attrs.items():
                setattr(info, key, value)
            tar.addfile(info, io.BytesIO(data))
        add("dir", tarfile.DIRTYPE, mode=0o2755, uid=1000, gid=1000, uname="user", gname="grp")
        add("dir/file", data=b"x" * 1000, mode=0o4755, mtime=1_700_000_000)
        add("usr/" + "deep/" * 25 + "file", data=b"prefix or long name")  # > 100 bytes
        add("dir/link", tarfile.SYMTYPE, linkname="file")
        add("dir/hard", tarfile.LNKTYPE, linkname="dir/file")
        add("dev/sda", tarfile.BLKTYPE, devmajor=8, devminor=1)
        if fmt != tarfile.USTAR_FORMAT:
            add("big-ids", data=b"b", uid=3_000_000, gid=2_100_000)  # base-256 in GNU headers
            add("x" * 150, data=b"long")
        if fmt == tarfile.PAX_FORMAT:
            add("ünïcode näme", data=b"u", mtime=1_700_000_000.25)
    data = buffer.getvalue()
    # An old V7-style directory: a regular file entry whose name ends with a slash.
    v7 = tarfile.TarInfo("olddir/")
    v7.type = tarfile.AREGTYPE
    data = v7.tobuf(tarfile.USTAR_FORMAT) + data
    expected = _members(data, tarfile.TarInfo)
    assert _members(data, _TarInfo) == expected
    assert len(expected) >= 7 and expected[0][6] == tarfile.DIRTYPE
    # A header whose checksum does not fit: the first one is an error, a later one ends the
    # archive for tarfile (the layer's diff_id check then fails); both parsers agree.
    corrupt = bytearray(data)
    corrupt[10] ^= 0x20
    with pytest.raises(tarfile.ReadError, match="bad checksum"):
        _members(bytes(corrupt), _TarInfo)
    corrupt = bytearray(data)
    corrupt[512 + 10] ^= 0x20
    assert _members(bytes(corrupt), _TarInfo) == _members(bytes(corrupt), tarfile.TarInfo)


@pytest.mark.parametrize("compression", ["gzip", ""])
def test_empty_layer(ext4_root: Path, tmp_path: Path, compression: str) -> None:
    # What `ENV`-only build steps produce: an archive with no entries (just its end blocks).
    layer = helpers.TarBuilder().bytes()
    blob = tmp_path / "empty"
    blob.write_bytes(helpers.compress(layer, compression))
    media_type = "application/vnd.oci.image.layer.v1.tar" + ("+gzip" if compression else "")
    stats = apply_layer(ext4_root, blob, media_type, helpers.digest_of(layer))
    assert stats.entries == 0 and stats.diff_id == helpers.digest_of(layer)
    assert sorted(p.name for p in ext4_root.iterdir()) == ["lost+found"]
