"""envd's volume mounts without a VM (guest/envd/mounts.py): what /init accepts, how a mount in
place is recognised, and when the NFSv4 client is loaded. The mounts themselves are made in
real guests (tests/node/test_volume_mounts.py, tests/runtime/test_nfs_guest.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from agentenv.guest.envd import mounts


def test_an_nfs_mount_is_parsed_and_checked() -> None:
    got = mounts.parse([{"kind": "nfs", "export": "/volumes/abc-1", "path": "/mnt/s/",
                         "readOnly": False},
                        {"serial": "aenv-vol0", "path": "/mnt/d", "readOnly": True}])
    assert got[0] == mounts.VolumeMount("", "/mnt/s", False, "nfs", "/volumes/abc-1")
    assert got[0].source == "169.254.169.254:/volumes/abc-1"
    assert got[1].kind == "disk" and got[1].serial == "aenv-vol0"
    for bad in ({"kind": "nfs", "export": "/etc", "path": "/m", "readOnly": False},
                {"kind": "nfs", "export": "/volumes/../x", "path": "/m", "readOnly": False},
                {"kind": "nfs", "path": "/m", "readOnly": False},
                {"kind": "9p", "serial": "x", "path": "/m", "readOnly": False}):
        with pytest.raises(ValueError):
            mounts.parse([bad])
    assert "vers=4.1" in mounts.NFS_OPTIONS and "addr=169.254.169.254" in mounts.NFS_OPTIONS


def test_an_nfs_mount_in_place_is_recognised(tmp_path: Path) -> None:
    info = tmp_path / "mountinfo"
    info.write_text(
        "22 1 0:21 / / rw - ext4 /dev/vdb rw\n"
        "40 22 0:45 / /mnt/my\\040data rw,nosuid,nodev - nfs4 169.254.169.254:/volumes/v1 "
        "rw,vers=4.1\n"
        "41 22 0:46 / /mnt/other rw - tmpfs tmpfs rw\n")
    assert mounts._nfs_mounted("/mnt/my data", "169.254.169.254:/volumes/v1", str(info))
    assert not mounts._nfs_mounted("/mnt/free", "169.254.169.254:/volumes/v1", str(info))
    with pytest.raises(mounts.MountError, match="another file system"):
        mounts._nfs_mounted("/mnt/other", "169.254.169.254:/volumes/v1", str(info))
    with pytest.raises(mounts.MountError, match="another file system"):
        mounts._nfs_mounted("/mnt/my data", "169.254.169.254:/volumes/v2", str(info))


def test_the_nfs_client_is_loaded_only_when_missing(tmp_path: Path) -> None:
    have = tmp_path / "sys-module-nfsv4"
    have.mkdir()
    lack = tmp_path / "absent"
    # In the kernel already: nothing is read, nothing loaded.
    assert mounts.load_nfs_modules(str(tmp_path / "none.order"), str(have)) == []
    with pytest.raises(mounts.NoNfsClient, match="build it again"):
        mounts.load_nfs_modules(str(tmp_path / "none.order"), str(lack))
