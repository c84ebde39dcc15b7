"""A shared volume's own file system (node/shared_fs.py): an ext4 image with the volume's
content, owners and modes, loop-mounted as a file system of its own (what ganesha exports: a
forged handle reaches nothing else), full at the volume's size, kept across unmount. Root."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import pytest

from agentenv.node.shared_fs import SharedFilesystem, SharedFsError
from agentenv.node.volumes import fs_bytes

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="needs root (loop mounts)")


def test_a_shared_volume_is_a_file_system_of_its_own(tmp_path: Path) -> None:
    content = tmp_path / "data"
    (content / "sub").mkdir(parents=True)
    (content / "sub" / "f.txt").write_text("hello\n")
    os.chown(content / "sub" / "f.txt", 1000, 1001)
    shared = SharedFilesystem(tmp_path / "shared")
    shared.create(content, fs_bytes(8 << 20), (4321, 4321, 0o750))
    with pytest.raises(SharedFsError, match="exists"):
        shared.create(content, fs_bytes(8 << 20), (0, 0, 0o755))
    root = shared.mount()
    try:
        assert shared.mounted() and shared.mount() == root  # a second mount keeps the first
        assert os.stat(root).st_dev != os.stat(tmp_path).st_dev  # not the state's file system
        st = os.stat(root)
        assert (st.st_uid, st.st_gid, st.st_mode & 0o777) == (4321, 4321, 0o750)
        f = root / "sub" / "f.txt"
        assert f.read_text() == "hello\n" and (os.stat(f).st_uid, os.stat(f).st_gid) == (1000, 1001)
        # Full at about the volume's size (8 MiB plus ext4's own): ENOSPC, nothing around it.
        with pytest.raises(OSError) as full, open(root / "big", "wb") as out:
            for _ in range(256):
                out.write(b"\0" * (1 << 20))
                out.flush()
                os.fsync(out.fileno())
        assert full.value.errno == errno.ENOSPC
        (root / "big").unlink()
        (root / "kept.txt").write_text("kept\n")
    finally:
        shared.unmount()
    assert not shared.mounted()
    assert shared.mount() == root and (root / "kept.txt").read_text() == "kept\n"
    # Busy (the NFS server may still hold a file of a dropped export): detached all the same.
    with open(root / "kept.txt") as held:
        with pytest.raises(SharedFsError, match="umount"):
            shared.unmount()
        shared.remove()
        assert not shared.mounted() and not shared.exists()
        assert held.read() == "kept\n"
