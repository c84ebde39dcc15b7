"""Hostile layer tarballs: whiteouts naming `.`, `..` or nothing, names and hard links that
climb out of the root, PAX headers built to choke tarfile's parser; and the host mount of a
layer (nodev, nosuid, noexec)."""

from __future__ import annotations

import io
import subprocess
import tarfile
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentenv.template.apply import apply_layer
from agentenv.template.convert import loop_mount
from agentenv.template.errors import LayerApplyError
from tests.template import helpers
from tests.template.conftest import needs_root

pytestmark = pytest.mark.root
TAR = "application/vnd.oci.image.layer.v1.tar"


@pytest.fixture
def ext4_root(tmp_path: Path) -> Iterator[Path]:
    needs_root()
    disk = tmp_path / "disk.raw"
    with open(disk, "wb") as f:
        f.truncate(64 << 20)
    subprocess.run(["mkfs.ext4", "-F", "-q", str(disk)], check=True)
    with loop_mount(disk, tmp_path / "mnt") as root:
        yield root


def _apply(root: Path, tmp: Path, data: bytes) -> None:
    blob = tmp / "layer.tar"
    blob.write_bytes(data)
    apply_layer(root, blob, TAR)


@pytest.mark.parametrize(("entry", "message"), [
    (".wh...", r"whiteout '\.wh\.\.\.' names no entry \('\.\.'\)"),  # the root's parent
    ("keep/.wh..", r"whiteout 'keep/\.wh\.\.' names no entry \('\.'\)"),  # its own directory
    ("keep/.wh.", r"whiteout 'keep/\.wh\.' names no entry \('empty'\)"),
    ("keep/sub/../../../escaped", "points outside the layer root"),
    ("/../../escaped", "points outside the layer root"),
])
def test_whiteouts_and_names_outside_the_root_are_refused(ext4_root: Path, tmp_path: Path,
                                                          entry: str, message: str) -> None:
    canary = tmp_path / "canary"
    canary.write_text("still here")
    _apply(ext4_root, tmp_path, helpers.TarBuilder().file("keep/file", b"k").bytes())
    with pytest.raises(LayerApplyError, match=message):
        _apply(ext4_root, tmp_path, helpers.TarBuilder().file(entry, b"").bytes())
    assert canary.read_text() == "still here"
    assert (ext4_root / "keep" / "file").read_bytes() == b"k"
    assert not (tmp_path / "escaped").exists()


def test_hard_link_out_of_the_root_is_refused(ext4_root: Path, tmp_path: Path) -> None:
    layer = helpers.TarBuilder().hardlink("passwd", "../../../etc/passwd").bytes()
    with pytest.raises(LayerApplyError, match=r"hard link 'passwd' to '\.\./\.\./\.\./etc/passwd' points outside"):
        _apply(ext4_root, tmp_path, layer)
    assert not (ext4_root / "passwd").exists()


def test_ordinary_whiteouts_still_apply(ext4_root: Path, tmp_path: Path) -> None:
    _apply(ext4_root, tmp_path, helpers.TarBuilder().file("d/a", b"a").file("d/b", b"b")
           .file("e/c", b"c").bytes())
    _apply(ext4_root, tmp_path, helpers.TarBuilder().whiteout("d/a").opaque("e")
           .file("d/.wh..wh.plnk", b"").bytes())
    assert sorted(p.name for p in (ext4_root / "d").iterdir()) == ["b"]
    assert list((ext4_root / "e").iterdir()) == []


def _pax_layer(headers: dict[str, str]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("f")
        info.size = 1
        info.pax_headers = headers
        tar.addfile(info, io.BytesIO(b"x"))
    return buf.getvalue()


@pytest.mark.parametrize(("headers", "message"), [
    # Quadratic in tarfile's regexes before CVE-2024-6232's fix (this interpreter may have it).
    ({"comment": "9" * 300_000}, "run of more than 64 digits"),
    ({"comment": "x" * (2 << 20)}, "PAX header of .* bytes"),
    ({"GNU.sparse.size": "1", "GNU.sparse.numblocks": "0"}, "GNU sparse files"),
])
def test_hostile_pax_headers_fail_fast(ext4_root: Path, tmp_path: Path,
                                       headers: dict[str, str], message: str) -> None:
    started = time.monotonic()
    with pytest.raises(LayerApplyError, match=f"corrupt archive: .*{message}"):
        _apply(ext4_root, tmp_path, _pax_layer(headers))
    assert time.monotonic() - started < 10


def test_normal_pax_headers_still_apply(ext4_root: Path, tmp_path: Path) -> None:
    name = "d/" + "long-name-" * 20 + "/" + "x" * 150
    _apply(ext4_root, tmp_path, _pax_layer({"path": name, "mtime": "1700000000.123456789",
                                            "SCHILY.xattr.user.k": "v"}))
    assert (ext4_root / name).read_bytes() == b"x"


def test_layers_are_mounted_nodev_nosuid_noexec(tmp_path: Path) -> None:
    needs_root()
    disk = tmp_path / "disk.raw"
    with open(disk, "wb") as f:
        f.truncate(16 << 20)
    subprocess.run(["mkfs.ext4", "-F", "-q", str(disk)], check=True)
    for readonly in (False, True):
        with loop_mount(disk, tmp_path / "mnt", readonly=readonly) as root:
            line = next(x for x in Path("/proc/self/mountinfo").read_text().splitlines()
                        if x.split()[4] == str(root))
            options = set(line.split()[5].split(","))
            assert {"nodev", "nosuid", "noexec"} <= options, line
