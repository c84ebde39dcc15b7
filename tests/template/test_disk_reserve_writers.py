"""The node's own writers keep the disk reserve while they write, not only before they start.

A pull (or an upload) checked the free space once, up front: writers that each found room
before they started (concurrent pulls, a body longer than announced) could together take the
reserve that running sandboxes' disks need. `fsutil.SpaceGuard` looks again every few MiB;
the writer stops with an error naming the reserve's setting and keeps nothing of what it
wrote. Here on a small tmpfs the test mounts: a registry blob larger than the room above the
reserve stops part-way (the up-front check is what a concurrent writer already passed), and
the directory is left as it was.
"""

from __future__ import annotations

import os
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

from agentenv.fsutil import InsufficientSpace, free_bytes
from agentenv.registry.client import RegistryClient
from agentenv.registry.reference import parse_reference
from tests.template import helpers
from tests.template.conftest import Registry, needs_root

FS_BYTES = 64 << 20
RESERVE = 40 << 20


@pytest.fixture
def small_fs() -> Iterator[Path]:
    """A tmpfs of FS_BYTES, mounted for the test and removed after it."""
    needs_root()
    point = Path(tempfile.mkdtemp(prefix="aenv-smallfs-"))
    subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={FS_BYTES},mode=0700", "tmpfs",
                    str(point)], check=True)
    try:
        yield point
    finally:
        subprocess.run(["umount", "-l", str(point)], check=False)
        point.rmdir()


def test_a_guard_stops_a_writer_at_the_reserve(small_fs: Path) -> None:
    from agentenv.fsutil import SpaceGuard

    guard = SpaceGuard(small_fs, "the test's file", reserve=RESERVE, setting="AENV_TEST_RESERVE",
                       every=1 << 20)
    piece = os.urandom(256 << 10)
    with open(small_fs / "file", "wb") as out, pytest.raises(InsufficientSpace) as raised:
        while True:
            out.write(piece)
            out.flush()
            guard.wrote(len(piece))
    message = str(raised.value)
    assert "AENV_TEST_RESERVE" in message and "the test's file" in message
    # stopped within one check period of the reserve
    assert RESERVE - (1 << 20) - len(piece) <= free_bytes(small_fs) < RESERVE


def test_a_pull_stops_at_the_reserve_and_keeps_nothing(
        small_fs: Path, registry: Registry, no_docker_config: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The blob (40 MiB) fits the filesystem (64 MiB) but not above its reserve (40 MiB):
    the download stops once the reserve is reached, with an error naming AENV_DISK_RESERVE,
    and no partial file stays."""
    monkeypatch.setenv("AENV_DISK_RESERVE", str(RESERVE))
    image = helpers.build_image([os.urandom(40 << 20)], [""])
    helpers.push_image(registry.host, "reserve/big", "v1", image)
    with RegistryClient(registry.host) as client:
        manifest = client.resolve_manifest(parse_reference(f"{registry.host}/reserve/big:v1"))
        layer = manifest.layers[0]
        with pytest.raises(InsufficientSpace, match="AENV_DISK_RESERVE") as raised:
            client.download_blob("reserve/big", layer, small_fs / "blobs" / "layer")
        assert layer.digest in str(raised.value)
        assert list((small_fs / "blobs").iterdir()) == []
        # with room above the reserve the same download goes through
        monkeypatch.setenv("AENV_DISK_RESERVE", str(4 << 20))
        out = client.download_blob("reserve/big", layer, small_fs / "blobs" / "layer")
        assert helpers.digest_of(out.read_bytes()) == layer.digest
